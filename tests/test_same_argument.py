"""One object passed as two arguments (``model(x, x)``, ``model(v, [v])``):
the recording gets one object there too, and such a call is its own key."""
import warnings

import numpy
import pytest

import chainer
import chainer.functions as F
import chainer.links as L

import static_graph
from static_graph import static_graph as static


class Net(chainer.Chain):
    def __init__(self):
        super(Net, self).__init__()
        with self.init_scope():
            self.l = L.Linear(16, 16)

    def body(self, a, b, c):
        h = F.tanh(self.l(a)) * b + a * 3 + F.sin(b) * c[0]
        r = F.sum(F.matmul(h, h, transb=True)) + F.sum(a * b * a)
        if a is b:
            r = r * 2
        return r, F.matmul(a, b, transa=True)

    def forward(self, a, b, c):
        return self.body(a, b, c)


class StaticNet(Net):
    @static
    def forward(self, a, b, c):
        return self.body(a, b, c)


def _args(pattern, x, y):
    vx, vy = chainer.Variable(x.copy()), chainer.Variable(y.copy())
    args = {
        'same Variable': (vx, vx, [vx]),
        'distinct': (vx, vy, [vy]),
        'same array': (x, x, [x]),
        'in a list': (vx, vy, [vx]),
    }[pattern]
    return args, vx, vy


def _same(a, b):
    if a is None or b is None:
        return a is None and b is None
    return numpy.array_equal(a, b)


@pytest.mark.parametrize('order', [
    ('same Variable', 'distinct', 'same array', 'in a list'),
    ('distinct', 'same Variable', 'in a list', 'same array'),
])
def test_one_object_twice_trains_as_define_by_run(order):
    rs = numpy.random.RandomState(0)
    dbr, ours = Net(), StaticNet()
    ours.copyparams(dbr)
    opts = []
    for m in (dbr, ours):
        o = chainer.optimizers.SGD(0.01)
        o.setup(m)
        opts.append(o)
    for step in range(3 * len(order)):
        x = rs.randn(16, 16).astype('f')
        y = rs.randn(16, 16).astype('f')
        got = []
        for m, o in zip((dbr, ours), opts):
            args, vx, vy = _args(order[step % len(order)], x, y)
            m.cleargrads()
            loss, p = m(*args)
            loss.backward()
            o.update()
            got.append((loss.array, p.array, m.l.W.array.copy(),
                        vx.grad, vy.grad))
        for what, a, b in zip(('loss', 'product', 'W', 'x.grad', 'y.grad'),
                              *got):
            assert _same(a, b), (step, order[step % len(order)], what)
    # Each pattern is its own key; all of them replay.
    text = static_graph.explain(ours)
    assert 'array 1 is array 0, array 2 is array 0' in text
    assert 'array 2 is array 1' in text
    assert '4 recordings, 8 replays' in text


def test_the_same_variable_gets_one_gradient_of_every_use():
    """The gradient of a Variable given twice sums its uses as
    define-by-run's graph does (not per argument, then added)."""
    x = numpy.random.RandomState(1).randn(16, 16).astype('f')
    dbr, ours = Net(), StaticNet()
    ours.copyparams(dbr)
    out = []
    for m in (dbr, ours, ours):     # the recording, then a replay
        v = chainer.Variable(x.copy())
        m.cleargrads()
        loss, _ = m(v, v, [v])
        loss.backward()
        out.append(v.grad)
    assert numpy.array_equal(out[0], out[1])
    assert numpy.array_equal(out[0], out[2])


class Product(chainer.Chain):
    def __init__(self):
        super(Product, self).__init__()
        with self.init_scope():
            self.l = L.Linear(48, 48)

    def body(self, a, b):
        return F.sum(self.l(a)), F.matmul(a, b)

    def forward(self, a, b):
        return self.body(a, b)


class StaticProduct(Product):
    @static
    def forward(self, a, b):
        return self.body(a, b)


@pytest.mark.parametrize('how', ['transposed', 'Variables'])
def test_arguments_over_one_memory_record_over_one_memory(how):
    """``x @ x.T`` of one memory is NumPy's symmetric product (syrk), of
    two copies gemm: the recording's copies lie in one memory too."""
    rs = numpy.random.RandomState(2)
    dbr, ours = Product(), StaticProduct()
    ours.copyparams(dbr)
    for _ in range(3):
        x = rs.randn(48, 48).astype('f')
        got = []
        for m in (dbr, ours):
            args = (x, x.T) if how == 'transposed' else (
                chainer.Variable(x), chainer.Variable(x.T))
            got.append(m(*args)[1].array)
        assert numpy.array_equal(*got)


class WriteThenRead(chainer.Chain):
    """Writes into its first argument, then reads the second, which
    overlaps it (falls back: replay would not repeat the write)."""

    def forward(self, x, y):
        x = chainer.as_variable(x)
        x.array[...] *= 0.5
        return F.sum(x * 2) + F.sum(chainer.as_variable(y) * 3)


class StaticWriteThenRead(WriteThenRead):
    forward = static(WriteThenRead.forward)


@pytest.mark.parametrize('second', ['shifted view', 'reversed view',
                                    'same start', 'Variable of it'])
def test_a_write_into_an_argument_shows_in_one_that_overlaps_it(second):
    """The recording's copies of ``x`` and ``x[1:]`` share memory as the
    arguments do: the write into one shows in the other (the recording
    call's loss was 81 for define-by-run's 51), and only the copy written
    into is written back (comparing ``x[1:]`` after ``x`` came back undid
    the write)."""
    views = {'shifted view': lambda x: x[1:],
             'reversed view': lambda x: x[::-1],
             'same start': lambda x: x[:3],
             'Variable of it': lambda x: chainer.Variable(x)}
    got = []
    for m in (WriteThenRead(), StaticWriteThenRead()):
        x = numpy.arange(1., 7.).astype('f')
        with warnings.catch_warnings():
            warnings.simplefilter('ignore')   # (the fallback's, once)
            loss = m(x, views[second](x))
        got.append((loss.array, x))
    (la, xa), (lb, xb) = got
    assert la == lb and numpy.array_equal(xa, xb), got


def test_arguments_far_apart_in_one_memory_get_copies_of_their_own():
    """Rows far apart in one large array (a dataset) are copied apart, not
    into one block spanning the rows between them."""
    from static_graph import arguments
    data = numpy.zeros((10000, 8), 'f')
    near = data[0:4], data[2:6]
    far = data[0:4], data[9000:9004]
    shared = arguments._copies_sharing(near)
    assert set(shared) == {0, 1}
    assert numpy.shares_memory(shared[0], shared[1])
    assert arguments._copies_sharing(far) == {}
