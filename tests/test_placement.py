"""Placement (schedules/placement.py): a compiled replay writes results into
the memory of buffers that died before them, and then allocates nothing for
those results. The first half runs schedules alone (no chainer); the second
trains chains and watches a steady replay's allocations with tracemalloc."""
import gc
import tracemalloc

import numpy
import pytest

from schedules import executor
from schedules import ir
from schedules import placement
from schedules import planner


# -- schedules alone ------------------------------------------------------

class Kernels(object):
    """Kernels that note the address of every array they return, and an
    ``into`` kernel that notes the memory it is given."""

    def __init__(self):
        self.made = {}      # name -> data address of the result

    def fresh(self, name, workspace=0):
        def fn(a):
            r = a[0] + 1
            self.made[name] = r.__array_interface__['data'][0]
            return r,
        fn.workspace = workspace
        return fn

    def into(self, name, workspace=0):
        fn = self.fresh(name, workspace)

        def into(a, outs):
            if outs[0] is None:
                return fn(a)
            numpy.add(a[0], 1, out=outs[0])
            self.made[name] = outs[0].__array_interface__['data'][0]
            return outs[0],
        fn.into = into
        return fn


@pytest.fixture
def small_too(monkeypatch):
    """The schedules below are of small arrays: let placement take them."""
    monkeypatch.setattr(placement, 'MIN_BYTES', 0)


def _schedule(specs, ops, inputs, outputs, keep=()):
    """specs: {id: (role, shape)}; ops: (kind, fn, inputs, outputs)."""
    bufs = dict((b, ir.Buffer(b, shape, 'f4', role))
                for b, (role, shape) in specs.items())
    return ir.Schedule('s', bufs, [ir.Op(k, i, o, fn=fn)
                                   for k, fn, i, o in ops],
                       inputs, outputs, keep=keep)


def _chain(k, into_last=True, last_shape=(4, 8), host_shape=(4, 8),
           workspace=0):
    """x -> a -> h (dies at op 2) -> y; z = last(y): z may go where h was.
    Returns the schedule (its facts: every buffer its own memory)."""
    specs = {0: (ir.INPUT, (4, 8)), 1: (ir.TEMP, host_shape),
             2: (ir.TEMP, host_shape), 3: (ir.TEMP, (4, 8)),
             4: (ir.TEMP, last_shape), 5: (ir.TEMP, last_shape)}
    last = k.into('z', workspace) if into_last else k.fresh('z', workspace)
    s = _schedule(specs, [
        ('A', k.fresh('a'), (0,), (1,)),
        ('H', lambda a: (numpy.ones(host_shape, 'f4'),), (1,), (2,)),
        ('Y', k.fresh('y'), (0, 2), (3,)),
        ('Z', last, (3,), (4,)),
        ('W', k.fresh('w'), (4,), (5,))],
        (0,), (5,))
    s.ops[1].fn.workspace = 0
    s.memory = placement.Facts([], ())
    return s


def test_result_goes_where_a_dead_buffer_was(small_too):
    k = Kernels()
    s = _chain(k)
    p = placement.plan(s, s.memory, explain=True)
    assert p.places == {4: (2, 0)}           # z in %2's memory
    assert planner.check_plan(*p.check)
    assert p.reasons == {1: 'no out= (fn)', 2: 'no out= (H.forward)',
                         3: 'no out= (fn)', 5: 'escapes'}
    run = executor.compile_schedule(s, numpy.copyto)
    host = []
    s.ops[1].fn = lambda a: (host.append(numpy.ones((4, 8), 'f4')) or
                             (host[-1],))
    s.ops[1].fn.workspace = 0
    run = executor.compile_schedule(s, numpy.copyto)
    assert 'take(H2, 0, (4, 8)' in run.source
    x = numpy.arange(32, dtype='f4').reshape(4, 8)
    (out,) = run([x])
    numpy.testing.assert_array_equal(out, x + 3)
    assert k.made['z'] == host[-1].__array_interface__['data'][0]
    # The printout says where each result went, and why others did not.
    text = s.format()
    assert '%4 in dead %2+0' in text
    assert '%2 allocated: no out= (H.forward)' in text
    assert 'place: 1 result (128 B) in dead memory, 4 allocated' in text
    assert 'kernels with no out=: H.forward x1, fn x2' in text


def test_nothing_placed_without_into_facts_or_when_switched_off(small_too):
    k = Kernels()
    s = _chain(k, into_last=False)
    assert placement.plan(s, s.memory).places == {}
    s = _chain(k)
    assert placement.plan(s, None).places == {}
    assert executor.compile_schedule(s, numpy.copyto, free=False) \
        .source.count('take(') == 0       # plan_memory=False
    old = placement.ENABLED
    placement.ENABLED = False
    try:
        assert placement.plan(s, s.memory).places == {}
    finally:
        placement.ENABLED = old


def test_plans_skipped_by_the_cheap_check_place_nothing(monkeypatch):
    """plan() returns at once where no result could be placed
    (placement._may_place): only where the full plan places nothing."""
    k = Kernels()
    s = _chain(k)      # z, the one result with into: 128 bytes
    for min_bytes in (0, 128, 129, 1 << 16):
        monkeypatch.setattr(placement, 'MIN_BYTES', min_bytes)
        full = placement.plan(s, s.memory, explain=True).places
        assert placement.plan(s, s.memory).places == full
        assert bool(full) == (min_bytes <= 128)


@pytest.mark.parametrize('how', ['read later', 'kept', 'input', 'static',
                                 'alias read later', 'shared memory kept'])
def test_memory_still_seen_is_never_taken(how, small_too):
    k = Kernels()
    s = _chain(k)
    bufs = s.buffers
    why = None
    if how == 'read later':       # %2 read again after z is made
        s.ops[4].inputs = (4, 2)
    elif how == 'kept':           # %2 saved for another schedule
        s.keep = (2,)
    elif how == 'input':          # the caller's array
        bufs[2].role = ir.INPUT
        why = 'input'
    elif how == 'static':
        bufs[2].static = True
    elif how == 'alias read later':
        # Y's kernel returns %2's memory as %3 (it writes into it): that
        # memory lives on as %3, which Z reads.
        s.ops[2].fn.aliases = (1,)
        s.ops[2].inputs = (0, 2)
    elif how == 'shared memory kept':
        # %6 (a buffer of another schedule, handed out) was a view of %2.
        bufs[6] = ir.Buffer(6, (4, 8), 'f4', ir.TEMP)
        s.memory = placement.Facts([((2, 6), 128, True)], keep=(6,))
    p = placement.plan(s, s.memory, explain=True)
    # (it may go where %1 was: nobody sees that memory any more)
    assert p.places.get(4, (None,))[0] != 2, how
    if why:
        assert p.reasons.get(2, why) == why


def test_rules_hold_memory_only_where_they_may(small_too):
    """A host larger than the result holds memory the schedule would have
    let go: ``strict`` never does, ``workspace`` where the kernels running
    meanwhile say how much they allocate themselves (not where one does
    not), up to the schedule's peak."""
    k = Kernels()
    s = _chain(k, last_shape=(4, 4))      # z is half of h
    assert placement.plan(s, s.memory, rule='strict').places == {}
    assert placement.plan(s, s.memory, rule='workspace').places == \
        {4: (2, 0)}
    s.ops[4].fn.workspace = None          # W runs while z lives: unknown
    assert placement.plan(s, s.memory, rule='workspace').places == {}
    assert placement.plan(s, s.memory, rule='peak').places == {4: (2, 0)}
    # a workspace that would make a new peak while the host is held
    s.ops[4].fn.workspace = 4096
    s.ops[3].fn.workspace = 0
    assert placement.plan(s, s.memory, rule='workspace').places == {}
    with pytest.raises(ValueError, match='rule must be one of'):
        placement.plan(s, s.memory, rule='loose')


def test_take_checks_the_memory_it_is_given(small_too):
    a = numpy.zeros(64, 'f4')
    v = placement.take(a, 64, (4, 8), numpy.dtype('f4'), 128)
    assert v.shape == (4, 8) and numpy.shares_memory(v, a)
    assert v.__array_interface__['data'][0] == \
        a.__array_interface__['data'][0] + 64
    assert placement.take(a, 200, (4, 8), numpy.dtype('f4'), 128) is None
    assert placement.take(a[:32], 0, (4, 8), numpy.dtype('f4'), 128) \
        is None                       # a window: the rest is someone's
    t = numpy.zeros((8, 8), 'f4').T
    assert placement.take(t, 0, (4, 8), numpy.dtype('f4'), 128) is not None
    assert placement.take(numpy.zeros((8, 16), 'f4')[:, ::2], 0, (4, 8),
                          numpy.dtype('f4'), 128) is None
    # memory of its own in NHWC order, seen as NCHW (a convolution's)
    nhwc = numpy.zeros((2, 4, 4, 2), 'f4').transpose(0, 3, 1, 2).copy('K')
    assert nhwc.base is None and not nhwc.flags.c_contiguous
    v = placement.take(nhwc, 64, (4, 8), numpy.dtype('f4'), 128)
    v[...] = 1
    assert nhwc.sum() == 32 and v.flags.c_contiguous
    assert placement.one_block(nhwc.shape, nhwc.strides, 4)
    assert not placement.one_block((4, 8), (64, 4), 4)
    ro = numpy.zeros(64, 'f4')
    ro.flags.writeable = False
    assert placement.take(ro, 0, (4, 8), numpy.dtype('f4'), 128) is None
    assert placement.take([0.0] * 64, 0, (4, 8), numpy.dtype('f4'), 128) \
        is None


def test_check_plan_catches_a_broken_placement(small_too):
    k = Kernels()
    s = _chain(k)
    p = placement.plan(s, s.memory, explain=True)
    sizes, lifetimes, offsets = p.check
    bad = dict(lifetimes)
    bad[('placed', 4)] = (2, 4)       # alive while its host still is
    with pytest.raises(AssertionError, match='overlap in memory'):
        planner.check_plan(sizes, bad, offsets)


# -- chains ---------------------------------------------------------------

chainer = pytest.importorskip('chainer')
import chainer.functions as F  # NOQA
import chainer.links as L  # NOQA

import static_graph  # NOQA
from tests.twins import train_twins  # NOQA


class MLP(chainer.Chain):
    def __init__(self):
        super(MLP, self).__init__()
        with self.init_scope():
            self.l1 = L.Linear(64, 256)
            self.l2 = L.Linear(256, 256)
            self.l3 = L.Linear(256, 10)

    def forward(self, x, t):
        h = F.relu(self.l1(x))
        h = F.relu(self.l2(h))
        return F.softmax_cross_entropy(self.l3(h), t)


class Bottleneck(chainer.Chain):
    def __init__(self, cin, mid, cout, stride=1):
        super(Bottleneck, self).__init__()
        with self.init_scope():
            self.c1 = L.Convolution2D(cin, mid, 1, stride, 0, nobias=True)
            self.b1 = L.BatchNormalization(mid)
            self.c2 = L.Convolution2D(mid, mid, 3, 1, 1, nobias=True)
            self.b2 = L.BatchNormalization(mid)
            self.c3 = L.Convolution2D(mid, cout, 1, 1, 0, nobias=True)
            self.b3 = L.BatchNormalization(cout)
            self.c4 = L.Convolution2D(cin, cout, 1, stride, 0, nobias=True)
            self.b4 = L.BatchNormalization(cout)

    def forward(self, x):
        h = F.relu(self.b1(self.c1(x)))
        h = F.relu(self.b2(self.c2(h)))
        return F.relu(self.b3(self.c3(h)) + self.b4(self.c4(x)))


class ResNetLike(chainer.Chain):
    """A 3x3 stem and two bottleneck blocks, as a small ResNet."""

    def __init__(self):
        super(ResNetLike, self).__init__()
        with self.init_scope():
            self.conv = L.Convolution2D(3, 16, 3, 1, 1, nobias=True)
            self.bn = L.BatchNormalization(16)
            self.r1 = Bottleneck(16, 8, 32)
            self.r2 = Bottleneck(32, 16, 64, 2)
            self.fc = L.Linear(64, 10)

    def forward(self, x, t):
        h = F.relu(self.bn(self.conv(x)))
        h = self.r2(self.r1(h))
        return F.softmax_cross_entropy(self.fc(F.average(h, axis=(2, 3))),
                                       t)


def _make(cls):
    def make(static):
        if not static:
            return cls()
        return type('Static' + cls.__name__, (cls,), {
            'forward': static_graph.static_graph(cls.forward)})()
    return make


def _batches(case, n):
    rs = numpy.random.RandomState(0)
    if case is MLP:
        return [(rs.standard_normal((32, 64)).astype('f'),
                 rs.randint(0, 10, 32).astype('i')) for _ in range(n)]
    return [(rs.standard_normal((8, 3, 16, 16)).astype('f'),
             rs.randint(0, 10, 8).astype('i')) for _ in range(n)]


def _placed(model):
    """{(schedule name, op index): bytes of its results placed in dead
    memory}."""
    (s,) = static_graph.cached(model)
    out = {}
    for sched in (s.entry.forward, s.entry.backward):
        for i, op in enumerate(sched.ops):
            mine = [b for b in op.outputs if b in sched.placement.places]
            if mine:
                out[sched.name, i] = sum(sched.buffers[b].nbytes
                                         for b in mine)
    return out


def _steady_growth(model, batch, ops):
    """{(schedule name, op index): bytes its kernel left allocated} over
    one training iteration, for the ops ``ops`` names."""
    (s,) = static_graph.cached(model)
    e = s.entry
    growth = {}
    for sched, runner in ((e.forward, e.run_forward),
                          (e.backward, e.run_backward)):
        env = getattr(runner, 'tiered', runner).compiled.run.__globals__
        for name, i in ops:
            if name != sched.name:
                continue
            for f in ('f%d' % i, 'g%d' % i):    # (g: with ``into``)
                fn = env.get(f)
                if fn is None:
                    continue

                def watched(*a, fn=fn, key=(name, i)):
                    before = tracemalloc.get_traced_memory()[0]
                    r = fn(*a)
                    growth[key] = tracemalloc.get_traced_memory()[0] - \
                        before
                    return r
                env[f] = watched
    gc.collect()
    tracemalloc.start()
    try:
        model.cleargrads()
        model(*batch).backward()
    finally:
        tracemalloc.stop()
    return growth


@pytest.mark.parametrize('case, least, forward', [
    (MLP, 1, False),          # its forward saves every result
    (ResNetLike, 8, True)])   # BatchNormalization outputs recomputed later
def test_steady_replay_allocates_nothing_for_placed_results(
        case, least, forward, small_too):
    """After the replay compiled, every op whose results the plan put in
    dead memory leaves nothing allocated for them (tracemalloc around each
    kernel; NumPy registers its data with it), and training stays define-
    by-run's bit for bit. The same ops with placement switched off do
    allocate their results: the measurement sees it."""
    batches = _batches(case, 6)
    steps = [lambda m, b=b: m(*b) for b in batches[:5]]
    _, m = train_twins(_make(case), steps,
                       lambda: chainer.optimizers.MomentumSGD(0.1),
                       rtol=0, atol=0)
    placed = _placed(m)
    assert len(placed) >= least, placed
    assert any(name == 'forward' for name, _ in placed) == forward
    growth = _steady_growth(m, batches[5], placed)
    assert set(growth) == set(placed)
    for key, n in growth.items():
        # (a BatchNormalization also returns its small statistics)
        assert n < placed[key] // 2, (key, n, placed[key])
    # The same ops, placement off: each allocates at least those results.
    old = placement.ENABLED
    placement.ENABLED = False
    try:
        _, m = train_twins(_make(case), steps,
                           lambda: chainer.optimizers.MomentumSGD(0.1),
                           rtol=0, atol=0)
        assert _placed(m) == {}
        growth = _steady_growth(m, batches[5], placed)
    finally:
        placement.ENABLED = old
    assert set(growth) == set(placed)
    for key, n in growth.items():
        assert n >= placed[key], (key, n, placed[key])


def test_small_results_are_allocated():
    """Results under placement.MIN_BYTES (64 KiB) are not placed: NumPy
    allocates them faster than the compiled code could place them; the
    printout says why."""
    batches = _batches(MLP, 4)
    steps = [lambda m, b=b: m(*b) for b in batches]
    _, m = train_twins(_make(MLP), steps,
                       lambda: chainer.optimizers.MomentumSGD(0.1),
                       rtol=0, atol=0)
    assert _placed(m) == {}
    (s,) = static_graph.cached(m)
    assert 'small (allocating is cheaper)' in str(s.entry.backward)


def test_into_is_checked_at_its_first_call():
    """A lowered kernel's ``into`` is checked when placement first uses it
    (not on the first replay, where it cost a third run of each large op):
    results equal to the kernel's, in the memory given, keep it; otherwise
    that call and every later one hand out the kernel's own results."""
    import numpy
    from static_graph import kernel_checks

    def make(bad):
        def kernel(a):
            return (a[0] * 2,)

        def into(a, o):
            numpy.multiply(a[0], 3 if bad else 2, out=o[0])
            return (o[0],)
        kernel.into = into
        return kernel

    x = numpy.arange(6, dtype='f').reshape(2, 3)
    for bad in (False, True):
        k = make(bad)
        assert kernel_checks.same_results(k, (x,), (x * 2,))
        for _ in range(2):
            out = numpy.empty_like(x)
            got, = k.into((x,), (out,))
            assert numpy.array_equal(got, x * 2)
            assert numpy.shares_memory(got, out) == (not bad)
