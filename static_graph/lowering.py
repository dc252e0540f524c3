"""Choose the kernel an op runs at replay.

By default an op replays its own FunctionNode's forward (the generic path:
always the same numbers as define-by-run). ``FAST`` maps an op kind to a
factory that may return a cheaper kernel for the recorded shapes, only where
it computes exactly the same values; the factory returns None otherwise.
"""
import numpy


def _plain_cpu(in_arrays):
    return all(type(a) is numpy.ndarray and a.ndim > 0 for a in in_arrays)


def _scalar_value(node):
    v = getattr(node, 'value', None)
    return v if numpy.isscalar(v) else None


# Element-wise ops whose CPU forward is one NumPy expression (wrapped in
# ``force_array``, a no-op for results with at least one dimension).
def _add(rop, node, xs):
    if _plain_cpu(xs):
        return lambda a: (a[0] + a[1],)


def _mul(rop, node, xs):
    if _plain_cpu(xs):
        return lambda a: (a[0] * a[1],)


def _add_constant(rop, node, xs):
    from chainer.functions.math import basic_math
    if _plain_cpu(xs) and _scalar_value(node) is not None:
        value = basic_math._preprocess_const(xs[0], node.value)
        return lambda a: (a[0] + value,)


def _mul_constant(rop, node, xs):
    from chainer.functions.math import basic_math
    if _plain_cpu(xs) and _scalar_value(node) is not None:
        value = basic_math._preprocess_const(xs[0], node.value)
        return lambda a: (value * a[0],)


def _tanh(rop, node, xs):
    if _plain_cpu(xs):
        tanh = numpy.tanh
        return lambda a: (tanh(a[0]),)


def _tanh_grad(rop, node, xs):
    if _plain_cpu(xs) and getattr(node, 'x', None) is None:
        one = xs[0].dtype.type(1)
        return lambda a: (a[1] * (one - a[0] * a[0]),)


def _plain_conv(node, in_arrays):
    """A convolution the NumPy kernels of schedules.numpy_conv compute
    like Chainer's CPU path: no dilation, cover_all, iDeep or non-standard
    memory layout."""
    return _plain_cpu(in_arrays) and in_arrays[0].ndim == 4 and \
        (node.dy, node.dx) == (1, 1) and not node.cover_all and \
        not getattr(node, '_use_ideep', False) and \
        not getattr(node, 'cudnn_fast', False) and \
        all(lay is None for lay in node._input_layouts or ())


def _convolution_2d(rop, node, xs):
    from schedules import numpy_conv
    if not _plain_conv(node, xs) or xs[1].dtype != xs[0].dtype:
        return None
    sy, sx, ph, pw = node.sy, node.sx, node.ph, node.pw
    g = node.groups
    if g > 1:
        grouped = numpy_conv.conv2d_grouped
        if len(xs) == 2:
            return lambda a: (grouped(a[0], a[1], None, g, sy, sx, ph, pw),)
        return lambda a: (grouped(a[0], a[1], a[2], g, sy, sx, ph, pw),)
    conv2d = numpy_conv.conv2d
    if len(xs) == 2:
        return lambda a: (conv2d(a[0], a[1], None, sy, sx, ph, pw),)
    return lambda a: (conv2d(a[0], a[1], a[2], sy, sx, ph, pw),)


def _convolution_2d_grad_w(rop, node, xs):
    from schedules import numpy_conv
    if not _plain_conv(node, xs) or node.w_layout is not None:
        return None
    args = (node.kh, node.kw, node.sy, node.sx, node.ph, node.pw,
            node.W_dtype)
    if node.groups > 1:
        grouped = numpy_conv.conv2d_grouped_grad_w
        args = (node.groups,) + args
        return lambda a: (grouped(a[0], a[1], *args),)
    grad_w = numpy_conv.conv2d_grad_w
    return lambda a: (grad_w(a[0], a[1], *args),)


def _deconvolution_2d(rop, node, xs):
    from schedules import numpy_conv
    if len(xs) != 2 or not _plain_conv(node, xs) or node.groups != 1 or \
            xs[1].dtype != xs[0].dtype or node.outh is None:
        return None
    args = (node.sy, node.sx, node.ph, node.pw, node.outh, node.outw)
    deconv2d = numpy_conv.deconv2d
    return lambda a: (deconv2d(a[0], a[1], *args),)


FAST = {
    'Deconvolution2DFunction': _deconvolution_2d,
    'Convolution2DFunction': _convolution_2d,
    'Convolution2DGradW': _convolution_2d_grad_w,
    'Add': _add,
    'Mul': _mul,
    'AddConstant': _add_constant,
    'MulConstant': _mul_constant,
    'Tanh': _tanh,
    'TanhGrad': _tanh_grad,
}


def candidate(rop):
    """May ``rop`` get a cheaper kernel (checked later by fast_kernel)?"""
    return rop.kind in FAST and not rop.state and not rop.rebind


def propose(rop, in_arrays):
    """A cheaper kernel for ``rop`` given its recorded inputs (types,
    shapes, attributes), not yet checked; or None. The kernel bypasses the
    node, so ops with hidden state keep their own."""
    if not candidate(rop):
        return None
    kernel = FAST[rop.kind](rop, rop.node, in_arrays)
    if kernel is not None and kernel.__name__ == '<lambda>':
        kernel.__name__ = 'numpy_' + rop.kind   # for printouts
    return kernel


def same_results(kernel, in_arrays, out_arrays):
    """Does ``kernel`` give ``out_arrays`` from ``in_arrays`` bit for bit,
    in the same memory layout (a later reduction's summation order follows
    its input's strides)?"""
    got = kernel(tuple(in_arrays))
    if len(got) != len(out_arrays):
        return False
    for g, want in zip(got, out_arrays):
        if type(g) is not type(want) or g.shape != want.shape or \
                g.dtype != want.dtype or g.strides != want.strides or \
                not numpy.array_equal(g, want):
            return False
    return True


def fast_kernel(rop, in_arrays, out_arrays):
    """A cheaper kernel for ``rop``, checked on the recorded arrays: it
    must reproduce the recorded outputs bit for bit. Or None."""
    kernel = propose(rop, in_arrays)
    if kernel is None or not same_results(kernel, in_arrays, out_arrays):
        return None
    return kernel


def probing(kernel, fast, decided):
    """A kernel that runs ``kernel`` (the node's own) and, on its first
    call, checks ``fast`` against it on that call's arrays; from then on it
    runs whichever was chosen, and ``decided(chosen)`` is told once."""
    chosen = []

    def probe(inputs):
        if chosen:
            return chosen[0](inputs)
        out = kernel(inputs)
        ok = same_results(fast, inputs, out)
        chosen.append(fast if ok else kernel)
        decided(chosen[0])
        return out

    probe.__name__ = 'probe_' + fast.__name__
    return probe
