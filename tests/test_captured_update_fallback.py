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
from tests.update_twins import Net, RULES, Twins, captured


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
