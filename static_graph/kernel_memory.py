"""How much memory the kernels of lowering.py allocate for their own use
while they run (im2col matrices, copies BLAS needs, NumPy's temporaries),
beyond the results they return: an upper bound in bytes, from the recorded
arrays. ``schedules/placement.py`` reads it as ``fn.workspace``: where a
kernel's workspace is known, placing results in dead memory may hold memory
there up to the schedule's peak less that workspace; where it is not (a
Chainer FunctionNode's own forward), not at all."""

# NumPy's ufunc and reduction buffers, and small arrays (per-channel
# statistics, masks of a row) that no formula below names.
SLACK = 1 << 16


def _col(x, kh, kw, oh, ow, ph, pw):
    """Bytes of the im2col matrix schedules.numpy_conv builds for x, and of
    the padded copy of x it makes first where x has few channels."""
    n, c, h, w = x.shape
    col = n * oh * ow * c * kh * kw * x.itemsize
    if c < 8 and (ph or pw) and (kh, kw) != (1, 1):
        col += n * c * (h + 2 * ph) * (w + 2 * pw) * x.itemsize
    return col


def _unready(arrays):
    """Bytes NumPy's dot copies: operands BLAS cannot take as they are."""
    return sum(a.nbytes for a in arrays
               if not (a.flags.c_contiguous or a.flags.f_contiguous))


def _conv(node, xs):
    from schedules import numpy_conv
    x, W = xs[0], xs[1]
    kh, kw = W.shape[2:]
    oh = numpy_conv.out_size(x.shape[2], kh, node.sy, node.ph)
    ow = numpy_conv.out_size(x.shape[3], kw, node.sx, node.pw)
    return _col(x, kh, kw, oh, ow, node.ph, node.pw) + W.nbytes


def _conv_grad_w(node, xs):
    x, gy = xs[0], xs[1]
    oh, ow = gy.shape[2:]
    return _col(x, node.kh, node.kw, oh, ow, node.ph, node.pw) + \
        2 * gy.nbytes


def _deconv(node, xs):
    x, W = xs[0], xs[1]
    n, _, h, w = x.shape
    gcol = W.size // W.shape[0] * n * h * w * x.itemsize
    return W.nbytes + x.nbytes + gcol


def _linear(node, xs):
    return _unready(xs)


def _zero(node, xs):
    return 0


def _first(k):
    return lambda node, xs: k * xs[0].nbytes


def _relu_grad(node, xs):
    return xs[-1].size      # the mask ``b > 0``, one byte an element


def _embed_id_grad(node, xs):
    # Indices as intp, the mask and its selections, a copy of gy's rows
    # (of a broadcast gy, or selected), the flat indices.
    x, gy = xs[0], xs[1]
    return x.size * 17 + 2 * gy.nbytes + gy.size * 8


BOUNDS = {
    'LinearFunction': _linear,
    'LinearGradData': _linear,
    'LinearGradWeight': _linear,
    'Sum': _zero,
    'Add': _zero,
    'Mul': _zero,
    'AddConstant': _zero,
    'MulConstant': _zero,
    'Tanh': _zero,
    'ReLU': _zero,
    'TanhGrad': _first(2),
    'ReLUGrad2': _relu_grad,
    'Convolution2DFunction': _conv,
    'Convolution2DGradW': _conv_grad_w,
    'Deconvolution2DFunction': _deconv,
    'BatchNormalization': _first(1),
    'FixedBatchNormalization': _zero,
    'BatchNormalizationGrad': _first(2),
    'SoftmaxCrossEntropy': _first(2),
    'EmbedIDGrad': _embed_id_grad,
}


def workspace(kind, node, xs):
    """Upper bound of what the lowered kernel for ``kind`` allocates besides
    its results on inputs like ``xs``; None where unknown."""
    bound = BOUNDS.get(kind)
    if bound is None:
        return None
    return bound(node, xs) + SLACK
