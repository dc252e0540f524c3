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


class TwoBranches(chainer.Chain):
    """Independent products side by side: two Linears of one input (an
    LSTM's upward and lateral), and every Linear's input and weight
    gradients in the backward."""

    def __init__(self):
        super(TwoBranches, self).__init__()
        with self.init_scope():
            self.a = L.Linear(40, 64)
            self.b = L.Linear(40, 64)
            self.c = L.Linear(64, 64)
            self.d = L.Linear(64, 3)

    def forward(self, x, t):
        h = F.tanh(self.a(x) + self.b(x))
        h = F.relu(self.c(h))
        return F.softmax_cross_entropy(self.d(h), t)


def train_two_branches(threads, steps):
    """(define-by-run, static) TwoBranches trained ``steps`` steps with
    Adam side by side, equal bit for bit after each."""
    a, b = static_twins(TwoBranches, threads=threads)
    oa, ob = chainer.optimizers.Adam(), chainer.optimizers.Adam()
    oa.setup(a)
    ob.setup(b)
    rs = numpy.random.RandomState(0)
    for i in range(steps):
        x = rs.randn(32, 40).astype(numpy.float32)
        t = rs.randint(0, 3, 32).astype(numpy.int32)
        for m, o in ((a, oa), (b, ob)):
            m.cleargrads()
            m(x, t).backward()
            o.update()
        compare_chains(a, b, rtol=0, atol=0, grads=True)
    return a, b


def _paired_ops(chain):
    entry = next(iter(stats(chain).entries.values()))
    kinds = []
    for run in (entry.run_forward, entry.run_backward):
        s = run.schedule
        for i in s.pairs:
            kinds.append((s.ops[i].kind, s.ops[i + 1].kind))
    return kinds


@pytest.mark.parametrize('threads,blas', [(1, 1), (2, 1), (2, 2)])
def test_independent_products_run_two_at_a_time_with_the_same_bits(
        threads, blas, monkeypatch):
    """With two threads allowed and a BLAS that runs each product on one
    thread, neighbouring independent products run at the same time
    (forced here on every call): every loss, gradient and parameter equal
    to define-by-run's; the printout names the pairs. A BLAS of two
    threads pairs nothing."""
    from schedules import stream
    from static_graph import blas_idle
    monkeypatch.setattr(blas_idle, 'numpy_blas_threads', lambda: blas)
    # (the pairs of the pool's Python threads: test_stream.py has the C
    # worker's)
    monkeypatch.setattr(stream, 'available', lambda: 'off')
    concurrent = []
    run = parallel.Pair._run

    def counting(runner, *args):
        concurrent.append(runner is not None)
        return run(runner, *args)
    monkeypatch.setattr(parallel.Pair, '_run', staticmethod(counting))
    monkeypatch.setattr(parallel.SplitChoice, 'use_pool',
                        lambda self: (self.threads > 1, False))
    a, b = train_two_branches(threads, 6)
    pairs = _paired_ops(b)
    if threads == 1 or blas > 1:
        assert pairs == [] and concurrent == []
        return
    assert ('LinearFunction', 'LinearFunction') in pairs
    assert ('LinearGradData', 'LinearGradWeight') in pairs
    assert concurrent and all(concurrent)
    entry = next(iter(stats(b).entries.values()))
    assert 'at the same time as the next op' in str(
        entry.run_backward.schedule)


def test_a_result_placed_where_its_partner_reads_is_not_paired():
    """executor._pairs: two ops run at once only if neither writes memory
    the other reads (a result placed in a host held from before both)."""
    from schedules import executor, ir

    class Fn(object):
        __name__ = 'numpy_k'

        def __call__(self, a):
            return a[0] + 1,

    bufs = dict((i, ir.Buffer(i, (2,), numpy.dtype('f'),
                              ir.INPUT if i == 0 else ir.TEMP))
                for i in range(5))
    ops = [ir.Op('K', [0], [1], fn=Fn()), ir.Op('K', [1], [2], fn=Fn()),
           ir.Op('K', [1], [3], fn=Fn()), ir.Op('K', [2, 3], [4], fn=Fn())]
    s = ir.Schedule('s', bufs, ops, [0], [4])

    class Plan(object):
        places = {}

    always = lambda a, b: object()   # NOQA
    # op 1 and op 2 are independent; op 0 and op 1 are not
    assert list(executor._pairs(s, Plan(), {}, always)) == [1]
    # op 2's result placed in a host held from op 1 on (op 1's input dies
    # there, say): not paired
    Plan.places = {3: (7, 0)}
    assert executor._pairs(s, Plan(), {1: [(7, 1)]}, always) == {}
    # held from before op 1: paired
    assert list(executor._pairs(s, Plan(), {0: [(7, 0)]}, always)) == [1]


class Wide(chainer.Chain):
    def __init__(self):
        super(Wide, self).__init__()
        with self.init_scope():
            self.l = L.Linear(400, 400)   # 160k weights

    def forward(self, x):
        return F.sum(F.tanh(self.l(x)))


@pytest.mark.parametrize('threads', [1, 2])
def test_gradients_added_to_held_ones_split_with_the_same_bits(
        threads, always_split):
    """Gradients accumulated over calls without cleargrads (a loss summed
    over a truncated sequence): the held gradient is added into the
    call's contribution, split across the threads (forced here); the
    same bits as define-by-run."""
    a, b = static_twins(Wide, threads=threads)
    rs = numpy.random.RandomState(0)
    for step in range(4):
        for m in (a, b):
            m.cleargrads()
        for _ in range(3):
            x = rs.randn(4, 400).astype(numpy.float32)
            for m in (a, b):
                m(x).backward()
        compare_chains(a, b, rtol=0, atol=0, grads=True)
    assert stats(b).replays > 0
    assert ('add_into' in always_split) == (threads > 1)
