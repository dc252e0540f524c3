"""A backward that meets calls of several kinds: a loss summed over calls of
new keys, where the bound on keys that do not repeat would run one
define-by-run."""
import warnings

import numpy

import chainer
import chainer.functions as F
import chainer.links as L

from static_graph import StaticGraphWarning
from static_graph import static_graph as static
from static_graph.decorator import caches_of


class MLP(chainer.Chain):
    def __init__(self):
        super(MLP, self).__init__()
        with self.init_scope():
            self.l1 = L.Linear(6, 8)
            self.l2 = L.Linear(8, 3)

    def forward(self, x, t):
        return F.softmax_cross_entropy(self.l2(F.relu(self.l1(x))), t)


class StaticMLP(MLP):
    forward = static(MLP.forward)


def _batches(sizes, seed=1):
    rs = numpy.random.RandomState(seed)
    return [(rs.randn(n, 6).astype('f'), rs.randint(0, 3, n).astype('i'))
            for n in sizes]


def _grads_equal(a, b):
    return [n for (n, p), (_, q) in zip(sorted(a.namedparams()),
                                        sorted(b.namedparams()))
            if not numpy.array_equal(p.grad, q.grad)]


def test_a_loss_over_calls_of_new_keys_records_them_all():
    """Five new batch sizes summed into one loss: the fifth call would run
    define-by-run (4 new keys without replays), its contributions at its
    own nodes' ranks among four one-node calls: 1e-7 off. It records.
    (Not with a weight used twice in the method: fallbacks.md, gradient
    sums.)"""
    numpy.random.seed(0)
    a, b = MLP(), StaticMLP()
    b.copyparams(a)
    batches = _batches([2, 3, 4, 5, 6])
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', StaticGraphWarning)
        for m in (a, b):
            m.cleargrads()
            loss = 0
            for x, t in batches:
                loss = loss + m(x, t)
            loss.backward()
    assert _grads_equal(a, b) == []
    assert caches_of(b)['forward'].recordings == 5


def _four_new_keys(a, b):
    """Four iterations of new batch sizes, each with its backward, for
    both twins: ``b``'s next new key goes on probation."""
    for x, t in _batches([7, 8, 9, 10], seed=2):
        for m in (a, b):
            m.cleargrads()
            m(x, t).backward()


def test_evaluation_with_backprop_over_new_keys_runs_define_by_run():
    """Evaluation with backprop enabled (``train=False``, as Chainer's
    custom-loop examples evaluate) over batch sizes that never repeat,
    each call's loss kept until the next call returns: the earlier call
    still waited for its backward, so every call recorded (60 recordings,
    0.2x define-by-run). A call made on probation is let go when the next
    one is to run define-by-run: that one does, the losses the same, and a
    backward through the last call's loss still gives define-by-run's
    gradients."""
    numpy.random.seed(0)
    a, b = MLP(), StaticMLP()
    b.copyparams(a)
    batches = _batches(range(3, 63), seed=3)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', StaticGraphWarning)
        with chainer.using_config('train', False):
            losses = {}
            for m in (a, b):
                out = []
                loss = None
                for x, t in batches:
                    loss = m(x, t)
                    out.append(float(loss.array))
                losses[m] = out
                m.cleargrads()
                loss.backward()
    assert losses[a] == losses[b]
    assert _grads_equal(a, b) == []
    c = caches_of(b)['forward']
    assert c.recordings <= 6, c.recordings
    assert c.fallback_calls >= 54


def test_a_call_let_go_gives_define_by_run_gradients():
    """A call recorded on probation while another recording waited, let
    go by the next call (which runs define-by-run): its recorded nodes are
    the caller's graph. A loss over both calls gives define-by-run's
    gradients, the argument's included."""
    numpy.random.seed(0)
    a, b = MLP(), StaticMLP()
    b.copyparams(a)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', StaticGraphWarning)
        _four_new_keys(a, b)
        (xk, tk), (x1, t1), (x2, t2) = _batches([11, 12, 13], seed=4)
        grads = {}
        for m in (a, b):
            for _ in range(2):
                m(xk, tk)          # (a key on probation: define-by-run)
            kept = m(xk, tk)       # its third call records, and waits
            v1 = chainer.Variable(x1.copy())
            y1 = m(v1, t1)         # recorded on probation: it waits
            del kept               # (that recording is let go)
            y2 = m(x2, t2)         # define-by-run: y1's call let go
            m.cleargrads()
            (y1 * 2 + y2).backward()
            grads[m] = v1.grad
    c = caches_of(b)['forward']
    assert c.probation is not None
    assert c.recordings == 6, c.recordings
    assert numpy.array_equal(grads[a], grads[b])
    assert _grads_equal(a, b) == []


class TwoDepths(chainer.Chain):
    """Two outputs made at different depths."""

    def __init__(self):
        super(TwoDepths, self).__init__()
        with self.init_scope():
            self.l1 = L.Linear(6, 8)
            self.l2 = L.Linear(8, 6)

    def forward(self, x):
        h = self.l1(x)
        return F.relu(h), self.l2(F.tanh(h))


class StaticTwoDepths(TwoDepths):
    forward = static(TwoDepths.forward)


def test_outputs_used_before_the_call_would_be_let_go_keep_their_ranks():
    """Evaluation with backprop on over new batch sizes, a loss summed over
    the calls from the caller's nodes on both outputs, built right after
    each call (review40). The recording node gives both outputs the
    deeper one's rank: letting its call go later would leave the caller's
    nodes on the shallower output above define-by-run's ranks (gradients
    3.8e-6 off). Such a call is not let go; each records, as before."""
    numpy.random.seed(0)
    a, b = TwoDepths(), StaticTwoDepths()
    b.copyparams(a)
    rs = numpy.random.RandomState(1)
    xs = [rs.randn(n, 6).astype('f') for n in range(3, 10)]
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', StaticGraphWarning)
        with chainer.using_config('train', False):
            for m in (a, b):
                total = 0
                for i, x in enumerate(xs):
                    h, y = m(x)
                    if i >= 4:
                        total = total + F.sum(h * h) + F.sum(y)
                m.cleargrads()
                total.backward()
    assert _grads_equal(a, b) == []
