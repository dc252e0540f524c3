"""Converters of the matrix products: linear layers, ``MatMul`` and
embeddings.

Each registers itself in ``common.CONVERTERS`` (see there) when imported.
"""
from schedules.onnx_export.common import converter


# -- connections --------------------------------------------------------------

@converter('LinearFunction')
def _cv_linear(ctx, xs, ys):
    if len(ctx.in_shape(0)) != 2:
        raise ctx.unsupported('LinearFunction input must be 2-D, got %s'
                              % (ctx.in_shape(0),))
    ctx.emit('Gemm', xs[:3], ys, transB=1)


@converter('EmbedIDFunction')
def _cv_embed_id(ctx, xs, ys):
    # The ids' batch axis is the result's (one more axis, at the end).
    info = ctx.in_batch(0)
    if info is not None:
        ctx.set_batch(0, *info)
    ignore = ctx.attr('ignore_label')
    if ignore is None:
        ctx.emit('Gather', [xs[1], xs[0]], ys, axis=0)
        return
    # As Chainer: the ignored ids look up row 0 (an ignore_label outside
    # the table, -100, is no index), then give zeros.
    mask = ctx.emit1('Equal', [xs[0], ctx.scalar(ignore, ctx.in_dtype(0))])
    ids = ctx.emit1('Where', [mask, ctx.scalar(0, ctx.in_dtype(0), 'row0'),
                              xs[0]])
    g = ctx.emit1('Gather', [xs[1], ids], axis=0)
    mask = ctx.unsqueeze(mask, [-1])
    zero = ctx.scalar(0, ctx.out_dtype(0), 'zero')
    ctx.emit('Where', [mask, zero, g], ys)


@converter('MatMul')
def _cv_matmul(ctx, xs, ys):
    a, b = xs[0], xs[1]
    for i, key in ((0, 'transa'), (1, 'transb')):
        nd = len(ctx.in_shape(i))
        if ctx.attr(key) and nd >= 2:
            perm = list(range(nd))
            perm[-1], perm[-2] = perm[-2], perm[-1]
            t = ctx.transpose(xs[i], perm)
            if i == 0:
                a = t
            else:
                b = t
    if ctx.attr('transc'):
        raise ctx.unsupported('transc=True')
    ctx.emit('MatMul', [a, b], ys)
