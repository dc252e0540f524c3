"""What the recording call leaves on the chain that shows an argument's
memory: the recording runs on copies of the arguments, and define-by-run's
method keeps the caller's arrays (``self.pe = x``, ``numpy.asarray(x)``, a
Variable argument's ``.array``) or views of them (``x[0]``, ``x.T``), also
inside lists, tuples and dicts; link_state.keep_attrs gives the chain those
(docs/faithfulness.md, "What a method may return")."""
from collections import abc

import numpy

import chainer

from static_graph import arrayutil
from static_graph import key_constants
from static_graph import traced

try:
    _byte_bounds = numpy.byte_bounds
except AttributeError:      # (NumPy 2)
    from numpy.lib.array_utils import byte_bounds as _byte_bounds


class _Memory(object):
    """Holds an ``__array_interface__`` for numpy.asarray, and the array
    whose memory it describes (kept alive as the view's base)."""

    def __init__(self, interface, base):
        self.__array_interface__ = interface
        self.base = base


def _pointer(a):
    return a.__array_interface__['data'][0]


def argument_memory(rec, cur):
    """What define-by-run's method holds where the recording call's holds
    ``cur``, an array that shows the memory of an argument's copy (the
    recording runs on copies), or None (a copy is kept, as before): the
    caller's array where ``cur`` is the argument as the method got it (a
    Variable argument's ``.array`` too); where the copy has the caller's
    layout (shape, strides, dtype; on NumPy), a plain view of the
    caller's array where ``cur`` shows all of it as a plain array
    (``numpy.asarray(x)``: the caller's array itself where that is a plain
    ndarray), else the same view of the caller's memory (``x[0]``,
    ``x.T``, ``x[...]``), read-only where ``cur`` is (``x.diagonal()``).
    Another layout (the copy of a caller whose strides are no multiple of
    its item size is contiguous): what the method did to the copy, define-
    by-run may have done to the caller's array as a copy
    (``numpy.ascontiguousarray(x)``)."""
    a = rec.traced_views.get(id(cur))
    if a is not None:
        caller = rec.callers.get(id(a))
        if caller is not None:
            return caller if _same_layout(a, caller) else None
        cur = a     # (what it stands for: numpy.asarray(x), a plain view)
    if type(cur) not in (numpy.ndarray, traced.TracedArray) or not cur.size:
        return None
    low, high = _byte_bounds(cur)
    for a, caller in rec.argument_copies:
        if not isinstance(a, numpy.ndarray) or not a.size:
            continue
        a_low, a_high = _byte_bounds(a)
        if not a_low <= low or not high <= a_high:
            continue
        if not _same_layout(a, caller):
            continue
        if arrayutil.same_view(cur, a) and \
                type(cur) is not traced.TracedArray:
            return caller if type(caller) is numpy.ndarray else \
                caller.view(numpy.ndarray)
        memmap = isinstance(caller, numpy.memmap)
        if type(caller) is not numpy.ndarray and not memmap:
            continue     # (a subclass's views are of its kind: np.matrix)
        return _view_of(caller, cur, _pointer(caller) + _pointer(cur) -
                        _pointer(a), memmap)
    return None


def _view_of(caller, cur, pointer, memmap):
    """A view of ``caller``'s memory laid out as ``cur`` from ``pointer``:
    read-only where either is; of ``cur``'s dtype (built as bytes, then
    viewed as it, so that structured dtypes keep their fields, offsets
    and record type); a memmap with the caller's file where that is one;
    None where it cannot be built (objects in fields)."""
    dtype = cur.dtype
    if dtype.hasobject and dtype.fields is not None:
        return None
    readonly = not cur.flags.writeable or not caller.flags.writeable
    typestr = dtype.str if dtype.hasobject else '|V%d' % dtype.itemsize
    view = numpy.asarray(_Memory(dict(
        version=3, shape=cur.shape, typestr=typestr, strides=cur.strides,
        data=(pointer, readonly)), caller))
    if not dtype.hasobject:
        view = view.view(dtype)
    if memmap:
        view = view.view(numpy.memmap)
        for k in ('_mmap', 'filename', 'offset', 'mode'):
            setattr(view, k, getattr(caller, k, None))
    return view


def _same_layout(copy, caller):
    """Does the recording's copy of an argument lay its elements out as
    the caller's array does, with the same flags NumPy decides a copy by
    (writeable, aligned: ``numpy.require``), so that what NumPy did to the
    copy, a view or the array itself, it does to the caller's?"""
    return isinstance(copy, numpy.ndarray) and \
        isinstance(caller, numpy.ndarray) and \
        caller.shape == copy.shape and caller.strides == copy.strides and \
        caller.dtype == copy.dtype and \
        caller.flags.writeable == copy.flags.writeable and \
        caller.flags.aligned == copy.flags.aligned


def untrace_set_containers(rec):
    """Lists, tuples and dicts the method set as attributes (the key falls
    back: rec.container_writes) hold what define-by-run's would: an
    argument's memory as the caller's (``self.pe = [x[0]]``), a traced
    array as the plain array it shows, four levels down (lists, dicts,
    deques, their subclasses and other mutable sequences and mappings,
    tuples and namedtuples; a Variable the method made over an argument,
    ``Variable(x)``, gets the caller's array)."""
    for d, k in rec.container_writes:
        v = d.get(k)
        new = _untraced(rec, v, 4)
        if new is not v:
            d[k] = new


def untrace_containers(rec, containers):
    """The same for containers the links held before the call whose
    contents it changed (``self.cache['ref'] = x``, ``self.hist.append(
    x[0])``), in place."""
    for c in containers:
        _untraced(rec, c, 4)


# (A plain array, or one user code was handed while recording: key_constants.)
_ARRAYS = (numpy.ndarray, traced.TracedArray, key_constants.KeyConstant)


def _as_define_by_run(rec, a):
    """Array ``a`` as define-by-run's method holds it: an argument's
    memory as the caller's, a traced array as the plain array it shows."""
    mine = argument_memory(rec, a)
    return mine if mine is not None else traced.untraced(a)


def _untraced(rec, v, depth):
    if type(v) in _ARRAYS:
        return _as_define_by_run(rec, v)
    if isinstance(v, chainer.Variable):
        # (A leaf the method made over an argument: ``Variable(x)``.)
        a = v.raw_array
        if v.creator is None and type(a) in _ARRAYS:
            v.array = _as_define_by_run(rec, a)
        return v
    if depth == 0 or isinstance(v, (str, bytes)):
        return v
    if isinstance(v, abc.MutableSequence):      # list, deque, UserList
        for i, x in enumerate(list(v)):
            new = _untraced(rec, x, depth - 1)
            if new is not x:
                v[i] = new
    elif isinstance(v, abc.MutableMapping):     # dict, OrderedDict...
        for key, x in list(v.items()):
            new = _untraced(rec, x, depth - 1)
            if new is not x:
                v[key] = new
    elif isinstance(v, tuple):
        new = [_untraced(rec, x, depth - 1) for x in v]
        if any(x is not y for x, y in zip(new, v)):
            if type(v) is tuple:
                return tuple(new)
            if hasattr(v, '_fields'):       # (a namedtuple)
                return type(v)(*new)
    return v
