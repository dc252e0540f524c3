"""Converters of the normalizations (batch, layer, group, local
response, L2).

Each registers itself in ``common.CONVERTERS`` (see there) when imported.
"""
from schedules.onnx_export.common import _norm_axis, converter, \
    float_types_alike


# -- normalization -----------------------------------------------------------

def _bn_axes(ctx):
    """(reduced axes, key axes) of a batch normalization, normalised."""
    nd = len(ctx.in_shape(0))
    g_nd = len(ctx.in_shape(1))
    axis = ctx.attr('axis')
    if axis is None:
        axis = (0,) + tuple(range(g_nd + 1, nd))
    axis = tuple(sorted(_norm_axis(a, nd) for a in axis))
    key = tuple(i for i in range(nd) if i not in axis)
    return axis, key


def _expand_param(ctx, name, key, nd):
    shape = [ctx.in_shape(0)[i] if i in key else 1 for i in range(nd)]
    while shape and shape[0] == 1 and len(shape) > 1:
        shape.pop(0)
    return ctx.reshape(name, shape)


@converter('FixedBatchNormalization')
def _cv_fixed_bn(ctx, xs, ys):
    x, gamma, beta, mean, var = xs[:5]
    nd = len(ctx.in_shape(0))
    axis, key = _bn_axes(ctx)
    eps = float(ctx.attr('eps', 2e-5))
    if key == (1,) and nd >= 2 and ctx.opset >= 15:
        # (Its input, its scale and bias, its mean and variance may each
        # be of another floating type: a mixed16 model's.)
        float_types_alike(ctx, ctx.op, (1, 2))
        float_types_alike(ctx, ctx.op, (3, 4))
        ctx.emit('BatchNormalization', [x, gamma, beta, mean, var], ys,
                 epsilon=eps)
        return
    float_types_alike(ctx, ctx.op)
    if key == (1,) and nd >= 2:
        ctx.emit('BatchNormalization', [x, gamma, beta, mean, var], ys,
                 epsilon=eps)
        return
    dt = ctx.in_dtype(0)
    std = ctx.emit1('Sqrt', [ctx.emit1('Add', [var, ctx.scalar(eps, dt)])])
    scale = ctx.emit1('Div', [gamma, std])
    xc = ctx.emit1('Sub', [x, _expand_param(ctx, mean, key, nd)])
    y = ctx.emit1('Mul', [xc, _expand_param(ctx, scale, key, nd)])
    ctx.emit('Add', [y, _expand_param(ctx, beta, key, nd)], ys)


@converter('BatchNormalization')
def _cv_batch_bn(ctx, xs, ys):
    # Batch statistics (a schedule recorded in training mode).
    x, gamma, beta = xs[:3]
    nd = len(ctx.in_shape(0))
    axis, key = _bn_axes(ctx)
    eps = float(ctx.attr('eps', 2e-5))
    dt = ctx.in_dtype(0)
    mean = ctx.reduce('ReduceMean', x, axis, True)
    xc = ctx.emit1('Sub', [x, mean])
    var = ctx.reduce('ReduceMean', ctx.emit1('Mul', [xc, xc]), axis, True)
    std = ctx.emit1('Sqrt', [ctx.emit1('Add', [var, ctx.scalar(eps, dt)])])
    xh = ctx.emit1('Div', [xc, std])
    y = ctx.emit1('Mul', [xh, _expand_param(ctx, gamma, key, nd)])
    ctx.emit('Add', [y, _expand_param(ctx, beta, key, nd)], ys)


@converter('LocalResponseNormalization')
def _cv_lrn(ctx, xs, ys):
    if len(ctx.in_shape(0)) != 4:
        # (Chainer takes 2 dimensions or more; ONNX's LRN 4 only)
        raise ctx.unsupported('LRN on %d-D input: ONNX takes 4-D only'
                              % len(ctx.in_shape(0)))
    n = int(ctx.attr('n', 5))
    size = 2 * (n // 2) + 1   # chainer sums n//2 channels on each side
    alpha = float(ctx.attr('alpha', 1e-4))
    ctx.emit('LRN', [xs[0]], ys, size=size, alpha=alpha * size,
             beta=float(ctx.attr('beta', 0.75)),
             bias=float(ctx.attr('k', 2)))


@converter('LayerNormalization')
def _cv_layer_norm(ctx, xs, ys):
    x, gamma, beta = xs[:3]
    dt = ctx.in_dtype(0)
    eps = float(ctx.attr('eps', 1e-5))
    mean = ctx.reduce('ReduceMean', x, [1], True)
    xc = ctx.emit1('Sub', [x, mean])
    var = ctx.reduce('ReduceMean', ctx.emit1('Mul', [xc, xc]), [1], True)
    std = ctx.emit1('Sqrt', [ctx.emit1('Add', [var, ctx.scalar(eps, dt)])])
    xh = ctx.emit1('Div', [xc, std])
    ctx.emit('Add', [ctx.emit1('Mul', [xh, gamma]), beta], ys)


@converter('GroupNormalization')
def _cv_group_norm(ctx, xs, ys):
    x, gamma, beta = xs[:3]
    x_shape = ctx.in_shape(0)
    nd = len(x_shape)
    groups = int(ctx.require('groups'))
    eps = float(ctx.attr('eps', 1e-5))
    dt = ctx.in_dtype(0)
    # (B, C, ...) -> (B, G, C/G * ...): 0 keeps the (dynamic) batch.
    g = ctx.reshape(x, [0, groups, -1])
    mean = ctx.reduce('ReduceMean', g, [2], True)
    gc = ctx.emit1('Sub', [g, mean])
    var = ctx.reduce('ReduceMean', ctx.emit1('Mul', [gc, gc]), [2], True)
    std = ctx.emit1('Sqrt', [ctx.emit1('Add', [var, ctx.scalar(eps, dt)])])
    xh = ctx.reshape(ctx.emit1('Div', [gc, std]),
                     ctx.emit1('Shape', [x]))
    shape = [x_shape[1]] + [1] * (nd - 2)
    y = ctx.emit1('Mul', [xh, ctx.reshape(gamma, shape)])
    ctx.emit('Add', [y, ctx.reshape(beta, shape)], ys)


@converter('NormalizeL2')
def _cv_normalize_l2(ctx, xs, ys):
    nd = len(ctx.in_shape(0))
    axis = ctx.attr('axis', 1)
    if isinstance(axis, int):
        axis = (axis,)
    axis = [_norm_axis(a, nd) for a in axis]
    dt = ctx.in_dtype(0)
    sq = ctx.reduce('ReduceSum', ctx.emit1('Mul', [xs[0], xs[0]]), axis,
                    True)
    norm = ctx.emit1('Add', [ctx.emit1('Sqrt', [sq]),
                             ctx.scalar(ctx.attr('eps', 1e-5), dt)])
    ctx.emit('Div', [xs[0], norm], ys)
