"""A worker thread in C for the stream (stream.py): NumPy's own BLAS
products and element-wise sums, run without the GIL.

A Python worker thread hands the GIL back and forth with the caller's
thread around every NumPy call; a caller that runs small ops keeps
winning it, and the worker's results wait (measured: a PTB backward went
from 1.1 ms to 1.8 ms a call). This worker is a C thread that never takes
the GIL: the caller pushes tasks (one ctypes call each) and waits once.

Tasks, each the very computation NumPy runs:

* ``dot_task(a, b)``: ``a.dot(b)`` for 2-D float32/float64 operands that
  NumPy hands to BLAS's gemm (``cblas_matrixproduct``: both operands
  matrices, each C- or F-contiguous, not a matrix times its own
  transpose): the result allocated C-contiguous and zeroed, then the same
  ``cblas_?gemm`` call with the same arguments, in the OpenBLAS NumPy
  uses (its ILP64 entry point). Anything else: None (the caller runs it).
* ``add_task(g, x)``: ``numpy.add(g, x, out=x)`` over contiguous arrays
  of one shape and dtype: one correctly rounded addition per element,
  ``g[i] + x[i]``, built without contraction or fast-math (native.py);
  the floating-point exceptions raised are collected and handed to
  NumPy's error handling by ``wait``.
* ``bias_task(y, b)``: ``y += b`` for a C-contiguous matrix and a vector
  of its row's length, likewise.

Each task names the one it waits for (the product whose result a sum
reads). A caller that waits runs tasks the worker has not taken yet
itself, the last pushed first, so the two threads share what is left.
After its last task the worker spins for a while (``SPIN_US``) before it
sleeps, so a schedule's next push finds it awake. Framework-free.
"""
import ctypes
import os
import threading

import numpy

from schedules import native

SPIN_US = 400

_SOURCE = r'''
#define _POSIX_C_SOURCE 200809L
#include <fenv.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

typedef void (*sgemm64_t)(int, int, int, int64_t, int64_t, int64_t, float,
                          const float *, int64_t, const float *, int64_t,
                          float, float *, int64_t);
typedef void (*dgemm64_t)(int, int, int, int64_t, int64_t, int64_t, double,
                          const double *, int64_t, const double *, int64_t,
                          double, double *, int64_t);

typedef struct {
    int kind, ta, tb;
    int64_t m, n, k, lda, ldb, ldc, bytes;
    const void *a, *b;
    void *c;
    uint64_t ticket, dep;      /* its number; the task it waits for */
    int state;                 /* 0 pending, 1 running, 2 done */
} task_t;

#define RING 1024
static task_t ring[RING];
static uint64_t head, cursor, completed;     /* pushed, looked at, done */
static uint64_t helped;                      /* run by a waiting caller */
static int sleeping, waiting, flags, started;
static long spin_ns;
static sgemm64_t sgemm;
static dgemm64_t dgemm;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t push_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t work_cv = PTHREAD_COND_INITIALIZER;
static pthread_cond_t done_cv = PTHREAD_COND_INITIALIZER;

static long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}

/* o = g + x element by element; o = x + b, b one row, row by row */
#define ADD(T) {                                                        \
        const T *g = t->a, *x = t->b;                                   \
        T *o = t->c;                                                    \
        feclearexcept(FE_ALL_EXCEPT);                                   \
        for (int64_t i = 0; i < t->m; i++)                              \
            o[i] = g[i] + x[i];                                         \
        return FLAGS;                                                   \
    }
#define ADD_ROWS(T) {                                                   \
        const T *x = t->a, *b = t->b;                                   \
        T *o = t->c;                                                    \
        feclearexcept(FE_ALL_EXCEPT);                                   \
        for (int64_t i = 0; i < t->m; i++)                              \
            for (int64_t j = 0; j < t->n; j++)                          \
                o[i * t->n + j] = x[i * t->n + j] + b[j];               \
        return FLAGS;                                                   \
    }

static int run(const task_t *t) {
    switch (t->kind) {
    case 1:
        memset(t->c, 0, (size_t)t->bytes);
        sgemm(101, t->ta, t->tb, t->m, t->n, t->k, 1.f, t->a, t->lda,
              t->b, t->ldb, 0.f, t->c, t->ldc);
        return 0;
    case 2:
        memset(t->c, 0, (size_t)t->bytes);
        dgemm(101, t->ta, t->tb, t->m, t->n, t->k, 1., t->a, t->lda,
              t->b, t->ldb, 0., t->c, t->ldc);
        return 0;
    case 3: ADD(float)
    case 4: ADD(double)
    case 5: ADD_ROWS(float)
    case 6: ADD_ROWS(double)
    }
    return 0;
}

/* A slot is reused only once its task is done (sg_push): a ticket whose
   slot holds another is done. */
static int is_done(uint64_t ticket) {
    if (ticket == 0)
        return 1;
    task_t *t = &ring[(ticket - 1) % RING];
    if (__atomic_load_n(&t->ticket, __ATOMIC_ACQUIRE) != ticket)
        return 1;
    return __atomic_load_n(&t->state, __ATOMIC_ACQUIRE) == 2;
}

static int claim(task_t *t) {
    int pending = 0;
    return __atomic_compare_exchange_n(&t->state, &pending, 1, 0,
                                       __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
}

static void finish(task_t *t) {
    while (!is_done(t->dep))
        ;                         /* the other thread runs it */
    int f = run(t);
    if (f)
        __atomic_fetch_or(&flags, f, __ATOMIC_SEQ_CST);
    __atomic_store_n(&t->state, 2, __ATOMIC_SEQ_CST);
    __atomic_fetch_add(&completed, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&waiting, __ATOMIC_SEQ_CST)) {
        pthread_mutex_lock(&mu);
        pthread_cond_broadcast(&done_cv);
        pthread_mutex_unlock(&mu);
    }
}

/* Until *var is no longer seen: spinning for spin_ns, then asleep on cv
   (counted in *sleepers, for whoever changes *var to wake). */
static void await_change(uint64_t *var, uint64_t seen, int *sleepers,
                         pthread_cond_t *cv) {
    long until = now_ns() + spin_ns;
    while (__atomic_load_n(var, __ATOMIC_SEQ_CST) == seen && now_ns() < until)
        ;
    if (__atomic_load_n(var, __ATOMIC_SEQ_CST) != seen)
        return;
    pthread_mutex_lock(&mu);
    __atomic_fetch_add(sleepers, 1, __ATOMIC_SEQ_CST);
    while (__atomic_load_n(var, __ATOMIC_SEQ_CST) == seen)
        pthread_cond_wait(cv, &mu);
    __atomic_fetch_sub(sleepers, 1, __ATOMIC_SEQ_CST);
    pthread_mutex_unlock(&mu);
}

static void *worker(void *arg) {
    (void)arg;
    for (;;) {
        uint64_t c = __atomic_load_n(&cursor, __ATOMIC_SEQ_CST);
        if (__atomic_load_n(&head, __ATOMIC_SEQ_CST) == c) {
            await_change(&head, c, &sleeping, &work_cv);
            continue;
        }
        task_t *t = &ring[c % RING];
        int mine = claim(t);
        __atomic_store_n(&cursor, c + 1, __ATOMIC_SEQ_CST);
        if (mine)
            finish(t);
    }
    return 0;
}

int sg_start(void *s, void *d, long spin) {
    pthread_t th;
    if (started)
        return 0;
    for (int i = 0; i < RING; i++)
        ring[i].state = 2;
    sgemm = (sgemm64_t)s;
    dgemm = (dgemm64_t)d;
    spin_ns = spin;
    if (pthread_create(&th, 0, worker, 0))
        return -1;
    pthread_detach(th);
    started = 1;
    return 0;
}

uint64_t sg_push(int kind, int ta, int tb, int64_t m, int64_t n, int64_t k,
                 int64_t lda, int64_t ldb, int64_t ldc, int64_t bytes,
                 const void *a, const void *b, void *c, uint64_t dep) {
    pthread_mutex_lock(&push_mu);
    uint64_t h = head;
    task_t *t = &ring[h % RING];
    while (__atomic_load_n(&t->state, __ATOMIC_SEQ_CST) != 2 ||
           h - __atomic_load_n(&cursor, __ATOMIC_SEQ_CST) >= RING)
        ;                         /* full: the worker drains it */
    t->kind = kind; t->ta = ta; t->tb = tb;
    t->m = m; t->n = n; t->k = k;
    t->lda = lda; t->ldb = ldb; t->ldc = ldc; t->bytes = bytes;
    t->a = a; t->b = b; t->c = c;
    t->dep = dep;
    __atomic_store_n(&t->ticket, h + 1, __ATOMIC_SEQ_CST);
    __atomic_store_n(&t->state, 0, __ATOMIC_SEQ_CST);
    __atomic_store_n(&head, h + 1, __ATOMIC_SEQ_CST);
    pthread_mutex_unlock(&push_mu);
    if (__atomic_load_n(&sleeping, __ATOMIC_SEQ_CST)) {
        pthread_mutex_lock(&mu);
        pthread_cond_signal(&work_cv);
        pthread_mutex_unlock(&mu);
    }
    return h + 1;
}

/* Wait until the tasks first..last are done, running those the worker
   has not taken yet itself, the last first (each once its own wait is
   over); the exceptions raised since the last call. */
int sg_wait(uint64_t first, uint64_t last) {
    for (;;) {
        uint64_t i, seen = __atomic_load_n(&completed, __ATOMIC_SEQ_CST);
        int all = 1, ran = 0;
        for (i = last; i >= first && i > 0; i--)
            if (!is_done(i)) {
                all = 0;
                break;
            }
        if (all)
            break;
        for (i = last; i >= first && i > 0; i--) {
            task_t *t = &ring[(i - 1) % RING];
            if (__atomic_load_n(&t->ticket, __ATOMIC_SEQ_CST) != i ||
                __atomic_load_n(&t->state, __ATOMIC_SEQ_CST) != 0 ||
                !is_done(t->dep) || !claim(t))
                continue;
            finish(t);
            __atomic_fetch_add(&helped, 1, __ATOMIC_SEQ_CST);
            ran = 1;
            break;
        }
        if (!ran)
            await_change(&completed, seen, &waiting, &done_cv);
    }
    return __atomic_exchange_n(&flags, 0, __ATOMIC_SEQ_CST);
}

uint64_t sg_helped(void) {
    return __atomic_load_n(&helped, __ATOMIC_SEQ_CST);
}
'''.replace('FLAGS', '(%s)' % native.FLAGS_C.replace('\n', ' '))

_NO_TRANS, _TRANS = 111, 112
_GEMM = {numpy.dtype(numpy.float32): 1, numpy.dtype(numpy.float64): 2}
_ADD = {numpy.dtype(numpy.float32): 3, numpy.dtype(numpy.float64): 4}
_ADD_ROWS = {numpy.dtype(numpy.float32): 5, numpy.dtype(numpy.float64): 6}

# NumPy 1 wheels export OpenBLAS's own names; NumPy 2's scipy-openblas
# prefixes them.
OPENBLAS_PREFIXES = ('', 'scipy_')

_state = []      # [(push, wait)] or [why not], once per process
_helped = []
_lock = threading.Lock()


def worker():
    """(push, wait) of the process's C worker, or a string: why there is
    none (no compiler, no OpenBLAS entry point of NumPy's)."""
    if not _state or (not isinstance(_state[0], str) and
                      _state[0][2] != os.getpid()):
        with _lock:
            if not _state or (not isinstance(_state[0], str) and
                              _state[0][2] != os.getpid()):
                _state[:] = [_start()]
    s = _state[0]
    return s if isinstance(s, str) else s[:2]


def helped():
    """How many tasks a waiting caller ran itself (for tests)."""
    return _helped[0]() if _helped else 0


def _start():
    if not native.enabled():
        return 'compiled loops are off (STATIC_GRAPH_NATIVE=0)'
    gemms = _numpy_gemms()
    if gemms is None:
        return 'no ILP64 OpenBLAS gemm of NumPy\'s found'
    lib = native.load(_SOURCE)
    if isinstance(lib, str):
        return lib
    if _state and not isinstance(_state[0], str):
        # After a fork: the library's thread is gone, its counters not.
        return 'a forked process (the worker thread stayed in the parent)'
    lib.sg_start.argtypes = [ctypes.c_void_p, ctypes.c_void_p,
                             ctypes.c_long]
    lib.sg_start.restype = ctypes.c_int
    i64, p = ctypes.c_int64, ctypes.c_void_p
    lib.sg_push.argtypes = [ctypes.c_int] * 3 + [i64] * 7 + [p] * 3 + [
        ctypes.c_uint64]
    lib.sg_push.restype = ctypes.c_uint64
    lib.sg_wait.argtypes = [ctypes.c_uint64] * 2
    lib.sg_wait.restype = ctypes.c_int
    lib.sg_helped.restype = ctypes.c_uint64
    _helped.append(lib.sg_helped)
    if lib.sg_start(gemms[0], gemms[1], SPIN_US * 1000) != 0:
        return 'the worker thread did not start'
    return lib.sg_push, lib.sg_wait, os.getpid()


def loaded_openblas():
    """Paths of the OpenBLAS libraries mapped into this process."""
    paths = []
    try:
        with open('/proc/self/maps') as f:
            for line in f:
                parts = line.split()
                if len(parts) < 6:
                    continue
                path = parts[-1]
                if ('openblas' in os.path.basename(path).lower()
                        and '.so' in path and path not in paths):
                    paths.append(path)
    except OSError:
        pass
    return paths


def _numpy_gemms():
    """Addresses of (cblas_sgemm, cblas_dgemm) of the ILP64 OpenBLAS that
    NumPy calls, or None."""
    numpy_dir = os.path.dirname(os.path.dirname(numpy.__file__))
    paths = [p for p in loaded_openblas() if p.startswith(numpy_dir)]
    mode = getattr(os, 'RTLD_NOLOAD', 0) | getattr(os, 'RTLD_LAZY', 0)
    for path in paths:
        try:
            lib = ctypes.CDLL(path, mode=mode)
        except OSError:
            continue
        for prefix in OPENBLAS_PREFIXES:
            try:
                fns = [getattr(lib, '%scblas_%sgemm64_' % (prefix, t))
                       for t in 'sd']
            except AttributeError:
                continue
            return [ctypes.cast(f, ctypes.c_void_p).value for f in fns]
    return None


def dot_task(a, b):
    """(task arguments, result) for ``a.dot(b)`` as NumPy's gemm call, or
    None where NumPy would take another path."""
    if type(a) is not numpy.ndarray or type(b) is not numpy.ndarray or \
            a.ndim != 2 or b.ndim != 2 or a.dtype != b.dtype or \
            a.dtype not in _GEMM:
        return None
    (l, m), (m2, n) = a.shape, b.shape
    if m != m2 or min(l, m, n) < 2:
        return None       # vectors, scalars: gemv, axpy, dot
    fa, fb = a.flags, b.flags
    if not (fa.c_contiguous or fa.f_contiguous) or \
            not (fb.c_contiguous or fb.f_contiguous) or \
            not fa.aligned or not fb.aligned:
        return None       # NumPy copies it first
    ta = _TRANS if fa.f_contiguous else _NO_TRANS
    tb = _TRANS if fb.f_contiguous else _NO_TRANS
    if (ta == _TRANS) != (tb == _TRANS) and \
            a.ctypes.data == b.ctypes.data and a.shape == b.shape[::-1] \
            and a.strides == b.strides[::-1]:
        return None       # a matrix times its transpose: syrk
    lda = l if ta == _TRANS else m
    ldb = m if tb == _TRANS else n
    out = numpy.empty((l, n), a.dtype)
    return ((_GEMM[a.dtype], ta, tb, l, n, m, lda, ldb, n, out.nbytes,
             a.ctypes.data, b.ctypes.data, out.ctypes.data), out)


def add_task(g, x):
    """(task arguments, x) for ``numpy.add(g, x, out=x)`` over
    C-contiguous arrays of one shape and float dtype, x its own writable
    memory; else None."""
    if type(g) is not numpy.ndarray or type(x) is not numpy.ndarray or \
            g.dtype != x.dtype or x.dtype not in _ADD or \
            g.shape != x.shape or not g.flags.c_contiguous or \
            not x.flags.c_contiguous or not x.flags.writeable or \
            x.base is not None:
        return None
    return ((_ADD[x.dtype], 0, 0, x.size, 0, 0, 0, 0, 0, 0,
             g.ctypes.data, x.ctypes.data, x.ctypes.data), x)


def bias_task(y, b):
    """Task arguments for ``y += b`` (``numpy.add(y, b, out=y)``): y a
    C-contiguous float matrix of its own, b a contiguous vector of y's
    row length and dtype; else None."""
    if type(b) is not numpy.ndarray or b.dtype != y.dtype or \
            y.dtype not in _ADD_ROWS or y.ndim != 2 or b.ndim != 1 or \
            b.shape[0] != y.shape[1] or not y.flags.c_contiguous or \
            not b.flags.c_contiguous:
        return None
    return (_ADD_ROWS[y.dtype], 0, 0, y.shape[0], y.shape[1], 0, 0, 0, 0,
            0, y.ctypes.data, b.ctypes.data, y.ctypes.data)
