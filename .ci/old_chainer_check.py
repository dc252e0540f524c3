"""Run under an old Chainer: the decorator must be a pass-through that warns
once, and a decorated chain must train exactly like an undecorated one."""
import os
import sys
import warnings

import numpy

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import chainer  # NOQA
import chainer.functions as F  # NOQA
import chainer.links as L  # NOQA

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    import static_graph

    class Net(chainer.Chain):
        def __init__(self):
            super(Net, self).__init__()
            with self.init_scope():
                self.l1 = L.Linear(6, 8)
                self.l2 = L.Linear(8, 3)

        def body(self, x, t):
            h = F.dropout(F.relu(self.l1(x)), 0.2)
            return F.softmax_cross_entropy(self.l2(h), t)

    class Static(Net):
        @static_graph.static_graph
        def __call__(self, x, t):
            return self.body(x, t)

    class Plain(Net):
        def __call__(self, x, t):
            return self.body(x, t)

    class Static2(Net):   # a second decorated method: no second warning
        @static_graph.static_graph(cache_size=2)
        def __call__(self, x, t):
            return self.body(x, t)

ours = [w for w in caught if issubclass(w.category, static_graph.StaticGraphWarning)]
assert len(ours) == 1, [str(w.message) for w in caught]
assert 'pass-through' in str(ours[0].message), ours[0].message

a, b = Plain(), Static()
b.copyparams(a)
oa, ob = chainer.optimizers.MomentumSGD(), chainer.optimizers.MomentumSGD()
oa.setup(a)
ob.setup(b)
with warnings.catch_warnings(record=True) as caught_update:
    warnings.simplefilter('always')
    assert static_graph.capture_update(ob) is ob   # a pass-through too
assert type(ob) is chainer.optimizers.MomentumSGD
assert 'pass-through' in str(caught_update[-1].message)
rs = numpy.random.RandomState(0)
for i in range(5):
    x = rs.randn(4, 6).astype('f')
    t = rs.randint(0, 3, 4).astype('i')
    losses = []
    for m, o in ((a, oa), (b, ob)):
        numpy.random.seed(i)
        m.cleargrads()
        loss = m(x, t)
        loss.backward()
        o.update()
        losses.append(float(loss.data))
    assert losses[0] == losses[1], losses
for (n, p), (_, q) in zip(sorted(a.namedparams()), sorted(b.namedparams())):
    assert numpy.array_equal(p.data, q.data), n
print('chainer %s: pass-through with one warning, training identical: %s'
      % (chainer.__version__, str(ours[0].message)))
