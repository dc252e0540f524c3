"""Converters of reductions (sums, means, extrema, arg-extrema, cumsum).

Each registers itself in ``common.CONVERTERS`` (see there) when imported.
"""
from schedules.onnx_export.common import (
    CONVERTERS, _norm_axis, _onnx_dtype, converter)


# -- reductions --------------------------------------------------------------

def _reduced_axes(ctx):
    nd = len(ctx.in_shape(0))
    axis = ctx.attr('axis')
    if axis is None:
        return None
    if isinstance(axis, int):
        axis = (axis,)
    return sorted(_norm_axis(a, nd) for a in axis)


def _batch_after_reduce(ctx, axes, keepdims):
    info = ctx.in_batch(0)
    if info is None:
        return ctx.set_batch(0, None)
    a, f = info
    if axes is None or a in axes:
        return ctx.set_batch(0, None)
    if not keepdims:
        a -= sum(1 for r in axes if r < a)
    ctx.set_batch(0, a, f)


def _reduction(op_type, keep_default=False):
    def cv(ctx, xs, ys):
        axes = _reduced_axes(ctx)
        keepdims = bool(ctx.attr('keepdims', keep_default))
        if axes is not None and len(axes) == 0:
            ctx.emit('Identity', [xs[0]], ys)
        else:
            ctx.reduce(op_type, xs[0], axes, keepdims, ys[0])
        _batch_after_reduce(ctx, axes, keepdims)
    return cv


CONVERTERS['Sum'] = _reduction('ReduceSum')
CONVERTERS['Mean'] = _reduction('ReduceMean')
CONVERTERS['Average'] = _reduction('ReduceMean')
CONVERTERS['Max'] = _reduction('ReduceMax')
CONVERTERS['Min'] = _reduction('ReduceMin')
CONVERTERS['Prod'] = _reduction('ReduceProd')
CONVERTERS['LogSumExp'] = _reduction('ReduceLogSumExp')


def _arg_reduction(op_type):
    def cv(ctx, xs, ys):
        axis = ctx.attr('axis')
        x = xs[0]
        if axis is None:
            x = ctx.reshape(x, [-1])
            axis = 0
            ctx.set_batch(0, None)
        else:
            axis = _norm_axis(axis, len(ctx.in_shape(0)))
            _batch_after_reduce(ctx, [axis], False)
        r = ctx.emit1(op_type, [x], axis=axis, keepdims=0)
        ctx.emit('Cast', [r], ys, to=_onnx_dtype(ctx.onnx, ctx.out_dtype(0)))
    return cv


CONVERTERS['ArgMax'] = _arg_reduction('ArgMax')
CONVERTERS['ArgMin'] = _arg_reduction('ArgMin')


@converter('Cumsum')
def _cv_cumsum(ctx, xs, ys):
    axis = ctx.attr('axis')
    x = xs[0]
    if axis is None:
        x = ctx.reshape(x, [-1])
        axis = 0
        ctx.set_batch(0, None)
    ctx.emit('CumSum', [x, ctx.i64([int(axis)], 'axis')], ys)
