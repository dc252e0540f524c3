"""Calls on probation counted by a glance at their arguments
(static_graph/glance.py): the calls that run define-by-run build no key,
and a key that repeats still records at its sightings-th call and
replays after."""
import warnings

import numpy

import chainer
import chainer.functions as F
import chainer.links as L

from static_graph import StaticGraphWarning
from static_graph import signature
from static_graph import static_graph
from static_graph.decorator import caches_of


class MLP(chainer.Chain):
    def __init__(self):
        super(MLP, self).__init__()
        with self.init_scope():
            self.l1 = L.Linear(5, 8)
            self.l2 = L.Linear(8, 3)

    def forward(self, x, t):
        return F.softmax_cross_entropy(self.l2(F.relu(self.l1(x))), t)


class StaticMLP(MLP):
    forward = static_graph(MLP.forward)


def _batch(rs, n):
    return rs.randn(n, 5).astype('f'), rs.randint(0, 3, n).astype('i')


def _train(models, opts, batch):
    losses = []
    for m, o in zip(models, opts):
        m.cleargrads()
        loss = m(*batch)
        loss.backward()
        o.update()
        losses.append(loss.array)
    return losses


def test_calls_on_probation_build_no_key_and_a_repeating_key_replays(
        monkeypatch):
    numpy.random.seed(0)
    models = [MLP(), StaticMLP()]
    models[1].copyparams(models[0])
    opts = [chainer.optimizers.SGD(0.1) for _ in models]
    for o, m in zip(opts, models):
        o.setup(m)
    rs = numpy.random.RandomState(1)
    built = []
    flatten = signature.flatten
    monkeypatch.setattr(signature, 'flatten',
                        lambda *a, **k: built.append(1) or flatten(*a, **k))
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', StaticGraphWarning)
        # Five new sizes: the fifth goes on probation.
        for n in range(2, 7):
            a, b = _train(models, opts, _batch(rs, n))
            assert numpy.array_equal(a, b)
        c = caches_of(models[1])['forward']
        assert c.probation is not None
        # Twenty more new sizes: define-by-run, no key built.
        del built[:]
        for n in range(10, 30):
            a, b = _train(models, opts, _batch(rs, n))
            assert numpy.array_equal(a, b)
        assert built == []
        # A size that repeats: define-by-run twice, recorded at its third
        # call, replayed after.
        before = c.recordings, c.replays
        for _ in range(6):
            a, b = _train(models, opts, _batch(rs, 40))
            assert numpy.array_equal(a, b)
        assert (c.recordings - before[0], c.replays - before[1]) == (1, 3)
    for (_, p), (_, q) in zip(sorted(models[0].namedparams()),
                              sorted(models[1].namedparams())):
        assert numpy.array_equal(p.array, q.array)
