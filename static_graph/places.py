"""Places the watch (link_values.Watch) reads as mappings of names to
values, besides dicts: a function's closure cells and default argument
values, the attribute names an object or class has, whether a weak
reference still refers to its object, and what a container too big to
compare by value holds (by identity: Contents). The closure and defaults take
writes too (generators.stand_ins, early_bound.stand_ins)."""
import array
import collections
import gc
from collections import abc
import itertools
import operator
import weakref

import numpy

from static_graph import frozen_values


class Closure(object):
    """A function's closure cells as a mapping (name -> contents)."""

    def __init__(self, names, cells):
        self.cells = dict(zip(names, cells))

    def get(self, k, default=None):
        try:
            return self.cells[k].cell_contents
        except (KeyError, ValueError):   # an empty cell
            return default

    def __setitem__(self, k, v):     # (generators.stand_ins)
        self.cells[k].cell_contents = v


class Defaults(object):
    """A function's default argument values as a mapping (name -> value),
    read from the function at each look (``f.__defaults__`` replaced
    too)."""

    def __init__(self, fn):
        self.fn = fn
        code = fn.__code__
        names = code.co_varnames[:code.co_argcount]
        self.at = dict((k, i - len(names)) for i, k in enumerate(names))
        self.keyword = code.co_varnames[
            code.co_argcount:code.co_argcount + code.co_kwonlyargcount]

    def get(self, k, default=None):
        if k in self.at:
            d = self.fn.__defaults__ or ()
            i = self.at[k]
            return d[i] if -i <= len(d) else default
        return (self.fn.__kwdefaults__ or {}).get(k, default)

    def names(self):
        d = self.fn.__defaults__ or ()
        return [k for k, i in self.at.items() if -i <= len(d)] + \
            sorted(self.fn.__kwdefaults__ or ())

    def __setitem__(self, k, v):     # (early_bound.stand_ins)
        if k in self.at:
            d = list(self.fn.__defaults__)
            d[self.at[k]] = v
            self.fn.__defaults__ = tuple(d)
        else:
            self.fn.__kwdefaults__[k] = v


class Names(object):
    """The attribute names a helper object has now, as a mapping's only
    value (whatever the key)."""

    def __init__(self, fields):
        self.fields = fields

    def get(self, k, default=None):
        return tuple(self.fields)


class ClassNames(Names):
    """How many attributes a class has now (one set on it that shadows a
    base class's adds one), but the one this package sets on a class
    itself (``_static_graph_type_info`` on a FunctionNode class at its
    first recording) and the one ``copy`` and ``pickle`` set on a class
    at its first copy (``__slotnames__``: ``copy.deepcopy(model)``). A
    count, not the names: looked at in every replay's check."""

    def get(self, k, default=None):
        d = self.fields
        return len(d) - (TYPE_INFO in d) - ('__slotnames__' in d)


# What recorder.py sets on a FunctionNode class (its kind, ...).
TYPE_INFO = '_static_graph_type_info'


class Alive(object):
    """Whether a ``weakref.ref`` or proxy still refers to its object, as
    a mapping's only value: the id of that object (of its ``__dict__``,
    for a proxy), or None once it is gone."""
    __slots__ = ('ref',)

    def __init__(self, ref):
        self.ref = ref

    def get(self, k, default=None):
        r = self.ref
        if type(r) is weakref.ref:
            target = r()
            return None if target is None else id(target)
        try:
            return id(r.__dict__)
        except (ReferenceError, AttributeError):
            return None


class Contents(object):
    """What a container too big to compare by value holds (a list, deque,
    set or dict of more than MAX_ITEMS elements, or one holding such: the
    watch compares it by identity), as a mapping's only value: the very
    objects in it (a sequence's or set's items, a mapping's keys and
    values) and in the mutable containers it holds, to ``DEPTH`` levels
    below it (``MAX_NESTED`` of them; any more by their length only).
    An item replaced (``self.feats[i] = h.array``), a full deque or a
    rolling list appended to, a list in a dict appended to, is a change;
    an item replaced by an equal scalar of the same kind (a float
    counter set to what it was), or an equal string, is none, as in a
    smaller container. The items are held (an object's id is another's
    once it is gone), a weak container's by id only; bytearrays,
    array.arrays and memoryviews by their bytes. ``get`` gives this
    object while the contents hold, else None: the replay's check is
    C-level comparisons."""
    __slots__ = ('container', 'parts', 'sized', 'sizes')

    def __init__(self, container):
        self.container = container
        # [(container, how, then, positions, their items)], [container]
        self.parts, self.sized = [], []
        _parts(container, DEPTH, self.parts, self.sized, set())
        self.sizes = tuple(map(len, self.sized))

    def watched(self):
        """Is there anything in the container that can change?"""
        return bool(self.parts or self.sized)

    def forget(self):
        """Let go of what it held (the objects the loop replaced in the
        container: arrays kept alive by a key gone stale, which records
        again anyway): it no longer holds."""
        self.parts = None

    def get(self, k=None, default=None, exact=False):
        """This object while the contents hold, else None; ``exact``:
        by identity only (after a recording call, whose traced arrays
        ``==`` would read)."""
        if self.parts is None:
            return None
        try:
            for part in self.parts:
                if not _hold(exact, *part):
                    return None
            if self.sized and tuple(map(len, self.sized)) != self.sizes:
                return None
        except Exception:       # (a container that no longer tells)
            return None
        return self


DEPTH = 3          # nested containers watched to this depth below one
MAX_NESTED = 64    # nested containers watched by contents; more by length
_WEAK = (weakref.WeakSet, weakref.WeakKeyDictionary,
         weakref.WeakValueDictionary)
_BUFFERS = (bytearray, array.array, memoryview)


def _how(c):
    """How Contents reads container ``c``: 'weak' (ids), 'bytes', 'map'
    (keys and values), 'seq' (items), or None (immutable: a tuple's or
    frozenset's items are its identity's, or one not read)."""
    if isinstance(c, _WEAK):
        return 'weak'
    if isinstance(c, _BUFFERS):
        return 'bytes'
    if isinstance(c, (tuple, frozenset)):
        return None
    if isinstance(c, abc.Mapping) or isinstance(c, frozen_values.VIEWS):
        return 'map'    # (a dict's view: the dict's keys and values)
    if isinstance(c, (abc.MutableSequence, abc.MutableSet)):
        return 'seq'
    return None


def _parts(c, depth, parts, sized, seen):
    """Collect container ``c`` and the containers it holds, ``depth``
    levels down, once each."""
    if id(c) in seen:
        return
    seen.add(id(c))
    how = _how(c)
    if how is not None:
        try:
            then = _now(c, how)
        except Exception:     # (a released memoryview)
            return
        if then is c:
            then = list(c)
        if len(parts) > MAX_NESTED:
            sized.append(c)
            return
        at = tuple(i for i, x in enumerate(then) if _loose(x)) \
            if how in ('seq', 'map') else ()
        if len(at) > len(then) // 4:
            at = None     # (mostly: all by identity)
        parts.append((c, how, then, at,
                      at and tuple(then[i] for i in at)))
    elif not isinstance(c, (tuple, frozenset)):
        return
    if depth == 0 or how in ('weak', 'bytes'):
        return
    for x in list(_mapping(c).values() if how == 'map' else c):
        if frozen_values.is_container(x):
            _parts(x, depth - 1, parts, sized, seen)


def _mapping(c):
    """Mapping ``c``, or the dict a view of one shows (``d.items()``,
    whose tuples are new at every look: review34)."""
    return c.mapping if isinstance(c, frozen_values.VIEWS) else c


def _now(c, how):
    """What container ``c`` holds now (a list: itself)."""
    if how == 'seq':
        return c if type(c) is list else (*c,)
    if how == 'map':
        c = _mapping(c)
        return (*c, *c.values())
    if how == 'bytes':
        return bytes(c)
    if isinstance(c, weakref.WeakSet):
        return tuple(map(id, list(c)))
    return tuple(map(id, itertools.chain.from_iterable(list(c.items()))))


def _loose(x):
    """Could another object be ``==`` to item ``x`` and differ for the
    method: a number of another kind (2 for 2.0, -0.0 for 0.0), a
    container (changed later, unwatched), an array of fewer than two
    elements, an object compared by value? Those are compared by
    identity after ``==``. (An array of two or more elements cannot be
    ``==`` another object, nor one compared by identity; an equal string
    is the same value.)"""
    t = type(x)
    if t is str or t is bytes:
        return False
    if t is numpy.ndarray:
        return x.size < 2
    return t.__eq__ is not object.__eq__


def _hold(exact, c, how, then, at, items):
    """Does container ``c`` hold what it held (``then``: _now's then;
    ``at``: the positions of _loose items, ``items``: those; None where
    they are most)? In C while it holds the very objects: ``==`` (which
    takes identical items for equal without comparing them), then
    identity at ``at``; or identity throughout."""
    now = _now(c, how)
    if how != 'seq' and how != 'map':
        return now == then
    if len(now) != len(then):
        return False
    if at is None or exact:
        if all(map(operator.is_, now, then)):
            return True
    else:
        try:
            if now == then and (not at or all(map(
                    operator.is_, map(now.__getitem__, at), items))):
                return True
        except Exception:     # (arrays compared: an item is another)
            pass
    return _alike(now, then)


def _alike(now, then):
    """Do ``now`` and ``then`` hold the same objects, or equal scalars of
    the same kinds (the slow path, where an item is another object)?"""
    return len(now) == len(then) and all(
        x is y or type(x) is type(y) and isinstance(x, frozen_values.SCALARS)
        and frozen_values._equal(x, y) for x, y in zip(now, then))


class ClassAttributes(object):
    """A class's own attributes as a mapping that takes writes
    (generators.stand_ins puts a stand-in for a generator kept on the
    class, and puts it back)."""

    def __init__(self, cls):
        self.cls = cls

    def get(self, k, default=None):
        return self.cls.__dict__.get(k, default)

    def __setitem__(self, k, v):
        setattr(self.cls, k, v)


def forget_contents(pairs):
    """``Contents.forget`` for those among ``pairs`` (Watch.pairs)."""
    for d, _ in pairs:
        if type(d) is Contents:
            d.forget()


def array_slots(containers, depth=DEPTH):
    """[(container, key, array)]: the NumPy arrays that ``containers`` and
    the mutable containers in them, ``depth`` levels down, hold where an
    item can be set (a list's, a deque's, a dict's or its subclasses':
    OrderedDict, defaultdict; the dict a view shows). A tuple's or a
    set's cannot: not among them."""
    out, seen = [], set()
    for c in containers:
        _slots(c, depth, out, seen)
    return out


def _slots(c, depth, out, seen):
    if id(c) in seen:
        return
    seen.add(id(c))
    if isinstance(c, frozen_values.VIEWS):
        # (the dict the view shows: the only object it refers to)
        c = next((d for d in gc.get_referents(c)
                  if isinstance(d, dict)), None)
    if isinstance(c, dict):
        items = list(c.items())
    elif isinstance(c, (list, collections.deque)):
        items = list(enumerate(list(c)))
    elif isinstance(c, tuple):
        items = [(None, x) for x in c]      # (nested ones only)
    else:
        return
    for k, v in items:
        if type(v) is numpy.ndarray:
            if k is not None:
                out.append((c, k, v))
        elif depth and frozen_values.is_container(v):
            _slots(v, depth - 1, out, seen)
