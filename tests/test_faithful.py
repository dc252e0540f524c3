"""Define-by-run and static twins train to the same numbers (issue 2, point 6).

Every test trains both twins side by side for several iterations with fresh
inputs, comparing outputs, every gradient, and the parameters after each
optimizer step.
"""
import os
import warnings

import numpy
import pytest

import chainer
import chainer.functions as F
import chainer.links as L
from chainer import optimizer_hooks

from static_graph import static_graph
from static_graph.decorator import caches_of
from tests.twins import compare_chains, train_twins, assert_close

OPTIMIZERS = {
    'sgd': lambda: chainer.optimizers.SGD(lr=0.1),
    'momentum': lambda: chainer.optimizers.MomentumSGD(lr=0.05),
    'adam': lambda: chainer.optimizers.Adam(),
}
rs = numpy.random.RandomState(42)


def twin(cls):
    """make(static) for a chain class whose ``forward`` is undecorated."""
    static_cls = type('Static' + cls.__name__, (cls,),
                      {'forward': static_graph(cls.forward)})

    def make(static):
        return static_cls() if static else cls()
    return make


def data(*shape, dtype=numpy.float32):
    return rs.standard_normal(shape).astype(dtype)


def labels(n, k):
    return rs.randint(0, k, n).astype(numpy.int32)


def cache(model, method='forward'):
    return caches_of(model)[method]


class MLP(chainer.Chain):
    def __init__(self, n_in=12, n_hidden=16, n_out=5):
        super(MLP, self).__init__()
        with self.init_scope():
            self.l1 = L.Linear(n_in, n_hidden)
            self.l2 = L.Linear(n_hidden, n_hidden)
            self.l3 = L.Linear(n_hidden, n_out)

    def forward(self, x, t):
        h = F.relu(self.l1(x))
        h = F.relu(self.l2(h))
        return F.softmax_cross_entropy(self.l3(h), t)


@pytest.mark.parametrize('opt', sorted(OPTIMIZERS))
def test_mlp(opt):
    steps = [lambda m, x=data(8, 12), t=labels(8, 5): m(x, t)
             for _ in range(5)]
    a, b = train_twins(twin(MLP), steps, OPTIMIZERS[opt])
    c = cache(b)
    assert c.recordings == 1 and c.replays == 4


class CNN(chainer.Chain):
    def __init__(self):
        super(CNN, self).__init__()
        with self.init_scope():
            self.c1 = L.Convolution2D(1, 4, 3, pad=1)
            self.c2 = L.Convolution2D(4, 6, 3)
            self.fc = L.Linear(None, 3)

    def forward(self, x, t):
        h = F.max_pooling_2d(F.relu(self.c1(x)), 2)
        h = F.max_pooling_2d(F.relu(self.c2(h)), 2, stride=1)
        h = F.average_pooling_2d(h, 2)
        return F.softmax_cross_entropy(self.fc(h), t)


@pytest.mark.parametrize('opt', sorted(OPTIMIZERS))
def test_cnn_max_pooling(opt):
    steps = [lambda m, x=data(4, 1, 10, 10), t=labels(4, 3): m(x, t)
             for _ in range(4)]
    a, b = train_twins(twin(CNN), steps, OPTIMIZERS[opt])
    assert cache(b).replays == 3


class DropoutNet(chainer.Chain):
    def __init__(self):
        super(DropoutNet, self).__init__()
        with self.init_scope():
            self.l1 = L.Linear(10, 20)
            self.l2 = L.Linear(20, 3)

    def forward(self, x):
        h = F.dropout(F.relu(self.l1(x)), 0.5)
        return F.sum(F.dropout(self.l2(h), 0.2) ** 2)


def test_dropout_mask_resampled_each_call():
    steps = [lambda m, x=data(6, 10): m(x) for _ in range(5)]
    a, b = train_twins(twin(DropoutNet), steps, OPTIMIZERS['momentum'])
    # Same input twice: different masks must give different outputs.
    x = data(6, 10)
    numpy.random.seed(1)
    y1 = b(x).array.copy()
    numpy.random.seed(2)
    y2 = b(x).array.copy()
    numpy.random.seed(1)
    y3 = b(x).array.copy()
    assert y1 != y2
    assert y1 == y3
    assert cache(b).recordings == 1


class BNNet(chainer.Chain):
    def __init__(self):
        super(BNNet, self).__init__()
        with self.init_scope():
            self.c = L.Convolution2D(2, 4, 3, pad=1)
            self.bn = L.BatchNormalization(4)
            self.l = L.Linear(144, 3)

    def forward(self, x):
        h = F.relu(self.bn(self.c(x)))
        return self.l(h)


def test_batchnorm_train_then_eval():
    steps = [lambda m, x=data(5, 2, 6, 6): m(x) for _ in range(5)]
    a, b = train_twins(twin(BNNet), steps, OPTIMIZERS['sgd'])
    # Running statistics moved and agree (compare_chains checks them).
    assert not numpy.allclose(b.bn.avg_mean, 0)
    with chainer.using_config('train', False):
        steps = [lambda m, x=data(5, 2, 6, 6): m(x) for _ in range(3)]
        for step in steps:
            ya, yb = step(a), step(b)
            assert_close(ya.array, yb.array, 'eval output')
            a.cleargrads()
            b.cleargrads()
            F.sum(ya * ya).backward()
            F.sum(yb * yb).backward()
            compare_chains(a, b)
    # train and eval recorded separately
    assert cache(b).recordings == 2


class ClassifierNet(chainer.Chain):
    """softmax_cross_entropy and accuracy inside, labels as t=..."""

    def __init__(self):
        super(ClassifierNet, self).__init__()
        with self.init_scope():
            self.l1 = L.Linear(8, 12)
            self.l2 = L.Linear(12, 4)

    def forward(self, x, t=None, train=True):
        h = F.dropout(F.relu(self.l1(x)), 0.1 if train else 0.0)
        y = self.l2(h)
        if t is None:
            return y
        loss = F.softmax_cross_entropy(y, t)
        acc = F.accuracy(y, t)
        chainer.report({'loss': loss, 'accuracy': acc}, self)
        return loss, acc


def test_labels_positional_and_keyword():
    steps = []
    for i in range(6):
        x, t = data(7, 8), labels(7, 4)
        if i % 2:
            steps.append(lambda m, x=x, t=t: m(x, t))
        else:
            steps.append(lambda m, x=x, t=t: m(x, t=t))
    a, b = train_twins(twin(ClassifierNet), steps, OPTIMIZERS['adam'])
    # Positional and keyword labels are two keys, each recorded once.
    assert cache(b).recordings == 2


def test_train_false_keyword_and_no_labels():
    steps = [lambda m, x=data(7, 8), t=labels(7, 4): m(x, t, train=False)
             for _ in range(3)]
    steps += [lambda m, x=data(7, 8): m(x) for _ in range(3)]
    a, b = train_twins(twin(ClassifierNet), steps, OPTIMIZERS['sgd'])
    assert cache(b).recordings == 2


def test_report_every_call():
    make = twin(ClassifierNet)
    a, b = make(False), make(True)
    b.copyparams(a)
    for model in (a, b):
        model.observations = []
    for i in range(4):
        x, t = data(7, 8), labels(7, 4)
        for model in (a, b):
            reporter = chainer.Reporter()
            reporter.add_observer('main', model)
            obs = {}
            with reporter.scope(obs):
                numpy.random.seed(i)
                loss, acc = model(x, t)
                model.cleargrads()
                loss.backward()
            model.observations.append(obs)
    for oa, ob in zip(a.observations, b.observations):
        assert sorted(oa) == sorted(ob) == ['main/accuracy', 'main/loss']
        for k in oa:
            assert_close(oa[k].array, ob[k].array, k)
    # Reported values are not overwritten by later calls.
    losses = [float(o['main/loss'].array) for o in b.observations]
    assert len(set(losses)) == 4


def test_inputs_without_requires_grad():
    steps = [lambda m, x=data(8, 12), t=labels(8, 5):
             m(chainer.Variable(x, requires_grad=False), t)
             for _ in range(4)]
    a, b = train_twins(twin(MLP), steps, OPTIMIZERS['momentum'])
    assert numpy.abs(b.l1.W.grad).sum() > 0


def test_input_variable_gradient():
    make = twin(MLP)
    a, b = make(False), make(True)
    b.copyparams(a)
    for i in range(3):
        x, t = data(8, 12), labels(8, 5)
        va, vb = chainer.Variable(x.copy()), chainer.Variable(x.copy())
        a(va, t).backward()
        b(vb, t).backward()
        assert_close(va.grad, vb.grad, 'input gradient')


@pytest.mark.parametrize('opt', sorted(OPTIMIZERS))
def test_gradient_accumulation_without_cleargrads(opt):
    make = twin(MLP)
    numpy.random.seed(0)
    a, b = make(False), make(True)
    b.copyparams(a)
    oa, ob = OPTIMIZERS[opt](), OPTIMIZERS[opt]()
    oa.setup(a)
    ob.setup(b)
    for it in range(3):
        a.cleargrads()
        b.cleargrads()
        for micro in range(3):
            x, t = data(4, 12), labels(4, 5)
            a(x, t).backward()
            b(x, t).backward()
            compare_chains(a, b)
        oa.update()
        ob.update()
        compare_chains(a, b, grads=False)


def test_batch_size_changes():
    sizes = [8, 3, 8, 5, 3, 8]
    steps = [lambda m, x=data(n, 12), t=labels(n, 5): m(x, t) for n in sizes]
    a, b = train_twins(twin(MLP), steps, OPTIMIZERS['sgd'])
    c = cache(b)
    assert c.recordings == 3 and c.replays == 3


def test_parameters_replaced_after_recording(tmp_path):
    make = twin(MLP)
    a, b = make(False), make(True)
    b.copyparams(a)
    x, t = data(8, 12), labels(8, 5)
    b(x, t).backward()
    b(x, t).backward()
    # W.array = ... (a new array object)
    w = numpy.random.RandomState(3).randn(*a.l1.W.shape).astype('f')
    a.l1.W.array = w.copy()
    b.l1.W.array = w.copy()
    # copyparams (in place) and load_npz (in place)
    src = make(False)
    a.l2.copyparams(src.l2)
    b.l2.copyparams(src.l2)
    path = str(tmp_path / 'l3.npz')
    chainer.serializers.save_npz(path, src.l3)
    chainer.serializers.load_npz(path, a.l3)
    chainer.serializers.load_npz(path, b.l3)
    for i in range(3):
        x, t = data(8, 12), labels(8, 5)
        a.cleargrads()
        b.cleargrads()
        la, lb = a(x, t), b(x, t)
        assert_close(la.array, lb.array, 'loss')
        la.backward()
        lb.backward()
        compare_chains(a, b)


def test_eval_interleaved_with_training():
    make = twin(BNNet)
    numpy.random.seed(0)
    a, b = make(False), make(True)
    b.copyparams(a)
    oa, ob = OPTIMIZERS['momentum'](), OPTIMIZERS['momentum']()
    oa.setup(a)
    ob.setup(b)
    for it in range(4):
        x = data(4, 2, 6, 6)
        for m, o in ((a, oa), (b, ob)):
            m.cleargrads()
            F.sum(m(x) ** 2).backward()
            o.update()
        compare_chains(a, b, grads=False)
        xe = data(3, 2, 6, 6)
        with chainer.using_config('train', False), chainer.no_backprop_mode():
            ya, yb = a(xe), b(xe)
        assert_close(ya.array, yb.array, 'eval output')
        assert yb.creator is None
    assert cache(b).recordings == 2


class TwoInTwoOut(chainer.Chain):
    def __init__(self):
        super(TwoInTwoOut, self).__init__()
        with self.init_scope():
            self.a = L.Linear(6, 4)
            self.b = L.Linear(3, 4)

    def forward(self, x, extra):
        u = F.tanh(self.a(x))
        v = F.sigmoid(self.b(extra['z']))
        return {'sum': u + v, 'prod': u * v, 'n': 2}


def test_several_inputs_and_outputs():
    def step(m, x=None, z=None):
        out = m(x, {'z': z})
        assert out['n'] == 2
        return F.sum(out['sum'] * 2) + F.sum(out['prod'])
    steps = [lambda m, x=data(5, 6), z=data(5, 3): step(m, x, z)
             for _ in range(4)]
    train_twins(twin(TwoInTwoOut), steps, OPTIMIZERS['adam'])


def test_only_some_outputs_get_gradients():
    steps = [lambda m, x=data(5, 6), z=data(5, 3): F.sum(m(x, {'z': z})['sum'])
             for _ in range(4)]
    train_twins(twin(TwoInTwoOut), steps, OPTIMIZERS['sgd'])


def test_same_chain_twice_per_iteration():
    steps = [lambda m, x1=data(7, 8), x2=data(7, 8), t1=labels(7, 4),
             t2=labels(7, 4): _pair(m, x1, x2, t1, t2) for _ in range(4)]
    train_twins(twin(ClassifierNet), steps, OPTIMIZERS['momentum'])


def _pair(m, x1, x2, t1, t2):
    l1, _ = m(x1, t1)
    l2, _ = m(x2, t2)
    return l1 + 2 * l2


def test_twice_per_iteration_backward_in_call_order():
    make = twin(DropoutNet)
    a, b = make(False), make(True)
    b.copyparams(a)
    for it in range(4):
        x1, x2 = data(6, 10), data(6, 10)
        grads = []
        for m in (a, b):
            m.cleargrads()
            numpy.random.seed(it)
            y1 = m(x1)
            y2 = m(x2)
            y1.backward()     # first call's backward after the second call
            g1 = m.l1.W.grad.copy()
            y2.backward()
            grads.append((g1, m.l1.W.grad.copy(), y1.array, y2.array))
        for u, v in zip(*grads):
            assert_close(u, v, 'value')


class Residual(chainer.Chain):
    def __init__(self):
        super(Residual, self).__init__()
        with self.init_scope():
            self.c1 = L.Convolution2D(3, 3, 3, pad=1)
            self.bn1 = L.BatchNormalization(3)
            self.c2 = L.Convolution2D(3, 3, 3, pad=1)
            self.bn2 = L.BatchNormalization(3)

    def forward(self, x):
        h = F.relu(self.bn1(self.c1(x)))
        h = self.bn2(self.c2(h))
        h = F.relu(h + x)
        h = F.relu(self.bn2(self.c2(h)) + h)   # a link used twice
        return F.mean(h ** 2)


@pytest.mark.parametrize('opt', sorted(OPTIMIZERS))
def test_residual_additions(opt):
    steps = [lambda m, x=data(2, 3, 5, 5): m(x) for _ in range(4)]
    train_twins(twin(Residual), steps, OPTIMIZERS[opt])


def test_optimizer_hooks():
    def opt():
        o = chainer.optimizers.MomentumSGD(lr=0.1)
        return o

    make = twin(MLP)
    numpy.random.seed(0)
    a, b = make(False), make(True)
    b.copyparams(a)
    oa, ob = opt(), opt()
    for m, o in ((a, oa), (b, ob)):
        o.setup(m)
        o.add_hook(optimizer_hooks.WeightDecay(1e-3))
        o.add_hook(optimizer_hooks.GradientClipping(0.5))
    for i in range(4):
        x, t = data(8, 12), labels(8, 5)
        oa.update(a, x, t)
        ob.update(b, x, t)
        compare_chains(a, b)


def test_replay_applies_one_function_node():
    class Counter(chainer.FunctionHook):
        name = 'counter'

        def __init__(self):
            self.forward = 0
            self.backward = 0

        def forward_preprocess(self, function, in_data):
            self.forward += 1

        def backward_preprocess(self, function, in_data, out_grad):
            self.backward += 1

    make = twin(ClassifierNet)
    a, b = make(False), make(True)
    x, t = data(7, 8), labels(7, 4)
    for m in (a, b):
        for _ in range(2):
            loss, acc = m(x, t)
            m.cleargrads()
            loss.backward()
    counts = {}
    for name, m in (('dbr', a), ('static', b)):
        hook = Counter()
        with hook:
            loss, acc = m(x, t)
            m.cleargrads()
            loss.backward()
        counts[name] = (hook.forward, hook.backward)
    assert counts['static'] == (1, 1)
    assert counts['dbr'][0] > 5


def test_outputs_are_not_overwritten_by_later_calls():
    make = twin(ClassifierNet)
    b = make(True)
    kept = []
    for i in range(4):
        y = b(data(7, 8))
        kept.append((y, y.array.copy()))
        F.sum(y).backward()
    for y, snap in kept:
        numpy.testing.assert_array_equal(y.array, snap)


# -- recurrent nets whose last cell state is not used ----------------------------
class NStepLSTMNet(chainer.Chain):
    """Text classification: the last hidden state classifies, the last
    cell state is dropped, so backprop hands LSTMGrad a None gradient."""
    def __init__(self):
        super(NStepLSTMNet, self).__init__()
        with self.init_scope():
            self.rnn = L.NStepLSTM(1, 4, 5, 0.0)
            self.out = L.Linear(5, 3)

    def forward(self, xs, t):
        hy, cy, ys = self.rnn(None, None, xs)
        return F.softmax_cross_entropy(self.out(hy[0]), t)


class UnrolledLSTMNet(chainer.Chain):
    def __init__(self):
        super(UnrolledLSTMNet, self).__init__()
        with self.init_scope():
            self.x2h = L.Linear(4, 20)
            self.out = L.Linear(5, 3)

    def forward(self, xs, t):
        c = h = None
        for x in xs:
            gates = self.x2h(x)
            if h is not None:
                gates = gates + F.concat([h] * 4)
            c, h = F.lstm(c if c is not None else
                          self.xp.zeros((len(x), 5), 'f'), gates)
        return F.softmax_cross_entropy(self.out(h), t)


@pytest.mark.parametrize('cls', [NStepLSTMNet, UnrolledLSTMNet])
def test_lstm_with_the_last_cell_state_unused(cls):
    """LSTMGrad gets None for the gradient of the unused cell state; it
    gets None again at every replay (it fell back before)."""
    steps = [lambda m, xs=[data(3, 4) for _ in range(3)], t=labels(3, 3):
             m(xs, t) for _ in range(4)]
    a, b = train_twins(twin(cls), steps, OPTIMIZERS['adam'], rtol=0,
                       atol=0)
    c = cache(b)
    assert (c.recordings, c.replays) == (1, 3)


@pytest.mark.parametrize('scaling', ['fixed', 'dynamic'])
def test_loss_scaling(scaling):
    """backward(loss_scale=...) scales every gradient of the replayed call
    as define-by-run does; with dynamic scaling starting high enough that
    gradients overflow, both skip the same updates and lower the scale at
    the same steps."""
    make = twin(MLP)
    numpy.random.seed(0)
    a, b = make(False), make(True)
    b.copyparams(a)
    opts = []
    for m in (a, b):
        o = chainer.optimizers.Adam()
        o.setup(m)
        if scaling == 'dynamic':
            o.loss_scaling(interval=2)
            o._loss_scale = 2.0 ** 130    # overflows: no update, scale cut
        opts.append(o)
    scales = []
    for i in range(6):
        x, t = data(8, 12), labels(8, 5)
        for m, o in zip((a, b), opts):
            m.cleargrads()
            loss = m(x, t)
            with warnings.catch_warnings():   # the overflow, and its note
                warnings.simplefilter('ignore', RuntimeWarning)
                warnings.simplefilter('ignore', UserWarning)
                loss.backward(loss_scale=1024.0 if scaling == 'fixed' else
                              o._loss_scale)
                o.update()
        compare_chains(a, b, rtol=0, atol=0)
        scales.append((opts[0]._loss_scale, opts[1]._loss_scale))
    assert cache(b).replays == 5
    assert all(sa == sb for sa, sb in scales)
    if scaling == 'dynamic':   # the first step overflowed in both
        assert scales[0] == (65504, 65504)
