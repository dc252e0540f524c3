"""Values frozen for comparison: what a watched container held when a call
recorded (``freeze``), and whether it still holds it (``holds``): by
value element by element, by identity for what is no scalar, with the
kinds ``==`` does not see (2.0 for 2, -0.0 for 0.0). Used by the watch of
link_values.py."""
import array
import collections
import functools
import itertools
import math
import types
import weakref

import numpy

import chainer

SCALARS = (type(None), bool, int, float, complex, str, bytes, numpy.generic,
           numpy.dtype)
# Python's other containers: their items by value, as a tuple's, a list's
# or a dict's (a deque a loop appends to or the call pops from, an
# array.array, a ChainMap of settings); a memoryview by its bytes; a
# functools.partial by its function, arguments and keywords (changed in
# place: ``p.keywords['slope'] = 0.3``).
_WEAK = (weakref.WeakValueDictionary, weakref.WeakKeyDictionary)
_MAPPINGS = (dict, collections.UserDict, collections.ChainMap,
             types.MappingProxyType) + _WEAK
# (A dict's keys, values or items view: what the dict holds now.)
VIEWS = (type({}.keys()), type({}.values()), type({}.items()))
_SEQUENCES = (tuple, list, collections.deque, collections.UserList,
              array.array, bytearray) + VIEWS
CONTAINERS = _MAPPINGS + _SEQUENCES + (set, frozenset, memoryview,
                                        weakref.WeakSet, functools.partial)
MAX_ITEMS = 64

_TOO_BIG = object()


class _Same(object):
    """An element of a container compared by identity (a function, a link,
    an array in a list)."""
    __slots__ = ('obj',)

    def __init__(self, obj):
        self.obj = obj

    def __eq__(self, other):
        return type(other) is _Same and other.obj is self.obj

    def __ne__(self, other):
        return not self.__eq__(other)

    def __hash__(self):
        return id(self.obj)

    def __repr__(self):      # (_kind_key: the same for the same object)
        return '_Same(%d)' % id(self.obj)


class _SameVariable(_Same):
    """A Variable that is no Parameter, compared by identity and by its
    array's (``v.array = new``: the recording read the old one)."""
    __slots__ = ('array',)

    def __init__(self, obj):
        self.obj = obj
        self.array = obj.raw_array

    def __eq__(self, other):
        return type(other) is _SameVariable and other.obj is self.obj and \
            other.array is self.array


def variable_array(v):
    """The array of ``v`` where it is a Variable that is no Parameter (its
    array is part of what a recording read), else None."""
    if isinstance(v, chainer.Variable) and \
            not isinstance(v, chainer.Parameter):
        return v.raw_array
    return None


def _freeze(v, budget):
    """A value of ``v`` that later changes to it do not reach, comparable
    with ==; ``budget``: [elements left]. A tuple of scalars is its own."""
    if type(v) in weakref.ProxyTypes:
        return _Same(v)      # (dead or not: ``isinstance`` would ask it)
    if isinstance(v, SCALARS):
        return v
    if not isinstance(v, CONTAINERS):
        if variable_array(v) is not None:
            return _SameVariable(v)
        if type(v) is itertools.count:      # (its next value: its text)
            return (itertools.count, repr(v))
        return _Same(v)
    t = type(v)
    if t is functools.partial or isinstance(v, functools.partial):
        budget[0] -= 1
        return (t, _Same(v.func), _freeze(v.args, budget),
                _freeze(v.keywords, budget))
    if isinstance(v, (memoryview, array.array, bytearray)):
        # Their bytes: numbers compared bit for bit (a NaN is no change).
        try:
            data = bytes(v) if t is bytearray else v.tobytes()
        except ValueError:      # (a released memoryview)
            return _TOO_BIG
        budget[0] -= max(len(data) // 8, 1)
        if budget[0] < 0:
            return _TOO_BIG
        return (t, getattr(v, 'typecode', None), data)
    try:
        budget[0] -= len(v)
    except TypeError:
        return _TOO_BIG
    if budget[0] < 0:
        return _TOO_BIG
    if isinstance(v, _WEAK):
        # (Weakly: the watch must not keep alive what the dict lets go.)
        items = tuple((_weakly(k) if t is weakref.WeakKeyDictionary else
                       _freeze(k, budget),
                       _weakly(x) if t is not weakref.WeakKeyDictionary else
                       _freeze(x, budget)) for k, x in list(v.items()))
    elif isinstance(v, _MAPPINGS):    # OrderedDict, defaultdict too
        items = tuple((_freeze(k, budget), _freeze(x, budget))
                      for k, x in list(v.items()))
        if isinstance(v, collections.ChainMap):
            items = (items, tuple(_Same(m) for m in v.maps))
    elif isinstance(v, weakref.WeakSet):
        items = frozenset(_weakly(x) for x in list(v))
    elif isinstance(v, (set, frozenset)):
        items = frozenset(_freeze(x, budget) for x in v)
    else:
        # (A copy first, in C: a deque another thread appends to.)
        items = tuple(_freeze(x, budget) for x in tuple(v))
        if t is tuple and budget[0] >= 0 and \
                all(x is y for x, y in zip(items, v)):
            return v      # immutable all the way down
        if t is collections.deque:
            items = (v.maxlen, items)
    return _TOO_BIG if budget[0] < 0 else (t, items)


class _Weak(object):
    """An object a weak container holds, compared by identity while it
    lives, without keeping it alive."""
    __slots__ = ('ref', 'key')

    def __init__(self, obj):
        self.ref = weakref.ref(obj)
        self.key = id(obj)

    def __eq__(self, other):
        if type(other) is not _Weak:
            return False
        a = self.ref()
        return a is not None and a is other.ref()

    def __ne__(self, other):
        return not self.__eq__(other)

    def __hash__(self):
        return self.key

    def __repr__(self):
        return '_Weak(%d)' % self.key


def _weakly(x):
    try:
        return _Weak(x)
    except TypeError:       # (not weakly referable: a number, a string)
        return x


def is_container(v):
    """Is ``v`` one of CONTAINERS (not through a weak proxy, which
    ``isinstance`` would ask, dead or not)? Quick for the common
    attributes: the check against the other containers goes through
    ABCMeta for some."""
    t = type(v)
    if t is dict or t is list or t is tuple:
        return True
    return t not in _ATOMS and t not in weakref.ProxyTypes and \
        isinstance(v, CONTAINERS)


# Numbers, strings and arrays: never containers.
_ATOMS = frozenset((type(None), bool, int, float, str, bytes,
                    numpy.ndarray))


def members(v):
    """The objects container ``v`` (one of CONTAINERS) holds: a mapping's
    values (a WeakKeyDictionary's keys), a sequence's or a set's items, a
    partial's arguments; none for the containers of numbers (a memoryview,
    an array.array, a bytearray). A copy, taken in C (another thread may
    append to a deque)."""
    if isinstance(v, weakref.WeakKeyDictionary):
        return list(v.keys())
    if isinstance(v, _MAPPINGS):
        return list(v.values())
    if isinstance(v, functools.partial):
        return list(v.args) + list(v.keywords.values())
    if isinstance(v, (memoryview, array.array, bytearray)):
        return []
    return list(v)


def freeze(v, items=MAX_ITEMS):
    """``v`` frozen for comparison (see _freeze), or None for a container
    of more than ``items`` elements in all."""
    frozen = _freeze(v, [items])
    return None if frozen is _TOO_BIG else frozen


def same_value(a, b):
    """Do ``a`` and ``b`` hold the same scalars or containers of them?"""
    if not isinstance(a, SCALARS + CONTAINERS) or type(a) is not type(b):
        return False
    fa, fb = freeze(a), freeze(b)
    try:
        return fa is not None and fb is not None and bool(fa == fb)
    except Exception:
        return False


def _holds(v, frozen, items=MAX_ITEMS):
    """Does container ``v`` still hold ``frozen`` (freeze's value of it
    then, of at most ``items`` elements; an immutable tuple is its own)?"""
    return v is frozen or _same_objects(v, frozen) or \
        _equal(freeze(v, items), frozen)


def _same_objects(v, frozen):
    """The hot path of ``_holds``: a dict or list of one level (a registry
    of functions, a list of scalars) that holds the very objects it held,
    under the very keys: nothing in it can have changed. Anything else, or
    any other object, goes the long way (an equal number in another
    object: the same value; a container in it: changed inside?)."""
    t = type(v)
    if (t is not dict and t is not list) or type(frozen) is not tuple or \
            len(frozen) != 2 or frozen[0] is not t:
        return False
    then = frozen[1]
    if len(v) != len(then):
        return False
    if t is dict:
        for (k, x), (k0, y) in zip(v.items(), then):
            if k is not k0 or not (
                    x is y or type(y) is _Same and y.obj is x):
                return False
        return True
    for x, y in zip(v, then):
        if not (x is y or type(y) is _Same and y.obj is x):
            return False
    return True


holds = _holds


def _equal(now, then):
    try:
        return bool(now == then) and _same_kinds((now,), (then,))
    except Exception:
        # Values == cannot compare (a Variable where None was recorded):
        # not the recorded value.
        return False


def _same_kinds(now, then):
    """Of values that are ==: the same types too, and zeros of the same
    sign (True == 1 == numpy.bool_(True) and -0.0 == 0.0, but ``~`` and
    numpy.arctan2 tell them apart)."""
    for a, b in zip(now, then):
        t = type(a)
        if t is not type(b):
            return False
        if t is tuple:
            # (at any depth: a frozen list or dict is (type, items), an
            # item of a dict (key, value); 2.0 -> 2 in a config dict)
            if not _same_kinds(a, b):
                return False
        elif t is frozenset:    # (a frozen set: {2} for {2.0}, {-0.0})
            if sorted(map(_kind_key, a)) != sorted(map(_kind_key, b)):
                return False
        elif isinstance(a, (float, numpy.floating)) and a == 0 and \
                math.copysign(1.0, a) != math.copysign(1.0, b):
            return False
        elif isinstance(a, (complex, numpy.complexfloating)) and (
                math.copysign(1.0, a.real) != math.copysign(1.0, b.real) or
                math.copysign(1.0, a.imag) != math.copysign(1.0, b.imag)):
            return False
    return True


def _kind_key(v):
    return type(v).__name__, repr(v)


_NUMBERS = (int, float, complex, numpy.generic)


def _numbers_inside(v):
    """Could a value equal to ``v`` differ from it in a way ``==`` and the
    types of the watched values do not see: a zero (its sign), a tuple
    holding a number at any depth (2.0 for 2, True for 1)?"""
    if type(v) is tuple:
        return any(isinstance(x, _NUMBERS) or
                   type(x) in (tuple, frozenset) and _numbers_inside(x)
                   for x in v)
    if type(v) is frozenset:
        return any(isinstance(x, _NUMBERS) for x in v)
    return isinstance(v, (complex, numpy.complexfloating)) or \
        isinstance(v, (float, numpy.inexact)) and v == 0
