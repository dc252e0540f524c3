"""Never slower across copies: copies of a chain called a few times each.

A DQN's target network copied at every step (``copy.deepcopy``: a copy
starts without recordings) recorded each copy's first key, which its few
calls never repaid: 0.60x-0.66x define-by-run (slow32 hunt). The rule for
keys that do not repeat (cache.must_repeat) is per instance, so it never
applied.

Per class and decorated function, the caches of copies are noted as they
are made
(``starting``; a copy: its chain's __dict__ came with a cache holder of
another chain's, cache._holder, so a copy of a chain that has called a
decorated method, by copy, deepcopy or pickle). Once the last
``INSTANCES`` copies that recorded and were freed each recorded without
``REPLAYS_PER_RECORDING`` replays per recording, a new copy starts on
probation: a key records at its ``sightings``-th call only, twice the most
any of those copies waited (at least ``SIGHTINGS``, at most
``SIGHTINGS_MAX``), so copies that live for a few calls run define-by-run,
and copies that live long enough still record and replay. Copies alive (an
ensemble) are not counted, nor instances made anew (``Model()``: a model
per test or per run of a sweep records its first call, which export and
explain() expect); a copy of a chain that never called a decorated method
(a meta-learning loop copying a model only its copies call) is not known
as one: left.
"""
import collections
import threading
import weakref

INSTANCES = 4
LIVE_MAX = 64       # instances alive remembered per function (ensembles)

_lock = threading.Lock()
# the chain's class -> {decorated function: _History} (one function
# decorated on two classes, or a base class's method its subclasses use,
# keeps a history per class: review43)
_history = weakref.WeakKeyDictionary()


class _History(object):
    __slots__ = ('live', 'dead')

    def __init__(self):
        self.live = []      # (weakref to a Cache, its tally)
        self.dead = collections.deque(maxlen=INSTANCES)   # tallies


def counter(i):
    """A Cache's counter kept in its ``tally`` (recordings, replays), which
    outlives it here; counted as ``cache.tally[i] += 1``, as an attribute
    was (one increment of one object: a property's read and write would
    lose counts between threads)."""
    return property(lambda cache: cache.tally[i])


def _repaid(tally, per_recording):
    return tally[1] >= per_recording * tally[0]


def starting(cache, chain, method, sightings, sightings_max,
             per_recording):
    """``cache`` (a new copy's, of decorated function ``method``) starts on
    probation where the copies before it did not repay their recordings
    (module docstring). ``cache.tally``: [recordings, replays,
    the calls a new key waited for before it recorded]."""
    with _lock:
        per_class = _history.get(type(chain))
        if per_class is None:
            per_class = _history[type(chain)] = {}
        h = per_class.get(method)
        if h is None:
            h = per_class[method] = _History()
        live = []
        for ref, tally in h.live:
            if ref() is not None:
                live.append((ref, tally))
            elif tally[0]:
                h.dead.append(tally)
        if len(h.dead) == INSTANCES and \
                not any(_repaid(t, per_recording) for t in h.dead):
            waited = max(t[2] for t in h.dead)
            cache.sightings = min(max(2 * waited, sightings), sightings_max)
            cache.probation = (
                'its chains are copied anew and the copies\' recordings do '
                'not repay (the last %d copies that recorded, by '
                'copy.deepcopy or the like, each had fewer than %d replays '
                'per recording): a new key of a new copy runs define-by-run '
                'until it has been called %d times, and then records'
                % (INSTANCES, per_recording, cache.sightings))
        cache.tally[2] = cache.sightings if cache.probation else 1
        live.append((weakref.ref(cache), cache.tally))
        h.live = live[-LIVE_MAX:]
