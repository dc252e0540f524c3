"""A stand-in for CuPy on NumPy, enough for the captured update's CuPy path
(``static_graph.update_cupy``) to run on a CPU: its arrays are a NumPy
subclass named ``cupy.ndarray``, an ``ElementwiseKernel`` runs its C body
translated line by line into NumPy operations, the stream, events and
pinned memory do their work at once. It shows the plumbing (which scalar
reaches which kernel, the order of the ops, the fp32 copies, the staging
copy), not CUDA's arithmetic: compare with tolerances."""
import ctypes
import re
import types

import numpy


class ndarray(numpy.ndarray):
    """A 'device' array: NumPy memory, CuPy's ``device`` and ``data``."""

    @property
    def device(self):
        return types.SimpleNamespace(id=0)

    @property
    def data(self):
        return _Ptr(self)


ndarray.__module__ = 'cupy'


class _Ptr(object):
    def __init__(self, a):
        self.a = a
        self.ptr = a.__array_interface__['data'][0]

    def copy_from_host_async(self, mem, size):
        ctypes.memmove(self.ptr, mem.value, size)


def asarray(a):
    return numpy.asarray(a).view(ndarray)


def zeros(n, dtype):
    return numpy.zeros(n, dtype).view(ndarray)


def empty(shape, dtype):
    return numpy.empty(shape, dtype).view(ndarray)


def zeros_like(a):
    return numpy.zeros_like(a).view(ndarray)


def copyto(dst, src):
    numpy.copyto(dst, src, casting='same_kind')


sign = numpy.sign
sqrt = numpy.sqrt
true_divide = numpy.true_divide
where = numpy.where


def clip(a, lo, hi, out=None):
    return numpy.clip(a, lo, hi, out=out)


linalg = types.SimpleNamespace(norm=numpy.linalg.norm)


class ElementwiseKernel(object):
    """Runs the C body as NumPy statements over whole arrays."""

    def __init__(self, in_params, out_params, operation, name):
        self.ins = [p.split() for p in in_params.split(',')]
        self.outs = [p.split() for p in out_params.split(',')]
        self.lines = _translate(operation)
        self.name = name
        self.calls = 0

    def __call__(self, *args):
        self.calls += 1
        env = {'sqrt': numpy.sqrt, 'max': numpy.maximum,
               'min': numpy.minimum, 'rsqrt': lambda x: 1 / numpy.sqrt(x)}
        types_ = {}
        for spec, a in zip(self.ins + self.outs, args):
            name, t = spec[-1], spec[-2]
            if isinstance(a, numpy.ndarray):
                types_.setdefault(t, a.dtype.type)
        for spec, a in zip(self.ins + self.outs, args):
            name, t = spec[-1], spec[-2]
            if 'raw' in spec or not isinstance(a, numpy.ndarray):
                env[name] = a if isinstance(a, numpy.ndarray) else \
                    types_[t](a)
            else:
                env[name] = numpy.array(a)       # a working copy
        env.update(types_)
        env['static_cast'] = None
        for line in self.lines:
            exec(line, env)
        for spec, a in zip(self.outs, args[len(self.ins):]):
            a[...] = env[spec[-1]]


_CAST = re.compile(r'static_cast<(\w+)>')


def _translate(body):
    out = []
    for stmt in body.replace('\n', ' ').split(';'):
        s = stmt.strip()
        if not s:
            continue
        s = _CAST.sub(r'\1', s)
        m = re.match(r'^(?:const\s+)?([A-Z])\s+(\w+)\s*(=.*)?$', s)
        if m:
            if m.group(3) is None:
                continue                     # T r, x; (a declaration)
            s = m.group(2) + ' ' + m.group(3)
        elif re.match(r'^[A-Z]\s+\w+\s*,', s):
            continue
        out.append(s)
    return out


class _Device(object):
    def __init__(self, i=0):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _Event(object):
    def __init__(self, block=False, disable_timing=False):
        self.done = True

    def record(self):
        self.done = True

    def synchronize(self):
        pass


def _pinned(n):
    return bytearray(n)


cuda = types.SimpleNamespace(Device=_Device, Event=_Event,
                             alloc_pinned_memory=_pinned)
_core = types.SimpleNamespace(_scalar=types.SimpleNamespace(
    numpy_dtype_from_pyscalar=None))
