"""Schedules replayed as CUDA graphs (schedules/cuda_graph.py, graphs.py).

Every scenario runs twice: on NumPy through the stand-in for graphs
(tests/fake_cuda_graph.py: a launch writes into the captured results, as a
graph writes its memory), and on CuPy with real CUDA graphs where there is a
GPU (skipped elsewhere). Twins train side by side, define-by-run and
static, and must agree bit for bit.
"""
import types

import numpy
import pytest

import chainer
import chainer.functions as F
import chainer.links as L

from static_graph import graphs
from static_graph.decorator import caches_of
from static_graph.inspect import explain
from tests import fake_cuda_graph
from tests.twins import static_twins


def _gpu_reason():
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return 'no CUDA device'
    except Exception as e:
        return 'no CuPy with a CUDA device (%s)' % type(e).__name__
    return None


class Target(object):
    def __init__(self, name, device, backend):
        self.name = name
        self.device = chainer.get_device(device)
        self.backend = backend

    @property
    def xp(self):
        return self.device.xp

    def send(self, a):
        return self.device.send(a)

    def seed(self, i):
        numpy.random.seed(i)
        if self.xp is not numpy:
            self.xp.random.seed(i)


@pytest.fixture(params=['fake', 'cupy'])
def target(request):
    saved = list(graphs._backend)
    if request.param == 'fake':
        b = fake_cuda_graph.FakeBackend()
        graphs.set_backend(b)
        t = Target('fake', '@numpy', b)
    else:
        reason = _gpu_reason()
        if reason:
            pytest.skip(reason)
        graphs._backend[:] = []     # made afresh: CuPy's
        t = Target('cupy', '@cupy:0', graphs.backend())
        assert t.backend is not None
    yield t
    graphs._backend[:] = saved


def cpu(a):
    return chainer.backend.CpuDevice().send(a)


def same(a, b, what):
    numpy.testing.assert_array_equal(cpu(a), cpu(b), err_msg=what)


def same_chains(a, b, grads=True):
    pa, pb = dict(a.namedparams()), dict(b.namedparams())
    for name in pa:
        same(pa[name].array, pb[name].array, 'param ' + name)
        if grads and pa[name].grad is not None:
            same(pa[name].grad, pb[name].grad, 'grad of ' + name)
    for (n, la), (_, lb) in zip(sorted(a.namedlinks()),
                                sorted(b.namedlinks())):
        for k in getattr(la, '_persistent', ()):
            if hasattr(getattr(la, k), 'shape'):
                same(getattr(la, k), getattr(lb, k), n + '/' + k)


def entry_of(chain):
    (cache,) = caches_of(chain).values()
    (e,) = [e for e in cache.entries.values() if e.state == 'complete']
    return e


def tiers(chain):
    return dict(graphs.tiers(entry_of(chain)))


class HostRead(chainer.function_node.FunctionNode):
    """2x, after reading the input's maximum on the host: a function that
    synchronizes with the device in its forward."""

    def forward(self, inputs):
        x, = inputs
        self.seen = float(x.max())
        return x * x.dtype.type(2),

    def backward(self, indexes, grad_outputs):
        return grad_outputs[0] * 2,


class BNNet(chainer.Chain):
    def __init__(self, drop=0.0, accuracy=False, sync=False):
        super(BNNet, self).__init__()
        self.drop = drop
        self.accuracy = accuracy
        self.sync = sync
        with self.init_scope():
            self.l1 = L.Linear(6, 8)
            self.bn = L.BatchNormalization(8)
            self.l2 = L.Linear(8, 3)

    def forward(self, x, t):
        h = F.relu(self.bn(self.l1(x)))
        if self.drop:
            h = F.dropout(h, self.drop)
        if self.sync:
            h, = HostRead().apply((h,))
        y = self.l2(h)
        loss = F.softmax_cross_entropy(y, t)
        if self.accuracy:
            chainer.report({'accuracy': F.accuracy(y, t, ignore_label=-1)},
                           self)
        return loss


def batch(target, rs, n=5):
    x = rs.standard_normal((n, 6)).astype('f')
    t = rs.randint(0, 3, n).astype('i')
    return target.send(x), target.send(t)


def twins(target, *args, **options):
    a, b = static_twins(BNNet, *args, **options)
    a.to_device(target.device)
    b.to_device(target.device)
    opts = []
    for m in (a, b):
        o = chainer.optimizers.Adam()
        o.setup(m)
        opts.append(o)
    return (a, b), opts


def train(target, models, opts, steps=8, seed=0):
    rs = numpy.random.RandomState(seed)
    losses = []
    for i in range(steps):
        x, t = batch(target, rs)
        step = []
        for m, o in zip(models, opts):
            target.seed(i)
            m.cleargrads()
            loss = m(x, t)
            loss.backward()
            o.update()
            step.append(loss)
        same(step[0].array, step[1].array, 'loss of step %d' % i)
        same_chains(*models, grads=True)
        losses.append(step)
    return losses


def test_training_replays_as_graphs_bit_for_bit(target):
    models, opts = twins(target)
    train(target, models, opts, steps=9)
    t = tiers(models[1])
    for name in ('forward', 'backward'):
        assert t[name].reason is None, t[name].reason
        assert t[name].graph is not None and t[name].captures == 1
        # Recording, 2 interpreted runs, 1 compiled, then the graph.
        assert t[name].launches == 5, name
    # Every gradient of the graph launches after the capture's own was
    # lent (cleargrads let go of the last ones): six parameters, four
    # launches; the loss is copied out.
    assert t['backward'].graph.lent_results == 6 * 4
    assert t['backward'].held == 0
    assert t['forward'].graph.lent_results == 0
    assert 'forward replays as one launch' in explain(models[1])


def test_what_the_caller_keeps_is_not_overwritten(target):
    """The loss, reported values and gradients handed out are the caller's:
    later launches, which rewrite the graph's memory, leave them alone."""
    models, opts = twins(target, 0.0, True)
    rs = numpy.random.RandomState(1)
    kept = []
    for i in range(8):
        x, t = batch(target, rs)
        m = models[1]
        m.cleargrads()
        r = chainer.reporter.Reporter()
        r.add_observer('m', m)
        seen = {}
        with r.scope(seen):
            loss = m(x, t)
        loss.backward()
        grads = dict((n, p.grad) for n, p in m.namedparams())
        kept.append((loss.array, seen['m/accuracy'].array, grads,
                     cpu(loss.array), cpu(seen['m/accuracy'].array),
                     dict((n, cpu(g)) for n, g in grads.items())))
        opts[1].update()
    for loss, acc, grads, loss0, acc0, grads0 in kept:
        same(loss, loss0, 'a loss kept from an earlier step')
        same(acc, acc0, 'a reported value kept from an earlier step')
        for n in grads:
            same(grads[n], grads0[n], 'a gradient kept from an earlier step')
    t = tiers(models[1])
    assert t['forward'].launches > 0
    # The gradients lent by the first launch after the capture were still
    # held (kept above): that call ran launch by launch, the next captured
    # a graph that copies them out.
    g = t['backward']
    assert (g.held, g.captures, g.launches) == (1, 2, 3)
    assert g.graph.lent_results == 0 and g.unlent


def test_a_view_of_a_lent_gradient_keeps_its_values(target):
    """A view of a lent gradient, kept past cleargrads (the gradient
    itself let go), holds the graph's array as its base: the next
    backward sees it held and runs launch by launch."""
    models, opts = twins(target)
    train(target, models, opts, steps=6)     # captured, then lent
    m, o = models[1], opts[1]
    g = tiers(m)['backward']
    assert g.graph is not None and g.graph.lent_results > 0
    rs = numpy.random.RandomState(5)
    x, t = batch(target, rs)
    m.cleargrads()
    m(x, t).backward()
    row = m.l1.W.grad[0]          # a view; the gradient itself let go
    want = cpu(row).copy()
    o.update()
    for _ in range(2):
        x, t = batch(target, rs)
        m.cleargrads()
        m(x, t).backward()
        o.update()
    same(row, want, 'a view of a gradient kept from an earlier step')
    assert g.held == 1


def test_two_calls_before_their_backwards(target):
    """Two calls, then both backwards: the first call's backward reads its
    own saved activations (put aside from the graph's memory by the second
    call), BatchNormalization's statistics included."""
    models, opts = twins(target)
    rs = numpy.random.RandomState(2)
    for i in range(8):
        x1, t1 = batch(target, rs)
        x2, t2 = batch(target, rs)
        first = []
        for m in models:
            m.cleargrads()
            y1 = m(x1, t1)
            y2 = m(x2, t2)
            y1.backward()
            first.append(dict((n, p.grad.copy())
                              for n, p in m.namedparams()))
            y2.backward()
        for n in first[0]:
            same(first[0][n], first[1][n], 'first backward ' + n)
        same_chains(*models)
        for o in opts:
            o.update()
    assert tiers(models[1])['forward'].launches > 0


def test_random_draws_keep_the_stream_replay(target):
    models, opts = twins(target, 0.5)
    train(target, models, opts, steps=7)
    reason = tiers(models[1])['forward'].reason
    assert reason is not None and 'random' in reason, reason
    assert 'forward replays launch by launch' in explain(models[1])
    # The backward has no draws of its own.
    assert tiers(models[1])['backward'].graph is not None


def test_replaced_parameters_capture_again_then_stop(target):
    models, opts = twins(target)
    rs = numpy.random.RandomState(3)
    for i in range(12):
        x, t = batch(target, rs)
        for m, o in zip(models, opts):
            if i >= 6:   # as weight clipping by assignment does
                m.l1.W.array = m.l1.W.array.copy()
            m.cleargrads()
            m(x, t).backward()
            o.update()
        same_chains(*models)
    t = tiers(models[1])['forward']
    assert t.captures == 2 and t.stale == 2
    assert 'replaced' in t.reason


def test_option_off():
    saved = list(graphs._backend)
    graphs.set_backend(fake_cuda_graph.FakeBackend())
    try:
        target = Target('fake', '@numpy', graphs.backend())
        models, opts = twins(target, cuda_graph=False)
        train(target, models, opts, steps=6)
        assert tiers(models[1]) == {}
        assert 'CUDA graph' not in explain(models[1])
    finally:
        graphs._backend[:] = saved


class Refusing(fake_cuda_graph.FakeBackend):
    def __init__(self):
        super(Refusing, self).__init__(refuse='a reason of the backend')


class Perturbing(fake_cuda_graph.FakeBackend):
    """Its launches add one to the first result: as a graph that froze a
    host value would be off."""

    def launch(self, graph):
        graph.launch()
        graph.outputs[0][...] += 1


@pytest.mark.parametrize('backend,words', [
    (Refusing, 'a reason of the backend'),
    (Perturbing, "differs from the schedule run launch by launch")])
def test_a_graph_that_fails_keeps_the_stream_replay(backend, words):
    saved = list(graphs._backend)
    graphs.set_backend(backend())
    try:
        target = Target('fake', '@numpy', graphs.backend())
        models, opts = twins(target)
        train(target, models, opts, steps=7)   # bit for bit throughout
        t = tiers(models[1])
        for name in ('forward', 'backward'):
            assert t[name].graph is None and words in t[name].reason
        assert 'launch by launch: ' in explain(models[1])
    finally:
        graphs._backend[:] = saved


def test_host_synchronization_is_refused_on_the_gpu(target):
    """A function that reads a value on the host in its forward: CUDA
    refuses the capture, and the stream replay stays (on NumPy there is
    nothing to refuse)."""
    if target.name != 'cupy':
        pytest.skip('a CUDA capture')
    models, opts = twins(target, 0.0, False, True)
    train(target, models, opts, steps=6)
    reason = tiers(models[1])['forward'].reason
    assert reason is not None and 'capture failed' in reason, reason
    assert tiers(models[1])['backward'].graph is not None


def test_capture_refuses_what_a_graph_cannot_repeat(target):
    """CuPy capture on its own: GEMMs are captured and replay the same
    bits; a read of a value, a random draw, a copy from host memory and a
    draw from NumPy's generator on the host are refused."""
    if target.name != 'cupy':
        pytest.skip('a CUDA capture')
    import cupy
    from schedules import cuda_graph
    b = target.backend
    rs = numpy.random.RandomState(0)
    w = cupy.asarray(rs.standard_normal((64, 64)).astype('f'))
    x = cupy.asarray(rs.standard_normal((8, 64)).astype('f'))

    def mlp(a):
        h = cupy.maximum(a[0].dot(a[1]), 0)
        return h, h.sum()

    g, outs, _ = b.capture(mlp, (x, w))
    b.launch(g)
    for o, r in zip(outs, mlp((x, w))):
        assert b.same(o, r)
    refused = {
        'D2H': lambda a: (a[0] * float(a[0].sum()),),
        'random numbers from CuPy':
            lambda a: (a[0] * cupy.random.rand(*a[0].shape, dtype='f'),),
        'host memory':
            lambda a: (a[0] + cupy.asarray(numpy.ones(64, 'f')),),
        'on the host': lambda a: (a[0] * numpy.random.rand(),),
    }
    for words, run in refused.items():
        with pytest.raises(cuda_graph.NotCapturable) as e:
            b.capture(run, (x,))
        assert words in str(e.value), (words, str(e.value))


class HingeNet(chainer.Chain):
    def __init__(self):
        super(HingeNet, self).__init__()
        with self.init_scope():
            self.l = L.Linear(6, 3)

    def forward(self, x, t):
        return F.hinge(self.l(x), t)


def test_what_a_schedule_writes_into_its_arguments_reaches_the_caller(target):
    """Chainer's hinge flips signs in the state its backward gets (on the
    CPU): a second backward through the same call sees the flipped state.
    A graph reads a copy of that state; what it writes there is copied
    back, so the two backwards train as define-by-run's."""
    a, b = static_twins(HingeNet)
    for m in (a, b):
        m.to_device(target.device)
    rs = numpy.random.RandomState(4)
    for i in range(8):
        grads = []
        data = [batch(target, rs) for _ in range(2)]
        for m in (a, b):
            m.cleargrads()
            for x, t in data:
                loss = m(x, t)
                loss.backward()
                loss.backward()
            grads.append(m.l.W.grad.copy())
        same(grads[0], grads[1], 'step %d' % i)
    assert tiers(b)['forward'].graph is not None


class ScaledHinge(chainer.Chain):
    def __init__(self):
        super(ScaledHinge, self).__init__()
        with self.init_scope():
            self.s = chainer.Parameter(numpy.ones(3, 'f'))

    def forward(self, x, t):
        return F.hinge(x * self.s, t)


def test_a_write_whose_value_was_no_change_at_capture(target):
    """Hinge's backward flips the sign of its state where the labels are;
    while the schedule is captured those entries are all zero (the margin
    met), a flip that changes no value: the state is still copied back
    after every launch, so later batches, where they are not zero, see
    their flips as define-by-run does."""
    a, b = static_twins(ScaledHinge)
    for m in (a, b):
        m.to_device(target.device)
    rs = numpy.random.RandomState(6)
    for i in range(8):
        t = rs.randint(0, 3, 4).astype('i')
        x = rs.uniform(-0.5, 0.5, (4, 3)).astype('f')
        if i < 4:
            x[numpy.arange(4), t] = 5.0    # margin met: zeros at the labels
        x, t = target.send(x), target.send(t)
        grads = []
        for m in (a, b):
            m.cleargrads()
            loss = m(x, t)
            loss.backward()
            loss.backward()
            grads.append(m.s.grad.copy())
        same(grads[0], grads[1], 'step %d' % i)
    assert tiers(b)['backward'].graph is not None or \
        entry_of(b).plain_backward_run.graph is not None


class _FakeDeviceArray(numpy.ndarray):
    """For the comparison's plumbing on a CPU: what same_many reads of a
    CuPy array."""
    data = property(lambda self: types.SimpleNamespace(device_id=0))

    def get(self):
        return numpy.asarray(self)


class _FakeSameBytes(object):
    """The comparison kernel, as NumPy: ``differs[k] = 1`` where the first
    ``n`` bytes of ``a`` and ``b`` in memory differ."""

    def __init__(self, source, name):
        assert name in source
        self.launches = 0

    def __call__(self, grid, block, args):
        a, b, n, differs, k = args
        self.launches += 1
        if a.tobytes('A')[:n] != b.tobytes('A')[:n]:
            differs[k] = 1


_FAKE_CUPY = types.SimpleNamespace(
    cuda=types.SimpleNamespace(Device=lambda: types.SimpleNamespace(id=0)),
    zeros=lambda n, dtype: numpy.zeros(n, dtype).view(_FakeDeviceArray),
    asnumpy=numpy.asarray, array_equal=numpy.array_equal,
    RawKernel=_FakeSameBytes)


def test_dense_layouts():
    """What the comparison kernel may compare as bytes: arrays without
    gaps, in any order of their axes, strides positive."""
    from schedules.cuda_graph import _dense
    a = numpy.zeros((4, 5, 6), 'f')
    for yes in (a, numpy.asfortranarray(a), a.transpose(2, 0, 1),
                numpy.rollaxis(a, 2, 1), a[:, None], a[1], a[1:3],
                numpy.zeros(()), a[:1, :1]):
        assert _dense(yes), yes.strides
    for no in (a[:, :3], a[:, :1], a[::2], a[::-1], a[..., ::2],
               numpy.broadcast_to(a[:1], a.shape),
               a.transpose(2, 0, 1)[1:, :, :2]):
        assert not _dense(no), no.strides


@pytest.mark.parametrize('big', [False, True])
@pytest.mark.parametrize('where', ['fake', 'cupy'])
def test_comparison_of_many_pairs_is_bit_for_bit(where, big):
    """``CupyBackend.same_many``, on the host (small pairs) and on the
    device (past HOST_COMPARE_BYTES in all: one kernel per pair of one
    contiguous layout), gives what NumPy gives of the same bits. 'fake':
    its plumbing on a CPU, the kernel as NumPy."""
    from schedules import bits, cuda_graph
    if where == 'cupy':
        reason = _gpu_reason()
        if reason:
            pytest.skip(reason)
        import cupy
        b = cuda_graph.CupyBackend()

        def send(a):
            d = cupy.asarray(a)
            return cupy.asfortranarray(d) if a.flags.f_contiguous and \
                not a.flags.c_contiguous else d
    else:
        b = cuda_graph.CupyBackend.__new__(cuda_graph.CupyBackend)
        b.cupy, b._same_bytes = _FAKE_CUPY, None

        def send(a):
            return a.copy(order='K').view(_FakeDeviceArray)
    rs = numpy.random.RandomState(0)
    # (big: x[::2] too is past HOST_COMPARE_BYTES, a view with gaps.)
    n = (cuda_graph.HOST_COMPARE_BYTES // 2 + 1) if big else 1000
    xh = rs.standard_normal(n).astype('f')
    x, last, first = send(xh), send(xh), send(xh)
    last[-1] += 1                      # the end of the kernel's loop
    first[0] += 1
    mh = rs.standard_normal((30, 7)).astype('f')
    m, f, f2 = send(mh), send(numpy.asfortranarray(mh)), \
        send(numpy.asfortranarray(mh))
    f2[29, 6] = -f2[29, 6]
    nan = send(numpy.full(5, numpy.nan, 'f'))
    i = send(numpy.arange(7, dtype='i'))
    ph = rs.standard_normal((4, 5, 6)).astype('f')
    q, q2 = send(ph), send(ph)
    q2[3, 4, 5] = 0
    pt = send(ph).transpose(2, 0, 1)     # dense, not contiguous
    pairs = [
        (x, x.copy()), (x, last), (x, first),
        (send(numpy.zeros(4, 'f')), send(-numpy.zeros(4, 'f'))),
        (nan, nan.copy()), (i, i.copy()), (i, i[::-1].copy()),
        (f, f.copy(order='F')), (f, f2), (m, f),     # other strides
        (x[::2], x[::2].copy()), (x[::2], last[::2]),
        (x[:0], x[:0].copy()), (x[:3], x[:4]), (i, i.astype('l')),
        (send(numpy.full((), 2.5)), send(numpy.full((), 2.5))),
        (pt, q.transpose(2, 0, 1)), (pt, q2.transpose(2, 0, 1)),
    ]

    def host(a, c):
        a, c = numpy.asarray(b.cupy.asnumpy(a)), \
            numpy.asarray(b.cupy.asnumpy(c))
        return a.shape == c.shape and a.dtype == c.dtype and \
            bits.same_bits(a, c, numpy.array_equal)
    want = [host(a, c) for a, c in pairs]
    # (x[::2] holds last's changed element where n - 1 is even.)
    assert want == [True, False, False, False, True, True, False, True,
                    False, True, True, (n - 1) % 2 == 1, True, False, False,
                    True, True, False]
    assert b.same_many(pairs) == want
    if where == 'fake':
        # Past the host's share: the pairs of one dtype, shape and dense
        # layout (all but the views with gaps, the other strides, the
        # empty pair and the two that differ in shape or dtype), one
        # kernel each.
        k = b._same_bytes
        assert (k is not None and k.launches == 12) if big else k is None
    assert [b.same(a, c) for a, c in pairs] == want
