"""Lowered kernels for element-wise ops (lowering.py's ``FAST`` table), and
the layout helpers of kernels that write into given memory (``into``, see
schedules/placement.py): each gives its node's CPU result bit for bit, in
the node's memory layout."""
import numpy
from numpy.lib.stride_tricks import as_strided


def plain_cpu(in_arrays):
    return all(type(a) is numpy.ndarray and a.ndim > 0 for a in in_arrays)


def scalar_value(node):
    v = getattr(node, 'value', None)
    return v if numpy.isscalar(v) else None


def with_into(kernel, into):
    """``kernel`` that can also write its result into given memory
    (``into(inputs, outs)``: the placement protocol of
    schedules/placement.py)."""
    kernel.into = into
    return kernel


def dense_view(out, strides):
    """``out``'s memory (a C-contiguous array) with ``strides``, where
    those lay an array of out's shape over exactly that memory (the axes
    of a C-contiguous array in some order); else None."""
    if out is None or not out.flags.c_contiguous:
        return None
    if strides == out.strides:
        return out
    acc = out.itemsize
    for i in sorted(range(out.ndim), key=lambda i: strides[i]):
        if out.shape[i] != 1:
            if strides[i] != acc:
                return None
            acc *= out.shape[i]
    return as_strided(out, out.shape, strides)


def out_like(out, x):
    """``out`` with ``x``'s layout (``dense_view``), where shape and dtype
    agree; else None."""
    if out is None or out.shape != x.shape or out.dtype != x.dtype:
        return None
    return dense_view(out, x.strides)


def elementwise(kernel, write):
    """``kernel`` (one NumPy element-wise result) with an ``into`` that
    computes it with ``write(inputs, out)`` into given memory (out None:
    as ``kernel`` does), laid out as the kernel lays out its result:
    NumPy's choice from the operands' layouts, which ``same_results``
    learns from the recorded result (``kernel.layout``) when it checks the
    kernel. Same values, same layout, so the same sums downstream. (into
    does not call ``kernel``: kernel -> into -> kernel would be a
    reference cycle.)"""
    layout = []

    def into(a, o):
        return write(a, dense_view(o[0], layout[0]) if layout else None),
    kernel.layout = layout
    return with_into(kernel, into)


# Element-wise ops whose CPU forward is one NumPy expression (wrapped in
# ``force_array``, a no-op for results with at least one dimension).
def for_add(rop, node, xs):
    if plain_cpu(xs):
        add = numpy.add
        return elementwise(lambda a: (a[0] + a[1],),
                            lambda a, out: add(a[0], a[1], out=out))


def for_mul(rop, node, xs):
    if plain_cpu(xs):
        multiply = numpy.multiply
        return elementwise(lambda a: (a[0] * a[1],),
                            lambda a, out: multiply(a[0], a[1], out=out))


def for_add_constant(rop, node, xs):
    from chainer.functions.math import basic_math
    if plain_cpu(xs) and scalar_value(node) is not None:
        value = basic_math._preprocess_const(xs[0], node.value)
        add = numpy.add
        return elementwise(lambda a: (a[0] + value,),
                            lambda a, out: add(a[0], value, out=out))


def for_mul_constant(rop, node, xs):
    from chainer.functions.math import basic_math
    if plain_cpu(xs) and scalar_value(node) is not None:
        value = basic_math._preprocess_const(xs[0], node.value)
        multiply = numpy.multiply
        return elementwise(lambda a: (value * a[0],),
                            lambda a, out: multiply(value, a[0], out=out))


def for_tanh(rop, node, xs):
    if plain_cpu(xs):
        tanh = numpy.tanh
        return elementwise(lambda a: (tanh(a[0]),),
                            lambda a, out: tanh(a[0], out=out))


def for_tanh_grad(rop, node, xs):
    if plain_cpu(xs) and getattr(node, 'x', None) is None:
        one = xs[0].dtype.type(1)
        multiply, subtract = numpy.multiply, numpy.subtract

        def write(a, t):
            # The same three operations, each into t (same values: they
            # are element-wise, whatever the layout).
            if t is None or a[0].shape != t.shape or a[0].dtype != t.dtype:
                return a[1] * (one - a[0] * a[0])
            multiply(a[0], a[0], out=t)
            subtract(one, t, out=t)
            return multiply(a[1], t, out=t)
        return elementwise(lambda a: (a[1] * (one - a[0] * a[0]),), write)


def for_relu_grad(rop, node, xs):
    """Chainer's CPU ReLUGrad2: ``gy * (b > 0)``, b the ReLU's output the
    node was built with (the op's second input)."""
    keys = [k for k, _ in rop.rebind]
    if keys == ['b'] and plain_cpu(xs[:2]) and \
            xs[0].shape == xs[1].shape and not ideep_on():
        multiply = numpy.multiply
        return elementwise(lambda a: (a[0] * (a[1] > 0),),
                            lambda a, out: multiply(a[0], a[1] > 0, out=out))


def for_relu(rop, node, xs):
    """Chainer's CPU ReLU: ``numpy.maximum(x, 0, dtype=x.dtype)``."""
    if plain_cpu(xs) and not ideep_on():
        maximum = numpy.maximum
        return elementwise(
            lambda a: (maximum(a[0], 0, dtype=a[0].dtype),),
            lambda a, out: maximum(a[0], 0, dtype=a[0].dtype, out=out))


def ideep_on():
    from chainer.backends import intel64
    return intel64.is_ideep_available() and \
        intel64.should_use_ideep('>=auto')
