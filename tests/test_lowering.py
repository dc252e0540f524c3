"""Cheaper CPU kernels (static_graph/lowering.py): used where they give the
recorded outputs bit for bit, and replay stays identical to define-by-run."""
import numpy
import pytest

import chainer
import chainer.functions as F

from static_graph import static_graph
from static_graph.decorator import caches_of
from tests.twins import twin_optimizers


class Net(chainer.Chain):
    def __init__(self, dtype):
        super(Net, self).__init__()
        with self.init_scope():
            self.p = chainer.Parameter(numpy.full((3, 4), 0.5, dtype))

    def forward(self, x, y):
        h = F.tanh(x * self.p) * 0.9 + y     # Mul, Tanh, MulConstant, Add
        h = h + 0.25                          # AddConstant
        return F.sum(F.tanh(h) * h)


Static = type('Static', (Net,), {'forward': static_graph(Net.forward)})


def kernels(chain):
    (cache,) = caches_of(chain).values()
    (entry,) = cache.entries.values()
    return [(op.kind, getattr(op.fn, '__name__', None))
            for s in (entry.forward, entry.backward) for op in s.ops]


@pytest.mark.parametrize('dtype', [numpy.float16, numpy.float32,
                                   numpy.float64])
def test_fast_kernels_replay_bit_for_bit(dtype):
    rs = numpy.random.RandomState(0)
    a, b = Net(dtype), Static(dtype)
    for i in range(4):
        x = rs.standard_normal((3, 4)).astype(dtype)
        y = rs.standard_normal((3, 4)).astype(dtype)
        for m in (a, b):
            m.cleargrads()
            m(x, y).backward()
        numpy.testing.assert_array_equal(a.p.grad, b.p.grad)
    used = dict(kernels(b))
    for kind in ('Tanh', 'TanhGrad', 'Mul', 'MulConstant', 'AddConstant'):
        assert used[kind] == 'numpy_' + kind, used
    # The first Add's input dies there: it writes into it.
    assert used['Add'] == 'numpy_inplace_Add', used


def test_zero_dim_results_keep_the_node_kernel():
    """A 0-d result of NumPy arithmetic is a NumPy scalar, not an array:
    such ops keep the node's own kernel, and replay gives arrays."""
    class Sc(chainer.Chain):
        def __init__(self):
            super(Sc, self).__init__()
            with self.init_scope():
                self.p = chainer.Parameter(numpy.ones(4, numpy.float32))

        @static_graph
        def forward(self, x):
            s = F.sum(x * self.p)
            return s + s * 2.0 + F.sum(x + self.p)

    m = Sc()
    rs = numpy.random.RandomState(1)
    for i in range(3):
        m.cleargrads()
        x = rs.standard_normal((2, 4)).astype(numpy.float32)
        loss = m(x)
        assert type(loss.array) is numpy.ndarray
        loss.backward()
        with chainer.using_config('use_static_graph', False):
            ref = Sc()
            ref.p.array[...] = m.p.array
            want = ref(x)
        assert loss.array == want.array
    # s * 2.0 (and its backward) are 0-d: the node's own kernel.
    zero_dim = [name for kind, name in kernels(m) if kind == 'MulConstant']
    assert zero_dim and all(not n.startswith('numpy_') for n in zero_dim)


class ConvNet(chainer.Chain):
    """1x1 (strided and not), 3x3 (padded), non-square and strided kernels,
    an RGB-like first layer (few channels), a bias-free and a depthwise
    convolution."""

    def __init__(self, c_in):
        super(ConvNet, self).__init__()
        import chainer.links as L
        with self.init_scope():
            self.c1 = L.Convolution2D(c_in, 16, 5, stride=2, pad=2)
            self.c2 = L.Convolution2D(16, 16, 3, pad=1, nobias=True)
            self.c3 = L.Convolution2D(16, 12, 1, stride=2)
            self.c4 = L.Convolution2D(12, 8, (2, 3), stride=(1, 2), pad=(0, 1))
            self.c5 = L.Convolution2D(8, 8, 1)
            self.dw = L.Convolution2D(8, 8, 3, pad=1, groups=8)
            self.fc = L.Linear(None, 5)

    def forward(self, x, t):
        h = F.relu(self.c1(x))
        h = F.relu(self.c2(h)) + h
        h = F.relu(self.c4(F.relu(self.c3(h))))
        h = F.relu(self.c5(h)) * h
        h = self.dw(h)
        return F.softmax_cross_entropy(self.fc(h), t)


StaticConvNet = type('StaticConvNet', (ConvNet,),
                     {'forward': static_graph(ConvNet.forward)})


@pytest.mark.parametrize('c_in', [3, 9])
def test_numpy_convolution_kernels_replay_bit_for_bit(c_in):
    """Convolutions, their weight gradients and their input gradients
    (deconvolutions) run schedules.numpy_conv, and training stays bit for
    bit equal to define-by-run."""
    rs = numpy.random.RandomState(2)
    a = ConvNet(c_in)
    b = StaticConvNet(c_in)
    x0 = rs.standard_normal((4, c_in, 15, 14)).astype('f')
    with chainer.using_config('use_static_graph', False):
        b(x0, numpy.zeros(4, 'i'))    # initialize fc
        a(x0, numpy.zeros(4, 'i'))
    b.copyparams(a)
    opts = []
    for m in (a, b):
        o = chainer.optimizers.MomentumSGD(0.05)
        o.setup(m)
        opts.append(o)
    for i in range(4):
        x = rs.standard_normal((4, c_in, 15, 14)).astype('f')
        t = rs.randint(0, 5, 4).astype('i')
        losses = []
        for m, o in zip((a, b), opts):
            m.cleargrads()
            loss = m(x, t)
            loss.backward()
            o.update()
            losses.append(loss.array)
        assert losses[0] == losses[1]
        for (n1, p1), (n2, p2) in zip(sorted(a.namedparams()),
                                      sorted(b.namedparams())):
            numpy.testing.assert_array_equal(p1.grad, p2.grad, err_msg=n1)
            numpy.testing.assert_array_equal(p1.array, p2.array, err_msg=n1)
    used = kernels(b)
    names = [n for k, n in used if k in ('Convolution2DFunction',
                                         'Convolution2DGradW',
                                         'Deconvolution2DFunction')]
    # 6 convolutions, 6 weight gradients, 5 input gradients; the grouped
    # deconvolution (the depthwise input gradient) keeps Chainer's kernel.
    assert len(names) == 6 + 6 + 5
    assert sum(n.startswith('numpy_') for n in names) == 16, used


def test_convolution_kernel_rejected_where_bits_differ():
    """A single-channel, single-image, single-filter convolution: NumPy's
    tensordot keeps a view there and BLAS gives other bits, so the check
    made while recording keeps Chainer's own kernel."""
    import chainer.links as L

    class One(chainer.Chain):
        def __init__(self):
            super(One, self).__init__()
            with self.init_scope():
                self.c = L.Convolution2D(1, 1, 3, initialW=numpy.random.
                                         RandomState(0).rand(1, 1, 3, 3))

        @static_graph
        def forward(self, x):
            return F.sum(self.c(x) ** 2)

    m = One()
    x = numpy.random.RandomState(1).rand(1, 1, 5, 5).astype('f')
    for _ in range(3):
        m.cleargrads()
        m(x).backward()
    from static_graph import lowering
    from schedules import numpy_conv
    got = numpy_conv.conv2d(x, m.c.W.array, m.c.b.array, 1, 1, 0, 0)
    want = F.convolution_2d(x, m.c.W.array, m.c.b.array).array
    if got.tobytes() == want.tobytes():
        pytest.skip('this BLAS gives the same bits here')
    names = dict(kernels(m))
    assert not names['Convolution2DFunction'].startswith('numpy_')
    assert lowering.FAST['Convolution2DFunction']   # it was a candidate


@pytest.mark.parametrize('n,c,h,w,oc,k,s,p', [
    (2, 5, 7, 6, 3, 3, 2, 1), (3, 16, 8, 8, 4, 1, 1, 0),
    (2, 9, 9, 5, 8, (2, 3), (3, 1), (2, 0)), (2, 3, 11, 11, 6, 5, 2, 2),
    (1, 12, 4, 4, 7, 1, 2, 0),
    # Padding wider than the taps reach: border taps read only zeros.
    (2, 9, 5, 6, 4, 1, 2, 1), (2, 10, 4, 4, 3, 3, 3, 3),
    (2, 8, 1, 3, 2, 1, 5, 2)])
def test_numpy_conv_matches_chainer_bytes(n, c, h, w, oc, k, s, p):
    """The kernels against Chainer's own CPU functions, byte for byte and
    stride for stride, with -0.0, inf and NaN among the values."""
    from schedules import numpy_conv
    k = k if isinstance(k, tuple) else (k, k)
    s = s if isinstance(s, tuple) else (s, s)
    p = p if isinstance(p, tuple) else (p, p)
    rs = numpy.random.RandomState(3)
    x = rs.standard_normal((n, c, h, w)).astype('f')
    W = rs.standard_normal((oc, c) + k).astype('f')
    b = rs.standard_normal(oc).astype('f')
    x.flat[::7] = -0.0
    want = F.convolution_2d(x, W, b, stride=s, pad=p).array
    got = numpy_conv.conv2d(x, W, b, s[0], s[1], p[0], p[1])
    assert got.strides == want.strides and got.tobytes() == want.tobytes()
    gy = rs.standard_normal(want.shape).astype('f')
    gy.flat[::5] = -0.0
    gy.flat[3] = numpy.inf
    gy.flat[4] = numpy.nan
    want_gx = F.deconvolution_2d(gy, W, stride=s, pad=p,
                                 outsize=(h, w)).array
    got_gx = numpy_conv.deconv2d(gy, W, s[0], s[1], p[0], p[1], h, w)
    assert got_gx.strides == want_gx.strides
    assert got_gx.tobytes() == want_gx.tobytes()
    gy[~numpy.isfinite(gy)] = 1
    from chainer.functions.connection import convolution_2d as c2d
    node = c2d.Convolution2DFunction(stride=s, pad=p)
    node.apply((x, W))
    want_gw, = c2d.Convolution2DGradW(node, W.shape, W.dtype, None).apply(
        (x, gy))
    got_gw = numpy_conv.conv2d_grad_w(x, gy, k[0], k[1], s[0], s[1], p[0],
                                      p[1], W.dtype)
    assert got_gw.strides == want_gw.array.strides
    assert got_gw.tobytes() == want_gw.array.tobytes()


@pytest.mark.parametrize('n,c,h,oc,k,s,p,g', [
    (4, 8, 9, 8, 3, 1, 1, 8), (3, 12, 8, 6, 3, 2, 0, 3),
    (2, 8, 7, 8, 1, 1, 0, 2), (2, 8, 3, 4, 3, 2, 2, 2),
    (2, 8, 2, 8, 1, 2, 2, 8)])
def test_numpy_grouped_conv_matches_chainer_bytes(n, c, h, oc, k, s, p, g):
    """Grouped (depthwise too) convolution and its weight gradient."""
    from schedules import numpy_conv
    from chainer.functions.connection import convolution_2d as c2d
    rs = numpy.random.RandomState(4)
    x = rs.standard_normal((n, c, h, h + 1)).astype('f')
    W = rs.standard_normal((oc, c // g, k, k)).astype('f')
    b = rs.standard_normal(oc).astype('f')
    want = F.convolution_2d(x, W, b, stride=s, pad=p, groups=g).array
    got = numpy_conv.conv2d_grouped(x, W, b, g, s, s, p, p)
    assert got.strides == want.strides and got.tobytes() == want.tobytes()
    gy = rs.standard_normal(want.shape).astype('f')
    node = c2d.Convolution2DFunction(stride=s, pad=p, groups=g)
    node.apply((x, W))
    want_gw, = c2d.Convolution2DGradW(node, W.shape, W.dtype, None).apply(
        (x, gy))
    got_gw = numpy_conv.conv2d_grouped_grad_w(x, gy, g, k, k, s, s, p, p,
                                              W.dtype)
    assert got_gw.strides == want_gw.array.strides
    assert got_gw.tobytes() == want_gw.array.tobytes()


class BigConv(chainer.Chain):
    def __init__(self):
        super(BigConv, self).__init__()
        import chainer.links as L
        with self.init_scope():
            self.c = L.Convolution2D(8, 8, 3, pad=1)

    def forward(self, x):
        return F.sum(F.relu(self.c(x)) ** 2)


StaticBigConv = type('StaticBigConv', (BigConv,),
                     {'forward': static_graph(BigConv.forward)})


def _train_big(monkeypatch=None):
    a, b = BigConv(), StaticBigConv()
    b.copyparams(a)
    rs = numpy.random.RandomState(5)
    names = []
    for i in range(4):
        x = rs.standard_normal((2, 8, 32, 32)).astype('f')
        for m in (a, b):
            m.cleargrads()
            m(x).backward()
        numpy.testing.assert_array_equal(a.c.W.grad, b.c.W.grad)
        names.append(dict(kernels(b))['Convolution2DFunction'])
    return names


def test_large_ops_are_checked_on_the_first_replay():
    """A convolution too large to check while recording (the recording
    iteration does not pay for it) is checked on the first replay's own
    arrays, and runs the NumPy kernel from then on."""
    names = _train_big()
    assert names[0] == 'probe_numpy_Convolution2DFunction'
    assert names[1:] == ['numpy_Convolution2DFunction'] * 3, names


def test_first_replay_check_rejects_other_bits(monkeypatch):
    """A kernel that is off by one unit in the last place is caught by the
    first replay's check: the node's own kernel runs, numbers stay
    define-by-run's."""
    from static_graph import lowering
    real = lowering.FAST['Convolution2DFunction']

    def off_by_one_ulp(rop, node, xs):
        k = real(rop, node, xs)
        if k is None:
            return None

        def kernel(a):
            y, = k(a)
            y.flat[0] = numpy.nextafter(y.flat[0], y.dtype.type(numpy.inf))
            return y,
        kernel.__name__ = 'off_by_one'
        return kernel

    monkeypatch.setitem(lowering.FAST, 'Convolution2DFunction',
                        off_by_one_ulp)
    names = _train_big()      # asserts define-by-run's gradients
    assert names[0] == 'probe_off_by_one'
    assert 'off_by_one' not in names[1:], names


def test_col_layout_prediction_matches_numpy_reshape():
    """schedules.numpy_conv predicts from shapes alone whether NumPy's
    reshape of the transposed im2col array is a C-contiguous matrix (then
    the NumPy kernels make Chainer's very BLAS call); checked against
    NumPy itself, batch of one and 1x1 outputs included."""
    import itertools
    from schedules import numpy_conv
    cases = 0
    for n, c, kh, kw, oh, ow in itertools.product(
            [1, 2], [1, 2, 4], [1, 3], [1, 2], [1, 3], [1, 2]):
        shape = (n, c, kh, kw, oh, ow)
        col = numpy.zeros(shape, 'f')
        layouts = [((0, 4, 5, 1, 2, 3), (n * oh * ow, c * kh * kw))]
        for g in sorted(set([1, c])):
            layouts.append(((1, 2, 3, 0, 4, 5),
                            (g, c // g * kh * kw, n * oh * ow)))
        for perm, new in layouts:
            got = col.transpose(perm).reshape(new)
            want = got.strides == numpy.zeros(new, 'f').strides
            assert numpy_conv.same_as_reshaped(shape, perm, new) == want, (
                shape, perm, new)
            cases += 1
    assert cases > 200


@pytest.mark.parametrize('n,c,hw,k,g', [(2, 2, 3, 3, 2), (2, 3, 2, 2, 3),
                                        (1, 4, 8, 3, 1)])
def test_convolutions_whose_col_reshape_is_a_view_keep_chainers_kernel(
        n, c, hw, k, g):
    """Shapes found by the fuzzer (a 1x1 output of a grouped convolution,
    a batch of one): Chainer's im2col matrix is a non-contiguous view, BLAS
    sums in another order than on the kernels' matrix, and a value check
    only catches that for some values. The kernels are not offered; the
    gradients stay bit for bit define-by-run's over micro-batches."""
    import chainer.links as L

    class G(chainer.Chain):
        def __init__(self):
            super(G, self).__init__()
            with self.init_scope():
                self.c = L.Convolution2D(c, c, k, groups=g)

        def forward(self, x):
            return F.sum(F.relu(self.c(x)) ** 2)

    S = type('S', (G,), {'forward': static_graph(G.forward)})
    a, b = G(), S()
    b.copyparams(a)
    rs = numpy.random.RandomState(7)
    for i in range(5):
        for m in (a, b):
            m.cleargrads()
        for micro in range(3):
            x = rs.standard_normal((n, c, hw, hw)).astype('f')
            for m in (a, b):
                m(x).backward()
        numpy.testing.assert_array_equal(a.c.W.grad, b.c.W.grad)
    names = dict(kernels(b))
    assert not names['Convolution2DFunction'].startswith('numpy_'), names
    assert not names['Convolution2DGradW'].startswith('numpy_'), names


def test_col_taps_fill_padding_with_zeros():
    """The im2col taps are written straight from the unpadded image: every
    element of the destination, padding included, is set (checked on a
    NaN-filled destination against numpy.pad), also where a tap lies
    wholly in the padding."""
    from schedules import numpy_conv
    rs = numpy.random.RandomState(5)
    for h, w, k, s, p in [(1, 3, 1, 5, 2), (4, 4, 3, 3, 3), (5, 6, 1, 2, 1),
                          (7, 6, 3, 2, 1), (2, 2, 3, 1, 2), (6, 5, 2, 3, 0)]:
        x = rs.standard_normal((2, 3, h, w)).astype('f')
        img = numpy.pad(x, ((0, 0), (0, 0), (p, p), (p, p)))
        oh, ow = (numpy_conv.out_size(h, k, s, p),
                  numpy_conv.out_size(w, k, s, p))
        for j in range(k):
            for i in range(k):
                dst = numpy.full((2, 3, oh, ow), numpy.nan, 'f')
                numpy_conv._fill_tap(dst, x, j, i, s, s, p, p)
                want = img[:, :, j:j + s * oh:s, i:i + s * ow:s]
                assert dst.tobytes() == want.tobytes(), (h, w, k, s, p, j, i)


class BNNet(chainer.Chain):
    def __init__(self):
        super(BNNet, self).__init__()
        import chainer.links as L
        with self.init_scope():
            self.c = L.Convolution2D(3, 8, 3, pad=1)
            self.bn = L.BatchNormalization(8)
            self.fc = L.Linear(None, 4)

    def forward(self, x, t):
        h = F.relu(self.bn(self.c(x)))
        return F.softmax_cross_entropy(self.fc(h), t)


StaticBNNet = type('StaticBNNet', (BNNet,),
                   {'forward': static_graph(BNNet.forward)})


def _train_bn(steps=4):
    """Train define-by-run and static twins with SGD, then evaluate both;
    everything must agree bit for bit: loss, gradients, parameters and
    BatchNormalization's running statistics. The static twin's kernel
    names, per call."""
    a, b = BNNet(), StaticBNNet()
    rs = numpy.random.RandomState(6)
    x0 = rs.standard_normal((4, 3, 6, 6)).astype('f')
    with chainer.using_config('use_static_graph', False):
        a(x0, numpy.zeros(4, 'i'))
        b(x0, numpy.zeros(4, 'i'))
    b.copyparams(a)
    opts = twin_optimizers((a, b), lambda: chainer.optimizers.SGD(lr=0.1))
    names = []
    for i in range(steps):
        x = rs.standard_normal((4, 3, 6, 6)).astype('f')
        t = rs.randint(0, 4, 4).astype('i')
        losses = []
        for m, o in zip((a, b), opts):
            m.cleargrads()
            loss = m(x, t)
            loss.backward()
            o.update()
            losses.append(loss.array)
        assert losses[0].tobytes() == losses[1].tobytes()
        for (n, p), (_, q) in zip(sorted(a.namedparams()),
                                  sorted(b.namedparams())):
            assert p.array.tobytes() == q.array.tobytes(), n
        for k in ('avg_mean', 'avg_var'):
            assert getattr(a.bn, k).tobytes() == getattr(b.bn, k).tobytes()
        names.append(dict(kernels(b))['BatchNormalization'])
    with chainer.using_config('train', False), chainer.no_backprop_mode():
        for i in range(3):
            x = rs.standard_normal((4, 3, 6, 6)).astype('f')
            t = rs.randint(0, 4, 4).astype('i')
            assert a(x, t).array.tobytes() == b(x, t).array.tobytes()
    return names, b


def test_batch_normalization_kernels_replay_bit_for_bit():
    """BatchNormalization's forward (train: statistics, running averages;
    eval: in place, its input dying there) runs one NumPy buffer instead of
    Chainer's three temporaries, and training and evaluation stay define-
    by-run's bit for bit."""
    names, b = _train_bn()
    assert names[0] == 'probe_numpy_BatchNormalization'
    assert names[1:] == ['numpy_BatchNormalization'] * 3, names
    # Its backward too, on a convolution's output (NHWC memory): gx gets
    # the layout Chainer's expression gives (it came back in x's before,
    # and the first-replay check kept Chainer's kernel).
    (cache,) = caches_of(b).values()
    train = [e for e in cache.entries.values() if e.backward is not None]
    grads = [op.fn.__name__ for op in train[0].backward.ops
             if op.kind == 'BatchNormalizationGrad']
    assert grads == ['numpy_inplace_BatchNormalizationGrad']
    (cache,) = caches_of(b).values()
    evals = [e for e in cache.entries.values() if e.backward is None]
    (entry,) = evals
    fixed = [op.fn.__name__ for op in entry.forward.ops
             if op.kind == 'FixedBatchNormalization']
    assert fixed == ['numpy_inplace_FixedBatchNormalization']


def test_running_statistics_are_part_of_the_check(monkeypatch):
    """A kernel whose outputs are right but whose running-average update is
    off is rejected on the first replay: the node's own kernel runs, the
    running statistics stay define-by-run's (asserted by _train_bn)."""
    from static_graph import lowering
    real = lowering.STATEFUL['BatchNormalization']

    def drifting(rop, node, xs, donated):
        k = real(rop, node, xs, donated)
        if k is None:
            return None
        d = node.__dict__

        def kernel(a):
            out = k(a)
            d['running_var'] *= numpy.float32(1.0000001)
            return out
        kernel.__name__ = 'drifting'
        kernel.effects = k.effects
        return kernel

    monkeypatch.setitem(lowering.STATEFUL, 'BatchNormalization', drifting)
    names, _ = _train_bn()
    assert names[0] == 'probe_drifting'
    assert 'drifting' not in names[1:], names


def test_linear_gradients_of_the_nodes_own_expression_are_not_probed():
    """LinearFunction, LinearGradData and LinearGradWeight's kernels are the
    nodes' own
    expressions: large ones are chosen when the schedule is built, with no
    first-replay comparison (which ran each twice), and train bit for bit
    like define-by-run."""
    import chainer.links as L

    class Big(chainer.Chain):
        def __init__(self):
            super(Big, self).__init__()
            with self.init_scope():
                self.l1 = L.Linear(300, 200)
                self.l2 = L.Linear(200, 10)

        def forward(self, x, t):
            return F.softmax_cross_entropy(self.l2(F.relu(self.l1(x))), t)

    Static = type('Static', (Big,), {'forward': static_graph(Big.forward)})
    numpy.random.seed(0)
    a, b = Big(), Static()
    b.copyparams(a)
    opts = twin_optimizers((a, b), lambda: chainer.optimizers.SGD(0.1))
    rs = numpy.random.RandomState(0)
    for i in range(4):
        x = rs.standard_normal((64, 300)).astype('f')
        t = rs.randint(0, 10, 64).astype('i')
        for m, o in zip((a, b), opts):
            m.cleargrads()
            m(x, t).backward()
            o.update()
        if i == 0:
            (e,) = caches_of(b)['forward'].entries.values()
            # (The small ones, l2's, are checked when the schedule
            # compiles; the large one, l1's weight gradient, is chosen.)
            names = [getattr(op.fn, '__name__', '') for op in e.backward.ops
                     if op.kind in ('LinearGradData', 'LinearGradWeight')]
            assert 'numpy_LinearGradWeight' in names and not any(
                n.startswith('probe_') for n in names), names
            # So is the forward's: l1's (large) chosen, not probed.
            names = [getattr(op.fn, '__name__', '') for op in e.forward.ops
                     if op.kind == 'LinearFunction']
            assert 'numpy_LinearFunction' in names and not any(
                n.startswith('probe_') for n in names), names
        for (_, p), (_, q) in zip(sorted(a.namedparams()),
                                  sorted(b.namedparams())):
            numpy.testing.assert_array_equal(p.array, q.array)


@pytest.mark.parametrize('dtype', [numpy.float16, numpy.float32])
@pytest.mark.parametrize('ignore_label', [None, -1, 3])
def test_embed_id_grad_kernel_is_chainers_loop_bit_for_bit(dtype,
                                                            ignore_label):
    """EmbedIDGrad's CPU backward adds gy's rows into gW one by one in a
    Python loop; the lowered kernel makes the same additions in one
    ``numpy.add.at``: the same bits, for a broadcast gy (a Sum's backward
    gives one), many repeated indices, ignored labels and negative
    indices (which the loop wraps)."""
    from chainer.functions.connection.embed_id import EmbedIDGrad
    from static_graph import lowering

    class Rop(object):
        kind, state, nones, rebind = 'EmbedIDGrad', (), (), ()

    rs = numpy.random.RandomState(2)
    x = rs.randint(-2, 7, (10, 12, 5)).astype(numpy.int32)
    x[:, :, 3:] = 0
    if ignore_label == -1:
        x[x == -2] = 0
    gy = numpy.broadcast_to(
        rs.standard_normal((10, 12, 1, 6)).astype(dtype) * 1e3,
        (10, 12, 5, 6))
    for g in (gy, numpy.ascontiguousarray(gy)):
        rop = Rop()
        rop.node = EmbedIDGrad((7, 6), ignore_label)
        want = rop.node.forward((x, g))[0]
        kernel = lowering.propose(rop, [x, g])
        assert kernel is not None
        got = kernel((x, g))[0]
        assert got.dtype == want.dtype and got.strides == want.strides
        assert got.tobytes() == want.tobytes()


def test_embed_id_grad_of_a_broadcast_gradient_replays_lowered():
    """The bag-of-words encoder of Chainer's memnn example (``F.sum`` over
    embedded words): EmbedIDGrad's gy is a broadcast view that dies there.
    A kernel that writes into no input is checked on the inputs as they
    are (no copy of a donated input, which a broadcast view cannot have),
    and replaces the node's loop."""
    class Bow(chainer.Chain):
        def __init__(self):
            super(Bow, self).__init__()
            with self.init_scope():
                self.embed = chainer.links.EmbedID(30, 8)

        def forward(self, x):
            return F.sum(F.sum(self.embed(x), axis=-2) ** 2)

    StaticBow = type('StaticBow', (Bow,),
                     {'forward': static_graph(Bow.forward)})
    rs = numpy.random.RandomState(3)
    numpy.random.seed(0)
    a = Bow()
    b = StaticBow()
    b.copyparams(a)
    for i in range(4):
        x = rs.randint(0, 30, (16, 10, 6)).astype(numpy.int32)
        for m in (a, b):
            m.cleargrads()
            m(x).backward()
        assert a.embed.W.grad.tobytes() == b.embed.W.grad.tobytes()
    assert dict(kernels(b))['EmbedIDGrad'] == 'numpy_EmbedIDGrad'


def test_kernel_checks_compare_bits_not_values():
    """A kernel whose result differs from the node's only in the sign of a
    zero is not the node's result (a later 1/x tells them apart); one
    whose result holds the same NaNs is."""
    from static_graph import kernel_checks
    zero = numpy.array([0.0, 1.0], numpy.float32)
    assert not kernel_checks._same((zero,), (-zero,))
    assert kernel_checks._same((zero,), (zero.copy(),))
    nan = numpy.array([numpy.nan, 2.0], numpy.float64)
    assert kernel_checks._same((nan,), (nan.copy(),))
    assert not kernel_checks._same((0.0,), (-0.0,))
    assert kernel_checks._same((float('nan'),), (float('nan'),))
    strided = numpy.arange(12, dtype=numpy.float16).reshape(3, 4)[:, ::2]
    assert kernel_checks._same_bits(strided, strided.copy())


def test_batch_normalization_gradient_keeps_chainers_nan():
    """The in-place BatchNormalizationGrad kernel (lowering._bn_grad_in_x)
    against Chainer's, with a NaN gamma and a NaN gradient of other
    payloads: where both operands of the last product are NaN, NumPy keeps
    one operand's payload, so the kernel multiplies in Chainer's operand
    order (hunt33c: it kept the other's)."""
    from chainer.functions.normalization import batch_normalization as bn
    from static_graph import lowering

    def nan(payload):
        return numpy.array([0x7fc00000 | payload], numpy.uint32).view(
            numpy.float32)[0]
    rs = numpy.random.RandomState(0)
    x = rs.randn(16, 8).astype('f')
    gamma = rs.randn(8).astype('f')
    gamma[2] = nan(0x11)
    gy = rs.randn(16, 8).astype('f')
    gy[:, 2] = nan(0x22)
    mean = x.mean(axis=0)
    inv_std = (1 / numpy.sqrt(x.var(axis=0) + 2e-5)).astype('f')
    expander = (None, slice(None))
    with numpy.errstate(all='ignore'):
        gx, _, ggamma, gbeta = bn.GeneralBatchNormalizationImpl().backward(
            (0,), gamma, gy, x, None, numpy, expander, mean, inv_std, 2e-5,
            None, None)
        ours = lowering._bn_grad_in_x(x.copy(), gamma, gy, mean, inv_std,
                                      expander, (0,))
    assert numpy.isnan(gx[:, 2]).all()
    for a, b in zip(ours, (gx, ggamma, gbeta)):
        assert a.tobytes() == b.tobytes()
