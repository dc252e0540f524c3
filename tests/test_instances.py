"""Never slower across copies (static_graph/instances.py): copies of a
chain called a few times each, as ``copy.deepcopy`` makes a DQN's target
network at every step."""
import copy
import gc
import warnings

import numpy

import chainer
import chainer.functions as F
import chainer.links as L

from static_graph import StaticGraphWarning
from static_graph import static_graph
from static_graph.decorator import caches_of


class Q(chainer.Chain):
    def __init__(self):
        super(Q, self).__init__()
        with self.init_scope():
            self.l1 = L.Linear(4, 16)
            self.l2 = L.Linear(16, 2)

    def forward(self, x):
        return self.l2(F.relu(self.l1(x)))


def _static_q():
    """A decorated Q of a function of its own: what instances.py
    remembers is per decorated function, and each test starts afresh."""
    def forward(self, x):
        return Q.forward(self, x)
    return type('StaticQ', (Q,), {'forward': static_graph(forward)})


def _copies(calls_each, n_copies=12):
    """Each step a new copy of a decorated Q, called ``calls_each`` times
    under no_backprop_mode, as a target network; beside it the same for
    an undecorated Q. Returns (outputs equal, per copy (recordings,
    replays, define-by-run calls))."""
    numpy.random.seed(0)
    base = Q()
    ours = _static_q()()
    ours.copyparams(base)
    rs = numpy.random.RandomState(1)
    counts, equal = [], True
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', StaticGraphWarning)
        with chainer.no_backprop_mode():
            # (The online network: called, so its copies are known as
            # copies, instances.py.)
            x = rs.randn(8, 4).astype('f')
            equal &= numpy.array_equal(base(x).array, ours(x).array)
            for _ in range(n_copies):
                a, b = copy.deepcopy(base), copy.deepcopy(ours)
                for _ in range(calls_each):
                    x = rs.randn(8, 4).astype('f')
                    equal &= numpy.array_equal(a(x).array, b(x).array)
                c = caches_of(b)['forward']
                counts.append((c.recordings, c.replays, c.fallback_calls))
                del a, b, c
                # (A chain with recordings is in reference cycles: its
                # entries hold its links. The collector frees it; only then
                # is it counted.)
                gc.collect()
    return equal, counts


def test_copies_called_once_run_define_by_run():
    """A copy per step called once: each recorded its first call, which
    it never repaid (slow32 hunt: 0.6x define-by-run). After four such
    copies, a new copy's key runs define-by-run until its third call,
    which none reaches."""
    equal, counts = _copies(1)
    assert equal
    assert counts[:4] == [(1, 0, 0)] * 4
    assert counts[4:] == [(0, 0, 1)] * 8


def test_copies_that_live_long_enough_still_replay():
    """Copies called 10 times each (or 5: a recording and 4 replays) repay
    their recordings: every copy records once and replays the rest."""
    for n in (10, 5):
        equal, counts = _copies(n)
        assert equal
        assert counts == [(1, n - 1, 0)] * 12


def test_copies_called_a_few_times_wait_longer():
    """Copies called 3 times each (a recording and 2 replays: not repaid).
    After four, a new copy records at its third call; that one did not
    repay either, so the next ones wait twice as long and run
    define-by-run."""
    equal, counts = _copies(3)
    assert equal
    assert counts == [(1, 2, 0)] * 4 + [(1, 0, 2)] + [(0, 0, 3)] * 7


def test_fresh_instances_and_copies_alive_are_not_counted():
    """Instances made anew (a model per test, per run of a sweep) record
    their first call, however many died young before; so do copies kept
    alive (an ensemble)."""
    numpy.random.seed(0)
    cls = _static_q()
    x = numpy.ones((3, 4), 'f')
    with chainer.no_backprop_mode():
        for _ in range(8):
            m = cls()
            m(x)
            assert caches_of(m)['forward'].recordings == 1
            del m
            gc.collect()
        first = cls()
        first(x)
    members = [copy.deepcopy(first) for _ in range(8)]
    with chainer.no_backprop_mode():
        for _ in range(3):
            for m in members:
                m(x)
    assert [caches_of(m)['forward'].replays for m in members] == [2] * 8
