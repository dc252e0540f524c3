"""Schedule IR: buffers, ops and schedules as plain data.

A ``Schedule`` is a straight-line program over numbered buffers. It knows
nothing about Chainer: an op's ``fn`` is an opaque callable that takes a tuple
of input arrays and returns a tuple of output arrays.
"""
import numpy

# Buffer roles.
INPUT = 'input'      # an argument of the call (array or Variable)
PARAM = 'param'      # a parameter array (looked up live on every call)
PERSIST = 'persist'  # a persistent value of a link (BatchNorm statistics)
CONST = 'const'      # an array created while recording, frozen
TEMP = 'temp'        # produced by an op
STATE = 'state'      # hidden state an op keeps on itself (dropout mask, ...)
GRAD_OUT = 'grad_out'  # gradient fed into the backward schedule

ROLES = (INPUT, PARAM, PERSIST, CONST, TEMP, STATE, GRAD_OUT)

_DTYPE_SHORT = {
    'float16': 'f16', 'float32': 'f32', 'float64': 'f64',
    'int8': 'i8', 'int16': 'i16', 'int32': 'i32', 'int64': 'i64',
    'uint8': 'u8', 'bool': 'bool',
}


def dtype_short(dtype):
    name = numpy.dtype(dtype).name
    return _DTYPE_SHORT.get(name, name)


class Buffer(object):
    """One array slot of a schedule.

    ``static`` buffers keep one array object for their whole life: ops write
    into it (``storage``) so that anything holding a reference to it sees the
    current values. Other buffers are rebound to each op's fresh result.
    """

    __slots__ = ('id', 'shape', 'dtype', 'role', 'name', 'static', 'storage',
                 'view_of', 'offset')

    def __init__(self, id, shape, dtype, role, name=None, static=False,
                 storage=None):
        if role not in ROLES:
            raise ValueError('unknown buffer role %r' % (role,))
        self.id = id
        self.shape = shape if type(shape) is tuple else tuple(shape)
        self.dtype = dtype if isinstance(dtype, numpy.dtype) else \
            numpy.dtype(dtype)
        self.role = role
        self.name = name
        self.static = static
        self.storage = storage
        self.view_of = None   # id of the buffer this one is a view of
        self.offset = None    # arena offset, once planned

    @property
    def nbytes(self):
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize

    def type_str(self):
        return '%s[%s]' % (dtype_short(self.dtype),
                           ','.join(str(d) for d in self.shape))

    def __repr__(self):
        return 'Buffer(%%%d %s %s%s)' % (
            self.id, self.type_str(), self.role,
            ' ' + self.name if self.name else '')


def add_buffer(buffers, like, role, name=None, storage=None):
    """A new buffer in ``buffers`` (a schedule's table) with ``like``'s
    shape and dtype; returns its id."""
    b = max(buffers) + 1
    buffers[b] = Buffer(b, like.shape, like.dtype, role, name=name,
                        storage=storage)
    return b


class Op(object):
    """One step of a schedule: ``outputs = fn(inputs)``.

    ``kind`` names the operation (a Chainer FunctionNode class name, say),
    ``attrs`` holds its static attributes (strides, axes, ...), ``source`` the
    user's file:line that recorded it. ``fn`` is None for ops that need no
    work at replay (views computed once).
    """

    __slots__ = ('kind', 'inputs', 'outputs', '_attrs', 'source', 'fn',
                 'select', 'lower_from', '__weakref__')

    def __init__(self, kind, inputs, outputs, attrs=None, source=None,
                 fn=None, select=None):
        self.kind = kind
        self.inputs = tuple(inputs)
        self.outputs = tuple(outputs)
        self._attrs = attrs if callable(attrs) else dict(attrs or {})
        self.source = source
        self.fn = fn
        # What a front end needs to pick a cheaper fn later (or None).
        self.lower_from = None
        # Positions in fn's result tuple that the outputs take (results that
        # are None or unused have no buffer).
        self.select = tuple(range(len(self.outputs))) if select is None \
            else tuple(select)
        if len(self.select) != len(self.outputs):
            raise ValueError('select and outputs differ in length')

    @property
    def attrs(self):
        if callable(self._attrs):
            self._attrs = dict(self._attrs())
        return self._attrs

    @attrs.setter
    def attrs(self, value):
        self._attrs = value

    def copy(self):
        """The same op (kind, buffers, attributes, source, kernel) as a new
        object, for another schedule over the same buffers."""
        return Op(self.kind, self.inputs, self.outputs, self._attrs,
                  self.source, self.fn, self.select)

    def __repr__(self):
        return 'Op(%s %r -> %r)' % (self.kind, self.inputs, self.outputs)


class ScheduleError(Exception):
    """A schedule broke one of its invariants."""


class Schedule(object):
    """A straight-line program: ``ops`` over ``buffers``.

    ``buffers`` maps id -> Buffer and may be shared with another schedule (the
    forward and backward schedules of one recording share one table).
    ``inputs`` are bound by the caller, ``outputs`` are returned, in order;
    ``keep`` names buffers saved for a later schedule.
    """

    def __init__(self, name, buffers, ops, inputs, outputs, notes=None,
                 keep=()):
        self.name = name
        self.buffers = buffers
        self.ops = list(ops)
        self.inputs = tuple(inputs)
        self.outputs = tuple(outputs)
        self.notes = list(notes or [])
        # Buffers a later schedule reads (activations saved for backward):
        # alive until the end, returned after the outputs.
        self.keep = tuple(keep)
        # What the front end knew of the buffers' memory
        # (``placement.Facts``), and where a compiled run writes its
        # results (``placement.Placement``, set when it compiles).
        self.memory = None
        self.placement = None
        # Ops a compiled run may run at the same time as the next one:
        # {index: runner} (executor._pairs), set when it compiles.
        self.pairs = {}
        # Ops a compiled run hands to the stream's worker (their indexes)
        # and the ``stream.Stream`` (stream.select), likewise.
        self.streamed = frozenset()
        self.stream = None

    # -- checks -------------------------------------------------------------
    def verify(self, preset=()):
        """Check the schedule; raise ScheduleError with the first problem.

        ``preset`` names buffers defined outside this schedule (for a backward
        schedule: the forward buffers it reads). Rules: every input of an op
        is defined before use; a buffer has one writer; outputs are defined;
        every buffer referenced exists.
        """
        defined = set(preset)
        for b in self.inputs:
            self._known(b, 'schedule input')
            defined.add(b)
        for b, buf in self.buffers.items():
            if buf.role in (PARAM, PERSIST, CONST):
                defined.add(b)
        writer = {}
        buffers = self.buffers
        inputs = set(self.inputs)
        for i, op in enumerate(self.ops):
            # The messages are formatted only for a problem: this runs
            # over every op of every recording.
            for b in op.inputs:
                if b not in buffers:
                    self._known(b, 'input of op %d (%s)' % (i, op.kind))
                if b not in defined:
                    raise ScheduleError(
                        'op %d (%s) reads %%%d before it is defined'
                        % (i, op.kind, b))
            for b in op.outputs:
                if b not in buffers:
                    self._known(b, 'output of op %d (%s)' % (i, op.kind))
                if b in writer:
                    raise ScheduleError(
                        '%%%d is written by op %d (%s) and op %d (%s)'
                        % (b, writer[b], self.ops[writer[b]].kind, i,
                           op.kind))
                if b in inputs:
                    raise ScheduleError(
                        'op %d (%s) overwrites schedule input %%%d'
                        % (i, op.kind, b))
                writer[b] = i
                defined.add(b)
        for b in self.outputs + self.keep:
            self._known(b, 'schedule output')
            if b not in defined:
                raise ScheduleError('output %%%d is never defined' % b)
        return True

    def _known(self, b, what):
        if b not in self.buffers:
            raise ScheduleError('%s %%%s is not a buffer' % (what, b))

    # -- queries ------------------------------------------------------------
    def last_uses(self):
        """Map op index -> buffers whose last reader (in this schedule) it is
        (``liveness.Liveness.frees``). Schedule outputs and saved buffers are
        never freed."""
        from schedules import liveness
        return liveness.of(self).frees(self.outputs + self.keep)

    def kinds(self):
        """Count of ops by kind."""
        out = {}
        for op in self.ops:
            out[op.kind] = out.get(op.kind, 0) + 1
        return out

    # -- printing -----------------------------------------------------------
    def _ref(self, b):
        return '%%%d' % b

    def format(self, show_source=True):
        bufs = self.buffers
        lines = ['schedule %s (%d ops)' % (self.name, len(self.ops))]
        for b in self.inputs:
            buf = bufs[b]
            lines.append('  in   %s: %s %s%s' % (
                self._ref(b), buf.type_str(), buf.role,
                ' ' + buf.name if buf.name else ''))
        used = set()
        for op in self.ops:
            used.update(op.inputs)
        for b in sorted(used):
            buf = bufs[b]
            if buf.role in (PARAM, PERSIST, CONST) and b not in self.inputs:
                lines.append('  %-4s %s: %s%s' % (
                    buf.role, self._ref(b), buf.type_str(),
                    ' ' + buf.name if buf.name else ''))
        frees = self.last_uses()
        placed = None
        if self.placement is not None:
            from schedules import placement
            placed = placement.explain(self)
        for i, op in enumerate(self.ops):
            outs = ', '.join('%s: %s' % (self._ref(b), bufs[b].type_str())
                             for b in op.outputs)
            args = ', '.join(self._ref(b) for b in op.inputs)
            attrs = ''
            if op.attrs:
                attrs = ' {%s}' % ', '.join(
                    '%s=%s' % (k, _fmt_attr(v))
                    for k, v in sorted(op.attrs.items()))
            line = '  %s = %s(%s)%s' % (outs or '()', op.kind, args, attrs)
            marks = []
            for b in op.outputs:
                buf = bufs[b]
                if buf.view_of is not None:
                    marks.append('%s view of %s' % (self._ref(b),
                                                   self._ref(buf.view_of)))
                elif buf.static:
                    marks.append('%s static' % self._ref(b))
                if buf.offset is not None:
                    marks.append('%s @%d' % (self._ref(b), buf.offset))
                if placed is not None and b in placed.places:
                    h, off = placed.places[b]
                    marks.append('%s in dead %s+%d' % (
                        self._ref(b), self._ref(h), off))
                elif placed is not None and b in placed.reasons:
                    marks.append('%s allocated: %s' % (
                        self._ref(b), placed.reasons[b]))
            if op.fn is None:
                marks.append('no-op at replay')
            if i in self.streamed:
                marks.append('on the worker thread, collected at the end%s'
                             % (self.stream.describe()
                                if i == min(self.streamed) else ''))
            for j in (i, i - 1):
                runner = self.pairs.get(j)
                if runner is not None:
                    marks.append('at the same time as the %s op%s' % (
                        'next' if j == i else 'previous',
                        runner.describe() if j == i else ''))
            if show_source and op.source:
                marks.append(op.source)
            if marks:
                line = '%-60s # %s' % (line, '; '.join(marks))
            lines.append(line)
            if i in frees:
                lines.append('    free %s' % ', '.join(
                    self._ref(b) for b in sorted(frees[i])))
        lines.append('  return (%s)' % ', '.join(
            self._ref(b) for b in self.outputs))
        if self.keep:
            lines.append('  save (%s)' % ', '.join(
                self._ref(b) for b in self.keep))
        for note in self.notes:
            lines.append('  # ' + note)
        if placed is not None:
            lines.append('  # ' + placed.summary())
            kernels = placed.allocating_kernels(self)
            if kernels:
                lines.append('  # kernels with no out=: ' + ', '.join(
                    '%s x%d' % kv for kv in sorted(kernels.items())))
        return '\n'.join(lines)

    def __str__(self):
        return self.format()

    def export_onnx(self, path, values=None, **options):
        """Write this (inference) schedule as an ONNX model; ``values`` maps
        parameter/constant buffer ids to arrays (default: their storage).
        Options as ``schedules.onnx_export.schedule_to_onnx``."""
        from schedules import onnx_export
        if values is None:
            values = {b: buf.storage for b, buf in self.buffers.items()
                      if buf.role in (PARAM, PERSIST, CONST)}
        return onnx_export.export_schedule(self, values, path, **options)

    def __repr__(self):
        return '<Schedule %s: %d ops, %d inputs, %d outputs>' % (
            self.name, len(self.ops), len(self.inputs), len(self.outputs))


def _fmt_attr(v):
    if isinstance(v, float):
        return '%g' % v
    if isinstance(v, numpy.ndarray):
        return 'array%s' % (v.shape,)
    return repr(v)
