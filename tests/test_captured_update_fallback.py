"""The captured update falls back to Chainer's own update where it cannot
run a step as Chainer would: the same numbers, the reason warned once and
listed by explain_update."""
import copy
import pickle
import types
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


def _masked(rule, param):
    # (A user's own step for one rule: only the first row of W moves.)
    param.array[:1] -= 0.01 * param.grad[:1]


def _rule_method(m, o):
    rule = m.l1.W.update_rule
    rule.update_core_cpu = types.MethodType(_masked, rule)


def _optimizer_method(m, o):
    o.is_safe_to_update = lambda: False     # (Chainer skips the step)


def _parameter_method(m, o):
    p = m.l1.W
    p.update = lambda: None                 # (a frozen parameter)


FALLBACKS = {
    'rule': (_custom_rule, 'NoisyRule is not one the captured update'),
    'a method set on a rule': (
        _rule_method, 'an update rule has method update_core_cpu set on '
        'itself'),
    'a method set on the optimizer': (
        _optimizer_method, 'the optimizer has method is_safe_to_update'),
    'a method set on a parameter': (
        _parameter_method, 'a parameter has method update set on itself'),
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


def test_a_method_set_on_a_rule_and_removed():
    """Where the method set on one object goes again, the steps are
    captured again."""
    t = Twins(RULES['Adam'][0])
    t.step(1)
    t.for_both(_rule_method)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        t.step(2)
    t.for_both(lambda m, o: delattr(m.l1.W.update_rule, 'update_core_cpu'))
    t.step(2)
    cap = captured(t.ob)
    assert cap.steps == 3 and cap.fallback_steps == 2


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


class WideBasePlusDelta(Net):
    """base + delta of 3500 elements each, unsplit at min_split=8192, and
    a 60000-element weight, split across the threads: the two run at once
    on two threads."""

    def __init__(self, dtype=None):
        super(WideBasePlusDelta, self).__init__(dtype)
        rs = numpy.random.RandomState(1)
        with self.init_scope():
            self.base = chainer.Parameter(
                rs.standard_normal((500, 7)).astype('f') * 0.01)
            self.delta = chainer.Parameter(numpy.zeros((500, 7), 'f'))
            self.big = chainer.links.Linear(500, 120, initialW=(
                rs.standard_normal((120, 500)).astype('f') * 0.01))

    def forward(self, x):
        return self.big(chainer.functions.linear(x, self.base + self.delta))


def _decay_both(m, o):
    for p in (m.base, m.delta):
        p.update_rule.add_hook(H.WeightDecay(0.1))


@pytest.mark.parametrize('case', ['loss scale', 'rule hook', 'one array'])
def test_parameters_sharing_memory_update_one_after_the_other(
        case, monkeypatch):
    """Chainer updates two parameters of one gradient (or one array) one
    after the other, the second seeing what the first wrote: the gradient
    divided by the loss scale twice, a rule's WeightDecay added twice, two
    updates of one array. A split step ran them at once on two threads
    (0.0148 off after two SGD steps with loss scaling); a step with
    parameters sharing memory now runs on one thread, in order, and says
    so."""
    from schedules import parallel

    def last_thread_first(self, parts, errstate=None):
        # The threads' parts one after the other, the last thread's first:
        # an order a busy machine gives (on an idle one the worker often
        # starts after the caller's part is done); the step's result must
        # not depend on it.
        for part in reversed(parts):
            parallel._run_tasks(part)

    monkeypatch.setattr(parallel.WorkerPool, 'run', last_thread_first)
    # Every step split (not only those the measurement picks).
    monkeypatch.setattr(parallel.SplitChoice, 'use_pool',
                        lambda self: (True, False))
    t = Twins(RULES['SGD'][0], net=WideBasePlusDelta, capture=dict(
        threads=2, min_split=8192))
    kw = {}
    if case == 'loss scale':
        kw['loss_scale'] = 16.0
    elif case == 'rule hook':
        t.for_both(_decay_both)
    else:
        t.for_both(lambda m, o: setattr(m.delta, 'array', m.base.array))
    t.step(8, **kw)
    assert captured(t.ob).fallback_steps == 0
    assert 'share memory' in static_graph.explain_update(t.ob)


def test_smorms3_with_a_wider_hyperparameter_falls_back():
    """eps as a one-element float64 array: Chainer's SMORMS3 binds new
    state arrays, which NumPy makes float64; the captured step wrote into
    the float32 ones (7.5e-9 off at the second step)."""
    t = Twins(RULES['SMORMS3'][0])
    t.for_both(lambda m, o: setattr(o, 'eps', numpy.array([1e-16])))
    with pytest.warns(StaticGraphWarning, match='SMORMS3 with eps of dtype '
                                                'float64'):
        t.step(3)
    assert t.b.l1.W.update_rule.state['g'].dtype == numpy.float64
    assert captured(t.ob).fallback_steps == 3


def test_an_error_raised_by_numpy_stops_the_step_where_chainers_stops():
    """Under numpy.seterr(all='raise') an overflow in the first
    parameter's update raises; Chainer has counted that rule's step and
    not the others'. The captured step had counted every rule's (Adam's
    bias correction then differed: 1.4e-4 two steps later): such steps
    run Chainer's update."""
    t = Twins(RULES['Adam'][0])
    t.step(1)
    t.backward()
    for m in (t.a, t.b):
        m.l1.W.grad[0, 0] = numpy.float32(3e38)
    with numpy.errstate(all='raise'):
        for o in (t.oa, t.ob):
            with pytest.raises(FloatingPointError):
                with warnings.catch_warnings():
                    warnings.simplefilter('ignore', StaticGraphWarning)
                    o.update()
    t.check()
    t.step(2)
    assert captured(t.ob).fallback_steps == 1


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


def test_a_one_element_hyperparameter_of_more_dimensions_falls_back():
    """AdamW's alpha as [[[1e-3]]]: Chainer's assignment drops the update's
    extra dimensions, the captured kernels raised ValueError at every step
    (after counting it)."""
    t = Twins(lambda: Opt.AdamW(weight_decay_rate=0.01))
    t.for_both(lambda m, o: setattr(o.hyperparam, 'alpha',
                                    numpy.array([[[1e-3]]])))
    with pytest.warns(StaticGraphWarning,
                      match=r'alpha_t is an array of shape \(1, 1, 1\)'):
        t.step(2)
    assert captured(t.ob).fallback_steps == 2


class _Lazy(chainer.Chain):
    def __init__(self):
        super(_Lazy, self).__init__()
        with self.init_scope():
            self.l = chainer.links.Linear(3, 2)
            self.e = chainer.Parameter(numpy.ones((3,), 'f'))
            self.unused = chainer.links.Linear(None, 2)

    def forward(self, x):
        # F.sum's backward hands e a broadcast gradient: read-only.
        return chainer.functions.sum(self.l(x)) + \
            chainer.functions.sum(self.e)


def _raising_updates(capture, case):
    numpy.random.seed(0)
    m = _Lazy()
    o = Opt.Adam().setup(m)
    if case == 'optimizer hook, read-only gradient':
        o.add_hook(H.WeightDecay(1e-2))
    elif case == 'rule hook, read-only gradient':
        m.e.update_rule.add_hook(H.WeightDecay(1e-2))
    if capture:
        static_graph.capture_update(o)
    out = []
    for i in range(3):
        if case != 'uninitialized, no cleargrads':
            m.cleargrads()
        m(numpy.ones((4, 3), 'f')).backward()
        if case == 'read-only parameter' and i == 1:
            m.l.W.array.flags.writeable = False     # the same array
        try:
            o.update()
            out.append('ok')
        except (ValueError, RuntimeError) as e:
            out.append(type(e).__name__)
    return (out, o.t, [(n, p.update_rule.t, p.update_rule.state is None)
                       for n, p in sorted(m.namedparams())],
            [p.array for _, p in sorted(m.namedparams())])


@pytest.mark.parametrize('case', [
    'read-only parameter', 'optimizer hook, read-only gradient',
    'rule hook, read-only gradient', 'uninitialized, no cleargrads'])
def test_a_step_chainer_raises_in_runs_chainers_update(case):
    """Where Chainer's update raises (a parameter made read-only between
    steps, a read-only gradient a hook writes into, the gradient of an
    uninitialized parameter read before any cleargrads), the step runs
    Chainer's update and raises where it does. The captured update wrote
    into the read-only parameter through the flat view it kept (0.8 off
    after 3 steps), raised only after counting every rule's step and
    making its state, or counted the step and went on."""
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        a = _raising_updates(False, case)
        b = _raising_updates(True, case)
    assert 'ok' in a[0] or case != 'read-only parameter'
    assert any(r != 'ok' for r in a[0])
    assert a[:3] == b[:3]
    for u, v in zip(a[3], b[3]):
        assert (u is None and v is None) or u.tobytes() == v.tobytes()
