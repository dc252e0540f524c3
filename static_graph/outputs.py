"""What a method returns: the Variables and arrays in it, and the same
structure rebuilt around each call's own.

``flatten(out)`` gives a spec and the leaves (Variables and arrays) in
order; ``rebuild(spec, leaves)`` makes a new structure of the same kind
around other leaves. Walked are tuples (namedtuples too), lists and dicts
(their subclasses too: an OrderedDict, a defaultdict) and objects that hold
Variables or arrays in their attributes (a ``chainer.distributions.Normal``,
a dataclass, a result object of the user's), objects up to three levels
deep. A rebuilt object is a new instance of the same class, with the
recording's other attributes and this call's Variables; its ``__init__`` is
not run again. Lists, dicts, sets, namespaces and objects of one's own
classes that the call made are made afresh too, Variables or not, with the
contents they had when the recording call returned (a counter or a log the
caller fills is not carried from call to call); those it did not make
(``roots``, ``live_ids``) without Variables in them come back as
themselves. An object that holds Parameters of the chain is made afresh
too, around the same Parameters (the prior of the VAE example returns
``D.Normal(self.loc, scale=self.scale)``, which caches ``log(scale)`` on
itself). Anything else comes back as the recording returned it (a number,
a string, None, the chain itself, a Parameter).

An object that holds Variables or arrays where the walk does not go (in
``__slots__``, more than three objects deep, past 256 attributes, in a
reference cycle) cannot be rebuilt: ``flatten`` raises ``Unrebuildable``
and the call falls back to define-by-run. Never is an object of the
recording handed out again with the recording's Variables in it.
"""
import collections
import copy
import types

import numpy

import chainer

from schedules import ir
from static_graph import arrayutil
from static_graph import reach

_SCALARS = (type(None), bool, int, float, complex, str, bytes,
            numpy.generic, type, types.ModuleType, types.FunctionType,
            types.BuiltinFunctionType, types.MethodType)
_COPIED = (collections.deque, bytearray)   # holding no Variables
_LAZY = (types.CoroutineType, types.AsyncGeneratorType)
MAX_DEPTH = 3       # objects inside objects
MAX_ATTRIBUTES = 256


class Unrebuildable(Exception):
    """The result holds Variables or arrays that replay cannot put back."""


def _is_leaf(obj):
    return isinstance(obj, chainer.Variable) or \
        hasattr(obj, '__array_interface__') or \
        hasattr(obj, '__cuda_array_interface__')


class _Walk(object):
    def __init__(self, live=()):
        # ids of objects the call did not make, or a function giving them
        # (called once, at the first leafless container or object met).
        self._live = live
        self.leaves = []
        self.parameters = 0
        self.attributes = 0
        self.path = []      # ids of the objects being walked (cycles)

    def spec(self, obj, depth=0):
        if isinstance(obj, chainer.Parameter):
            # The chain's own, live: handed out as it is, as define-by-run
            # does (gradients reach it directly); but an object holding one
            # is made afresh (what it caches is per call).
            self.parameters += 1
            return ('K', obj)
        if isinstance(obj, _SCALARS):
            return ('K', obj)
        if _is_leaf(obj):
            self.leaves.append(obj)
            return ('V' if isinstance(obj, chainer.Variable) else 'A',)
        if id(obj) in self.path:
            if self._holds_leaves(obj):
                raise Unrebuildable('it holds Variables or arrays in a '
                                    'reference cycle')
            return ('K', obj)
        self.path.append(id(obj))
        try:
            return self._container(obj, depth)
        finally:
            self.path.pop()

    def _container(self, obj, depth):
        n, m = len(self.leaves), self.parameters
        if isinstance(obj, tuple):
            children = tuple(self.spec(o, depth) for o in obj)
            return ('T', type(obj), children)
        if isinstance(obj, (list, dict, set)):
            if isinstance(obj, dict):
                children = tuple((k, self.spec(v, depth))
                                 for k, v in obj.items())
            else:
                children = tuple(self.spec(o, depth) for o in obj)
            if len(self.leaves) == n and self.parameters == m and \
                    self.is_live(obj):
                return ('K', obj)     # the chain's, a global's: itself
            tag, base = (('L', list) if isinstance(obj, list) else
                         ('D', dict) if isinstance(obj, dict) else
                         ('S', set))
            return (tag, _empty_like(obj, base), children)
        if (hasattr(type(obj), '__next__') or
                isinstance(obj, _LAZY)) and not self.is_live(obj):
            # A generator (the method's own body, when it yields), a map,
            # an iterator of one's own: made by the call, consumed by the
            # caller; replay would hand out the recording call's again.
            raise Unrebuildable('it is a %s, which runs (or is consumed) '
                                'after the call' % type(obj).__name__)
        if isinstance(obj, _COPIED) and not self._holds_leaves(obj) and \
                not self.is_live(obj):
            # (made by the call, no attributes to walk: a copy per call)
            return ('C', copy.copy(obj))
        if arrayutil.is_link(obj) or \
                not hasattr(obj, '__dict__') or depth >= MAX_DEPTH:
            if not arrayutil.is_link(obj):
                self._no_slot_leaves(obj)
            self._no_hidden_leaves(obj, depth)
            return ('K', obj)
        state, children = {}, []
        for name, value in vars(obj).items():
            self.attributes += 1
            if self.attributes > MAX_ATTRIBUTES:
                self._no_hidden_leaves(obj, depth)
                return ('K', obj)
            s = self.spec(value, depth + 1)
            if s[0] == 'K':
                state[name] = value
            else:       # made afresh (a list, a dict, what holds leaves)
                children.append((name, s))
        self._no_slot_leaves(obj)
        if len(self.leaves) == n and self.parameters == m and (
                not _renewable(obj) or self.is_live(obj)):
            return ('K', obj)
        return ('O', type(obj), state, tuple(children))

    def is_live(self, obj):
        if callable(self._live):
            self._live = self._live()
        return id(obj) in self._live

    def _no_hidden_leaves(self, obj, depth):
        if not arrayutil.is_link(obj) and self._holds_leaves(obj):
            raise Unrebuildable(
                'it holds Variables or arrays %s' % (
                    'more than %d objects deep' % MAX_DEPTH
                    if depth >= MAX_DEPTH else
                    'past %d attributes' % MAX_ATTRIBUTES
                    if self.attributes > MAX_ATTRIBUTES else
                    'where its attributes are not a __dict__'))

    def _no_slot_leaves(self, obj):
        for name, value in _slots(obj):
            if self._holds_leaves(value):
                raise Unrebuildable(
                    'it holds Variables or arrays in __slots__ (%s.%s)'
                    % (type(obj).__name__, name))

    def _holds_leaves(self, obj, depth=0, seen=None):
        """Are there Variables or arrays in obj (a bounded search)?"""
        if _is_leaf(obj):
            return True
        if isinstance(obj, _SCALARS) or arrayutil.is_link(obj) or \
                depth > 2 * MAX_DEPTH:
            return False
        seen = set() if seen is None else seen
        if id(obj) in seen:
            return False
        seen.add(id(obj))
        if isinstance(obj, dict):
            items = list(obj.values())
        elif isinstance(obj, (tuple, list, set, frozenset)):
            items = list(obj)
        else:
            items = list(getattr(obj, '__dict__', {}).values())
            items += [v for _, v in _slots(obj)]
        return any(self._holds_leaves(o, depth + 1, seen)
                   for o in items[:MAX_ATTRIBUTES])


def _renewable(obj):
    """Can a new one be made without its ``__init__`` (a namespace, an
    object of a class of one's own without a ``__new__``)?"""
    cls = type(obj)
    return cls is types.SimpleNamespace or (
        cls.__new__ is object.__new__ and not _has_slots(cls))


def _has_slots(cls):
    return any(getattr(c, '__slots__', ()) for c in cls.__mro__)


def roots(snapshot, functions, classes, args, kwargs):
    """What a call reaches that it did not make: its links' attributes
    before the call (``snapshot``), the globals ``functions`` name and the
    attributes of those that are modules their code names (``mod.X``),
    their defaults and closure variables, the classes' attributes, the
    call's arguments."""
    out = [v for _, before, _ in snapshot for v in before.values()]
    _argument_roots(list(args) + list(kwargs.values()), out, LIVE_DEPTH)
    for fn in functions:
        glob = fn.__globals__
        for k in reach.global_names(fn, only_globals=True):
            v = glob.get(k)
            if type(v) is types.ModuleType:
                out.extend(getattr(v, n) for n in reach.global_names(fn)
                           if n in v.__dict__)
            elif v is not None:
                out.append(v)
        out.extend(fn.__defaults__ or ())
        out.extend((fn.__kwdefaults__ or {}).values())
        for c in fn.__closure__ or ():
            try:
                out.append(c.cell_contents)
            except ValueError:     # an empty cell
                pass
    for cls in reach.user_classes(classes):
        out.extend(vars(cls).values())
    return out


def _argument_roots(values, out, depth):
    """The arguments' objects, but in place of their lists, dicts and
    tuples what those hold: a container argument the method returns is
    made afresh at each replay, as a copy of the recording's was (the
    caller's own from the recording call would be handed out again, with
    what the caller has put in it since)."""
    for v in values:
        if isinstance(v, (list, tuple)):
            if depth:
                _argument_roots(v, out, depth - 1)
        elif isinstance(v, dict):
            if depth:
                _argument_roots(list(v.values()), out, depth - 1)
        else:
            out.append(v)


LIVE_DEPTH = 3       # objects inside objects, from a root
LIVE_BUDGET = 4096   # objects walked at most


def live_ids(roots):
    """ids of the objects reachable from ``roots`` (the chain's link
    attributes before a call, the globals, module attributes, defaults and
    closure variables its code names, its classes' attributes, its
    arguments) through containers and object attributes, LIVE_DEPTH deep:
    objects the call did not make, which a result hands out as
    themselves. At most LIVE_BUDGET objects are looked at; a container
    larger than what is left is taken as live without its elements (a
    vocabulary of a million words)."""
    out = set()
    left = LIVE_BUDGET
    level = list(roots)
    for _ in range(LIVE_DEPTH + 1):
        nxt = []
        for v in level:
            left -= 1
            if left < 0:
                return out
            if isinstance(v, _SCALARS) or id(v) in out or _is_leaf(v):
                continue
            out.add(id(v))
            if isinstance(v, dict):
                items = v.values()
            elif isinstance(v, (list, tuple, set, frozenset)):
                items = v
            elif not arrayutil.is_link(v):
                items = getattr(v, '__dict__', {}).values()
            else:
                continue
            if len(items) + len(nxt) <= left:
                nxt.extend(items)
        level = nxt
    return out


def _slots(obj):
    """(name, value) of the ``__slots__`` attributes of obj's classes."""
    for cls in type(obj).__mro__:
        for name in getattr(cls, '__slots__', ()):
            if name not in ('__dict__', '__weakref__'):
                yield name, getattr(obj, name, None)


def _empty_like(obj, base):
    """None for a plain list or dict; else an empty one of obj's class,
    with what its copy keeps (a defaultdict's factory)."""
    if type(obj) is base:
        return None
    empty = copy.copy(obj)
    empty.clear()
    return empty


def flatten(out, live=()):
    """(spec, leaves) of a method's result; ``live``: ids of objects the
    call did not make (``live_ids``), or a function that gives them."""
    w = _Walk(live)
    return w.spec(out), w.leaves


def rebuild(spec, leaves):
    return _build(spec, iter(leaves))


def _build(s, it):
    tag = s[0]
    if tag in ('V', 'A'):
        return next(it)
    if tag == 'K':
        return s[1]
    if tag == 'T':
        cls, items = s[1], [_build(c, it) for c in s[2]]
        if cls is tuple:
            return tuple(items)
        make = getattr(cls, '_make', None)   # a namedtuple
        return make(items) if make is not None else cls(items)
    if tag == 'L':
        items = [_build(c, it) for c in s[2]]
        if s[1] is None:
            return items
        new = copy.copy(s[1])
        new.extend(items)
        return new
    if tag == 'D':
        new = {} if s[1] is None else copy.copy(s[1])
        for k, c in s[2]:
            new[k] = _build(c, it)
        return new
    if tag == 'C':
        return copy.copy(s[1])
    if tag == 'S':
        new = set() if s[1] is None else copy.copy(s[1])
        new.update([_build(c, it) for c in s[2]])
        return new
    cls, state, children = s[1], s[2], s[3]
    new = cls.__new__(cls)
    d = new.__dict__
    d.update(state)
    for name, c in children:
        d[name] = _build(c, it)
    return new


def recorded(rec, out, live):
    """What the method returned, as recording ``rec`` holds it: its spec,
    the inner output Variables, their buffers and kinds ('V' a Variable,
    'A' an array, 'S' a NumPy scalar)."""
    try:
        out_spec, out_leaves = flatten(out, live)
    except Unrebuildable as err:
        rec.add_reason('it returns a %s that replay cannot rebuild: %s'
                       % (type(out).__name__, err))
        # This call hands out what the method returned, as it is.
        out_spec, out_leaves = ('K', out), []
    out_bids, out_kinds, inner_outs = [], [], []
    for o in out_leaves:
        if isinstance(o, chainer.Variable):
            out_kinds.append('V')
            inner_outs.append(o)
            a = o.raw_array
            own = own_attributes(o)
            if own:
                rec.add_reason(
                    'it sets attribute %s on a Variable it returns (an '
                    'intermediate handed out so: ``y.hidden = h``), which '
                    "replay's output Variables would not have"
                    % ', '.join(own))
        else:
            # ('S': a 0-d array standing for the NumPy scalar a NumPy
            # call gave, numpy_calls.py: handed out as that scalar)
            out_kinds.append('S' if id(o) in rec.scalar_like else 'A')
            a = rec.untrace(o, 'the return value')
            inner_outs.append(chainer.Variable(a, requires_grad=False))
        out_bids.append(rec.buffer_of(a, 'the return value'))
    return out_spec, inner_outs, out_bids, out_kinds


def detached(rec, inner_outs, out_bids):
    """(the positions of the returned Variables that need no gradient,
    those of ``leaves``): both handed out without the call's node
    (nodes.detach_outputs)."""
    return (tuple(i for i, v in enumerate(inner_outs)
                  if not v.requires_grad),
            leaves(rec, inner_outs, out_bids))


def leaves(rec, inner_outs, out_bids):
    """The positions of the returned Variables with no graph behind them
    that the call made (``chainer.Variable(h.array)``, a result computed
    under ``no_backprop_mode()``, ``h.unchain_backward()``): define-by-run
    hands them out as leaves, which a caller's backward stops at (a frozen
    feature extractor decorated on its own; until 2026-11-29 replay handed
    them out of its node, and the caller's backward raised there:
    hunt33a). Not an argument or a parameter returned (their memory is
    no result of the call's), which the caller's graph reaches through
    the call."""
    out = []
    for i, (v, b) in enumerate(zip(inner_outs, out_bids)):
        if not v.requires_grad or v.creator is not None:
            continue
        # (``Variable(h.array)``: the traced view user code read, of the
        # result's buffer)
        base = rec.traced_views.get(id(v.raw_array))
        if base is not None:
            b = rec.by_id.get(id(base), b)
        if rec.buffers[b].role == ir.TEMP:
            out.append(i)
    return tuple(out)


# A Variable's own fields: a fresh one's, and those Chainer's Variable
# sets later (``x.array = ...``, ``to_cpu()``, ChainerX's caches).
_VARIABLE_FIELDS = frozenset(vars(chainer.Variable(numpy.zeros(1)))) | \
    frozenset(('_has_chainerx_array', '_chainerx_nobp_array_cache',
               '_chainerx_grad_cache', '_chainerx_fallback_array',
               '_chainerx_name', '_grad_initializer', '_initial_device'))


def own_attributes(v):
    """The attributes set on Variable ``v`` beyond Chainer's own (none
    for a Parameter: the chain's, which keeps what is set on it)."""
    if isinstance(v, chainer.Parameter):
        return []
    return sorted(k for k in vars(v) if k not in _VARIABLE_FIELDS)


def handed(v, kind):
    """What the caller gets for output Variable ``v`` of ``kind``
    (``recorded``)."""
    if kind == 'V':
        return v
    return v.raw_array[()] if kind == 'S' else v.raw_array


def by_inner(inner_outs, outs):
    """id(inner output) -> what the caller gets in its place, and the same
    for their arrays (``self.feat = h.array``: the array handed out with
    h, as define-by-run's attribute is h's)."""
    out = {}
    for v, o in zip(inner_outs, outs):
        out[id(v)] = o
        out.setdefault(id(v.raw_array), o.raw_array)
    return out


def chain_aliases(rec, chain_map, out_bids, out_kinds, attr_writes):
    """Of the buffers a call hands out as arrays (returned, or set on an
    attribute), those that are the chain's memory (``chain_map``), which
    define-by-run hands out as that memory, not a copy: {buffer id: how
    (arrayutil.hand_out)}: False for the chain's array itself (a
    parameter's, a persistent, an array a link holds: the very object),
    ALIAS for a view of one (``self.l.W.array[0]``, also one of all of it:
    ``W.array[...]``; a new view at every call)."""
    bids = [b for b, k in zip(out_bids, out_kinds) if k == 'A'] + \
        [b for _, _, b, kind in attr_writes if kind == 'A']
    out = {}
    for b in bids:
        a = rec.buffers[b].storage
        if a is None or b in out:
            continue
        if id(a) in chain_map:
            out[b] = False
            continue
        base = getattr(a, 'base', None)
        while arrayutil.is_array(base):
            # (The chain's array may be a view itself: parameters packed
            # into one buffer.)
            if id(base) in chain_map:
                out[b] = arrayutil.ALIAS
                break
            base = getattr(base, 'base', None)
    return out


def hand_modes(aliases, out_bids, out_kinds):
    """How the recording call hands out each output (arrayutil.hand_out):
    a copy, or the chain's memory as define-by-run does."""
    return [aliases[b] if b in aliases and k == 'A' else True
            for b, k in zip(out_bids, out_kinds)]
