"""Large in-place element-wise kernels, and convolutions' im2col and
col2im, split across threads (static_graph/split_kernels.py,
schedules/numpy_conv.py): the same bits with 1, 2 and 4 threads, split or
not, as define-by-run."""
import numpy
import pytest

import chainer
import chainer.functions as F
import chainer.links as L

from schedules import parallel
from static_graph import split_kernels
from tests.twins import compare_chains, stats, static_twins


class Block(chainer.Chain):
    """Large ReLUs and an Add of two same-shaped arrays: in the backward,
    ReLU's gradient of a gradient that dies with it (in place)."""

    def __init__(self):
        super(Block, self).__init__()
        with self.init_scope():
            self.c1 = L.Convolution2D(4, 16, 3, pad=1)
            self.c2 = L.Convolution2D(16, 16, 3, pad=1)

    def forward(self, x):
        h = F.relu(self.c1(x))
        h = F.relu(self.c2(h) + h)
        return F.mean(h * h)


def _splits(chain):
    entry = next(iter(stats(chain).entries.values()))
    found = []
    for run in (entry.run_forward, entry.run_backward):
        for op in run.schedule.ops:
            if isinstance(op.fn, split_kernels._Split):
                found.append(op.fn)
    return found


@pytest.fixture
def always_split(monkeypatch):
    """Every split kernel takes the split path on every call (not only
    where it measured faster); returns the names of the functions run
    split."""
    monkeypatch.setattr(parallel.SplitChoice, 'use_pool',
                        lambda self: (self.threads > 1, False))
    ran = set()
    call = parallel.Ranges.__call__

    def recording_call(self, fn):
        ran.add(fn.__name__)
        return call(self, fn)
    monkeypatch.setattr(parallel.Ranges, '__call__', recording_call)
    return ran


@pytest.mark.parametrize('threads', [1, 2, 4])
@pytest.mark.parametrize('forced', [False, True])
def test_split_kernels_give_define_by_runs_bits(threads, forced, request):
    ran = request.getfixturevalue('always_split') if forced else None
    a, b = static_twins(Block, threads=threads)
    oa, ob = chainer.optimizers.SGD(0.01), chainer.optimizers.SGD(0.01)
    oa.setup(a)
    ob.setup(b)
    rs = numpy.random.RandomState(0)
    for i in range(8):
        x = rs.randn(8, 4, 48, 48).astype(numpy.float32)   # 295k per ReLU
        for m, o in ((a, oa), (b, ob)):
            m.cleargrads()
            loss = m(x)
            loss.backward()
            o.update()
        compare_chains(a, b, rtol=0, atol=0, grads=True)
        # (a live network: the backward's kernels get nonzero gradients)
        assert numpy.count_nonzero(b.c1.W.grad) == b.c1.W.size
    assert stats(b).replays == 7
    # The NumPy convolution kernels passed their first-replay check (a
    # split that changed a bit would leave the node's own kernel).
    entry = next(iter(stats(b).entries.values()))
    kernels = dict((op.kind, getattr(op.fn, '__name__', None))
                   for run in (entry.run_forward, entry.run_backward)
                   for op in run.schedule.ops)
    for kind in ('Convolution2DFunction', 'Convolution2DGradW',
                 'Deconvolution2DFunction'):
        assert kernels[kind] == 'numpy_' + kind, kernels
    splits = _splits(b)
    if threads == 1:
        assert splits == []
    else:
        kinds = sorted(s.__name__ for s in splits)
        assert any('ReLU_' in k for k in kinds), kinds
        assert any('ReLUGrad2' in k for k in kinds), kinds
        assert all(k.endswith('_split%d' % threads) for k in kinds)
        if forced:   # each ran split, and took the pool
            assert all(s.choice.times == {True: [], False: []}
                       for s in splits)
            # the element-wise kernels, the im2col taps of the second
            # convolution (16 channels) and its input gradient's col2im
            assert ran == {'part', 'taps', 'add_taps'}, ran


def test_small_or_broadcast_kernels_are_not_split():
    rs = numpy.random.RandomState(0)
    big = rs.randn(8, 64, 32).astype(numpy.float32)     # 16k elements
    k = split_kernels.split(_inplace(), 'ReLU', [big], 2)
    assert not isinstance(k, split_kernels._Split)
    big = rs.randn(8, 256, 128).astype(numpy.float32)
    k = split_kernels.split(_inplace(), 'ReLU', [big], 2)
    assert isinstance(k, split_kernels._Split)
    bias = rs.randn(128).astype(numpy.float32)
    k = split_kernels.split(_inplace(), 'Add', [big, bias], 2)
    assert not isinstance(k, split_kernels._Split)
    k = split_kernels.split(_inplace(), 'Mul', [big, big], 2)
    assert not isinstance(k, split_kernels._Split)


def test_threads_option_is_checked():
    from static_graph import static_graph
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError):
            static_graph(threads=bad)


def _inplace():
    def kernel(a):
        return numpy.maximum(a[0], 0, out=a[0]),
    kernel.aliases = (0,)
    return kernel
