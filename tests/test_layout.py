"""Copies the library makes keep the memory layout of what they copy: a
NumPy reduction sums in an order that follows its input's strides, so a
C-ordered copy of a strided array would give other bits downstream."""
import numpy

import chainer
import chainer.functions as F
import chainer.links as L

import static_graph
from static_graph.recorder import copy_exact
from tests.twins import compare_chains

rs = numpy.random.RandomState(13)


def test_copy_exact_keeps_strides():
    a = numpy.arange(24.).reshape(2, 3, 4)
    for v in (a[:, ::2, 1:], a.transpose(2, 0, 1)[::-1],
              numpy.broadcast_to(a[:, :1], (2, 3, 4)), a[..., ::-1],
              a.T, a[0, 0, 0:1]):
        c = copy_exact(v)
        assert c.strides == v.strides and c.dtype == v.dtype
        assert numpy.array_equal(c, v) and not numpy.shares_memory(c, v)


class ConvBN(chainer.Chain):
    def __init__(self):
        super(ConvBN, self).__init__()
        with self.init_scope():
            self.bn0 = L.BatchNormalization(3)
            self.c = L.Convolution2D(3, 6, 3, pad=1, nobias=True)
            self.bn = L.BatchNormalization(6)

    def forward(self, x):
        return F.relu(self.bn(self.c(self.bn0(x))))


def test_copies_handed_out_keep_the_memory_layout():
    """Arrays the recording call hands out (and replay's copies) keep
    define-by-run's layout (a convolution's NHWC memory seen as NCHW), and
    the recording runs on its arguments in their layout: a reduction
    downstream (or inside) sums in the same order, so even the recording
    iteration matches bit for bit (C-ordered copies were 3e-5 off)."""
    static = type('StaticConvBN', (ConvBN,),
                  {'forward': static_graph.static_graph(ConvBN.forward)})
    models = ConvBN(), static()
    models[1].copyparams(models[0])
    for i in range(3):
        # The caller's batch is an NHWC array seen as NCHW.
        x = rs.standard_normal((4, 6, 6, 3)).astype('f').transpose(0, 3, 1, 2)
        ys = []
        for m in models:
            m.cleargrads()
            y = m(x)
            loss = F.sum(F.average(y, axis=(2, 3)) ** 2) + F.sum(y * y)
            loss.backward()
            ys.append(y.array)
        assert ys[0].strides == ys[1].strides
        compare_chains(*models, rtol=0, atol=0)


def test_gradient_and_input_views_keep_their_strides_in_the_recording():
    """The recording call works on copies of its arguments and of the
    gradient it is handed; those copies keep the originals' strides (a
    broadcast's zero strides too, as F.average's backward hands over), so
    the recorded backward's reductions sum as define-by-run's do."""
    static = type('StaticConvBN', (ConvBN,),
                  {'forward': static_graph.static_graph(ConvBN.forward)})
    models = ConvBN(), static()
    models[1].copyparams(models[0])
    for i in range(3):
        row = rs.standard_normal((4, 3, 1, 6)).astype('f')
        x = numpy.broadcast_to(row, (4, 3, 6, 6))   # zero strides
        for m in models:
            m.cleargrads()
            F.sum(F.average(m(x), axis=(2, 3)) ** 2).backward()
        compare_chains(*models, rtol=0, atol=0)
