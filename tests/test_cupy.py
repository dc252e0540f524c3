"""The same replay path on CuPy arrays (skipped where there is no GPU)."""
import numpy
import pytest

import chainer
import chainer.functions as F
import chainer.links as L

from static_graph import static_graph
from static_graph.decorator import caches_of


def _gpu_reason():
    try:
        import cupy
    except Exception as e:   # not installed, or no CUDA libraries
        return 'cupy is not available (%s: %s)' % (type(e).__name__, e)
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return 'no CUDA device'
    except Exception as e:
        return 'no CUDA device (%s)' % e
    return None


_reason = _gpu_reason()
pytestmark = pytest.mark.skipif(_reason is not None, reason=str(_reason))


class Net(chainer.Chain):
    def __init__(self):
        super(Net, self).__init__()
        with self.init_scope():
            self.c = L.Convolution2D(1, 4, 3, pad=1)
            self.bn = L.BatchNormalization(4)
            self.l1 = L.Linear(4 * 4 * 4, 16)
            self.l2 = L.Linear(16, 3)

    def forward(self, x, t):
        h = F.max_pooling_2d(F.relu(self.bn(self.c(x))), 2)
        h = F.dropout(F.relu(self.l1(h)), 0.3)
        return F.softmax_cross_entropy(self.l2(h), t)


class StaticNet(Net):
    forward = static_graph(Net.forward)


def test_twins_train_identically_on_gpu():
    import cupy
    a, b = Net(), StaticNet()
    b.copyparams(a)
    a.to_gpu()
    b.to_gpu()
    oa, ob = chainer.optimizers.MomentumSGD(), chainer.optimizers.MomentumSGD()
    oa.setup(a)
    ob.setup(b)
    rs = numpy.random.RandomState(0)
    for i in range(5):
        x = cupy.asarray(rs.rand(6, 1, 8, 8).astype('f'))
        t = cupy.asarray(rs.randint(0, 3, 6).astype('i'))
        losses = []
        for m, o in ((a, oa), (b, ob)):
            cupy.random.seed(i)
            m.cleargrads()
            loss = m(x, t)
            loss.backward()
            o.update()
            losses.append(float(loss.array))
        numpy.testing.assert_allclose(losses[0], losses[1], rtol=1e-5)
        for (n, p), (_, q) in zip(sorted(a.namedparams()),
                                  sorted(b.namedparams())):
            numpy.testing.assert_allclose(cupy.asnumpy(p.array),
                                          cupy.asnumpy(q.array),
                                          rtol=1e-4, atol=1e-6, err_msg=n)
    cache = caches_of(b)['forward']
    assert cache.recordings == 1 and cache.replays == 4


def test_to_gpu_records_again():
    import cupy
    b = StaticNet()
    rs = numpy.random.RandomState(1)
    x = rs.rand(6, 1, 8, 8).astype('f')
    t = rs.randint(0, 3, 6).astype('i')
    b(x, t).backward()
    b.to_gpu()
    b(cupy.asarray(x), cupy.asarray(t)).backward()
    assert caches_of(b)['forward'].recordings == 2
