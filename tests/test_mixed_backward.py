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
