"""Run a schedule: compile it to one straight-line Python function.

Replay must cost one call per op and nothing else, so the schedule is turned
into Python source once (``b3 = f0((b0, b1))[0]`` ...), with locals for
buffers and ``del`` after a buffer's last use so memory is released as early
as define-by-run releases it. The same code serves NumPy and CuPy: the array
module only enters through ``copyto``.
"""
from schedules import ir

_LIVE_ROLES = (ir.PARAM, ir.PERSIST, ir.CONST)


class CompiledSchedule(object):
    """A schedule compiled to ``run(args) -> tuple``.

    ``args`` holds the values of ``schedule.inputs`` in order; the result the
    values of ``schedule.outputs`` followed by ``extra_outputs``.
    """

    def __init__(self, schedule, run, source):
        self.schedule = schedule
        self.run = run
        self.source = source

    def __call__(self, args):
        return self.run(args)


def compile_schedule(schedule, copyto, extra_outputs=(), copy_outputs=(),
                     preset=()):
    """Compile ``schedule``.

    copyto: ``copyto(dst, src)`` of the array module (numpy.copyto,
        cupy.copyto); used to refresh static buffers in place.
    extra_outputs: buffer ids returned after the schedule's outputs (values a
        later schedule needs, such as activations saved for backward).
    copy_outputs: buffer ids whose returned value must be a copy (they are
        static storage that the next run overwrites).
    preset: buffer ids that are defined outside (bound through ``args`` after
        the schedule inputs, in this order).
    """
    bufs = schedule.buffers
    env = {'copyto': copyto}
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
        for i, b in enumerate(bound):
            if bufs[b].static:
                lines.append('    copyto(%s, a%d)' % (ref(b), i))
                lines.append('    del a%d' % i)

    keep = set(schedule.outputs) | set(extra_outputs)
    frees = {}
    last = {}
    for i, op in enumerate(schedule.ops):
        for b in op.inputs:
            last[b] = i
        for b in op.outputs:
            last.setdefault(b, i)
    for b, i in last.items():
        buf = bufs[b]
        if b in keep or buf.static or buf.role in _LIVE_ROLES:
            continue
        frees.setdefault(i, []).append(b)

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
        lines.append('    _r = %s((%s))' % (fname, args))
        for b, pos in zip(op.outputs, op.select):
            if bufs[b].static:
                lines.append('    copyto(%s, _r[%d])' % (ref(b), pos))
            else:
                lines.append('    %s = _r[%d]' % (ref(b), pos))
        dead = [ref(b) for b in sorted(frees.get(i, ()))]
        dead.append('_r')
        lines.append('    del %s' % ', '.join(dead))

    outs = []
    for b in tuple(schedule.outputs) + tuple(extra_outputs):
        r = ref(b)
        outs.append(r + '.copy()' if b in copy_outputs else r)
    lines.append('    return (%s)' % ''.join(o + ', ' for o in outs))
    source = '\n'.join(lines) + '\n'
    code = compile(source, '<schedule %s>' % schedule.name, 'exec')
    exec(code, env)
    return CompiledSchedule(schedule, env['run'], source)
