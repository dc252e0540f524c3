"""Copies the library makes keep the memory layout of what they copy: a
NumPy reduction sums in an order that follows its input's strides, so a
C-ordered copy of a strided array would give other bits downstream."""
import numpy

import chainer
import chainer.functions as F
import chainer.links as L

import static_graph
from static_graph.arrayutil import copy_exact
from tests.twins import compare_chains, static_twins

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
    models = static_twins(ConvBN)
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
    models = static_twins(ConvBN)
    for i in range(3):
        row = rs.standard_normal((4, 3, 1, 6)).astype('f')
        x = numpy.broadcast_to(row, (4, 3, 6, 6))   # zero strides
        for m in models:
            m.cleargrads()
            F.sum(F.average(m(x), axis=(2, 3)) ** 2).backward()
        compare_chains(*models, rtol=0, atol=0)


class Flat(chainer.Chain):
    def __init__(self):
        super(Flat, self).__init__()
        with self.init_scope():
            self.l = L.Linear(48, 3)

    def forward(self, x):
        return self.l(F.relu(F.reshape(x, (x.shape[0], -1))))


def test_argument_layout_is_part_of_the_key():
    """Recorded with NHWC memory, ``F.reshape`` copies and the ReLU may
    write into that copy; called with a C-ordered batch (a view of the
    training set), the reshape is a view of the caller's array: the same
    schedule wrote the ReLU into the training set. A layout is a key."""
    data = rs.standard_normal((40, 3, 4, 4)).astype('f')
    nhwc = numpy.ascontiguousarray(data[:8].transpose(0, 2, 3, 1))
    models = static_twins(Flat)
    kept = data.copy()
    for i in range(5):
        x = nhwc.transpose(0, 3, 1, 2) if i == 0 else data[8 * i:8 * i + 8]
        for m in models:
            m.cleargrads()
            F.sum(m(x) ** 2).backward()
        compare_chains(*models, rtol=0, atol=0)
    assert numpy.array_equal(data, kept)
    keys = [s.key for s in static_graph.cached(models[1])]
    assert len(keys) == 2 and any('strides=' in k for k in keys), keys


def test_static_input_layouts_follow_the_call():
    """An input a node holds (F.where's condition) is copied into a buffer
    of the recording's layout at each replay: a broadcast mask there (one
    memory cell per row) garbled later full masks."""
    class Net(chainer.Chain):
        def __init__(self):
            super(Net, self).__init__()
            with self.init_scope():
                self.p = chainer.Parameter(numpy.zeros((1, 1, 1), 'f'))

        def forward(self, x, mask):
            y = F.where(mask, x, F.broadcast_to(self.p, x.shape))
            return F.sum(F.sum(y, axis=2) ** 2)

    models = static_twins(Net)
    for i in range(4):
        x = rs.standard_normal((6, 5, 40)).astype('f')
        mask = rs.standard_normal((6, 5, 40)) > 0
        if i == 0:
            mask = numpy.broadcast_to(mask[0], mask.shape)
        losses = []
        for m in models:
            m.cleargrads()
            losses.append(m(chainer.Variable(x), mask))
            losses[-1].backward()
        assert float(losses[0].array) == float(losses[1].array), i
        compare_chains(*models, rtol=0, atol=0)


class Shaped(chainer.Chain):
    def __init__(self):
        super(Shaped, self).__init__()
        with self.init_scope():
            self.l = L.Linear(12, 24)
            self.w = chainer.Parameter(
                rs.standard_normal((4, 6, 4)).astype('f'))

    def forward(self, x):
        return F.reshape(F.relu(self.l(x)), (4, 6, 4))


def test_gradient_in_another_layout_than_at_recording():
    """Recorded with a broadcast gradient (the caller's loss sums over an
    axis), the backward's reshape copies it and the ReLU's gradient may be
    written into that copy; when the loss changes and the gradient comes
    C-ordered, the reshape is a view of the caller's gradient array, which
    Chainer also handed to ``w``: such a backward runs the ops' own kernels
    (w's gradient was off by 4.6)."""
    models = static_twins(Shaped)
    for i in range(6):
        x = rs.standard_normal((4, 12)).astype('f')
        for m in models:
            m.cleargrads()
            y = m(x)
            loss = F.sum(F.sum(y, axis=1) ** 2) if i == 0 else \
                F.sum((y + m.w) ** 2)
            loss.backward()
        compare_chains(*models, rtol=0, atol=0)
    cache = static_graph.decorator.caches_of(models[1])['forward']
    assert cache.replays == 5


def test_gradient_passed_through_keeps_its_layout():
    """A method whose input gradient is the gradient it was handed
    (``F.identity``): the copy replay returns keeps the broadcast's strides
    (a C-ordered copy made the caller's bias gradient 6e-5 off)."""
    class Through(chainer.Chain):
        def __init__(self):
            super(Through, self).__init__()
            with self.init_scope():
                self.l = L.Linear(29, 37)

        def forward(self, h):
            return F.identity(h)

    models = static_twins(Through)
    for i in range(5):
        x = rs.standard_normal((16, 29)).astype('f')
        for m in models:
            m.cleargrads()
            F.sum(F.sum(m(m.l(x)), axis=0) ** 2).backward()
        compare_chains(*models, rtol=0, atol=0)
