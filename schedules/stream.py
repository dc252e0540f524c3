"""Ops a schedule hands to a second thread and collects at its end.

In a backward schedule the weight-gradient products (and the sums that add
a gradient held from earlier calls to them) feed nothing but the
schedule's outputs: the chain of input gradients goes on without them. A
compiled schedule (``executor.compile_schedule``, its ``stream`` option)
pushes such ops, in schedule order, to the process's worker thread in C
(``blas_stream``: NumPy's own gemm call and element-wise sums, without the
GIL) and waits for them once, before it returns. Each op is the very
computation it is inline, on the same operands: the same bits; only the
thread that runs it changes. Which ops may go is decided by ``select``:
none whose result a later op of the calling thread reads, none reading
memory that the calling thread writes into or hands to a placed result.
An op whose kernel gives no task for this call's arrays (``fn.stream_task``
returns None: a layout NumPy would copy first) runs on the calling thread,
after the worker's tasks.

Whether a schedule uses the worker is measured (``parallel.SplitChoice``):
runs with the worker and runs inline alternate over the first runs and the
faster is kept (another process may hold the other core), measured again
every few hundred runs. Runs under a NumPy error state other than the
default run inline (an error then stops where NumPy's own op stops).
"""
import os
import time

from schedules import blas_stream
from schedules import native
from schedules import parallel

_perf = time.perf_counter
# For comparisons (benchmarks): True or False puts every schedule's
# streamed ops and pairs on the worker or inline, whatever was measured.
FORCE = None


def available():
    """The worker, or a string: why there is none."""
    return blas_stream.worker()


class _User(object):
    """What uses the worker: its ``push`` and ``wait`` (None where there
    is no worker), the measured ``choice``."""

    def __init__(self, threads):
        self.choice = parallel.SplitChoice(min(threads, 2))
        w = blas_stream.worker()
        self.push, self.wait = (None, None) if isinstance(w, str) else w
        self.pid = os.getpid()

    def usable(self):
        """Not without a worker, not under a NumPy error state other than
        the default, not in a forked child (the thread stayed in the
        parent)."""
        return self.push is not None and os.getpid() == self.pid and \
            parallel.caller_errstate() is None


class Stream(_User):
    """One compiled schedule's use of the worker: ``begin()`` starts a
    run."""

    def begin(self):
        if not self.usable():
            return _Run(self, False, False)
        if FORCE is not None:
            return _Run(self, FORCE, False)
        on_worker, measuring = self.choice.use_pool()
        return _Run(self, on_worker, measuring)

    def describe(self):
        if self.push is None:
            return ' (not: %s)' % blas_stream.worker()
        return parallel.describe_choice(self.choice, ' a run')


class _Run(object):
    """One run of a schedule: ``put`` each streamed op at its place in the
    schedule (its results, not to be read before ``end()``), ``end()``
    waits for them."""

    __slots__ = ('stream', 'on_worker', 'measuring', 't0', 'first',
                 'ticket', 'held', 'made', 'dtype')

    def __init__(self, stream, on_worker, measuring):
        self.stream = stream
        self.on_worker = on_worker
        self.measuring = measuring
        self.first = self.ticket = 0
        self.held = []     # what the worker's tasks read and write
        self.made = {}     # id of an array a task writes -> its ticket
        self.dtype = None
        if measuring:
            self.t0 = _perf()

    def put(self, fn, args):
        if self.on_worker:
            task = fn.stream_task(args)
            if task is not None:
                tasks, outs = task
                self.held.append((args, outs))
                made = self.made
                # (each task waits for the one that writes what it reads:
                # the first of its list for the op's inputs, the others
                # for the one before them)
                dep = max([made.get(id(a), 0) for a in args] or [0])
                push = self.stream.push
                for t in tasks:
                    dep = push(*(t + (dep,)))
                self.ticket = dep
                self.first = self.first or dep - len(tasks) + 1
                for o in outs:
                    made[id(o)] = dep
                if self.dtype is None:
                    self.dtype = outs[0].dtype
                return outs
            if self.ticket:
                self._wait()
        return fn(args)

    def _wait(self):
        flags = self.stream.wait(self.first, self.ticket)
        self.first = self.ticket = 0
        self.held = []
        self.made = {}
        if flags:
            native.report(flags, self.dtype)

    def __del__(self):
        # A run left by an exception: its tasks still read and write the
        # arrays it holds, which must outlive them.
        if self.ticket:
            self.stream.wait(self.first, self.ticket)

    def end(self):
        if self.ticket:
            self._wait()
        if self.measuring:
            self.stream.choice.took(self.on_worker, _perf() - self.t0)


class Pair(_User):
    """Two neighbouring independent ops (``executor._pairs``): the first
    pushed to the worker (``fn.stream_task``) while the calling thread
    runs the second, or one after the other, whichever measures faster
    (``parallel.SplitChoice``). The same kernels' computations either way:
    the same bits."""

    def __init__(self, threads):
        super(Pair, self).__init__(threads)
        # for calls the worker cannot take (a result written into given
        # memory: ``fn.into``): the pool's Python thread
        self.fallback = parallel.Pair(threads)

    def __call__(self, fa, xa, fb, xb):
        if FORCE is None:
            on, measuring = self.choice.use_pool()
        else:
            on, measuring = FORCE, False
        if on and len(xa) != 1:
            return self.fallback(fa, xa, fb, xb)
        if measuring:
            t0 = _perf()
        # (a run of one op: pushed, or run here where there is no task)
        run = _Run(self, on and self.usable(), False)
        try:
            ra = run.put(fa, xa[0])
            rb = fb(*xb)
        finally:
            run.end()
        if measuring:
            self.choice.took(on, _perf() - t0)
        return ra, rb

    def describe(self):
        return parallel.describe_choice(self.choice)


def select(schedule, plan, role):
    """The indexes of the ops of ``schedule`` that go to the worker (a
    frozenset). ``role(op)``: 'head' (an op that may start
    work on the worker: a product), 'follow' (one that may go where it
    reads a result of an op on the worker: a sum) or None. An op goes
    where:

    * its results are its own arrays (not static, not placed, not host
      memory for a placed result, not views) and every one is read on the
      worker or returned, never by the calling thread;
    * every input it may write into (``fn.aliases``, ``fn.overwrites``)
      is a result made on the worker;
    * no input shares memory with a host, nor with an input that an op of
      the calling thread after it writes into.
    """
    if role is None:
        return frozenset()
    bufs = schedule.buffers
    ops = schedule.ops
    root = _memory(schedule, plan)
    hosts = set(root(b) for b in plan.hosts)
    # memory an op of the calling thread writes into, and from where
    written_from = {}
    for j, op in enumerate(ops):
        for p in _writes(op):
            written_from.setdefault(root(op.inputs[p]), []).append(j)
    on = {}
    for i, op in enumerate(ops):
        r = role(op) if op.fn is not None else None
        if r is None or not op.outputs or \
                op.select != tuple(range(len(op.outputs))):
            continue
        made = set(b for b in op.inputs if b in on)
        if r == 'follow' and not made:
            continue
        if any(bufs[b].static or b in plan.places or
               bufs[b].view_of is not None or root(b) in hosts
               for b in op.outputs):
            continue
        if any(op.inputs[p] not in made for p in _writes(op)):
            continue
        if any(root(b) in hosts for b in op.inputs if b not in made):
            continue
        for b in op.outputs:
            on[b] = i
    ops_on = set(on.values())
    # Drop, until none is left to drop: an op whose result the calling
    # thread reads, or whose input the calling thread writes into after
    # it (unless it writes into it itself: a result of the worker's), and
    # every op on the worker that reads its results.
    changed = True
    while changed:
        changed = False
        drop = set()
        for j, op in enumerate(ops):
            if j in ops_on:
                for b in op.inputs:
                    if on.get(b) in ops_on:
                        continue
                    if on.get(b) is not None:    # its maker was dropped
                        drop.add(j)
                    elif any(w > j and w not in ops_on
                             for w in written_from.get(root(b), ())):
                        drop.add(j)
            else:
                drop.update(on[b] for b in op.inputs
                            if on.get(b) in ops_on)
        if drop:
            ops_on -= drop
            changed = True
    return frozenset(ops_on)


def _writes(op):
    """Positions of the inputs ``op``'s kernel may write into."""
    fn = op.fn
    if fn is None:
        return ()
    aliases = getattr(fn, 'aliases', None) or ()
    return tuple(sorted(set(
        [a for a in aliases if a is not None] +
        list(getattr(fn, 'overwrites', None) or ()))))


def _memory(schedule, plan):
    """``root(b)``: one buffer id for all buffers that may share memory
    (recorded groups, views, results a kernel may write into an input,
    placed results and their hosts)."""
    parent = {}

    def root(b):
        r = b
        while parent.get(r, r) != r:
            r = parent[r]
        while b != r:
            parent[b], b = r, parent[b]
        return r

    def union(a, b):
        ra, rb = root(a), root(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
    facts = schedule.memory
    if facts is not None:
        for ids, _, _ in facts.groups:
            for b in ids[1:]:
                union(ids[0], b)
    for b, buf in schedule.buffers.items():
        if buf.view_of is not None:
            union(b, buf.view_of)
    for op in schedule.ops:
        aliases = getattr(op.fn, 'aliases', None) or () if op.fn else ()
        for pos, a in enumerate(aliases):
            if a is not None and pos < len(op.outputs):
                union(op.outputs[pos], op.inputs[a])
        for p in getattr(op.fn, 'overwrites', None) or () if op.fn else ():
            for b in op.outputs:
                union(b, op.inputs[p])
    for b, (h, _) in plan.places.items():
        union(b, h)
    for h, b in plan.holder.items():
        union(h, b)
    return root
