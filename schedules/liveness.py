"""Liveness: when each buffer of a schedule is written and read.

The one place that answers "where does this buffer die?" for everything
that asks: the executor (``del`` after a buffer's last use), the printout
(``free`` lines), donation (may a kernel overwrite an input that dies with
it?), the memory planner (lifetimes over schedules that run one after the
other) and the placement of buffers into dead memory (placement.py).

Pure functions over the IR; nothing here knows Chainer.
"""
from schedules import ir

# Roles whose arrays outlive every run (looked up live, never freed).
LIVE_ROLES = (ir.PARAM, ir.PERSIST, ir.CONST)


class Liveness(object):
    """Op indexes at which one schedule's ops write and read each buffer:
    ``first_write``, ``last_write``, ``first_read`` and ``last_read`` map
    buffer id -> op index (a buffer never written or never read is absent
    from the maps concerned)."""

    __slots__ = ('schedule', 'first_write', 'last_write', 'first_read',
                 'last_read')

    def __init__(self, schedule):
        self.schedule = schedule
        fw, lw, fr, lr = {}, {}, {}, {}
        for i, op in enumerate(schedule.ops):
            for b in op.inputs:
                if b not in fr:
                    fr[b] = i
                lr[b] = i
            for b in op.outputs:
                if b not in fw:
                    fw[b] = i
                lw[b] = i
        self.first_write = fw
        self.last_write = lw
        self.first_read = fr
        self.last_read = lr

    def last_use(self, b):
        """The op after which ``b`` is dead: its last reader, or for a
        buffer no op reads, its (first) writer; None if no op touches
        it."""
        i = self.last_read.get(b)
        return self.first_write.get(b) if i is None else i

    def dead_after(self, b, i):
        """Is ``b`` read by no op after op ``i``?"""
        return self.last_read.get(b, -1) <= i

    def frees(self, keep=(), unread=False):
        """Map op index -> buffer ids whose memory the schedule lets go
        after that op: their last use (``unread``: also buffers written and
        never read, right after their writer). Never freed: ``keep``
        (outputs, what a later schedule reads), static buffers and buffers
        of ``LIVE_ROLES``."""
        bufs = self.schedule.buffers
        keep = set(keep)
        out = {}
        last = dict(self.last_read)
        if unread:
            for b, i in self.first_write.items():
                last.setdefault(b, i)
        for b, i in last.items():
            buf = bufs[b]
            if b in keep or buf.static or buf.role in LIVE_ROLES:
                continue
            out.setdefault(i, []).append(b)
        return out


def of(schedule):
    """The ``Liveness`` of ``schedule``."""
    return Liveness(schedule)


def ancestors(ops, bids, more=None):
    """Walk back from buffers ``bids`` through ``ops``: (op index by the
    buffer it makes, the indexes of the ops reached, every buffer
    reached). What an export keeps (the ops its outputs need: ``more(b)``,
    the buffers ``b`` is a view of); the ops a graph cut reaches inside a
    call (static_graph/cuts.py)."""
    made_by = {}
    for k, op in enumerate(ops):
        for b in op.outputs:
            made_by[b] = k
    reached, seen = set(), set()
    todo = list(bids)
    while todo:
        b = todo.pop()
        if b in seen:
            continue
        seen.add(b)
        if more is not None:
            todo.extend(more(b))
        k = made_by.get(b)
        if k is not None and k not in reached:
            reached.add(k)
            todo.extend(ops[k].inputs)
    return made_by, reached, seen


def _root(bufs, b):
    """The buffer whose memory ``b`` is (following ``Buffer.view_of``)."""
    r, seen = b, set()
    while bufs[r].view_of is not None and r not in seen:
        seen.add(r)
        r = bufs[r].view_of
    return r


def lifetimes(schedules, keep=()):
    """Map buffer id -> (first, last) global step over ``schedules`` run in
    order (steps number their ops one after the other). Params, persistent
    values and constants are left out.

    A buffer is live from the op that writes it, or, when it is bound before
    it is written (a schedule input, or a value read before any write), from
    the first op of the schedule that binds it; it stays live until its last
    reader. Each schedule's outputs stay live at least to that schedule's
    last op; buffers in ``keep`` stay live to the very last step. A view
    (``Buffer.view_of``) is not planned itself: it keeps its base alive.
    """
    first, last = {}, {}
    base = 0
    for sched in schedules:
        bufs = sched.buffers
        live = Liveness(sched)
        end = base + max(len(sched.ops), 1) - 1
        # Per planned root, over its views: earliest write and read, latest
        # touch in this schedule.
        write, read, touch = {}, {}, {}
        roots = {}

        def planned(b):
            if b not in roots:
                r = _root(bufs, b)
                roots[b] = None if bufs[r].role in LIVE_ROLES else r
            return roots[b]

        def note(table, r, i, pick):
            table[r] = i if r not in table else pick(table[r], i)

        bound = set()
        for b in sched.inputs:
            r = planned(b)
            if r is not None:
                bound.add(r)
                note(touch, r, base, max)
        for b, i in live.first_read.items():
            r = planned(b)
            if r is not None:
                note(read, r, base + i, min)
                note(touch, r, base + live.last_read[b], max)
        for b, i in live.first_write.items():
            r = planned(b)
            if r is not None:
                note(write, r, base + i, min)
                note(touch, r, base + live.last_write[b], max)
        for b in sched.outputs:
            r = planned(b)
            if r is not None:
                note(touch, r, end, max)
        for r, t in touch.items():
            if r not in first:
                # Bound by the caller (an input, or read before any of its
                # memory is written here): live from the schedule's start.
                w, rd = write.get(r), read.get(r)
                if r in bound or rd is not None and (w is None or rd <= w):
                    first[r] = base
                else:   # written here, or only returned
                    first[r] = end if w is None else w
            last[r] = max(last.get(r, t), t)
        base += len(sched.ops)
    final = max(base - 1, 0)
    for b in keep:
        if b in first:
            last[b] = final
    # (a trailing schedule with no ops binds its inputs past the last step)
    return dict((b, (min(first[b], final), min(last[b], final)))
                for b in first)
