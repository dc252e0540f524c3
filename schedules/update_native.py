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

Only programs of float32 or float64 arrays whose every op computes in
that dtype, of ``add subtract multiply true_divide sqrt``, are compiled
(``schedules/native.py`` says what keeps the bits); others keep their
NumPy ufuncs (``maximum``/``minimum``/``clip``/``sign`` differ among
NumPy's own loops in which zero or NaN they return, and a cast between
dtypes is NumPy's). ``program(prog)`` gives the compiled program or says
why not. A call whose operands the loop would not treat as the ufuncs do
(``_loop_gives_numpys``: a scalar NumPy would not cast down, one the C
cast would round twice, an array of another dtype or read-only) runs the
ufuncs, and so does a step under ``numpy.seterr(...='raise')``
(``parallel.Phases.run_phase``: NumPy raises at the op that errs, before
the ops after it write; a loop could only report after its last). A floating-point exception the loop raised is
reported through NumPy's error handling after the loop
(``native.report``). Framework-free.
"""
import ctypes

import numpy

from schedules import native
from schedules import update_rules as K

_OPS = {'add': '+', 'subtract': '-', 'multiply': '*', 'true_divide': '/'}
_CTYPE = {numpy.dtype(numpy.float32): ('float', 'sqrtf'),
          numpy.dtype(numpy.float64): ('double', 'sqrt')}


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
    lines += ['    }', '    return %s;' % native.FLAGS_C, '}']
    return '\n'.join(lines) + '\n'


def scalar_slots(program):
    """The scalar slots the C function reads (``S`` must cover them)."""
    n = -1
    for seg in program.segments:
        for a in seg.scalars.values():
            n = max(n, a)
    return n + 1


# -- running -------------------------------------------------------------------

_programs = {}


def program(prog):
    """(the Program to run, why it is not a C loop or None): a Program
    like ``prog`` (an update_rules.Program) whose ``fn`` runs the C loop
    (``native`` set; whole arrays, ``B == 0``, keep NumPy), else ``prog``
    itself and the reason."""
    if not native.enabled():
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
    lib = native.load(source)
    if isinstance(lib, str):
        return prog, lib
    run = lib.run
    run.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                    ctypes.c_void_p]
    run.restype = ctypes.c_int
    slots = prog.slots
    nsc = scalar_slots(prog)
    values, written = _operands(prog)
    dtype = prog.segments[0].dtype
    numpy_fn, temp_dtypes = prog.fn, prog.temp_dtypes
    Ptrs = ctypes.c_void_p * len(slots)
    Scalars = ctypes.c_double * max(nsc, 1)

    # NumPy 1 widens a float scalar of this magnitude (K.weak)
    bound = K.VALUE_BOUND.get(dtype) if K.VALUE_BASED else None

    def fn(A, S, T, lo, hi, B):
        if B:
            arrays = [A[s] for s in slots]
            if _loop_gives_numpys(arrays, S, dtype, values, written, bound):
                # (c_double takes Python and NumPy numbers and bools)
                flags = run(lo, hi, Scalars(*S[:nsc]),
                            Ptrs(*[a.ctypes.data for a in arrays]))
                if flags:
                    native.report(flags, dtype)
                return
        if T is None:
            shape = A[slots[0]].shape if not B else (B,)
            T = tuple(numpy.empty(shape, dt) for dt in temp_dtypes)
        return numpy_fn(A, S, T, lo, hi, B)

    # (its ufuncs run instead under numpy.seterr(...='raise'): run_phase)
    return K.Program(fn, temp_dtypes, source, prog.segments, slots,
                     ufuncs=prog), None


def _operands(prog):
    """The scalar slots the program computes with (not its guards), and
    the positions in ``prog.slots`` of the arrays it writes."""
    values, written = set(), set()
    for seg in prog.segments:
        for op in seg.kernel.ops:
            values.update(seg.scalars[a[1:]] for a in op.args
                          if isinstance(a, str) and a.startswith('$'))
            if not K.is_temp(op.out):
                written.add(prog.slots.index(seg.arrays[op.out]))
    return tuple(sorted(values)), tuple(sorted(written))


def _loop_gives_numpys(arrays, S, dtype, values, written, bound):
    """Does the loop compute what the ufuncs would on these operands? Not
    where an array is of another dtype (the ufuncs cast) or read-only
    (they raise), or where a scalar would make NumPy compute in a wider type
    (a NumPy float64 scalar under NumPy 2, a float of magnitude ``bound``
    or more under NumPy 1: the ufunc casts the result down instead) or is
    not a number the C cast rounds once."""
    for a in arrays:
        if a.dtype != dtype:
            return False
    for j in written:
        if not arrays[j].flags.writeable:
            return False
    for k in values:
        v = S[k]
        t = type(v)
        if t is float:
            if bound is not None and not -bound < v < bound and \
                    v - v == 0:         # (finite)
                return False
        elif t is int:
            if not -_EXACT <= v <= _EXACT:
                return False
        elif t is not bool and not _plain_number(v, dtype):
            return False
    return True


_EXACT = 2 ** 53       # integers a double holds exactly


def _plain_number(v, dtype):
    """A NumPy scalar or 0-d array that the double ctypes passes holds
    exactly and that NumPy casts down to ``dtype``."""
    if isinstance(v, numpy.ndarray):
        if v.ndim != 0:
            return False
        v = v[()]
    if isinstance(v, numpy.integer):
        return -_EXACT <= int(v) <= _EXACT and K.weak(v, dtype)
    return isinstance(v, (numpy.floating, numpy.bool_)) and \
        v.dtype.itemsize <= 8 and K.weak(v, dtype)
