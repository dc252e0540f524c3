"""Pieces every part of the ONNX exporter uses: the errors, the converter
registry, the lazy ``onnx`` import and small name and array helpers."""
import re

import numpy


MIN_OPSET = 13
INT64_MAX = 2 ** 63 - 1
INT64_MIN = -2 ** 63

_INSTALL_HINT = 'pip install chainer-static-graph[onnx]'


class UnsupportedOpError(ValueError):
    """An op the ONNX exporter cannot convert.

    ``kind`` is the op kind, ``source`` the user's file:line that recorded it
    (may be None) and ``detail`` why, when the kind is known but this use of it
    is not supported.
    """

    def __init__(self, kind, source=None, detail=None):
        self.kind = kind
        self.source = source
        self.detail = detail
        msg = 'cannot export op %s to ONNX' % (kind,)
        if source:
            msg += ' (recorded at %s)' % (source,)
        if detail:
            msg += ': %s' % (detail,)
        else:
            msg += ': no ONNX converter for this op kind'
        ValueError.__init__(self, msg)

    def __reduce__(self):
        return (type(self), (self.kind, self.source, self.detail))


def _import_onnx():
    try:
        import onnx
        import onnx.helper
        import onnx.numpy_helper
    except ImportError as e:
        raise ImportError(
            'ONNX export needs the onnx package (%s): %s'
            % (_INSTALL_HINT, e)) from e
    return onnx


# -- converter registry ------------------------------------------------------

# Converters. Each takes (ctx, xs, ys): the ONNX names of the op's inputs and
# of its outputs (which it must produce); ctx.op is the op. The op family
# modules (elementwise, linalg, conv, norm, reduce, shape, indexing)
# register theirs here when the package is imported.
CONVERTERS = {}


def converter(*kinds):
    """Register the decorated function as the converter of ``kinds``."""
    def register(fn):
        for k in kinds:
            CONVERTERS[k] = fn
        return fn
    return register


def supported_kinds():
    """The op kinds the exporter can convert, sorted."""
    return sorted(CONVERTERS)


# -- names -------------------------------------------------------------------

def sanitize_name(name):
    """A readable tensor name: '/l1/W' -> 'l1.W', 'args[0]' -> 'args_0'."""
    s = str(name).strip('/').replace('/', '.')
    s = re.sub(r'[^A-Za-z0-9_.]+', '_', s).strip('_')
    return s


def _root(a):
    while getattr(a, 'base', None) is not None:
        a = a.base
    return a


def _arrays_in(value):
    """The arrays in ``value``: itself, or in its tuples and lists at any
    depth."""
    if hasattr(value, 'shape') and hasattr(value, 'dtype') and \
            hasattr(value, 'base'):
        yield value
    elif type(value) in (tuple, list):
        for v in value:
            yield from _arrays_in(v)


def _address(a):
    ctypes = getattr(a, 'ctypes', None)
    return ctypes.data if ctypes is not None else a.data.ptr


def _as_slices(view, whole):
    """[(start, step)] per axis such that ``whole[start::step]`` slicing
    gives exactly ``view`` (same memory, shape and strides), or None."""
    if view.ndim != whole.ndim or not whole.flags.c_contiguous or \
            view.itemsize != whole.itemsize:
        return None
    offset = _address(view) - _address(whole)
    out = []
    for n, sv, sw, dim in zip(view.shape, view.strides, whole.strides,
                              whole.shape):
        step = 1 if n <= 1 else (sv // sw if sw and sv % sw == 0 else 0)
        if step == 0:
            return None
        start = offset // sw if sw else 0
        start = min(max(start, 0), dim - 1) if dim else 0
        offset -= start * sw
        out.append((start, step))
    if offset != 0:
        return None
    index = tuple(slice(start, start + step * n if start + step * n >= 0
                        else None, step)
                  for (start, step), n in zip(out, view.shape))
    got = whole[index]
    if got.shape != view.shape or _address(got) != _address(view) or any(
            a != b for a, b, n in zip(got.strides, view.strides, view.shape)
            if n > 1):
        return None
    return out


def _to_numpy(a):
    if isinstance(a, numpy.ndarray):
        return a
    get = getattr(a, 'get', None)   # cupy
    if callable(get):
        return numpy.asarray(get())
    return numpy.asarray(a)


def _norm_axis(axis, ndim):
    axis = int(axis)
    if axis < 0:
        axis += ndim
    return axis


def _prod(xs):
    p = 1
    for x in xs:
        p *= int(x)
    return p


# -- dtypes -------------------------------------------------------------------

def _onnx_dtype(onnx, dtype):
    return onnx.helper.np_dtype_to_tensor_dtype(numpy.dtype(dtype))


def float_types_alike(ctx, op, inputs=None):
    """Refuse ``op`` where its inputs (those at ``inputs``, or all) mix
    floating types (a float32 input into float64 weights: Chainer computes
    it, NumPy promoting), which ONNX's operators do not take: the model
    would not be valid."""
    kinds = sorted(set(str(ctx.dtype(op.inputs[i]))
                       for i in (inputs if inputs is not None
                                 else range(len(op.inputs)))
                       if op.inputs[i] is not None and
                       ctx.dtype(op.inputs[i]).kind == 'f'))
    if len(kinds) > 1:
        raise ctx.unsupported(
            'its inputs mix %s, and an ONNX operator takes one floating '
            "type: give the parameters the input's dtype, or cast the "
            'input' % ' and '.join(kinds))
