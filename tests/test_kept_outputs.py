"""What a call hands out or keeps on the chain, as define-by-run does: a
Variable kept while the method returns its array or another Variable of
its memory is the one in the graph (a loss from it backpropagates); views
and constants kept keep their values whatever later calls and the caller
do; the chain's own memory is handed out as that memory."""
import warnings

import numpy
import pytest

import chainer
import chainer.functions as F
import chainer.links as L

from static_graph.decorator import caches_of
from static_graph import static_graph as static


class Net(chainer.Chain):
    def __init__(self, how):
        super(Net, self).__init__()
        self.how = how
        with self.init_scope():
            self.l = L.Linear(3, 4)

    def forward(self, x, t):
        h = F.tanh(self.l(x))
        if self.how == 'loss.array':
            loss = F.softmax_cross_entropy(h, t)
            self.loss = loss
            return loss.array
        self.h = h
        return F.identity(h)


class StaticNet(Net):
    forward = static(Net.forward)


def _loss(m, out):
    if m.how == 'loss.array':
        return m.loss
    return F.sum(out) + 2 * F.sum(m.h)


@pytest.mark.parametrize('how', ['loss.array', 'F.identity'])
def test_a_kept_variable_backpropagates(how):
    dbr, ours = Net(how), StaticNet(how)
    ours.copyparams(dbr)
    opts = [chainer.optimizers.SGD(0.1).setup(m) for m in (dbr, ours)]
    rs = numpy.random.RandomState(0)
    for step in range(4):
        x = rs.randn(5, 3).astype('f')
        t = rs.randint(0, 4, 5).astype('i')
        grads = []
        for m, o in zip((dbr, ours), opts):
            m.cleargrads()
            _loss(m, m(x, t)).backward()
            grads.append(m.l.W.grad)
            o.update()
        assert grads[1] is not None, step
        assert numpy.array_equal(*grads), step
    assert numpy.array_equal(dbr.l.W.array, ours.l.W.array)


class ViewNet(chainer.Chain):
    """Keeps a NumPy view of an output on itself (features for later):
    each call's view is its own call's values, whatever later calls do."""

    def __init__(self, view):
        super(ViewNet, self).__init__()
        self.view = view
        with self.init_scope():
            self.l1 = L.Linear(3, 4)
            self.l2 = L.Linear(4, 2)

    def forward(self, x):
        h = F.relu(self.l1(x))
        self.h = h
        self.feat = self.view(h.array)
        return F.sum(self.l2(h) ** 2)


class StaticViewNet(ViewNet):
    forward = static(ViewNet.forward)


@pytest.mark.parametrize('view', [
    lambda a: a[0], lambda a: a.T, lambda a: a.reshape(-1),
    lambda a: a[:, 1:]], ids=['[0]', '.T', 'reshape', '[:, 1:]'])
def test_views_kept_over_calls_keep_their_values(view):
    # (The key changes after the first call: the chain then holds h and
    # feat. The second call records again; a view that recording left on
    # the chain was of memory the replays then wrote.)
    dbr, ours = ViewNet(view), StaticViewNet(view)
    ours.copyparams(dbr)
    opts = [chainer.optimizers.SGD(0.1).setup(m) for m in (dbr, ours)]
    kept = {id(dbr): [], id(ours): []}
    for step in range(6):
        x = numpy.random.RandomState(step).randn(4, 3).astype('f')
        for m, o in zip((dbr, ours), opts):
            m.cleargrads()
            m(x).backward()
            kept[id(m)].append(m.feat)
            o.update()
    assert caches_of(ours)['forward'].replays >= 3
    for step, (a, b) in enumerate(zip(kept[id(dbr)], kept[id(ours)])):
        assert numpy.array_equal(a, b), step


class ChainMemoryNet(chainer.Chain):
    """Returns or keeps the chain's own arrays (a parameter's, a
    persistent, an array a link holds) or views of them."""

    def __init__(self, pick, keep):
        super(ChainMemoryNet, self).__init__()
        self.pick, self.keep = pick, keep
        with self.init_scope():
            self.l1 = L.Linear(3, 4)
            self.bn = L.BatchNormalization(4)
            self.l2 = L.Linear(4, 2)
        self.l2.scale = numpy.arange(2, dtype='f')

    def forward(self, x):
        h = F.relu(self.bn(self.l1(x)))
        loss = F.sum(self.l2(h) ** 2)
        if self.keep:
            self.kept = self.pick(self)
            return loss
        return loss, self.pick(self)


class StaticChainMemoryNet(ChainMemoryNet):
    forward = static(ChainMemoryNet.forward)


PICKS = [lambda m: m.l1.W.array, lambda m: m.l1.W.array[0],
         lambda m: m.l1.W.array.T, lambda m: m.l1.W.array[...],
         lambda m: m.bn.avg_mean, lambda m: m.bn.avg_var[1:],
         lambda m: m.l2.scale, lambda m: m.l2.scale[::-1]]
PICK_IDS = ['W', 'W[0]', 'W.T', 'W[...]', 'avg_mean', 'avg_var[1:]', 'held',
            'held[::-1]']
# Those that fall back (each for a reason of its own): W kept is read by
# the next call before it is set again (state carried over); avg_mean kept
# is written by BatchNormalization while the chain holds it; a view of
# avg_var is of memory an op of the call writes.
FALL_BACK = {('W', True), ('avg_mean', True),
             ('avg_var[1:]', False), ('avg_var[1:]', True)}


@pytest.mark.parametrize('keep', [False, True], ids=['returned', 'kept'])
@pytest.mark.parametrize('pick', PICKS, ids=PICK_IDS)
def test_chain_memory_is_handed_out_as_define_by_run_does(pick, keep):
    # Define-by-run hands out the chain's memory itself: an update in
    # place (the optimizer's, BatchNormalization's statistics, the caller's
    # own) shows in what earlier calls returned and kept.
    dbr, ours = ChainMemoryNet(pick, keep), StaticChainMemoryNet(pick, keep)
    ours.copyparams(dbr)
    opts = [chainer.optimizers.SGD(0.1).setup(m) for m in (dbr, ours)]
    got = {id(dbr): [], id(ours): []}
    for step in range(6):
        x = numpy.random.RandomState(step).randn(5, 3).astype('f')
        for m, o in zip((dbr, ours), opts):
            m.cleargrads()
            if keep:
                m(x).backward()
                out = m.kept
            else:
                loss, out = m(x)
                loss.backward()
            got[id(m)].append(out)
            o.update()
            m.l2.scale += 1
    replays = caches_of(ours)['forward'].replays
    if (PICK_IDS[PICKS.index(pick)], keep) in FALL_BACK:
        assert replays == 0
    else:
        assert replays >= 4
    for m in (dbr, ours):
        for out in got[id(m)]:
            assert numpy.shares_memory(out, pick(m))
    for a, b in zip(got[id(dbr)], got[id(ours)]):
        # (The chain's array itself where the method handed that, else a
        # view of its own, which the caller may reshape.)
        assert (a is pick(dbr)) == (b is pick(ours))
        assert (a.base is None) == (b.base is None)
    for step, (a, b) in enumerate(zip(got[id(dbr)], got[id(ours)])):
        assert numpy.array_equal(a, b), step


class ConstNet(chainer.Chain):
    """Keeps a constant it makes at every call (a causal mask) on itself,
    where the caller may write into it (a plot that marks the masked
    places)."""

    def __init__(self, view):
        super(ConstNet, self).__init__()
        self.view = view
        with self.init_scope():
            self.l = L.Linear(4, 3)

    def forward(self, x):
        mask = numpy.tri(3, dtype=numpy.float32)
        self.mask = self.view(mask)
        return F.sum(F.matmul(self.l(x), mask) ** 2)


class StaticConstNet(ConstNet):
    forward = static(ConstNet.forward)


@pytest.mark.parametrize('view', [lambda a: a, lambda a: a[:2]],
                         ids=['itself', 'a view'])
def test_a_kept_constant_written_by_the_caller(view):
    dbr, ours = ConstNet(view), StaticConstNet(view)
    ours.copyparams(dbr)
    opts = [chainer.optimizers.SGD(0.01).setup(m) for m in (dbr, ours)]
    for step in range(6):
        x = numpy.random.RandomState(step).randn(5, 4).astype('f')
        losses = []
        for m, o in zip((dbr, ours), opts):
            m.cleargrads()
            loss = m(x)
            loss.backward()
            o.update()
            losses.append(loss.array)
            m.mask[m.mask == 0] = -1e4
        assert numpy.array_equal(*losses), step
    assert caches_of(ours)['forward'].replays >= 3
    assert numpy.array_equal(dbr.l.W.array, ours.l.W.array)


class Settings(object):
    pass


class ForeignNet(chainer.Chain):
    """Keeps on itself an array a plain object holds (not a link), which
    the caller then scales in place: the array itself, as define-by-run
    keeps it (the key falls back: the table is no op's result)."""

    def __init__(self):
        super(ForeignNet, self).__init__()
        with self.init_scope():
            self.l = L.Linear(4, 3)
        self.cfg = Settings()
        self.cfg.table = numpy.linspace(0.5, 1.5, 3).astype('f')

    def forward(self, x):
        y = self.l(x) * self.cfg.table
        self.kept = self.cfg.table
        return F.sum(y ** 2)


class StaticForeignNet(ForeignNet):
    forward = static(ForeignNet.forward)


def test_an_array_of_a_helper_object_kept_where_the_key_falls_back():
    dbr, ours = ForeignNet(), StaticForeignNet()
    ours.copyparams(dbr)
    for step in range(4):
        x = numpy.random.RandomState(step).randn(5, 4).astype('f')
        losses = []
        for m in (dbr, ours):
            m.cleargrads()
            with warnings.catch_warnings():
                warnings.simplefilter('ignore')
                loss = m(x)
            loss.backward()
            losses.append(loss.array)
            assert m.kept is m.cfg.table
            m.kept *= 2
        assert numpy.array_equal(*losses), step
    # (The key the next call has, with the array kept, records once too:
    # an array kept may be a memo the next call reuses; it falls back.)
    cache = caches_of(ours)['forward']
    assert cache.recordings == 2 and cache.fallback_calls == 2


def _table(n):
    pe = numpy.zeros((n, 4), numpy.float32)
    pe[:, 0] = numpy.sin(numpy.arange(n))
    return pe


class _Memo(chainer.Chain):
    """A positional table made on the first call and kept (a lazy memo):
    the first call's key falls back (the table, made by NumPy item
    assignment, enters the graph), the next calls use the kept one."""

    def __init__(self):
        super(_Memo, self).__init__()
        self.pe = None
        with self.init_scope():
            self.l = L.Linear(4, 3)

    def forward(self, x):
        if self.pe is None:
            self.pe = _table(64)
        h = x + F.broadcast_to(self.pe[None, :x.shape[1]], x.shape)
        return F.sum(self.l(h, n_batch_axes=2))


def test_an_array_memo_filled_by_a_call_that_falls_back_replays_after():
    """The first call's fallback is not carried to the key the next call
    has (the memo set): that call records, and its key replays, as the
    other length's does (before, it ran define-by-run for good)."""
    Static = type('Static', (_Memo,), {'forward': static(_Memo.forward)})
    a, b = _Memo(), Static()
    b.copyparams(a)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        for s in range(10):
            x = numpy.full((2, 5 if s % 2 == 0 else 7, 4), 0.5 + s,
                           numpy.float32)
            for m in (a, b):
                m.cleargrads()
                loss = m(x)
                loss.backward()
            assert numpy.array_equal(a.l.W.grad, b.l.W.grad)
            assert numpy.array_equal(a.pe, b.pe)
    cache = caches_of(b)['forward']
    assert cache.replays >= 6
    assert cache.fallback_calls == 0


class _ArgumentMemo(chainer.Chain):
    def __init__(self):
        super(_ArgumentMemo, self).__init__()
        self.pe = None
        with self.init_scope():
            self.l1 = L.Linear(6, 6)
            self.l2 = L.Linear(6, 3)

    def forward(self, x, t):
        h = F.tanh(self.l1(x))
        if self.pe is None:
            self.pe = x
        return F.softmax_cross_entropy(self.l2(h + self.pe), t)


def test_an_array_argument_kept_by_the_recording_call_is_the_callers():
    """``self.pe = x`` at the first call, with a batch buffer the caller
    refills in place (review24): define-by-run keeps the caller's array,
    so later calls read each new batch through it; the recording call
    kept a copy of the first batch (loss 0.22 off from step 1)."""
    Static = type('Static', (_ArgumentMemo,),
                  {'forward': static(_ArgumentMemo.forward)})
    numpy.random.seed(0)
    a, b = _ArgumentMemo(), Static()
    b.copyparams(a)
    rs = numpy.random.RandomState(0)
    bufs = [numpy.zeros((4, 6), numpy.float32) for _ in (a, b)]
    for step in range(6):
        x = rs.randn(4, 6).astype(numpy.float32)
        t = rs.randint(0, 3, 4).astype(numpy.int32)
        losses = []
        for m, buf in zip((a, b), bufs):
            buf[...] = x
            loss = m(buf, t)
            m.cleargrads()
            loss.backward()
            losses.append(loss.array)
            assert m.pe is buf
        assert numpy.array_equal(*losses), step
    assert caches_of(b)['forward'].replays >= 3


_ARGUMENT_VIEWS = {
    'x': lambda x: x, 'x[0]': lambda x: x[0], 'x[::-1]': lambda x: x[::-1],
    'x.T': lambda x: x.T, 'x[:, ::-2]': lambda x: x[:, ::-2],
    'x[...]': lambda x: x[...], 'asarray': lambda x: numpy.asarray(x),
    'reshape': lambda x: x.reshape(-1), 'x[1:3, 2:]': lambda x: x[1:3, 2:],
    'view': lambda x: x.view(numpy.float32)}


def _memo_twins(keep, batches, step_input=lambda b: b, use=None):
    """Twins whose first call keeps ``keep(x)`` on ``self.ref``; each step
    refills the twin's own batch buffer (``batches``: one per twin) and
    calls with ``step_input(buffer)``. Returns the losses per step and
    the twins."""
    use = use or (lambda x, ref: x - ref)

    class Memo(chainer.Chain):
        def __init__(self):
            super(Memo, self).__init__()
            self.ref = None
            with self.init_scope():
                self.l = L.Linear(6, 3)

        def forward(self, x):
            if self.ref is None:
                self.ref = keep(x)
            return F.sum(self.l(use(x, self.ref)) ** 2)

    return _twin_steps(Memo, batches, step_input)


def _twin_steps(cls, batches, step_input=lambda b: b, steps=5,
                after=None):
    """``cls`` and its twin with ``forward`` decorated, the same
    parameters, trained ``steps`` steps; each step refills the twin's own
    batch buffer (``batches``: one per twin), calls with
    ``step_input(buffer)`` and backpropagates, then calls ``after(step,
    define-by-run's, the static twin)``. Returns the losses per step and
    the twins."""
    Static = type('Static', (cls,), {'forward': static(cls.forward)})
    a, b = cls(), Static()
    b.copyparams(a)
    losses = []
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        for s in range(steps):
            got = []
            for m, buf in zip((a, b), batches):
                buf[...] = numpy.random.RandomState(s).randn(*buf.shape)
                m.cleargrads()
                loss = m(step_input(buf))
                loss.backward()
                got.append(loss.array)
            losses.append(got)
            if after is not None:
                after(s, a, b)
    return losses, a, b



@pytest.mark.parametrize('order', ['C', 'F'])
@pytest.mark.parametrize('how', sorted(_ARGUMENT_VIEWS))
def test_a_memo_of_an_array_argument_or_its_view_is_the_callers_memory(
        how, order):
    """``if self.pe is None: self.pe = view(x)`` over a buffer the caller
    refills (review25): the memo is the caller's array, or the same view
    of it (``numpy.asarray(x)`` is ``x``), as define-by-run keeps it; it
    was a copy of the first batch (losses 1.05 for 1.56 from step 1)."""
    bufs = [numpy.zeros((4, 6), numpy.float32, order=order)
            for _ in range(2)]
    losses, a, b = _memo_twins(_ARGUMENT_VIEWS[how], bufs,
                               use=lambda x, ref: x + ref[..., :1].sum())
    assert all(numpy.array_equal(u, v) for u, v in losses)
    (pa, ba), (pb, bb) = (a.ref, bufs[0]), (b.ref, bufs[1])
    assert numpy.array_equal(pa, pb)
    assert (pa is ba) == (pb is bb)
    assert numpy.shares_memory(pa, ba) == numpy.shares_memory(pb, bb)
    assert (pa.shape, pa.strides, pa.dtype) == (pb.shape, pb.strides, pb.dtype)


def test_a_memo_of_a_variable_arguments_array_is_the_callers():
    """``self.pe = x.array`` of a Variable over a refilled buffer."""
    bufs = [numpy.zeros((4, 6), numpy.float32) for _ in range(2)]
    losses, a, b = _memo_twins(lambda x: x.array, bufs, chainer.Variable,
                               use=lambda x, ref: x * ref)
    assert all(numpy.array_equal(u, v) for u, v in losses)
    assert b.ref is bufs[1]
    assert caches_of(b)['forward'].replays >= 3


def test_a_copy_of_an_argument_whose_layout_the_recording_could_not_keep():
    """``numpy.ascontiguousarray(x)`` of a field of a packed structured
    batch (strides of 6 bytes): define-by-run copies; the recording's copy
    of ``x`` is contiguous, so that call gave back the argument itself,
    and review26 found the caller's buffer kept (loss 0.0 for 43.9)."""
    dt = numpy.dtype([('x', '<f4'), ('y', '<i2')])
    records = [numpy.zeros(24, dt).reshape(4, 6) for _ in range(2)]
    fields = [r['x'] for r in records]
    losses, a, b = _memo_twins(lambda x: numpy.ascontiguousarray(x), fields)
    assert all(numpy.array_equal(u, v) for u, v in losses)
    assert not numpy.shares_memory(b.ref, records[1])


def test_a_read_only_view_of_an_argument_stays_read_only():
    """``x.diagonal()`` is a read-only view under define-by-run; the view
    of the caller's memory built for it is read-only too (a write through
    it reached the caller's buffer, review26)."""
    bufs = [numpy.zeros((6, 6), numpy.float32) for _ in range(2)]
    losses, a, b = _memo_twins(lambda x: x.diagonal(), bufs,
                               use=lambda x, ref: x * ref)
    assert all(numpy.array_equal(u, v) for u, v in losses)
    assert numpy.shares_memory(b.ref, bufs[1])
    assert a.ref.flags.writeable == b.ref.flags.writeable is False


def test_a_plain_view_of_a_matrix_argument_is_a_plain_array():
    """``numpy.asarray(m)`` of an ``np.matrix`` argument is an ndarray
    under define-by-run; the caller's matrix kept made ``ref * ref`` a
    matrix product at later calls (review26)."""
    bufs = [numpy.asmatrix(numpy.zeros((6, 6), numpy.float32))
            for _ in range(2)]
    losses, a, b = _memo_twins(lambda x: numpy.asarray(x), bufs,
                               use=lambda x, ref: x * (ref * ref))
    assert all(numpy.array_equal(u, v) for u, v in losses)
    assert type(a.ref) is type(b.ref) is numpy.ndarray


def test_arguments_kept_in_a_list_are_the_callers_memory():
    """``self.ref = [x[0], x]`` (a list attribute: the key falls back): the
    list held traced views of the recording's copy, which the calls run
    define-by-run then read (losses 233 for 56, review26)."""
    bufs = [numpy.zeros((4, 6), numpy.float32) for _ in range(2)]
    losses, a, b = _memo_twins(lambda x: [x[0], x], bufs,
                               use=lambda x, ref: x - ref[0] + ref[1])
    assert all(numpy.array_equal(u, v) for u, v in losses)
    assert b.ref[1] is bufs[1] and type(b.ref[0]) is numpy.ndarray
    assert numpy.shares_memory(b.ref[0], bufs[1])


def test_numpy_require_copies_where_the_callers_flags_differ():
    """``numpy.require(x, requirements='W')`` of a read-only caller (a
    Variable's array) and ``requirements='A'`` of an unaligned one copy
    under define-by-run; the recording's copy is writable and aligned, so
    NumPy gave it back itself, and the caller's memory was kept (review27:
    loss 0.0 for 43.9)."""
    ro = [numpy.zeros((4, 6), numpy.float32) for _ in range(2)]

    def read_only(buf):
        v = buf.view()
        v.flags.writeable = False
        return chainer.Variable(v)

    losses, a, b = _memo_twins(
        lambda x: numpy.require(x.array, requirements='W'), ro, read_only)
    assert all(numpy.array_equal(u, v) for u, v in losses)
    assert not numpy.shares_memory(b.ref, ro[1])
    raw = [numpy.zeros(4 * 6 * 4 + 1, numpy.uint8) for _ in range(2)]
    unaligned = [numpy.frombuffer(r.data, numpy.float32, 24, 1).reshape(4, 6)
                 for r in raw]
    assert not unaligned[0].flags.aligned
    losses, a, b = _memo_twins(
        lambda x: numpy.require(x, requirements='A'), unaligned)
    assert all(numpy.array_equal(u, v) for u, v in losses)
    assert not numpy.shares_memory(b.ref, raw[1])


def test_a_view_with_out_of_order_fields_is_kept():
    """A kept view of a structured argument whose fields are out of order
    (``x[['b', 'a']]``): the view over the caller's memory is built as
    bytes and viewed as its dtype (``dtype.descr`` raised, review27)."""
    dt = numpy.dtype([('a', '<f4'), ('b', '<f4')])

    class Memo(chainer.Chain):
        def __init__(self):
            super(Memo, self).__init__()
            self.ref = None
            with self.init_scope():
                self.l = L.Linear(3, 2)

        def forward(self, x, rec):
            if self.ref is None:
                self.ref = rec[['b', 'a']]
            return F.sum(self.l(x) ** 2)

    Static = type('Static', (Memo,), {'forward': static(Memo.forward)})
    a, b = Memo(), Static()
    b.copyparams(a)
    recs = [numpy.zeros(4, dt) for _ in range(2)]
    for m, r in zip((a, b), recs):
        for s in range(3):
            r['a'] = s
            r['b'] = -s
            m(numpy.ones((4, 3), numpy.float32), r).backward()
    assert a.ref.dtype == b.ref.dtype
    assert numpy.array_equal(a.ref, b.ref)
    assert numpy.shares_memory(b.ref, recs[1])


@pytest.mark.parametrize('kind', ['ordered', 'named', 'deep', 'held dict',
                                  'held list', 'held deque', 'variable',
                                  'helper list'])
def test_arguments_in_containers_of_other_kinds(kind):
    """An OrderedDict, a namedtuple, a list three deep set as the memo, or
    a dict and a list the link held before the call and the call filled:
    each held a traced view of the recording's copy, which every later
    call read (review27: 0.0 for 43.9)."""
    import collections
    import types
    pair = collections.namedtuple('pair', 'ref n')
    make = {'ordered': lambda x: collections.OrderedDict(ref=x),
            'named': lambda x: pair(x, 1), 'deep': lambda x: [[[[x]]]],
            'variable': lambda x: [chainer.Variable(x)]}
    held = {'held dict': dict, 'held list': list,
            'held deque': collections.deque,
            'helper list': lambda: types.SimpleNamespace(items=[])}
    get = {'ordered': lambda c: c['ref'], 'named': lambda c: c.ref,
           'deep': lambda c: c[0][0][0][0], 'held dict': lambda c: c['ref'],
           'held list': lambda c: c[0], 'held deque': lambda c: c[0],
           'variable': lambda c: c[0].array,
           'helper list': lambda c: c.items[0]}[kind]

    class Memo(chainer.Chain):
        def __init__(self):
            super(Memo, self).__init__()
            self.ref = held[kind]() if kind in held else None
            with self.init_scope():
                self.l = L.Linear(6, 3)

        def forward(self, x):
            if kind == 'held dict' and not self.ref:
                self.ref['ref'] = x
            elif kind in ('held list', 'held deque') and not self.ref:
                self.ref.append(x)
            elif kind == 'helper list' and not self.ref.items:
                self.ref.items.append(x)
            elif kind in make and self.ref is None:
                self.ref = make[kind](x)
            return F.sum(self.l(x - get(self.ref)) ** 2)

    bufs = [numpy.zeros((4, 6), numpy.float32) for _ in range(2)]
    losses, a, b = _twin_steps(Memo, bufs, steps=4)
    assert all(numpy.array_equal(u, v) for u, v in losses)
    assert get(b.ref) is bufs[1]


@pytest.mark.parametrize('every_call', [True, False])
def test_a_list_of_more_items_than_compared_by_value(every_call):
    """A list of 100 items on the chain (watched by identity alone, too big
    to compare by value) to which the method appends ``h.array`` at every
    call replayed without appending (106 items for define-by-run's 101
    after six steps, review29). Its length is watched: that falls back;
    one appended to once (a memo) records again and keeps what
    define-by-run keeps."""
    class Log(chainer.Chain):
        def __init__(self):
            super(Log, self).__init__()
            self.hist = [numpy.zeros(1, numpy.float32)] * 100
            with self.init_scope():
                self.l = L.Linear(6, 3)

        def forward(self, x):
            h = self.l(x)
            if every_call or len(self.hist) == 100:
                self.hist.append(h.array)
            return F.sum((h - self.hist[-1]) ** 2)

    def same_history(step, a, b):
        assert len(a.hist) == len(b.hist), step
        assert numpy.array_equal(a.hist[-1], b.hist[-1]), step

    bufs = [numpy.zeros((4, 6), numpy.float32) for _ in range(2)]
    losses, a, b = _twin_steps(Log, bufs, steps=6, after=same_history)
    assert all(numpy.array_equal(u, v) for u, v in losses)
    assert caches_of(b)['forward'].replays == 0 or not every_call
