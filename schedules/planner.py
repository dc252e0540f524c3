"""Static memory planning: give every temporary buffer an offset in one arena.

Pure functions over plain dicts; nothing here knows about Chainer.

* ``liveness(schedules, keep)`` (``liveness.lifetimes``) numbers the ops of
  schedules that run one after the other and returns each buffer's (first,
  last) live step.
* ``plan(sizes, lifetimes, pinned, alignment)`` packs the buffers greedily:
  largest first, each at the best-fitting gap that does not collide with an
  already placed buffer whose lifetime overlaps.
* ``check_plan(...)`` is the independent no-overlap checker.
* ``plan_schedules(...)`` glues the three together for ``Schedule`` objects.
"""
import operator

from schedules import liveness as _liveness

# Roles whose arrays live outside the arena: never planned.
UNPLANNED_ROLES = _liveness.LIVE_ROLES


class Plan(object):
    """Result of ``plan``: ``offsets`` (id -> byte offset), ``arena_bytes``
    (arena size) and ``total_bytes`` (sum of aligned sizes, i.e. the memory
    needed without any reuse)."""

    __slots__ = ('offsets', 'arena_bytes', 'total_bytes', 'sizes',
                 'lifetimes', 'pinned', 'alignment')

    def __init__(self, offsets, arena_bytes, total_bytes, sizes, lifetimes,
                 pinned, alignment):
        self.offsets = offsets
        self.arena_bytes = arena_bytes
        self.total_bytes = total_bytes
        self.sizes = sizes
        self.lifetimes = lifetimes
        self.pinned = pinned
        self.alignment = alignment

    def summary(self):
        ratio = (float(self.arena_bytes) / self.total_bytes
                 if self.total_bytes else 1.0)
        return 'plan_memory: %d buffers, %s -> %s (%.2fx)' % (
            len(self.offsets), format_bytes(self.total_bytes),
            format_bytes(self.arena_bytes), ratio)

    def __repr__(self):
        return '<Plan %s>' % self.summary()


def format_bytes(n):
    if n < 1024:
        return '%d B' % n
    for unit in ('KB', 'MB', 'GB'):
        n /= 1024.0
        if n < 1024 or unit == 'GB':
            return '%.1f %s' % (n, unit)


def _align(n, alignment):
    return -(-n // alignment) * alignment


def _validate(sizes, lifetimes, pinned):
    if set(sizes) != set(lifetimes):
        raise ValueError(
            'sizes and lifetimes have different keys: only in sizes %r, '
            'only in lifetimes %r' % (sorted(set(sizes) - set(lifetimes)),
                                      sorted(set(lifetimes) - set(sizes))))
    clean_sizes, clean_lifetimes = {}, {}
    for b, n in sizes.items():
        n = operator.index(n)
        if n < 0:
            raise ValueError('buffer %r has negative size %d' % (b, n))
        clean_sizes[b] = n
    for b, lt in lifetimes.items():
        first, last = (operator.index(t) for t in lt)
        if first > last:
            raise ValueError('buffer %r has lifetime (%d, %d) with first > '
                             'last' % (b, first, last))
        clean_lifetimes[b] = (first, last)
    pinned = frozenset(pinned)
    unknown = pinned - set(sizes)
    if unknown:
        raise ValueError('pinned buffers %r have no size' % sorted(unknown))
    return clean_sizes, clean_lifetimes, pinned


def _conflict(a, b, lifetimes, pinned):
    """Must a and b not share memory? (pinned buffers share with nobody)"""
    if a in pinned or b in pinned:
        return True
    fa, la = lifetimes[a]
    fb, lb = lifetimes[b]
    return fa <= lb and fb <= la


def _best_fit(occupied, size, alignment):
    """Lowest offset of the smallest gap between ``occupied`` (start, end)
    intervals that holds ``size`` bytes; else the first offset above them."""
    best = None  # (gap size, offset)
    top = 0
    for start, end in sorted(occupied):
        offset = _align(top, alignment)
        gap = start - offset
        if gap >= size and (best is None or gap < best[0]):
            best = (gap, offset)
        top = max(top, end)
    return best[1] if best is not None else _align(top, alignment)


def plan(sizes, lifetimes, pinned=(), alignment=64):
    """Assign each buffer a byte offset; see the module docstring.

    ``sizes``: id -> bytes; ``lifetimes``: id -> (first, last) inclusive
    steps; ``pinned``: ids that get memory of their own, never shared.
    """
    if (isinstance(alignment, bool) or not isinstance(alignment, int)
            or alignment <= 0 or alignment & (alignment - 1)):
        raise ValueError('alignment must be a positive power of two, got %r'
                         % (alignment,))
    sizes, lifetimes, pinned = _validate(sizes, lifetimes, pinned)
    aligned = dict((b, _align(n, alignment)) for b, n in sizes.items())
    order = sorted(sizes, key=lambda b: (-aligned[b], lifetimes[b][0], b))
    offsets, placed = {}, []
    for b in order:
        if aligned[b] == 0:
            offsets[b] = 0
            continue
        occupied = [(offsets[p], offsets[p] + aligned[p]) for p in placed
                    if _conflict(b, p, lifetimes, pinned)]
        offsets[b] = _best_fit(occupied, aligned[b], alignment)
        placed.append(b)
    arena = max([offsets[b] + aligned[b] for b in placed] or [0])
    return Plan(offsets, arena, sum(aligned.values()), sizes, lifetimes,
                pinned, alignment)


def check_plan(sizes, lifetimes, offsets, pinned=()):
    """Raise if two buffers live at one step overlap in memory, or a pinned
    buffer shares memory with any other; return True otherwise.

    Bad input raises ValueError, a broken plan AssertionError, each naming
    the buffers concerned. Zero-size buffers occupy no memory.
    """
    sizes, lifetimes, pinned = _validate(sizes, lifetimes, pinned)
    missing = set(sizes) - set(offsets)
    if missing:
        raise ValueError('buffers %r have no offset' % sorted(missing))
    for b in sizes:
        if operator.index(offsets[b]) < 0:
            raise ValueError('buffer %r has negative offset %d'
                             % (b, offsets[b]))
    spans = sorted((offsets[b], offsets[b] + sizes[b], i, b)
                   for i, b in enumerate(sorted(sizes, key=repr))
                   if sizes[b] > 0)
    # Sweep by offset: only buffers starting before ``end`` can overlap.
    for i, (start, end, _, a) in enumerate(spans):
        for start2, end2, _, b in spans[i + 1:]:
            if start2 >= end:
                break
            if _conflict(a, b, lifetimes, pinned):
                why = ('pinned buffer shares memory'
                       if a in pinned or b in pinned else
                       'live at the same step, overlap in memory')
                raise AssertionError(
                    'buffers %r [%d, %d) life %r and %r [%d, %d) life %r: %s'
                    % (a, start, end, lifetimes[a], b, start2, end2,
                       lifetimes[b], why))
    return True


# Buffer lifetimes over schedules run one after the other (the one liveness
# computation, shared with the executor, donation and the printout).
liveness = _liveness.lifetimes


def plan_schedules(schedules, keep=(), alignment=64):
    """liveness + plan over ``schedules``; sets each planned ``Buffer.offset``
    and appends the plan's summary to the last schedule's notes."""
    schedules = list(schedules)
    lifetimes = liveness(schedules, keep)
    buffers = {}
    for sched in schedules:
        buffers.update(sched.buffers)
    result = plan(dict((b, buffers[b].nbytes) for b in lifetimes), lifetimes,
                  alignment=alignment)
    for b, offset in result.offsets.items():
        buffers[b].offset = offset
    if schedules:
        schedules[-1].notes.append(result.summary())
    return result
