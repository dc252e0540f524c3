"""Element-wise optimizer update rules as op sequences, and their compiler.

Each rule (or gradient hook) is a ``Kernel``: a short straight-line program
of NumPy ufunc calls over named arrays (``param``, ``grad``, the rule's
state arrays by their state-dictionary names), temporaries ``t0, t1, ...``
and per-step scalars ``$name``. The op sequences below are Chainer 7.8.1's
``update_core_cpu`` (and its hooks) written out one ufunc at a time, in the
same order, on the same operands: ``v -= lr * grad`` is ``t0 =
multiply($lr, grad)`` then ``v = subtract(v, t0)``. Writing a result into
the array it updates (``out=``), and into a preallocated temporary instead
of a fresh one, gives the same bits: each element's value is computed by the
same IEEE operation on the same operands, in the same dtype. Temporaries
take the dtype of the arrays of their kernel (but see below).

A scalar that NumPy does not cast down to the arrays' dtype (a NumPy
float64 scalar times a float32 array, under NumPy 2's promotion rules) makes
the temporaries it feeds wider, as NumPy would: a Segment names such
``strong`` scalars and the dtype they promote to, and ``temp_dtypes`` works
out each temporary's dtype op by op; writing a wider temporary into an array
casts it back as Chainer's in-place operator does.

Because every op is element-wise, a kernel run on a slice of the flattened
arrays computes that slice exactly as a run on the whole arrays would:
``compile_program`` turns a sequence of kernels into one Python function
that walks a range of elements in blocks (so that a block's operands stay in
cache across the ops), and a caller may split the range across threads.

This module knows nothing about Chainer.
"""
import ast
import re

import numpy


class Op(object):
    """``out = fn(*args)``, run when the scalar ``guard`` (if any) is
    true. Operands: array names, temporaries (``t0``...), scalars
    (``$name``) and number literals."""

    __slots__ = ('fn', 'out', 'args', 'guard')

    def __init__(self, fn, out, args, guard=None):
        self.fn = fn
        self.out = out
        self.args = tuple(args)
        self.guard = guard

    def text(self):
        s = '%s = %s(%s)' % (self.out, self.fn,
                             ', '.join(_arg_text(a) for a in self.args))
        return 'if $%s: %s' % (self.guard, s) if self.guard else s


def _arg_text(a):
    return a if isinstance(a, str) else repr(a)


_LINE = re.compile(r'^(?:if \$(\w+): )?(\w+) = (\w+)\((.*)\)$')
FUNCTIONS = ('add', 'subtract', 'multiply', 'true_divide', 'sqrt',
             'maximum', 'minimum', 'sign', 'clip', 'copy')


def _parse(text):
    ops = []
    for line in text.strip().splitlines():
        line = line.split('#')[0].strip()
        if not line:
            continue
        m = _LINE.match(line)
        if m is None:
            raise ValueError('bad kernel line %r' % line)
        guard, out, fn, args = m.groups()
        if fn not in FUNCTIONS:
            raise ValueError('unknown function %r' % fn)
        parsed = []
        for a in (x.strip() for x in args.split(',')):
            if a[0].isdigit() or a[0] in '-.':
                a = ast.literal_eval(a)
            parsed.append(a)
        ops.append(Op(fn, out, parsed, guard))
    return ops


def is_temp(name):
    return isinstance(name, str) and re.match(r'^t\d+$', name) is not None


class Kernel(object):
    """A named element-wise op sequence (see the module docstring).

    ``arrays``: the arrays it reads or writes, in a fixed order;
    ``scalars``: its per-step scalars, in the order a caller passes them;
    ``typed``: the scalars that feed a temporary (their NumPy promotion
    with the arrays' dtype must give that dtype); ``temps``: how many
    temporaries it needs; ``writes``: the arrays it writes into."""

    __slots__ = ('name', 'arrays', 'scalars', 'ops', 'temps', 'typed',
                 'writes')

    def __init__(self, name, text, arrays=None):
        self.name = name
        self.ops = _parse(text)
        seen_arrays, scalars, temps, typed, writes = [], [], set(), set(), []
        for op in self.ops:
            if op.guard and op.guard not in scalars:
                scalars.append(op.guard)
            for a in op.args + (op.out,):
                if not isinstance(a, str):
                    continue
                if a.startswith('$'):
                    if a[1:] not in scalars:
                        scalars.append(a[1:])
                    if is_temp(op.out) and a is not op.out:
                        typed.add(a[1:])
                elif is_temp(a):
                    temps.add(int(a[1:]))
                elif a not in seen_arrays:
                    seen_arrays.append(a)
            if not is_temp(op.out) and op.out not in writes:
                writes.append(op.out)
        self.arrays = tuple(arrays) if arrays is not None else \
            tuple(seen_arrays)
        missing = set(seen_arrays) - set(self.arrays)
        if missing:
            raise ValueError('%s uses undeclared arrays %s' % (name, missing))
        self.scalars = tuple(scalars)
        self.temps = max(temps) + 1 if temps else 0
        self.typed = frozenset(typed)
        self.writes = tuple(writes)

    def text(self):
        return '\n'.join(op.text() for op in self.ops)

    def __repr__(self):
        return '<Kernel %s: %d ops>' % (self.name, len(self.ops))


# -- Chainer 7.8.1's update_core_cpu, op by op ------------------------------
# (Python-side scalar expressions, such as (1 + momentum) * lr, are computed
# by the caller exactly as Chainer writes them and passed as $scalars.)

SGD = Kernel('SGD', '''
t0 = multiply($lr, grad)              # param.data -= lr * grad
param = subtract(param, t0)
''', arrays=('param', 'grad'))

MOMENTUM_SGD = Kernel('MomentumSGD', '''
v = multiply(v, $momentum)            # v *= momentum
t0 = multiply($lr, grad)              # v -= lr * grad
v = subtract(v, t0)
param = add(param, v)                 # param.data += v
''', arrays=('param', 'grad', 'v'))

NESTEROV_AG = Kernel('NesterovAG', '''
v = multiply(v, $momentum)            # v *= momentum
t0 = multiply($lr, grad)              # v -= lr * grad
v = subtract(v, t0)
t0 = multiply($momentum_sq, v)        # param.data += momentum * momentum * v
param = add(param, t0)
t0 = multiply($one_plus_momentum_lr, grad)
param = subtract(param, t0)           # param -= (1 + momentum) * lr * grad
''', arrays=('param', 'grad', 'v'))

CORRECTED_MOMENTUM_SGD = Kernel('CorrectedMomentumSGD', '''
v = multiply(v, $momentum)            # v *= momentum
v = subtract(v, grad)                 # v -= grad
t0 = multiply($lr, v)                 # param.data += lr * v
param = add(param, t0)
''', arrays=('param', 'grad', 'v'))

_ADAM_MOMENTS = '''
t0 = subtract(grad, m)                # m += (1 - beta1) * (grad - m)
t0 = multiply($one_minus_beta1, t0)
m = add(m, t0)
t0 = multiply(grad, grad)             # v += (1 - beta2) * (grad * grad - v)
t0 = subtract(t0, v)
t0 = multiply($one_minus_beta2, t0)
v = add(v, t0)
'''
_ADAM_STEP = '''
t0 = sqrt(%s)                         # step = alpha_t / (sqrt(vhat) + eps)
t0 = add(t0, $eps)
t0 = true_divide($alpha_t, t0)
'''
_ADAM_BOUND = '''
t0 = clip(t0, $lower, $upper)         # step = clip(step, lower, upper)
'''
_ADAM_AXPBY_ONE = '''
t0 = multiply(t0, m)                  # param += -eta * (step * m)
t0 = multiply($b, t0)
param = add(param, t0)
'''
_ADAM_AXPBY = '''
t0 = multiply(t0, m)                  # param[...] = a * param + b * (step * m)
t1 = multiply($a, param)
t0 = multiply($b, t0)
param = add(t1, t0)
'''


def _adam(amsgrad, adabound, a_is_one):
    text = _ADAM_MOMENTS
    if amsgrad:
        text += 'vhat = maximum(vhat, v)\n'
    text += _ADAM_STEP % ('vhat' if amsgrad else 'v')
    if adabound:
        text += _ADAM_BOUND
    text += _ADAM_AXPBY_ONE if a_is_one else _ADAM_AXPBY
    name = 'Adam' + ('/amsgrad' if amsgrad else '') + \
        ('/adabound' if adabound else '') + ('' if a_is_one else '/decay')
    arrays = ('param', 'grad', 'm', 'v') + (('vhat',) if amsgrad else ())
    return Kernel(name, text, arrays=arrays)


ADAM = {(ams, bound, one): _adam(ams, bound, one)
        for ams in (False, True) for bound in (False, True)
        for one in (False, True)}

_RMSPROP_MS = '''
ms = multiply(ms, $alpha)             # ms *= alpha
t0 = multiply($one_minus_alpha, grad) # ms += (1 - alpha) * grad * grad
t0 = multiply(t0, grad)
ms = add(ms, t0)
'''
_RMSPROP_TAIL = '''
t1 = multiply($lr, grad)              # param.data -= lr * grad / denom
t1 = true_divide(t1, t0)
param = subtract(param, t1)
'''
RMSPROP = {
    False: Kernel('RMSprop', _RMSPROP_MS + '''
t0 = sqrt(ms)                         # denom = sqrt(ms) + eps
t0 = add(t0, $eps)
''' + _RMSPROP_TAIL, arrays=('param', 'grad', 'ms')),
    True: Kernel('RMSprop/eps_inside_sqrt', _RMSPROP_MS + '''
t0 = add(ms, $eps)                    # denom = sqrt(ms + eps)
t0 = sqrt(t0)
''' + _RMSPROP_TAIL, arrays=('param', 'grad', 'ms')),
}

RMSPROP_GRAVES = Kernel('RMSpropGraves', '''
n = multiply(n, $alpha)               # n *= alpha
t0 = multiply($one_minus_alpha, grad) # n += (1 - alpha) * grad * grad
t0 = multiply(t0, grad)
n = add(n, t0)
g = multiply(g, $alpha)               # g *= alpha
t0 = multiply($one_minus_alpha, grad) # g += (1 - alpha) * grad
g = add(g, t0)
delta = multiply(delta, $momentum)    # delta *= momentum
t0 = multiply($lr, grad)              # delta -= lr * grad
                                      #     / sqrt(n - g * g + eps)
t1 = multiply(g, g)
t1 = subtract(n, t1)
t1 = add(t1, $eps)
t1 = sqrt(t1)
t0 = true_divide(t0, t1)
delta = subtract(delta, t0)
param = add(param, delta)             # param.data += delta
''', arrays=('param', 'grad', 'n', 'g', 'delta'))

ADA_GRAD = Kernel('AdaGrad', '''
t0 = multiply(grad, grad)             # h += grad * grad
h = add(h, t0)
t0 = multiply($lr, grad)              # param.data -= lr * grad
                                      #     / (sqrt(h) + eps)
t1 = sqrt(h)
t1 = add(t1, $eps)
t0 = true_divide(t0, t1)
param = subtract(param, t0)
''', arrays=('param', 'grad', 'h'))

ADA_DELTA = Kernel('AdaDelta', '''
msg = multiply(msg, $rho)             # msg *= rho
t0 = multiply($one_minus_rho, grad)   # msg += (1 - rho) * grad * grad
t0 = multiply(t0, grad)
msg = add(msg, t0)
t0 = add(msdx, $eps)                  # dx = sqrt((msdx + eps)
                                      #     / (msg + eps)) * grad
t1 = add(msg, $eps)
t0 = true_divide(t0, t1)
t0 = sqrt(t0)
t0 = multiply(t0, grad)
msdx = multiply(msdx, $rho)           # msdx *= rho
t1 = multiply($one_minus_rho, t0)     # msdx += (1 - rho) * dx * dx
t1 = multiply(t1, t0)
msdx = add(msdx, t1)
param = subtract(param, t0)           # param.data -= dx
''', arrays=('param', 'grad', 'msg', 'msdx'))

# Chainer's SMORMS3 binds new arrays to mem, g and g2; here the new values
# are written into the state arrays themselves (each is read for the last
# time by the op that writes it).
SMORMS3 = Kernel('SMORMS3', '''
t0 = add(mem, 1)                      # r = 1 / (mem + 1)
t0 = true_divide(1, t0)
t1 = subtract(1, t0)                  # g = (1 - r) * g + r * grad
t2 = multiply(t1, g)
t3 = multiply(t0, grad)
g = add(t2, t3)
t2 = multiply(t1, g2)                 # g2 = (1 - r) * g2 + r * grad * grad
t3 = multiply(t0, grad)
t3 = multiply(t3, grad)
g2 = add(t2, t3)
t0 = multiply(g, g)                   # x = g * g / (g2 + eps)
t1 = add(g2, $eps)
t0 = true_divide(t0, t1)
t1 = minimum(t0, $lr)                 # param.data -= grad * minimum(x, lr)
t1 = multiply(grad, t1)               #     / (sqrt(g2) + eps)
t2 = sqrt(g2)
t2 = add(t2, $eps)
t1 = true_divide(t1, t2)
param = subtract(param, t1)
t1 = subtract(1, t0)                  # mem = 1 + mem * (1 - x)
t1 = multiply(mem, t1)
mem = add(1, t1)
''', arrays=('param', 'grad', 'mem', 'g', 'g2'))

# -- hooks and the steps around a rule ---------------------------------------

WEIGHT_DECAY = Kernel('WeightDecay', '''
t0 = multiply($rate, param)           # g += rate * p
grad = add(grad, t0)
''', arrays=('param', 'grad'))

LASSO = Kernel('Lasso', '''
t0 = sign(param)                      # g += rate * sign(p)
t0 = multiply($rate, t0)
grad = add(grad, t0)
''', arrays=('param', 'grad'))

GRADIENT_HARD_CLIPPING = Kernel('GradientHardClipping', '''
grad = clip(grad, $lower_bound, $upper_bound)
''', arrays=('grad',))

# The scale of GradientClipping (a global norm) and of GradientLARS (the
# norms of one parameter) are reductions the caller computes, serially,
# between two element-wise phases.
GRADIENT_CLIPPING = Kernel('GradientClipping', '''
if $clip: grad = multiply(grad, $rate) # grad *= rate (unless rate >= 1)
''', arrays=('grad',))

GRADIENT_LARS = Kernel('GradientLARS', '''
t0 = multiply($weight_decay, param)   # g += weight_decay * p
grad = add(grad, t0)
grad = multiply(grad, $rate)          # g *= rate
''', arrays=('param', 'grad'))

LOSS_SCALE = Kernel('loss_scale', '''
grad = true_divide(grad, $loss_scale) # grad /= loss_scale
''', arrays=('grad',))

TO_FP32 = Kernel('grad_to_fp32', '''
grad32 = copy(grad)                   # grad.astype(float32)
''', arrays=('grad', 'grad32'))

FROM_FP32 = Kernel('param_from_fp32', '''
param = copy(param32)                 # param32.astype(param.dtype)
''', arrays=('param32', 'param'))


# -- scalars and NumPy's promotion -------------------------------------------

# NumPy 1 promotes by value: a float scalar (Python's or NumPy's) takes the
# smallest float type that holds it by its C code's bounds (min_scalar_type:
# |v| < 65000 half, < 3.4e38 float, else double; inf and NaN: half), so a
# float32 array times 3.4e38 computes in float64. NumPy 2 (NEP 50) keeps
# Python numbers weak and promotes NumPy scalars by type.
VALUE_BASED = numpy.lib.NumpyVersion(numpy.__version__) < '2.0.0'
VALUE_BOUND = {numpy.dtype(numpy.float16): 65000.0,
          numpy.dtype(numpy.float32): 3.4e38}
_weak_cache = {}


def weak(value, dtype):
    """Whether NumPy computes an op of ``value`` and an array of ``dtype``
    in ``dtype`` (the scalar is cast down to it)."""
    t = type(value)
    if t is float or (VALUE_BASED and t is not numpy.longdouble and
                      isinstance(value, numpy.floating)):
        if VALUE_BASED:
            bound = VALUE_BOUND.get(dtype)
            if bound is not None:
                v = abs(float(value))
                return not bound <= v < float('inf')
        return t is float or numpy.dtype(t) <= dtype
    if t is int or t is bool:
        return True
    key = (t, getattr(value, 'dtype', None), dtype)
    ok = None if VALUE_BASED else _weak_cache.get(key)
    if ok is None:
        try:
            ok = numpy.result_type(value, numpy.empty(0, dtype)) == dtype
        except TypeError:
            ok = False
        if not VALUE_BASED:
            _weak_cache[key] = ok
    return ok


# -- compiling a sequence of kernels -----------------------------------------

class Segment(object):
    """One kernel bound into a program: ``arrays`` maps the kernel's array
    names to slots of the program's array list, ``scalars`` its scalar names
    to slots of the scalar list; its arrays are of ``dtype``; ``strong``:
    (scalar name, dtype) of scalars that promote what they touch to that
    dtype (see the module docstring)."""

    __slots__ = ('kernel', 'arrays', 'scalars', 'dtype', 'strong')

    def __init__(self, kernel, arrays, scalars, dtype, strong=()):
        self.kernel = kernel
        self.arrays = dict(arrays)
        self.scalars = dict(scalars)
        self.dtype = numpy.dtype(dtype)
        self.strong = tuple(strong)

    def key(self):
        return (id(self.kernel), tuple(sorted(self.arrays.items())),
                tuple(sorted(self.scalars.items())), self.dtype.str,
                self.strong)

    def temp_dtypes(self):
        """The dtype of each op's result where it is a temporary (else
        None), in op order."""
        strong = dict(self.strong)
        current = {}
        out = []
        for op in self.kernel.ops:
            if not is_temp(op.out):
                out.append(None)
                continue
            dts = [self.dtype]
            for a in op.args:
                if not isinstance(a, str):
                    continue            # a literal: weak
                if a.startswith('$'):
                    if a[1:] in strong:
                        dts.append(numpy.dtype(strong[a[1:]]))
                elif is_temp(a):
                    dts.append(current[a])
            dt = numpy.result_type(*dts)
            current[op.out] = dt
            out.append(dt)
        return out


_NAMESPACE = {
    'add': numpy.add, 'subtract': numpy.subtract,
    'multiply': numpy.multiply, 'true_divide': numpy.true_divide,
    'sqrt': numpy.sqrt, 'maximum': numpy.maximum, 'minimum': numpy.minimum,
    'sign': numpy.sign, 'clip': numpy.clip, 'copyto': numpy.copyto,
}

_compiled = {}


class Program(object):
    """A compiled sequence of segments: ``fn(A, S, T, lo, hi, B)`` runs it
    on elements ``lo:hi`` of the flat arrays ``A`` (a list indexed by
    slot) in blocks of ``B`` with the temporaries ``T`` (each at least
    ``B`` long, dtypes as ``temp_dtypes``), scalars ``S``; with ``B == 0``
    on the arrays as they are, whole (``T`` then has their shape).
    ``source`` is the generated Python (or C, ``native``: see
    update_native; its ``fn`` takes ``T=None`` and needs no temporaries
    on flat arrays)."""

    __slots__ = ('fn', 'temp_dtypes', 'source', 'segments', 'slots',
                 'ufuncs')

    def __init__(self, fn, temp_dtypes, source, segments, slots,
                 ufuncs=None):
        self.fn = fn
        self.temp_dtypes = temp_dtypes
        self.source = source
        self.segments = segments
        self.slots = slots
        self.ufuncs = ufuncs    # a C loop's: the ufunc program it replaces

    @property
    def native(self):
        return self.ufuncs is not None


def compile_program(segments):
    """The ``Program`` running ``segments`` in order (cached)."""
    key = tuple(s.key() for s in segments)
    prog = _compiled.get(key)
    if prog is None:
        prog = _compiled[key] = _compile(list(segments))
    return prog


def _compile(segments):
    temp_slots = {}      # (dtype str, kernel temp index) -> T index
    array_slots = []
    scalar_slots = []
    body = []
    for seg in segments:
        k = seg.kernel
        dtypes = seg.temp_dtypes()
        for op, dt in zip(k.ops, dtypes):
            if dt is not None:
                temp_slots.setdefault((dt.str, op.out), len(temp_slots))
        held = {}       # temporary name -> its dtype at this op

        def operand(a, seg=seg, held=held):
            if not isinstance(a, str):
                return repr(a)
            if a.startswith('$'):
                slot = seg.scalars[a[1:]]
                if slot not in scalar_slots:
                    scalar_slots.append(slot)
                return 's%d' % slot
            if is_temp(a):
                return 'y%d' % temp_slots[(held[a].str, a)]
            slot = seg.arrays[a]
            if slot not in array_slots:
                array_slots.append(slot)
            return 'x%d' % slot

        for op, dt in zip(k.ops, dtypes):
            args = [operand(a) for a in op.args]
            if dt is not None:
                held[op.out] = dt
            out = operand(op.out)
            if op.fn == 'copy':
                line = 'copyto(%s, %s)' % (out, args[0])
            else:
                line = '%s(%s, out=%s)' % (op.fn, ', '.join(args), out)
            if op.guard:
                line = 'if %s: %s' % (operand('$' + op.guard), line)
            body.append(line)
    temps = sorted(temp_slots.items(), key=lambda kv: kv[1])
    lines = ['def program(A, S, T, lo, hi, B):']
    lines += ['    s%d = S[%d]' % (s, s) for s in sorted(scalar_slots)]
    lines.append('    if B == 0:')
    lines += ['        x%d = A[%d]' % (a, a) for a in array_slots]
    lines += ['        y%d = T[%d]' % (t, t) for _, t in temps]
    lines += ['        ' + b for b in body]
    lines.append('        return')
    lines += ['    a%d = A[%d]' % (a, a) for a in array_slots]
    lines += ['    u%d = T[%d]' % (t, t) for _, t in temps]
    lines.append('    for i in range(lo, hi, B):')
    lines.append('        j = i + B')
    lines.append('        if j > hi:')
    lines.append('            j = hi')
    lines += ['        x%d = a%d[i:j]' % (a, a) for a in array_slots]
    if temps:
        lines.append('        n = j - i')
    lines += ['        y%d = u%d[:n]' % (t, t) for _, t in temps]
    lines += ['        ' + b for b in body]
    source = '\n'.join(lines) + '\n'
    namespace = dict(_NAMESPACE)
    exec(compile(source, '<update program>', 'exec'), namespace)
    return Program(namespace['program'],
                   tuple(numpy.dtype(d) for (d, _), _ in temps), source,
                   tuple(segments), tuple(sorted(array_slots)))
