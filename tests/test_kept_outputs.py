"""A Variable the method keeps on itself while it returns its array or
another Variable of its memory: the kept one is in the graph, as under
define-by-run, and a loss from it backpropagates."""
import numpy
import pytest

import chainer
import chainer.functions as F
import chainer.links as L

from static_graph import static_graph as static


class Net(chainer.Chain):
    def __init__(self, how):
        super(Net, self).__init__()
        self.how = how
        with self.init_scope():
            self.l = L.Linear(3, 4)

    def forward(self, x, t):
        h = F.tanh(self.l(x))
        if self.how == 'loss.array':
            loss = F.softmax_cross_entropy(h, t)
            self.loss = loss
            return loss.array
        self.h = h
        return F.identity(h)


class StaticNet(Net):
    forward = static(Net.forward)


def _loss(m, out):
    if m.how == 'loss.array':
        return m.loss
    return F.sum(out) + 2 * F.sum(m.h)


@pytest.mark.parametrize('how', ['loss.array', 'F.identity'])
def test_a_kept_variable_backpropagates(how):
    dbr, ours = Net(how), StaticNet(how)
    ours.copyparams(dbr)
    opts = [chainer.optimizers.SGD(0.1).setup(m) for m in (dbr, ours)]
    rs = numpy.random.RandomState(0)
    for step in range(4):
        x = rs.randn(5, 3).astype('f')
        t = rs.randint(0, 4, 5).astype('i')
        grads = []
        for m, o in zip((dbr, ours), opts):
            m.cleargrads()
            _loss(m, m(x, t)).backward()
            grads.append(m.l.W.grad)
            o.update()
        assert grads[1] is not None, step
        assert numpy.array_equal(*grads), step
    assert numpy.array_equal(dbr.l.W.array, ours.l.W.array)
