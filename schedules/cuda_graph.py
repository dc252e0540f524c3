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
import ctypes
import os
import threading

import numpy

from schedules import bits
from schedules import ir

_STABLE_ROLES = (ir.PARAM, ir.PERSIST, ir.CONST)
# Results that must not be handed to the caller as the graph's own memory
# (the next launch overwrites it) are copied out after each launch.


# Process-wide counts, for benchmarks and fuzzing reports.
counts = {'captured': 0, 'refused': 0, 'stale': 0}


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
    needs the static results); ``on_capture(graph)``: told of each graph.
    (A graph dropped as stale leaves its static results where they are: a
    call from before may still read them.)
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
                             self.state() if self.state else (), self.owned)
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
                 keep, written=()):
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

    def replay(self, args):
        """This call's results, or None (and ``stale`` says why) where the
        graph no longer fits: an argument read in place is another array,
        or a host value differs from the captured one."""
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
        return tuple(copy(o) if c else o
                     for o, c in zip(self.outputs, self.copy_out))

    def static_arrays(self):
        """The results that stay the graph's memory (not copied out)."""
        return [o for o, c in zip(self.outputs, self.copy_out)
                if not c and self.backend.is_array(o)]


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


def _same(backend, a, b):
    if backend.is_array(a) and backend.is_array(b):
        return backend.same(a, b)
    return type(a) is type(b) and (a == b or (a != a and b != b))


def capture(run, schedule, args, backend, static_results=(), state=(),
            owned=None):
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
    written = tuple(i for i, a, b in zip(copied, after, before)
                    if roles[i] != ir.INPUT or not backend.same(a, b))

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
                   copy_out, backend, keep, written)
    result = g.launch([args[i] for i in written])
    bad = [i for i, (o, w) in enumerate(zip(outputs, want))
           if not _same(backend, o, w)]
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
    return g, result


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
        self._hook_cublas()
        self._host_rng = _host_random_states()
        return self

    def _hook_cublas(self):
        """CuPy refuses any cuBLAS call while a stream captures (its
        ``setStream`` raises NotImplementedError; cuBLAS itself supports
        capture). Its matrix products reach cuBLAS through attributes of
        ``cupy_backends.cuda.libs.cublas`` looked up at each call, so while
        capturing, the GEMM entry points CuPy uses go to the same cuBLAS
        functions of the same library, on the same handle and with the same
        arguments, through ctypes, after setting the handle's stream
        without that check. (The first replay's comparison with the run
        launch by launch stands behind this too.)"""
        try:
            from cupy_backends.cuda.libs import cublas
            lib = _cublas_library()
        except Exception:   # no cuBLAS: nothing calls it
            return
        cupy = self.cupy
        guard = self
        for name, (symbol, sig) in _CUBLAS_GEMMS.items():
            old = getattr(cublas, name, None)
            fn = getattr(lib, symbol, None)
            if old is None or fn is None:
                continue
            fn.restype = ctypes.c_int
            fn.argtypes = [_CTYPES[c] for c in sig]

            def direct(handle, *args, _fn=fn, _old=old, _name=symbol):
                if not guard._mine():
                    return _old(handle, *args)
                stream = cupy.cuda.get_current_stream().ptr
                status = lib.cublasSetStream_v2(handle, stream)
                if status == 0:
                    status = _fn(handle, *args)
                if status != 0:
                    raise NotCapturable('%s returned cuBLAS status %d while '
                                        'capturing' % (_name, status))

            setattr(cublas, name, direct)
            self.undo.append(
                lambda name=name, old=old: setattr(cublas, name, old))

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

    def check(self):
        """After the captured run: did it draw from NumPy's or Python's
        global generator (a host value the graph would freeze)?"""
        if _host_random_states() != self._host_rng:
            raise NotCapturable(
                'it draws random numbers on the host (NumPy\'s or Python\'s '
                'global generator): a graph would repeat the first draw')

    def __exit__(self, *exc):
        while self.undo:
            self.undo.pop()()
        return False


def _host_random_states():
    import random
    import numpy
    st = numpy.random.get_state()
    return (st[0], st[1].tobytes(), st[2:], random.getstate())


# cuBLAS GEMM entry points of CuPy's binding -> (C symbol, argument kinds:
# h handle, p pointer, i int, q 64-bit int), as cublas_api.h declares them.
_CUBLAS_GEMMS = {
    'gemmEx': ('cublasGemmEx', 'hiiiiippiipiippiiii'),
    'gemmStridedBatchedEx': ('cublasGemmStridedBatchedEx',
                             'hiiiiippiiqpiiqppiiqiii'),
    'gemmBatchedEx': ('cublasGemmBatchedEx', 'hiiiiippiipiippiiiii'),
    'sgemmEx': ('cublasSgemmEx', 'hiiiiippiipiippii'),
    'sgemm': ('cublasSgemm_v2', 'hiiiiippipippi'),
    'dgemm': ('cublasDgemm_v2', 'hiiiiippipippi'),
    'sgemmBatched': ('cublasSgemmBatched', 'hiiiiippipippii'),
    'dgemmBatched': ('cublasDgemmBatched', 'hiiiiippipippii'),
    'sgemmStridedBatched': ('cublasSgemmStridedBatched',
                            'hiiiiippiqpiqppiqi'),
    'dgemmStridedBatched': ('cublasDgemmStridedBatched',
                            'hiiiiippiqpiqppiqi'),
}
_CTYPES = {'h': ctypes.c_void_p, 'p': ctypes.c_void_p, 'i': ctypes.c_int,
           'q': ctypes.c_longlong}
_cublas_lib = []


def _cublas_library():
    """The libcublas this process loaded (CuPy's), through ctypes."""
    if not _cublas_lib:
        path = None
        with open('/proc/self/maps') as f:
            for line in f:
                name = line.rsplit(None, 1)[-1]
                if os.path.basename(name).startswith('libcublas.so'):
                    path = name
                    break
        if path is None:
            raise OSError('libcublas is not loaded')
        lib = ctypes.CDLL(path)
        lib.cublasSetStream_v2.restype = ctypes.c_int
        lib.cublasSetStream_v2.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        _cublas_lib.append(lib)
    return _cublas_lib[0]


# Arrays up to this size are compared after a copy to the host.
HOST_COMPARE_BYTES = 16 << 20


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
        if a.nbytes <= HOST_COMPARE_BYTES:
            # On the host: CuPy's comparison kernels would be compiled or
            # loaded first (tens of milliseconds in a fresh process, most
            # of a small model's capture).
            return bits.same_bits(cupy.asnumpy(a), cupy.asnumpy(b),
                                  numpy.array_equal)
        return bits.same_bits(a, b, cupy.array_equal)

    def capture(self, run, inputs):
        cupy = self.cupy
        pool = cupy.cuda.MemoryPool()
        # A blocking stream: work that reaches the legacy default stream
        # during capture (an explicit Stream.null) then fails the capture
        # instead of running outside it.
        stream = cupy.cuda.Stream()
        outputs = graph = err = None
        with cupy.cuda.using_allocator(pool.malloc), stream, \
                _Guard(cupy) as guard:
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
