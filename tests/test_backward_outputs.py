"""Backward passes through different outputs of one call: feature
matching (``y, h = D(x)``; a loss of ``y``, then one of ``h``), and
gradients Chainer takes from an output's ``.grad`` (left by
``backward(retain_grad=True)``) that define-by-run never uses
(static_graph/reloads.py)."""
import warnings

import numpy
import pytest

import chainer
import chainer.functions as F
import chainer.links as L

from static_graph import StaticGraphWarning
from static_graph import static_graph
from static_graph.decorator import caches_of


class D(chainer.Chain):
    def __init__(self):
        super(D, self).__init__()
        with self.init_scope():
            self.l1 = L.Linear(6, 10)
            self.l2 = L.Linear(10, 1)

    def forward(self, x):
        h = F.leaky_relu(self.l1(x))
        return self.l2(h), h


class Split(chainer.Chain):
    def __init__(self):
        super(Split, self).__init__()
        with self.init_scope():
            self.l1 = L.Linear(6, 4)

    def forward(self, x):
        return F.split_axis(self.l1(x), 2, 1)


def _twins(cls):
    numpy.random.seed(0)
    a = cls()
    numpy.random.seed(0)
    b = type(cls.__name__, (cls,), {'forward': static_graph(cls.forward)})()
    return a, b


def _train(step, cls=D, steps=4):
    """Each twin runs ``step(model, x)`` (its backward passes) and an
    update; everything compared bit for bit after each step."""
    a, b = _twins(cls)
    opts = []
    for m in (a, b):
        o = chainer.optimizers.SGD(0.1)
        o.setup(m)
        opts.append(o)
    rs = numpy.random.RandomState(1)
    for _ in range(steps):
        x = rs.randn(5, 6).astype('f')
        got = []
        for m, o in zip((a, b), opts):
            xv = chainer.Variable(x.copy())
            m.cleargrads()
            step(m, xv)
            got.append([None if p.grad is None else p.grad.copy()
                        for p in m.params()] + [xv.grad])
            o.update()
        for ga, gb in zip(*got):
            assert (ga is None) == (gb is None)
            if ga is not None:
                numpy.testing.assert_array_equal(ga, gb)
        for pa, pb in zip(a.params(), b.params()):
            numpy.testing.assert_array_equal(pa.array, pb.array)
    return caches_of(b)['forward']


def _feature_matching(m, x):
    y, h = m(x)
    F.sum(y).backward()
    F.sum(h * h).backward()


def _both_then_h(m, x):
    y, h = m(x)
    (F.sum(y) + F.sum(h)).backward()
    F.sum(h * h).backward()


def test_a_second_backward_through_other_outputs():
    # The recording call runs its second backward through its own
    # recorded nodes; the key's later calls run define-by-run, since
    # replay knows only the recorded backward.
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        c = _train(_feature_matching)
    assert [e.state for e in c.entries.values()] == ['fallback']
    assert 'backward passes through different outputs' in \
        list(c.entries.values())[0].reason
    assert any(issubclass(x.category, StaticGraphWarning) for x in w)


def test_a_second_backward_through_fewer_outputs_replays():
    """Both outputs, then ``h`` alone: the second backward is the recorded
    one without ``y``'s gradient, whose ops (``y``'s Linear) define-by-run
    never reaches; replayed so, bit for bit (it fell back before the
    masked backward left out ops all of whose gradients are missing)."""
    c = _train(_both_then_h)
    assert [e.state for e in c.entries.values()] == ['complete']
    assert c.replays == 3


class Dropped(D):
    def forward(self, x):
        h = F.dropout(F.leaky_relu(self.l1(x)), 0.5)
        return self.l2(h), h


def test_other_outputs_after_a_replay_of_the_key_is_an_error():
    """The recording call's second backward, through other outputs, after
    another call of its key replayed: that replay rebound what the
    recorded nodes hold (the dropout's mask), so the recorded nodes
    cannot serve it (28-50 off, silently, before this was checked)."""
    numpy.random.seed(0)
    b = type('S', (Dropped,), {'forward': static_graph(Dropped.forward)})()
    x = numpy.ones((5, 6), 'f')
    y1, h1 = b(x)
    F.sum(y1).backward()
    y2, h2 = b(x * 2)
    F.sum(y2).backward()
    with pytest.raises(RuntimeError, match='recorded without a gradient'):
        F.sum(h1 * h1).backward()


def _retained(m, x):
    y, h = m(x)
    (F.sum(y * y) + F.sum(h)).backward(retain_grad=True)
    m.cleargrads()
    x.cleargrad()
    # Chainer hands the call y's retained gradient too; define-by-run
    # never runs l2 in this backward, so it uses none of it.
    F.sum(h * h).backward()


def test_a_retained_output_gradient_is_not_used_again():
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        _train(_retained)


def test_a_retained_gradient_is_left_on_its_variable():
    for cls in _twins(D):
        y, h = cls(chainer.Variable(numpy.ones((5, 6), 'f')))
        (F.sum(y * y) + F.sum(h)).backward(retain_grad=True)
        kept = y.grad_var
        with warnings.catch_warnings():
            warnings.simplefilter('ignore')
            F.sum(h * h).backward()
        assert y.grad_var is kept


class SplitAndMore(chainer.Chain):
    def __init__(self):
        super(SplitAndMore, self).__init__()
        with self.init_scope():
            self.l1 = L.Linear(6, 4)
            self.l2 = L.Linear(4, 1)

    def forward(self, x):
        h = self.l1(x)
        a, b = F.split_axis(h, 2, 1)
        return a, b, self.l2(h)


@pytest.mark.parametrize('cls, second', [
    (Split, lambda outs: F.sum(outs[0])),
    (SplitAndMore, lambda outs: F.sum(outs[2])),
    (SplitAndMore, lambda outs: F.sum(outs[0] * 2)),
])
def test_a_retained_gradient_of_a_split_output(cls, second):
    """Define-by-run runs split_axis's backward where another of its
    outputs reaches this backward's loss, and takes the retained gradient
    of the one that does not there: the call uses it too; where split_axis
    does not run (a loss of l2(h) alone) it does not (this raised)."""
    grads = []
    for m in _twins(cls):
        x = chainer.Variable(numpy.linspace(-1, 1, 30, dtype='f').reshape(
            5, 6))
        with warnings.catch_warnings():
            warnings.simplefilter('ignore')
            for step in range(3):
                outs = m(x)
                sum(F.sum(o * o) for o in outs).backward(retain_grad=True)
                m.cleargrads()
                x.cleargrad()
                second(outs).backward()
        grads.append([p.grad for p in m.params()] + [x.grad])
    for ga, gb in zip(*grads):
        assert (ga is None) == (gb is None)
        if ga is not None:
            numpy.testing.assert_array_equal(ga, gb)


class _MadeUp(chainer.FunctionNode):
    """Two outputs; its backward makes a missing gradient up (zeros) and
    adds a term of its own to it (a penalty's gradient, ``0.1 * a``)."""

    def forward(self, inputs):
        self.retain_inputs((0,))
        a, b = inputs
        return a * 2, b * 3

    def backward(self, indexes, grad_outputs):
        a, = self.get_retained_inputs()
        ga, gb = grad_outputs
        if ga is None:
            ga = chainer.Variable(numpy.zeros(a.shape, 'f'))
        if gb is None:
            gb = chainer.Variable(numpy.zeros(a.shape, 'f'))
        return ga * 2.0 + 0.1 * a, gb * 3.0


class _TwoOut(chainer.Chain):
    def __init__(self):
        super(_TwoOut, self).__init__()
        with self.init_scope():
            self.l = L.Linear(6, 6)
            self.l2 = L.Linear(6, 6)

    def forward(self, x):
        return _MadeUp().apply((self.l2(x), self.l(x)))


def _both_then_second(m, x):
    y1, y2 = m(x)
    (F.sum(y1) + F.sum(y2)).backward()
    F.sum(y2 * y2).backward()


def test_a_node_that_makes_a_missing_gradient_up_is_not_left_out():
    """The masked backward left out the ops of the first output's path
    where the node, reached through its second output, computes them from
    zeros and a term of its own: l2 got nothing, silently (review20). Ops
    are left out only where their node gets none of its gradients."""
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        c = _train(_both_then_second, cls=_TwoOut)
    assert [e.state for e in c.entries.values()] == ['fallback']
