"""The same replay path on CuPy arrays (skipped where there is no GPU)."""
import warnings

import numpy
import pytest

import chainer
import chainer.functions as F
import chainer.links as L

from static_graph import static_graph
from static_graph.decorator import caches_of
from tests import gpu_available


_reason = gpu_available.reason()
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


class Body(chainer.Chain):
    """``body(self, x)`` -> loss, ``x`` a raw CuPy input array."""

    def __init__(self, body):
        super(Body, self).__init__()
        self.body = body
        with self.init_scope():
            self.l1 = L.Linear(3, 3)
            self.l2 = L.Linear(3, 2)

    def forward(self, x):
        return self.body(self, x)


def _twins(body):
    a = Body(body)
    b = type('StaticBody', (Body,),
             {'forward': static_graph(Body.forward)})(body)
    b.copyparams(a)
    a.to_device('@cupy:0')
    b.to_device('@cupy:0')
    for m in (a, b):
        m.scale = m.xp.asarray(numpy.float32(2))
    return a, b


def _train_twins(a, b, calls=5):
    """Inputs whose sign flips between calls (so a frozen branch shows);
    every gradient compared with define-by-run's. Returns b's cache."""
    import cupy
    rs = numpy.random.RandomState(0)
    for i in range(calls):
        x = cupy.asarray(rs.rand(4, 3).astype('f') - 0.5 + 0.3 * (-1) ** i)
        for m in (a, b):
            m.cleargrads()
            m(x).backward()
        for (n, p), (_, q) in zip(sorted(a.namedparams()),
                                  sorted(b.namedparams())):
            assert (p.grad is None) == (q.grad is None), n
            if p.grad is not None:
                numpy.testing.assert_allclose(
                    cupy.asnumpy(p.grad), cupy.asnumpy(q.grad), rtol=1e-6,
                    err_msg='%s at call %d' % (n, i))
    return caches_of(b)['forward']


def _on_hidden(f):
    """A body that applies ``f(m, h)`` to a hidden Variable."""
    return lambda m, x: F.sum(m.l2(f(m, F.tanh(m.l1(x)))))


def _write_into(h):
    h.array[:, 0] = 0
    return h


def _scale_in_place(h):
    a = h.array
    a *= 2
    return h


# User code reading or writing CuPy array values in the forward pass: each
# must fall back (with a warning naming the read) and stay correct, since
# replay would freeze the branch or skip the write. CuPy arrays are not
# traced like NumPy's; static_graph/device_reads.py patches cupy.ndarray.
READS = {
    'float()': lambda m, h: h if float(F.sum(h).array) > 0 else -h,
    'bool()': lambda m, h: h if bool((h.array > 0).all()) else h * 3,
    '.item()': lambda m, h: h * (2 if h.array.sum().item() > 0 else 3),
    'cupy.asnumpy': lambda m, h: h * (
        2 if m.xp.asnumpy(h.array).sum() > 0 else 3),
    'to_cpu': lambda m, h: h * (
        2 if chainer.backends.cuda.to_cpu(h.array).sum() > 0 else 3),
    '.tolist()': lambda m, h: h * (2 if h.array.tolist()[0][0] > 0 else 3),
    'int()': lambda m, h: h[:int(abs(h.array[0, 0]) * 10) % 2 + 1],
}
def _scale_held(m, h):
    m.scale *= 0.5   # a CuPy array the chain held before the call
    return h * m.scale


WRITES = {
    '[...] =': lambda m, h: _write_into(h),
    '*=': lambda m, h: _scale_in_place(h),
    'held *=': _scale_held,
}


@pytest.mark.parametrize('what', sorted(READS) + sorted(WRITES))
def test_value_reads_and_writes_fall_back_on_gpu(what):
    from static_graph import StaticGraphWarning
    a, b = _twins(_on_hidden(READS.get(what) or WRITES[what]))
    with pytest.warns(StaticGraphWarning) as caught:
        cache = _train_twins(a, b, calls=6)
    assert cache.replays == 0 and cache.fallback_calls == 5
    word = 'writes into' if what in WRITES else 'reads array'
    assert any(word in str(w.message) and 'test_cupy.py' in str(w.message)
               for w in caught), [str(w.message) for w in caught]


def test_reads_outside_the_recording_are_not_flagged():
    """A value read before the call (the loss printed by the training
    loop) or by Chainer's own code keeps the replay."""
    import cupy
    a, b = _twins(_on_hidden(lambda m, h: h))
    rs = numpy.random.RandomState(0)
    for _ in range(3):
        x = cupy.asarray(rs.rand(2, 3).astype('f'))
        loss = b(x)
        loss.backward()
        float(loss.array)
        cupy.asnumpy(x).tolist()
    cache = caches_of(b)['forward']
    assert cache.recordings == 1 and cache.replays == 2
    # the patches are gone once the recording ends
    assert not [n for n, v in vars(cupy.ndarray).items() if getattr(
        v, '__module__', None) == 'static_graph.device_reads']


# Arrays user code computes with CuPy from the input during the call, then
# hands to Chainer functions (as inputs or as a node's attribute): replay
# would freeze them, also the uniform ones.
COMPUTED = {
    'scaled input': lambda m, x: F.sum(m.l1(x / 2 + 1)),
    'reduction': lambda m, x: F.sum(m.l1(x)) / x.sum(),
    'Variable of a max': lambda m, x: F.sum(m.l1(x)) * chainer.Variable(
        x.max()),
    'full of a mean': lambda m, x: F.sum(
        m.l1(x) * m.xp.full(x.shape, x.mean(), x.dtype)),
    'F.where condition': lambda m, x: F.sum(F.where(x > 0, m.l1(x),
                                                   m.l1(x) * 2)),
    'boolean mask': lambda m, x: F.sum(m.l1(x)[x[:, 0] > 0]),
    'array of device values': lambda m, x: F.sum(m.l1(x) * m.xp.array(
        [x.max(), x.min(), x.mean()], dtype=x.dtype)),
}
# Constants and views: these replay.
CONSTANT = {
    'zeros': lambda m, x: F.sum(m.l1(x) + m.xp.zeros(x.shape, x.dtype)),
    'full of a number': lambda m, x: F.sum(
        m.l1(x) * m.xp.full((1, 3), 0.5, x.dtype)),
    'ones_like': lambda m, x: F.sum(m.l1(x) * m.xp.ones_like(x)),
    'view of the input': lambda m, x: F.sum(m.l1(x[::-1])),
    'asarray of host data': lambda m, x: F.sum(
        m.l1(x) * m.xp.asarray(numpy.full(3, 0.5, x.dtype))),
    # From a shape alone (MemNN's temporal encoding): a constant of the key.
    'arange of a shape': lambda m, x: F.sum(
        m.l1(x) * m.xp.arange(3, dtype=x.dtype)),
    'eye': lambda m, x: F.sum(
        F.matmul(m.l1(x), m.xp.eye(3, dtype=x.dtype))),
}


@pytest.mark.parametrize('what', sorted(COMPUTED))
def test_arrays_computed_with_cupy_fall_back(what):
    from static_graph import StaticGraphWarning
    a, b = _twins(COMPUTED[what])
    with pytest.warns(StaticGraphWarning, match='computed with CuPy'):
        cache = _train_twins(a, b)
    assert cache.replays == 0 and cache.fallback_calls == 4


@pytest.mark.parametrize('what', sorted(CONSTANT))
def test_cupy_constants_and_views_replay(what):
    a, b = _twins(CONSTANT[what])
    cache = _train_twins(a, b)
    assert cache.recordings == 1 and cache.replays == 4


@pytest.mark.parametrize('as_variable', [False, True])
def test_write_into_an_argument_reaches_the_caller_on_gpu(as_variable):
    """The recording runs on copies of the arguments; a write into one
    (which makes the call fall back) reaches the caller's array, as under
    define-by-run, and the input's gradient is define-by-run's (the copy
    was left unwritten back: the caller's array kept its old values and the
    gradient, read from it, came out 2x)."""
    import cupy
    from static_graph import StaticGraphWarning

    def body(m, x):
        h = chainer.as_variable(x)
        h.array[...] *= 0.5
        return F.sum(m.l1(h) * m.l1(h))

    a, b = _twins(body)
    rs = numpy.random.RandomState(0)
    with pytest.warns(StaticGraphWarning, match='writes into'):
        for i in range(3):
            x = cupy.asarray(rs.rand(4, 3).astype('f') - 0.5)
            got = []
            for m in (a, b):
                xi = x.copy()
                arg = chainer.Variable(xi) if as_variable else xi
                m.cleargrads()
                m(arg).backward()
                got.append((xi, arg.grad if as_variable else None))
            (xa, ga), (xb, gb) = got
            assert (xa == xb).all(), i
            if as_variable:
                assert (ga == gb).all(), i
            _same_grads(a, b, i)


def _same_grads(a, b, i):
    """Every parameter gradient of ``a`` and ``b`` bit for bit (None where
    the body leaves a link out)."""
    for (n, p), (_, q) in zip(sorted(a.namedparams()),
                              sorted(b.namedparams())):
        assert (p.grad is None) == (q.grad is None), (n, i)
        if p.grad is not None:
            assert (p.grad == q.grad).all(), (n, i)


FUNCTION_WRITES = {
    # CuPy's functions write into an argument unseen by the operator
    # patches (device_reads): the write-back's comparison sees them.
    'cupy.copyto': lambda xp, a: xp.copyto(a, a * 0.5),
    'ufunc out=': lambda xp, a: xp.multiply(a, 0.5, out=a),
    '.fill': lambda xp, a: a.fill(0.25),
}


@pytest.mark.parametrize('what', sorted(FUNCTION_WRITES))
def test_a_cupy_function_writing_into_an_argument_falls_back(what):
    import cupy
    from static_graph import StaticGraphWarning

    def body(m, x):
        FUNCTION_WRITES[what](m.xp, x)
        return F.sum(m.l1(x) * m.l1(x))

    a, b = _twins(body)
    rs = numpy.random.RandomState(0)
    with pytest.warns(StaticGraphWarning, match='in place'):
        for i in range(4):
            x = cupy.asarray(rs.rand(4, 3).astype('f') - 0.5)
            xs = []
            for m in (a, b):
                xi = x.copy()
                m.cleargrads()
                m(xi).backward()
                xs.append(xi)
            assert (xs[0] == xs[1]).all(), i
            _same_grads(a, b, i)
    assert caches_of(b)['forward'].replays == 0


def test_cupy_arguments_over_one_memory_see_a_write_on_gpu():
    """Two arguments over one CuPy array: the recording's copies share a
    memory as they do, so a write into one shows in the other."""
    import cupy

    def run(m, x):
        return m(x, x[1:])

    class W(chainer.Chain):
        def forward(self, x, y):
            x = chainer.as_variable(x)
            x.array[...] *= 0.5
            return F.sum(x * 2) + F.sum(chainer.as_variable(y) * 3)

    S = type('SW', (W,), {'forward': static_graph(W.forward)})
    got = []
    for m in (W(), S()):
        x = cupy.arange(1., 7., dtype='f')
        with warnings.catch_warnings():
            warnings.simplefilter('ignore')
            loss = run(m, x)
        got.append((float(loss.array), cupy.asnumpy(x)))
    assert got[0][0] == got[1][0]
    assert numpy.array_equal(got[0][1], got[1][1])

