"""The captured update's compiled C loops (schedules/update_native.py): the
same bits as the NumPy ufuncs they replace, on values that probe rounding,
signed zeros, subnormals, infinities and NaNs (NaN where NumPy gives NaN;
which NaN an op of two NaNs returns is the compiler's choice, as it is
NumPy's); NumPy's floating-point
error handling kept; and the NumPy ufuncs, with the reason, wherever no
loop can be built."""
import os
import subprocess
import sys
import warnings

import numpy
import pytest

from chainer import optimizers as Opt

import static_graph
from schedules import native
from schedules import update_native as N
from schedules import update_rules as K
from tests.update_twins import RULES, Twins, captured

pytestmark = pytest.mark.skipif(native.compiler() is None,
                                reason='no C compiler here')

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

KERNELS = [K.SGD, K.MOMENTUM_SGD, K.NESTEROV_AG, K.CORRECTED_MOMENTUM_SGD,
           K.RMSPROP[False], K.RMSPROP[True], K.RMSPROP_GRAVES, K.ADA_GRAD,
           K.ADA_DELTA, K.WEIGHT_DECAY, K.GRADIENT_LARS, K.LOSS_SCALE,
           K.GRADIENT_CLIPPING] + [
    k for k in K.ADAM.values() if '/ams' not in k.name and
    '/adabound' not in k.name]


def _values(rs, n, dtype):
    """Random values of every magnitude, with the awkward ones mixed in."""
    fi = numpy.finfo(dtype)
    x = rs.standard_normal(n) * 10.0 ** rs.randint(-8, 8, n)
    special = [0.0, -0.0, numpy.inf, -numpy.inf, numpy.nan, fi.tiny,
               fi.tiny / 4, -fi.tiny / 3, fi.max, -fi.max, fi.eps, 1.0]
    idx = rs.choice(n, len(special) * 3, replace=False)
    x[idx] = numpy.array(special * 3)
    return x.astype(dtype)


def _program(kernel, dtype):
    arrays = {a: j for j, a in enumerate(kernel.arrays)}
    scalars = {s: j for j, s in enumerate(kernel.scalars)}
    return K.compile_program([K.Segment(kernel, arrays, scalars, dtype)])


@pytest.mark.parametrize('dtype', [numpy.float32, numpy.float64])
@pytest.mark.parametrize('kernel', KERNELS, ids=lambda k: k.name)
def test_loop_gives_the_ufuncs_bits(kernel, dtype):
    """Each supported kernel, on the same arrays and scalars: the C loop
    over the whole range, and over two chunks, writes every array bit for
    bit as the NumPy program does."""
    prog = _program(kernel, dtype)
    nprog, why = N.program(prog)
    assert why is None and nprog.native and not prog.native
    rs = numpy.random.RandomState(len(kernel.name))
    n = 517
    start = [_values(rs, n, dtype) for _ in kernel.arrays]
    for trial in range(3):
        scalars = [float(v) for v in rs.uniform(-2, 2, len(kernel.scalars))]
        if trial == 1:     # scalars that round when cast to float32
            scalars = [v * (1 + 1e-9) + 1e-20 for v in scalars]
        if trial == 2 and 'clip' in kernel.scalars:
            scalars[kernel.scalars.index('clip')] = 0.0
        want = [a.copy() for a in start]
        got = [a.copy() for a in start]
        temps = tuple(numpy.empty(n, dt) for dt in prog.temp_dtypes)
        with numpy.errstate(all='ignore'):
            prog.fn(want, scalars, temps, 0, n, n)
            nprog.fn(got, scalars, None, 0, 200, n)
            nprog.fn(got, scalars, None, 200, n, n)
        for w, g in zip(want, got):
            assert _bits(w) == _bits(g)


def _bits(a):
    """The array's bytes with every NaN made one NaN: an op with two NaN
    operands returns one of them, which one depends on the operand order
    the compiler (or NumPy's build: 1.26 and 2.5 differ) chose."""
    a = a.copy()
    a[numpy.isnan(a)] = numpy.nan
    return a.tobytes()


def test_whole_arrays_keep_numpy():
    """B == 0 (arrays that are not flat) runs the NumPy program."""
    prog = _program(K.SGD, numpy.float32)
    nprog, _ = N.program(prog)
    p = numpy.asfortranarray(numpy.ones((3, 4), numpy.float32))
    g = numpy.asfortranarray(numpy.full((3, 4), 2, numpy.float32))
    nprog.fn([p, g], [0.5], (numpy.empty((3, 4), numpy.float32),), 0, 0, 0)
    assert (p == 0).all()


@pytest.mark.parametrize('mode', ['warn', 'ignore', 'call'])
def test_floating_point_errors_follow_numpy_errstate(mode):
    """An overflow inside the loop reaches NumPy's error handling as the
    ufunc's own would: warned, ignored or called."""
    prog, _ = N.program(_program(K.SGD, numpy.float32))
    p = numpy.ones(64, numpy.float32)
    g = numpy.full(64, 3e38, numpy.float32)
    calls = []
    with numpy.errstate(over=mode, under='ignore', invalid='ignore',
                        divide='ignore'), warnings.catch_warnings(
                            record=True) as caught:
        warnings.simplefilter('always')
        old = numpy.seterrcall(lambda kind, flag: calls.append(kind))
        try:
            prog.fn([p, g], [-10.0], None, 0, 64, 64)
        finally:
            numpy.seterrcall(old)
    assert numpy.isinf(p).all()
    overflow = [w for w in caught if 'overflow' in str(w.message)]
    assert len(overflow) == (mode == 'warn')
    assert (calls == ['overflow']) == (mode == 'call')


def test_unsupported_programs_say_why():
    for kernel, why in ((K.ADAM[(True, False, True)], 'maximum'),
                        (K.SMORMS3, 'minimum'), (K.LASSO, 'sign'),
                        (K.GRADIENT_HARD_CLIPPING, 'clip')):
        prog = _program(kernel, numpy.float32)
        assert why in N.program(prog)[1]
        assert N.program(prog)[0] is prog
    assert 'float16' in N.program(_program(K.SGD, numpy.float16))[1]
    seg = K.Segment(K.SGD, {'param': 0, 'grad': 1}, {'lr': 0},
                    numpy.float32, strong=(('lr', '<f8'),))
    assert 'promotes' in N.program(K.compile_program([seg]))[1]


@pytest.mark.parametrize('name', ['Adam', 'MomentumSGD', 'RMSprop'])
def test_native_and_numpy_twins(name):
    """The captured update with C loops, split across two threads, trains
    bit for bit like Chainer; the plan says each parameter runs one loop;
    native=False says NumPy ufuncs."""
    t = Twins(RULES[name][0], capture=dict(threads=2, min_split=64))
    t.step(4)
    report = static_graph.explain_update(t.ob)
    assert report.count('one C loop') == 4, report
    t = Twins(RULES[name][0], capture=dict(native=False))
    t.step(2)
    assert 'NumPy ufuncs (native=False)' in static_graph.explain_update(t.ob)


def test_python_float_beyond_float32_promotes():
    """NumPy 1 computes ``lr * grad`` in float64 when a Python float lr
    does not fit float32 (value-based casting): the captured update does
    too, with NumPy's ufuncs (a zero gradient element leaves its
    parameter as it was instead of making it NaN). NumPy 2 casts lr to
    float32 (inf): the same NaN on both twins."""
    t = Twins(lambda: Opt.SGD(lr=1e39))
    with numpy.errstate(all='ignore'):
        t.backward()
        for m in (t.a, t.b):
            m.l1.W.grad[0, :3] = (0.0, 1e-36, -2e-37)
        t.update()
    assert captured(t.ob).fallback_steps == 0
    value_based = numpy.lib.NumpyVersion(numpy.__version__) < '2.0.0'
    assert numpy.isfinite(t.b.l1.W.array[0, :3]).all() == value_based


_SUBPROCESS = '''
import os, sys
sys.path.insert(0, %r)
import static_graph, numpy, chainer
from schedules import native
from tests.update_twins import RULES, Twins
t = Twins(RULES['Adam'][0])
t.step(2)
print(static_graph.explain_update(t.ob))
print(native.status())
'''


@pytest.mark.parametrize('env,why', [
    ({'CC': '/bin/false'}, 'failed'),
    ({'STATIC_GRAPH_NATIVE': '0'}, 'turned off'),
])
def test_no_loops_where_they_cannot_be_built(tmp_path, env, why):
    """A compiler that fails, or the switch off: NumPy ufuncs, the same
    bits (Twins checks them), and the reason in explain_update."""
    out = _run(tmp_path, env)
    assert 'NumPy ufuncs (' in out and why in out, out
    assert 'C loop' not in out, out


def test_unwritable_cache_builds_in_a_private_directory(tmp_path):
    blocker = tmp_path / 'file'
    blocker.write_text('')
    out = _run(tmp_path, {'STATIC_GRAPH_CACHE': str(blocker / 'cache')})
    assert out.count('one C loop') == 4 and "'built': 1" in out, out


def _run(tmp_path, env):
    e = dict(os.environ)
    e.pop('PYTHONPATH', None)
    e['STATIC_GRAPH_CACHE'] = str(tmp_path)
    e.update(env)
    if env.get('CC') == '/bin/false':
        e['PATH'] = str(tmp_path)          # no cc, gcc or clang either
    return subprocess.run([sys.executable, '-c', _SUBPROCESS % ROOT], env=e,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          timeout=120, cwd=ROOT).stdout.decode()


def test_compiler_command_from_cc(monkeypatch):
    """$CC may name a wrapper and the compiler; options in it are dropped
    (-ffast-math would change the bits); a $CC not found falls back to
    gcc or clang."""
    import shutil
    monkeypatch.setenv('CC', 'env gcc -ffast-math -O0')
    assert native.compiler() == [shutil.which('env'), 'gcc']
    monkeypatch.setenv('CC', 'no-such-compiler-here')
    assert native.compiler()[0] in (shutil.which('gcc'),
                                    shutil.which('clang'))


@pytest.mark.parametrize('make', [
    lambda: Opt.MomentumSGD(lr=1e-3, momentum=1e39),  # v *= momentum
    lambda: Opt.SGD(lr=3.4e38),     # NumPy 1 widens from 3.4e38, not max
    lambda: Opt.RMSprop(alpha=1e39),
    lambda: Opt.MomentumSGD(lr=0.05, momentum=numpy.float64(0.9)),
    lambda: Opt.SGD(lr=numpy.longdouble(1) + 2 ** -24 + 2 ** -60),
    lambda: Opt.SGD(lr=2 ** 60 + 1),
], ids=['momentum-1e39', 'lr-3.4e38', 'alpha-1e39', 'momentum-float64',
        'lr-longdouble', 'lr-int-2**60'])
def test_scalars_the_loop_cannot_cast_run_the_ufuncs(make):
    """A scalar NumPy would not cast down to the arrays' dtype (it widens
    the op, even one that writes an array: ``v *= momentum``), or that the
    C cast would round twice: that step's ops run as ufuncs, the same bits
    as Chainer (Twins checks every array after every step)."""
    t = Twins(make, capture=dict(native=True))
    with numpy.errstate(all='ignore'):
        for step in range(2):
            t.backward()
            for m in (t.a, t.b):
                m.l1.W.grad[0, :3] = (0.0, 1e-36, -2e-37)
            t.update()
    assert captured(t.ob).fallback_steps == 0


def test_read_only_array_raises_as_numpy_does():
    prog, _ = N.program(_program(K.SGD, numpy.float32))
    p = numpy.ones(64, numpy.float32)
    p.flags.writeable = False
    with pytest.raises(ValueError, match='read-only'):
        prog.fn([p, numpy.ones(64, numpy.float32)], [0.5], None, 0, 64, 64)



def test_seterrcall_reaches_the_worker_threads():
    """numpy.seterr(...='call') with numpy.seterrcall: the function is
    called for an error in the second thread's chunk too (the workers get
    the caller's function, not only its modes)."""
    t = Twins(RULES['Adam'][0], capture=dict(threads=2, min_split=1))
    t.step(1)
    split = captured(t.ob).split
    split.choice, split.left = True, 10 ** 9      # split from now on
    t.backward()
    for m in (t.a, t.b):
        m.l1.W.grad[-1, -1] = numpy.inf       # in the second thread's chunk
    calls = []
    old = numpy.seterrcall(lambda kind, flag: calls.append(kind))
    try:
        with numpy.errstate(all='call'):
            t.ob.update()
    finally:
        numpy.seterrcall(old)
    assert 'invalid value' in calls, calls


def test_seterr_raise_runs_chainers_update():
    """Where NumPy would raise, the step is Chainer's update: the error
    comes at the parameter and op that err and leaves what Chainer's update
    leaves, 1 or 2 threads (the split step left the other thread's chunk
    updated, and every rule's t counted)."""
    for threads in (1, 2):
        t = Twins(lambda: Opt.SGD(lr=10.0),
                  capture=dict(threads=threads, min_split=1))
        t.step(1)
        t.backward()
        for m in (t.a, t.b):
            m.l1.W.grad[-1, -1] = 3e38       # in the second thread's chunk
        before = t.b.l1.W.array.copy()
        for o in (t.oa, t.ob):
            with numpy.errstate(over='raise'):
                with pytest.raises(FloatingPointError, match='overflow'):
                    o.update()
        assert t.b.l1.W.array[-1, -1] == before[-1, -1]
        t.check()
        assert captured(t.ob).fallback_steps == 1
