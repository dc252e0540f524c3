"""Kernels that write into an input that dies with the op (donation): which
inputs may be overwritten, and replay staying define-by-run's."""
import warnings

import numpy
import pytest

import chainer
import chainer.functions as F
import chainer.links as L
from chainer import function_node

from schedules import ir
from static_graph import lower_pass
from static_graph import static_graph
from static_graph.decorator import caches_of


def _schedule(specs, ops, inputs, outputs):
    bufs = {}
    for b, (role, storage, static) in specs.items():
        bufs[b] = ir.Buffer(b, storage.shape, storage.dtype, role,
                            static=static, storage=storage)
    return ir.Schedule('s', bufs, [ir.Op('K', i, o) for i, o in ops],
                       inputs, outputs)


def test_donations_follow_liveness_roles_and_shared_memory():
    a = numpy.zeros(4, 'f')
    base = numpy.zeros(8, 'f')
    view = base[:4]
    arrays = {0: ('input', numpy.zeros(4, 'f'), False),
              1: ('temp', a, False),                  # dies at op 1
              2: ('temp', numpy.zeros(4, 'f'), False),  # read again later
              3: ('temp', numpy.zeros(4, 'f'), True),   # static
              4: ('temp', base, False),               # base of 5, used later
              5: ('temp', view, False),               # dies at op 1
              6: ('temp', numpy.zeros(4, 'f'), False),  # kept
              7: ('temp', numpy.zeros(4, 'f'), False),
              8: ('temp', numpy.zeros(4, 'f'), False)}
    s = _schedule(arrays,
                  [((0,), (1, 2, 3, 4, 5, 6)),
                   ((0, 1, 2, 3, 5, 6), (7,)),
                   ((2, 4, 7), (8,))],
                  (0,), (8,))
    d = lower_pass.donations(s, keep={6})
    assert d[1] == (False,   # an input of the call
                    True,    # dies here, owns its memory
                    False,   # read by op 2
                    False,   # static
                    False,   # its memory (base, 4) is read by op 2
                    False)   # kept
    # At op 2, 2 and 7 die; 4 dies but shares memory with 5 (dead): fine.
    assert d[2] == (True, True, True)


class _Attention(chainer.Chain):
    """Show-Attend-Tell's "doubly stochastic" regulariser: the attention
    maps of the steps stacked and summed over the steps. Stack's backward
    hands each step's map a slice of the sum's gradient, a read-only
    ``broadcast_to`` view, which the map's own gradient sum was given as
    the array to add into."""

    def __init__(self):
        super(_Attention, self).__init__()
        with self.init_scope():
            self.v = L.Linear(5, 1)

    def forward(self, feats):
        maps, loss = [], 0
        for _ in range(2):
            a = F.reshape(self.v(F.reshape(feats, (12, 5))), (3, 4))
            loss += F.sum(feats * F.repeat(a[..., None], 5, axis=2))
            maps.append(a)
        return loss + F.sum(F.sum(F.stack(maps, axis=1), axis=1) ** 2)


def test_a_read_only_gradient_is_not_donated():
    """The compiled backward raised "output array is read-only" at its
    first run (the fourth call), where define-by-run trains."""
    S = type('S', (_Attention,), {'forward': static_graph(
        _Attention.forward)})
    models = []
    for cls in (_Attention, S):
        numpy.random.seed(0)
        models.append(cls())
    for i in range(6):
        x = numpy.random.RandomState(i).randn(3, 4, 5).astype('f')
        for m in models:
            m.cleargrads()
            m(x.copy()).backward()
        assert numpy.array_equal(models[0].v.W.grad, models[1].v.W.grad)
    ro = numpy.broadcast_to(numpy.zeros(4, 'f'), (2, 4))[0]
    s = _schedule({0: ('input', numpy.zeros(4, 'f'), False),
                   1: ('temp', ro, False), 2: ('temp', ro.copy(), False)},
                  [((0,), (1,)), ((1, 0), (2,))], (0,), (2,))
    assert lower_pass.donations(s, keep=set())[1] == (False, False)


def test_broadcast_arrays_results_are_not_donated_and_no_warning():
    """F.broadcast's results (numpy.broadcast_arrays' views, whose flag
    NumPy warns of reading): never donated, and the lowering warns of
    nothing (under -W error the key fell back)."""
    class Net(chainer.Chain):
        def __init__(self):
            super(Net, self).__init__()
            with self.init_scope():
                self.l = L.Linear(3, 3)

        def forward(self, x):
            a, b = F.broadcast(self.l(x), x[:1])
            return F.sum(a * b)

    S = type('S', (Net,), {'forward': static_graph(Net.forward)})
    m = S()
    with warnings.catch_warnings():
        warnings.simplefilter('error', FutureWarning)
        for i in range(5):
            m.cleargrads()
            m(numpy.ones((2, 3), 'f')).backward()
    assert caches_of(m)['forward'].replays == 4


def test_an_input_read_twice_by_the_op_is_not_donated():
    x = numpy.zeros(3, 'f')
    s = _schedule({0: ('input', numpy.zeros(3, 'f'), False),
                   1: ('temp', x, False), 2: ('temp', x.copy(), False)},
                  [((0,), (1,)), ((1, 1), (2,))], (0,), (2,))
    assert lower_pass.donations(s, keep=())[1] == (False, False)


class Scale(function_node.FunctionNode):
    """y = 2x, keeping its input on the node in forward; its backward node
    reads it from there (not as an input) when it runs."""

    def forward(self, inputs):
        self.x = inputs[0]
        return inputs[0] * 2,

    def backward(self, indexes, grad_outputs):
        return ScaleGrad(self).apply(grad_outputs)


class ScaleGrad(function_node.FunctionNode):
    def __init__(self, fwd):
        self.fwd = fwd

    def forward(self, inputs):
        return inputs[0] * 2 + self.fwd.x,


class Held(chainer.Chain):
    def __init__(self):
        super(Held, self).__init__()
        with self.init_scope():
            self.p = chainer.Parameter(numpy.ones((3, 4), 'f'))

    def forward(self, x):
        x1 = x * self.p * 3.0
        y, = Scale().apply((x1,))
        z = x1 + y             # the last use of x1 as an op input
        return F.sum(z * z) + F.sum(y)    # y lives on: only x1 could be
                                          # written into


StaticHeld = type('StaticHeld', (Held,), {'forward': static_graph(Held.forward)})


def _kernels(chain):
    (cache,) = caches_of(chain).values()
    (entry,) = cache.entries.values()
    return [(op.kind, getattr(op.fn, '__name__', '')) for s in (
        entry.forward, entry.backward) for op in s.ops]


def test_arrays_nodes_hold_by_attribute_are_never_written():
    """x1 dies, as an op input, at the Add; but Scale's node holds it and
    its backward node reads it there: the Add must not write into it."""
    a, b = Held(), StaticHeld()
    rs = numpy.random.RandomState(0)
    for i in range(6):
        x = rs.standard_normal((3, 4)).astype('f')
        for m in (a, b):
            m.cleargrads()
            m(x).backward()
        numpy.testing.assert_array_equal(a.p.grad, b.p.grad)
    first_add = [n for k, n in _kernels(b) if k == 'Add'][0]
    assert first_add == 'numpy_Add', _kernels(b)


class Block(chainer.Chain):
    def __init__(self):
        super(Block, self).__init__()
        with self.init_scope():
            self.c1 = L.Convolution2D(4, 8, 3, pad=1)
            self.bn1 = L.BatchNormalization(8)
            self.c2 = L.Convolution2D(8, 8, 3, pad=1)
            self.bn2 = L.BatchNormalization(8)
            self.fc = L.Linear(8, 3)

    def forward(self, x, t):
        h = F.relu(self.bn1(self.c1(x)))
        h = F.relu(self.bn2(self.c2(h)) + h)
        chainer.report({'h_sum': F.sum(h)}, self)
        return F.softmax_cross_entropy(self.fc(F.mean(h, axis=(2, 3))), t)


StaticBlock = type('StaticBlock', (Block,),
                   {'forward': static_graph(Block.forward)})


@pytest.mark.parametrize('size', [6, 24])
def test_inplace_kernels_train_bit_for_bit(size):
    """ReLU, the residual Add, ReLU's and BatchNormalization's backward
    write into inputs that die with them (small ops checked at compile,
    large ones on the first replay); training matches define-by-run bit
    for bit, reported values included."""
    a, b = Block(), StaticBlock()
    b.copyparams(a)
    opts = []
    for m in (a, b):
        o = chainer.optimizers.MomentumSGD(0.05)
        o.setup(m)
        opts.append(o)
    rs = numpy.random.RandomState(1)
    for i in range(5):
        x = rs.standard_normal((4, 4, size, size)).astype('f')
        t = rs.randint(0, 3, 4).astype('i')
        reported = []
        for m, o in zip((a, b), opts):
            m.cleargrads()
            reporter = chainer.Reporter()
            reporter.add_observer('main', m)
            obs = {}
            with reporter.scope(obs):
                loss = m(x, t)
            loss.backward()
            o.update()
            reported.append((loss.array, obs['main/h_sum'].array))
        assert reported[0][0] == reported[1][0]
        assert reported[0][1] == reported[1][1]
        for (n1, p1), (n2, p2) in zip(sorted(a.namedparams()),
                                      sorted(b.namedparams())):
            numpy.testing.assert_array_equal(p1.array, p2.array, err_msg=n1)
        numpy.testing.assert_array_equal(a.bn1.avg_mean, b.bn1.avg_mean)
    names = [n for _, n in _kernels(b)]
    inplace = [n for n in names if n.startswith('numpy_inplace_')]
    assert 'numpy_inplace_BatchNormalizationGrad' in inplace, names
    assert 'numpy_inplace_ReLUGrad2' in inplace, names
    assert 'numpy_inplace_ReLU' in inplace, names
