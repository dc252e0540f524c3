"""Converters of elementwise ops and activations.

Each registers itself in ``common.CONVERTERS`` (see there) when imported.
"""
import math

import numpy

from schedules.onnx_export.common import CONVERTERS, _onnx_dtype, converter


# -- elementwise --------------------------------------------------------------

_UNARY = {
    'ReLU': 'Relu', 'Sigmoid': 'Sigmoid', 'Tanh': 'Tanh', 'Exp': 'Exp',
    'Log': 'Log', 'Sqrt': 'Sqrt', 'Neg': 'Neg', 'Absolute': 'Abs',
    'Sin': 'Sin', 'Cos': 'Cos', 'Tan': 'Tan', 'Arcsin': 'Asin',
    'Arccos': 'Acos', 'Arctan': 'Atan', 'Sinh': 'Sinh', 'Cosh': 'Cosh',
    'Arctanh': 'Atanh', 'Erf': 'Erf', 'Identity': 'Identity',
    'Copy': 'Identity',
}


def _unary(op_type):
    def cv(ctx, xs, ys):
        ctx.emit(op_type, [xs[0]], ys)
    return cv


for _k, _v in _UNARY.items():
    CONVERTERS[_k] = _unary(_v)

def _dropout(ctx, xs, ys):
    """A Dropout op of an inference recording: the method applied it in
    training mode on purpose (Monte-Carlo dropout; under ``train=False``
    F.dropout records none). ONNX's Dropout in training mode draws its own
    mask (so another one than Chainer's: the same distribution, not the
    same values); it was exported as the identity, the mask dropped."""
    if ctx.opset < 12:
        raise ctx.unsupported('dropout in training mode needs opset 12 or '
                              'later (ONNX Dropout\'s training_mode)')
    ratio = ctx.scalar(ctx.require('ratio'), ctx.in_dtype(0),
                       'ratio')
    mode = ctx.const(numpy.asarray(True), 'training_mode')
    ctx.emit('Dropout', [xs[0], ratio, mode], ys)


CONVERTERS['Dropout'] = _dropout

_BINARY = {'Add': 'Add', 'Sub': 'Sub', 'Mul': 'Mul', 'Div': 'Div',
           'Maximum': 'Max', 'Minimum': 'Min', 'PowVarVar': 'Pow'}


def _binary(op_type):
    def cv(ctx, xs, ys):
        ctx.emit(op_type, xs[:2], ys)
    return cv


for _k, _v in _BINARY.items():
    CONVERTERS[_k] = _binary(_v)


@converter('MultiAdd')
def _cv_multi_add(ctx, xs, ys):
    ctx.emit('Sum', xs, ys)


def _const_of(ctx, key='value'):
    return ctx.const(numpy.asarray(ctx.require(key), dtype=ctx.in_dtype(0)),
                     'const')


@converter('AddConstant')
def _cv_add_constant(ctx, xs, ys):
    ctx.emit('Add', [xs[0], _const_of(ctx)], ys)


@converter('SubFromConstant')
def _cv_sub_from_constant(ctx, xs, ys):
    ctx.emit('Sub', [_const_of(ctx), xs[0]], ys)


@converter('MulConstant')
def _cv_mul_constant(ctx, xs, ys):
    ctx.emit('Mul', [xs[0], _const_of(ctx)], ys)


@converter('DivFromConstant')
def _cv_div_from_constant(ctx, xs, ys):
    ctx.emit('Div', [_const_of(ctx), xs[0]], ys)


@converter('PowVarConst')
def _cv_pow_var_const(ctx, xs, ys):
    ctx.emit('Pow', [xs[0], _const_of(ctx)], ys)


@converter('PowConstVar')
def _cv_pow_const_var(ctx, xs, ys):
    ctx.emit('Pow', [_const_of(ctx), xs[0]], ys)


@converter('Square')
def _cv_square(ctx, xs, ys):
    ctx.emit('Mul', [xs[0], xs[0]], ys)


def _log_base(base):
    def cv(ctx, xs, ys):
        lx = ctx.emit1('Log', [xs[0]])
        ctx.emit('Div', [lx, ctx.scalar(math.log(base), ctx.in_dtype(0))], ys)
    return cv


CONVERTERS['Log2'] = _log_base(2.0)
CONVERTERS['Log10'] = _log_base(10.0)


@converter('Expm1')
def _cv_expm1(ctx, xs, ys):
    e = ctx.emit1('Exp', [xs[0]])
    ctx.emit('Sub', [e, ctx.scalar(1, ctx.in_dtype(0))], ys)


@converter('Log1p')
def _cv_log1p(ctx, xs, ys):
    a = ctx.emit1('Add', [xs[0], ctx.scalar(1, ctx.in_dtype(0))])
    ctx.emit('Log', [a], ys)


@converter('Fmod')
def _cv_fmod(ctx, xs, ys):
    ctx.emit('Mod', xs[:2], ys, fmod=1)


@converter('Clip')
def _cv_clip(ctx, xs, ys):
    dt = ctx.in_dtype(0)
    lo, hi = ctx.attr('x_min'), ctx.attr('x_max')
    ins = [xs[0],
           '' if lo is None else ctx.scalar(lo, dt, 'min'),
           '' if hi is None else ctx.scalar(hi, dt, 'max')]
    while ins[-1] == '':
        ins.pop()
    ctx.emit('Clip', ins, ys)


@converter('Cast')
def _cv_cast(ctx, xs, ys):
    ctx.emit('Cast', [xs[0]], ys,
             to=_onnx_dtype(ctx.onnx, ctx.out_dtype(0)))


@converter('Where')
def _cv_where(ctx, xs, ys):
    cond = numpy.asarray(ctx.constant_attr('condition'), dtype=bool)
    info = ctx.in_batch(0) or ctx.in_batch(1)
    if ctx.dynamic_batch and info is not None and \
            cond.ndim == len(ctx.out_shape(0)) and \
            cond.shape[info[0]] == ctx.out_shape(0)[info[0]] > 1:
        # A condition as large as the batch (a mask broadcast to
        # ``x.shape``): the same for every example, one row broadcasts
        # to any batch size; else it is the recorded batch's.
        a = info[0]
        first = numpy.take(cond, [0], axis=a)
        if not (cond == first).all():
            raise ctx.unsupported(
                "F.where's condition differs between the examples of the "
                'recorded batch, a constant of its size: export with '
                'dynamic_batch=False')
        cond = first
    ctx.emit('Where', [ctx.const(cond, 'condition'), xs[0], xs[1]], ys)


# -- activations --------------------------------------------------------------

@converter('LeakyReLU')
def _cv_leaky_relu(ctx, xs, ys):
    ctx.emit('LeakyRelu', [xs[0]], ys, alpha=float(ctx.attr('slope', 0.2)))


@converter('ClippedReLU')
def _cv_clipped_relu(ctx, xs, ys):
    dt = ctx.in_dtype(0)
    ctx.emit('Clip', [xs[0], ctx.scalar(0, dt, 'min'),
                      ctx.scalar(ctx.require('z'), dt, 'max')], ys)


@converter('ELU')
def _cv_elu(ctx, xs, ys):
    ctx.emit('Elu', [xs[0]], ys, alpha=float(ctx.attr('alpha', 1.0)))


@converter('HardSigmoid')
def _cv_hard_sigmoid(ctx, xs, ys):
    ctx.emit('HardSigmoid', [xs[0]], ys, alpha=0.2, beta=0.5)


@converter('Softplus')
def _cv_softplus(ctx, xs, ys):
    beta = float(ctx.attr('beta', 1.0))
    if beta == 1.0:
        ctx.emit('Softplus', [xs[0]], ys)
        return
    dt = ctx.in_dtype(0)
    bx = ctx.emit1('Mul', [xs[0], ctx.scalar(beta, dt, 'beta')])
    sp = ctx.emit1('Softplus', [bx])
    ctx.emit('Div', [sp, ctx.scalar(beta, dt, 'beta')], ys)


def _channel_shape(w_shape, x_ndim):
    """Chainer's (1,) + W.shape + (1,)*k, without the leading 1."""
    return tuple(w_shape) + (1,) * (x_ndim - len(w_shape) - 1)


@converter('PReLUFunction')
def _cv_prelu(ctx, xs, ys):
    w = ctx.reshape(xs[1], _channel_shape(ctx.in_shape(1),
                                          len(ctx.in_shape(0))))
    ctx.emit('PRelu', [xs[0], w], ys)


@converter('Swish')
def _cv_swish(ctx, xs, ys):
    beta = ctx.reshape(xs[1], _channel_shape(ctx.in_shape(1),
                                             len(ctx.in_shape(0))))
    bx = ctx.emit1('Mul', [xs[0], beta])
    s = ctx.emit1('Sigmoid', [bx])
    ctx.emit('Mul', [xs[0], s], ys)


@converter('Softmax')
def _cv_softmax(ctx, xs, ys):
    ctx.emit('Softmax', [xs[0]], ys, axis=int(ctx.attr('axis', 1)))


@converter('LogSoftmax')
def _cv_log_softmax(ctx, xs, ys):
    ctx.emit('LogSoftmax', [xs[0]], ys, axis=int(ctx.attr('axis', 1)))


@converter('CReLU')
def _cv_crelu(ctx, xs, ys):
    pos = ctx.emit1('Relu', [xs[0]])
    neg = ctx.emit1('Relu', [ctx.emit1('Neg', [xs[0]])])
    ctx.emit('Concat', [pos, neg], ys, axis=int(ctx.attr('axis', 1)))
