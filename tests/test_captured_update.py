"""The captured optimizer update (static_graph.capture_update) trains bit for
bit like Chainer's own update, with every rule and hook, around everything
Chainer does between steps; what it cannot run falls back, once, loudly."""
import os
import warnings

import numpy
import pytest

import chainer
import chainer.links as L
from chainer import optimizer_hooks as H
from chainer import optimizers as Opt
from chainer import serializers
from chainer import training
from chainer.training import extensions

import static_graph
from tests.update_twins import HOOKS, RULES, Net, Twins, assert_same, \
    captured, loss_of


@pytest.mark.parametrize('name', sorted(RULES))
def test_rule_bit_for_bit(name):
    """Each rule, several steps, its learning rate (or another
    hyperparameter) changed between steps as an extension would."""
    make, attr = RULES[name]
    t = Twins(make)
    t.step(3)
    t.for_both(lambda m, o: setattr(o, attr, getattr(o, attr) * 0.7))
    t.step(3)
    assert captured(t.ob).steps == 6 and captured(t.ob).fallback_steps == 0


@pytest.mark.parametrize('name', ['SGD', 'Adam', 'AdaDelta'])
def test_float64(name):
    t = Twins(RULES[name][0], dtype=numpy.float64)
    t.step(3)
    assert captured(t.ob).fallback_steps == 0


@pytest.mark.parametrize('name', sorted(HOOKS))
@pytest.mark.parametrize('rule', ['MomentumSGD', 'Adam'])
def test_optimizer_hook(name, rule):
    t = Twins(RULES[rule][0], hooks=[HOOKS[name]])
    t.step(4)
    assert captured(t.ob).fallback_steps == 0


def test_hooks_together_and_post_timing():
    """Hooks in sequence (an element-wise one, the global norm, per-
    parameter norms), one of them after the update: three phases with
    reductions between them."""
    t = Twins(RULES['Adam'][0], hooks=[
        HOOKS['WeightDecay'], HOOKS['GradientClipping'],
        HOOKS['GradientLARS']])
    t.for_both(lambda m, o: o.add_hook(H.Lasso(0.001), timing='post'))
    t.for_both(lambda m, o: o.add_hook(H.GradientClipping(0.1),
                                       name='clip2', timing='post'))
    t.step(4)
    v = captured(t.ob).last[1]
    assert v.nphases >= 3
    assert captured(t.ob).fallback_steps == 0


@pytest.mark.parametrize('name', ['WeightDecay', 'Lasso',
                                  'GradientHardClipping', 'GradientLARS'])
def test_update_rule_hook(name):
    """A hook on one parameter's update rule, before and after its update."""
    t = Twins(RULES['MomentumSGD'][0])
    t.for_both(lambda m, o: m.l1.W.update_rule.add_hook(HOOKS[name]()))
    t.for_both(lambda m, o: m.l2.W.update_rule.add_hook(
        HOOKS[name](), timing='post'))
    t.step(4)
    assert captured(t.ob).fallback_steps == 0


@pytest.mark.parametrize('threads', [1, 2, 4])
def test_threads_give_the_same_bits(threads):
    """Every parameter split (min_split=1; at multiples of 16 elements,
    so a 5-element bias leaves three threads nothing): the same bits as
    Chainer for 1, 2 and 4 threads, with hooks and reductions."""
    t = Twins(RULES['AMSBound'][0], capture=dict(threads=threads,
                                                 min_split=1),
              hooks=[HOOKS['GradientClipping'], HOOKS['WeightDecay']])
    t.step(4)
    v = captured(t.ob).last[1]
    assert v.phases.split == [threads > 1] * 4


def test_blocks():
    """block=16: each thread walks its chunk in blocks (same bits)."""
    t = Twins(RULES['SMORMS3'][0], capture=dict(block=16))
    t.step(3)


def test_not_contiguous_gradient():
    """A gradient that is not C-contiguous runs its parameter unsplit, on
    the whole arrays."""
    t = Twins(RULES['Adam'][0])
    for i in range(3):
        t.backward()
        for m in (t.a, t.b):
            m.l1.W.grad = numpy.asfortranarray(m.l1.W.grad)
        t.update()


def test_numpy_error_state_reaches_the_threads():
    """numpy.seterr(all='raise'): an invalid operation in what would be a
    worker's chunk raises FloatingPointError, as Chainer's update does (the
    step is Chainer's: test_captured_update_fallback)."""
    t = Twins(RULES['Adam'][0])
    t.step(1)
    t.backward()
    for m in (t.a, t.b):
        m.l1.W.grad[-1, -1] = numpy.inf     # in the second thread's chunk
    for o in (t.oa, t.ob):
        with numpy.errstate(all='raise'):
            with pytest.raises(FloatingPointError):
                o.update()


def test_worker_pool_reports_failures():
    from schedules import parallel
    pool = parallel.WorkerPool(3)
    out = []

    def fail():
        raise ValueError('in a worker')
    with pytest.raises(ValueError, match='in a worker'):
        pool.run([[(out.append, (0,))], [(fail, ())], [(out.append, (2,))]])
    pool.run([[(out.append, (0,))], [(out.append, (1,))], []])
    assert sorted(out) == [0, 0, 1, 2]


def test_keeps_no_gradient_alive():
    """After cleargrads the last step's gradients are gone, as in Chainer
    (the captured update keeps views only of arrays that last)."""
    import gc
    import weakref
    t = Twins(RULES['Adam'][0])
    t.step(2)
    refs = [weakref.ref(p.grad) for p in t.b.params()]
    t.b.cleargrads()
    gc.collect()
    assert all(r() is None for r in refs)


def test_schedule_is_printable():
    t = Twins(RULES['Adam'][0], hooks=[HOOKS['GradientClipping']])
    assert static_graph.update_schedule(t.ob) is None
    t.step(2)
    s = static_graph.update_schedule(t.ob)
    s.verify()
    text = str(s)
    assert 'sqrt(' in text and 'GradientClipping(' in text
    # the weights run split, the biases do not
    w = [ln for ln in text.splitlines() if '/l1/W Adam' in ln]
    b = [ln for ln in text.splitlines() if '/l1/b Adam' in ln]
    assert w and all('threads=2' in ln for ln in w)
    assert b and not any('threads=' in ln for ln in b)
    assert 'view of' in text        # in place
    report = static_graph.explain_update(t.ob)
    assert '2 steps captured' in report and 'split across 2' in report
    assert static_graph.explain(t.ob) == report


def test_disable_update_and_per_parameter_hyperparameter():
    t = Twins(RULES['Adam'][0])
    t.step(2)
    t.for_both(lambda m, o: m.l1.disable_update())
    t.step(2)
    t.for_both(lambda m, o: m.l1.enable_update())
    t.for_both(lambda m, o: setattr(m.l2.W.update_rule.hyperparam,
                                    'alpha', 0.01))
    t.step(2)
    assert t.a.l1.W.update_rule.t == 4 and t.a.l2.W.update_rule.t == 6


def test_gradient_accumulation():
    """Two backward passes add into the gradients before one update."""
    t = Twins(RULES['MomentumSGD'][0])
    for i in range(3):
        t.backward()
        t.backward(clear=False)
        t.update()


def test_parameter_without_gradient():
    """A parameter the loss does not reach gets zeros (Chainer's
    reallocate_cleared_grads) and Adam still moves it."""
    class Unused(Net):
        def __init__(self, dtype=None):
            super(Unused, self).__init__(dtype)
            with self.init_scope():
                self.l3 = L.Linear(4, 4)
    t = Twins(RULES['Adam'][0], net=Unused)
    t.step(3)
    assert numpy.array_equal(t.b.l3.W.grad, numpy.zeros((4, 4), 'f'))


@pytest.mark.parametrize('dynamic', [False, True])
def test_loss_scaling(dynamic):
    """Gradients are unscaled in the update; with dynamic scaling an
    overflow (an inf put into a gradient) skips the update and halves the
    scale, as Chainer does."""
    t = Twins(RULES['Adam'][0], hooks=[HOOKS['WeightDecay']])
    if dynamic:
        t.for_both(lambda m, o: o.loss_scaling(interval=2))
    else:
        t.for_both(lambda m, o: o.loss_scaling(scale=64.0))
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', RuntimeWarning)
        warnings.simplefilter('ignore', UserWarning)  # Chainer's overflow
        for i in range(6):
            x = t.batch()
            for m, o in ((t.a, t.oa), (t.b, t.ob)):
                m.cleargrads()
                loss_of(m, x).backward(loss_scale=o._loss_scale)
                if i == 3:
                    m.l2.W.grad[0, 0] = numpy.inf
            t.update()
    assert captured(t.ob).fallback_steps == 0
    if dynamic:     # step 3 was skipped (and the scale halved)
        assert t.a.l1.W.update_rule.t == 5 and t.ob.t == 6


def test_an_array_weight_decay_rate_under_loss_scaling():
    """Chainer's WeightDecay multiplies its rate by the parameter's loss
    scale with ``rate *= scale``: a rate that is an array (0-d, read from
    a config file) is multiplied in place, once for each parameter, and
    each parameter decays with the value it has then, in Chainer's order
    of hooks and parameters. The captured update handed every parameter
    the array itself, read after all of them had multiplied it (optim31
    hunt: 19.8 off at the third step); such a step runs Chainer's
    update now."""
    t = Twins(RULES['MomentumSGD'][0],
              hooks=[lambda: H.WeightDecay(numpy.array(1e-4))])
    t.for_both(lambda m, o: o.loss_scaling(scale=4.0))
    for i in range(3):
        t.backward(loss_scale=4.0)
        t.update()
        assert t.oa._hookable._pre_update_hooks['WeightDecay'].rate == \
            t.ob._hookable._pre_update_hooks['WeightDecay'].rate
    assert captured(t.ob).fallback_steps == 3


def test_fp32_update_of_float16():
    t = Twins(RULES['Adam'][0], dtype=numpy.float16,
              hooks=[HOOKS['WeightDecay']])
    t.for_both(lambda m, o: o.use_fp32_update())
    t.for_both(lambda m, o: m.l1.W.update_rule.add_hook(H.Lasso(0.01)))
    arrays = [p.array for p in t.b.params()]
    t.step(3)
    assert captured(t.ob).fallback_steps == 0
    # as Chainer: a new float16 array each step
    assert all(p.array is not a for p, a in zip(t.b.params(), arrays))


@pytest.mark.parametrize('rule', ['MomentumSGD', 'AMSBound', 'SMORMS3'])
def test_fp32_update_with_hooks_and_loss_scaling(rule):
    """float16 parameters updated in float32 under every kind of hook (the
    optimizer's run on the float16 arrays, the rule's on the float32 copy;
    a post hook sees the new float16 array) and dynamic loss scaling."""
    t = Twins(RULES[rule][0], dtype=numpy.float16, hooks=[
        HOOKS['GradientClipping'], HOOKS['GradientLARS']])
    t.for_both(lambda m, o: o.use_fp32_update())
    t.for_both(lambda m, o: o.loss_scaling(interval=3))
    t.for_both(lambda m, o: o.add_hook(H.WeightDecay(1e-3), timing='post'))
    t.for_both(lambda m, o: m.l2.W.update_rule.add_hook(
        H.GradientLARS(threshold=1e-3, weight_decay=0.01)))
    t.for_both(lambda m, o: m.l1.b.update_rule.add_hook(
        H.GradientHardClipping(-0.1, 0.1), timing='post'))
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', RuntimeWarning)
        warnings.simplefilter('ignore', UserWarning)  # Chainer's overflow
        for i in range(5):
            x = t.batch()
            for m, o in ((t.a, t.oa), (t.b, t.ob)):
                m.cleargrads()
                loss_of(m, x).backward(loss_scale=o._loss_scale)
            t.update()
    assert captured(t.ob).fallback_steps == 0


def test_save_and_load_npz(tmp_path):
    """The captured optimizer saves the same file; loading a snapshot
    mid-run into fresh twins resumes bit for bit."""
    t = Twins(RULES['AMSGrad'][0], hooks=[HOOKS['GradientClipping']])
    t.step(3)
    files = []
    for o, name in ((t.oa, 'a'), (t.ob, 'b')):
        serializers.save_npz(str(tmp_path / ('opt_' + name)), o)
        serializers.save_npz(str(tmp_path / ('model_' + name)), o.target)
        files.append(numpy.load(str(tmp_path / ('opt_' + name))))
    assert sorted(files[0].files) == sorted(files[1].files)
    for k in files[0].files:
        assert numpy.array_equal(files[0][k], files[1][k]), k
    rs_state = t.rs.get_state()
    t.step(2)
    u = Twins(RULES['AMSGrad'][0], seed=5,
              hooks=[HOOKS['GradientClipping']])
    for m, o, name in ((u.a, u.oa, 'a'), (u.b, u.ob, 'b')):
        serializers.load_npz(str(tmp_path / ('model_' + name)), m)
        serializers.load_npz(str(tmp_path / ('opt_' + name)), o)
    u.rs.set_state(rs_state)
    u.step(2)
    assert_same(t.a, u.b, t.oa, u.ob)


def test_load_into_a_running_optimizer(tmp_path):
    """load_npz writes into the state arrays the captured update reads."""
    t = Twins(RULES['Adam'][0])
    t.step(2)
    serializers.save_npz(str(tmp_path / 'opt'), t.oa)
    serializers.save_npz(str(tmp_path / 'model'), t.a)
    t.step(3)
    for m, o in ((t.a, t.oa), (t.b, t.ob)):
        serializers.load_npz(str(tmp_path / 'model'), m)
        serializers.load_npz(str(tmp_path / 'opt'), o)
    assert t.ob.t == 2
    t.step(2)


SHIFTS = {
    'ExponentialShift': lambda: extensions.ExponentialShift('lr', 0.5),
    'LinearShift': lambda: extensions.LinearShift('lr', (0.1, 0.01), (2, 6)),
    'StepShift': lambda: extensions.StepShift('lr', 0.5, 3),
    'WarmupShift': lambda: extensions.WarmupShift('lr', 0.01, 4, 0.1),
    'PolynomialShift': lambda: extensions.PolynomialShift('lr', 0.5, 10),
    'MultistepShift': lambda: extensions.MultistepShift('lr', 0.3, [2, 5],
                                                        0.1),
    'InverseShift': lambda: extensions.InverseShift('lr', 0.2, 0.75),
}


@pytest.mark.parametrize('shift', sorted(SHIFTS))
def test_trainer_with_lr_shift_and_evaluator(shift, tmp_path):
    """StandardUpdater + Trainer + a learning-rate shift every iteration
    + Evaluator: the same training with and without the opt-in."""
    rs = numpy.random.RandomState(3)
    x = rs.standard_normal((24, 7)).astype(numpy.float32)
    y = rs.randint(0, 5, 24).astype(numpy.int32)
    dataset = chainer.datasets.TupleDataset(x, y)
    results = []
    for capture in (False, True):
        numpy.random.seed(0)
        model = L.Classifier(Net())
        opt = Opt.MomentumSGD(lr=0.1).setup(model)
        opt.add_hook(H.WeightDecay(1e-3))
        if capture:
            static_graph.capture_update(opt, min_split=64)
        it = chainer.iterators.SerialIterator(dataset, 6, shuffle=False)
        updater = training.updaters.StandardUpdater(it, opt)
        trainer = training.Trainer(updater, (8, 'iteration'),
                                   out=str(tmp_path))
        trainer.extend(SHIFTS[shift](), trigger=(1, 'iteration'))
        lrs = []
        trainer.extend(lambda tr, o=opt, lrs=lrs: lrs.append(o.lr),
                       trigger=(1, 'iteration'), name='lrs')
        trainer.extend(extensions.Evaluator(
            chainer.iterators.SerialIterator(
                dataset, 12, repeat=False, shuffle=False), model),
            trigger=(4, 'iteration'))
        trainer.run()
        results.append((model, opt, lrs))
    (a, oa, lra), (b, ob, lrb) = results
    assert lra == lrb and len(set(lra)) > 2
    assert oa.epoch == ob.epoch == 2
    assert_same(a, b, oa, ob)
    assert captured(ob).steps == 8 and captured(ob).fallback_steps == 0


@pytest.mark.parametrize('kind', ['numpy.float64', 'numpy.float32',
                                  '0-d array', 'int'])
def test_hyperparameters_of_other_types(kind):
    """A learning rate given as a NumPy scalar, a 0-d array or an int: the
    captured update computes in the dtype NumPy would (or falls back)."""
    value = {'numpy.float64': numpy.float64(0.01),
             'numpy.float32': numpy.float32(0.01),
             '0-d array': numpy.array(0.01), 'int': 1}[kind]
    t = Twins(RULES['NesterovAG'][0])
    t.for_both(lambda m, o: setattr(o, 'lr', value))
    t.step(3)
    assert captured(t.ob).fallback_steps == 0
    # NumPy 2 computes a float64 scalar times a float32 array in float64
    # (NumPy 1 in float32): so do the temporaries it feeds
    numpy2 = numpy.lib.NumpyVersion(numpy.__version__) >= '2.0.0'
    text = str(static_graph.update_schedule(t.ob))
    wide = kind in ('numpy.float64', '0-d array') and numpy2
    assert ('f64[37,7] = multiply(' in text) == wide


def test_state_arrays_are_chainers_own():
    """Written in place: the state dictionary keeps its arrays."""
    t = Twins(RULES['AMSGrad'][0])
    t.step(1)
    before = {k: v for k, v in t.b.l1.W.update_rule.state.items()}
    w = t.b.l1.W.array
    t.step(2)
    after = t.b.l1.W.update_rule.state
    assert all(after[k] is before[k] for k in before)
    assert t.b.l1.W.array is w


def test_parameters_added_and_setup_again():
    t = Twins(RULES['Adam'][0])
    t.step(2)
    # a new link: no update rule until setup, hooks and all else as Chainer
    for m in (t.a, t.b):
        with m.init_scope():
            m.l3 = L.Linear(5, 5)
    numpy.random.seed(1)
    w = t.a.l3.W.array.copy()
    t.b.l3.W.array[...] = w
    t.b.l3.b.array[...] = t.a.l3.b.array
    t.step(2)
    t.for_both(lambda m, o: o.setup(m))     # new rules, t = 0
    t.step(2)
    assert captured(t.ob).fallback_steps == 0


def test_a_new_optimizer_on_the_same_model():
    """A second optimizer set up on the model takes its parameters' rules;
    the captured one updates with whatever rules they hold, as Chainer."""
    t = Twins(RULES['Adam'][0])
    t.step(2)
    t.for_both(lambda m, o: Opt.SGD(lr=0.1).setup(m))
    t.step(2)
    assert isinstance(t.b.l1.W.update_rule, Opt.sgd.SGDRule)


def test_uninitialized_parameter():
    """A link never called keeps its parameters uninitialized: Chainer's
    rules count the step (t) and do nothing else; so does the capture."""
    class Lazy(Net):
        def __init__(self, dtype=None):
            super(Lazy, self).__init__(dtype)
            with self.init_scope():
                self.lazy = L.Linear(None, 3)
    t = Twins(RULES['Adam'][0], net=Lazy,
              hooks=[HOOKS['WeightDecay'], HOOKS['GradientClipping']])
    t.step(2)
    assert t.b.lazy.W.update_rule.t == 2 and t.b.lazy.W.array is None
    assert captured(t.ob).fallback_steps == 0
    x = numpy.ones((2, 4), 'f')
    for m in (t.a, t.b):
        numpy.random.seed(0)
        m.lazy(x)           # now initialized: planned again
    t.step(2)
    assert captured(t.ob).fallback_steps == 0


def test_capture_before_setup():
    numpy.random.seed(0)
    a, b = Net(), Net()
    b.copyparams(a)
    ob = static_graph.capture_update(Opt.Adam())
    ob.setup(b)
    oa = Opt.Adam().setup(a)
    for i in range(2):
        x = numpy.full((3, 7), i + 1, 'f')
        for m, o in ((a, oa), (b, ob)):
            m.cleargrads()
            loss_of(m, x).backward()
            o.update()
    assert_same(a, b, oa, ob)
    assert captured(ob).steps == 2


class FakeCommunicator(object):
    """A one-process stand-in: the mean of one process's gradients is
    themselves."""

    def bcast_data(self, model):
        pass

    def multi_node_mean_grad(self, model, zero_fill=False):
        pass


@pytest.mark.parametrize('on', ['wrapper', 'actual'])
def test_chainermn_multi_node_optimizer(on):
    chainermn = pytest.importorskip('chainermn')

    def make():
        return Opt.Adam()
    numpy.random.seed(0)
    a, b = Net(), Net()
    b.copyparams(a)
    oa = chainermn.create_multi_node_optimizer(make(), FakeCommunicator())
    ob_actual = make()
    ob = chainermn.create_multi_node_optimizer(ob_actual, FakeCommunicator())
    oa.setup(a)
    ob.setup(b)
    assert static_graph.capture_update(
        ob if on == 'wrapper' else ob_actual) is not None
    rs = numpy.random.RandomState(0)
    for i in range(4):
        x = rs.standard_normal((6, 7)).astype(numpy.float32)
        for m, o in ((a, oa), (b, ob)):
            o.update(loss_of, m, x)
    assert captured(ob_actual).steps == 3    # the first only broadcasts
    assert_same(a, b, oa.actual_optimizer, ob_actual)


def test_with_a_static_graph_model():
    """The library's two halves together: a decorated forward replayed,
    its gradients updated by the captured update; the same bits as
    define-by-run and Chainer's update."""
    class StaticNet(Net):
        @static_graph.static_graph
        def forward(self, x):
            return super(StaticNet, self).forward(x)
    numpy.random.seed(0)
    a, b = Net(), StaticNet()
    b.copyparams(a)
    oa = Opt.Adam().setup(a)
    ob = static_graph.capture_update(Opt.Adam().setup(b), min_split=64)
    rs = numpy.random.RandomState(1)
    for i in range(4):
        x = rs.standard_normal((6, 7)).astype(numpy.float32)
        for m, o in ((a, oa), (b, ob)):
            o.update(loss_of, m, x)
        assert_same(a, b, oa, ob)
    assert static_graph.cached(b)[0].state == 'complete'
    assert captured(ob).steps == 4


def test_schedules_do_not_import_chainer():
    import subprocess
    import sys
    code = ('import sys; import schedules.update_rules, schedules.parallel, '
            'schedules.update_ir, schedules.update_cuda; '
            'assert "chainer" not in sys.modules')
    subprocess.check_call([sys.executable, '-c', code],
                          cwd=os.path.dirname(os.path.dirname(__file__)))


def test_threads_default_is_the_affinity():
    o = static_graph.capture_update(Opt.SGD())
    assert captured(o).threads == len(os.sched_getaffinity(0))


def test_split_or_not_is_measured_and_the_faster_kept():
    """Split and whole give the same bits, so the captured update keeps
    whichever ran faster over its first steps (up to 4 of each,
    alternating; 2 of each where every time of one is below every time of
    the other), and measures again every 500 steps."""
    from schedules.parallel import SplitChoice as _SplitChoice
    c = _SplitChoice(2)
    seen = []
    times = {True: [1.0, 2.5, 1.2, 1.1], False: [2.0, 1.5, 2.2, 2.1]}
    for _ in range(8):
        pool, measuring = c.use_pool()
        assert measuring
        seen.append(pool)
        c.took(pool, times[pool][len(c.times[pool])])   # overlapping
    assert seen == [True, False] * 4
    assert c.use_pool() == (True, False) and c.choice is True
    for _ in range(_SplitChoice.REPROBE):
        assert c.use_pool() == (True, False)
    pool, measuring = c.use_pool()          # measuring again
    assert measuring
    seen = [pool]
    while measuring:
        c.took(pool, 1.0 if not pool else 3.0)   # now whole is clearly faster
        pool, measuring = c.use_pool()
        seen.append(pool)
    assert seen == [True, False, True, False, False]   # decided after 2+2
    assert c.choice is False and not pool
    assert _SplitChoice(1).use_pool() == (False, False)
    assert 'not split' in c.describe()
