"""Converters of convolution, deconvolution and pooling.

Each registers itself in ``common.CONVERTERS`` (see there) when imported.
"""
import numpy

from schedules.onnx_export.common import converter


# -- convolution --------------------------------------------------------------

def _nd(v, n, name):
    if v is None:
        raise ValueError(name)
    if isinstance(v, (int, numpy.integer)):
        return [int(v)] * n
    v = [int(e) for e in v]
    if len(v) != n:
        raise ValueError(name)
    return v


def _conv_geometry(ctx, n, w_shape):
    stride = _nd(ctx.attr('stride', 1), n, 'stride')
    pad = _nd(ctx.attr('pad', 0), n, 'pad')
    dilate = _nd(ctx.attr('dilate', 1), n, 'dilate')
    return stride, pad, dilate


def _end_pads(in_dims, out_dims, k, s, p, d):
    """End pads that give the recorded output size with floor rounding.

    Chainer's ``cover_all`` adds ``stride - 1`` extra pixels at the end; the
    smallest end pad that yields the same output size is used instead.
    """
    ends = []
    for i in range(len(in_dims)):
        dk = (k[i] - 1) * d[i] + 1
        need = (out_dims[i] - 1) * s[i] + dk - in_dims[i] - p[i]
        ends.append(max(p[i], need))
    return ends


@converter('Convolution2DFunction', 'ConvolutionND')
def _cv_conv(ctx, xs, ys):
    x_shape, w_shape = ctx.in_shape(0), ctx.in_shape(1)
    n = len(x_shape) - 2
    k = list(w_shape[2:])
    s, p, d = _conv_geometry(ctx, n, w_shape)
    ends = p
    if ctx.attr('cover_all'):
        ends = _end_pads(x_shape[2:], ctx.out_shape(0)[2:], k, s, p, d)
    ctx.emit('Conv', xs[:3], ys, kernel_shape=k, strides=s, pads=p + ends,
             dilations=d, group=int(ctx.attr('groups', 1) or 1))


@converter('Deconvolution2DFunction', 'DeconvolutionND')
def _cv_deconv(ctx, xs, ys):
    x_shape, w_shape = ctx.in_shape(0), ctx.in_shape(1)
    n = len(x_shape) - 2
    k = list(w_shape[2:])
    s, p, d = _conv_geometry(ctx, n, w_shape)
    out = ctx.out_shape(0)[2:]
    output_padding = []
    for i in range(n):
        base = s[i] * (x_shape[2 + i] - 1) + (k[i] - 1) * d[i] + 1 - 2 * p[i]
        output_padding.append(out[i] - base)
    if any(o < 0 for o in output_padding):
        raise ctx.unsupported('output size %s smaller than the minimum'
                              % (tuple(out),))
    ctx.emit('ConvTranspose', xs[:3], ys, kernel_shape=k, strides=s,
             pads=p + p, dilations=d,
             group=int(ctx.attr('groups', 1) or 1),
             output_padding=(output_padding if any(output_padding)
                             else None))


# -- pooling -----------------------------------------------------------------

def _pool_geometry(ctx):
    x_shape = ctx.in_shape(0)
    n = len(x_shape) - 2
    k = _nd(ctx.require('ksize'), n, 'ksize')
    s = ctx.attr('stride')
    s = k if s is None else _nd(s, n, 'stride')
    p = _nd(ctx.attr('pad', 0), n, 'pad')
    return x_shape, n, k, s, p


@converter('MaxPooling2D', 'MaxPoolingND')
def _cv_max_pool(ctx, xs, ys):
    x_shape, n, k, s, p = _pool_geometry(ctx)
    ends = p
    if ctx.attr('cover_all', True):
        ends = _end_pads(x_shape[2:], ctx.out_shape(0)[2:], k, s, p, [1] * n)
        if any(e >= kk for e, kk in zip(ends, k)):
            raise ctx.unsupported(
                'cover_all pooling with a window lying entirely in the '
                'padding (ksize=%s, stride=%s, pad=%s)' % (k, s, p))
    ctx.emit('MaxPool', [xs[0]], ys[:1], kernel_shape=k, strides=s,
             pads=p + ends)


@converter('AveragePooling2D', 'AveragePoolingND')
def _cv_avg_pool(ctx, xs, ys):
    x_shape, n, k, s, p = _pool_geometry(ctx)
    if ctx.attr('cover_all'):
        raise ctx.unsupported('average pooling with cover_all=True')
    include = ctx.attr('count_include_pad', True)
    ctx.emit('AveragePool', [xs[0]], ys, kernel_shape=k, strides=s,
             pads=p + p, count_include_pad=int(bool(include)))
