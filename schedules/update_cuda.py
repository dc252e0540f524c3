"""The optimizer update on CuPy: Chainer 7.8.1's ``update_core_gpu``
kernels with their per-step scalars read from a device array, and the
staging of those scalars (one host-to-device copy per step).

Each ``RuleKernel`` holds the element-wise kernel of one update rule (or
hook) as Chainer 7.8.1 writes it: its ``in_params``, ``out_params`` and C
body, copied here verbatim (``tests/test_captured_update_cuda.py`` checks
them against the ones Chainer's ``update_core_gpu`` creates). The one
change: the parameters Chainer passes as host scalars (``T lr``, ``T
alpha_t``, ...) become reads from ``raw T _s``, a slice of the step's
device scalar array, at the top of the body (``const T lr = _s[0];``), so
the body computes with exactly the value CuPy would have cast the host
scalar to, in the same expression, and a CUDA graph that keeps the kernel
reads the values written before each launch.

``device_values`` computes on the host the bits CuPy gives a Python or
NumPy scalar passed for a ``T`` parameter; ``ScalarRing`` writes a step's
scalars into a pinned host buffer and copies them to the device, never
overwriting a buffer whose copy may still be in flight.

This module knows nothing about Chainer, and imports CuPy only when a
kernel is made.
"""
import ctypes

import numpy


class RuleKernel(object):
    """One of Chainer's update kernels, its scalars read from a device
    array. ``scalars``: the names of Chainer's scalar parameters, in the
    order of the device slice; ``ctype``: their type placeholder."""

    __slots__ = ('name', 'in_params', 'out_params', 'body', 'scalars',
                 'ctype', 'drop', '_kernels')

    def __init__(self, name, in_params, out_params, body, scalars,
                 ctype='T', drop=()):
        self.name = name
        self.in_params = in_params
        self.out_params = out_params
        self.body = body
        self.scalars = tuple(scalars)
        self.ctype = ctype
        self.drop = tuple(drop)       # Chainer's own dtype carriers
        self._kernels = {}

    def arrays(self):
        """Chainer's in_params that stay arrays, in order."""
        out = []
        for p in self.in_params.split(','):
            name = p.split()[-1]
            if name not in self.scalars and name not in self.drop:
                out.append(p.strip())
        return out

    def source(self):
        """(in_params, out_params, operation) of the kernel made here."""
        ins = ', '.join(self.arrays() + ['raw %s _s' % self.ctype])
        pre = ''.join('const %s %s = _s[%d];\n' % (self.ctype, n, i)
                      for i, n in enumerate(self.scalars))
        return ins, self.out_params, pre + self.body

    def kernel(self, cupy):
        """The ``cupy.ElementwiseKernel`` (made once per process)."""
        k = self._kernels.get(id(cupy))
        if k is None:
            ins, outs, body = self.source()
            k = self._kernels[id(cupy)] = cupy.ElementwiseKernel(
                ins, outs, body, 'static_graph_' + self.name)
        return k


# -- Chainer 7.8.1's update_core_gpu kernels, verbatim ----------------------

SGD = RuleKernel('sgd', 'T grad, T lr', 'T param',
                 'param -= lr * grad', ('lr',))

MOMENTUM_SGD = RuleKernel(
    'momentum_sgd', 'T grad, T lr, T momentum', 'T param, T v',
    '''v = momentum * v - lr * grad;
                   param += v;''', ('lr', 'momentum'))

NESTEROV_AG = RuleKernel(
    'nesterov_ag', 'T grad, T lr, T momentum', 'T param, T v',
    '''
                v = v * momentum - lr * grad;
                param += momentum * momentum * v - (1 + momentum) * lr * grad;
                ''', ('lr', 'momentum'))

CORRECTED_MOMENTUM_SGD = RuleKernel(
    'corrected_momentum_sgd', 'T grad, T lr, T momentum', 'T param, T v',
    '''v = momentum * v - grad;
               param += lr * v;''', ('lr', 'momentum'))

ADA_GRAD = RuleKernel(
    'adagrad', 'T grad, T lr, T eps', 'T param, T h',
    '''h += grad * grad;
                   param -= lr * grad / (sqrt(h) + eps);''', ('lr', 'eps'))

ADA_DELTA = RuleKernel(
    'adadelta', 'T grad, T one_minus_rho, T eps', 'T param, T msg, T msdx',
    '''msg   = msg + one_minus_rho * (grad * grad - msg);
                   T dx  = sqrt((msdx + eps) / (msg + eps)) * grad;
                   msdx  += one_minus_rho * (dx * dx - msdx);
                   param -= dx;''', ('one_minus_rho', 'eps'))

_RMSPROP = '''ms = alpha * ms + (1 - alpha) * grad * grad;
               param -= lr * grad / ({});'''
RMSPROP = {
    inside: RuleKernel(
        'rmsprop' + ('_inside' if inside else ''),
        'T grad, T lr, T alpha, T eps', 'T param, T ms',
        _RMSPROP.format('sqrt(ms + eps)' if inside else 'sqrt(ms) + eps'),
        ('lr', 'alpha', 'eps'))
    for inside in (False, True)}

RMSPROP_GRAVES = RuleKernel(
    'rmsprop_graves', 'T grad, T lr, T alpha, T momentum, T eps',
    'T param, T avg_n, T avg_g, T delta',
    '''avg_n = alpha * avg_n + (1 - alpha) * grad * grad;
                   avg_g = alpha * avg_g + (1 - alpha) * grad;
                   delta = delta * momentum -
                       lr * grad * rsqrt(avg_n - avg_g * avg_g + eps);
                   param += delta;''', ('lr', 'alpha', 'momentum', 'eps'))

SMORMS3 = RuleKernel(
    'smorms3', 'T grad, T lr, T eps', 'T param, T mem, T g, T g2',
    '''T r, x;
                   r = 1 / (mem + 1);
                   g = (1 - r) * g + r * grad;
                   g2 = (1 - r) * g2 + r * grad * grad;
                   x = g * g / (g2 + eps);
                   param -= grad * min(lr, x) / (sqrt(g2) + eps);
                   mem = 1 + mem * (1 - x)
                   ''', ('lr', 'eps'))

_ADAM_IN = ('P grad, T alpha_t, T one_minus_beta1, T one_minus_beta2, '
            '%sT eps, T eta, T weight_decay_rate, raw T dummy')
_ADAM_BODY = {
    (True, True): """T grad_ = static_cast<T>(grad);
                       T m_ = static_cast<T>(m);
                       T v_ = static_cast<T>(v);
                       T vhat_ = static_cast<T>(vhat);
                       m_ += one_minus_beta1 * (grad_ - m_);
                       v_ += one_minus_beta2 * (grad_ * grad_ - v_);
                       vhat_ = max(vhat_, v_);
                       vhat = static_cast<T>(vhat_);
                       m = static_cast<P>(m_);
                       v = static_cast<P>(v_);
                       param -= eta *
                           (max(min(alpha_t / (sqrt(vhat_) + eps), upper),
                                lower) * m_ + weight_decay_rate * param);""",
    (False, True): """T grad_ = static_cast<T>(grad);
                       T m_ = static_cast<T>(m);
                       T v_ = static_cast<T>(v);
                       m_ += one_minus_beta1 * (grad_ - m_);
                       v_ += one_minus_beta2 * (grad_ * grad_ - v_);
                       m = static_cast<P>(m_);
                       v = static_cast<P>(v_);
                       param -= eta *
                           (max(min(alpha_t / (sqrt(v_) + eps), upper),
                                lower) * m_ + weight_decay_rate * param);""",
    (True, False): """T grad_ = static_cast<T>(grad);
                       T m_ = static_cast<T>(m);
                       T v_ = static_cast<T>(v);
                       T vhat_ = static_cast<T>(vhat);
                       m_ += one_minus_beta1 * (grad_ - m_);
                       v_ += one_minus_beta2 * (grad_ * grad_ - v_);
                       vhat_ = max(vhat_, v_);
                       vhat = static_cast<T>(vhat_);
                       m = static_cast<P>(m_);
                       v = static_cast<P>(v_);
                       param -= eta * (alpha_t * m_ / (sqrt(vhat_) + eps) +
                                       weight_decay_rate * param);""",
    (False, False): """T grad_ = static_cast<T>(grad);
                       T m_ = static_cast<T>(m);
                       T v_ = static_cast<T>(v);
                       m_ += one_minus_beta1 * (grad_ - m_);
                       v_ += one_minus_beta2 * (grad_ * grad_ - v_);
                       m = static_cast<P>(m_);
                       v = static_cast<P>(v_);
                       param -= eta * (alpha_t * m_ / (sqrt(v_) + eps) +
                                       weight_decay_rate * param);""",
}


def _adam(amsgrad, adabound):
    bounds = ('lower', 'upper') if adabound else ()
    name = {(False, False): 'adam', (True, False): 'adam_amsgrad',
            (False, True): 'adabound', (True, True): 'amsbound'}
    return RuleKernel(
        name[(amsgrad, adabound)],
        _ADAM_IN % ('T lower, T upper, ' if adabound else ''),
        'P param, P m, P v' + (', P vhat' if amsgrad else ''),
        _ADAM_BODY[(amsgrad, adabound)],
        ('alpha_t', 'one_minus_beta1', 'one_minus_beta2') + bounds +
        ('eps', 'eta', 'weight_decay_rate'), drop=('dummy',))


ADAM = {(ams, bound): _adam(ams, bound)
        for ams in (False, True) for bound in (False, True)}

# Hooks Chainer runs as an element-wise kernel of their own.
WEIGHT_DECAY = RuleKernel('weight_decay', 'T p, T decay', 'T g',
                          'g += decay * p', ('decay',))
LASSO = RuleKernel('lasso', 'T s, T decay', 'T g', 'g += decay * s',
                   ('decay',))

KERNELS = [SGD, MOMENTUM_SGD, NESTEROV_AG, CORRECTED_MOMENTUM_SGD, ADA_GRAD,
           ADA_DELTA, RMSPROP[False], RMSPROP[True], RMSPROP_GRAVES, SMORMS3,
           WEIGHT_DECAY, LASSO] + list(ADAM.values())


# -- the bits CuPy gives a host scalar ----------------------------------------

def legacy_scalars(cupy):
    """True where CuPy (13 and older) converts a scalar kernel argument
    through a C ``double``, and to float16 through ``float``
    (``internal.to_float16(<float>val)``: two roundings); False where it
    packs the scalar with NumPy's assignment (``PyArray_Pack``, CuPy's
    newer ``CScalar``: one rounding, as ``numpy.float16(x)``)."""
    core = getattr(cupy, '_core', None)
    scalar = getattr(core, '_scalar', None)
    if scalar is None:
        import importlib
        scalar = importlib.import_module(cupy.__name__ + '._core._scalar')
    return not hasattr(scalar, 'numpy_dtype_from_pyscalar')


FLOAT16 = numpy.dtype(numpy.float16)
FLOAT32 = numpy.dtype(numpy.float32)
FLOAT64 = numpy.dtype(numpy.float64)


def device_values(values, dtype, legacy):
    """``values`` (Python or NumPy real scalars) as CuPy passes each to a
    kernel parameter of type ``dtype``: an array of ``dtype``. Both of
    CuPy's conversions go through the value as a C double (exact for the
    Python floats, NumPy float scalars and small integers hyperparameters
    are), then round once to ``dtype``, except legacy float16, which
    rounds to float32 first."""
    a = numpy.array(values, dtype=FLOAT64)
    dtype = numpy.dtype(dtype)
    if legacy and dtype == FLOAT16:
        a = a.astype(FLOAT32)
    return a.astype(dtype)


# -- one host-to-device copy per step ----------------------------------------

class Layout(object):
    """Where each scalar of a step lives: one device buffer of float64,
    float32 and float16 runs (in that order, each aligned), one slice per
    segment. ``segments``: (dtype, count) in step order."""

    ORDER = (FLOAT64, FLOAT32, FLOAT16)

    def __init__(self, segments):
        self.segments = tuple((numpy.dtype(d), int(n)) for d, n in segments)
        counts = dict((d, 0) for d in self.ORDER)
        self.offsets = []
        for d, n in self.segments:
            if d not in counts:
                raise TypeError('no device scalars of %s' % d)
            self.offsets.append(counts[d])
            counts[d] += n
        self.counts = counts
        self.starts = {}
        pos = 0
        for d in self.ORDER:
            self.starts[d] = pos
            pos += counts[d] * d.itemsize
            pos = (pos + 7) // 8 * 8
        self.nbytes = max(pos, 8)

    def views(self, buf):
        """{dtype: flat array} over a buffer of ``nbytes`` bytes (a NumPy
        or CuPy uint8 array)."""
        return dict((d, buf[self.starts[d]:self.starts[d] +
                            self.counts[d] * d.itemsize].view(d))
                    for d in self.ORDER)

    def slices(self, views):
        """Each segment's slice of ``views``, in step order."""
        return [views[d][o:o + n]
                for (d, n), o in zip(self.segments, self.offsets)]

    def pack(self, host_views, values, legacy):
        """Write each segment's values (a list per segment, in step order)
        into the host views."""
        per = dict((d, []) for d in self.ORDER)
        for (d, n), vals in zip(self.segments, values):
            if len(vals) != n:
                raise ValueError('%d scalars for a slot of %d' % (
                    len(vals), n))
            per[d].extend(vals)
        for d, vals in per.items():
            if vals:
                host_views[d][:] = device_values(vals, d, legacy)


class ScalarRing(object):
    """The step's scalars: a device buffer that kernels (and graphs) read
    at a fixed address, written by one asynchronous copy per step from one
    of a ring of pinned host buffers. A host buffer is written again only
    once the copy that read it is done (its event, queried, never waited
    on); where every buffer is still in flight the ring grows, up to
    ``limit`` buffers, and only then waits for the oldest.

    ``backend``: ``pinned(nbytes)`` (a NumPy uint8 array in page-locked
    memory), ``device(nbytes)`` (a device uint8 array), ``copy(dst, src,
    nbytes)`` (asynchronous, on the current stream), ``event()``,
    ``record(event)``, ``done(event)`` and ``wait(event)``."""

    def __init__(self, layout, backend, legacy, size=2, limit=64):
        self.layout = layout
        self.backend = backend
        self.legacy = legacy
        self.limit = limit
        self.device = backend.device(layout.nbytes)
        self.device_views = layout.views(self.device)
        self.slices = layout.slices(self.device_views)
        self.slots = []          # [host uint8 array, its views, event]
        for _ in range(size):
            self._grow()
        self.next = 0
        self.copies = 0
        self.waits = 0           # times every buffer was in flight

    def _grow(self):
        host = self.backend.pinned(self.layout.nbytes)
        self.slots.append([host, self.layout.views(host), None])

    def _free_slot(self):
        n = len(self.slots)
        for k in range(n):
            i = (self.next + k) % n
            ev = self.slots[i][2]
            if ev is None or self.backend.done(ev):
                return i
        if n < self.limit:
            self._grow()
            return n
        i = self.next % n        # the oldest copy: wait for it
        self.waits += 1
        self.backend.wait(self.slots[i][2])
        return i

    def stage(self, values):
        """Write ``values`` (one list per segment, in step order) and copy
        them to the device buffer; returns the index of the host buffer
        used."""
        i = self._free_slot()
        slot = self.slots[i]
        self.layout.pack(slot[1], values, self.legacy)
        self.backend.copy(self.device, slot[0], self.layout.nbytes)
        ev = slot[2]
        if ev is None:
            ev = slot[2] = self.backend.event()
        self.backend.record(ev)
        self.next = (i + 1) % len(self.slots)
        self.copies += 1
        return i


class CupyStaging(object):
    """``ScalarRing``'s backend on CuPy."""

    def __init__(self, cupy):
        self.cupy = cupy

    def pinned(self, nbytes):
        mem = self.cupy.cuda.alloc_pinned_memory(nbytes)
        return numpy.frombuffer(mem, numpy.uint8, nbytes)

    def device(self, nbytes):
        return self.cupy.zeros(nbytes, numpy.uint8)

    def copy(self, dst, src, nbytes):
        dst.data.copy_from_host_async(ctypes.c_void_p(src.ctypes.data),
                                      nbytes)

    def event(self):
        return self.cupy.cuda.Event(block=False, disable_timing=True)

    def record(self, event):
        event.record()

    def done(self, event):
        return event.done

    def wait(self, event):
        event.synchronize()
