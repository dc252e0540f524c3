"""A hand-written NumPy training step for the 784-1000-1000-10 MLP.

Every buffer is allocated once; each step writes into them (``out=``). This
is the floor the library's replay is measured against: what removing all of
Chainer's per-iteration overhead could give. The benchmark checks that its
loss and updated parameters match Chainer's.
"""
import numpy


class NumpyMLP(object):

    def __init__(self, params, batch, lr):
        self.W1, self.b1, self.W2, self.b2, self.W3, self.b3 = params
        self.lr = numpy.float32(lr)
        f = numpy.float32
        n1, n2, n3 = self.W1.shape[0], self.W2.shape[0], self.W3.shape[0]
        e = numpy.empty
        self.h1 = e((batch, n1), f)
        self.h2 = e((batch, n2), f)
        self.y = e((batch, n3), f)
        self.g3 = e((batch, n3), f)
        self.g2 = e((batch, n2), f)
        self.g1 = e((batch, n1), f)
        self.gW = [e(w.shape, f) for w in (self.W1, self.W2, self.W3)]
        self.gb = [e(b.shape, f) for b in (self.b1, self.b2, self.b3)]
        self.rows = numpy.arange(batch)

    @classmethod
    def from_chain(cls, chain, batch, lr):
        params = [p.array.copy() for p in (
            chain.l1.W, chain.l1.b, chain.l2.W, chain.l2.b, chain.l3.W,
            chain.l3.b)]
        return cls(params, batch, lr)

    def load(self, chain):
        for mine, p in zip(self._params(), (
                chain.l1.W, chain.l1.b, chain.l2.W, chain.l2.b, chain.l3.W,
                chain.l3.b)):
            mine[...] = p.array

    def _params(self):
        return [self.W1, self.b1, self.W2, self.b2, self.W3, self.b3]

    def params_against(self, chain):
        return list(zip(self._params(), (
            chain.l1.W, chain.l1.b, chain.l2.W, chain.l2.b, chain.l3.W,
            chain.l3.b)))

    def step(self, x, t):
        loss = self.forward_backward(x, t)
        self.update()
        return loss

    def forward_backward(self, x, t):
        """The loss; the gradients are left in ``gW`` and ``gb``."""
        n = x.shape[0]
        # forward
        numpy.dot(x, self.W1.T, out=self.h1)
        self.h1 += self.b1
        numpy.maximum(self.h1, 0, out=self.h1)
        numpy.dot(self.h1, self.W2.T, out=self.h2)
        self.h2 += self.b2
        numpy.maximum(self.h2, 0, out=self.h2)
        numpy.dot(self.h2, self.W3.T, out=self.y)
        self.y += self.b3
        # softmax cross-entropy (mean over the batch)
        g = self.g3
        numpy.subtract(self.y, self.y.max(axis=1, keepdims=True), out=g)
        numpy.exp(g, out=g)
        g /= g.sum(axis=1, keepdims=True)
        loss = -numpy.log(g[self.rows[:n], t]).mean()
        g[self.rows[:n], t] -= 1
        g *= numpy.float32(1.0 / n)
        # backward
        numpy.dot(g.T, self.h2, out=self.gW[2])
        g.sum(axis=0, out=self.gb[2])
        numpy.dot(g, self.W3, out=self.g2)
        self.g2 *= self.h2 > 0
        numpy.dot(self.g2.T, self.h1, out=self.gW[1])
        self.g2.sum(axis=0, out=self.gb[1])
        numpy.dot(self.g2, self.W2, out=self.g1)
        self.g1 *= self.h1 > 0
        numpy.dot(self.g1.T, x, out=self.gW[0])
        self.g1.sum(axis=0, out=self.gb[0])
        return float(loss)

    def update(self):
        """SGD, in place (the gradients are scaled where they are)."""
        for p, gp in zip(self._params(), (self.gW[0], self.gb[0], self.gW[1],
                                         self.gb[1], self.gW[2],
                                         self.gb[2])):
            gp *= self.lr
            p -= gp
