"""The captured update's steady path on CuPy (update_cupy_steady.py), on
fake CuPy: a step like the one before reuses its device work and reads
only the rules' scalars. Two captured twins train side by side, one with
the steady path, one reading every step in full; through everything that
may change between steps, they must stay the same bits (the same fake
kernels run on both: only how the step is read differs)."""
import numpy
import pytest

import chainer
from chainer import optimizer_hooks as H

import static_graph
from static_graph import update_cupy
from tests import fake_cupy
from tests.update_steady_fuzz import steady_path
from tests.update_twins import RULES, Net, captured


@pytest.fixture(autouse=True)
def fake(monkeypatch):
    monkeypatch.setattr(update_cupy, 'cupy_module', lambda: fake_cupy)
    yield


class Twins(object):
    """``models[0]`` with the steady path, ``models[1]`` without; both
    captured on fake CuPy, with gradients given as the same arrays at
    every step (as a CUDA graph lends them) unless ``fresh``."""

    def __init__(self, make_opt, dtype=None):
        numpy.random.seed(0)
        a = Net(dtype)
        b = Net(dtype)
        b.copyparams(a)
        self.models = [a, b]
        self.opts = []
        for m in self.models:
            for p in m.params():
                p.array = fake_cupy.asarray(p.array.copy())
            o = make_opt().setup(m)
            static_graph.capture_update(o, threads=1, cuda_graph=False)
            self.opts.append(o)
        self.grads = [dict((n, fake_cupy.asarray(numpy.zeros(p.shape,
                                                             p.dtype)))
                           for n, p in m.namedparams()) for m in self.models]
        self.rs = numpy.random.RandomState(3)
        self.kept = []

    def for_both(self, fn):
        for m, o in zip(self.models, self.opts):
            fn(m, o)

    def step(self, n=1, fresh=False, loss_scale=None):
        for _ in range(n):
            values = dict((name, self.rs.standard_normal(p.shape).astype(
                p.dtype)) for name, p in self.models[0].namedparams())
            for m, o, grads, steady in zip(self.models, self.opts,
                                           self.grads, (True, False)):
                m.cleargrads()
                for name, p in m.namedparams():
                    if fresh:
                        # (kept: no new one lands where an old one was)
                        p.grad = fake_cupy.asarray(values[name].copy())
                        self.kept.append(p.grad)
                    else:
                        g = grads[name]
                        numpy.copyto(g, values[name])
                        p.grad = g
                    p._loss_scale = loss_scale    # (backward sets it)
                with steady_path(steady):
                    o.update()
            self.check()

    def check(self):
        a, b = self.models
        for (na, pa), (nb, pb) in zip(sorted(a.namedparams()),
                                      sorted(b.namedparams())):
            assert na == nb
            numpy.testing.assert_array_equal(pa.array, pb.array, err_msg=na)
            ra, rb = pa.update_rule, pb.update_rule
            assert ra.t == rb.t, na
            assert sorted(ra.state) == sorted(rb.state), na
            for k in ra.state:
                numpy.testing.assert_array_equal(
                    ra.state[k], rb.state[k], err_msg='%s %s' % (na, k))
        assert self.opts[0].t == self.opts[1].t

    def steady_steps(self):
        return [captured(o).gpu.steady_steps for o in self.opts]


@pytest.mark.parametrize('name', ['Adam', 'AdaBound', 'MomentumSGD',
                                  'RMSprop', 'AdaDelta'])
def test_steady_steps_are_the_full_steps_bits(name):
    make, attr = RULES[name]
    t = Twins(make)
    t.step(3)      # two steps on the same arrays read in full, then one
    steady = t.steady_steps()[0]
    assert steady == 1 and t.steady_steps()[1] == 0
    # A hyperparameter of the optimizer, then of one rule: read each step.
    t.for_both(lambda m, o: setattr(o, attr, getattr(o, attr) * 0.5))
    t.step(2)
    t.for_both(lambda m, o: setattr(m.l2.W.update_rule.hyperparam, attr,
                                    getattr(o, attr) * 3))
    t.step(2)
    assert t.steady_steps()[0] == steady + 4


def test_what_changes_the_work_reads_the_step_in_full():
    """After each change, two steps read in full (the second on the same
    arrays as the first makes the template), then the third is read in
    part; where the change stays (hooks, new gradient arrays), every step
    is read in full."""
    t = Twins(RULES['Adam'][0])
    t.step(3)
    assert t.steady_steps()[0] == 1

    def after(change, n):
        t.for_both(change)
        t.step(3)
        assert t.steady_steps()[0] == n

    # A link's update disabled, then enabled.
    after(lambda m, o: m.l1.disable_update(), 2)
    after(lambda m, o: m.l1.enable_update(), 3)
    # A parameter given a new array.
    after(lambda m, o: setattr(m.l2.b, 'array', m.l2.b.array.copy()), 4)
    # A state array replaced (as deserializing may): the template's work
    # would update the old one.
    after(lambda m, o: m.l1.W.update_rule.state.__setitem__(
        'm', m.l1.W.update_rule.state['m'].copy()), 5)
    # Static loss scaling (each gradient divided first), from a step that
    # was read in part.
    t.step(3, loss_scale=8.0)
    assert t.steady_steps()[0] == 5
    t.step(3)
    assert t.steady_steps()[0] == 6
    # Gradients that are new arrays at new places at every step.
    t.step(3, fresh=True)
    assert t.steady_steps()[0] == 6
    # A hook of a rule's own, then of the optimizer.
    after(lambda m, o: m.l1.W.update_rule.add_hook(H.Lasso(0.01)), 6)
    after(lambda m, o: o.add_hook(H.WeightDecay(1e-3)), 6)
    assert t.steady_steps()[1] == 0


def test_fp32_update_turned_on_reads_in_full():
    t = Twins(lambda: chainer.optimizers.MomentumSGD(lr=0.05),
              numpy.float16)
    t.step(3)
    assert t.steady_steps()[0] == 1
    t.for_both(lambda m, o: o.use_fp32_update())
    t.step(3)
    assert t.steady_steps()[0] == 1


def test_a_reader_that_raises_is_read_in_full():
    """An eps that underflows in the parameters' dtype, set between two
    steps: the steady read raises and puts every t back, the full read
    raises too, and Chainer's own update runs that step (and raises, as it
    does): the same on both twins."""
    t = Twins(lambda: chainer.optimizers.RMSprop())
    t.step(3)
    assert t.steady_steps()[0] == 1
    t.for_both(lambda m, o: setattr(o, 'eps', 1e-50))
    for m, o, steady in zip(t.models, t.opts, (True, False)):
        with steady_path(steady), pytest.warns(
                static_graph.StaticGraphWarning, match='underflows'), \
                pytest.raises(ValueError, match='too small'):
            o.update()
        assert captured(o).fallback_steps == 1
    t.check()
    assert t.steady_steps()[0] == 1
