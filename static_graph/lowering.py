"""Choose the kernel an op runs at replay.

By default an op replays its own FunctionNode's forward (the generic path:
always the same numbers as define-by-run). ``FAST`` maps an op kind to a
factory that may return a cheaper kernel for the recorded shapes, only where
it computes exactly the same values; the factory returns None otherwise.
``DONATING`` does the same for kernels that write into an input dying with
the op, ``STATEFUL`` for ops with hidden state (their kernels return it).
When they are used is lower_pass.py's business; how a kernel is checked
is kernel_checks.py's; element-wise kernels are in elementwise_kernels.py.
"""
import numpy

from static_graph import elementwise_kernels as ew
from static_graph import kernel_memory
from static_graph import lstm_kernels
from static_graph import split_kernels
from static_graph import stream_tasks
from static_graph.elementwise_kernels import out_like
from static_graph.elementwise_kernels import plain_cpu as _plain_cpu
from static_graph.elementwise_kernels import with_into as _with_into


def _plain_conv(node, in_arrays):
    """A convolution the NumPy kernels of schedules.numpy_conv compute
    like Chainer's CPU path: no dilation, cover_all, iDeep or non-standard
    memory layout."""
    return _plain_cpu(in_arrays) and in_arrays[0].ndim == 4 and \
        (node.dy, node.dx) == (1, 1) and not node.cover_all and \
        not getattr(node, '_use_ideep', False) and \
        not getattr(node, 'cudnn_fast', False) and \
        all(lay is None for lay in node._input_layouts or ())


def _same_col_layout(node, x, kh, kw, oh, ow):
    """Does Chainer hand BLAS the im2col matrix in the C-contiguous layout
    schedules.numpy_conv builds? (Not where NumPy's reshape returns a view:
    a batch of one, say.) Same layout, same call, same bits."""
    from schedules import numpy_conv
    n, c = x.shape[:2]
    return numpy_conv.matches_tensordot(n, c, kh, kw, oh, ow, node.groups)


def _batch_ranges(threads, x, col_elements):
    """A ``parallel.Ranges`` over x's batch for a convolution whose im2col
    (or col2im) array has ``col_elements`` elements, where it may be split
    across threads; else None."""
    from schedules import parallel
    threads = split_kernels.threads_of(threads)
    if threads < 2 or x.shape[0] < threads or \
            col_elements < split_kernels.MIN_ELEMENTS:
        return None
    return parallel.Ranges(threads, x.shape[0])


def _convolution_2d(rop, node, xs, threads=1):
    from schedules import numpy_conv
    if not _plain_conv(node, xs) or xs[1].dtype != xs[0].dtype:
        return None
    sy, sx, ph, pw = node.sy, node.sx, node.ph, node.pw
    kh, kw = xs[1].shape[2:]
    oh = numpy_conv.out_size(xs[0].shape[2], kh, sy, ph)
    ow = numpy_conv.out_size(xs[0].shape[3], kw, sx, pw)
    if not _same_col_layout(node, xs[0], kh, kw, oh, ow):
        return None
    g = node.groups
    if g > 1:
        grouped = numpy_conv.conv2d_grouped
        if len(xs) == 2:
            return lambda a: (grouped(a[0], a[1], None, g, sy, sx, ph, pw),)
        return lambda a: (grouped(a[0], a[1], a[2], g, sy, sx, ph, pw),)
    conv2d = numpy_conv.conv2d
    n, c = xs[0].shape[:2]
    r = _batch_ranges(threads, xs[0], n * c * kh * kw * oh * ow)

    def into(a, o):
        return conv2d(a[0], a[1], a[2] if len(a) > 2 else None,
                      sy, sx, ph, pw, out=o[0], ranges=r),
    if len(xs) == 2:
        return _with_into(
            lambda a: (conv2d(a[0], a[1], None, sy, sx, ph, pw, ranges=r),),
            into)
    return _with_into(
        lambda a: (conv2d(a[0], a[1], a[2], sy, sx, ph, pw, ranges=r),),
        into)


def _convolution_2d_grad_w(rop, node, xs, threads=1):
    from schedules import numpy_conv
    if not _plain_conv(node, xs) or node.w_layout is not None or \
            not _same_col_layout(node, xs[0], node.kh, node.kw,
                                 *xs[1].shape[2:]):
        return None
    args = (node.kh, node.kw, node.sy, node.sx, node.ph, node.pw,
            node.W_dtype)
    if node.groups > 1:
        grouped = numpy_conv.conv2d_grouped_grad_w
        args = (node.groups,) + args
        return lambda a: (grouped(a[0], a[1], *args),)
    grad_w = numpy_conv.conv2d_grad_w
    n, c = xs[0].shape[:2]
    r = _batch_ranges(threads, xs[0],
                      n * c * node.kh * node.kw * xs[1].shape[2] *
                      xs[1].shape[3])
    return lambda a: (grad_w(a[0], a[1], *args, ranges=r),)


def _deconvolution_2d(rop, node, xs, threads=1):
    from schedules import numpy_conv
    if len(xs) != 2 or not _plain_conv(node, xs) or node.groups != 1 or \
            xs[1].dtype != xs[0].dtype or node.outh is None:
        return None
    args = (node.sy, node.sx, node.ph, node.pw, node.outh, node.outw)
    deconv2d = numpy_conv.deconv2d
    # (its col2im array: W's in-channels, kh, kw and x's N, h, w)
    r = _batch_ranges(threads, xs[0], xs[0].shape[0] * xs[0].shape[2] *
                      xs[0].shape[3] * xs[1][0].size)
    kernel = lambda a: (deconv2d(a[0], a[1], *args, ranges=r),)  # NOQA
    if not numpy_conv.deconv_fills(xs[1].shape[2:], *args[:4]) or \
            tuple(xs[0].shape[2:]) != args[4:]:
        return kernel    # its result is a view into a padded array

    def into(a, o):
        return deconv2d(a[0], a[1], *args, out=o[0], ranges=r),
    return _with_into(kernel, into)


def _blas_ready(a):
    """Chainer copies a non-contiguous operand with a unit axis before its
    dot (chainer issue 2744); the kernels below call dot on it as is."""
    return a.flags.c_contiguous or a.flags.f_contiguous or 1 not in a.shape


# Linear's forward and its gradients: Chainer's own BLAS calls on the same
# operands (the same summation order), without its per-call checks and the
# copy of the product into a preallocated result.
def _linear(rop, node, xs):
    if not _plain_cpu(xs) or xs[0].ndim != 2 or \
            len(set(a.dtype for a in xs)) != 1 or not _blas_ready(xs[0]):
        return None
    dot, empty = numpy.dot, numpy.empty
    n_out = xs[1].shape[0]
    if len(xs) == 2:
        def kernel(a):
            y = empty((a[0].shape[0], n_out), a[0].dtype)
            dot(a[0], a[1].T, out=y)
            return y,
    else:
        def kernel(a):
            y = empty((a[0].shape[0], n_out), a[0].dtype)
            dot(a[0], a[1].T, out=y)
            y += a[2]
            return y,

    def into(a, o):
        y = o[0]
        if y is None:
            y = empty((a[0].shape[0], n_out), a[0].dtype)
        dot(a[0], a[1].T, out=y)
        if len(a) > 2:
            y += a[2]
        return y,
    kernel = _same_code(_with_into(kernel, into))
    kernel.stream_task = stream_tasks.linear
    return kernel


def _linear_grad_data(rop, node, xs):
    if _plain_cpu(xs) and xs[0].dtype == xs[1].dtype and _blas_ready(xs[1]):
        dot = numpy.dot

        def into(a, o):
            # (dot writes a C-contiguous result of its operands' dtype
            # either way: the same BLAS call)
            if o[0] is None or o[0].dtype != a[1].dtype:
                return a[1].dot(a[0]),
            return dot(a[1], a[0], out=o[0]),
        kernel = _same_code(_with_into(lambda a: (a[1].dot(a[0]),), into))
        kernel.stream_task = stream_tasks.grad_data
        return kernel


def _linear_grad_weight(rop, node, xs):
    if _plain_cpu(xs) and xs[0].dtype == xs[1].dtype == node._w_dtype and \
            _blas_ready(xs[1]):
        kernel = _same_code(lambda a: (a[1].T.dot(a[0]),))
        kernel.stream_task = stream_tasks.grad_weight
        return kernel


def _same_code(kernel):
    """``kernel`` computes its result with the very expression of the
    node's own forward on the same arrays (Chainer's LinearFunction, its
    operands of one dtype: ``y = empty(...)``, ``dot(x, W.T, out=y)``,
    ``y += b``; LinearGradData: ``gy.dot(W).astype(gy.dtype, copy=False)``,
    LinearGradWeight: ``gy.T.dot(x).astype(w_dtype, copy=False)``; the
    casts are no-ops under the conditions checked here, and the copy
    Chainer makes of a strided x or gy with a unit axis is excluded by
    ``_blas_ready``): the same
    result by construction, so nothing runs it twice to compare
    (lower_pass.lower). Its ``into`` is still checked at first use."""
    kernel.same_code = True
    return kernel


# Rows below which Chainer's own loop costs no more than one add.at.
_EMBED_LOOP_ROWS = 64


def _embed_id_grad(rop, node, xs):
    """Chainer's CPU EmbedIDGrad adds gy's rows into gW one by one in a
    Python loop (``gW[ix] += igy``, skipping ``ignore_label``).
    ``numpy.add.at`` over gW's elements (flat indices ``ix * n + j``, row
    after row) makes the very same additions: each element gets the same
    operands in the same order (``gW + gy``, by rows), in one call."""
    if not _plain_cpu(xs) or len(xs) != 2:
        return None
    x, gy = xs
    w_shape, ignore = tuple(node.w_shape), node.ignore_label
    if x.size < _EMBED_LOOP_ROWS or len(w_shape) != 2 or \
            x.dtype.kind not in 'iu' or \
            gy.size != x.size * w_shape[1] or \
            gy.shape[:x.ndim] != x.shape:
        return None
    n = w_shape[1]
    cols = numpy.arange(n, dtype=numpy.intp)
    zeros, add_at = numpy.zeros, numpy.add.at

    def kernel(a):
        x, gy = a
        gW = zeros(w_shape, dtype=gy.dtype)
        ix = x.reshape(-1).astype(numpy.intp)
        rows = gy.reshape(x.size, n)
        if ignore is not None:
            keep = ix != ignore
            ix, rows = ix[keep], rows[keep]
        add_at(gW.reshape(-1), (ix[:, None] * n + cols).reshape(-1),
               rows.reshape(-1))
        return gW,
    return kernel


def _sum(rop, node, xs):
    if _plain_cpu(xs):
        axis, keepdims, asarray = node.axis, node.keepdims, numpy.asarray
        return lambda a: (asarray(a[0].sum(axis=axis, keepdims=keepdims)),)


# Their kernels, where proposed, are the nodes' own expressions.
for _factory in (_linear, _linear_grad_data, _linear_grad_weight):
    _factory.same_code = True
del _factory

# Of these, kinds whose factory takes a node built with arrays (inputs
# after the node's own, ``rop.rebind``).
REBINDING = frozenset(('ReLUGrad2',))

FAST = {
    'ReLU': ew.for_relu,
    'ReLUGrad2': ew.for_relu_grad,
    'LinearFunction': _linear,
    'LinearGradData': _linear_grad_data,
    'LinearGradWeight': _linear_grad_weight,
    'Sum': _sum,
    'EmbedIDGrad': _embed_id_grad,
    'Deconvolution2DFunction': _deconvolution_2d,
    'Convolution2DFunction': _convolution_2d,
    'Convolution2DGradW': _convolution_2d_grad_w,
    'Add': ew.for_add,
    'Mul': ew.for_mul,
    'AddConstant': ew.for_add_constant,
    'MulConstant': ew.for_mul_constant,
    'Tanh': ew.for_tanh,
    'TanhGrad': ew.for_tanh_grad,
    'LSTM': lstm_kernels.for_lstm,
    'LSTMGrad': lstm_kernels.for_lstm_grad,
}


# FAST factories that take the threads a kernel may split its batch across
# (numpy_conv's im2col taps and col2im sums).
for _factory in (_convolution_2d, _convolution_2d_grad_w, _deconvolution_2d):
    _factory.batch_split = True
del _factory


# Kernels that write their result into an input that dies with the op
# (lower_pass.donations): factory(rop, node, inputs, donated) where inputs
# are all the op's inputs (the node's, then the arrays it was built with).
# Each says which input its results may be (``aliases``, placement.py).
def _aliasing(kernel, *aliases):
    kernel.aliases = aliases
    return kernel


def _relu_inplace(rop, node, xs, donated):
    if donated[0] and _plain_cpu(xs[:1]):
        maximum = numpy.maximum
        return _aliasing(
            lambda a: (maximum(a[0], 0, dtype=a[0].dtype, out=a[0]),), 0)


def _relu_grad_inplace(rop, node, xs, donated):
    keys = [k for k, _ in rop.rebind]
    if donated[0] and keys == ['b'] and _plain_cpu(xs[:2]) and \
            xs[0].shape == xs[1].shape:
        multiply = numpy.multiply
        return _aliasing(lambda a: (multiply(a[0], a[1] > 0, out=a[0]),), 0)


def _add_inplace(rop, node, xs, donated):
    if not _plain_cpu(xs) or xs[0].dtype != xs[1].dtype:
        return None
    add = numpy.add
    shape = numpy.broadcast(xs[0], xs[1]).shape
    if donated[0] and xs[0].shape == shape:
        return _aliasing(lambda a: (add(a[0], a[1], out=a[0]),), 0)
    if donated[1] and xs[1].shape == shape:
        return _aliasing(lambda a: (add(a[0], a[1], out=a[1]),), 1)


def _bn_grad_inplace(rop, node, xs, donated):
    from chainer.functions.normalization import batch_normalization as bn
    keys = [k for k, _ in rop.rebind]
    if not donated[0] or 'mean' not in keys or 'inv_std' not in keys or \
            type(getattr(node, '_impl', None)) is not \
            bn.GeneralBatchNormalizationImpl or not _plain_cpu(xs):
        return None
    x, gamma = xs[0], xs[1]
    if not x.dtype == gamma.dtype == xs[2].dtype:
        return None
    im, ii = 3 + keys.index('mean'), 3 + keys.index('inv_std')
    expander, axis = node.expander, node.axis

    def kernel(a):
        return _bn_grad_in_x(a[0], a[1], a[2], a[im], a[ii], expander, axis)

    return _aliasing(kernel, 0, None, None)


def _bn_grad_in_x(x, gamma, gy, mean, inv_std, expander, axis):
    """Chainer's CPU BatchNormalizationGrad, step for step, with x_hat
    computed in x's memory (x dies here), and gx too where gy has x's
    layout. Otherwise (x a view in another order: a convolution's output
    is NHWC memory) gx gets the layout NumPy gives Chainer's ``gy - ...``,
    so that later reductions over it sum in the same order."""
    x_hat = numpy.subtract(x, mean[expander], out=x)
    x_hat *= inv_std[expander]
    gbeta = gy.sum(axis=axis, dtype=gamma.dtype)
    ggamma = (gy * x_hat).sum(axis=axis, dtype=gamma.dtype)
    inv_m = gamma.dtype.type(1. / (x.size // gamma.size))
    t = x_hat
    t *= ggamma[expander]
    t += gbeta[expander]
    t *= inv_m
    if gy.strides == t.strides:
        gx = numpy.subtract(gy, t, out=t)
    else:
        gx = numpy.subtract(gy, t)
    # (its operands in Chainer's order: where both are NaN, NumPy's loops
    # keep one operand's payload; hunt33c)
    numpy.multiply((gamma * inv_std)[expander], gx, out=gx)
    return gx, ggamma, gbeta


DONATING = {
    'ReLU': _relu_inplace,
    'ReLUGrad2': _relu_grad_inplace,
    'Add': _add_inplace,
    'BatchNormalizationGrad': _bn_grad_inplace,
}


# Kernels for ops with hidden state: factory(rop, node, inputs, donated)
# -> kernel returning the node's results, then the state arrays it would
# keep (in rop.state's order). ``kernel.effects`` names the node's arrays
# it updates in place, as the node does (BatchNormalization's running
# statistics): the first-replay check compares those too.
def generic_bn_cpu(node, xs):
    """Chainer's generic CPU BatchNormalization path, all in one dtype (so
    its final ``astype`` is a plain copy) and nothing iDeep could take?"""
    from chainer.backends import intel64
    if not _plain_cpu(xs) or intel64.is_ideep_available() or \
            any(lay is not None for lay in node._input_layouts or ()):
        return False
    x = xs[0]
    return all(a.dtype == x.dtype for a in xs) and \
        not all(x.shape[i] == 1 for i in node.axis)   # Chainer warns


def bn_normalize(x, mean, inv_std, gamma, beta, out):
    """Chainer's ``_apply_bn_fwd`` on the CPU, in one buffer (``out``: x's
    own memory where x dies here, else None for a new array): the same
    operations on the same operands, without the temporaries and the
    closing copy."""
    y = numpy.subtract(x, mean, out=out)
    y *= inv_std
    numpy.multiply(y, gamma, out=y)
    y += beta
    return y


def _bn_forward(rop, node, xs, donated):
    from chainer.functions.normalization import batch_normalization as bn
    keys = tuple(k for k, _ in rop.state)
    if len(xs) != 3 or type(getattr(node, '_impl', None)) is not \
            bn.GeneralBatchNormalizationImpl or \
            not set(keys) <= {'mean', 'var', 'inv_std'} or \
            not generic_bn_cpu(node, xs):
        return None
    d = node.__dict__
    effects = tuple(k for k in ('running_mean', 'running_var')
                    if d.get(k) is not None)
    if len(effects) == 1 or any(type(d[k]) is not numpy.ndarray
                                for k in effects):
        return None
    x = xs[0]
    dtype, axis, expander, eps = x.dtype, node.axis, node.expander, node.eps
    decay = node.decay
    m = x.size // xs[1].size
    adjust = m / max(m - 1., 1.)
    inplace = bool(donated) and donated[0]

    def run(a, out):
        x, gamma, beta = a
        mean = x.mean(axis=axis, dtype=dtype)
        var = x.var(axis=axis, dtype=dtype)
        inv_std = numpy.reciprocal(numpy.sqrt(var + eps, dtype=dtype))
        y = bn_normalize(x, mean[expander], inv_std[expander],
                          gamma[expander], beta[expander],
                          x if inplace else out)
        if effects:
            running_mean, running_var = d['running_mean'], d['running_var']
            running_mean *= decay
            running_mean += (1 - decay) * mean
            running_var *= decay
            running_var += (1 - decay) * adjust * var
        state = {'mean': mean, 'var': var, 'inv_std': inv_std}
        return (y,) + tuple([state[k] for k in keys])

    def kernel(a):
        return run(a, None)

    kernel.effects = effects
    kernel.__name__ = 'numpy_%sBatchNormalization' % (
        'inplace_' if inplace else '')
    if inplace:
        kernel.aliases = (0,) + (None,) * len(keys)
    else:
        # y into given memory, in x's layout (as NumPy lays out x - mean)
        kernel.into = lambda a, o: run(a, out_like(o[0], a[0]))
    return kernel


def _fixed_bn_forward(rop, node, xs, donated):
    keys = tuple(k for k, _ in rop.state)
    if len(xs) != 5 or not set(keys) <= {'inv_var', 'inv_std'} or \
            not generic_bn_cpu(node, xs):
        return None
    expander, eps = node.expander, node.eps
    inplace = bool(donated) and donated[0]

    def kernel(a):
        x, gamma, beta, mean, var = a
        inv_var = numpy.reciprocal(var + eps)
        inv_std = numpy.sqrt(inv_var, dtype=inv_var.dtype)
        y = bn_normalize(x, mean[expander], inv_std[expander],
                          gamma[expander], beta[expander],
                          x if inplace else None)
        state = {'inv_var': inv_var, 'inv_std': inv_std}
        return (y,) + tuple([state[k] for k in keys])

    kernel.effects = ()
    kernel.__name__ = 'numpy_%sFixedBatchNormalization' % (
        'inplace_' if inplace else '')
    if inplace:
        kernel.aliases = (0,) + (None,) * len(keys)
    return kernel


def _softmax_cross_entropy(rop, node, xs, donated):
    """F.softmax_cross_entropy on a batch of class scores with integer
    labels, mean over the valid ones: the operations of Chainer's CPU
    forward (log-softmax, kept scores, label picks, the promoted sum)
    without its per-call checks. Its state: the scores ``y`` the gradient
    node takes and the ``_coeff`` it multiplies by."""
    import chainer
    from chainer.functions.loss import softmax_cross_entropy as sce
    keys = tuple(k for k, _ in rop.state)
    if len(xs) != 2 or not _plain_cpu(xs) or xs[0].ndim != 2 or \
            xs[1].ndim != 1 or xs[0].dtype.kind != 'f' or \
            xs[1].dtype.kind != 'i' or not set(keys) <= {'y', '_coeff'} or \
            node.class_weight is not None or node.reduce != 'mean' or \
            not node.normalize or not node.cache_score or chainer.is_debug():
        return None
    ignore = node.ignore_label
    reduce_dtype = sce._reduction_dtype(xs[0].dtype)
    np = numpy

    def kernel(a):
        x, t = a
        m = x.max(axis=1, keepdims=True)
        e = x - m
        np.exp(e, out=e)
        s = e.sum(axis=1, keepdims=True)
        np.log(s, out=s)
        m += s
        log_y = x - m
        y = np.exp(log_y)
        t_valid = t != ignore
        t = t * t_valid
        log_p = log_y.T[t, np.arange(t.size)]
        log_p *= t_valid
        coeff = 1.0 / max(t_valid.sum(), 1)
        loss = log_p.sum(keepdims=True, dtype=reduce_dtype) * (-coeff)
        state = {'y': y, '_coeff': coeff}
        return (loss.astype(x.dtype, copy=False).reshape(()),) + tuple(
            [state[k] for k in keys])

    kernel.__name__ = 'numpy_SoftmaxCrossEntropy'
    return kernel


STATEFUL = {
    'SoftmaxCrossEntropy': _softmax_cross_entropy,
    'BatchNormalization': _bn_forward,
    'FixedBatchNormalization': _fixed_bn_forward,
}


def candidate(rop):
    """May ``rop`` get a cheaper kernel (proposed by propose, checked by
    same_results)?"""
    if rop.nones:
        return False
    if rop.state:
        return rop.kind in STATEFUL
    return rop.kind in FAST or rop.kind in DONATING


def same_code_kind(kind):
    """Is every kernel proposed for ``kind`` its node's own expression
    (``_same_code``: nothing to compare)?"""
    return kind not in DONATING and kind not in STATEFUL and \
        getattr(FAST.get(kind), 'same_code', False)


def propose(rop, in_arrays, donated=(), threads=1):
    """A cheaper kernel for ``rop`` given its recorded inputs (types,
    shapes, attributes) and which of them it may overwrite, not yet
    checked; or None. The kernel bypasses the node: an op with hidden
    state gets one only from STATEFUL, which returns that state too. A
    large in-place element-wise one may be split across ``threads``
    threads (split_kernels.py; None: the cores)."""
    if not candidate(rop):
        return None
    if rop.state:
        kernel = STATEFUL[rop.kind](rop, rop.node, in_arrays, donated)
        if kernel is not None:
            kernel.workspace = kernel_memory.workspace(
                rop.kind, rop.node, in_arrays)
        return kernel
    kernel = None
    if any(donated) and rop.kind in DONATING:
        kernel = DONATING[rop.kind](rop, rop.node, in_arrays, donated)
        prefix = 'numpy_inplace_'
    if kernel is None and rop.kind in FAST and (
            not rop.rebind or rop.kind in REBINDING):
        factory = FAST[rop.kind]
        if getattr(factory, 'batch_split', False):
            kernel = factory(rop, rop.node, in_arrays, threads)
        else:
            kernel = factory(rop, rop.node, in_arrays)
        prefix = 'numpy_'
    if kernel is not None and kernel.__name__ in ('<lambda>', 'kernel'):
        kernel.__name__ = prefix + rop.kind   # for printouts
    if kernel is not None and prefix == 'numpy_inplace_':
        kernel = split_kernels.split(kernel, rop.kind, in_arrays, threads)
    if kernel is not None:
        kernel.workspace = kernel_memory.workspace(rop.kind, rop.node,
                                                   in_arrays)
    return kernel


def fallback(rop, in_arrays, donated):
    """For an op whose proposed kernel writes into an input: the kernel
    that allocates its result instead, to check where the other gives
    another memory layout than the node (an input that is a window of a
    larger array); or None."""
    if any(donated) and rop.kind in DONATING and rop.kind in FAST and \
            not rop.state:
        return propose(rop, in_arrays, ())
    return None
