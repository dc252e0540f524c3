"""The Python values on a chain's links that a recording depends on.

A method reads its links' attributes as Python values: ``self.temperature``,
``self.act`` (a function), ``self.hp['scale']``, a convolution's ``pad``.
The recording holds what they were (a MulConstant's value, the function
applied, a shape), so replay is valid only while they still hold. The
entry keeps them, and ``Watch.holds`` compares before every replay:

* scalars (None, bool, numbers, strings, NumPy scalars and dtypes) by value;
* containers (tuple, list, dict, set, frozenset) by value, element by
  element, which sees a list or dict changed in place; a container of more
  than ``MAX_ITEMS`` elements in all (a vocabulary) by identity only;
* anything else (a function, a helper object) by identity: assigning
  another records again, a change inside the object is not seen.

Arrays, Variables and links are ``entry.link_structure``'s; so are the
names Chainer manages on every link (``_params``, ``_children``, hooks).
"""
import numpy

import chainer

SCALARS = (type(None), bool, int, float, complex, str, bytes, numpy.generic,
           numpy.dtype)
_CONTAINERS = (tuple, list, dict, set, frozenset)
MAX_ITEMS = 64

# What Link, Chain and ChainList put in every link's __dict__, the link
# hooks and the device (a new Device object at every ``to_device``, even to
# the same device): checked by entry.link_structure (the parameters' arrays
# and devices, the child links) and entry.link_hooks.
MANAGED = frozenset(
    k for c in (chainer.Link(), chainer.Chain(), chainer.ChainList())
    for k, v in c.__dict__.items() if not isinstance(v, SCALARS)) | \
    frozenset(('_local_link_hooks', '_device'))

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


def _freeze(v, budget):
    """A value of ``v`` that later changes to it do not reach, comparable
    with ==; ``budget``: [elements left]. A tuple of scalars is its own."""
    if isinstance(v, SCALARS):
        return v
    if not isinstance(v, _CONTAINERS):
        return _Same(v)
    budget[0] -= len(v)
    if budget[0] < 0:
        return _TOO_BIG
    t = type(v)
    if isinstance(v, dict):    # OrderedDict, defaultdict too
        items = tuple((_freeze(k, budget), _freeze(x, budget))
                      for k, x in v.items())
    elif isinstance(v, (set, frozenset)):
        items = frozenset(_freeze(x, budget) for x in v)
    else:
        items = tuple(_freeze(x, budget) for x in v)
        if t is tuple and budget[0] >= 0 and \
                all(x is y for x, y in zip(items, v)):
            return v      # immutable all the way down
    return _TOO_BIG if budget[0] < 0 else (t, items)


def freeze(v):
    """``v`` frozen for comparison (see _freeze), or None for a container
    too big to compare by value."""
    frozen = _freeze(v, [MAX_ITEMS])
    return None if frozen is _TOO_BIG else frozen


def same_value(a, b):
    """Do ``a`` and ``b`` hold the same scalars or containers of them?"""
    if not isinstance(a, SCALARS + _CONTAINERS) or type(a) is not type(b):
        return False
    fa, fb = freeze(a), freeze(b)
    try:
        return fa is not None and fb is not None and bool(fa == fb)
    except Exception:
        return False


def _equal(now, then):
    try:
        return bool(now == then)
    except Exception:
        # Values == cannot compare (a Variable where None was recorded):
        # not the recorded value.
        return False


class Watch(object):
    """The links' values as the recording saw them (see the module)."""
    __slots__ = ('pairs', 'values', 'frozen', 'objects')

    def __init__(self, snapshot):
        """``snapshot``: [(link __dict__, copy of it)] before the call."""
        self.pairs, values = [], []
        self.frozen = []     # (dict, name, frozen container, container)
        self.objects = []    # (dict, name, object): compared by identity
        for d, before in snapshot:
            for k, v in before.items():
                if isinstance(v, SCALARS):
                    self.pairs.append((d, k))
                    values.append(v)
                elif k in MANAGED or isinstance(
                        v, (chainer.Link, chainer.Variable)) or \
                        hasattr(v, '__array_interface__') or \
                        hasattr(v, '__cuda_array_interface__'):
                    continue
                elif isinstance(v, _CONTAINERS):
                    frozen = freeze(v)
                    if frozen is None:
                        self.objects.append((d, k, v))
                    else:
                        self.frozen.append((d, k, frozen, v))
                else:
                    self.objects.append((d, k, v))
        self.values = tuple(values)

    def changed_in_place(self):
        """The names of the containers the links still hold but whose
        contents changed since the snapshot (the method appended to a
        list)."""
        return [k for d, k, frozen, v in self.frozen
                if d.get(k) is v and not _equal(freeze(v), frozen)]

    def holds(self):
        """Do the links still hold the recorded values?"""
        for d, k, v in self.objects:
            if d.get(k) is not v:
                return False
        for d, k, frozen, _ in self.frozen:
            v = d.get(k)
            if v is not frozen and not _equal(freeze(v), frozen):
                return False
        now = tuple([d.get(k) for d, k in self.pairs])
        try:
            return now == self.values
        except Exception:
            # One now holds what cannot be compared with ==: a Variable
            # (whose == raises) or an array where None was recorded
            # (recurrent state: StatefulGRU's h). Not the recorded value.
            return all(v is w or type(v) is type(w) and v == w
                       for v, w in zip(now, self.values))
