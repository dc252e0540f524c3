"""Recording, replaying and dropping a static chain leave no reference
cycles behind.

Define-by-run frees a training iteration's graph by reference counting
alone. Anything of ours that refers to itself (a recursive closure, a
compiled function kept in its own globals, a bound method kept on its own
object) would leave garbage that only the cyclic collector frees: work on
every call, and a whole entry's kernels and buffers kept alive until the
collector happens to run.
"""
import gc

import numpy
import pytest

import chainer
import chainer.functions as F
import chainer.links as L

import static_graph
from static_graph.gc_pause import gc_paused
from static_graph.decorator import caches_of


class Net(chainer.Chain):
    def __init__(self):
        super(Net, self).__init__()
        with self.init_scope():
            self.l1 = L.Linear(6, 5)
            self.bn = L.BatchNormalization(5)
            self.l2 = L.Linear(5, 3)

    def forward(self, batch, extra):
        x, t = batch
        h = F.dropout(F.relu(self.bn(self.l1(x))), 0.3)
        y = self.l2(h * extra['scale'])
        loss = F.softmax_cross_entropy(y, t)
        return {'loss': loss, 'out': (y, [h])}


class StaticNet(Net):
    forward = static_graph.static_graph(Net.forward)


def _step(model, opt, rs, batch_size=4):
    x = rs.standard_normal((batch_size, 6)).astype(numpy.float32)
    t = rs.randint(0, 3, batch_size).astype(numpy.int32)
    scale = rs.standard_normal((batch_size, 5)).astype(numpy.float32)
    model.cleargrads()
    out = model((x, t), {'scale': scale})
    out['loss'].backward()
    opt.update()
    return float(out['loss'].array)


@pytest.fixture
def collector_off():
    """Only the gc.collect() calls of the test collect: their counts say
    what reference counting left behind. (The process's C worker, which a
    first build starts, loads its library through ctypes, whose types are
    cycles: started first, where the test runs in a process of its own.)"""
    from schedules import stream
    stream.available()
    gc.collect()
    with gc_paused():
        yield


@pytest.mark.parametrize('cls', [Net, StaticNet])
def test_no_cyclic_garbage_from_recording_replay_or_dropping(
        cls, collector_off):
    rs = numpy.random.RandomState(0)
    model = cls()
    opt = chainer.optimizers.MomentumSGD(0.1)
    opt.setup(model)
    _step(model, opt, rs)                    # records
    assert gc.collect() == 0, 'recording'
    for _ in range(4):                       # interpreted, then compiled
        _step(model, opt, rs)
        assert gc.collect() == 0, 'replay'
    _step(model, opt, rs, batch_size=3)      # a second key
    assert gc.collect() == 0, 'second key'
    for _ in range(4):                       # evaluation: a forward-only key
        with chainer.using_config('train', False), \
                chainer.no_backprop_mode():
            x = rs.standard_normal((4, 6)).astype(numpy.float32)
            t = rs.randint(0, 3, 4).astype(numpy.int32)
            model((x, t), {'scale': numpy.ones((4, 5), numpy.float32)})
        assert gc.collect() == 0, 'evaluation'
    if cls is StaticNet:
        entries = [e for c in caches_of(model).values()
                   for e in c.entries.values()]
        assert len(entries) == 3
        assert all(e.state == 'complete' for e in entries)
        assert all(e.run_forward.compiled is not None
                   for e in entries[:1])
        for c in caches_of(model).values():   # dropping one key
            c.entries.clear()
        del entries
        assert gc.collect() == 0, 'dropped entries'
        _step(model, opt, rs)                 # records again
        assert gc.collect() == 0, 'recording again'


def test_the_programs_young_garbage_stays_young_through_a_recording():
    """A reference cycle the program dropped before a recording is freed
    by the next young collection. (A recording handed everything young to
    the oldest generation, uncounted towards a full collection: a loop that
    records often piled up its cycles, 40 KB an iteration.)"""
    import weakref

    class Cycle(object):
        pass

    rs = numpy.random.RandomState(0)
    model = StaticNet()
    opt = chainer.optimizers.SGD(0.1)
    opt.setup(model)
    gc.collect()
    thresholds = gc.get_threshold()
    gc.set_threshold(10 ** 8)     # no collection of its own in between
    try:
        c = Cycle()
        c.me = c
        gone = weakref.ref(c)
        del c
        _step(model, opt, rs)     # records
        assert gone() is not None
        gc.collect(1)             # the young generations only
        assert gone() is None
    finally:
        gc.set_threshold(*thresholds)


def test_objects_the_program_froze_stay_frozen():
    """A program that froze its objects (before forking workers) keeps
    them frozen through a recording."""
    rs = numpy.random.RandomState(0)
    model = StaticNet()
    opt = chainer.optimizers.SGD(0.1)
    opt.setup(model)
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        assert frozen > 0
        _step(model, opt, rs)
        # (frozen objects may still be freed by reference counting)
        assert gc.get_freeze_count() > 0.9 * frozen
    finally:
        gc.unfreeze()


def test_a_chain_let_go_is_freed_with_its_caches():
    """A recorded chain dropped by the program goes (with its parameters
    and schedules) once the collector runs: its caches live on it, not in
    a table keyed by it (which its entries, holding its links, kept
    alive). Copies start with no caches and record their own."""
    import copy
    import pickle
    import weakref
    rs = numpy.random.RandomState(0)
    model = StaticNet()
    opt = chainer.optimizers.MomentumSGD(0.1)
    opt.setup(model)
    for _ in range(3):
        _step(model, opt, rs)
    assert caches_of(model)['forward'].replays == 2
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model)),
                 copy.copy(model)):
        assert caches_of(twin) == {}
    twin = copy.deepcopy(model)
    twin_opt = chainer.optimizers.MomentumSGD(0.1)
    twin_opt.setup(twin)
    for _ in range(2):
        _step(twin, twin_opt, rs)
    assert caches_of(twin)['forward'].recordings == 1
    assert caches_of(model)['forward'].recordings == 1
    chain, link = weakref.ref(model), weakref.ref(model.l1)
    del model, opt
    gc.collect()
    assert chain() is None and link() is None


def test_the_first_copy_of_a_chain_records_nothing_again():
    """``copy`` and ``pickle`` leave ``__slotnames__`` on a class at its
    first copy: no change the watch of the class's attributes counts (the
    original's keys recorded once more, persist30 hunt)."""
    import copy
    cls = type('FreshNet', (Net,), {
        'forward': static_graph.static_graph(Net.forward)})
    rs = numpy.random.RandomState(0)
    model = cls()
    opt = chainer.optimizers.SGD(0.1)
    opt.setup(model)
    for i in range(4):
        if i == 2:
            assert '__slotnames__' not in cls.__dict__
            copy.deepcopy(model)
            assert '__slotnames__' in cls.__dict__
        _step(model, opt, rs)
    c = caches_of(model)['forward']
    assert (c.recordings, c.replays) == (1, 3)
