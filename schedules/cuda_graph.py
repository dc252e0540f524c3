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
import threading

from schedules import ir

_STABLE_ROLES = (ir.PARAM, ir.PERSIST, ir.CONST)
# Results that must not be handed to the caller as the graph's own memory
# (the next launch overwrites it) are copied out after each launch.


class NotCapturable(Exception):
    """Why a schedule runs launch by launch instead of as a graph."""


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
    needs the static results); ``on_capture(graph)``: told once.
    """

    def __init__(self, tiered, backend, after=1, static_results=(),
                 state=None, allowed=None, on_capture=None, owned=None):
        self.tiered = tiered
        self.backend = backend
        self.after = after
        self.static_results = frozenset(static_results)
        self.state = state
        self.allowed = allowed
        self.on_capture = on_capture
        self.owned = owned
        self.graph = None
        self.reason = None         # why not (for good), or None
        self.captures = 0
        self.launches = 0
        self.stale = 0             # graphs dropped for a replaced parameter
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
            if out is not None:
                self.launches += 1
                return out
            # Stale: a parameter's array was replaced. Captured again, but
            # not at every call (``use_fp32_update`` replaces them all).
            self.graph = None
            self.stale += 1
            if self.stale >= 2:
                self.reason = (
                    'parameter arrays were replaced between calls %d times '
                    '(optimizer.use_fp32_update(), W.array = ...): the '
                    'graph reads parameters in place' % self.stale)
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
                             self.state() if self.state else (), self.owned)
        except NotCapturable as e:
            self.reason = str(e)
            out = getattr(e, 'result', None)
            return out if out is not None else self.tiered(args)
        self.graph = g
        self.captures += 1
        self.launches += 1
        if self.on_capture is not None:
            self.on_capture(g)
        return out


class GraphedRun(object):
    """A captured schedule: ``replay(args)`` -> results, or None where an
    argument read in place is no longer the captured array."""

    def __init__(self, graph, inputs, in_place, outputs, copy_out, backend,
                 keep):
        self.graph = graph
        self.inputs = inputs          # the captured arrays, per argument
        self.in_place = in_place      # per argument: 'param', 'owned', None
        self.outputs = outputs        # the graph's results (its memory)
        self.copy_out = copy_out      # per result: copy after each launch
        self.backend = backend
        self.keep = keep              # the pool, the stream: alive with it

    def replay(self, args):
        copyto = self.backend.copyto
        for a, s, how in zip(args, self.inputs, self.in_place):
            if a is s:
                continue
            if how == 'param':
                return None
            copyto(s, a)
        if args.__class__ is list:
            args.clear()
        self.backend.launch(self.graph)
        copy = self.backend.copy
        return tuple(copy(o) if c else o
                     for o, c in zip(self.outputs, self.copy_out))

    def static_arrays(self):
        """The results that stay the graph's memory (not copied out)."""
        return [o for o, c in zip(self.outputs, self.copy_out) if not c]


def _check_arrays(backend, what, arrays):
    for i, a in enumerate(arrays):
        if not backend.is_array(a):
            raise NotCapturable(
                '%s %d is %s, not a device array: its value would be '
                'frozen at capture' % (what, i, type(a).__name__))


def capture(run, schedule, args, backend, static_results=(), state=(),
            owned=None):
    """Run the compiled schedule ``run`` on this call's ``args`` launch by
    launch, capture it, launch the graph from the same state and check that
    both agree bit for bit; return ``(GraphedRun, this call's results)``.
    Raises NotCapturable if it cannot be replayed as a graph; then
    ``.result`` holds this call's results (of the launch-by-launch run,
    whose effects stand), or None where the schedule did not run."""
    args = tuple(args)
    _check_arrays(backend, 'argument', args)
    bufs = schedule.buffers
    roles = [bufs[b].role for b in schedule.inputs]
    roles += [None] * (len(args) - len(roles))    # preset buffers
    in_place, inputs = [], []
    for a, role in zip(args, roles):
        if role in _STABLE_ROLES:
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
    touched = [s for s, role in zip(inputs, roles)
               if role not in (ir.PARAM, ir.CONST)]
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

    def refuse(e):
        for a, w in zip(touched, after):
            backend.copyto(a, w)
        e.result = want
        return e

    try:
        _check_arrays(backend, 'result', want)
    except NotCapturable as e:
        raise refuse(e)
    for a, b in zip(touched, before):
        backend.copyto(a, b)
    try:
        graph, outputs, keep = backend.capture(run, inputs)
    except NotCapturable as e:
        raise refuse(e)
    for a, b in zip(touched, before):
        # (A capture runs nothing on the device; this is for backends that
        # do run something while capturing.)
        backend.copyto(a, b)
    copy_out = tuple(i not in static_results for i in range(len(outputs)))
    g = GraphedRun(graph, inputs, tuple(in_place), tuple(outputs),
                   copy_out, backend, keep)
    backend.launch(graph)
    bad = [i for i, (o, w) in enumerate(zip(outputs, want))
           if not backend.same(o, w)]
    bad_state = [i for i, (a, w) in enumerate(zip(touched, after))
                 if not backend.same(a, w)]
    if bad or bad_state:
        raise refuse(NotCapturable(
            'the graph\'s first replay differs from the schedule run '
            'launch by launch (results %s%s): a kernel that is not '
            'deterministic, or a host value the capture froze' % (
                ', '.join(map(str, bad)) or 'none',
                '; arrays updated in place %s' % ', '.join(map(
                    str, bad_state)) if bad_state else '')))
    return g, tuple(copy(o) if c else o for o, c in zip(outputs, copy_out))


class _Guard(object):
    """While a schedule is captured on this thread: refuse what a graph
    cannot repeat and CUDA would let pass (transfers from host memory,
    random draws), by hooks on CuPy's pinned-memory allocator and its
    random generators."""

    def __init__(self, cupy):
        self.cupy = cupy
        self.thread = threading.get_ident()
        self.undo = []

    def _mine(self):
        return threading.get_ident() == self.thread

    def __enter__(self):
        cupy = self.cupy
        pinned = cupy.get_default_pinned_memory_pool().malloc
        guard = self

        def pinned_malloc(size):
            if guard._mine():
                raise NotCapturable(
                    'a kernel copies from host memory (%d bytes through '
                    'pinned memory): a graph would copy that host buffer '
                    'again at every replay' % size)
            return pinned(size)

        cupy.cuda.set_pinned_memory_allocator(pinned_malloc)
        self.undo.append(
            lambda: cupy.cuda.set_pinned_memory_allocator(pinned))
        self._hook_random()
        return self

    def _hook_random(self):
        import cupy.random._generator as generator
        guard = self

        def refuse(name, inner):
            def hooked(*a, **k):
                if guard._mine():
                    raise NotCapturable(
                        'it draws random numbers from CuPy (%s): a graph '
                        'would not advance the generator as a launch from '
                        'Python does' % name)
                return inner(*a, **k)
            return hooked

        cls = generator.RandomState
        old_seed = cls.__dict__['_get_seed']
        cls._get_seed = refuse('RandomState', old_seed)
        self.undo.append(lambda: setattr(cls, '_get_seed', old_seed))
        try:
            from cupy_backends.cuda.libs import curand
            names = [n for n in dir(curand) if n.startswith('generate')]
        except Exception:   # no cuRAND: nothing draws from it
            return
        for n in names:
            old = getattr(curand, n)
            try:
                setattr(curand, n, refuse('cuRAND ' + n, old))
            except (AttributeError, TypeError):   # a read-only module
                continue
            self.undo.append(
                lambda n=n, old=old: setattr(curand, n, old))

    def __exit__(self, *exc):
        while self.undo:
            self.undo.pop()()
        return False


class CupyBackend(object):
    """Graphs on CuPy: capture on a stream of its own, allocations from a
    private pool, launch on the current stream."""

    def __init__(self):
        import cupy
        self.cupy = cupy
        self.copyto = cupy.copyto
        self.serves = cupy.copyto    # the array module's: CuPy's arrays

    def is_array(self, a):
        return isinstance(a, self.cupy.ndarray)

    def empty_like(self, a):
        return self.cupy.empty_like(a)

    @staticmethod
    def copy(a):
        return a.copy(order='K')

    def same(self, a, b):
        cupy = self.cupy
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        if a.dtype.kind in 'fc':
            return bool(cupy.array_equal(a, b, equal_nan=True))
        return bool(cupy.array_equal(a, b))

    def capture(self, run, inputs):
        cupy = self.cupy
        pool = cupy.cuda.MemoryPool()
        # A blocking stream: work that reaches the legacy default stream
        # during capture (an explicit Stream.null) then fails the capture
        # instead of running outside it.
        stream = cupy.cuda.Stream()
        outputs = graph = err = None
        with cupy.cuda.using_allocator(pool.malloc), stream, _Guard(cupy):
            stream.begin_capture()
            try:
                outputs = run(inputs)
            except Exception as e:
                err = e
            try:
                # Ended whatever happened; a capture that CUDA invalidated
                # (a synchronization, a read of a value) raises here.
                graph = stream.end_capture()
            except Exception as e:
                err = err or e
        if isinstance(err, NotCapturable):
            raise err
        if err is not None:
            text = str(err).splitlines()
            raise NotCapturable('capture failed: %s%s' % (
                type(err).__name__, ': ' + text[0] if text else ''))
        graph.upload(cupy.cuda.get_current_stream())
        return graph, tuple(outputs), (pool, stream)

    def launch(self, graph):
        graph.launch()
