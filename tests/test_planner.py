"""Tests for schedules.planner (no Chainer involved)."""
import random
import sys

import pytest
from hypothesis import given, settings, strategies as st

from schedules import ir
from schedules.planner import (
    Plan, check_plan, format_bytes, liveness, plan, plan_schedules)


def _live_lower_bound(sizes, lifetimes, pinned, alignment):
    """No valid plan can use less than the peak live memory."""
    a = lambda n: -(-n // alignment) * alignment
    steps = set(t for lt in lifetimes.values() for t in lt)
    pinned_total = sum(a(sizes[b]) for b in pinned)
    peak = 0
    for t in steps:
        peak = max(peak, sum(a(sizes[b]) for b in sizes if b not in pinned
                             and lifetimes[b][0] <= t <= lifetimes[b][1]))
    return peak + pinned_total


def _check_all(sizes, lifetimes, pinned, alignment):
    p = plan(sizes, lifetimes, pinned, alignment)
    assert isinstance(p, Plan)
    assert set(p.offsets) == set(sizes)
    assert check_plan(sizes, lifetimes, p.offsets, pinned) is True
    assert all(off % alignment == 0 for off in p.offsets.values())
    assert p.arena_bytes <= p.total_bytes
    assert p.arena_bytes >= _live_lower_bound(sizes, lifetimes, pinned,
                                              alignment)
    for b in sizes:
        assert p.offsets[b] + sizes[b] <= p.arena_bytes or sizes[b] == 0
    # deterministic, whatever the dict order
    keys = list(sizes)
    random.Random(len(keys)).shuffle(keys)
    q = plan(dict((k, sizes[k]) for k in keys),
             dict((k, lifetimes[k]) for k in reversed(keys)), pinned,
             alignment)
    assert q.offsets == p.offsets and q.arena_bytes == p.arena_bytes
    return p


def _break_plan(sizes, lifetimes, offsets):
    """Put two positive-size buffers live at one step at the same offset."""
    ids = [b for b in sorted(sizes) if sizes[b] > 0]
    for i, a in enumerate(ids):
        for b in ids[i + 1:]:
            if (lifetimes[a][0] <= lifetimes[b][1]
                    and lifetimes[b][0] <= lifetimes[a][1]):
                bad = dict(offsets)
                bad[b] = bad[a]
                return a, b, bad
    return None


# -- hand-made timelines ----------------------------------------------------

def test_chain_reuses_dead_buffer():
    # a -> b -> c: a dies when b is made, c can take a's place.
    sizes = {'a': 100, 'b': 100, 'c': 100}
    lifetimes = {'a': (0, 1), 'b': (1, 2), 'c': (2, 3)}
    p = _check_all(sizes, lifetimes, (), 64)
    assert p.offsets == {'a': 0, 'b': 128, 'c': 0}
    assert p.arena_bytes == 256
    assert p.total_bytes == 384


def test_disjoint_lifetimes_share_everything():
    sizes = dict((i, 1000) for i in range(5))
    lifetimes = dict((i, (i, i)) for i in range(5))
    p = _check_all(sizes, lifetimes, (), 8)
    assert set(p.offsets.values()) == {0}
    assert p.arena_bytes == 1000
    assert p.total_bytes == 5000


def test_all_live_together_no_sharing():
    sizes = {0: 64, 1: 128, 2: 192}
    lifetimes = dict((i, (0, 3)) for i in sizes)
    p = _check_all(sizes, lifetimes, (), 64)
    # largest first, packed upwards
    assert p.offsets == {2: 0, 1: 192, 0: 320}
    assert p.arena_bytes == p.total_bytes == 384


def test_best_fit_picks_smallest_gap():
    # Layout after the first four: x1 [0,256) short, l1 [256,512) long,
    # x2 [512,704) short, l2 [704,832) long. e (long) collides with l1, l2
    # only: gaps [0,256) and [512,704); best fit takes the smaller one.
    sizes = {0: 256, 1: 256, 2: 192, 3: 128, 4: 128}
    lifetimes = {0: (0, 0), 1: (0, 5), 2: (0, 0), 3: (0, 5), 4: (1, 5)}
    p = _check_all(sizes, lifetimes, (), 64)
    assert p.offsets == {0: 0, 1: 256, 2: 512, 3: 704, 4: 512}
    assert p.arena_bytes == 832


def test_pinned_never_shared():
    sizes = {'p': 100, 'a': 100, 'b': 100, 'q': 50}
    lifetimes = {'p': (0, 0), 'a': (1, 1), 'b': (2, 2), 'q': (3, 3)}
    p = _check_all(sizes, lifetimes, ('p', 'q'), 64)
    assert p.offsets['a'] == p.offsets['b']
    for pin in ('p', 'q'):
        lo = p.offsets[pin]
        for other in sizes:
            if other != pin:
                o = p.offsets[other]
                assert o + 128 <= lo or lo + 128 <= o
    assert p.arena_bytes == 128 + 128 + 64
    # without pinning everything fits in one slot
    assert plan(sizes, lifetimes).arena_bytes == 128


def test_alignment_respected():
    sizes = {0: 1, 1: 3, 2: 65, 3: 7}
    lifetimes = dict((i, (0, 1)) for i in sizes)
    for alignment in (1, 2, 16, 64, 4096):
        p = _check_all(sizes, lifetimes, (), alignment)
        a = lambda n: -(-n // alignment) * alignment
        assert p.total_bytes == sum(a(n) for n in sizes.values())
    assert plan(sizes, lifetimes, alignment=1).arena_bytes == 76
    assert plan(sizes, lifetimes, alignment=4096).arena_bytes == 4 * 4096


def test_zero_size_buffers():
    sizes = {'z': 0, 'a': 10, 'z2': 0}
    lifetimes = {'z': (0, 5), 'a': (0, 5), 'z2': (2, 3)}
    p = _check_all(sizes, lifetimes, ('z2',), 64)
    assert p.offsets['z'] == 0 and p.offsets['z2'] == 0
    assert p.arena_bytes == p.total_bytes == 64
    empty = plan({}, {})
    assert empty.offsets == {} and empty.arena_bytes == 0
    assert empty.total_bytes == 0
    assert empty.summary() == 'plan_memory: 0 buffers, 0 B -> 0 B (1.00x)'


def test_summary():
    mb = 1024 * 1024
    sizes = {0: 2 * mb, 1: 1 * mb, 2: 2 * mb}
    lifetimes = {0: (0, 1), 1: (1, 2), 2: (2, 3)}
    p = plan(sizes, lifetimes)
    assert p.arena_bytes == 3 * mb
    assert p.summary() == 'plan_memory: 3 buffers, 5.0 MB -> 3.0 MB (0.60x)'
    assert format_bytes(1536) == '1.5 KB'
    assert format_bytes(3 * 1024 * mb) == '3.0 GB'


@pytest.mark.parametrize('sizes,lifetimes,kwargs,match', [
    ({0: -1}, {0: (0, 0)}, {}, 'negative size'),
    ({0: 8}, {0: (3, 2)}, {}, 'first > last'),
    ({0: 8, 1: 8}, {0: (0, 0)}, {}, 'different keys'),
    ({0: 8}, {0: (0, 0), 1: (0, 0)}, {}, 'different keys'),
    ({0: 8}, {0: (0, 0)}, {'alignment': 0}, 'power of two'),
    ({0: 8}, {0: (0, 0)}, {'alignment': -64}, 'power of two'),
    ({0: 8}, {0: (0, 0)}, {'alignment': 48}, 'power of two'),
    ({0: 8}, {0: (0, 0)}, {'alignment': 64.0}, 'power of two'),
    ({0: 8}, {0: (0, 0)}, {'alignment': True}, 'power of two'),
    ({0: 8}, {0: (0, 0)}, {'pinned': (5,)}, 'pinned'),
])
def test_plan_rejects_bad_input(sizes, lifetimes, kwargs, match):
    with pytest.raises(ValueError, match=match):
        plan(sizes, lifetimes, **kwargs)


def test_check_plan_rejects_overlap_and_bad_input():
    sizes = {'a': 64, 'b': 64}
    lifetimes = {'a': (0, 1), 'b': (1, 2)}
    with pytest.raises(AssertionError, match="'a'.*'b'"):
        check_plan(sizes, lifetimes, {'a': 0, 'b': 32})
    assert check_plan(sizes, lifetimes, {'a': 0, 'b': 64})
    # not live together: may share, unless one is pinned
    lifetimes = {'a': (0, 0), 'b': (1, 2)}
    assert check_plan(sizes, lifetimes, {'a': 0, 'b': 0})
    with pytest.raises(AssertionError, match='pinned'):
        check_plan(sizes, lifetimes, {'a': 0, 'b': 0}, pinned=('b',))
    with pytest.raises(ValueError, match='no offset'):
        check_plan(sizes, lifetimes, {'a': 0})
    with pytest.raises(ValueError, match='negative offset'):
        check_plan(sizes, lifetimes, {'a': 0, 'b': -64})
    with pytest.raises(ValueError, match='first > last'):
        check_plan(sizes, {'a': (0, 0), 'b': (2, 1)}, {'a': 0, 'b': 64})
    # zero-size buffers occupy nothing
    assert check_plan({'a': 64, 'z': 0}, {'a': (0, 0), 'z': (0, 0)},
                      {'a': 0, 'z': 0}, pinned=('z',))


# -- randomized ---------------------------------------------------------------

@st.composite
def problems(draw):
    n = draw(st.integers(0, 20))
    sizes, lifetimes = {}, {}
    for b in range(n):
        sizes[b] = draw(st.one_of(st.just(0), st.integers(1, 5000)))
        first = draw(st.integers(0, 15))
        lifetimes[b] = (first, first + draw(st.integers(0, 8)))
    pinned = draw(st.sets(st.sampled_from(range(n)), max_size=3)
                  if n else st.just(set()))
    alignment = draw(st.sampled_from([1, 8, 64, 256]))
    return sizes, lifetimes, pinned, alignment


@settings(max_examples=200, deadline=None, database=None)
@given(problems())
def test_random_plans_hypothesis(problem):
    sizes, lifetimes, pinned, alignment = problem
    p = _check_all(sizes, lifetimes, pinned, alignment)
    broken = _break_plan(sizes, lifetimes, p.offsets)
    if broken is not None:
        a, b, bad = broken
        with pytest.raises(AssertionError):
            check_plan(sizes, lifetimes, bad, pinned)


def test_random_plans_seeded():
    rng = random.Random(1234)
    broken_checked = 0
    for trial in range(150):
        n = rng.randint(1, 60)
        steps = rng.randint(1, 40)
        ids = rng.sample(range(1000), n)
        sizes = dict((b, rng.choice([0, rng.randint(1, 64),
                                     rng.randint(1, 1 << 20)])) for b in ids)
        lifetimes = {}
        for b in ids:
            first = rng.randrange(steps)
            lifetimes[b] = (first, rng.randint(first, steps))
        pinned = set(rng.sample(ids, rng.randint(0, min(3, n))))
        alignment = rng.choice([1, 4, 64, 512])
        p = _check_all(sizes, lifetimes, pinned, alignment)
        broken = _break_plan(sizes, lifetimes, p.offsets)
        if broken is not None:
            a, b, bad = broken
            with pytest.raises(AssertionError) as info:
                check_plan(sizes, lifetimes, bad, pinned)
            # the plan was valid before, so every clash involves b
            assert ' %r [' % (b,) in str(info.value)
            broken_checked += 1
    assert broken_checked > 100


# -- schedules ----------------------------------------------------------------

def _schedules():
    """forward: x -> h1 -> h2 -> y (W a param); backward reads h1 and gy."""
    f32 = 'float32'
    bufs = {}
    for b, shape, role, name in [
            (0, (4, 8), ir.INPUT, 'x'), (1, (8, 8), ir.PARAM, 'W'),
            (2, (4, 8), ir.TEMP, 'h1'), (3, (4, 8), ir.TEMP, 'h2'),
            (4, (4, 8), ir.TEMP, 'y'), (5, (4, 8), ir.GRAD_OUT, 'gy'),
            (6, (4, 8), ir.TEMP, 'gh2'), (7, (4, 8), ir.TEMP, 'gh1'),
            (8, (4, 8), ir.TEMP, 'gx'), (9, (8, 8), ir.TEMP, 'gW')]:
        bufs[b] = ir.Buffer(b, shape, f32, role, name)
    fwd = ir.Schedule('forward', bufs, [
        ir.Op('Linear', (0, 1), (2,)),     # 0: h1 = x W
        ir.Op('ReLU', (2,), (3,)),         # 1: h2
        ir.Op('Tanh', (3,), (4,)),         # 2: y
    ], inputs=(0,), outputs=(4,))
    bwd = ir.Schedule('backward', bufs, [
        ir.Op('TanhGrad', (5,), (6,)),         # 3: gh2 = f(gy)
        ir.Op('ReLUGrad', (6, 2), (7,)),       # 4: gh1 = f(gh2, h1)
        ir.Op('LinearGrad', (7, 1), (8, 9)),   # 5: gx, gW
    ], inputs=(5,), outputs=(8, 9))
    assert fwd.verify() and bwd.verify(preset=(2,))
    return fwd, bwd, bufs


def test_liveness_forward_backward():
    fwd, bwd, bufs = _schedules()
    live = liveness([fwd, bwd])
    assert live == {
        0: (0, 0),   # x: input, read by op 0
        2: (0, 4),   # h1: saved, read by backward op 4
        3: (1, 2),
        4: (2, 2),   # y: output of forward
        5: (3, 3),   # gy: bound at backward's first op
        6: (3, 4),
        7: (4, 5),
        8: (5, 5),
        9: (5, 5),
    }                # W (param) is not planned
    kept = liveness([fwd, bwd], keep=(4, 0, 1))
    assert kept[4] == (2, 5) and kept[0] == (0, 5)
    assert 1 not in kept
    # forward alone: h1 dies at op 1; outputs live to the schedule's end
    assert liveness([fwd])[2] == (0, 1)
    # a buffer read before it is written is bound at its schedule's start
    assert liveness([bwd])[2] == (0, 1)


def test_liveness_edge_cases():
    bufs = {0: ir.Buffer(0, (2,), 'f4', ir.INPUT),
            1: ir.Buffer(1, (2,), 'f4', ir.TEMP),
            2: ir.Buffer(2, (2,), 'f4', ir.TEMP),
            3: ir.Buffer(3, (2,), 'f4', ir.TEMP),
            4: ir.Buffer(4, (2,), 'f4', ir.CONST)}
    bufs[3].view_of = 1
    s = ir.Schedule('s', bufs, [
        ir.Op('A', (0, 4), (1,)),   # 0
        ir.Op('View', (1,), (3,)),  # 1: %3 is a view of %1
        ir.Op('B', (0,), (2,)),     # 2: %2 never read
        ir.Op('C', (3,), ()),       # 3: reading the view keeps %1 alive
        ir.Op('D', (0,), ()),       # 4
    ], inputs=(0,), outputs=())
    assert liveness([s]) == {0: (0, 4), 1: (0, 3), 2: (2, 2)}
    empty = ir.Schedule('e', bufs, [], inputs=(0,), outputs=(0,))
    assert liveness([s, empty]) == {0: (0, 4), 1: (0, 3), 2: (2, 2)}
    assert liveness([]) == {}


def test_plan_schedules_sets_offsets_and_notes():
    fwd, bwd, bufs = _schedules()
    p = plan_schedules([fwd, bwd], keep=(4,), alignment=64)
    live = liveness([fwd, bwd], keep=(4,))
    assert set(p.offsets) == set(live)
    assert check_plan(p.sizes, live, p.offsets)
    for b, buf in bufs.items():
        assert buf.offset == p.offsets.get(b)   # None for the param W
    assert bufs[1].offset is None
    assert p.sizes[2] == 4 * 8 * 4 and p.sizes[9] == 8 * 8 * 4
    # the saved h1 is alive through backward: nothing live then sits on it
    h1 = (bufs[2].offset, bufs[2].offset + 128)
    for b in (3, 4, 5, 6, 7):
        o = bufs[b].offset
        assert o + 128 <= h1[0] or h1[1] <= o
    # reuse happened: x and h2 can share, so can plenty of others
    assert p.arena_bytes < p.total_bytes
    assert bwd.notes == [p.summary()] and fwd.notes == []
    assert p.summary().startswith('plan_memory: 9 buffers, ')
    assert '@%d' % bufs[6].offset in bwd.format()


def test_no_chainer_import():
    import schedules.planner
    src = open(schedules.planner.__file__).read()
    assert 'import chainer' not in src and 'from chainer' not in src
