"""The stream: weight-gradient products and held-gradient sums on a C
worker thread, and pairs of products with one on it (schedules/stream.py,
schedules/blas_stream.py)."""
import warnings

import numpy
import pytest

import chainer
import chainer.functions as F
import chainer.links as L

from schedules import blas_stream
from schedules import ir
from schedules import placement
from schedules import stream
from tests.twins import bptt_window, compare_chains, stats, static_twins
from tests.twins import twin_optimizers

_worker = blas_stream.worker()
needs_worker = pytest.mark.skipif(
    isinstance(_worker, str), reason='no C worker: %s' % (_worker,))


def _bits(a):
    return a.view('u%d' % a.dtype.itemsize)


def _run(task):
    push, wait = blas_stream.worker()
    ticket = push(*(task + (0,)))
    return wait(ticket, ticket)


@needs_worker
@pytest.mark.parametrize('dtype', [numpy.float32, numpy.float64])
def test_dot_tasks_are_numpys_gemm_call(dtype):
    """Every layout NumPy hands to gemm as it is (C- or F-contiguous
    operands) gives dot's bits; what NumPy copies first, vectors, and a
    matrix times its own transpose (syrk) give no task."""
    rs = numpy.random.RandomState(0)
    shapes = [(800, 20, 200), (7, 5, 3), (2, 2, 2), (33, 64, 17)]
    for l, m, n in shapes:
        for fa in (False, True):
            for fb in (False, True):
                a = rs.randn(l, m).astype(dtype)
                b = rs.randn(m, n).astype(dtype)
                a = numpy.asfortranarray(a) if fa else a
                b = numpy.asfortranarray(b) if fb else b
                task, out = blas_stream.dot_task(a, b)
                out[...] = numpy.nan       # the task zeroes it, as NumPy
                assert _run(task) == 0
                assert out.flags.c_contiguous
                numpy.testing.assert_array_equal(_bits(out), _bits(a.dot(b)))
    a = rs.randn(6, 4).astype(dtype)
    assert blas_stream.dot_task(a, a.T) is None                  # syrk
    assert blas_stream.dot_task(a[:, :1], a[:1]) is None         # vectors
    assert blas_stream.dot_task(a[::2], a.T[:, :3]) is None      # copied
    assert blas_stream.dot_task(a, a.T.astype(numpy.float16)) is None


@needs_worker
def test_sum_tasks_give_numpys_bits_and_its_warnings():
    rs = numpy.random.RandomState(1)
    for dtype in (numpy.float32, numpy.float64):
        g = rs.randn(50, 30).astype(dtype)
        x = rs.randn(50, 30).astype(dtype)
        want = g + x
        task, out = blas_stream.add_task(g, x)
        assert out is x and _run(task) == 0
        numpy.testing.assert_array_equal(_bits(x), _bits(want))
        b = rs.randn(30).astype(dtype)
        want = x + b
        assert _run(blas_stream.bias_task(x, b)) == 0
        numpy.testing.assert_array_equal(_bits(x), _bits(want))
        big = numpy.full((4, 3), numpy.finfo(dtype).max, dtype)
        flags = _run(blas_stream.add_task(big.copy(), big)[0])
        assert flags & 2     # overflow: stream.py reports it through NumPy
    x = rs.randn(4, 3).astype(numpy.float32)
    assert blas_stream.add_task(x, x[:, :2].copy()) is None     # shapes
    assert blas_stream.add_task(x, x.T.copy().T) is None        # layout
    assert blas_stream.add_task(x, x[1:]) is None               # a view
    assert blas_stream.bias_task(x, x[0].astype(numpy.float64)) is None


@needs_worker
def test_a_waiting_caller_runs_tasks_the_worker_has_not_taken():
    """Many products, each followed by a sum that waits for it: the
    caller, waiting, runs some itself; every result is NumPy's."""
    push, wait = blas_stream.worker()
    rs = numpy.random.RandomState(2)
    before = blas_stream.helped()
    for _ in range(5):
        ins = [(rs.randn(256, 20).astype(numpy.float32),
                rs.randn(20, 256).astype(numpy.float32),
                rs.randn(256, 256).astype(numpy.float32))
               for i in range(20)]
        outs, first, last = [], 0, 0
        for a, b, g in ins:
            task, out = blas_stream.dot_task(a, b)
            t = push(*(task + (0,)))
            first = first or t
            last = push(*(blas_stream.add_task(g, out)[0] + (t,)))
            outs.append(out)
        assert wait(first, last) == 0
        for out, (a, b, g) in zip(outs, ins):
            numpy.testing.assert_array_equal(_bits(out), _bits(g + a.dot(b)))
    assert blas_stream.helped() > before


class LM(chainer.Chain):
    """ptb's language model, small: state carried between calls, the
    loss of several calls summed, truncated backpropagation."""

    def __init__(self, n_vocab=30, n_units=16):
        super(LM, self).__init__()
        with self.init_scope():
            self.embed = L.EmbedID(n_vocab, n_units)
            self.l1 = L.LSTM(n_units, n_units)
            self.l2 = L.Linear(n_units, n_vocab)

    def reset_state(self):
        self.l1.reset_state()

    def forward(self, x):
        return self.l2(F.dropout(self.l1(self.embed(x))))


def _train(models, opts, rs, windows=4, calls=4, batch=5):
    for w in range(windows):
        xs = rs.randint(0, 30, (calls + 1, batch)).astype(numpy.int32)
        for m, o in zip(models, opts):
            numpy.random.seed(w)
            bptt_window(m, o, xs)
        compare_chains(models[0], models[1], rtol=0, atol=0, grads=True)


@needs_worker
@pytest.mark.parametrize('force', [True, False, None])
def test_weight_gradients_on_the_worker_give_define_by_runs_bits(
        force, monkeypatch):
    """Truncated BPTT with the stream forced on, off, or measured: every
    parameter and gradient equal to define-by-run's after each window;
    forced on, the weight gradients and the sums into gradients held from
    later calls ran on the worker, and the printout says so."""
    from static_graph import blas_idle
    monkeypatch.setattr(blas_idle, 'numpy_blas_threads', lambda: 1)
    monkeypatch.setattr(stream, 'FORCE', force)
    pushed = []
    push, wait = blas_stream.worker()

    def counting(*t):
        pushed.append(t[0])
        return push(*t)
    monkeypatch.setattr(blas_stream, 'worker', lambda: (counting, wait))
    a, b = static_twins(LM, threads=2)
    opts = twin_optimizers((a, b), lambda: chainer.optimizers.MomentumSGD(0.1))
    _train((a, b), opts, numpy.random.RandomState(0))
    text = '\n'.join(
        str(run.schedule) for e in stats(b).entries.values()
        for run in list(e.accumulating.values()) + [e.run_backward]
        if run is not None and hasattr(run, 'schedule'))
    if force:
        assert 1 in pushed and 3 in pushed     # products and sums
        assert 'on the worker thread' in text
    elif force is False:
        assert pushed == []


@needs_worker
def test_a_forked_process_runs_the_streamed_ops_itself(monkeypatch):
    """The worker thread stays in the parent: a child process forked after
    the schedules compiled runs them inline (not waiting for a worker that
    is not there), with the same bits."""
    import multiprocessing
    from static_graph import blas_idle
    monkeypatch.setattr(blas_idle, 'numpy_blas_threads', lambda: 1)
    monkeypatch.setattr(stream, 'FORCE', True)
    a, b = static_twins(LM, threads=2)
    opts = twin_optimizers((a, b), lambda: chainer.optimizers.SGD(0.1))
    _train((a, b), opts, numpy.random.RandomState(0), windows=3)

    def child():
        # (more tasks than the worker's ring holds: a child that pushed
        # would fill it and wait for a thread it does not have)
        _train((a, b), opts, numpy.random.RandomState(1), windows=40)
    ctx = multiprocessing.get_context('fork')
    p = ctx.Process(target=child)
    p.start()
    p.join(120)
    if p.is_alive():
        p.kill()
        p.join()
        pytest.fail('the child hung')
    assert p.exitcode == 0


@needs_worker
def test_a_run_left_by_an_exception_waits_for_its_tasks(monkeypatch):
    """A schedule that raises after pushing tasks drops its run: the
    arrays the tasks write must not be freed under them, so the run waits
    before it lets go."""
    monkeypatch.setattr(stream, 'FORCE', True)
    rs = numpy.random.RandomState(3)
    a = rs.randn(2600, 20).astype(numpy.float32)
    b = rs.randn(20, 650).astype(numpy.float32)
    seen = []

    class Product(object):
        def stream_task(self, args):
            task, out = blas_stream.dot_task(args[0], args[1])
            seen.append(out)
            return [task], (out,)

    def failing_schedule():
        run = stream.Stream(2).begin()
        for _ in range(16):
            run.put(Product(), (a, b))
        raise KeyError('a later op failed')
    want = a.dot(b)
    try:
        failing_schedule()
    except KeyError:
        pass        # (the run dies with the traceback, here)
    else:
        pytest.fail('no exception')
    assert len(seen) == 16
    for out in seen[::-1]:       # (the last first: the worker's last)
        numpy.testing.assert_array_equal(_bits(out), _bits(want))


def _op(kind, ins, outs, aliases=None, task=True):
    def fn(a):
        return tuple(a[:len(outs)])
    fn.__name__ = 'numpy_' + kind
    if aliases:
        fn.aliases = aliases
    if task:
        fn.stream_task = lambda a: None
    return ir.Op(kind, list(ins), list(outs), fn=fn)


def _schedule(ops, n, inputs, outputs):
    bufs = dict((i, ir.Buffer(i, (4,), numpy.dtype('f'),
                              ir.INPUT if i in inputs else ir.TEMP))
                for i in range(n))
    return ir.Schedule('s', bufs, ops, list(inputs), list(outputs))


def _role(op):
    return {'H': 'head', 'F': 'follow'}.get(op.kind)


def test_select_keeps_what_the_calling_thread_reads_or_writes():
    """stream.select: a product goes with the sum that follows it where
    only the outputs need them; not where an op of the calling thread
    reads its result, or writes into its input later."""
    plan = placement.Placement()
    # H: 0 -> 2 (weight gradient), F: 2 + 1 -> 3 (held gradient added),
    # M: 0 -> 4 (the chain goes on)
    ops = [_op('H', [0], [2]), _op('F', [1, 2], [3]),
           _op('M', [0], [4])]
    s = _schedule(ops, 5, (0, 1), (3, 4))
    assert sorted(stream.select(s, plan, _role)) == [0, 1]
    # the calling thread reads the product: neither goes
    ops.append(_op('M', [2], [5]))
    s = _schedule(ops, 6, (0, 1), (3, 4, 5))
    assert stream.select(s, plan, _role) == frozenset()
    # the calling thread writes into the product's input afterwards
    ops = [_op('H', [0], [2]), _op('M', [0], [4], aliases=(0,))]
    s = _schedule(ops, 5, (0,), (2, 4))
    assert stream.select(s, plan, _role) == frozenset()
    # a sum that would write into memory the worker did not make
    ops = [_op('F', [1, 0], [3], aliases=(1,))]
    s = _schedule(ops, 4, (0, 1), (3,))
    assert stream.select(s, plan, _role) == frozenset()
    # an op without a task stays
    ops = [_op('H', [0], [2], task=False)]
    s = _schedule(ops, 3, (0,), (2,))
    assert stream.select(s, plan, lambda op: 'head'
                         if getattr(op.fn, 'stream_task', None) else None) \
        == frozenset()


@needs_worker
def test_a_pair_with_one_product_on_the_worker_gives_the_same_bits(
        monkeypatch):
    from static_graph import blas_idle
    from static_graph import split_kernels
    monkeypatch.setattr(blas_idle, 'numpy_blas_threads', lambda: 1)
    monkeypatch.setattr(stream.parallel.SplitChoice, 'use_pool',
                        lambda self: (True, False))
    from tests.test_split_kernels import train_two_branches
    a, b = train_two_branches(threads=2, steps=5)
    entry = next(iter(stats(b).entries.values()))
    pairs = entry.run_forward.schedule.pairs
    assert pairs and all(isinstance(p, stream.Pair)
                         for p in pairs.values())
    assert split_kernels.pairing(2) is not None


@needs_worker
def test_a_pair_whose_first_op_writes_into_given_memory_uses_the_pool(
        monkeypatch):
    """``fn.into`` calls (a placed result) give the worker no task: such a
    pair runs as the pool's pairs do, on two threads where measured."""
    monkeypatch.setattr(stream.parallel.SplitChoice, 'use_pool',
                        lambda self: (True, False))
    ran = []
    run = stream.parallel.Pair._run

    def counting(runner, *args):
        ran.append(runner is not None)
        return run(runner, *args)
    monkeypatch.setattr(stream.parallel.Pair, '_run', staticmethod(counting))
    a = numpy.arange(6.0).reshape(2, 3)

    def into(args, outs):
        numpy.dot(args[0], args[1], out=outs[0])
        return outs[0],
    into.stream_task = lambda args: pytest.fail('not a task')
    out = numpy.empty((2, 2))
    ra, rb = stream.Pair(2)(into, ((a, a.T), (out,)),
                            lambda args: (args[0] * 2,), ((a,),))
    assert ra[0] is out and ran == [True]
    numpy.testing.assert_array_equal(out, a.dot(a.T))
    numpy.testing.assert_array_equal(rb[0], a * 2)


@needs_worker
def test_an_overflow_on_the_worker_warns_as_numpy_does(monkeypatch):
    monkeypatch.setattr(stream, 'FORCE', True)

    class Sum(object):
        def stream_task(self, a):
            t = blas_stream.add_task(a[0], a[1])
            return [t[0]], (t[1],)
    big = numpy.full((3, 3), numpy.finfo(numpy.float32).max, numpy.float32)
    s = stream.Stream(2)
    run = s.begin()
    run.put(Sum(), (big.copy(), big.copy()))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        run.end()
    assert any('overflow' in str(x.message) for x in w)
