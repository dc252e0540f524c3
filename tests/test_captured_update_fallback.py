"""The captured update falls back to Chainer's own update where it cannot
run a step as Chainer would: the same numbers, the reason warned once and
listed by explain_update."""
import copy
import pickle
import warnings

import numpy
import pytest

import chainer
from chainer import optimizer_hooks as H
from chainer import optimizers as Opt

import static_graph
from static_graph import StaticGraphWarning
from tests.update_twins import HOOKS, Net, RULES, Twins, captured


class NoisyRule(Opt.sgd.SGDRule):
    """A rule of one's own: falls back."""

    def update_core_cpu(self, param):
        param.array -= self.hyperparam.lr * param.grad * 1.5


def _custom_rule(m, o):
    m.l1.W.update_rule = NoisyRule(o.hyperparam)


def _noise(m, o):
    o.add_hook(H.GradientNoise(0.01, noise_func=lambda xp, shape, dtype,
                               hook, rule: xp.full(shape, 0.001, dtype)))


def _own_hook(m, o):
    def hook(opt):
        for p in opt.target.params():
            p.grad *= 0.5
    hook.name = 'half'
    o.add_hook(hook)


FALLBACKS = {
    'rule': (_custom_rule, 'NoisyRule is not one the captured update'),
    'GradientNoise': (_noise, 'hook GradientNoise is not one'),
    'hook': (_own_hook, 'hook half is not one'),
}


@pytest.mark.parametrize('name', sorted(FALLBACKS))
def test_fallback(name):
    """Unsupported: each step runs Chainer's update (same bits); the reason
    is warned once and listed by explain_update."""
    change, reason = FALLBACKS[name]
    t = Twins(RULES['SGD'][0])
    t.step(1)
    t.for_both(change)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        t.step(3)
    ours = [w for w in caught if issubclass(w.category, StaticGraphWarning)]
    assert len(ours) == 1 and reason in str(ours[0].message)
    cap = captured(t.ob)
    assert cap.steps == 1 and cap.fallback_steps == 3
    assert reason in static_graph.explain_update(t.ob)


def test_float16_without_fp32_update_falls_back():
    t = Twins(RULES['Adam'][0], dtype=numpy.float16)
    with pytest.warns(StaticGraphWarning, match='float16 parameter'):
        t.step(2)
    assert captured(t.ob).fallback_steps == 2


class SubArray(numpy.ndarray):
    pass


def test_array_that_is_not_numpys_own_falls_back():
    """Anything but numpy.ndarray (CuPy, ChainerX, iDeep; here a subclass)
    runs Chainer's update."""
    t = Twins(RULES['SGD'][0])
    t.for_both(lambda m, o: setattr(m.l1.W, 'array',
                                    m.l1.W.array.view(SubArray)))
    with pytest.warns(StaticGraphWarning, match='SubArray'):
        t.step(2)
    assert captured(t.ob).fallback_steps == 2


def test_a_link_registered_twice_falls_back():
    """Chainer updates a shared link's parameters twice a step."""
    class Twice(Net):
        def __init__(self, dtype=None):
            super(Twice, self).__init__(dtype)
            with self.init_scope():
                self.again = self.l1
    t = Twins(RULES['Adam'][0], net=Twice)
    with pytest.warns(StaticGraphWarning, match='twice'):
        t.step(2)


def test_optimizer_class_of_ones_own_falls_back():
    class MySGD(Opt.SGD):
        def update(self, lossfun=None, *args, **kwds):
            self.calls = getattr(self, 'calls', 0) + 1
            return super(MySGD, self).update(lossfun, *args, **kwds)
    t = Twins(lambda: MySGD(lr=0.1))
    with pytest.warns(StaticGraphWarning, match='overrides'):
        t.step(2)
    assert t.ob.calls == 2


def test_config_flag_turns_it_off():
    t = Twins(RULES['Adam'][0])
    with chainer.using_config('use_static_graph', False):
        t.step(2)
    t.step(1)
    assert captured(t.ob).steps == 1


def test_copies_are_plain_optimizers():
    t = Twins(RULES['Adam'][0])
    t.step(1)
    for c in (copy.copy(t.ob), copy.deepcopy(t.ob),
              pickle.loads(pickle.dumps(t.ob))):
        assert type(c) is Opt.Adam and captured(c) is None
    assert type(t.ob).__name__ == 'Adam' and isinstance(t.ob, Opt.Adam)


class Temperature(Net):
    """A 0-d parameter (SAC's log-temperature)."""

    def __init__(self, dtype=None):
        super(Temperature, self).__init__(dtype)
        with self.init_scope():
            self.log_t = chainer.Parameter(numpy.array(0.3, numpy.float32))

    def forward(self, x):
        return super(Temperature, self).forward(x) * self.log_t


@pytest.mark.skipif(int(numpy.__version__.split('.')[0]) >= 2,
                    reason='NumPy 2 computes 0-d arrays by their dtype')
@pytest.mark.parametrize('rule', ['SGD', 'MomentumSGD', 'Adam'])
def test_a_0d_parameter_falls_back_on_numpy_1(rule):
    """NumPy 1 computes Chainer's ``lr * grad`` of a 0-d float32 gradient
    in float64: the captured float32 loops were an ulp off each step."""
    t = Twins(RULES[rule][0], net=Temperature)
    with pytest.warns(StaticGraphWarning, match='0-d parameter /log_t'):
        t.step(4)
    assert captured(t.ob).fallback_steps == 4


class BasePlusDelta(Net):
    """W = base + delta: Add's backward gives both one gradient array."""

    def __init__(self, dtype=None):
        super(BasePlusDelta, self).__init__(dtype)
        with self.init_scope():
            self.base = chainer.Parameter(numpy.full((5, 7), 0.5, 'f'))
            self.delta = chainer.Parameter(numpy.full((5, 7), 0.01, 'f'))

    def forward(self, x):
        return chainer.functions.linear(x, self.base + self.delta)


@pytest.mark.parametrize('hook', ['GradientClipping', 'WeightDecay',
                                  'GradientLARS'])
def test_parameters_sharing_a_gradient_under_a_hook_fall_back(hook):
    """Chainer runs the hook over both (one array: twice) before either
    rule; the captured step ran hook and rule a parameter at a time (off by
    7e-3 after three SGD steps)."""
    t = Twins(RULES['SGD'][0], net=BasePlusDelta, hooks=[HOOKS[hook]])
    with pytest.warns(StaticGraphWarning, match='share the memory'):
        t.step(3)
    assert t.b.base.grad is t.b.delta.grad
    assert captured(t.ob).fallback_steps == 3


def test_parameters_sharing_a_gradient_without_hooks_stay_captured():
    t = Twins(RULES['Adam'][0], net=BasePlusDelta)
    t.step(3)
    assert captured(t.ob).fallback_steps == 0


def test_a_hyperparameter_array_falls_back():
    """A learning rate per row (Chainer broadcasts it) crashed the step."""
    t = Twins(RULES['MomentumSGD'][0])
    t.for_both(lambda m, o: setattr(
        m.l1.W.update_rule.hyperparam, 'lr',
        numpy.linspace(0.01, 0.1, 37, dtype='f')[:, None]))
    with pytest.warns(StaticGraphWarning, match=r'lr is an array of shape'):
        t.step(2)
    assert captured(t.ob).fallback_steps == 2


def test_adam_weight_decay_as_an_array_falls_back():
    """A one-element array weight_decay_rate (or eta) crashed the captured
    step (a dict key of an array); Chainer computes with it as an array."""
    t = Twins(lambda: Opt.Adam(weight_decay_rate=numpy.array([0.01])))
    with pytest.warns(StaticGraphWarning, match='is an array'):
        t.step(2)
    assert captured(t.ob).fallback_steps == 2
