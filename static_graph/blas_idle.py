"""OpenBLAS's idle worker threads, told to sleep soon instead of spinning.

After each matrix product, OpenBLAS's worker threads busy-wait for the
next one before they sleep: 2**28 CPU cycles by default (about 0.1 s), so
in a training loop they never sleep and hold every core but the caller's.
A captured optimizer update split across threads (``capture_update``)
then runs its second half on a core a spinning BLAS thread holds, and
gains nothing. ``quiet()`` sets that wait to 2**4 cycles, as
``OPENBLAS_THREAD_TIMEOUT=4`` in the environment would have done at start:
it asks the loaded OpenBLAS to read its environment again and stops its
worker threads; the next matrix product starts them afresh with the short
wait. Results do not change (the same kernels run on the same threads);
only the idle threads sleep.

It is done once per process, and not at all where the user set
``OPENBLAS_THREAD_TIMEOUT`` themselves, where NumPy's BLAS is not OpenBLAS,
or where the library does not export the entry points it takes (NumPy 2's
wheels keep them private); ``quiet()`` says which libraries it changed.
It runs on the thread that calls it while no matrix product is in flight on
another thread (the captured update calls it at its first split step).
"""
import ctypes
import os
import threading

from schedules import blas_stream

ENV = 'OPENBLAS_THREAD_TIMEOUT'
LOG2_CYCLES = 4             # OpenBLAS's lowest
DEFAULT_LOG2_CYCLES = 28    # OpenBLAS's THREAD_TIMEOUT when the env is unset
_PREFIXES = blas_stream.OPENBLAS_PREFIXES
_loaded_openblas = blas_stream.loaded_openblas
_NAMES = ('openblas_read_env', 'blas_thread_shutdown_',
          'openblas_thread_timeout')

_lock = threading.Lock()
_state = None               # the result of the first quiet()


def _int_functions(path, names, suffixes=('',)):
    """The functions ``names`` (no arguments, an int result) of the
    OpenBLAS mapped at ``path``, under the first prefix and suffix that
    has them all; or None."""
    mode = getattr(os, 'RTLD_NOLOAD', 0) | getattr(os, 'RTLD_LAZY', 0)
    try:
        lib = ctypes.CDLL(path, mode=mode)
    except OSError:
        return None
    for prefix in _PREFIXES:
        for suffix in suffixes:
            try:
                fns = [getattr(lib, prefix + name + suffix) for name in names]
            except AttributeError:
                continue
            for fn in fns:
                fn.restype = ctypes.c_int
                fn.argtypes = []
            return fns
    return None


def _entry_points(path):
    return _int_functions(path, _NAMES)


def quiet():
    """Make OpenBLAS's idle threads sleep after 2**4 cycles (once per
    process); returns a sentence saying what was done or why not."""
    global _state
    with _lock:
        if _state is None:
            _state = _quiet()
        return _state


def _quiet():
    user = os.environ.get(ENV)
    if user is not None:
        return 'OpenBLAS idle threads: %s=%s set by the user, kept' % (
            ENV, user)
    paths = _loaded_openblas()
    if not paths:
        return 'OpenBLAS idle threads: no OpenBLAS loaded, nothing to do'
    done, left = [], []
    for path in paths:
        fns = _entry_points(path)
        if fns is not None:
            read_env, shutdown, timeout = fns
            os.environ[ENV] = str(LOG2_CYCLES)
            try:
                read_env()
            finally:
                del os.environ[ENV]
            if timeout() == LOG2_CYCLES:
                shutdown()
                done.append(os.path.basename(path))
                continue
        left.append(os.path.basename(path))
    said = []
    if done:
        said.append('sleep after 2**%d cycles instead of spinning (default '
                    '2**%d) for the cores the split needs: %s' % (
                        LOG2_CYCLES, DEFAULT_LOG2_CYCLES, ', '.join(done)))
    if left:
        said.append('left spinning (no entry points to change their wait; '
                    'NumPy 2 wheels hide them): %s' % ', '.join(left))
    return 'OpenBLAS idle threads: ' + '; '.join(said)


def state():
    """What ``quiet()`` did, or None where it has not run."""
    return _state


_get_threads = []        # [the numpy BLAS's get_num_threads, or None]


def numpy_blas_threads():
    """How many threads the OpenBLAS NumPy calls uses for a product, or
    None where that cannot be read (another BLAS, no such entry point)."""
    if not _get_threads:
        _get_threads.append(_find_get_threads())
    fn = _get_threads[0]
    return None if fn is None else fn()


def _find_get_threads():
    paths = _loaded_openblas()
    # NumPy's own first (SciPy may map another OpenBLAS)
    paths.sort(key=lambda p: '/numpy' not in p)
    for path in paths:
        fns = _int_functions(path, ('openblas_get_num_threads',),
                             ('', '64_'))
        if fns is not None:
            return fns[0]
    return None
