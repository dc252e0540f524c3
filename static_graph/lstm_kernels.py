"""Chainer's LSTM cell (``F.lstm``: ``LSTM`` and its ``LSTMGrad``) as
compiled loops around NumPy's own tanh, for lowering.py's ``FAST`` table.

Chainer's CPU code runs some twenty NumPy ops per call on the gates'
strided views (``x.reshape(B, H, 4)[:, :, k]``), forward, and about thirty
for the gradient: half of a replayed PTB language model step's
element-wise time at 200 units. Here the same arithmetic runs in C loops
(``schedules/native.py``: ``+ - *`` correctly rounded, no contraction into
fused multiply-adds) and every tanh is NumPy's, on the same values (its
results do not depend on the operand's strides), so the results are the
same bits (but for which NaN an op of two NaN operands returns, as in the
captured update's loops, docs/captured_update.md: NumPy's own SIMD loops
keep one operand's payload, the C loop another's; NaN stays NaN, hunt33c):

* forward: ``t = x`` with the i, f, o gates times 0.5 (C), ``tanh(t)``
  (NumPy, in place), ``c = a*i + f*c_prev`` with ``s = t*0.5 + 0.5`` for
  each sigmoid (C), ``tanh(c)`` (NumPy), ``h = o * tanh(c)`` (C);
* gradient: the same ``t``, ``tanh(c_next)``, then Chainer's expressions
  for ``gc_prev`` and the four gate gradients, operand by operand (C).

Rows of the cell state beyond the batch (a shrinking batch) are copied as
Chainer copies them. Only float32/float64, 2-D, C-contiguous operands and
a gradient call with both ``gc`` and ``gh``; anything else (or
``numpy.seterr(...='raise')``, where NumPy raises at the op that errs)
runs Chainer's own code. Each kernel is still checked against the node's
recorded results before it is used (lower_pass)."""
import ctypes

import numpy

from chainer.functions.rnn import lstm as lstm_module

from schedules import native
from static_graph.elementwise_kernels import plain_cpu

_SOURCE = r'''
#include <fenv.h>
#include <stdint.h>

#define FLAGS (%(flags)s)
/* Chainer's _sigmoid after NumPy's tanh: tanh(v * half) * half + half */
#define SIG(t) ((t) * half + half)

#define DEFINE(T, S)                                                        \
int pre_##S(int64_t units, const T *x, T *t)                              \
{                                                                           \
    const T half = (T)0.5;                                                  \
    feclearexcept(FE_ALL_EXCEPT);                                           \
    for (int64_t u = 0; u < units; u++) {                                   \
        t[4 * u] = x[4 * u];                                                \
        t[4 * u + 1] = x[4 * u + 1] * half;                                 \
        t[4 * u + 2] = x[4 * u + 2] * half;                                 \
        t[4 * u + 3] = x[4 * u + 3] * half;                                 \
    }                                                                       \
    return FLAGS;                                                           \
}                                                                           \
int cell_##S(int64_t units, int64_t all, const T *t, const T *cp, T *c)    \
{                                                                           \
    const T half = (T)0.5;                                                  \
    feclearexcept(FE_ALL_EXCEPT);                                           \
    for (int64_t u = 0; u < units; u++) {                                   \
        T a = t[4 * u], i = SIG(t[4 * u + 1]), f = SIG(t[4 * u + 2]);      \
        T p = a * i;                                                        \
        T q = f * cp[u];                                                    \
        c[u] = p + q;                                                       \
    }                                                                       \
    for (int64_t u = units; u < all; u++)                                   \
        c[u] = cp[u];                                                       \
    return FLAGS;                                                           \
}                                                                           \
int out_##S(int64_t units, const T *t, T *h)                               \
{                                                                           \
    const T half = (T)0.5;                                                  \
    feclearexcept(FE_ALL_EXCEPT);                                           \
    for (int64_t u = 0; u < units; u++) {                                   \
        h[u] = SIG(t[4 * u + 3]) * h[u];                                    \
    }                                                                       \
    return FLAGS;                                                           \
}                                                                           \
int grad_##S(int64_t units, int64_t all, const T *t, const T *co,          \
             const T *cp, const T *gc, const T *gh, T *gcp, T *gx)         \
{                                                                           \
    const T half = (T)0.5;                                                  \
    feclearexcept(FE_ALL_EXCEPT);                                           \
    for (int64_t u = 0; u < units; u++) {                                   \
        T a = t[4 * u], i = SIG(t[4 * u + 1]), f = SIG(t[4 * u + 2]);      \
        T o = SIG(t[4 * u + 3]), k = co[u];                                 \
        T g = gh[u] * o;                  /* gh * sig_o * (1 - co*co) */    \
        T w = 1 - k * k;                                                    \
        g = g * w;                                                          \
        g = g + gc[u];                    /* + gc_update */                 \
        T r, s;                                                             \
        r = g * i; w = 1 - a * a;         /* gc * sig_i * (1 - a*a) */      \
        gx[4 * u] = r * w;                                                  \
        r = g * a; w = 1 - i; s = i * w;  /* gc * a * (i * (1 - i)) */      \
        gx[4 * u + 1] = r * s;                                              \
        r = g * cp[u]; w = 1 - f; s = f * w;                                \
        gx[4 * u + 2] = r * s;            /* gc * c_prev * (f*(1 - f)) */   \
        r = gh[u] * k; w = 1 - o; s = o * w;                                \
        gx[4 * u + 3] = r * s;            /* gh * co * (o * (1 - o)) */     \
        gcp[u] = g * f;                   /* gc_prev *= sig_f */            \
    }                                                                       \
    for (int64_t u = units; u < all; u++)                                   \
        gcp[u] = gc[u];                                                     \
    return FLAGS;                                                           \
}

DEFINE(float, f)
DEFINE(double, d)
''' % {'flags': native.FLAGS_C.replace('\n', ' ')}

_P = ctypes.c_void_p
_I = ctypes.c_int64
_SIGNATURES = {'pre': [_I, _P, _P], 'cell': [_I, _I, _P, _P, _P],
               'out': [_I, _P, _P],
               'grad': [_I, _I, _P, _P, _P, _P, _P, _P, _P]}
_SUFFIX = {numpy.dtype(numpy.float32): 'f', numpy.dtype(numpy.float64): 'd'}
_functions = []     # [{(name, dtype): function}] or [None], once


def _loops():
    if not _functions:
        lib = native.load(_SOURCE) if native.enabled() else 'off'
        if isinstance(lib, str):
            _functions.append(None)
        else:
            fns = {}
            for name, args in _SIGNATURES.items():
                for dtype, suffix in _SUFFIX.items():
                    fn = getattr(lib, '%s_%s' % (name, suffix))
                    fn.argtypes = args
                    fn.restype = ctypes.c_int
                    fns[name, dtype] = fn
            _functions.append(fns)
    return _functions[0]


def _fits(c_prev, x, more=()):
    """2-D C-contiguous float32/float64 operands of one dtype, shaped as
    the cell takes them (c_prev (rows, H), x (batch, 4H), batch <= rows;
    ``more``: arrays of c_prev's shape, then one of (batch, H))."""
    dtype = x.dtype
    if dtype not in _SUFFIX or x.ndim != 2 or c_prev.ndim != 2:
        return False
    batch, units4 = x.shape
    rows, units = c_prev.shape
    if units4 != 4 * units or batch > rows:
        return False
    shapes = [c_prev.shape] * (len(more) - 1) + [(batch, units)] \
        if more else []
    for a, shape in zip((c_prev, x) + tuple(more),
                        [c_prev.shape, x.shape] + shapes):
        if type(a) is not numpy.ndarray or a.dtype != dtype or \
                a.shape != shape or not a.flags.c_contiguous:
            return False
    return True


def _check(flags, dtype):
    if flags:
        native.report(flags, dtype)


def _gates(fns, c_prev, x):
    """(dtype, batch, batch * units, t): ``t`` the gates' tanh of ``x``
    (a) and of ``x * 0.5`` (i, f, o), as Chainer's LSTM computes them."""
    dtype = x.dtype
    batch = x.shape[0]
    n = batch * c_prev.shape[1]
    t = numpy.empty(x.shape, dtype)
    _check(fns['pre', dtype](n, x.ctypes.data, t.ctypes.data), dtype)
    numpy.tanh(t, out=t)
    return dtype, batch, n, t


def forward(c_prev, x):
    """``LSTM().forward((c_prev, x))``: (c_next, h), the same bits."""
    fns = _loops()
    if fns is None or not _fits(c_prev, x) or _raising():
        return lstm_module.LSTM().forward((c_prev, x))
    dtype, batch, n, t = _gates(fns, c_prev, x)
    c_next = numpy.empty_like(c_prev)
    _check(fns['cell', dtype](n, c_prev.size, t.ctypes.data,
                              c_prev.ctypes.data, c_next.ctypes.data), dtype)
    h = numpy.tanh(c_next[:batch])
    _check(fns['out', dtype](n, t.ctypes.data, h.ctypes.data), dtype)
    return c_next, h


def grad(c_prev, x, c_next, gc, gh):
    """``LSTMGrad().forward((c_prev, x, c_next, gc, gh))``: (gc_prev, gx),
    the same bits."""
    fns = _loops()
    if fns is None or gc is None or gh is None or \
            not _fits(c_prev, x, (c_next, gc, gh)) or _raising():
        return lstm_module.LSTMGrad().forward((c_prev, x, c_next, gc, gh))
    dtype, batch, n, t = _gates(fns, c_prev, x)
    co = numpy.tanh(c_next[:batch])
    gc_prev = numpy.empty_like(c_prev)
    gx = numpy.empty_like(x)
    _check(fns['grad', dtype](
        n, c_prev.size, t.ctypes.data, co.ctypes.data, c_prev.ctypes.data,
        gc.ctypes.data, gh.ctypes.data, gc_prev.ctypes.data,
        gx.ctypes.data), dtype)
    return gc_prev, gx


def for_lstm(rop, node, xs):
    """Kernel for ``LSTM`` (inputs c_prev, x; results c_next, h)."""
    if len(xs) != 2 or not plain_cpu(xs) or not _fits(*xs) or \
            _loops() is None:
        return None

    def kernel(a):
        return forward(*a)
    kernel.__name__ = 'c_LSTM'
    return kernel


def for_lstm_grad(rop, node, xs):
    """Kernel for ``LSTMGrad`` (inputs c_prev, x, c_next, gc, gh; results
    gc_prev, gx)."""
    if len(xs) != 5 or not plain_cpu(xs) or \
            not _fits(xs[0], xs[1], xs[2:]) or _loops() is None:
        return None

    def kernel(a):
        return grad(*a)
    kernel.__name__ = 'c_LSTMGrad'
    return kernel


def _raising():
    return 'raise' in numpy.geterr().values()
