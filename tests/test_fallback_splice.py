"""A recording that falls back while its forward runs is the define-by-run
call it stands for: its graph is the caller's (splice.py), so gradients
are summed where define-by-run sums them, even in the step that records."""
import warnings

import numpy
import pytest

import chainer
import chainer.functions as F
import chainer.links as L

from static_graph import StaticGraphWarning, static_graph


def _quiet():
    warnings.simplefilter('ignore', StaticGraphWarning)


class Twice(chainer.Chain):
    """One weight used twice; reads a value (the recording falls back)."""

    def __init__(self):
        super(Twice, self).__init__()
        with self.init_scope():
            self.l = L.Linear(6, 6)
            self.o = L.Linear(6, 1)

    def forward(self, x):
        h = F.tanh(self.l(x))
        h = F.tanh(self.l(h))
        if float(F.sum(h).array) > 1e9:
            h = h * 2
        return self.o(h)


class StaticTwice(Twice):
    forward = static_graph(Twice.forward)


def _twins(cls, static_cls):
    numpy.random.seed(0)
    a = cls()
    numpy.random.seed(0)
    b = static_cls()
    return a, b


def _grads(model):
    return dict((n, p.grad.copy()) for n, p in model.namedparams())


def _assert_same(got, want):
    assert got.keys() == want.keys()
    for k in want:
        assert numpy.array_equal(got[k], want[k]), k


def _assert_twins(got, caught=(), warned=None):
    """``got``: {static?: (gradients, an input's gradient)}, equal; and
    ``warned`` in one of the ``caught`` warnings, where given."""
    _assert_same(got[True][0], got[False][0])
    assert numpy.array_equal(got[True][1], got[False][1])
    if caught:
        assert any(warned in str(c.message) for c in caught)


def test_two_calls_in_one_backward_sum_as_define_by_run():
    _quiet()
    rs = numpy.random.RandomState(0)
    data = [(rs.randn(4, 6).astype('f'), rs.randn(4, 6).astype('f'))
            for _ in range(3)]
    plain, static = _twins(Twice, StaticTwice)
    for a, b in data:
        for m in (plain, static):
            m.cleargrads()
            (F.sum(m(a) ** 2) + F.sum(m(b) ** 2)).backward()
        _assert_same(_grads(static), _grads(plain))


def test_argument_with_a_graph_and_its_gradient():
    """The argument comes from ops outside the call, and the caller uses
    it again: its gradient and the parameters' as define-by-run's."""
    _quiet()
    rs = numpy.random.RandomState(1)
    plain, static = _twins(Twice, StaticTwice)
    x0 = rs.randn(4, 6).astype('f')
    out = {}
    for m in (plain, static):
        m.cleargrads()
        x = chainer.Variable(x0.copy())
        h = F.sin(x) * 3
        loss = F.sum(m(h) * F.sum(h ** 2)) + F.sum(m.l(h))
        loss.backward()
        out[m is static] = (_grads(m), x.grad.copy(), loss.array.copy())
    _assert_twins(out)
    assert numpy.array_equal(out[True][2], out[False][2])   # the loss


class Elman(chainer.Chain):
    """State kept on self across calls; a value read (falls back)."""

    def __init__(self):
        super(Elman, self).__init__()
        with self.init_scope():
            self.x2h = L.Linear(3, 5)
            self.h2h = L.Linear(5, 5, nobias=True)
        self.h = None

    def forward(self, x):
        z = self.x2h(x)
        if self.h is not None:
            z = z + self.h2h(self.h)
        self.h = F.tanh(z)
        if float(self.h.array.max()) > 1e9:
            self.h = self.h * 0
        return self.h


class StaticElman(Elman):
    forward = static_graph(Elman.forward)


@pytest.mark.parametrize('length', [2, 4])
def test_recurrent_state_from_an_earlier_call(length):
    _quiet()
    rs = numpy.random.RandomState(3)
    xs = [rs.randn(2, 3).astype('f') for _ in range(length)]
    plain, static = _twins(Elman, StaticElman)
    for m in (plain, static):
        m.cleargrads()
        m.h = None
        loss = 0
        for x in xs:
            loss = loss + F.sum(m(x) * m.h2h.W[0, 0])
        loss.backward()
    _assert_same(_grads(static), _grads(plain))


OUTSIDE = {}


class ReadsOutside(chainer.Chain):
    """Reads a Variable with a graph that is no argument (a global)."""

    def __init__(self):
        super(ReadsOutside, self).__init__()
        with self.init_scope():
            self.l = L.Linear(3, 3)

    def forward(self, x):
        return self.l(x) * OUTSIDE['v']


class StaticReadsOutside(ReadsOutside):
    forward = static_graph(ReadsOutside.forward)


def test_a_variable_with_a_graph_from_outside_gets_its_gradient():
    """Replay would read its array and drop its graph: the key runs
    define-by-run, the recording call included, and says why."""
    plain, static = _twins(ReadsOutside, StaticReadsOutside)
    x = numpy.ones((2, 3), 'f')
    for step in range(3):
        got = {}
        for m in (plain, static):
            m.cleargrads()
            w = chainer.Variable(numpy.full((2, 3), 0.5 + step, 'f'))
            OUTSIDE['v'] = F.exp(w)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter('always')
                F.sum(m(x)).backward()
            got[m is static] = (_grads(m), w.grad.copy())
        _assert_twins(got, caught if step == 0 else (),
                      'reads a Variable made outside the call (by exp)')


class Plain(chainer.Chain):
    """Replays: no value read."""

    def __init__(self):
        super(Plain, self).__init__()
        with self.init_scope():
            self.l = L.Linear(6, 6)
            self.o = L.Linear(6, 1)

    def forward(self, x):
        return self.o(F.tanh(self.l(F.tanh(self.l(x)))))


class StaticPlain(Plain):
    forward = static_graph(Plain.forward)


@pytest.mark.parametrize('classes', [
    (Twice, StaticTwice),    # fell back in its forward (a value read)
    (Plain, StaticPlain),    # falls back in its backward
])
def test_gradient_penalty_to_the_input(classes):
    """Double backpropagation to the input (WGAN-GP's penalty) through
    the recording call: its recorded nodes are the caller's graph, so the
    gradient, its graph and the parameters' gradients are define-by-run's,
    the recording call included; the key runs define-by-run after."""
    _quiet()
    rs = numpy.random.RandomState(4)
    xs = [rs.randn(4, 6).astype('f') for _ in range(3)]
    plain, static = _twins(*classes)
    got = {}
    for m in (plain, static):
        for step, x0 in enumerate(xs):
            m.cleargrads()
            x = chainer.Variable(x0.copy())
            y = m(x)
            gx, = chainer.grad([F.sum(y)], [x], enable_double_backprop=True)
            (F.sum(y) + F.sum(gx * gx)).backward()
            got[m is static, step] = (_grads(m), gx.array.copy())
    for step in range(len(xs)):
        _assert_same(got[True, step][0], got[False, step][0])
        assert numpy.array_equal(got[True, step][1], got[False, step][1])


class KeepsInput(chainer.Chain):
    def __init__(self):
        super(KeepsInput, self).__init__()
        with self.init_scope():
            self.l = L.Linear(3, 2)

    def forward(self, x):
        self.inp = x
        return self.l(x)


class StaticKeepsInput(KeepsInput):
    forward = static_graph(KeepsInput.forward)


def test_an_argument_kept_on_self_is_the_callers():
    """``self.inp = x`` with a Variable argument, used by the caller's
    loss: define-by-run keeps the caller's Variable; the recording ran on
    a copy, and replay would keep one, so the key runs define-by-run and
    its recording call hands the caller's back."""
    plain, static = _twins(KeepsInput, StaticKeepsInput)
    for step in range(3):
        got = {}
        for m in (plain, static):
            m.cleargrads()
            x = chainer.Variable(numpy.full((2, 3), step + 1.0, 'f'))
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter('always')
                y = m(x)
            assert m.inp is x
            F.sum(y * F.sum(m.inp)).backward()
            got[m is static] = (_grads(m), x.grad.copy())
        _assert_twins(got, caught if step == 0 else (),
                      'keeps an argument Variable on self (inp = x)')


class Lstm(chainer.Chain):
    def __init__(self):
        super(Lstm, self).__init__()
        with self.init_scope():
            self.l = L.LSTM(6, 5)
            self.o = L.Linear(5, 1)

    def forward(self, x):
        return F.tanh(self.o(self.l(x)))   # (tanh keeps its output)


class StaticLstm(Lstm):
    forward = static_graph(Lstm.forward)


def test_gradient_penalty_through_recurrent_calls():
    """Two recording calls chained by L.LSTM's state, a penalty on both
    inputs through the last: each call's nodes move onto the caller's
    graph as its backward comes, define-by-run's gradients."""
    _quiet()
    rs = numpy.random.RandomState(5)
    data = [rs.randn(4, 6).astype('f') for _ in range(2)]
    got = {}
    for cls in (Lstm, StaticLstm):
        numpy.random.seed(0)
        m = cls()
        m.cleargrads()
        xs = [chainer.Variable(a.copy()) for a in data]
        ys = [m(x) for x in xs]
        gs = chainer.grad([F.sum(ys[-1] ** 2)], xs,
                          enable_double_backprop=True)
        (F.sum(ys[0]) + sum(F.sum(g * g) for g in gs)).backward()
        got[cls] = ([g.array.copy() for g in gs], _grads(m))
    for a, b in zip(got[StaticLstm][0], got[Lstm][0]):
        assert numpy.array_equal(a, b)
    _assert_same(got[StaticLstm][1], got[Lstm][1])


def test_penalty_call_after_other_calls_of_its_key():
    """D on real data, then on x_hat with a penalty, one key: the penalty
    call falls back; the other call's build later must not bring the key
    back to replay (whose backward cannot double backpropagate)."""
    _quiet()
    plain, static = _twins(Plain, StaticPlain)
    rs = numpy.random.RandomState(6)
    for step in range(3):
        real = rs.randn(4, 6).astype('f')
        hat = rs.randn(4, 6).astype('f')
        gs = []
        for m in (plain, static):
            m.cleargrads()
            d_real = m(chainer.Variable(real.copy()))
            x_hat = chainer.Variable(hat.copy())
            g, = chainer.grad([F.sum(m(x_hat))], [x_hat],
                              enable_double_backprop=True)
            (F.sum(d_real) + F.sum(g * g)).backward()
            gs.append(g.array.copy())
        assert numpy.array_equal(gs[0], gs[1])


class Agent(object):
    """A learned temperature kept on a helper object, as SAC keeps
    ``log_alpha``: a leaf Variable, no Parameter of any link."""

    def __init__(self):
        self.log_alpha = chainer.Variable(numpy.zeros((1,), 'f'))


AGENT = Agent()


class Policy(chainer.Chain):
    def __init__(self):
        super(Policy, self).__init__()
        with self.init_scope():
            self.l = L.Linear(3, 2)

    def forward(self, x):
        return self.l(x) * F.broadcast_to(F.exp(AGENT.log_alpha), (2, 2))


class StaticPolicy(Policy):
    forward = static_graph(Policy.forward)


def test_a_learned_leaf_variable_outside_the_chain_gets_its_gradient():
    plain, static = _twins(Policy, StaticPolicy)
    for step in range(3):
        got = {}
        for m in (plain, static):
            m.cleargrads()
            AGENT.log_alpha = chainer.Variable(
                numpy.full((1,), 0.1 * step, 'f'))
            x = chainer.Variable(numpy.full((2, 3), step + 1.0, 'f'))
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter('always')
                F.sum(m(x) ** 2).backward()
            got[m is static] = (_grads(m), AGENT.log_alpha.grad.copy())
        _assert_twins(got, caught if step == 0 else (),
                      'reads a Variable that needs a gradient, no function '
                      'made')
