"""Run a schedule: compile it to one straight-line Python function.

Replay must cost one call per op and nothing else, so the schedule is turned
into Python source once (``b3 = f0((b0, b1))[0]`` ...), with locals for
buffers and ``del`` after a buffer's last use so memory is released as early
as define-by-run releases it. The same code serves NumPy and CuPy: the array
module only enters through ``copyto``.
"""
from schedules import ir
from schedules import liveness
from schedules import placement
from schedules import stream as stream_module

_LIVE_ROLES = liveness.LIVE_ROLES


class CompiledSchedule(object):
    """A schedule compiled to ``run(args) -> tuple``.

    ``args`` holds the values of ``schedule.inputs`` in order; the result the
    values of ``schedule.outputs`` followed by ``extra_outputs``. A list
    ``args`` is emptied once bound (the schedule owns the values from then
    on), a tuple is left alone.
    """

    def __init__(self, schedule, run, source):
        self.schedule = schedule
        self.run = run
        self.source = source

    def __call__(self, args):
        return self.run(args)


class TieredSchedule(object):
    """Interpret the first ``threshold`` runs, then compile.

    Compiling a long schedule costs milliseconds; a key that is used once or
    twice (the last, shorter batch of an epoch) should not pay for it.
    """

    def __init__(self, schedule, copyto, threshold=2, before_compile=None,
                 **options):
        self.schedule = schedule
        self.copyto = copyto
        self.before_compile = before_compile   # f(schedule), once
        self.options = options
        self.left = threshold
        self.compiled = None
        # The compiled function once there is one. (Not a bound method of
        # self kept on self: that is a reference cycle, which leaves a
        # dropped schedule to the garbage collector instead of freeing it.)
        self.run = None
        self._table = None

    @property
    def source(self):
        return self._get_compiled().source

    def _get_compiled(self):
        if self.compiled is None:
            if self.before_compile is not None:
                self.before_compile(self.schedule)
                self.before_compile = None
            self.compiled = compile_schedule(self.schedule, self.copyto,
                                             **self.options)
        return self.compiled

    def _interpret(self, args):
        self.left -= 1
        if self._table is None:
            self._table = _table(self.schedule, **self.options)
        return _interpret(self._table, args, self.copyto,
                          self.options.get('copy', _copy))

    def __call__(self, args):
        run = self.run
        if run is not None:
            return run(args)
        if self.left > 0:
            return self._interpret(args)
        self.run = run = self._get_compiled().run
        # The interpreter's table holds the kernels it ran (probes that
        # have since chosen a kernel, with what they closed over): no
        # longer needed.
        self._table = None
        return run(args)


def _copy(a):
    return a.copy(order='K')


def _table(schedule, extra_outputs=(), copy_outputs=(), preset=(),
           free=True, copy=_copy, pair=None, stream=None):
    # The interpreter holds every buffer until it returns: ``free`` is for
    # compile_schedule.
    bufs = schedule.buffers
    slot = {}

    def idx(b):
        if b not in slot:
            slot[b] = len(slot)
        return slot[b]

    bound = [(idx(b), bufs[b].storage if bufs[b].static else None)
             for b in tuple(schedule.inputs) + tuple(preset)]
    fixed = [(idx(b), bufs[b].storage) for b in bufs
             if bufs[b].role in _LIVE_ROLES or bufs[b].static]
    ops = []
    for op in schedule.ops:
        if op.fn is None:
            continue
        outs = [(idx(b), pos, bufs[b].storage if bufs[b].static else None)
                for b, pos in zip(op.outputs, op.select)]
        ops.append((op.fn, [idx(b) for b in op.inputs], outs))
    rets = [(idx(b), b in copy_outputs)
            for b in tuple(schedule.outputs) + tuple(extra_outputs)]
    return len(slot), bound, fixed, ops, rets


def _interpret(table, args, copyto, copy=_copy):
    n, bound, fixed, ops, rets = table
    s = [None] * n
    for i, storage in fixed:
        s[i] = storage
    for (i, storage), a in zip(bound, args):
        if storage is None:
            s[i] = a
        else:
            copyto(storage, a)
    if args.__class__ is list:
        args.clear()
    for fn, ins, outs in ops:
        r = fn(tuple([s[i] for i in ins]))
        for i, pos, storage in outs:
            if storage is None:
                s[i] = r[pos]
            else:
                copyto(storage, r[pos])
    return tuple(copy(s[i]) if c else s[i] for i, c in rets)


def _pairs(schedule, plan, hold_at, pair, streamed=()):
    """{op index i: runner} for ops i and i + 1 that can run at the same
    time: neither writes a static buffer or into an input (``aliases``),
    the second reads nothing the first makes, and a result either places
    in dead memory goes to a host held before the first runs (so neither
    writes memory the other reads); ``pair(op_a, op_b)`` gives the runner
    or None."""
    if pair is None:
        return {}
    bufs = schedule.buffers
    held_from = {}
    for i, hs in hold_at.items():
        for h, _ in hs:
            held_from[h] = i
    ops = schedule.ops
    out = {}
    i = 0
    while i + 1 < len(ops):
        a, b = ops[i], ops[i + 1]
        ok = i not in streamed and i + 1 not in streamed and \
            a.fn is not None and b.fn is not None and \
            a.outputs and b.outputs and not set(a.outputs) & set(b.inputs)
        for op in (a, b):
            if not ok:
                break
            ok = not getattr(op.fn, 'aliases', None) and \
                op.select == tuple(range(len(op.outputs))) and \
                not any(bufs[x].static for x in op.outputs) and \
                all(held_from.get(plan.places[x][0], -1) < i
                    for x in op.outputs if x in plan.places)
        runner = pair(a, b) if ok else None
        if runner is not None:
            out[i] = runner
            i += 2
        else:
            i += 1
    return out


def compile_schedule(schedule, copyto, extra_outputs=(), copy_outputs=(),
                     preset=(), free=True, copy=_copy, place=True,
                     pair=None, stream=None):
    """Compile ``schedule``.

    copyto: ``copyto(dst, src)`` of the array module (numpy.copyto,
        cupy.copyto); used to refresh static buffers in place.
    extra_outputs: buffer ids returned after the schedule's outputs (values a
        later schedule needs, such as activations saved for backward).
    copy_outputs: buffer ids whose returned value must be a copy (they are
        static storage that the next run overwrites).
    preset: buffer ids that are defined outside (bound through ``args`` after
        the schedule inputs, in this order).
    free: release each buffer after its last use (False: when the run
        returns, for comparison).
    copy: ``copy(array)`` for ``copy_outputs`` (default: NumPy's or CuPy's
        copy in the array's memory order).
    place: write results into dead memory where ``schedule.memory`` (the
        front end's ``placement.Facts``) and the kernels allow it
        (placement.py); the plan is kept as ``schedule.placement``.
    pair: ``pair(op_a, op_b)``, for two neighbouring ops that could run at
        the same time (``_pairs``), a runner ``runner(fa, xa, fb, xb) ->
        (fa(*xa), fb(*xb))`` that may run them on two threads, or None
        (``parallel.Pair``).
    stream: ``stream(op)``, 'head', 'follow' or None: which ops may go to
        the stream's worker thread (``stream.select``), with
        ``stream.threads`` the threads allowed; None: none go.
    """
    bufs = schedule.buffers
    env = {'copyto': copyto, 'copy': copy, 'take': placement.take}
    lines = ['def run(args):']
    names = {}

    def ref(b):
        if b in names:
            return names[b]
        buf = bufs[b]
        if buf.role in _LIVE_ROLES or buf.static:
            name = ('C%d' if buf.role in _LIVE_ROLES else 'S%d') % b
            if buf.storage is None:
                raise ir.ScheduleError(
                    '%%%d is %s but has no storage' % (
                        b, 'static' if buf.static else buf.role))
            env[name] = buf.storage
        else:
            name = 'b%d' % b
        names[b] = name
        return name

    bound = tuple(schedule.inputs) + tuple(preset)
    if bound:
        targets = []
        for i, b in enumerate(bound):
            buf = bufs[b]
            if buf.static:
                targets.append('a%d' % i)
            else:
                targets.append(ref(b))
        lines.append('    %s, = args' % ', '.join(targets))
        # A list argument is handed over: clearing it lets each buffer die
        # at its last use instead of when the caller lets go.
        lines.append('    if args.__class__ is list: args.clear()')
        for i, b in enumerate(bound):
            if bufs[b].static:
                lines.append('    copyto(%s, a%d)' % (ref(b), i))
                lines.append('    del a%d' % i)

    returned = tuple(schedule.outputs) + tuple(extra_outputs)
    live = liveness.of(schedule)
    frees = live.frees(returned, unread=True) if free else {}
    plan = placement.Placement()
    if free and place and schedule.memory is not None:
        plan = placement.plan(schedule, schedule.memory,
                              keep=returned + tuple(copy_outputs))
        schedule.placement = plan
    # Hosts' memory is held from their death (by ``H<id>``) to the last op
    # that takes from it.
    hold_at = {}
    for h, b in plan.holder.items():
        hold_at.setdefault(live.last_use(b), []).append((h, b))
    release_at = {}
    for h, i in plan.held.items():
        release_at.setdefault(i, []).append(h)

    streamed = stream_module.select(schedule, plan, stream) \
        if free and stream is not None else frozenset()
    if streamed:
        env['S'] = schedule.stream = stream_module.Stream(stream.threads)
        lines.append('    R = S.begin()')
    else:
        schedule.stream = None
    schedule.streamed = streamed
    pairs = _pairs(schedule, plan, hold_at, pair, streamed) if free else {}
    schedule.pairs = pairs
    waiting = None       # the first op of a pair: (index, call pieces)
    for i, op in enumerate(schedule.ops):
        if op.fn is None:
            for b in op.outputs:
                if not bufs[b].static:
                    raise ir.ScheduleError(
                        'op %d (%s) has no kernel but writes non-static '
                        '%%%d' % (i, op.kind, b))
            continue
        fname = 'f%d' % i
        env[fname] = op.fn
        args = ', '.join(ref(b) for b in op.inputs)
        if len(op.inputs) == 1:
            args += ','
        fn_name, fn_args = fname, '(%s)' % args
        placed = [(b, pos) for b, pos in zip(op.outputs, op.select)
                  if b in plan.places]
        if placed:
            # ``into`` with the memory each placed result goes to.
            gname = 'g%d' % i
            env[gname] = op.fn.into
            outs = ['None'] * (max(op.select) + 1)
            for b, pos in placed:
                h, off = plan.places[b]
                buf = bufs[b]
                dname = 'D_' + buf.dtype.str.replace('<', 'l').replace(
                    '>', 'b').replace('|', 'n')
                env[dname] = buf.dtype
                outs[pos] = 'take(H%d, %d, %r, %s, %d)' % (
                    h, off, buf.shape, dname, buf.nbytes)
            fn_name, fn_args = gname, '(%s), (%s,)' % (args,
                                                      ', '.join(outs))
        call = '%s(%s)' % (fn_name, fn_args)
        if i in streamed:
            # Its results: not to be read before R.end() (select).
            lines.extend(_unpack([ref(b) for b in op.outputs],
                                 'R.put(%s, (%s))' % (fname, args)))
            lines.extend(_after(i, hold_at, release_at, frees, ref))
            continue
        if i in pairs:
            waiting = (i, fn_name, fn_args)
            continue
        if waiting is not None:
            # Both ops of the pair at once; then each one's bookkeeping.
            j, a_name, a_args = waiting
            waiting = None
            pname = 'P%d' % j
            env[pname] = pairs[j]
            lines.append('    _ra, _rb = %s(%s, (%s,), %s, (%s,))' % (
                pname, a_name, a_args, fn_name, fn_args))
            a_op = schedule.ops[j]
            lines.extend(_unpack([ref(b) for b in a_op.outputs], '_ra'))
            lines.extend(_after(j, hold_at, release_at, frees, ref))
            lines.extend(_unpack([ref(b) for b in op.outputs], '_rb'))
            lines.extend(_after(i, hold_at, release_at, frees, ref))
            continue
        static = [bufs[b].static for b in op.outputs]
        if not any(static) and op.select == tuple(range(len(op.outputs))):
            # One line: unpack the result tuple (padding unused tails).
            lines.extend(_unpack([ref(b) for b in op.outputs], call))
        else:
            lines.append('    _r = ' + call)
            for b, pos in zip(op.outputs, op.select):
                if bufs[b].static:
                    lines.append('    copyto(%s, _r[%d])' % (ref(b), pos))
                else:
                    lines.append('    %s = _r[%d]' % (ref(b), pos))
        lines.extend(_after(i, hold_at, release_at, frees, ref))

    if streamed:
        lines.append('    R.end()')
    outs = []
    for b in tuple(schedule.outputs) + tuple(extra_outputs):
        r = ref(b)
        outs.append('copy(%s)' % r if b in copy_outputs else r)
    lines.append('    return (%s)' % ''.join(o + ', ' for o in outs))
    source = '\n'.join(lines) + '\n'
    code = compile(source, '<schedule %s>' % schedule.name, 'exec')
    exec(code, env)
    # Out of its own globals: ``run`` -> globals -> ``run`` would be a
    # reference cycle holding every kernel until the garbage collector runs.
    return CompiledSchedule(schedule, env.pop('run'), source)


# Python compiles ``a, b, *_ = r`` for at most 255 names before the star.
_MAX_STARRED = 255


def _unpack(targets, expr):
    """The lines that set ``targets`` to the first results of ``expr``
    (a result tuple may be longer: padding unused tails)."""
    if not targets:
        return ['    %s' % expr]
    if len(targets) <= _MAX_STARRED:
        return ['    %s, *_ = %s' % (', '.join(targets), expr)]
    # (F.stack of 300 pieces: its backward's 300 gradients)
    return ['    _r = %s' % expr] + [
        '    %s = _r[%d]' % (t, k) for k, t in enumerate(targets)] + \
        ['    del _r']


def _after(i, hold_at, release_at, frees, ref):
    """The lines after op ``i``: memory held, let go, buffers freed."""
    lines = []
    for h, b in hold_at.get(i, ()):
        lines.append('    H%d = %s' % (h, ref(b)))
    if i in release_at:
        lines.append('    del %s' % ', '.join(
            'H%d' % h for h in sorted(release_at[i])))
    dead = [ref(b) for b in sorted(frees.get(i, ()))]
    if dead:
        lines.append('    del %s' % ', '.join(dead))
    return lines
