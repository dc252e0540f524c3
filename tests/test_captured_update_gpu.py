"""The captured update on CuPy (skipped without a GPU): each rule and hook
twin-trained against Chainer's own CuPy update (``update_core_gpu``) bit
for bit, with a learning-rate extension changing the rate mid-run; a step
that never waits for the device; the update captured into a CUDA graph and
replayed with new scalars; CuPy's scalar conversion; the fallbacks."""
import time
import warnings

import numpy
import pytest

from chainer import optimizer_hooks as H
from chainer import serializers
from chainer.training import extensions

import static_graph
from schedules import update_cuda as C
from tests.update_twins import HOOKS, RULES, Net, Twins, captured, loss_of
from tests import gpu_available


_reason = gpu_available.reason()
pytestmark = pytest.mark.skipif(_reason is not None, reason=str(_reason))
DEV = '@cupy:0'


def _shift(t, attr, rate=0.7):
    """ExponentialShift of ``attr`` on both optimizers (as a Trainer would
    call it, once a step)."""
    exts = [extensions.ExponentialShift(attr, rate, optimizer=o)
            for o in (t.oa, t.ob)]
    for e in exts:
        e.initialize(None)
    return lambda: [e(None) for e in exts]


def _train(t, steps, shift_from=None, attr='lr'):
    shift = _shift(t, attr) if shift_from is not None else None
    for i in range(steps):
        if shift is not None and i >= shift_from:
            shift()
        t.step()


def _no_fallback(t, steps):
    cap = captured(t.ob)
    assert cap.fallback_steps == 0, dict(cap.reasons)
    assert cap.gpu is not None and cap.gpu.steps == steps


@pytest.mark.parametrize('graph', [True, False])
@pytest.mark.parametrize('name', sorted(RULES))
def test_rule_bit_for_bit_on_gpu(name, graph):
    make, attr = RULES[name]
    t = Twins(make, device=DEV, capture=dict(cuda_graph=graph))
    _train(t, 4, shift_from=2, attr=attr)
    _no_fallback(t, 4)


@pytest.mark.parametrize('name,dtype', [
    (n, 'float16') for n in ('SGD', 'MomentumSGD', 'Adam', 'AMSBound',
                             'AdaDelta')] + [
    (n, 'float64') for n in sorted(RULES) if n != 'RMSpropGraves'])
def test_other_dtypes_on_gpu(name, dtype):
    """float64, and float16 updated in float16 (Adam: in float32 inside
    its kernel, as Chainer's), with float16 device scalars."""
    t = Twins(RULES[name][0], device=DEV, dtype=numpy.dtype(dtype))
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', RuntimeWarning)
        _train(t, 3, shift_from=1, attr=RULES[name][1])
    _no_fallback(t, 3)


@pytest.mark.xfail(strict=True, reason='in update_gpu_readers.'
                   'DIFFERED_ON_GPU: differed from Chainer on an H100')
@pytest.mark.parametrize('graph', [True, False])
def test_rmsprop_graves_float64_without_its_fallback(graph, monkeypatch):
    """RMSpropGraves on float64 runs Chainer's update on CuPy (ptxas
    fuses its kernel's FMAs differently with the scalars in a device
    array). Here it runs captured: where this passes, the fallback can
    go."""
    from static_graph import update_gpu_readers
    monkeypatch.setattr(update_gpu_readers, 'DIFFERED_ON_GPU', {})
    t = Twins(RULES['RMSpropGraves'][0], device=DEV,
              dtype=numpy.dtype('float64'), capture=dict(cuda_graph=graph))
    _train(t, 4, shift_from=1)
    _no_fallback(t, 4)


@pytest.mark.parametrize('name', sorted(HOOKS))
@pytest.mark.parametrize('rule', ['MomentumSGD', 'Adam'])
def test_optimizer_hook_on_gpu(name, rule):
    t = Twins(RULES[rule][0], hooks=[HOOKS[name]], device=DEV)
    _train(t, 3, shift_from=1, attr=RULES[rule][1])
    _no_fallback(t, 3)


@pytest.mark.parametrize('name', ['WeightDecay', 'Lasso',
                                  'GradientHardClipping', 'GradientLARS'])
def test_update_rule_hook_on_gpu(name):
    t = Twins(RULES['MomentumSGD'][0], device=DEV)
    t.for_both(lambda m, o: m.l1.W.update_rule.add_hook(HOOKS[name]()))
    t.for_both(lambda m, o: m.l2.W.update_rule.add_hook(
        HOOKS[name](), timing='post'))
    _train(t, 3)
    _no_fallback(t, 3)


@pytest.mark.parametrize('graph', [True, False])
@pytest.mark.parametrize('rule', ['MomentumSGD', 'AMSBound'])
def test_fp32_update_loss_scale_and_hooks_on_gpu(rule, graph):
    """float16 parameters updated in float32, static loss scaling, hooks
    of every kind (the optimizer's on float16, the rule's on float32; the
    optimizer's post hook reads each parameter's new float16 values)."""
    t = Twins(RULES[rule][0], dtype=numpy.float16, device=DEV, hooks=[
        HOOKS['GradientClipping'], HOOKS['GradientLARS']],
        capture=dict(cuda_graph=graph))
    t.for_both(lambda m, o: o.use_fp32_update())
    t.for_both(lambda m, o: o.loss_scaling(scale=64.0))
    t.for_both(lambda m, o: o.add_hook(H.WeightDecay(1e-3), timing='post'))
    t.for_both(lambda m, o: m.l1.b.update_rule.add_hook(
        H.GradientHardClipping(-0.1, 0.1), timing='post'))
    for i in range(3):
        x = t.batch()
        for m, o in ((t.a, t.oa), (t.b, t.ob)):
            m.cleargrads()
            loss_of(m, x).backward(loss_scale=o._loss_scale)
        t.update()
    _no_fallback(t, 3)


def test_around_the_update_on_gpu(tmp_path):
    """disable_update, a rule's own hyperparameter, gradient accumulation,
    a parameter added after capture, and save/load of the state."""
    t = Twins(RULES['Adam'][0], device=DEV)
    t.step(2)
    t.for_both(lambda m, o: m.l1.disable_update())
    t.step()
    t.for_both(lambda m, o: m.l1.enable_update())
    t.for_both(lambda m, o: setattr(m.l2.W.update_rule.hyperparam,
                                    'alpha', 0.01))
    t.backward()
    t.backward(clear=False)
    t.update()
    for o, tag in ((t.oa, 'a'), (t.ob, 'b')):
        serializers.save_npz(str(tmp_path / tag), o)
    t.step()
    for o, tag in ((t.oa, 'a'), (t.ob, 'b')):
        serializers.load_npz(str(tmp_path / tag), o)
    t.check()
    t.step(2)
    _no_fallback(t, 7)


def _spin_kernel():
    import cupy
    return cupy.RawKernel(r'''
extern "C" __global__ void spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
}''', 'spin')


@pytest.mark.parametrize('hooks', [(), ('WeightDecay', 'GradientClipping',
                                        'GradientLARS')])
def test_a_step_never_waits_for_the_device(hooks):
    """While a kernel keeps the stream busy for about a second, a captured
    update returns at once and leaves its work queued: nothing in it waits
    for the device (a float() or .get() would wait for the spin)."""
    import cupy
    t = Twins(RULES['Adam'][0], device=DEV,
              hooks=[HOOKS[h] for h in hooks])
    t.step(2)                        # kernels compiled, buffers allocated
    t.backward()
    spin = _spin_kernel()
    stream = cupy.cuda.get_current_stream()
    rate = cupy.cuda.runtime.getDeviceProperties(0)['clockRate'] * 1000
    spin((1,), (1,), (numpy.int64(rate * 1.0),))
    t0 = time.perf_counter()
    t.ob.update()
    took = time.perf_counter() - t0
    busy = not stream.done
    stream.synchronize()
    assert busy and took < 0.5, took
    t.oa.update()
    t.check()


class _FixedGrads(object):
    """Both twins' gradients copied into arrays kept from step to step (as
    a backward captured into a CUDA graph would write them)."""

    def __init__(self, t):
        self.t = t
        self.keep = {}

    def step(self):
        t = self.t
        t.backward()
        for tag, m in (('a', t.a), ('b', t.b)):
            for name, p in m.namedparams():
                k = (tag, name)
                if k not in self.keep:
                    self.keep[k] = p.grad.copy()
                else:
                    self.keep[k][...] = p.grad
                p.grad = self.keep[k]
        t.update()


@pytest.mark.parametrize('name', ['Adam', 'AMSBound', 'MomentumSGD',
                                  'SMORMS3'])
def test_update_replays_as_a_cuda_graph(name):
    """cuda_graph=True: a step on the arrays of the step before is captured
    into a CUDA graph (a capture is refused by CUDA where anything waits
    for the device), later ones launch it after the scalar copy; a
    learning-rate shift at every step reaches the graph (it reads the
    device scalars), bit for bit with Chainer."""
    make, attr = RULES[name]
    t = Twins(make, device=DEV, capture=dict(cuda_graph=True),
              hooks=[HOOKS['WeightDecay'], HOOKS['GradientHardClipping']])
    fixed = _FixedGrads(t)
    shift = _shift(t, attr)
    for i in range(6):
        shift()
        fixed.step()
    gpu = captured(t.ob).gpu
    assert gpu.captures == 1 and gpu.graph_launches == 5, gpu.describe()
    assert not gpu.refused
    _no_fallback(t, 6)


def test_fp32_update_in_a_graph_writes_in_place():
    t = Twins(RULES['Adam'][0], dtype=numpy.float16, device=DEV,
              capture=dict(cuda_graph=True))
    t.for_both(lambda m, o: o.use_fp32_update())
    fixed = _FixedGrads(t)
    arrays = [p.array for p in t.b.params()]
    for i in range(4):
        fixed.step()
    assert all(p.array is a for p, a in zip(t.b.params(), arrays))
    assert captured(t.ob).gpu.graph_launches == 3


def test_graph_with_a_cublas_norm():
    """GradientClipping's norm is Chainer's cuBLAS dot. Where CuPy lets it
    run under stream capture (CuPy 14 on an H100 did) the update replays as
    a graph; where CuPy refuses (older CuPy), the step stays launch by
    launch and explain_update says why. The same bits either way."""
    t = Twins(RULES['Adam'][0], device=DEV, capture=dict(cuda_graph=True),
              hooks=[HOOKS['GradientClipping']])
    fixed = _FixedGrads(t)
    for i in range(4):
        fixed.step()
    gpu = captured(t.ob).gpu
    if gpu.captures:
        assert gpu.captures == 1 and gpu.graph_launches == 3, gpu.describe()
        assert not gpu.refused
    else:
        assert gpu.refused
        assert 'refused' in static_graph.explain_update(t.ob)
    _no_fallback(t, 4)


def test_new_gradient_arrays():
    """cleargrads: new gradient arrays each step. Where CuPy's pool puts
    them at the addresses of the step before, the graph replays (it works
    by address); elsewhere the step runs launch by launch: bit for bit
    either way."""
    t = Twins(RULES['Adam'][0], device=DEV, capture=dict(cuda_graph=True))
    t.step(5)
    gpu = captured(t.ob).gpu
    assert gpu.captures <= 1 and not gpu.refused
    _no_fallback(t, 5)


def test_a_parameter_given_a_new_array_leaves_the_graph():
    t = Twins(RULES['MomentumSGD'][0], device=DEV,
              capture=dict(cuda_graph=True))
    fixed = _FixedGrads(t)
    for i in range(3):
        fixed.step()
    t.for_both(lambda m, o: setattr(m.l1.W, 'array', m.l1.W.array * 1))
    for i in range(3):
        fixed.step()
    gpu = captured(t.ob).gpu
    assert gpu.captures == 2 and gpu.graph_launches == 4
    _no_fallback(t, 6)


def test_device_values_are_what_cupy_passes():
    """Host scalars as an ElementwiseKernel sees them for a T parameter,
    against device_values (float16 values on a rounding boundary
    included)."""
    import cupy
    k = cupy.ElementwiseKernel('T x, raw T d', 'T y', 'y = x', 'passthru')
    legacy = C.legacy_scalars(cupy)
    vals = [0.1, 1e-8, 3, 1 + 2.0 ** -11 + 2.0 ** -30, 65519.0, 1e-7,
            numpy.float64(0.7) ** 3, numpy.float32(0.3), 2.0 ** -25]
    for dt in ('e', 'f', 'd'):
        d = cupy.empty(1, dt)
        got = numpy.array([k(v, d, cupy.empty((), dt)).get() for v in vals])
        want = C.device_values(vals, dt, legacy)
        assert got.tobytes() == want.tobytes(), (dt, got, want)


def test_dynamic_loss_scaling_falls_back_on_gpu():
    t = Twins(RULES['Adam'][0], device=DEV)
    t.for_both(lambda m, o: o.loss_scaling(interval=2))
    for i in range(3):
        x = t.batch()
        for m, o in ((t.a, t.oa), (t.b, t.ob)):
            m.cleargrads()
            loss_of(m, x).backward(loss_scale=o._loss_scale)
        with warnings.catch_warnings():
            warnings.simplefilter('ignore')
            t.update()
    cap = captured(t.ob)
    assert cap.fallback_steps == 3 and cap.steps == 0
    assert any('dynamic loss scaling' in r for r in cap.reasons)


def test_numpy_scalar_where_a_ufunc_takes_it_falls_back():
    """GradientHardClipping with NumPy float64 bounds: CuPy's ufuncs may
    promote them, so the step runs Chainer's update (same bits)."""
    t = Twins(RULES['SGD'][0], device=DEV, hooks=[
        lambda: H.GradientHardClipping(numpy.float64(-0.05),
                                       numpy.float64(0.05))])
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        t.step(2)
    cap = captured(t.ob)
    assert cap.fallback_steps == 2
    assert any('float64' in r for r in cap.reasons)


def test_static_graph_model_and_captured_update_on_gpu():
    """The decorated model's replay and the captured update together."""
    class Static(Net):
        forward = static_graph.static_graph(Net.forward)
    t = Twins(RULES['MomentumSGD'][0], device=DEV)
    t.b.__class__ = Static
    _train(t, 4, shift_from=2)
    _no_fallback(t, 4)
    assert static_graph.cached(t.b)[0].state == 'complete'
