"""A small worker pool for element-wise work, and the phases that use it.

NumPy releases the GIL inside its ufunc loops, so threads that each run the
same op sequence on their own contiguous slice of the arrays run in
parallel. An element-wise op computes each element from the same elements
of its operands, so the split changes no bit. Reductions (a norm) are never
split: the caller runs them, whole, between two phases.

One dispatch per phase: the caller's thread takes part 0 itself and waits
for the others once (one barrier per phase, not one per op).
"""
import os
import queue
import threading
import time

import numpy

ALIGN = 16   # chunk boundaries fall on multiples of this many elements
_thread_default = []    # [numpy.geterr() of a new thread], once read


def _new_thread_errstate():
    """NumPy's error state in a thread that never set one (a worker's): a
    new thread's, read once. Not the importing thread's, which a program
    may have changed before it imported this (``numpy.seterr(all=
    'raise')`` first: the workers ran with the defaults and warned)."""
    if not _thread_default:
        t = threading.Thread(
            target=lambda: _thread_default.append(numpy.geterr()))
        t.start()
        t.join()
    return _thread_default[0]


def caller_errstate():
    """The calling thread's ``numpy.geterr()`` where it differs from a new
    thread's (for the workers to use too; with its ``numpy.seterrcall``
    function where one is set), else None."""
    err = numpy.geterr()
    call = numpy.geterrcall()
    if err == _new_thread_errstate() and call is None:
        return None
    if call is not None:
        err['call'] = call
    return err


def default_threads():
    """The cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


class WorkerPool(object):
    """``threads - 1`` daemon worker threads; ``run(parts)`` runs part 0
    on the calling thread and part ``w`` on worker ``w``, and returns when
    all are done (re-raising the first exception a part raised)."""

    def __init__(self, threads):
        self.threads = threads
        self.pid = os.getpid()
        self.lock = threading.Lock()     # one dispatch at a time
        self._done = queue.SimpleQueue()
        self._gen = 0
        self._queues = []
        for w in range(1, threads):
            q = queue.SimpleQueue()
            t = threading.Thread(target=self._loop, args=(q,), daemon=True,
                                 name='static_graph-update-%d' % w)
            t.start()
            self._queues.append(q)

    def _loop(self, q):
        done = self._done
        while True:
            gen, tasks, err = q.get()
            failure = None
            try:
                if err is None:
                    _run_tasks(tasks)
                else:
                    with numpy.errstate(**err):
                        _run_tasks(tasks)
            except BaseException as e:     # handed to the dispatcher
                failure = e
            del tasks       # (its arrays are the caller's to free)
            done.put((gen, failure))
            del failure

    def run(self, parts, errstate=None):
        """Run ``parts`` (lists of ``(fn, args)``); ``errstate``: the
        caller's ``numpy.geterr()`` where it differs from the default, for
        the workers to use too."""
        self._gen += 1
        gen = self._gen
        sent = 0
        for q, tasks in zip(self._queues, parts[1:]):
            if tasks:
                q.put((gen, tasks, errstate))
                sent += 1
        failure = None
        try:
            _run_tasks(parts[0])
        except BaseException as e:
            failure = e
        while sent:
            # (a dispatch interrupted while it waited left its workers'
            # reports behind: they carry an older number)
            g, f = self._done.get()
            if g != gen:
                continue
            sent -= 1
            if failure is None and f is not None:
                failure = f
        if failure is not None:
            raise failure


def _run_tasks(tasks):
    for fn, args in tasks:
        fn(*args)


_pools = {}
_pools_lock = threading.Lock()


def pool(threads):
    """The process's shared pool of ``threads`` (made afresh after a
    fork, whose child has none of the parent's threads)."""
    with _pools_lock:
        p = _pools.get(threads)
        if p is None or p.pid != os.getpid():
            p = _pools[threads] = WorkerPool(threads)
        return p


def chunks(n, parts):
    """``parts`` contiguous ranges covering ``range(n)``, boundaries on
    multiples of ALIGN."""
    bounds = [0]
    for w in range(1, parts):
        b = (n * w // parts) // ALIGN * ALIGN
        bounds.append(max(b, bounds[-1]))
    bounds.append(n)
    return [(bounds[w], bounds[w + 1]) for w in range(parts)]


class Temps(object):
    """Per-worker temporaries: ``block``-long buffers by dtype."""

    def __init__(self, workers, block=0):
        self.block = block
        self._buffers = [{} for _ in range(workers)]

    def grow(self, block):
        """Make buffers at least ``block`` long from now on."""
        self.block = block
        self._buffers = [{} for _ in self._buffers]

    def get(self, worker, dtypes):
        """The tuple of buffers for temporaries of ``dtypes`` (the k-th
        buffer of a dtype for its k-th temporary)."""
        mine = self._buffers[worker]
        out, used = [], {}
        for dt in dtypes:
            k = used.get(dt, 0)
            used[dt] = k + 1
            lst = mine.setdefault(dt, [])
            while len(lst) <= k:
                lst.append(numpy.empty(self.block, dt))
            out.append(lst[k])
        return tuple(out)


class Phases(object):
    """The element-wise work of one update, by phase.

    ``work[k]``: the (entry index, Program) pairs of phase ``k`` in entry
    order; after phase ``k`` the caller runs its reductions. Each entry
    (a parameter) is either split into one chunk per thread (``size >=
    min_split``) or run whole by the thread that ``owner`` gives (balanced
    by size). ``run_phase`` builds the parts of one phase from the step's
    arrays and scalars and dispatches them.
    """

    def __init__(self, work, sizes, threads, min_split, block, temps):
        self.work = work
        self.threads = threads
        self.temps = temps
        self.split = [threads > 1 and n >= min_split for n in sizes]
        self.chunks = [chunks(n, threads) if s else None
                       for n, s in zip(sizes, self.split)]
        longest = max([hi - lo for c in self.chunks if c for lo, hi in c] +
                      [n for n, s in zip(sizes, self.split) if not s] + [1])
        # block None: a thread's whole range in one go
        self.block = min(block, longest) if block else longest
        if temps.block < self.block:
            temps.grow(self.block)
        load = [0] * threads
        self.owner = []
        for n, s in zip(sizes, self.split):
            if s:
                self.owner.append(None)
                for w in range(threads):
                    load[w] += n / threads
            else:
                w = min(range(threads), key=lambda w: (load[w], w))
                load[w] += n
                self.owner.append(w)
        # A phase with nothing to split runs on the calling thread alone.
        self.parallel = [any(self.split[i] for i, _ in w) for w in work]
        self._temps = {}

    def _t(self, worker, prog):
        if prog.native:         # a C loop: its temporaries are registers
            return None
        key = (worker, prog.temp_dtypes)
        t = self._temps.get(key)
        if t is None:
            t = self._temps[key] = self.temps.get(worker, prog.temp_dtypes)
        return t

    def run_phase(self, k, flat, whole, scalars, full_temps, runner,
                  errstate=None):
        """Run phase ``k``. ``flat[i]``: entry i's arrays flattened (None
        where one is not C-contiguous: then ``whole[i]``, its arrays as they
        are, run unsplit on the calling thread with ``full_temps(i, prog)``);
        ``scalars[i]``: its scalar list. ``runner``: a WorkerPool, or None
        to run every part on the calling thread."""
        if not self.parallel[k]:
            runner = None
        threads = self.threads if runner is not None else 1
        parts = [[] for _ in range(threads)]
        B = self.block
        # NumPy set to raise: the ufuncs, which raise at the op that errs
        # (a compiled loop would write every op first; update_native)
        raising = errstate is not None and 'raise' in errstate.values()
        for i, prog in self.work[k]:
            if raising and prog.native:
                prog = prog.ufuncs
            A = flat[i]
            S = scalars[i]
            fn = prog.fn
            if A is None:
                parts[0].append((fn, (whole[i], S, full_temps(i, prog),
                                      0, 0, 0)))
            elif self.split[i] and runner is not None:
                for w, (lo, hi) in enumerate(self.chunks[i]):
                    parts[w].append((fn, (A, S, self._t(w, prog), lo, hi,
                                          B)))
            else:
                w = self.owner[i] if runner is not None else 0
                n = A[prog.slots[0]].size
                parts[w].append((fn, (A, S, self._t(w, prog), 0, n, B)))
        if runner is None:
            _run_tasks(parts[0])       # the caller's own error state
        else:
            runner.run(parts, errstate)


class SplitChoice(object):
    """Whether a step (of a captured update, or of one split kernel)
    splits its work across the threads: measured. Split and unsplit give
    the same bits (each element is computed alone), so the faster is kept:
    up to PROBES steps of each, alternating, then the one of lower median
    time, checked again every REPROBE steps (another process may have
    taken the other core). Where after EARLY steps of each every time of
    one is below every time of the other, that one is kept at once (each
    probe of the slower costs a step)."""

    PROBES = 4
    EARLY = 2
    REPROBE = 500

    def __init__(self, threads):
        self.threads = threads
        self.times = {True: [], False: []}
        self.choice = None
        self.left = 0                # steps until the next probing

    def use_pool(self):
        """(split this step?, is it a measuring step?)"""
        if self.threads <= 1:
            return False, False
        if self.choice is not None and self.left > 0:
            self.left -= 1
            return self.choice, False
        t = self.times
        n = len(t[True]) + len(t[False])
        if n < 2 * self.PROBES and not (
                len(t[True]) == len(t[False]) >= self.EARLY and (
                    max(t[True]) < min(t[False]) or
                    max(t[False]) < min(t[True]))):
            return len(t[True]) <= len(t[False]), True
        self.medians = (numpy.median(t[True]), numpy.median(t[False]))
        self.choice = bool(self.medians[0] <= self.medians[1])
        t[True], t[False] = [], []
        self.left = self.REPROBE
        return self.choice, False

    def took(self, pooled, seconds):
        self.times[pooled].append(seconds)

    def run(self, work, before_split=None):
        """``work(runner)``, runner the shared pool (held for this call)
        on a split step, None on a whole one (or where another split holds
        the pool); timed where the step measures. ``before_split``: called
        first on a split step. Returns what ``work`` returns."""
        pooled, measuring = self.use_pool()
        runner = None
        if pooled:
            if before_split is not None:
                before_split()
            runner = pool(self.threads)
            if not runner.lock.acquire(blocking=False):
                runner = None        # busy with another split: run alone
        try:
            t0 = time.perf_counter()
            result = work(runner)
            if measuring:
                self.took(runner is not None, time.perf_counter() - t0)
        finally:
            if runner is not None:
                runner.lock.release()
        return result

    def describe(self):
        if self.threads <= 1:
            return ''
        if self.choice is None:
            return '; measuring split against whole'
        return '; %s (median %.3g ms split, %.3g ms whole, measured)' % (
            'split across threads' if self.choice else
            'not split: one thread was faster here',
            self.medians[0] * 1e3, self.medians[1] * 1e3)


class Pair(object):
    """Runs two independent kernels (``executor._pairs``): one after the
    other, or the second on the caller's thread while a worker runs the
    first, whichever measures faster (``SplitChoice``). Each kernel is
    what it is either way, so the results are the same bits; only which
    core runs it changes. For kernels that release the GIL for most of
    their time (BLAS products)."""

    def __init__(self, threads):
        self.choice = SplitChoice(min(threads, 2))

    def __call__(self, fa, xa, fb, xb):
        return self.choice.run(lambda runner: self._run(runner, fa, xa, fb,
                                                        xb))

    def describe(self):
        """What the printout says of the pair's measured choice."""
        return describe_choice(self.choice)

    @staticmethod
    def _run(runner, fa, xa, fb, xb):
        if runner is None:
            return fa(*xa), fb(*xb)
        out = [None, None]

        def first():
            out[0] = fa(*xa)

        def second():
            out[1] = fb(*xb)
        runner.run([[(second, ())], [(first, ())]], caller_errstate())
        return out[0], out[1]


def describe_choice(c, per=''):
    """The printout's words for a two-thread ``SplitChoice`` (``per``:
    what a median is of)."""
    if c.choice is None:
        return ' (measuring two threads against one)'
    return ' (%s: median %.3g ms%s, %.3g ms on one, measured)' % (
        'on two threads' if c.choice else 'not: one thread is faster',
        c.medians[0] * 1e3, per, c.medians[1] * 1e3)


class Ranges(object):
    """Runs ``fn(lo, hi)`` over ``[0, n)``: whole, or as ``threads``
    contiguous ranges on the shared pool, whichever measures faster
    (``SplitChoice``). For work whose every element is computed alone
    (copies, element-wise sums in a fixed order per element), so that the
    split changes no bit."""

    def __init__(self, threads, n):
        self.threads = threads
        self.n = n
        bounds = [n * w // threads for w in range(threads + 1)]
        self.parts = list(zip(bounds, bounds[1:]))
        self.choice = SplitChoice(threads)

    def __call__(self, fn):
        def work(runner):
            if runner is None:
                fn(0, self.n)
            else:
                runner.run([[(fn, part)] for part in self.parts],
                           caller_errstate())
        self.choice.run(work)


def run_ranges(ranges, fn, n):
    """``ranges(fn)`` where given (a ``Ranges`` over ``n``), else
    ``fn(0, n)``."""
    if ranges is None or ranges.n != n:
        fn(0, n)
    else:
        ranges(fn)
