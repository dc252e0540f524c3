"""FunctionNodes users write: numbers their forward computes from the data
and their backward computes with, and results that are memory the node
keeps between calls. Twins train alike, bit for bit, and replay."""
import numpy
import pytest

import chainer
import chainer.functions as F
import chainer.links as L

import static_graph
from static_graph import static_graph as static


class InverseNorm(chainer.FunctionNode):
    """``gy / self.n``: Chainer builds a MulConstant of a new float."""

    def forward(self, inputs):
        x, = inputs
        self.n = float(numpy.sqrt((x * x).sum()))
        return x / numpy.float32(self.n),

    def backward(self, indexes, grad_outputs):
        return grad_outputs[0] / self.n,


class InTuple(chainer.FunctionNode):
    def forward(self, inputs):
        x, = inputs
        self.st = (float(x.std()), x.shape)
        return x * numpy.float32(self.st[0]),

    def backward(self, indexes, grad_outputs):
        return grad_outputs[0] * self.st[0],


class Count(chainer.FunctionNode):
    def forward(self, inputs):
        x, = inputs
        self.k = int((x > 0).sum())
        return x * self.k,

    def backward(self, indexes, grad_outputs):
        return grad_outputs[0] * self.k,


class Sign(chainer.FunctionNode):
    def forward(self, inputs):
        x, = inputs
        self.pos = bool(x.sum() > 0)
        return (x * 2 if self.pos else x * 3),

    def backward(self, indexes, grad_outputs):
        return (grad_outputs[0] * 2 if self.pos else grad_outputs[0] * 3),


class Ones(chainer.FunctionNode):
    """Hands out an array it keeps between calls (a preallocated buffer)."""
    cache = None

    def forward(self, inputs):
        x, = inputs
        if x.shape not in self.cache:
            self.cache[x.shape] = numpy.ones(x.shape, x.dtype)
        return self.cache[x.shape],

    def backward(self, indexes, grad_outputs):
        return grad_outputs[0] * 0,


class Net(chainer.Chain):
    def __init__(self, node):
        super(Net, self).__init__()
        self.node = node
        with self.init_scope():
            self.l1 = L.Linear(5, 5)
            self.l2 = L.Linear(5, 5)

    def forward(self, x):
        h = self.l1(x)
        y, = self.node().apply((h,))
        return F.sum(F.tanh(self.l2(F.relu(y + h) * 2.0)))


class StaticNet(Net):
    forward = static(Net.forward)


@pytest.mark.parametrize('node', [InverseNorm, InTuple, Count, Sign, Ones],
                         ids=lambda n: n.__name__)
def test_trains_alike_and_replays(node):
    if node is Ones:
        nodes = [type('Ones', (Ones,), {'cache': {}}) for _ in range(2)]
    else:
        nodes = [node, node]
    numpy.random.seed(0)
    dbr, ours = Net(nodes[0]), StaticNet(nodes[1])
    ours.copyparams(dbr)
    opts = [chainer.optimizers.SGD(0.01).setup(m) for m in (dbr, ours)]
    rs = numpy.random.RandomState(1)
    for step in range(6):
        x = rs.randn(4, 5).astype('f') * (1 + step % 3)
        got = []
        for m, o in zip((dbr, ours), opts):
            m.cleargrads()
            loss = m(x)
            loss.backward()
            got.append((loss.array, m.l1.W.grad.copy(), m.l2.W.grad.copy()))
            o.update()
        for a, b in zip(*got):
            assert numpy.array_equal(a, b, equal_nan=True), step
            assert numpy.isfinite(a).all()
    if node is Ones:
        for n in nodes:
            for a in n.cache.values():
                assert (a == 1).all()      # never written into
    assert '0 define-by-run calls' in static_graph.explain(ours)
    assert ' 0 replays' not in static_graph.explain(ours)


_K = 1.0


class _ScaleByGlobal(chainer.FunctionNode):
    def forward(self, inputs):
        return inputs[0] * numpy.float32(_K),

    def backward(self, indexes, grad_outputs):
        return grad_outputs[0] * _K,


class _ScaleByClass(chainer.FunctionNode):
    k = 1.0

    def forward(self, inputs):
        return inputs[0] * numpy.float32(self.k),

    def backward(self, indexes, grad_outputs):
        return grad_outputs[0] * self.k,


@pytest.mark.parametrize('node, held', [
    (_ScaleByGlobal, False), (_ScaleByClass, False), (_ScaleByClass, True)])
def test_a_users_node_reading_a_global_or_class_attribute(node, held):
    """A node of one's own whose forward and backward read a module global
    (or its class attribute) that the training loop changes: replay ran
    its forward again with the new value but its recorded backward with
    the old (W.grad 2, 2, 2, 2 for 2, 4, 6, 8), silently. The method's
    code names the class: its methods' globals and its class attributes
    are watched now, and a change records again; also where a link holds
    the class (``self.node_cls = Scale``, called ``self.node_cls()``)."""
    global _K

    class Net(chainer.Chain):
        def __init__(self):
            super(Net, self).__init__()
            with self.init_scope():
                self.l = L.Linear(3, 2)
            self.node_cls = node

    def named(self, x):
        return F.sum(node().apply((self.l(x),))[0])

    def by_link(self, x):        # (its code does not name the class)
        return F.sum(self.node_cls().apply((self.l(x),))[0])

    Net.forward = by_link if held else named

    S = type('S', (Net,), {'forward': static(Net.forward)})
    numpy.random.seed(0)
    a, b = Net(), S()
    b.copyparams(a)
    x = numpy.ones((2, 3), numpy.float32)
    try:
        for i in range(6):
            _K = _ScaleByClass.k = 1.0 + i // 2
            for m in (a, b):
                m.cleargrads()
                m(x).backward()
            assert numpy.array_equal(a.l.W.grad, b.l.W.grad), i
    finally:
        _K = _ScaleByClass.k = 1.0
    c = list(static_graph.decorator.caches_of(b).values())[0]
    assert c.recordings == 3 and c.replays == 3
