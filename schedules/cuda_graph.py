"""Replay a compiled schedule as one CUDA graph launch (CuPy).

A compiled schedule is a Python function that launches one kernel after
another. Once it has run on a key's arrays, ``GraphTier`` captures one run of
it on a CUDA stream into a ``cupy.cuda.Graph`` and from then on replays the
graph: copy the call's arrays into the graph's static input buffers, launch,
copy out what escapes. No Python runs per op, and no kernel is launched from
Python but those copies.

What a graph replays is fixed at capture: the kernels, their arguments, the
memory they read and write. So:

* every buffer lives at one address: the run's own allocations come from a
  private memory pool the graph keeps (temporaries freed during the run are
  reused inside the graph only, never handed to other code); arguments are
  copied into static buffers, except those that keep one address across
  calls (parameters, persistent arrays, and outputs of another graph: the
  forward's saved activations read by the backward), which are read in place;
  a parameter given a new array makes the graph stale (``replay`` returns
  None, the caller runs the schedule and the tier captures again);
* what the graph cannot repeat is refused at capture (``NotCapturable``, and
  the tier keeps the stream replay for good, with the reason): a host
  synchronization or a read of a value (CUDA refuses it during capture), a
  transfer from host memory (its host buffer would be read again at every
  replay), a random draw from CuPy's generators (a replay would not advance
  them as a launch from Python does), an argument or a result that is not a
  CuPy array (a host value frozen at capture);
* as a last check, the first replay is compared bit for bit with a run of
  the schedule on the same arrays (from the same state: the arrays the
  schedule updates in place are put back between the two); a difference
  (a non-deterministic kernel, a host value the checks above missed) keeps
  the stream replay, with the values of that run.

Nothing here knows Chainer: the front end hands in the compiled run, which
argument positions keep their address, which results stay in the graph
(static) and which are copied out, and the arrays the schedule updates in
place. ``Backend`` is the seam that tests replace where there is no GPU.
"""
import sys

import numpy

from schedules import bits
from schedules import capture_guard
from schedules import ir

_STABLE_ROLES = (ir.PARAM, ir.PERSIST, ir.CONST)
# Results that must not be handed to the caller as the graph's own memory
# (the next launch overwrites it) are copied out after each launch.


# Process-wide counts, for benchmarks and fuzzing reports.
counts = {'captured': 0, 'refused': 0, 'stale': 0}


NotCapturable = capture_guard.NotCapturable


class GraphTier(object):
    """Runs ``tiered`` (an ``executor.TieredSchedule``) until its compiled
    form has run ``after`` times, then captures it as a graph and replays
    that.

    schedule roles decide which arguments are read in place (parameters,
    persistent arrays, constants, and arrays ``owned`` reports as another
    graph's static results); ``static_results``: positions in the result
    tuple that stay the graph's memory (the caller keeps them safe, as it
    does static buffers); the rest are copied out. ``state()``: the arrays
    the schedule updates in place, for the check; ``allowed()``: may a
    capture happen now (the front end says no while an earlier call still
    needs the static results); ``on_capture(graph)``: told of each graph;
    ``lend``: results copied out may be lent instead (see HELD).
    (A graph dropped as stale leaves its static results where they are: a
    call from before may still read them.)
    """

    def __init__(self, tiered, backend, after=1, static_results=(),
                 state=None, allowed=None, on_capture=None, owned=None,
                 lend=False):
        self.tiered = tiered
        self.backend = backend
        self.after = after
        self.static_results = frozenset(static_results)
        self.state = state
        self.allowed = allowed
        self.on_capture = on_capture
        self.owned = owned
        self.lend = lend
        self.unlent = set()        # positions found held: copied out
        self.graph = None
        self.reason = None         # why not (for good), or None
        self.captures = 0
        self.launches = 0
        self.stale = 0             # graphs dropped for a replaced parameter
        self.held = 0              # calls run launch by launch: see HELD
        self._compiled_runs = 0

    @property
    def schedule(self):
        return self.tiered.schedule

    @property
    def source(self):
        return self.tiered.source

    @property
    def compiled(self):
        return self.tiered.compiled

    def __call__(self, args):
        g = self.graph
        if g is not None:
            out = g.replay(args)
            if out is HELD:
                # A result lent by the last launch is still held: this
                # call runs launch by launch, the graph's memory untouched,
                # and the next captures a graph that copies it out (its
                # holder may keep it for good).
                self.held += 1
                self.unlent.update(g.lent)
                self.graph = None
                return self.tiered(args)
            if out is not None:
                self.launches += 1
                return out
            # Stale: captured again, but not at every call
            # (``use_fp32_update`` replaces every parameter array).
            self.graph = None
            self.stale += 1
            counts['stale'] += 1
            if self.stale >= 2:
                self.reason = '%s (%d times)' % (g.stale, self.stale)

        if self.reason is not None or self.tiered.run is None or \
                self._compiled_runs < self.after or \
                (self.allowed is not None and not self.allowed()):
            out = self.tiered(args)
            if self.tiered.run is not None:
                self._compiled_runs += 1
            return out
        try:
            g, out = capture(self.tiered.run, self.schedule, args,
                             self.backend, self.static_results,
                             self.state() if self.state else (), self.owned,
                             self.lend, self.unlent)
        except NotCapturable as e:
            self.reason = str(e)
            counts['refused'] += 1
            out = getattr(e, 'result', None)
            return out if out is not None else self.tiered(args)
        self.graph = g
        self.captures += 1
        counts['captured'] += 1
        self.launches += 1
        if self.on_capture is not None:
            self.on_capture(g)
        return out


class GraphedRun(object):
    """A captured schedule: ``replay(args)`` -> results, or None where an
    argument read in place is no longer the captured array."""

    def __init__(self, graph, inputs, in_place, outputs, copy_out, backend,
                 keep, written=(), lend=False, unlent=()):
        self.graph = graph
        self.inputs = inputs          # the captured arrays, per argument
        # Per argument: read in place ('param': stale if another array
        # comes; 'owned': another graph's memory), 'value' (a host value,
        # frozen), or None (copied into the static input).
        self.in_place = in_place
        self.outputs = outputs        # the graph's results (its memory)
        self.backend = backend
        self.keep = keep              # the pool, the stream: alive with it
        self.stale = None
        self.written = written        # arguments copied back after launch
        # Results that are host values are handed out as captured.
        self.copy_out = tuple(c and backend.is_array(o)
                              for o, c in zip(outputs, copy_out))
        # Results that may be lent: handed out as the graph's own array,
        # not a copy, while nothing holds the one lent before (see HELD).
        # (Only results that own their memory, none an argument's array,
        # each once: a view would not count views of its base, an
        # argument's array is held by others anyway.)
        shared = set(id(a) for a in inputs)
        mine = [id(o) for o in outputs]
        self.lend = set(i for i, (o, c) in enumerate(zip(outputs,
                                                          self.copy_out))
                        if lend and c and i not in unlent and
                        _owns_memory(o) and
                        id(o) not in shared and mine.count(id(o)) == 1)
        self.lent = ()           # positions lent by the last launch
        self.alone = None        # per result: its reference count unlent
        self.lent_results = 0    # results handed out without a copy

    def _refs(self, i):
        return sys.getrefcount(self.outputs[i])

    def _still_held(self):
        """Positions lent by the last launch whose array something still
        holds (a reference from outside, a view of it)."""
        alone = self.alone
        return tuple(i for i in self.lent if self._refs(i) > alone[i])

    def replay(self, args):
        """This call's results, or None (and ``stale`` says why) where the
        graph no longer fits: an argument read in place is another array,
        or a host value differs from the captured one."""
        if self.alone is None:
            # The first replay after the capture: only this object and
            # the backend hold the results (the capture's own launch
            # copied them all out).
            self.alone = tuple(self._refs(i)
                               for i in range(len(self.outputs)))
        elif self.lent:
            held = self._still_held()
            if held:
                self.lent = held
                return HELD
            self.lent = ()
        copyto = self.backend.copyto
        for a, s, how in zip(args, self.inputs, self.in_place):
            if a is s:
                continue
            if how == 'param':
                self.stale = ('parameter arrays were replaced between calls '
                              '(optimizer.use_fp32_update(), W.array = ...): '
                              'the graph reads parameters in place')
                return None
            if how == 'value':
                if type(a) is type(s) and a == s:
                    continue
                self.stale = ('a host value among its arguments changed '
                              'between calls (%r, then %r)' % (s, a))
                return None
            copyto(s, a)
        back = [args[i] for i in self.written]
        if args.__class__ is list:
            args.clear()
        return self.launch(back)

    def launch(self, back):
        """Launch; copy what it wrote into copied arguments back to the
        caller's arrays ``back`` (of ``written``); the results, those that
        escape copied out of the graph's memory."""
        self.backend.launch(self.graph)
        for a, i in zip(back, self.written):
            _copy_back(self.backend, a, self.inputs[i])
        copy = self.backend.copy
        if self.alone is None or not self.lend:
            return tuple(copy(o) if c else o
                         for o, c in zip(self.outputs, self.copy_out))
        lend = self.lend
        self.lent = tuple(lend)
        self.lent_results += len(lend)
        return tuple(o if i in lend else copy(o) if c else o
                     for i, (o, c) in enumerate(zip(self.outputs,
                                                    self.copy_out)))

    def static_arrays(self):
        """The results that stay the graph's memory (not copied out)."""
        return [o for o, c in zip(self.outputs, self.copy_out)
                if not c and self.backend.is_array(o)]


# ``GraphedRun.replay``'s answer where a result the last launch lent is
# still held: the next launch would overwrite what its holder sees.
#
# A result that escapes (a loss, the gradients handed to Chainer) would be
# copied out of the graph's memory after every launch, so that a later
# launch does not change what the caller holds: one allocation and one
# copy launch each (on CuPy about 15-20 microseconds of host time). A tier
# made with ``lend`` hands such a result out as the graph's own array
# instead. Before the next launch, the lent arrays' reference counts say
# whether anything still holds one (the caller, or a view of it: a view
# refers to the array that owns the memory, and only arrays that own
# theirs are lent). If nothing does, the graph launches into them again.
# If one is held, that call runs the schedule launch by launch (fresh
# results, the graph's memory untouched), and the next captures a new
# graph that copies that result out (its holder may keep it for good).
# Gradients, which ``cleargrads`` lets go of before the next step, are lent
# at every step; a loop that keeps them costs one call launch by launch
# and one capture.
HELD = object()


def _owns_memory(a):
    """An array that owns its memory (views of it refer to it)."""
    return not isinstance(a, numpy.generic) and \
        getattr(a, 'base', 0) is None and hasattr(a, 'shape')


def _copy_back(backend, a, s):
    """What the schedule left in the copy ``s`` of the caller's ``a``, into
    ``a``; not into an array the caller does not let write (a NumPy
    broadcast: the schedule could not have written it either)."""
    if getattr(getattr(a, 'flags', None), 'writeable', True):
        backend.copyto(a, s)


_VALUES = (bool, int, float, complex, type(None))


def _is_value(a):
    """A plain host value (a number, a NumPy scalar, None): what a
    schedule's Python computed from shapes and attributes, the same at
    every call of a key (one computed from a device value would have
    synchronized, which fails the capture)."""
    return isinstance(a, _VALUES) or isinstance(a, numpy.generic)


def _check_values(backend, what, values):
    for i, a in enumerate(values):
        if not backend.is_array(a) and not _is_value(a):
            raise NotCapturable(
                '%s %d is %s, neither a device array nor a number'
                % (what, i, type(a).__name__))


def _differing(backend, xs, ys):
    """The positions at which ``xs`` and ``ys`` differ: arrays bit for bit
    (``backend.same_many``, all pairs at once), host values by value."""
    pairs = [k for k, (a, b) in enumerate(zip(xs, ys))
             if backend.is_array(a) and backend.is_array(b)]
    same = backend.same_many([(xs[k], ys[k]) for k in pairs])
    bad = set(k for k, s in zip(pairs, same) if not s)
    arrays = set(pairs)
    bad.update(k for k, (a, b) in enumerate(zip(xs, ys))
               if k not in arrays and not (
                   type(a) is type(b) and (a == b or (a != a and b != b))))
    return sorted(bad)


def capture(run, schedule, args, backend, static_results=(), state=(),
            owned=None, lend=False, unlent=()):
    """Run the compiled schedule ``run`` on this call's ``args`` launch by
    launch, capture it, launch the graph from the same state and check that
    both agree bit for bit; return ``(GraphedRun, this call's results)``.
    Raises NotCapturable if it cannot be replayed as a graph; then
    ``.result`` holds this call's results (of the launch-by-launch run,
    whose effects stand), or None where the schedule did not run."""
    args = tuple(args)
    _check_values(backend, 'argument', args)
    bufs = schedule.buffers
    roles = [bufs[b].role for b in schedule.inputs]
    roles += [None] * (len(args) - len(roles))    # preset buffers
    in_place, inputs = [], []
    for a, role in zip(args, roles):
        if not backend.is_array(a):
            in_place.append('value')    # frozen: must stay the same
            inputs.append(a)
        elif role in _STABLE_ROLES:
            in_place.append('param')
            inputs.append(a)
        elif owned is not None and owned(a):
            in_place.append('owned')
            inputs.append(a)
        else:
            s = backend.empty_like(a)
            if s.strides != a.strides:
                raise NotCapturable(
                    'an argument is a view with gaps (strides %s): its '
                    'static copy would have other strides' % (a.strides,))
            backend.copyto(s, a)
            in_place.append(None)
            inputs.append(s)
    inputs = tuple(inputs)
    copy = backend.copy
    # What a run may change: arguments a kernel may write into (all but
    # parameters and constants), and what the schedule updates in place.
    # (Copied arguments first, in order: ``written`` reads their places.)
    touched = [s for s, how in zip(inputs, in_place) if how is None]
    touched += [s for s, role, how in zip(inputs, roles, in_place)
                if how == 'owned' and role not in (ir.PARAM, ir.CONST)]
    seen = set(id(a) for a in touched)
    for a in state:
        if id(a) not in seen:
            seen.add(id(a))
            touched.append(a)
    before = [copy(a) for a in touched]
    # First the schedule itself, launch by launch: the reference, and this
    # call's results should the graph fail. (Before the capture, so that
    # what its Python leaves on nodes is the capture's, not this run's.)
    want = tuple(copy(r) if backend.is_array(r) else r
                 for r in run(inputs))
    after = [copy(a) for a in touched]
    # Copied arguments the schedule may write into: the caller's arrays must
    # change too, as they do where the schedule runs on them. Any but the
    # call's own inputs (a backward step's Python, as Chainer's hinge does,
    # writes into the gradient and the state it gets, where and whether by
    # the data: flipping the sign of a zero is no change of value); an input
    # only where this run wrote into it.
    copied = [i for i, how in enumerate(in_place) if how is None]
    inputs_of = [k for k, i in enumerate(copied) if roles[i] == ir.INPUT]
    changed = set(inputs_of[d] for d in _differing(
        backend, [after[k] for k in inputs_of],
        [before[k] for k in inputs_of]))
    written = tuple(i for k, i in enumerate(copied)
                    if roles[i] != ir.INPUT or k in changed)

    def restore(values):
        for a, v in zip(touched, values):
            backend.copyto(a, v)

    def refuse(e):
        restore(after)
        for i in written:
            _copy_back(backend, args[i], inputs[i])
        e.result = want
        return e

    try:
        _check_values(backend, 'result', want)
    except NotCapturable as e:
        raise refuse(e)
    restore(before)
    try:
        graph, outputs, keep = backend.capture(run, inputs)
    except NotCapturable as e:
        raise refuse(e)
    # (A capture runs nothing on the device; this is for backends that do
    # run something while capturing.)
    restore(before)
    copy_out = tuple(i not in static_results for i in range(len(outputs)))
    g = GraphedRun(graph, inputs, tuple(in_place), tuple(outputs),
                   copy_out, backend, keep, written, lend, unlent)
    result = g.launch([args[i] for i in written])
    bad = _differing(backend, outputs, want)
    bad_state = _differing(backend, touched, after)
    if bad or bad_state:
        raise refuse(NotCapturable(
            'the graph\'s first replay differs from the schedule run '
            'launch by launch (results %s%s): a kernel that is not '
            'deterministic, or a host value the capture froze' % (
                ', '.join(map(str, bad)) or 'none',
                '; arrays updated in place %s' % ', '.join(map(
                    str, bad_state)) if bad_state else '')))
    return g, result


# Pairs of arrays up to this size in all are compared after a copy to the
# host (CupyBackend.same_many).
HOST_COMPARE_BYTES = 16 << 20


def _dense(a):
    """Whether ``a``'s elements fill ``a.nbytes`` bytes from its data
    pointer without gaps: C order up to a permutation of its axes, strides
    positive (C- and F-contiguous arrays, and views such as
    ``rollaxis`` of one, the layout of Chainer's convolutions without
    cuDNN). Two arrays of one shape, dtype and such strides hold the same
    bits where those bytes are the same."""
    step = a.itemsize
    for stride, n in sorted((s, n) for s, n in zip(a.strides, a.shape)
                            if n != 1):
        if stride != step:
            return False
        step *= n
    return True


# The bytes of two arrays of one dense layout compared on the device: one
# kernel for every dtype (compiled once: NVRTC takes about a second a
# kernel in a process without CuPy's kernel cache, and CuPy's array_equal
# compiles one comparison and one reduction per dtype).
_SAME_BYTES = r'''
extern "C" __global__ void same_bytes(const unsigned char* a,
                                      const unsigned char* b,
                                      unsigned long long n, int* differs,
                                      int k) {
    unsigned long long step = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i =
             (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
         i < n; i += step) {
        if (a[i] != b[i]) {
            differs[k] = 1;
            return;
        }
    }
}
'''


class CupyBackend(object):
    """Graphs on CuPy: capture on a stream of its own, allocations from a
    private pool, launch on the current stream."""

    def __init__(self):
        import cupy
        self.cupy = cupy
        self._ndarray = cupy.ndarray
        self._copyto = cupy.copyto
        self.serves = cupy.copyto    # the array module's: CuPy's arrays
        self._same_bytes = None      # the comparison kernel (same_many)

    def copyto(self, dst, src):
        """``cupy.copyto``; an argument into its static buffer (the same
        dtype and shape, both C-contiguous, one device) as the one memcpy
        ``cupy.copyto`` ends in, without its Python checks (a few
        microseconds a copy, several copies a step)."""
        if type(src) is self._ndarray and src.dtype == dst.dtype and \
                src.shape == dst.shape and src.flags.c_contiguous and \
                dst.flags.c_contiguous and \
                src.data.device_id == dst.data.device_id:
            if src.size:
                dst.data.copy_from_async(src.data, src.nbytes)
            return
        self._copyto(dst, src)

    def is_array(self, a):
        return isinstance(a, self.cupy.ndarray)

    def empty_like(self, a):
        return self.cupy.empty_like(a)

    @staticmethod
    def copy(a):
        return a.copy(order='K')

    def same(self, a, b):
        return self.same_many([(a, b)])[0]

    def same_many(self, pairs):
        """Whether the arrays of each pair hold the same bits. Pairs of at
        most HOST_COMPARE_BYTES in all are compared on the host (no kernel
        to compile or load: most of a small model's capture otherwise).
        Past that, each pair of one dense layout (``_dense``: the same
        strides, no gaps) on the current device by one kernel over its
        bytes, all with one wait for the device; any other pair larger
        than HOST_COMPARE_BYTES with CuPy's ``array_equal``, the rest on
        the host."""
        cupy = self.cupy
        out = [a.shape == b.shape and a.dtype == b.dtype for a, b in pairs]
        on_device = []
        if sum(a.nbytes for (a, _), ok in zip(pairs, out) if ok) > \
                HOST_COMPARE_BYTES:
            here = cupy.cuda.Device().id
            on_device = [
                k for k, ((a, b), ok) in enumerate(zip(pairs, out))
                if ok and a.size and a.strides == b.strides and _dense(a)
                and a.data.device_id == here == b.data.device_id]
        if on_device:
            if self._same_bytes is None:
                self._same_bytes = cupy.RawKernel(_SAME_BYTES, 'same_bytes')
            differs = cupy.zeros(len(on_device), numpy.int32)
            for j, k in enumerate(on_device):
                a, b = pairs[k]
                n = a.nbytes
                self._same_bytes((min((n + 255) // 256, 4096),), (256,), (
                    a, b, numpy.uint64(n), differs, numpy.int32(j)))
            for k, d in zip(on_device, differs.get()):
                out[k] = not d
        done = set(on_device)
        for k, ((a, b), ok) in enumerate(zip(pairs, out)):
            if not ok or k in done:
                continue
            if a.nbytes > HOST_COMPARE_BYTES:
                out[k] = bits.same_bits(a, b, cupy.array_equal)
            else:
                out[k] = bits.same_bits(cupy.asnumpy(a), cupy.asnumpy(b),
                                        numpy.array_equal)
        return out

    def capture(self, run, inputs):
        cupy = self.cupy
        pool = cupy.cuda.MemoryPool()
        # A blocking stream: work that reaches the legacy default stream
        # during capture (an explicit Stream.null) then fails the capture
        # instead of running outside it.
        stream = cupy.cuda.Stream()
        outputs = graph = err = None
        with cupy.cuda.using_allocator(pool.malloc), stream, \
                capture_guard.Guard(cupy) as guard:
            stream.begin_capture()
            try:
                outputs = run(inputs)
                guard.check()
            except BaseException as e:   # (the capture is ended first)
                err = e
            try:
                # Ended whatever happened; a capture that CUDA invalidated
                # (a synchronization, a read of a value) raises here.
                graph = stream.end_capture()
            except Exception as e:
                err = err or e
        if isinstance(err, NotCapturable) or \
                not isinstance(err, (Exception, type(None))):
            raise err
        if err is not None:
            text = str(err).splitlines()
            raise NotCapturable('capture failed: %s%s' % (
                type(err).__name__, ': ' + text[0] if text else ''))
        graph.upload(cupy.cuda.get_current_stream())
        return graph, tuple(outputs), (pool, stream)

    def launch(self, graph):
        graph.launch()
