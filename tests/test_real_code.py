"""Patterns of Chainer's own examples that broke replay: an index array
made from a shape (MemNN's temporal encoding), two backward passes through
one call (the DCGAN updater)."""
import warnings

import numpy
import pytest

import chainer
import chainer.functions as F
import chainer.links as L

from static_graph import StaticGraphWarning
from static_graph.decorator import caches_of
from tests.twins import static_twins


class Positions(chainer.Chain):
    """A position embedding looked up with ``xp.arange`` of the sentence
    length, as the MemNN example's temporal encoding does."""

    def __init__(self, how='arange'):
        super(Positions, self).__init__()
        self.how = how
        with self.init_scope():
            self.embed = L.EmbedID(10, 4)
            self.l = L.Linear(4, 3)

    def forward(self, x):
        n = x.shape[1]
        if self.how == 'arange':
            pos = self.xp.arange(n, dtype=numpy.int32)
        elif self.how == 'view':
            pos = self.xp.arange(10, dtype=numpy.int32)[:n]
        else:   # computed from the data: must not replay
            pos = (x[0, :, 0] > 0).astype(numpy.int32)
        e = F.broadcast_to(self.embed(pos), x.shape)
        return F.sum(self.l(F.sum(x * e, axis=1)))


def cache(chain):
    (c,) = caches_of(chain).values()
    return c


@pytest.mark.parametrize('how', ['arange', 'view'])
def test_an_index_made_from_a_shape_replays(how):
    a, b = static_twins(Positions, how)
    rs = numpy.random.RandomState(0)
    for i in range(5):
        x = rs.standard_normal((2, 5 if i < 4 else 7, 4)).astype('f')
        for m in (a, b):
            m.cleargrads()
            m(x).backward()
        for (n, p), (_, q) in zip(sorted(a.namedparams()),
                                  sorted(b.namedparams())):
            numpy.testing.assert_array_equal(p.grad, q.grad, err_msg=n)
    c = cache(b)
    assert c.recordings == 2 and c.replays == 3 and c.fallback_calls == 0


def test_an_index_computed_from_the_data_still_falls_back():
    a, b = static_twins(Positions, 'data')
    x = numpy.ones((2, 5, 4), 'f')
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        for m in (a, b):
            m(x).backward()
    assert any(issubclass(x.category, StaticGraphWarning) for x in w)
