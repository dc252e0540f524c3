"""Array helpers the recording and replay share: identity of memory
(``root_of``), exact copies that keep a view's strides (``copy_exact``,
``copies_sharing``),
value comparison, and detached copies of what a call hands out."""
import weakref

import numpy

import chainer
from chainer import backend

from schedules import bits
from static_graph import numpy_rules
from static_graph import traced

MISSING = object()


PROXIES = _PROXIES = (weakref.ProxyType, weakref.CallableProxyType)


def dead_proxy(v):
    """A ``weakref.proxy`` whose object is gone: any use of it raises."""
    if type(v) not in _PROXIES:
        return False
    try:
        v.__class__
    except ReferenceError:
        return True
    return False


def is_array(v):
    return isinstance(v, numpy.ndarray) or (
        type(v).__name__ == 'ndarray' and hasattr(v, '__cuda_array_interface__'))


_Link = chainer.Link


def is_link(v):
    """``isinstance(v, chainer.Link)``, read from the type's MRO. Link's
    metaclass is an ``abc.ABCMeta``: its first check of each new type
    (int, bool, set, a Parameter...) walks every Link subclass, 40-900 us
    a type, which the first recording of a process paid some twenty
    times. No class registers as a virtual Link subclass."""
    return _Link in type(v).__mro__


def _byte_range(a):
    """(first byte, one past the last byte) of a NumPy array's elements."""
    lo = hi = a.__array_interface__['data'][0]
    for n, st in zip(a.shape, a.strides):
        if st < 0:
            lo += st * (n - 1)
        else:
            hi += st * (n - 1)
    return lo, hi + a.itemsize


def within(a, b):
    """Does every element of NumPy array ``a`` lie in memory that NumPy
    array ``b``'s elements cover (``b`` one block of memory, ``a`` inside
    its bounds)?"""
    if type(a) is not numpy.ndarray or type(b) is not numpy.ndarray or \
            a.size == 0 or not (b.flags.c_contiguous or b.flags.f_contiguous):
        return False
    (alo, ahi), (blo, bhi) = _byte_range(a), _byte_range(b)
    return blo <= alo and ahi <= bhi


def root_of(a):
    base = getattr(a, 'base', None)
    while base is not None and is_array(base):
        a = base
        base = getattr(a, 'base', None)
    return a


def same_view(a, b):
    """Do arrays ``a`` and ``b`` show the very same memory (address,
    shape, strides, dtype)?"""
    if isinstance(a, numpy.ndarray) and isinstance(b, numpy.ndarray):
        return numpy_rules.same_memory(a, b)
    if a.shape != b.shape or a.dtype != b.dtype or a.strides != b.strides:
        return False
    return getattr(a, 'data', None) is not None and \
        getattr(b, 'data', None) is not None and \
        getattr(a.data, 'ptr', 0) == getattr(b.data, 'ptr', 1)


def write_back(pairs):
    """For each (array, copy) of ``pairs``: the copy's values into the
    array where they differ (and it can be written)."""
    for given, copy in pairs:
        if not getattr(getattr(given, 'flags', None), 'writeable', True):
            continue
        xp = backend.get_array_module(given)
        if not bits.same_bits(given, copy, xp.array_equal):
            copyto_for((given,))(given, copy)


def copyto_for(arrays):
    """``copyto`` of the arrays' module (NumPy's for none)."""
    xp = backend.get_array_module(*arrays) if arrays else numpy
    return xp.copyto


def copy_exact(a):
    """A copy of ``a`` in fresh memory with ``a``'s very strides (a view's
    gaps and a broadcast's zero strides included), so that NumPy's
    reductions over it sum in the same order as over ``a``. Other arrays
    (CuPy) get a copy in ``a``'s memory order."""
    if type(a) is not numpy.ndarray or a.flags.c_contiguous or \
            a.flags.f_contiguous or a.size == 0 or \
            any(s % a.itemsize for s in a.strides):
        return a.copy(order='K')
    lo = sum(s * (n - 1) for s, n in zip(a.strides, a.shape) if s < 0)
    hi = sum(s * (n - 1) for s, n in zip(a.strides, a.shape) if s > 0)
    flat = numpy.empty((hi - lo) // a.itemsize + 1, a.dtype)
    out = numpy.lib.stride_tricks.as_strided(
        flat[-lo // a.itemsize:], a.shape, a.strides)
    numpy.copyto(out, a)
    return out


ALIAS = 'alias'   # (how an output is handed: a view of the chain's memory)


def hand_out(a, how):
    """What the caller gets for array ``a`` of a call: ``how`` True, a
    copy (memory a later call writes again); ALIAS, a new view of the
    chain's memory ``a`` shows (chain_alias); else ``a`` itself (the
    chain's array, ``self.l.W.array``, among others)."""
    if how is True:
        return copy_exact(a)
    if how == ALIAS:
        return chain_alias(a)
    return a


def chain_alias(a):
    """A new plain view of ``a``, a view of the chain's memory (of a
    parameter's array, a persistent, an array a link holds:
    ``self.l.W.array[0]``), as define-by-run makes one at every call: the
    next update or a write in place shows in both."""
    if isinstance(a, traced.TracedArray):
        return traced.plain(a)
    return a.view()


def plain_array(v):
    """A NumPy array of no subclass, or a device (CuPy) array."""
    return type(v) is numpy.ndarray or (
        is_array(v) and not isinstance(v, numpy.ndarray))


def uniform(a):
    """Do all of ``a``'s elements hold one value (floats: the same bits)?
    A uniform array made outside Chainer functions is taken for a
    constant (analysis.classify_unknown)."""
    if a.size <= 1:
        return True
    if isinstance(a, numpy.ndarray):
        # (numpy.asarray: a numpy.matrix stays 2-D through reshape(-1))
        a = numpy.asarray(a)
    flat = a.reshape(-1)    # (CuPy: compared on the device)
    if a.dtype.kind == 'f' and a.dtype.itemsize in (2, 4, 8):
        # By the bits: all NaN (a fill value) is uniform too, and -0.0
        # among 0.0 is not.
        flat = flat.view('u%d' % a.dtype.itemsize)
    return bool((flat == flat[0]).all())


def start_of(a):
    """The address of ``a``'s first element (NumPy or CuPy)."""
    if isinstance(a, numpy.ndarray):
        return a.__array_interface__['data'][0]
    return a.data.ptr


def extent(a):
    """[first, past the last) byte address that ``a`` (NumPy or CuPy)
    shows."""
    s = start_of(a)
    return (s + sum(st * (n - 1) for st, n in zip(a.strides, a.shape)
                    if st < 0),
            s + sum(st * (n - 1) for st, n in zip(a.strides, a.shape)
                    if st > 0) + a.itemsize)


def span(arrays):
    """[first, past the last) byte address that ``arrays`` show together."""
    ends = [extent(a) for a in arrays]
    return min(lo for lo, _ in ends), max(hi for _, hi in ends)


def overlapping(arrays):
    """The positions of ``arrays`` (non-empty, of one memory) in groups
    whose extents overlap, each group in the given order."""
    spans = sorted((extent(a), k) for k, a in enumerate(arrays))
    groups, end = [], None
    for (lo, hi), k in spans:
        if end is None or lo >= end:
            groups.append([])
            end = hi
        groups[-1].append(k)
        end = max(end, hi)
    return [sorted(g) for g in groups]


def copies_sharing(arrays):
    """Copies of arrays of one memory (NumPy's or CuPy's), each with its
    array's strides, in one fresh block where they lie as the arrays lie
    in theirs: what one writes, another that overlaps it shows (a method
    writing into ``x`` that reads ``x[1:]``), and arrays that start at one
    address (``x`` and ``x.T``) still do, so that NumPy chooses the same
    routine for them (``x @ x.T`` of one memory is a symmetric product,
    syrk, not gemm: other last bits)."""
    starts = [start_of(a) for a in arrays]
    lo, hi = span(arrays)
    xp = backend.get_array_module(arrays[0])
    block = xp.empty(hi - lo, numpy.uint8)
    out = []
    for a, start in zip(arrays, starts):
        if xp is numpy:
            c = numpy.ndarray(a.shape, a.dtype, buffer=block,
                              offset=start - lo, strides=a.strides)
        else:
            c = xp.ndarray(a.shape, a.dtype, memptr=block.data + (start - lo),
                           strides=a.strides)
        xp.copyto(c, a)
        out.append(c)
    return out


def changed(before, after):
    if before.shape != after.shape:
        return True
    # Equal values first: one comparison, where equal_nan=True makes four
    # passes and three temporaries (72 against 6 us on 78400 floats, an
    # MLP's batch of 100, compared twice a recording). Only where they
    # differ can NaNs (equal to nothing, themselves included) be what
    # differs.
    if numpy.array_equal(before, after):
        return False
    return before.dtype.kind not in 'fc' or \
        not numpy.array_equal(before, after, equal_nan=True)


def detached_copy(v):
    if isinstance(v, chainer.Variable):
        a = v.raw_array
        return chainer.Variable(
            a if a is None else copy_exact(traced.untraced(a)),
            requires_grad=False)
    if is_array(v):
        return copy_exact(traced.untraced(v))
    return v


def is_scalar_value(v):
    """A number that a forward may compute from the data and hand to the
    backward node it builds (SoftmaxCrossEntropy's ``1 / count`` of valid
    labels), or leave on its node (user_nodes): a NumPy scalar or a Python
    float, tracked by identity and handed from call to call
    (analysis.scalar_state). Not Python ints and bools or NumPy bools:
    those objects are shared (small ints, ``numpy.True_``), so identity
    would not say where one came from."""
    return type(v) is float or numpy_number(v)


def numpy_number(v):
    return isinstance(v, numpy.generic) and not isinstance(v, numpy.bool_)
