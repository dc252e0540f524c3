"""What a CUDA-graph capture on CuPy must refuse, and CuPy's cuBLAS binding
made to work while capturing.

``Guard`` is entered around a capture on the capturing thread: it refuses
what a graph cannot repeat and CUDA would let pass (transfers from host
memory, random draws from CuPy's or the host's generators), and routes the
GEMMs CuPy's matrix products use to cuBLAS directly (CuPy's own binding
refuses any cuBLAS call while a stream captures).
"""
import ctypes
import os
import threading


class NotCapturable(Exception):
    """Why a schedule runs launch by launch instead of as a graph."""


class Guard(object):
    """While a schedule is captured on this thread: refuse what a graph
    cannot repeat and CUDA would let pass (transfers from host memory,
    random draws), by hooks on CuPy's pinned-memory allocator and its
    random generators."""

    def __init__(self, cupy):
        self.cupy = cupy
        self.thread = threading.get_ident()
        self.undo = []

    def _mine(self):
        return threading.get_ident() == self.thread

    def __enter__(self):
        cupy = self.cupy
        pinned = cupy.get_default_pinned_memory_pool().malloc
        guard = self

        def pinned_malloc(size):
            if guard._mine():
                raise NotCapturable(
                    'a kernel copies from host memory (%d bytes through '
                    'pinned memory): a graph would copy that host buffer '
                    'again at every replay' % size)
            return pinned(size)

        cupy.cuda.set_pinned_memory_allocator(pinned_malloc)
        self.undo.append(
            lambda: cupy.cuda.set_pinned_memory_allocator(pinned))
        self._hook_random()
        self._hook_cublas()
        self._host_rng = _host_random_states()
        return self

    def _hook_cublas(self):
        """CuPy refuses any cuBLAS call while a stream captures (its
        ``setStream`` raises NotImplementedError; cuBLAS itself supports
        capture). Its matrix products reach cuBLAS through attributes of
        ``cupy_backends.cuda.libs.cublas`` looked up at each call, so while
        capturing, the GEMM entry points CuPy uses go to the same cuBLAS
        functions of the same library, on the same handle and with the same
        arguments, through ctypes, after setting the handle's stream
        without that check. (The first replay's comparison with the run
        launch by launch stands behind this too.)"""
        try:
            from cupy_backends.cuda.libs import cublas
            lib = _cublas_library()
        except Exception:   # no cuBLAS: nothing calls it
            return
        cupy = self.cupy
        guard = self
        for name, (symbol, sig) in _CUBLAS_GEMMS.items():
            old = getattr(cublas, name, None)
            fn = getattr(lib, symbol, None)
            if old is None or fn is None:
                continue
            fn.restype = ctypes.c_int
            fn.argtypes = [_CTYPES[c] for c in sig]

            def direct(handle, *args, _fn=fn, _old=old, _name=symbol):
                if not guard._mine():
                    return _old(handle, *args)
                stream = cupy.cuda.get_current_stream().ptr
                status = lib.cublasSetStream_v2(handle, stream)
                if status == 0:
                    status = _fn(handle, *args)
                if status != 0:
                    raise NotCapturable('%s returned cuBLAS status %d while '
                                        'capturing' % (_name, status))

            setattr(cublas, name, direct)
            self.undo.append(
                lambda name=name, old=old: setattr(cublas, name, old))

    def _hook_random(self):
        import cupy.random._generator as generator
        guard = self

        def refuse(name, inner):
            def hooked(*a, **k):
                if guard._mine():
                    raise NotCapturable(
                        'it draws random numbers from CuPy (%s): a graph '
                        'would not advance the generator as a launch from '
                        'Python does' % name)
                return inner(*a, **k)
            return hooked

        cls = generator.RandomState
        old_seed = cls.__dict__['_get_seed']
        cls._get_seed = refuse('RandomState', old_seed)
        self.undo.append(lambda: setattr(cls, '_get_seed', old_seed))
        try:
            from cupy_backends.cuda.libs import curand
            names = [n for n in dir(curand) if n.startswith('generate')]
        except Exception:   # no cuRAND: nothing draws from it
            return
        for n in names:
            old = getattr(curand, n)
            try:
                setattr(curand, n, refuse('cuRAND ' + n, old))
            except (AttributeError, TypeError):   # a read-only module
                continue
            self.undo.append(
                lambda n=n, old=old: setattr(curand, n, old))

    def check(self):
        """After the captured run: did it draw from NumPy's or Python's
        global generator (a host value the graph would freeze)?"""
        if _host_random_states() != self._host_rng:
            raise NotCapturable(
                'it draws random numbers on the host (NumPy\'s or Python\'s '
                'global generator): a graph would repeat the first draw')

    def __exit__(self, *exc):
        while self.undo:
            self.undo.pop()()
        return False


def _host_random_states():
    import random
    import numpy
    st = numpy.random.get_state()
    return (st[0], st[1].tobytes(), st[2:], random.getstate())


# cuBLAS GEMM entry points of CuPy's binding -> (C symbol, argument kinds:
# h handle, p pointer, i int, q 64-bit int), as cublas_api.h declares them.
_CUBLAS_GEMMS = {
    'gemmEx': ('cublasGemmEx', 'hiiiiippiipiippiiii'),
    'gemmStridedBatchedEx': ('cublasGemmStridedBatchedEx',
                             'hiiiiippiiqpiiqppiiqiii'),
    'gemmBatchedEx': ('cublasGemmBatchedEx', 'hiiiiippiipiippiiiii'),
    'sgemmEx': ('cublasSgemmEx', 'hiiiiippiipiippii'),
    'sgemm': ('cublasSgemm_v2', 'hiiiiippipippi'),
    'dgemm': ('cublasDgemm_v2', 'hiiiiippipippi'),
    'sgemmBatched': ('cublasSgemmBatched', 'hiiiiippipippii'),
    'dgemmBatched': ('cublasDgemmBatched', 'hiiiiippipippii'),
    'sgemmStridedBatched': ('cublasSgemmStridedBatched',
                            'hiiiiippiqpiqppiqi'),
    'dgemmStridedBatched': ('cublasDgemmStridedBatched',
                            'hiiiiippiqpiqppiqi'),
}
_CTYPES = {'h': ctypes.c_void_p, 'p': ctypes.c_void_p, 'i': ctypes.c_int,
           'q': ctypes.c_longlong}
_cublas_lib = []


def _cublas_library():
    """The libcublas this process loaded (CuPy's), through ctypes."""
    if not _cublas_lib:
        path = None
        with open('/proc/self/maps') as f:
            for line in f:
                name = line.rsplit(None, 1)[-1]
                if os.path.basename(name).startswith('libcublas.so'):
                    path = name
                    break
        if path is None:
            raise OSError('libcublas is not loaded')
        lib = ctypes.CDLL(path)
        lib.cublasSetStream_v2.restype = ctypes.c_int
        lib.cublasSetStream_v2.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        _cublas_lib.append(lib)
    return _cublas_lib[0]
