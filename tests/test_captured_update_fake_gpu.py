"""The captured update's CuPy path run on a CPU, over tests/fake_cupy.py
(NumPy arrays named ``cupy.ndarray``, kernels' C bodies run as NumPy):
each rule and hook, with hyperparameters changing between steps, against
Chainer's own update of the same numbers. Not bit for bit (the C bodies
are Chainer's GPU expressions, the reference its CPU ones): it checks the
plumbing, which scalar reaches which kernel in which order, the fp32
copies, the loss scale, the staging copy, the counters."""
import numpy
import pytest

import chainer
from chainer import optimizer_hooks as H

import static_graph
from static_graph import update_cupy
from tests import fake_cupy
from tests.update_twins import HOOKS, RULES, Net, captured


@pytest.fixture(autouse=True)
def fake(monkeypatch):
    monkeypatch.setattr(update_cupy, 'cupy_module', lambda: fake_cupy)
    yield


class FakeTwins(object):
    """``a``: Chainer's update on NumPy; ``b``: the captured update's CuPy
    path on fake CuPy arrays. Gradients are set, not computed."""

    def __init__(self, make_opt, dtype=numpy.float32, hooks=(),
                 cuda_graph=False):
        numpy.random.seed(0)
        self.a, self.b = Net(dtype), Net(dtype)
        self.b.copyparams(self.a)
        for p in self.b.params():
            p.array = fake_cupy.asarray(p.array.copy())
        self.oa = make_opt().setup(self.a)
        self.ob = make_opt().setup(self.b)
        for h in hooks:
            self.oa.add_hook(h())
            self.ob.add_hook(h())
        static_graph.capture_update(self.ob, threads=1,
                                    cuda_graph=cuda_graph)
        self.rs = numpy.random.RandomState(3)
        self.dtype = dtype

    def for_both(self, fn):
        fn(self.a, self.oa)
        fn(self.b, self.ob)

    def step(self, n=1, loss_scale=None):
        for _ in range(n):
            self.a.cleargrads()
            self.b.cleargrads()
            for (na, pa), (nb, pb) in zip(sorted(self.a.namedparams()),
                                          sorted(self.b.namedparams())):
                if pa.array is None:
                    continue
                g = self.rs.standard_normal(pa.shape).astype(pa.dtype)
                if loss_scale is not None:
                    g = (g * loss_scale).astype(pa.dtype)
                    pa._loss_scale = pb._loss_scale = loss_scale
                pa.grad = g
                pb.grad = fake_cupy.asarray(g.copy())
            self.oa.update()
            self.ob.update()
            self.check()

    def check(self, grads=False):
        tol = dict(rtol=2e-3, atol=2e-3) if self.dtype == numpy.float16 \
            else dict(rtol=1e-5, atol=1e-6)
        for (na, pa), (nb, pb) in zip(sorted(self.a.namedparams()),
                                      sorted(self.b.namedparams())):
            ra, rb = pa.update_rule, pb.update_rule
            assert (ra is None) == (rb is None) and (
                ra is None or ra.t == rb.t), na
            if pa.array is None or ra is None:
                continue
            assert type(pb.array) is fake_cupy.ndarray, nb
            assert pa.array.dtype == pb.array.dtype
            numpy.testing.assert_allclose(
                numpy.asarray(pb.array), pa.array, err_msg=na, **tol)
            if grads:
                numpy.testing.assert_allclose(
                    numpy.asarray(pb.grad), pa.grad, err_msg='grad of ' + na,
                    **tol)
            for k in ra.state:
                numpy.testing.assert_allclose(
                    numpy.asarray(rb.state[k]), ra.state[k],
                    err_msg='%s %s' % (na, k), **tol)
        assert self.oa.t == self.ob.t
        cap = captured(self.ob)
        assert cap.fallback_steps == 0, dict(cap.reasons)


@pytest.mark.parametrize('name', sorted(RULES))
def test_rule_on_fake_cupy(name):
    make, attr = RULES[name]
    t = FakeTwins(make)
    t.step(2)
    t.for_both(lambda m, o: setattr(o, attr, getattr(o, attr) * 0.7))
    t.step(2)
    gpu = captured(t.ob).gpu
    assert gpu.steps == 4
    ring, = gpu.rings.values()
    assert ring.copies == 4          # one staging copy a step


@pytest.mark.parametrize('name', sorted(HOOKS))
def test_hook_on_fake_cupy(name):
    t = FakeTwins(RULES['Adam'][0], hooks=[HOOKS[name]])
    t.step(3)


@pytest.mark.parametrize('graph', [False, True])
def test_rule_hooks_loss_scale_and_fp32_on_fake_cupy(graph):
    """graph: the option of a CUDA graph (no graph forms on fake CuPy,
    but the float16 values go into the parameters' own arrays)."""
    t = FakeTwins(RULES['MomentumSGD'][0], dtype=numpy.float16,
                  hooks=[HOOKS['WeightDecay'], HOOKS['GradientClipping']],
                  cuda_graph=graph)
    t.for_both(lambda m, o: o.use_fp32_update())
    t.for_both(lambda m, o: m.l1.W.update_rule.add_hook(H.Lasso(0.01)))
    t.for_both(lambda m, o: m.l2.W.update_rule.add_hook(
        H.GradientLARS(threshold=1e-3, weight_decay=0.01), timing='post'))
    t.for_both(lambda m, o: m.l2.b.update_rule.add_hook(
        H.GradientHardClipping(-0.1, 0.1)))
    t.for_both(lambda m, o: o.add_hook(H.WeightDecay(1e-3), name='post_wd',
                                       timing='post'))
    arrays = [p.array for p in t.b.params()]
    t.step(3, loss_scale=8.0)
    t.check(grads=True)
    if graph:
        assert all(p.array is a for p, a in zip(t.b.params(), arrays))
        assert captured(t.ob).gpu.captures == 0
    else:   # as Chainer: a new float16 array each step
        assert all(p.array is not a for p, a in zip(t.b.params(), arrays))
    assert all(p.update_rule._fp32_param.grad is None
               for p in t.b.params())


def test_post_hook_reads_the_new_float16_parameter_on_fake_cupy():
    """An optimizer's post hook runs after each parameter took its new
    float16 array (use_fp32_update): it reads that one, not the array the
    step started from (a large rate and step make the two differ)."""
    t = FakeTwins(lambda: chainer.optimizers.SGD(lr=0.5),
                  dtype=numpy.float16)
    t.for_both(lambda m, o: o.use_fp32_update())
    t.for_both(lambda m, o: o.add_hook(H.WeightDecay(1.0), timing='post'))
    for _ in range(2):
        t.step()
        t.check(grads=True)


def test_rule_that_differed_on_a_gpu_runs_chainers_update_on_fake_cupy():
    t = FakeTwins(RULES['RMSpropGraves'][0], dtype=numpy.float64)
    t.check = lambda: None           # it asserts no fallback
    with pytest.warns(static_graph.StaticGraphWarning, match='RMSpropGraves'):
        t.step()
    cap = captured(t.ob)
    assert cap.fallback_steps == 1 and cap.gpu.steps == 0
    assert any('FMA' in r for r in cap.reasons)


def test_disable_update_and_rule_hyperparameter_on_fake_cupy():
    t = FakeTwins(RULES['Adam'][0])
    t.step(1)
    t.for_both(lambda m, o: m.l1.disable_update())
    t.step(1)
    t.for_both(lambda m, o: m.l1.enable_update())
    t.for_both(lambda m, o: setattr(m.l2.W.update_rule.hyperparam,
                                    'alpha', 0.01))
    t.step(2)
    assert t.b.l1.W.update_rule.t == 3 and t.b.l2.W.update_rule.t == 4


def test_float16_without_fp32_update_on_fake_cupy():
    """On CuPy, float16 parameters update in float16 as Chainer's GPU
    kernels do (the NumPy path falls back there)."""
    t = FakeTwins(RULES['SGD'][0], dtype=numpy.float16)
    t.step(2)


def test_unsupported_hook_falls_back_before_touching_anything():
    """A hook it does not know: the step runs Chainer's update (here on
    the fake arrays, NumPy underneath), each counter moved once."""
    t = FakeTwins(RULES['SGD'][0])
    t.step(1)
    t.for_both(lambda m, o: o.add_hook(H.GradientNoise(0.01)))
    before = [p.update_rule.t for p in t.b.params()]
    t.ob.update()
    cap = captured(t.ob)
    assert cap.fallback_steps == 1
    assert any('GradientNoise' in r for r in cap.reasons)
    assert [p.update_rule.t for p in t.b.params()] == [
        x + 1 for x in before]


def test_explain_update_on_fake_cupy():
    t = FakeTwins(RULES['Adam'][0])
    t.step(2)
    text = static_graph.explain_update(t.ob)
    assert 'on CuPy: 2 steps' in text and 'one copy a step' in text
    assert chainer.config.use_static_graph is not False


def test_parameters_added_uninitialized_and_setup_again_on_fake_cupy():
    """A link added after capture (no update rule until setup is called
    again), an uninitialized parameter (its rule only counts the step)."""
    import chainer.links as L
    t = FakeTwins(RULES['MomentumSGD'][0])
    t.step(1)

    def add(m, o):
        with m.init_scope():
            m.l3 = L.Linear(3, 3)
            m.u = chainer.Parameter()
        if m is t.b:
            m.l3.W.array = fake_cupy.asarray(t.a.l3.W.array.copy())
            m.l3.b.array = fake_cupy.asarray(t.a.l3.b.array.copy())
    t.for_both(add)
    t.step(1)
    t.for_both(lambda m, o: o.setup(m))
    t.step(2)
    assert t.b.u.update_rule.t == t.a.u.update_rule.t == 2
    assert captured(t.ob).gpu.steps == 4


def test_a_rules_reader_runs_once_a_step_for_rules_that_agree(monkeypatch):
    """``update_gpu_readers.read_rule``: rules of one type whose own
    scalars and hyperparameters along their parent chains hold the same
    values share one reader call in a step (``memo``), whichever objects
    hold those values; any difference, or a change before the next step,
    reads again."""
    from chainer.optimizers.adam import AdamRule
    from static_graph import update_gpu_readers as G
    calls = []
    reader = G.RULES[AdamRule]
    monkeypatch.setitem(G.RULES, AdamRule,
                        lambda r, d: calls.append(r) or reader(r, d))
    opts = [chainer.optimizers.Adam(alpha=a) for a in (1e-3, 1e-3, 2e-3)]
    r1, r2 = AdamRule(opts[0].hyperparam), AdamRule(opts[0].hyperparam)
    r3 = AdamRule(opts[1].hyperparam)      # the same values, another object
    r4 = AdamRule(opts[2].hyperparam)      # another alpha
    r5 = AdamRule(opts[0].hyperparam)
    r5.hyperparam.beta1 = 0.8              # its own
    r6 = AdamRule(opts[0].hyperparam)
    rules = [r1, r2, r3, r4, r5, r6]
    for r in rules:
        r.t = 3
    r6.t = 4
    dtype = numpy.dtype(numpy.float32)

    def step():
        del calls[:]
        memo = {}
        return [G.read_rule(r, dtype, memo) for r in rules]
    got = step()
    assert calls == [r1, r4, r5, r6]
    assert got[1] is got[0] and got[2] is got[0]
    want = [reader(r, dtype) for r in rules]
    assert [g[1] for g in got] == [w[1] for w in want]
    assert len(set(w[1] for w in want)) == 4
    opts[0].hyperparam.alpha = 4e-3        # before the next step
    got = step()
    assert calls == [r1, r3, r4, r5, r6]
    assert [g[1] for g in got] == [reader(r, dtype)[1] for r in rules]
