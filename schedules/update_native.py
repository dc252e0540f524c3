"""An update program's ops as one compiled C loop over its elements.

A ``update_rules.Program`` runs each op as a NumPy ufunc over the whole
range: Adam is 13 passes over memory, each reading and writing arrays of
the parameter's size. The same ops written as C statements in one loop
compute each element by the same IEEE operations (``+ - * /`` and the
square root, each correctly rounded) on the same operands, in the same
dtype and order: the same bits, in one pass (Adam on 1.8M float32
elements: 0.9 ms against NumPy's 2.8 ms on one core here). One exception:
an op whose two operands are both NaN returns one of them, and which one
(its sign and payload) follows the operand order the compiler chose, as
it does in NumPy's own builds (NumPy 1.26 and 2.5 differ there); a NaN
is a NaN either way.

What keeps the bits: no contraction of a product and a sum into a fused
multiply-add (``-ffp-contract=off``), no fast-math (no reassociation, no
flush of subnormals), a scalar cast to the op's dtype as NumPy casts a
Python float (round to nearest), every temporary held in the op's dtype.
Only programs of float32 or float64 arrays whose every op computes in
that dtype, of ``add subtract multiply true_divide sqrt``, are compiled;
others keep their NumPy ufuncs (``maximum``/``minimum``/``clip``/``sign``
differ among NumPy's own loops in which zero or NaN they return, and a
cast between dtypes is NumPy's). ``why_not(program)`` says why.

Floating-point exceptions: the loop clears the status flags and returns
those it raised; a raised flag is then reported through NumPy under the
calling thread's ``numpy.seterr`` state, by one small NumPy op that
raises it (a warning, an error, a call, as NumPy would; once per flag per
call, after the loop, not at the op).

The compiler is ``$CC`` or ``cc``; a shared object is built once per
source and kept in ``$STATIC_GRAPH_CACHE`` (default
``~/.cache/static_graph``; where that cannot be written, a private
temporary directory of the process); ``STATIC_GRAPH_NATIVE=0`` turns it
off. No compiler or a failed build leave the NumPy program
and say why (``status()``, ``explain_update``, and once in the
``static_graph`` logger at INFO). Framework-free: no Chainer here.
"""
import atexit
import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading

import numpy

from schedules import update_rules as K

FLAGS = ('-O3', '-std=c99', '-ffp-contract=off', '-fno-fast-math',
         '-fno-math-errno', '-fPIC', '-shared')
_OPS = {'add': '+', 'subtract': '-', 'multiply': '*', 'true_divide': '/'}
_CTYPE = {numpy.dtype(numpy.float32): ('float', 'sqrtf'),
          numpy.dtype(numpy.float64): ('double', 'sqrt')}

# fenv.h's flags on x86-64 and aarch64 glibc differ; the C side maps them
# to these bits.
_DIVIDE, _OVER, _UNDER, _INVALID = 1, 2, 4, 8


def enabled():
    """Not turned off by ``STATIC_GRAPH_NATIVE=0``."""
    return os.environ.get('STATIC_GRAPH_NATIVE', '1').strip() not in (
        '0', 'no', 'off', 'false', '')


def why_not(program):
    """Why ``program`` (an update_rules.Program) cannot be a C loop, or
    None where it can."""
    dtype = None
    for seg in program.segments:
        if seg.strong:
            return 'a scalar promotes past the arrays\' dtype'
        if seg.dtype not in _CTYPE:
            return 'arrays of %s' % seg.dtype.name
        if dtype is not None and seg.dtype != dtype:
            return 'arrays of two dtypes'
        dtype = seg.dtype
        for op, dt in zip(seg.kernel.ops, seg.temp_dtypes()):
            if op.fn not in _OPS and op.fn != 'sqrt':
                return 'NumPy\'s %s' % op.fn
            if dt is not None and dt != dtype:
                return 'a temporary of %s' % dt.name
    return None


def c_source(program):
    """The C function ``program`` becomes: ``int run(int64_t lo, int64_t
    hi, const double *S, char **A)``, ``A`` the data pointers of the
    program's array slots (``program.slots``, in that order), ``S`` its
    scalars by slot; it returns the exception flags its ops raised."""
    ctype, sqrt = _CTYPE[program.segments[0].dtype]
    arrays = {s: j for j, s in enumerate(program.slots)}
    scalars, guards, body = set(), set(), []
    for seg in program.segments:
        temps = sorted(set(op.out for op in seg.kernel.ops
                           if K.is_temp(op.out)))

        def operand(a, seg=seg):
            if not isinstance(a, str):
                return '((%s)%r)' % (ctype, float(a))
            if a.startswith('$'):
                scalars.add(seg.scalars[a[1:]])
                return 's%d' % seg.scalars[a[1:]]
            if K.is_temp(a):
                return a
            return 'x%d[i]' % arrays[seg.arrays[a]]

        # a segment's temporaries live in a block of their own
        body.append('{' + (' %s %s;' % (ctype, ', '.join(temps))
                           if temps else ''))
        for op in seg.kernel.ops:
            args = [operand(a) for a in op.args]
            if op.fn == 'sqrt':
                expr = '%s(%s)' % (sqrt, args[0])
            else:
                expr = '%s %s %s' % (args[0], _OPS[op.fn], args[1])
            line = '%s = %s;' % (operand(op.out), expr)
            if op.guard:
                g = seg.scalars[op.guard]
                guards.add(g)
                line = 'if (g%d) %s' % (g, line)
            body.append('    ' + line)
        body.append('}')
    lines = ['#include <fenv.h>', '#include <math.h>', '#include <stdint.h>',
             'int run(int64_t lo, int64_t hi, const double *S, char **A)',
             '{']
    lines += ['    %s *x%d = (%s *)A[%d];' % (ctype, j, ctype, j)
              for j in range(len(program.slots))]
    lines += ['    const %s s%d = (%s)S[%d];' % (ctype, s, ctype, s)
              for s in sorted(scalars)]
    lines += ['    const int g%d = S[%d] != 0;' % (g, g) for g in sorted(guards)]
    lines += ['    feclearexcept(FE_ALL_EXCEPT);',
              '    for (int64_t i = lo; i < hi; i++) {']
    lines += ['        ' + b for b in body]
    lines += ['    }',
              '    return (fetestexcept(FE_DIVBYZERO) ? %d : 0) |' % _DIVIDE,
              '        (fetestexcept(FE_OVERFLOW) ? %d : 0) |' % _OVER,
              '        (fetestexcept(FE_UNDERFLOW) ? %d : 0) |' % _UNDER,
              '        (fetestexcept(FE_INVALID) ? %d : 0);' % _INVALID,
              '}']
    return '\n'.join(lines) + '\n'


def scalar_slots(program):
    """The scalar slots the C function reads (``S`` must cover them)."""
    n = -1
    for seg in program.segments:
        for a in seg.scalars.values():
            n = max(n, a)
    return n + 1


# -- building and loading ------------------------------------------------------

_lock = threading.Lock()
_loaded = {}          # source digest -> ctypes function
_status = {'built': 0, 'loaded': 0, 'failed': None}


def status():
    """What the compiler did in this process: shared objects built and
    loaded from the cache, and the last failure (None if none)."""
    return dict(_status)


def compiler():
    """The C compiler's path, or None."""
    cc = os.environ.get('CC') or 'cc'
    return shutil.which(cc) or shutil.which('gcc') or shutil.which('clang')


def cache_dir():
    d = os.environ.get('STATIC_GRAPH_CACHE')
    if not d:
        base = os.environ.get('XDG_CACHE_HOME') or os.path.join(
            os.path.expanduser('~'), '.cache')
        d = os.path.join(base, 'static_graph')
    return os.path.join(d, 'native')


def load(source):
    """The compiled ``run`` of ``source``, built or found in the cache; a
    string (why) where that fails."""
    digest = hashlib.sha256(
        (source + ' '.join(FLAGS) + sys.platform +
         str(ctypes.sizeof(ctypes.c_void_p))).encode()).hexdigest()[:32]
    with _lock:
        fn = _loaded.get(digest)
        if fn is None:
            fn = _loaded[digest] = _build(source, digest)
        return fn


def _build(source, digest):
    cc = compiler()
    if cc is None:
        return _failed('no C compiler (cc, gcc, clang; or $CC)')
    d = cache_dir()
    path = os.path.join(d, 'update_%s.so' % digest)
    if not os.path.exists(path):
        try:
            os.makedirs(d, exist_ok=True)
            work = tempfile.mkdtemp(dir=d)
        except OSError:
            # A cache that cannot be written: this process's own private
            # directory (never a shared name another user could plant).
            d = _private_dir()
            path = os.path.join(d, 'update_%s.so' % digest)
            work = tempfile.mkdtemp(dir=d)
        try:
            src = os.path.join(work, 'update.c')
            with open(src, 'w') as f:
                f.write(source)
            out = os.path.join(work, 'update.so')
            try:
                r = subprocess.run([cc] + list(FLAGS) + ['-o', out, src,
                                                         '-lm'],
                                   stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, timeout=120)
            except (OSError, subprocess.TimeoutExpired) as e:
                return _failed('%s failed: %s' % (cc, e))
            if r.returncode != 0:
                msg = r.stdout.decode(errors='replace').strip()
                return _failed('%s failed: %s' % (
                    cc, msg.splitlines()[0] if msg else r.returncode))
            os.replace(out, path)        # atomic: other processes too
            _status['built'] += 1
        finally:
            shutil.rmtree(work, ignore_errors=True)
    else:
        _status['loaded'] += 1
    try:
        fn = ctypes.CDLL(path).run
    except OSError as e:
        return _failed('loading %s failed: %s' % (path, e))
    fn.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                   ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


_private = []


def _private_dir():
    if not _private:
        d = tempfile.mkdtemp(prefix='static_graph-native-')
        atexit.register(shutil.rmtree, d, True)
        _private.append(d)
    return _private[0]


def _failed(why):
    if _status['failed'] != why:
        logging.getLogger('static_graph').info(
            'captured update: NumPy ufuncs instead of C loops: %s', why)
    _status['failed'] = why
    return why


# -- running -------------------------------------------------------------------

_programs = {}


def program(prog):
    """(the Program to run, why it is not a C loop or None): a Program
    like ``prog`` (an update_rules.Program) whose ``fn`` runs the C loop
    (``native`` set; whole arrays, ``B == 0``, keep NumPy), else ``prog``
    itself and the reason."""
    if not enabled():
        return prog, 'turned off (STATIC_GRAPH_NATIVE=0)'
    got = _programs.get(prog)
    if got is None:
        got = _programs[prog] = _native(prog)
    return got


def _native(prog):
    why = why_not(prog)
    if why is not None:
        return prog, why
    source = c_source(prog)
    run = load(source)
    if isinstance(run, str):
        return prog, run
    slots = prog.slots
    nsc = scalar_slots(prog)
    dtype = prog.segments[0].dtype
    numpy_fn, temp_dtypes = prog.fn, prog.temp_dtypes
    Ptrs = ctypes.c_void_p * len(slots)
    Scalars = ctypes.c_double * max(nsc, 1)

    def fn(A, S, T, lo, hi, B):
        if B:
            arrays = [A[s] for s in slots]
            for a in arrays:
                if a.dtype is not dtype:
                    break
            else:
                # (c_double takes Python and NumPy numbers and bools)
                flags = run(lo, hi, Scalars(*S[:nsc]),
                            Ptrs(*[a.ctypes.data for a in arrays]))
                if flags:
                    report(flags, dtype)
                return
        if T is None:
            n = B or A[slots[0]].size
            T = tuple(numpy.empty(n, dt) for dt in temp_dtypes)
        return numpy_fn(A, S, T, lo, hi, B)

    return K.Program(fn, temp_dtypes, source, prog.segments, slots,
                     native=True), None


def report(flags, dtype):
    """Raise each flag through NumPy, under this thread's error state: the
    warning, error or call NumPy's own op would have given."""
    one = numpy.ones(1, dtype)
    big = numpy.full(1, numpy.finfo(dtype).max, dtype)
    tiny = numpy.full(1, numpy.finfo(dtype).tiny, dtype)
    if flags & _DIVIDE:
        numpy.true_divide(one, numpy.zeros(1, dtype))
    if flags & _OVER:
        numpy.multiply(big, big)
    if flags & _UNDER:
        numpy.multiply(tiny, tiny)
    if flags & _INVALID:
        numpy.sqrt(-one)
