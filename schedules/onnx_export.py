"""Export an inference ``Schedule`` to an ONNX model.

The exporter reads only the schedule IR (``schedules.ir``): op kinds, their
``attrs`` (as given by ``static_graph.describe``), buffer shapes, dtypes and
roles. It does not import Chainer. ``onnx`` is imported lazily, so this module
can be imported without it.

Each op kind has one small converter function, registered in ``CONVERTERS``;
``supported_kinds()`` lists them. A live op (one that contributes to the
schedule's outputs) of any other kind raises ``UnsupportedOpError``.

Dynamic batch: with ``dynamic_batch=True`` the leading dimension of every
input whose leading dimension equals the recorded batch size (that of the
first input) is named ``'batch'``. The exporter follows the batch axis through
the ops (``Reshape``, ``Transpose``, ``GetItem``, reductions, broadcasts ...)
so that shape constants baked into the graph (reshape targets, broadcast
shapes) keep working for other batch sizes: a recorded reshape to
``(32, 512)`` becomes a reshape to ``(-1, 512)``. Outputs whose leading
dimension carries the batch get the symbolic dimension ``'batch'`` too.
"""
import math
import os
import re
import tempfile
import warnings

import numpy

from schedules import ir


MIN_OPSET = 13
INT64_MAX = 2 ** 63 - 1
INT64_MIN = -2 ** 63

_INSTALL_HINT = 'pip install chainer-static-graph[onnx]'


class UnsupportedOpError(ValueError):
    """An op the ONNX exporter cannot convert.

    ``kind`` is the op kind, ``source`` the user's file:line that recorded it
    (may be None) and ``detail`` why, when the kind is known but this use of it
    is not supported.
    """

    def __init__(self, kind, source=None, detail=None):
        self.kind = kind
        self.source = source
        self.detail = detail
        msg = 'cannot export op %s to ONNX' % (kind,)
        if source:
            msg += ' (recorded at %s)' % (source,)
        if detail:
            msg += ': %s' % (detail,)
        else:
            msg += ': no ONNX converter for this op kind'
        ValueError.__init__(self, msg)

    def __reduce__(self):
        return (type(self), (self.kind, self.source, self.detail))


def _import_onnx():
    try:
        import onnx
        import onnx.helper
        import onnx.numpy_helper
    except ImportError as e:
        raise ImportError(
            'ONNX export needs the onnx package (%s): %s'
            % (_INSTALL_HINT, e)) from e
    return onnx


# -- converter registry ------------------------------------------------------

CONVERTERS = {}


def converter(*kinds):
    """Register the decorated function as the converter of ``kinds``."""
    def register(fn):
        for k in kinds:
            CONVERTERS[k] = fn
        return fn
    return register


def supported_kinds():
    """The op kinds the exporter can convert, sorted."""
    return sorted(CONVERTERS)


# -- public API --------------------------------------------------------------

def check_opset(opset):
    """Validate ``opset``; return it as an int."""
    onnx = _import_onnx()
    try:
        value = float(opset)
    except (TypeError, ValueError):
        value = None
    if value is None or not value.is_integer() or isinstance(opset, bool):
        raise ValueError('opset must be an integer, not %r' % (opset,))
    opset = int(value)
    newest = onnx.defs.onnx_opset_version()
    if opset < MIN_OPSET:
        raise ValueError(
            'ONNX export needs opset %d or newer (got opset=%d)'
            % (MIN_OPSET, opset))
    if opset > newest:
        raise ValueError(
            'opset %d is newer than the installed onnx package knows '
            '(newest: %d)' % (opset, newest))
    return opset


def schedule_to_onnx(schedule, values, opset=13, dynamic_batch=True,
                     input_names=None, output_names=None,
                     graph_name='static_graph', other_batch=None):
    """Convert an inference schedule to an ``onnx.ModelProto``.

    Args:
        schedule (schedules.ir.Schedule): an inference (forward) schedule.
        values (dict): buffer id -> array for the PARAM, PERSIST and CONST
            buffers the schedule reads (a CONST buffer missing here falls
            back to its ``storage``). They become initializers named after
            the buffers (``/l1/W`` -> ``l1.W``).
        opset (int): ONNX opset, 13 or newer.
        dynamic_batch (bool): make the leading (batch) dimension symbolic.
        input_names, output_names (list of str): graph input/output names;
            default: sanitised input buffer names and ``output``/
            ``output_<i>``.
        graph_name (str): name of the ONNX graph.
        other_batch (tuple): ``(batch size, {buffer id: shape})``, the
            shapes the same program gave at another batch size. With
            ``dynamic_batch``, every result is checked against them: where
            the exported graph would not follow the batch size as the
            program does (a reshape to ``(2, B, C)`` recorded at B = 2, a
            split of the batch axis), UnsupportedOpError is raised instead
            of writing a model that is wrong at other batch sizes.

    Raises:
        UnsupportedOpError: an op has no converter (or an unsupported use).
        ValueError: bad arguments or a value missing for a parameter.
    """
    onnx = _import_onnx()
    opset = check_opset(opset)
    ctx = _Context(onnx, schedule, values or {}, opset, dynamic_batch)
    if dynamic_batch:
        ctx.other_batch = other_batch
    return ctx.build(input_names, output_names, graph_name)


def save_onnx(model, path):
    """Write ``model`` to ``path`` atomically.

    The model is serialised first, then written to a temporary file in the
    same directory which replaces ``path`` at the end: on any error nothing
    (in particular no half-written file) is left at ``path``.
    """
    path = os.fspath(path)
    data = model.SerializeToString()
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise FileNotFoundError('cannot write %s: no directory %s'
                                % (path, directory))
    fd, tmp = tempfile.mkstemp(
        prefix='.%s.' % os.path.basename(path), suffix='.tmp', dir=directory)
    try:
        with os.fdopen(fd, 'wb') as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path


def export_schedule(schedule, values, path, **kwargs):
    """``schedule_to_onnx`` then ``save_onnx``; returns the model.

    The model is fully built (and any UnsupportedOpError raised) before
    anything is written.
    """
    model = schedule_to_onnx(schedule, values, **kwargs)
    save_onnx(model, path)
    return model


# -- names -------------------------------------------------------------------

def sanitize_name(name):
    """A readable tensor name: '/l1/W' -> 'l1.W', 'args[0]' -> 'args_0'."""
    s = str(name).strip('/').replace('/', '.')
    s = re.sub(r'[^A-Za-z0-9_.]+', '_', s).strip('_')
    return s


def _root(a):
    while getattr(a, 'base', None) is not None:
        a = a.base
    return a


def _address(a):
    ctypes = getattr(a, 'ctypes', None)
    return ctypes.data if ctypes is not None else a.data.ptr


def _as_slices(view, whole):
    """[(start, step)] per axis such that ``whole[start::step]`` slicing
    gives exactly ``view`` (same memory, shape and strides), or None."""
    if view.ndim != whole.ndim or not whole.flags.c_contiguous or \
            view.itemsize != whole.itemsize:
        return None
    offset = _address(view) - _address(whole)
    out = []
    for n, sv, sw, dim in zip(view.shape, view.strides, whole.strides,
                              whole.shape):
        step = 1 if n <= 1 else (sv // sw if sw and sv % sw == 0 else 0)
        if step == 0:
            return None
        start = offset // sw if sw else 0
        start = min(max(start, 0), dim - 1) if dim else 0
        offset -= start * sw
        out.append((start, step))
    if offset != 0:
        return None
    index = tuple(slice(start, start + step * n if start + step * n >= 0
                        else None, step)
                  for (start, step), n in zip(out, view.shape))
    got = whole[index]
    if got.shape != view.shape or _address(got) != _address(view) or any(
            a != b for a, b, n in zip(got.strides, view.strides, view.shape)
            if n > 1):
        return None
    return out


def _to_numpy(a):
    if isinstance(a, numpy.ndarray):
        return a
    get = getattr(a, 'get', None)   # cupy
    if callable(get):
        return numpy.asarray(get())
    return numpy.asarray(a)


def _norm_axis(axis, ndim):
    axis = int(axis)
    if axis < 0:
        axis += ndim
    return axis


def _prod(xs):
    p = 1
    for x in xs:
        p *= int(x)
    return p


# -- conversion context ------------------------------------------------------

# Converters that write the recorded sizes of their results into the graph
# (Split's sizes, Reshape's target): with no batch axis known, such a
# result that changes with the batch size cannot have a dynamic one.
_RECORDED_SIZES = frozenset(['SplitAxis', 'Reshape'])


class _Context(object):

    def __init__(self, onnx, schedule, values, opset, dynamic_batch):
        self.onnx = onnx
        self.helper = onnx.helper
        self.schedule = schedule
        self.buffers = schedule.buffers
        self.values = values
        self.opset = opset
        self.dynamic_batch = dynamic_batch
        self.nodes = []
        self.initializers = []
        self.used_names = set()
        self.tensor = {}      # buffer id -> ONNX tensor name
        self.batch = {}       # buffer id -> (axis, factor): dim = factor*B
        self.batch_size = None   # recorded batch size B
        self._batch_tensor = None
        self._batch_source = None
        self.op = None
        self.op_index = None
        self.results = ()     # the current op's result buffers (or None)
        self._per_call = None   # id(array) -> buffer id, per-call buffers
        self.other_batch = None   # (batch size, {buffer id: shape})

    # -- naming ---------------------------------------------------------------
    def unique(self, hint):
        base = sanitize_name(hint) or 't'
        name = base
        i = 1
        while name in self.used_names:
            name = '%s_%d' % (base, i)
            i += 1
        self.used_names.add(name)
        return name

    def tmp(self, hint=None):
        if hint is None:
            hint = '%s_%d' % (self.op.kind if self.op else 't',
                              self.op_index if self.op_index is not None
                              else 0)
        return self.unique(hint)

    # -- graph pieces ---------------------------------------------------------
    def emit(self, op_type, inputs, outputs=None, n_out=1, **attrs):
        """Add a node; return the list of its output names."""
        if outputs is None:
            outputs = [self.tmp() for _ in range(n_out)]
        elif isinstance(outputs, str):
            outputs = [outputs]
        name = self.unique('%s_%d' % (self.op.kind, self.op_index)
                           if self.op is not None else op_type)
        attrs = {k: v for k, v in attrs.items() if v is not None}
        node = self.helper.make_node(op_type, list(inputs), list(outputs),
                                     name=name, **attrs)
        if self.op is not None and self.op.source:
            node.doc_string = '%s at %s' % (self.op.kind, self.op.source)
        self.nodes.append(node)
        return list(outputs)

    def emit1(self, op_type, inputs, out=None, **attrs):
        return self.emit(op_type, inputs, outputs=out, **attrs)[0]

    def const(self, value, hint='const', dtype=None):
        arr = numpy.asarray(_to_numpy(value))
        if dtype is not None:
            arr = arr.astype(dtype, copy=False)
        if not arr.flags.c_contiguous:
            arr = arr.copy()    # (ascontiguousarray would make 0-d 1-d)
        name = self.unique(hint)
        self.initializers.append(
            self.onnx.numpy_helper.from_array(arr, name))
        return name

    def i64(self, values, hint='shape'):
        return self.const(numpy.asarray(values, dtype=numpy.int64).reshape(
            -1), hint)

    def scalar(self, value, dtype, hint='const'):
        return self.const(numpy.asarray(value, dtype=dtype), hint)

    # -- opset-dependent helpers ----------------------------------------------
    def unsqueeze(self, x, axes, out=None):
        return self.emit1('Unsqueeze', [x, self.i64(axes, 'axes')], out)

    def squeeze(self, x, axes, out=None):
        return self.emit1('Squeeze', [x, self.i64(axes, 'axes')], out)

    def reduce(self, op_type, x, axes, keepdims, out=None):
        keepdims = int(bool(keepdims))
        if axes is None:
            return self.emit1(op_type, [x], out, keepdims=keepdims)
        axes = list(axes)
        if op_type == 'ReduceSum' or self.opset >= 18:
            return self.emit1(op_type, [x, self.i64(axes, 'axes')], out,
                              keepdims=keepdims)
        return self.emit1(op_type, [x], out, axes=axes, keepdims=keepdims)

    def reshape(self, x, shape, out=None):
        if not isinstance(shape, str):
            shape = self.i64(shape)
        return self.emit1('Reshape', [x, shape], out)

    def transpose(self, x, perm, out=None):
        return self.emit1('Transpose', [x], out, perm=[int(p) for p in perm])

    # -- buffers --------------------------------------------------------------
    def shape(self, b):
        return self.buffers[b].shape

    def dtype(self, b):
        return self.buffers[b].dtype

    def in_shape(self, i):
        return self.shape(self.op.inputs[i])

    def out_shape(self, i=0):
        b = self.results[i] if i < len(self.results) else None
        if b is None:
            raise self.unsupported('result %d has no buffer' % i)
        return self.shape(b)

    def any_out_shape(self):
        for b in self.results:
            if b is not None:
                return self.shape(b)
        raise self.unsupported('no result has a buffer')

    def in_dtype(self, i=0):
        return self.dtype(self.op.inputs[i])

    def out_dtype(self, i=0):
        return self.dtype(self.results[i])

    def in_batch(self, i):
        return self.batch.get(self.op.inputs[i])

    def set_batch(self, j, axis, factor=1):
        b = self.results[j] if j < len(self.results) else None
        if b is None:
            return
        if axis is None:
            self.batch[b] = None
        else:
            self.batch[b] = (int(axis), int(factor))

    def attr(self, key, default=None):
        return self.op.attrs.get(key, default)

    def require(self, key):
        if key not in self.op.attrs:
            raise self.unsupported(
                'attribute %r missing from op.attrs %r'
                % (key, sorted(self.op.attrs)))
        return self.op.attrs[key]

    def unsupported(self, detail):
        return UnsupportedOpError(self.op.kind, self.op.source, detail)

    # -- batch ----------------------------------------------------------------
    def batch_tensor(self, factor=1):
        """A 1-D int64 tensor ``[factor * batch]`` computed from an input."""
        if self._batch_tensor is None:
            if self._batch_source is None:
                raise self.unsupported('no input carries the batch dimension')
            # Emitted once, before its first use; it reads only an input.
            shp = self.emit1('Shape', [self._batch_source],
                             self.unique('batch_shape'))
            self._batch_tensor = self.emit1(
                'Slice', [shp, self.i64([0], 'starts'), self.i64([1], 'ends'),
                          self.i64([0], 'axes')], self.unique('batch_size'))
        if factor == 1:
            return self._batch_tensor
        return self.emit1('Mul', [self._batch_tensor,
                                  self.i64([factor], 'factor')])

    def shape_tensor(self, dims, axis=None, factor=1):
        """A shape tensor: ``dims`` with ``dims[axis]`` = factor * batch."""
        dims = [int(d) for d in dims]
        if axis is None:
            return self.i64(dims)
        parts = []
        if axis > 0:
            parts.append(self.i64(dims[:axis]))
        parts.append(self.batch_tensor(factor))
        if axis + 1 < len(dims):
            parts.append(self.i64(dims[axis + 1:]))
        if len(parts) == 1:
            return parts[0]
        return self.emit1('Concat', parts, axis=0)

    def _results(self, op):
        """Buffers of the op's results by position (None: no buffer).

        Hidden state an op keeps (STATE buffers, appended to its outputs by
        the recorder) is not a result. ``op.select`` gives the result
        position of each output when present.
        """
        select = getattr(op, 'select', None)
        if select is None or len(select) != len(op.outputs):
            select = range(len(op.outputs))
        by_pos = {}
        for b, pos in zip(op.outputs, select):
            if self.buffers[b].role != ir.STATE:
                by_pos[int(pos)] = b
        if not by_pos:
            return []
        return [by_pos.get(j) for j in range(max(by_pos) + 1)]

    def result_names(self, ys, n):
        """``ys`` padded to ``n`` names (results after the last used one)."""
        ys = list(ys)
        while len(ys) < n:
            ys.append(self.unique('%s_%d_unused%d'
                                  % (self.op.kind, self.op_index, len(ys))))
        return ys

    def _default_batch(self, op):
        """Outputs keep an input's batch axis when shapes agree there."""
        for ob in self.results:
            if ob is None or ob in self.batch:
                continue
            oshape = self.shape(ob)
            found = None
            for ib in op.inputs:
                info = self.batch.get(ib)
                if info is None:
                    continue
                a, f = info
                ishape = self.shape(ib)
                if len(ishape) == len(oshape) and ishape[a] == oshape[a]:
                    found = info
                    break
            self.batch[ob] = found

    # -- tensors of buffers ---------------------------------------------------
    def tensor_of(self, b):
        name = self.tensor.get(b)
        if name is not None:
            return name
        buf = self.buffers[b]
        base = self._view_base(b)
        if base is not None:
            name = self._view(b, base)
            self.tensor[b] = name
            return name
        if buf.role in (ir.PARAM, ir.PERSIST, ir.CONST):
            if b in self.values:
                value = self.values[b]
            elif buf.role == ir.CONST and buf.storage is not None:
                value = buf.storage
            else:
                raise ValueError(
                    'no value given for %s buffer %%%d%s' % (
                        buf.role, b, ' (%s)' % buf.name if buf.name else ''))
            value = numpy.asarray(_to_numpy(value))
            if value.dtype != buf.dtype:
                value = value.astype(buf.dtype)
            if tuple(value.shape) != buf.shape:
                raise ValueError(
                    'value of buffer %%%d%s has shape %s, expected %s' % (
                        b, ' (%s)' % buf.name if buf.name else '',
                        value.shape, buf.shape))
            hint = buf.name or '%s_%d' % (buf.role, b)
            name = self.const(value, hint)
            self.tensor[b] = name
            self.batch[b] = None
            return name
        raise ValueError(
            'buffer %%%d (%s%s) is read before it is defined; an inference '
            'schedule cannot be exported with it'
            % (b, buf.role, ' ' + buf.name if buf.name else ''))

    def _check_batch(self):
        """Do the current op's results follow the batch size as the
        program did at the other batch size?"""
        if self.other_batch is None or self.batch_size is None:
            return
        size, shapes = self.other_batch
        for b in self.results:
            if b is None or b not in shapes:
                continue
            info = self.batch.get(b)
            want = list(self.shape(b))
            if info is not None:
                a, f = info
                want[a] = f * size
            elif self.op.kind not in _RECORDED_SIZES:
                # No batch axis known: the converters that follow one
                # anyway (Tile, Concat, Pad) cannot be told from others.
                continue
            if tuple(want) != tuple(shapes[b]):
                raise self.unsupported(
                    'its result has shape %s at batch size %d and %s at %d, '
                    'not the shape the exported graph would give (a fixed '
                    'size taken for the batch size); export with '
                    'dynamic_batch=False for a model of batch size %d'
                    % (self.shape(b), self.batch_size, tuple(shapes[b]),
                       size, self.batch_size))

    # -- NumPy views of per-call buffers ---------------------------------------
    def _view_base(self, b):
        """The buffer a constant is a view of, where that buffer holds each
        call's values (an input: ``x[:, ::-1]``, Chainer's own
        ``x.reshape(len(x), -1)`` in L.Linear), else None."""
        buf = self.buffers[b]
        if buf.role != ir.CONST or buf.storage is None or \
                _root(buf.storage) is buf.storage:
            return None
        if self._per_call is None:
            self._per_call = dict(
                (id(o.storage), k) for k, o in self.buffers.items()
                if o.role not in (ir.PARAM, ir.PERSIST, ir.CONST) and
                o.storage is not None and _root(o.storage) is o.storage)
        return self._per_call.get(id(_root(buf.storage)))

    def _view(self, b, base):
        """ONNX for the view ``b`` of ``base``: a Reshape (same memory in C
        order) or a Slice (start and step per axis), checked against the
        arrays; anything else is not exported."""
        view, whole = self.buffers[b].storage, self.buffers[base].storage
        x = self.tensor_of(base)
        info = self.batch.get(base)
        detail = None
        if view.size == whole.size and _address(view) == _address(whole) \
                and view.flags.c_contiguous and whole.flags.c_contiguous:
            dims = list(view.shape)
            if info is None:
                self.batch[b] = None
                return self.reshape(x, dims)
            if info == (0, 1) and dims and dims[0] == whole.shape[0]:
                self.batch[b] = (0, 1)
                return self.reshape(x, [0] + dims[1:])   # 0: copy the batch
            if info == (0, 1) and dims and dims[0] % whole.shape[0] == 0:
                # Leading axes merged (n_batch_axes=2): checked against the
                # other batch size, where there is one.
                self.batch[b] = (0, dims[0] // whole.shape[0])
                return self.reshape(x, [-1] + dims[1:])
            detail = 'it moves the batch axis'
        else:
            slices = _as_slices(view, whole)
            if slices is not None:
                starts, ends, axes, steps = [], [], [], []
                for i, (start, step) in enumerate(slices):
                    n = view.shape[i]
                    if step == 1 and start == 0 and n == whole.shape[i]:
                        continue
                    if info is not None and i == info[0] and not (
                            step == -1 and n == whole.shape[i]):
                        detail = 'it slices the batch axis'
                        break
                    end = start + step * n
                    if step == -1 and n == whole.shape[i]:
                        start = -1   # x[::-1] at any size of the axis
                    starts.append(start)
                    ends.append(end if end >= 0 else INT64_MIN)
                    axes.append(i)
                    steps.append(step)
                else:
                    self.batch[b] = info
                    if not axes:
                        return self.emit1('Identity', [x])
                    return self.emit1('Slice', [
                        x, self.i64(starts, 'starts'), self.i64(ends, 'ends'),
                        self.i64(axes, 'axes'), self.i64(steps, 'steps')])
        raise UnsupportedOpError(
            'NumPy view of an input', self.op.source if self.op else None,
            'a view of shape %s of an input of shape %s, taken with NumPy '
            '(not a Chainer function)%s, is neither a reshape nor a slice '
            'with steps that keeps the batch axis; use F.reshape, '
            'F.get_item, F.transpose or F.expand_dims'
            % (view.shape, whole.shape, ': ' + detail if detail else ''))

    # -- the whole graph ------------------------------------------------------
    def build(self, input_names, output_names, graph_name):
        helper = self.helper
        sched = self.schedule
        bufs = self.buffers

        # Inputs: the INPUT buffers among the schedule's inputs (parameters
        # bound as inputs become initializers).
        in_bids = [b for b in sched.inputs if bufs[b].role == ir.INPUT]
        for names in (input_names, output_names):
            for n in names or ():
                if not isinstance(n, str) or not n:
                    raise ValueError('tensor names must be non-empty '
                                     'strings, not %r' % (n,))
        if input_names is not None:
            input_names = list(input_names)
            if len(input_names) != len(in_bids):
                raise ValueError(
                    'input_names has %d names, the schedule has %d inputs'
                    % (len(input_names), len(in_bids)))
        if output_names is not None:
            output_names = list(output_names)
            if len(output_names) != len(sched.outputs):
                raise ValueError(
                    'output_names has %d names, the schedule has %d outputs'
                    % (len(output_names), len(sched.outputs)))
            if len(set(output_names)) != len(output_names):
                raise ValueError('output_names are not unique: %r'
                                 % (output_names,))
        for i, b in enumerate(in_bids):
            shp = bufs[b].shape
            if self.batch_size is None and len(shp) >= 1:
                self.batch_size = shp[0]
        graph_inputs = []
        for i, b in enumerate(in_bids):
            buf = bufs[b]
            if input_names is not None:
                want = str(input_names[i])
                if want in self.used_names:
                    raise ValueError('input name %r used twice' % (want,))
                self.used_names.add(want)
                name = want
            else:
                name = self.unique(buf.name or 'input_%d' % i)
            self.tensor[b] = name
            dims = list(buf.shape)
            if (self.dynamic_batch and len(dims) >= 1
                    and dims[0] == self.batch_size):
                dims[0] = 'batch'
                self.batch[b] = (0, 1)
                if self._batch_source is None:
                    self._batch_source = name
            else:
                self.batch[b] = None
            graph_inputs.append(helper.make_tensor_value_info(
                name, _onnx_dtype(self.onnx, buf.dtype), dims))

        # Reserve output names so that no other tensor takes them.
        if output_names is None:
            if len(sched.outputs) == 1:
                output_names = ['output']
            else:
                output_names = ['output_%d' % i
                                for i in range(len(sched.outputs))]
        for n in output_names:
            if n in self.used_names:
                raise ValueError('output name %r is also an input name' % n)
        self.used_names.update(output_names)

        # Live ops only.
        producer = {}
        for i, op in enumerate(sched.ops):
            for b in op.outputs:
                producer[b] = i
        live = set()
        needed = list(sched.outputs)
        seen = set()
        while needed:
            b = needed.pop()
            if b in seen:
                continue
            seen.add(b)
            i = producer.get(b)
            if i is not None and i not in live:
                live.add(i)
                needed.extend(sched.ops[i].inputs)

        # Name op results that are graph outputs after the output.
        renamed = set()
        for b, name in zip(sched.outputs, output_names):
            if b in producer and b not in self.tensor and b not in renamed:
                self.tensor[b] = name
                renamed.add(b)

        missing = [sched.ops[i] for i in sorted(live)
                   if sched.ops[i].kind not in CONVERTERS]
        if missing:
            first = missing[0]
            detail = None
            if len(missing) > 1:
                detail = ('no ONNX converter for this op kind (nor for: %s)'
                          % ', '.join(
                              '%s%s' % (op.kind, ' at %s' % op.source
                                        if op.source else '')
                              for op in missing[1:6]))
                if len(missing) > 6:
                    detail += ' and %d more' % (len(missing) - 6)
            raise UnsupportedOpError(first.kind, first.source, detail)

        for i, op in enumerate(sched.ops):
            if i not in live:
                continue
            self.op, self.op_index = op, i
            fn = CONVERTERS[op.kind]
            xs = [self.tensor_of(b) for b in op.inputs]
            self.results = self._results(op)
            ys = []
            for j, b in enumerate(self.results):
                if b is None:    # a result without a buffer (unused)
                    ys.append(self.unique('%s_%d_unused%d'
                                          % (op.kind, i, j)))
                    continue
                if b not in self.tensor:
                    self.tensor[b] = self.unique('%s_%d' % (op.kind, b))
                ys.append(self.tensor[b])
            fn(self, xs, ys)
            self._default_batch(op)
            self._check_batch()
        self.op = self.op_index = None

        # Outputs.
        graph_outputs = []
        for b, name in zip(sched.outputs, output_names):
            src = self.tensor.get(b)
            if src is None:
                src = self.tensor_of(b)
            if src != name:
                self.emit('Identity', [src], [name])
            buf = bufs[b]
            dims = list(buf.shape)
            info = self.batch.get(b)
            if self.dynamic_batch and info is not None:
                a, f = info
                dims[a] = 'batch' if f == 1 else None
            graph_outputs.append(helper.make_tensor_value_info(
                name, _onnx_dtype(self.onnx, buf.dtype), dims))

        graph = helper.make_graph(self.nodes, graph_name, graph_inputs,
                                  graph_outputs,
                                  initializer=self.initializers)
        graph.doc_string = 'exported from schedule %s' % (sched.name,)
        opsetid = helper.make_opsetid('', self.opset)
        model = helper.make_model(graph, opset_imports=[opsetid],
                                  producer_name='chainer-static-graph')
        try:
            model.ir_version = helper.find_min_ir_version_for(
                [opsetid], ignore_unknown=True)
        except Exception:
            pass
        return model


def _onnx_dtype(onnx, dtype):
    return onnx.helper.np_dtype_to_tensor_dtype(numpy.dtype(dtype))


# ============================================================================
# Converters. Each takes (ctx, xs, ys): the ONNX names of the op's inputs and
# of its outputs (which it must produce); ctx.op is the op.
# ============================================================================

# -- elementwise --------------------------------------------------------------

_UNARY = {
    'ReLU': 'Relu', 'Sigmoid': 'Sigmoid', 'Tanh': 'Tanh', 'Exp': 'Exp',
    'Log': 'Log', 'Sqrt': 'Sqrt', 'Neg': 'Neg', 'Absolute': 'Abs',
    'Sin': 'Sin', 'Cos': 'Cos', 'Tan': 'Tan', 'Arcsin': 'Asin',
    'Arccos': 'Acos', 'Arctan': 'Atan', 'Sinh': 'Sinh', 'Cosh': 'Cosh',
    'Arctanh': 'Atanh', 'Erf': 'Erf', 'Identity': 'Identity',
    'Copy': 'Identity',
    # Inference export: dropout is the identity.
    'Dropout': 'Identity',
}


def _unary(op_type):
    def cv(ctx, xs, ys):
        ctx.emit(op_type, [xs[0]], ys)
    return cv


for _k, _v in _UNARY.items():
    CONVERTERS[_k] = _unary(_v)

_BINARY = {'Add': 'Add', 'Sub': 'Sub', 'Mul': 'Mul', 'Div': 'Div',
           'Maximum': 'Max', 'Minimum': 'Min', 'PowVarVar': 'Pow'}


def _binary(op_type):
    def cv(ctx, xs, ys):
        ctx.emit(op_type, xs[:2], ys)
    return cv


for _k, _v in _BINARY.items():
    CONVERTERS[_k] = _binary(_v)


@converter('MultiAdd')
def _cv_multi_add(ctx, xs, ys):
    ctx.emit('Sum', xs, ys)


def _const_of(ctx, key='value'):
    return ctx.const(numpy.asarray(ctx.require(key), dtype=ctx.in_dtype(0)),
                     'const')


@converter('AddConstant')
def _cv_add_constant(ctx, xs, ys):
    ctx.emit('Add', [xs[0], _const_of(ctx)], ys)


@converter('SubFromConstant')
def _cv_sub_from_constant(ctx, xs, ys):
    ctx.emit('Sub', [_const_of(ctx), xs[0]], ys)


@converter('MulConstant')
def _cv_mul_constant(ctx, xs, ys):
    ctx.emit('Mul', [xs[0], _const_of(ctx)], ys)


@converter('DivFromConstant')
def _cv_div_from_constant(ctx, xs, ys):
    ctx.emit('Div', [_const_of(ctx), xs[0]], ys)


@converter('PowVarConst')
def _cv_pow_var_const(ctx, xs, ys):
    ctx.emit('Pow', [xs[0], _const_of(ctx)], ys)


@converter('PowConstVar')
def _cv_pow_const_var(ctx, xs, ys):
    ctx.emit('Pow', [_const_of(ctx), xs[0]], ys)


@converter('Square')
def _cv_square(ctx, xs, ys):
    ctx.emit('Mul', [xs[0], xs[0]], ys)


def _log_base(base):
    def cv(ctx, xs, ys):
        lx = ctx.emit1('Log', [xs[0]])
        ctx.emit('Div', [lx, ctx.scalar(math.log(base), ctx.in_dtype(0))], ys)
    return cv


CONVERTERS['Log2'] = _log_base(2.0)
CONVERTERS['Log10'] = _log_base(10.0)


@converter('Expm1')
def _cv_expm1(ctx, xs, ys):
    e = ctx.emit1('Exp', [xs[0]])
    ctx.emit('Sub', [e, ctx.scalar(1, ctx.in_dtype(0))], ys)


@converter('Log1p')
def _cv_log1p(ctx, xs, ys):
    a = ctx.emit1('Add', [xs[0], ctx.scalar(1, ctx.in_dtype(0))])
    ctx.emit('Log', [a], ys)


@converter('Fmod')
def _cv_fmod(ctx, xs, ys):
    ctx.emit('Mod', xs[:2], ys, fmod=1)


@converter('Clip')
def _cv_clip(ctx, xs, ys):
    dt = ctx.in_dtype(0)
    lo, hi = ctx.attr('x_min'), ctx.attr('x_max')
    ins = [xs[0],
           '' if lo is None else ctx.scalar(lo, dt, 'min'),
           '' if hi is None else ctx.scalar(hi, dt, 'max')]
    while ins[-1] == '':
        ins.pop()
    ctx.emit('Clip', ins, ys)


@converter('Cast')
def _cv_cast(ctx, xs, ys):
    ctx.emit('Cast', [xs[0]], ys,
             to=_onnx_dtype(ctx.onnx, ctx.out_dtype(0)))


@converter('Where')
def _cv_where(ctx, xs, ys):
    cond = ctx.const(numpy.asarray(ctx.require('condition'), dtype=bool),
                     'condition')
    ctx.emit('Where', [cond, xs[0], xs[1]], ys)


# -- activations --------------------------------------------------------------

@converter('LeakyReLU')
def _cv_leaky_relu(ctx, xs, ys):
    ctx.emit('LeakyRelu', [xs[0]], ys, alpha=float(ctx.attr('slope', 0.2)))


@converter('ClippedReLU')
def _cv_clipped_relu(ctx, xs, ys):
    dt = ctx.in_dtype(0)
    ctx.emit('Clip', [xs[0], ctx.scalar(0, dt, 'min'),
                      ctx.scalar(ctx.require('z'), dt, 'max')], ys)


@converter('ELU')
def _cv_elu(ctx, xs, ys):
    ctx.emit('Elu', [xs[0]], ys, alpha=float(ctx.attr('alpha', 1.0)))


@converter('HardSigmoid')
def _cv_hard_sigmoid(ctx, xs, ys):
    ctx.emit('HardSigmoid', [xs[0]], ys, alpha=0.2, beta=0.5)


@converter('Softplus')
def _cv_softplus(ctx, xs, ys):
    beta = float(ctx.attr('beta', 1.0))
    if beta == 1.0:
        ctx.emit('Softplus', [xs[0]], ys)
        return
    dt = ctx.in_dtype(0)
    bx = ctx.emit1('Mul', [xs[0], ctx.scalar(beta, dt, 'beta')])
    sp = ctx.emit1('Softplus', [bx])
    ctx.emit('Div', [sp, ctx.scalar(beta, dt, 'beta')], ys)


def _channel_shape(w_shape, x_ndim):
    """Chainer's (1,) + W.shape + (1,)*k, without the leading 1."""
    return tuple(w_shape) + (1,) * (x_ndim - len(w_shape) - 1)


@converter('PReLUFunction')
def _cv_prelu(ctx, xs, ys):
    w = ctx.reshape(xs[1], _channel_shape(ctx.in_shape(1),
                                          len(ctx.in_shape(0))))
    ctx.emit('PRelu', [xs[0], w], ys)


@converter('Swish')
def _cv_swish(ctx, xs, ys):
    beta = ctx.reshape(xs[1], _channel_shape(ctx.in_shape(1),
                                             len(ctx.in_shape(0))))
    bx = ctx.emit1('Mul', [xs[0], beta])
    s = ctx.emit1('Sigmoid', [bx])
    ctx.emit('Mul', [xs[0], s], ys)


@converter('Softmax')
def _cv_softmax(ctx, xs, ys):
    ctx.emit('Softmax', [xs[0]], ys, axis=int(ctx.attr('axis', 1)))


@converter('LogSoftmax')
def _cv_log_softmax(ctx, xs, ys):
    ctx.emit('LogSoftmax', [xs[0]], ys, axis=int(ctx.attr('axis', 1)))


@converter('CReLU')
def _cv_crelu(ctx, xs, ys):
    pos = ctx.emit1('Relu', [xs[0]])
    neg = ctx.emit1('Relu', [ctx.emit1('Neg', [xs[0]])])
    ctx.emit('Concat', [pos, neg], ys, axis=int(ctx.attr('axis', 1)))


# -- connections --------------------------------------------------------------

@converter('LinearFunction')
def _cv_linear(ctx, xs, ys):
    if len(ctx.in_shape(0)) != 2:
        raise ctx.unsupported('LinearFunction input must be 2-D, got %s'
                              % (ctx.in_shape(0),))
    ctx.emit('Gemm', xs[:3], ys, transB=1)


def _nd(v, n, name):
    if v is None:
        raise ValueError(name)
    if isinstance(v, (int, numpy.integer)):
        return [int(v)] * n
    v = [int(e) for e in v]
    if len(v) != n:
        raise ValueError(name)
    return v


def _conv_geometry(ctx, n, w_shape):
    stride = _nd(ctx.attr('stride', 1), n, 'stride')
    pad = _nd(ctx.attr('pad', 0), n, 'pad')
    dilate = _nd(ctx.attr('dilate', 1), n, 'dilate')
    return stride, pad, dilate


def _end_pads(in_dims, out_dims, k, s, p, d):
    """End pads that give the recorded output size with floor rounding.

    Chainer's ``cover_all`` adds ``stride - 1`` extra pixels at the end; the
    smallest end pad that yields the same output size is used instead.
    """
    ends = []
    for i in range(len(in_dims)):
        dk = (k[i] - 1) * d[i] + 1
        need = (out_dims[i] - 1) * s[i] + dk - in_dims[i] - p[i]
        ends.append(max(p[i], need))
    return ends


@converter('Convolution2DFunction', 'ConvolutionND')
def _cv_conv(ctx, xs, ys):
    x_shape, w_shape = ctx.in_shape(0), ctx.in_shape(1)
    n = len(x_shape) - 2
    k = list(w_shape[2:])
    s, p, d = _conv_geometry(ctx, n, w_shape)
    ends = p
    if ctx.attr('cover_all'):
        ends = _end_pads(x_shape[2:], ctx.out_shape(0)[2:], k, s, p, d)
    ctx.emit('Conv', xs[:3], ys, kernel_shape=k, strides=s, pads=p + ends,
             dilations=d, group=int(ctx.attr('groups', 1) or 1))


@converter('Deconvolution2DFunction', 'DeconvolutionND')
def _cv_deconv(ctx, xs, ys):
    x_shape, w_shape = ctx.in_shape(0), ctx.in_shape(1)
    n = len(x_shape) - 2
    k = list(w_shape[2:])
    s, p, d = _conv_geometry(ctx, n, w_shape)
    out = ctx.out_shape(0)[2:]
    output_padding = []
    for i in range(n):
        base = s[i] * (x_shape[2 + i] - 1) + (k[i] - 1) * d[i] + 1 - 2 * p[i]
        output_padding.append(out[i] - base)
    if any(o < 0 for o in output_padding):
        raise ctx.unsupported('output size %s smaller than the minimum'
                              % (tuple(out),))
    ctx.emit('ConvTranspose', xs[:3], ys, kernel_shape=k, strides=s,
             pads=p + p, dilations=d,
             group=int(ctx.attr('groups', 1) or 1),
             output_padding=(output_padding if any(output_padding)
                             else None))


@converter('EmbedIDFunction')
def _cv_embed_id(ctx, xs, ys):
    ignore = ctx.attr('ignore_label')
    if ignore is None:
        ctx.emit('Gather', [xs[1], xs[0]], ys, axis=0)
        return
    g = ctx.emit1('Gather', [xs[1], xs[0]], axis=0)
    mask = ctx.emit1('Equal', [xs[0], ctx.scalar(ignore, ctx.in_dtype(0))])
    mask = ctx.unsqueeze(mask, [-1])
    zero = ctx.scalar(0, ctx.out_dtype(0), 'zero')
    ctx.emit('Where', [mask, zero, g], ys)


@converter('MatMul')
def _cv_matmul(ctx, xs, ys):
    a, b = xs[0], xs[1]
    for i, key in ((0, 'transa'), (1, 'transb')):
        nd = len(ctx.in_shape(i))
        if ctx.attr(key) and nd >= 2:
            perm = list(range(nd))
            perm[-1], perm[-2] = perm[-2], perm[-1]
            t = ctx.transpose(xs[i], perm)
            if i == 0:
                a = t
            else:
                b = t
    if ctx.attr('transc'):
        raise ctx.unsupported('transc=True')
    ctx.emit('MatMul', [a, b], ys)


# -- pooling -----------------------------------------------------------------

def _pool_geometry(ctx):
    x_shape = ctx.in_shape(0)
    n = len(x_shape) - 2
    k = _nd(ctx.require('ksize'), n, 'ksize')
    s = ctx.attr('stride')
    s = k if s is None else _nd(s, n, 'stride')
    p = _nd(ctx.attr('pad', 0), n, 'pad')
    return x_shape, n, k, s, p


@converter('MaxPooling2D', 'MaxPoolingND')
def _cv_max_pool(ctx, xs, ys):
    x_shape, n, k, s, p = _pool_geometry(ctx)
    ends = p
    if ctx.attr('cover_all', True):
        ends = _end_pads(x_shape[2:], ctx.out_shape(0)[2:], k, s, p, [1] * n)
        if any(e >= kk for e, kk in zip(ends, k)):
            raise ctx.unsupported(
                'cover_all pooling with a window lying entirely in the '
                'padding (ksize=%s, stride=%s, pad=%s)' % (k, s, p))
    ctx.emit('MaxPool', [xs[0]], ys[:1], kernel_shape=k, strides=s,
             pads=p + ends)


@converter('AveragePooling2D', 'AveragePoolingND')
def _cv_avg_pool(ctx, xs, ys):
    x_shape, n, k, s, p = _pool_geometry(ctx)
    if ctx.attr('cover_all'):
        raise ctx.unsupported('average pooling with cover_all=True')
    include = ctx.attr('count_include_pad', True)
    ctx.emit('AveragePool', [xs[0]], ys, kernel_shape=k, strides=s,
             pads=p + p, count_include_pad=int(bool(include)))


# -- normalization -----------------------------------------------------------

def _bn_axes(ctx):
    """(reduced axes, key axes) of a batch normalization, normalised."""
    nd = len(ctx.in_shape(0))
    g_nd = len(ctx.in_shape(1))
    axis = ctx.attr('axis')
    if axis is None:
        axis = (0,) + tuple(range(g_nd + 1, nd))
    axis = tuple(sorted(_norm_axis(a, nd) for a in axis))
    key = tuple(i for i in range(nd) if i not in axis)
    return axis, key


def _expand_param(ctx, name, key, nd):
    shape = [ctx.in_shape(0)[i] if i in key else 1 for i in range(nd)]
    while shape and shape[0] == 1 and len(shape) > 1:
        shape.pop(0)
    return ctx.reshape(name, shape)


@converter('FixedBatchNormalization')
def _cv_fixed_bn(ctx, xs, ys):
    x, gamma, beta, mean, var = xs[:5]
    nd = len(ctx.in_shape(0))
    axis, key = _bn_axes(ctx)
    eps = float(ctx.attr('eps', 2e-5))
    if key == (1,) and nd >= 2:
        ctx.emit('BatchNormalization', [x, gamma, beta, mean, var], ys,
                 epsilon=eps)
        return
    dt = ctx.in_dtype(0)
    std = ctx.emit1('Sqrt', [ctx.emit1('Add', [var, ctx.scalar(eps, dt)])])
    scale = ctx.emit1('Div', [gamma, std])
    xc = ctx.emit1('Sub', [x, _expand_param(ctx, mean, key, nd)])
    y = ctx.emit1('Mul', [xc, _expand_param(ctx, scale, key, nd)])
    ctx.emit('Add', [y, _expand_param(ctx, beta, key, nd)], ys)


@converter('BatchNormalization')
def _cv_batch_bn(ctx, xs, ys):
    # Batch statistics (a schedule recorded in training mode).
    x, gamma, beta = xs[:3]
    nd = len(ctx.in_shape(0))
    axis, key = _bn_axes(ctx)
    eps = float(ctx.attr('eps', 2e-5))
    dt = ctx.in_dtype(0)
    mean = ctx.reduce('ReduceMean', x, axis, True)
    xc = ctx.emit1('Sub', [x, mean])
    var = ctx.reduce('ReduceMean', ctx.emit1('Mul', [xc, xc]), axis, True)
    std = ctx.emit1('Sqrt', [ctx.emit1('Add', [var, ctx.scalar(eps, dt)])])
    xh = ctx.emit1('Div', [xc, std])
    y = ctx.emit1('Mul', [xh, _expand_param(ctx, gamma, key, nd)])
    ctx.emit('Add', [y, _expand_param(ctx, beta, key, nd)], ys)


@converter('LocalResponseNormalization')
def _cv_lrn(ctx, xs, ys):
    n = int(ctx.attr('n', 5))
    size = 2 * (n // 2) + 1   # chainer sums n//2 channels on each side
    alpha = float(ctx.attr('alpha', 1e-4))
    ctx.emit('LRN', [xs[0]], ys, size=size, alpha=alpha * size,
             beta=float(ctx.attr('beta', 0.75)),
             bias=float(ctx.attr('k', 2)))


@converter('LayerNormalization')
def _cv_layer_norm(ctx, xs, ys):
    x, gamma, beta = xs[:3]
    dt = ctx.in_dtype(0)
    eps = float(ctx.attr('eps', 1e-5))
    mean = ctx.reduce('ReduceMean', x, [1], True)
    xc = ctx.emit1('Sub', [x, mean])
    var = ctx.reduce('ReduceMean', ctx.emit1('Mul', [xc, xc]), [1], True)
    std = ctx.emit1('Sqrt', [ctx.emit1('Add', [var, ctx.scalar(eps, dt)])])
    xh = ctx.emit1('Div', [xc, std])
    ctx.emit('Add', [ctx.emit1('Mul', [xh, gamma]), beta], ys)


@converter('GroupNormalization')
def _cv_group_norm(ctx, xs, ys):
    x, gamma, beta = xs[:3]
    x_shape = ctx.in_shape(0)
    nd = len(x_shape)
    groups = int(ctx.require('groups'))
    eps = float(ctx.attr('eps', 1e-5))
    dt = ctx.in_dtype(0)
    # (B, C, ...) -> (B, G, C/G * ...): 0 keeps the (dynamic) batch.
    g = ctx.reshape(x, [0, groups, -1])
    mean = ctx.reduce('ReduceMean', g, [2], True)
    gc = ctx.emit1('Sub', [g, mean])
    var = ctx.reduce('ReduceMean', ctx.emit1('Mul', [gc, gc]), [2], True)
    std = ctx.emit1('Sqrt', [ctx.emit1('Add', [var, ctx.scalar(eps, dt)])])
    xh = ctx.reshape(ctx.emit1('Div', [gc, std]),
                     ctx.emit1('Shape', [x]))
    shape = [x_shape[1]] + [1] * (nd - 2)
    y = ctx.emit1('Mul', [xh, ctx.reshape(gamma, shape)])
    ctx.emit('Add', [y, ctx.reshape(beta, shape)], ys)


@converter('NormalizeL2')
def _cv_normalize_l2(ctx, xs, ys):
    nd = len(ctx.in_shape(0))
    axis = ctx.attr('axis', 1)
    if isinstance(axis, int):
        axis = (axis,)
    axis = [_norm_axis(a, nd) for a in axis]
    dt = ctx.in_dtype(0)
    sq = ctx.reduce('ReduceSum', ctx.emit1('Mul', [xs[0], xs[0]]), axis,
                    True)
    norm = ctx.emit1('Add', [ctx.emit1('Sqrt', [sq]),
                             ctx.scalar(ctx.attr('eps', 1e-5), dt)])
    ctx.emit('Div', [xs[0], norm], ys)


# -- reductions --------------------------------------------------------------

def _reduced_axes(ctx):
    nd = len(ctx.in_shape(0))
    axis = ctx.attr('axis')
    if axis is None:
        return None
    if isinstance(axis, int):
        axis = (axis,)
    return sorted(_norm_axis(a, nd) for a in axis)


def _batch_after_reduce(ctx, axes, keepdims):
    info = ctx.in_batch(0)
    if info is None:
        return ctx.set_batch(0, None)
    a, f = info
    if axes is None or a in axes:
        return ctx.set_batch(0, None)
    if not keepdims:
        a -= sum(1 for r in axes if r < a)
    ctx.set_batch(0, a, f)


def _reduction(op_type, keep_default=False):
    def cv(ctx, xs, ys):
        axes = _reduced_axes(ctx)
        keepdims = bool(ctx.attr('keepdims', keep_default))
        if axes is not None and len(axes) == 0:
            ctx.emit('Identity', [xs[0]], ys)
        else:
            ctx.reduce(op_type, xs[0], axes, keepdims, ys[0])
        _batch_after_reduce(ctx, axes, keepdims)
    return cv


CONVERTERS['Sum'] = _reduction('ReduceSum')
CONVERTERS['Mean'] = _reduction('ReduceMean')
CONVERTERS['Average'] = _reduction('ReduceMean')
CONVERTERS['Max'] = _reduction('ReduceMax')
CONVERTERS['Min'] = _reduction('ReduceMin')
CONVERTERS['Prod'] = _reduction('ReduceProd')
CONVERTERS['LogSumExp'] = _reduction('ReduceLogSumExp')


def _arg_reduction(op_type):
    def cv(ctx, xs, ys):
        axis = ctx.attr('axis')
        x = xs[0]
        if axis is None:
            x = ctx.reshape(x, [-1])
            axis = 0
            ctx.set_batch(0, None)
        else:
            axis = _norm_axis(axis, len(ctx.in_shape(0)))
            _batch_after_reduce(ctx, [axis], False)
        r = ctx.emit1(op_type, [x], axis=axis, keepdims=0)
        ctx.emit('Cast', [r], ys, to=_onnx_dtype(ctx.onnx, ctx.out_dtype(0)))
    return cv


CONVERTERS['ArgMax'] = _arg_reduction('ArgMax')
CONVERTERS['ArgMin'] = _arg_reduction('ArgMin')


@converter('Cumsum')
def _cv_cumsum(ctx, xs, ys):
    axis = ctx.attr('axis')
    x = xs[0]
    if axis is None:
        x = ctx.reshape(x, [-1])
        axis = 0
        ctx.set_batch(0, None)
    ctx.emit('CumSum', [x, ctx.i64([int(axis)], 'axis')], ys)


# -- shapes -------------------------------------------------------------------

def _reshape_target(in_shape, info, out_shape, batch):
    """Reshape target that keeps working for other batch sizes.

    Returns ``(target, out_axis, out_factor)``; ``target`` has -1 at the
    output axis that carries the batch, ``out_axis`` is None when the batch
    could not be followed.
    """
    out_shape = [int(d) for d in out_shape]
    if info is None or not batch:
        return out_shape, None, 1
    a, f = info
    prefix = _prod(in_shape[:a])
    candidates = []
    for j in range(len(out_shape)):
        if _prod(out_shape[:j]) != prefix:
            continue
        if out_shape[j] % batch == 0 and out_shape[j] >= batch:
            candidates.append(j)
    if not candidates:
        return out_shape, None, 1
    # Prefer the axis that keeps the batch's size unchanged.
    exact = [j for j in candidates if out_shape[j] == in_shape[a]]
    j = (exact or candidates)[0]
    target = list(out_shape)
    target[j] = -1
    return target, j, out_shape[j] // batch


@converter('Reshape')
def _cv_reshape(ctx, xs, ys):
    in_shape, out_shape = ctx.in_shape(0), ctx.out_shape(0)
    info = ctx.in_batch(0) if ctx.dynamic_batch else None
    target, j, f = _reshape_target(in_shape, info, out_shape,
                                   ctx.batch_size)
    if info is not None and j is None:
        warnings.warn(
            'ONNX export: the reshape from %s to %s at %s mixes the batch '
            'dimension with others; it is exported with the recorded shape '
            'and the model will only work for batch size %s'
            % (tuple(in_shape), tuple(out_shape), ctx.op.source,
               ctx.batch_size))
    ctx.reshape(xs[0], target, ys[0])
    ctx.set_batch(0, j, f)


def _permute(ctx, xs, ys, perm):
    perm = [int(p) for p in perm]
    ctx.transpose(xs[0], perm, ys[0])
    info = ctx.in_batch(0)
    if info is None:
        ctx.set_batch(0, None)
    else:
        ctx.set_batch(0, perm.index(info[0]), info[1])


@converter('Transpose')
def _cv_transpose(ctx, xs, ys):
    nd = len(ctx.in_shape(0))
    axes = ctx.attr('axes')
    if axes is None:
        perm = list(reversed(range(nd)))
    else:
        perm = [_norm_axis(a, nd) for a in axes]
    _permute(ctx, xs, ys, perm)


@converter('Swapaxes')
def _cv_swapaxes(ctx, xs, ys):
    nd = len(ctx.in_shape(0))
    perm = list(range(nd))
    a = _norm_axis(ctx.require('axis1'), nd)
    b = _norm_axis(ctx.require('axis2'), nd)
    perm[a], perm[b] = perm[b], perm[a]
    _permute(ctx, xs, ys, perm)


@converter('Rollaxis')
def _cv_rollaxis(ctx, xs, ys):
    nd = len(ctx.in_shape(0))
    axis = _norm_axis(ctx.require('axis'), nd)
    start = int(ctx.attr('start', 0))
    if start < 0:
        start += nd
    if axis < start:
        start -= 1
    perm = list(range(nd))
    perm.remove(axis)
    perm.insert(start, axis)
    _permute(ctx, xs, ys, perm)


@converter('Moveaxis')
def _cv_moveaxis(ctx, xs, ys):
    nd = len(ctx.in_shape(0))
    src = ctx.require('source')
    dst = ctx.require('destination')
    if isinstance(src, int):
        src = (src,)
    if isinstance(dst, int):
        dst = (dst,)
    src = [_norm_axis(a, nd) for a in src]
    dst = [_norm_axis(a, nd) for a in dst]
    perm = [i for i in range(nd) if i not in src]
    for d, s in sorted(zip(dst, src)):
        perm.insert(d, s)
    _permute(ctx, xs, ys, perm)


@converter('Squeeze')
def _cv_squeeze(ctx, xs, ys):
    in_shape = ctx.in_shape(0)
    nd = len(in_shape)
    axis = ctx.attr('axis')
    if axis is None:
        axes = [i for i, d in enumerate(in_shape) if d == 1]
    else:
        if isinstance(axis, int):
            axis = (axis,)
        axes = sorted(_norm_axis(a, nd) for a in axis)
    if not axes:
        ctx.emit('Identity', [xs[0]], ys)
    else:
        ctx.squeeze(xs[0], axes, ys[0])
    info = ctx.in_batch(0)
    if info is None or info[0] in axes:
        ctx.set_batch(0, None)
    else:
        ctx.set_batch(0, info[0] - sum(1 for a in axes if a < info[0]),
                      info[1])


@converter('ExpandDims')
def _cv_expand_dims(ctx, xs, ys):
    out_nd = len(ctx.out_shape(0))
    axis = _norm_axis(ctx.require('axis'), out_nd)
    ctx.unsqueeze(xs[0], [axis], ys[0])
    info = ctx.in_batch(0)
    if info is None:
        ctx.set_batch(0, None)
    else:
        a = info[0] + (1 if axis <= info[0] else 0)
        ctx.set_batch(0, a, info[1])


@converter('Concat')
def _cv_concat(ctx, xs, ys):
    axis = _norm_axis(ctx.attr('axis', 1), len(ctx.out_shape(0)))
    ctx.emit('Concat', xs, ys, axis=axis)
    infos = [ctx.in_batch(i) for i in range(len(xs))]
    if all(info is not None and info[0] == axis for info in infos):
        # Concatenation along the batch axis: the factors add up.
        ctx.set_batch(0, axis, sum(info[1] for info in infos))


@converter('Stack')
def _cv_stack(ctx, xs, ys):
    out_nd = len(ctx.out_shape(0))
    axis = _norm_axis(ctx.attr('axis', 0), out_nd)
    parts = [ctx.unsqueeze(x, [axis]) for x in xs]
    ctx.emit('Concat', parts, ys, axis=axis)
    info = ctx.in_batch(0)
    if info is None:
        ctx.set_batch(0, None)
    else:
        a = info[0] + (1 if axis <= info[0] else 0)
        ctx.set_batch(0, a, info[1])


@converter('Hstack')
def _cv_hstack(ctx, xs, ys):
    nd = len(ctx.in_shape(0))
    if nd == 0:
        parts = [ctx.unsqueeze(x, [0]) for x in xs]
        ctx.emit('Concat', parts, ys, axis=0)
    else:
        ctx.emit('Concat', xs, ys, axis=0 if nd == 1 else 1)


@converter('Vstack')
def _cv_vstack(ctx, xs, ys):
    parts = []
    for i, x in enumerate(xs):
        nd = len(ctx.in_shape(i))
        if nd == 0:
            x = ctx.reshape(x, [1, 1])
        elif nd == 1:
            x = ctx.unsqueeze(x, [0])
        parts.append(x)
    ctx.emit('Concat', parts, ys, axis=0)


def _split_bounds(dim, indices):
    """(start, stop) of each piece of ``numpy.split(x, indices)``."""
    bounds = [0] + [min(max(int(i) if i >= 0 else int(i) + dim, 0), dim)
                    for i in indices] + [dim]
    return list(zip(bounds[:-1], bounds[1:]))


def _split_sizes(ctx, axis):
    """Chunk sizes of SplitAxis along ``axis``, from its attrs."""
    dim = int(ctx.in_shape(0)[axis])
    indices = ctx.attr('indices')
    sections = ctx.attr('sections')
    if indices is not None:
        return [max(b - a, 0) for a, b in _split_bounds(dim, indices)]
    if sections is not None:
        return [dim // int(sections)] * int(sections)
    return [int(ctx.out_shape(j)[axis]) for j in range(len(ctx.results))]


@converter('SplitAxis')
def _cv_split_axis(ctx, xs, ys):
    nd = len(ctx.in_shape(0))
    axis = _norm_axis(ctx.attr('axis', 0), nd)
    sizes = _split_sizes(ctx, axis)
    ys = ctx.result_names(ys, len(sizes))
    if len(ys) == 1:
        ctx.emit('Identity', [xs[0]], ys)
        return
    indices = ctx.attr('indices')
    if indices is not None and sum(sizes) != ctx.in_shape(0)[axis]:
        # Indices out of order ([4, 2]): the pieces overlap, as NumPy's
        # do; one Slice each.
        for (a, b), y in zip(_split_bounds(ctx.in_shape(0)[axis], indices),
                             ys):
            ctx.emit('Slice', [xs[0], ctx.i64([a], 'starts'),
                               ctx.i64([max(a, b)], 'ends'),
                               ctx.i64([axis], 'axes')], [y])
        return
    ctx.emit('Split', [xs[0], ctx.i64(sizes, 'split')], ys, axis=axis)


@converter('Separate')
def _cv_separate(ctx, xs, ys):
    nd = len(ctx.in_shape(0))
    axis = _norm_axis(ctx.attr('axis', 0), nd)
    n = int(ctx.in_shape(0)[axis])
    ys = ctx.result_names(ys, n)
    if n == 1:
        parts = [xs[0]]
    else:
        parts = ctx.emit('Split', [xs[0], ctx.i64([1] * n, 'split')],
                         n_out=n, axis=axis)
    for p, y in zip(parts, ys):
        ctx.squeeze(p, [axis], y)
    info = ctx.in_batch(0)
    for j in range(n):
        if info is None or info[0] == axis:
            ctx.set_batch(j, None)
        else:
            ctx.set_batch(j, info[0] - (1 if axis < info[0] else 0), info[1])


def _expand_target(ctx, in_shape, in_info, out_shape, out_info):
    """Shape tensor for Expand from ``in_shape`` to ``out_shape``."""
    nd = len(out_shape)
    off = nd - len(in_shape)
    dims = []
    for i in range(nd):
        d_in = in_shape[i - off] if i >= off else 1
        dims.append(1 if d_in == out_shape[i] else int(out_shape[i]))
    if out_info is not None:
        a, f = out_info
        if in_info is not None and in_info[0] + off == a:
            dims[a] = 1     # Expand keeps the input's (dynamic) batch
            return ctx.i64(dims)
        return ctx.shape_tensor(dims, a, f)
    return ctx.i64(dims)


def _broadcast_out_info(ctx, i, out_shape):
    info = ctx.in_batch(i)
    if info is None:
        return None
    return (info[0] + len(out_shape) - len(ctx.in_shape(i)), info[1])


@converter('BroadcastTo')
def _cv_broadcast_to(ctx, xs, ys):
    in_shape, out_shape = ctx.in_shape(0), ctx.out_shape(0)
    out_info = _broadcast_out_info(ctx, 0, out_shape)
    if (out_info is None and ctx.dynamic_batch
            and ctx._batch_source is not None and len(out_shape) >= 1
            and ctx.batch_size is not None and ctx.batch_size > 1
            and out_shape[0] == ctx.batch_size
            and (len(in_shape) < len(out_shape) or in_shape[0] == 1)):
        # Broadcasting a batch-free value to ``x.shape``: the leading
        # dimension is the batch size, taken from the input at run time.
        out_info = (0, 1)
    ctx.emit('Expand', [xs[0], _expand_target(ctx, in_shape, ctx.in_batch(0),
                                              out_shape, out_info)], ys)
    ctx.set_batch(0, *(out_info or (None,)))


@converter('Broadcast')
def _cv_broadcast(ctx, xs, ys):
    out_shape = ctx.any_out_shape()
    ys = ctx.result_names(ys, len(xs))
    out_info = None
    for i in range(len(xs)):
        out_info = _broadcast_out_info(ctx, i, out_shape)
        if out_info is not None:
            break
    for i, (x, y) in enumerate(zip(xs, ys)):
        ctx.emit('Expand', [x, _expand_target(
            ctx, ctx.in_shape(i), ctx.in_batch(i), out_shape, out_info)], [y])
        ctx.set_batch(i, *(out_info or (None,)))


@converter('Tile')
def _cv_tile(ctx, xs, ys):
    reps = ctx.require('reps')
    if isinstance(reps, int):
        reps = (reps,)
    reps = [int(r) for r in reps]
    x = xs[0]
    nd = len(ctx.in_shape(0))
    info = ctx.in_batch(0)
    shift = 0
    if len(reps) > nd:
        shift = len(reps) - nd
        x = ctx.unsqueeze(x, list(range(shift)))
    elif len(reps) < nd:
        reps = [1] * (nd - len(reps)) + reps
    ctx.emit('Tile', [x, ctx.i64(reps, 'repeats')], ys)
    if info is None or reps[info[0] + shift] != 1:
        ctx.set_batch(0, None)
    else:
        ctx.set_batch(0, info[0] + shift, info[1])


def _flip(ctx, xs, ys, axis):
    axis = _norm_axis(axis, len(ctx.in_shape(0)))
    ctx.emit('Slice', [xs[0], ctx.i64([-1], 'starts'),
                       ctx.i64([INT64_MIN], 'ends'), ctx.i64([axis], 'axes'),
                       ctx.i64([-1], 'steps')], ys)


@converter('Flip')
def _cv_flip(ctx, xs, ys):
    _flip(ctx, xs, ys, ctx.require('axis'))


@converter('FlipLR')
def _cv_fliplr(ctx, xs, ys):
    _flip(ctx, xs, ys, 1)


@converter('FlipUD')
def _cv_flipud(ctx, xs, ys):
    _flip(ctx, xs, ys, 0)


@converter('Pad')
def _cv_pad(ctx, xs, ys):
    nd = len(ctx.in_shape(0))
    mode = ctx.attr('mode', 'constant')
    onnx_mode = {'constant': 'constant', 'reflect': 'reflect',
                 'edge': 'edge'}.get(mode)
    if onnx_mode is None:
        raise ctx.unsupported('pad mode %r' % (mode,))
    width = numpy.broadcast_to(
        numpy.asarray(ctx.require('pad_width'), dtype=numpy.int64), (nd, 2))
    pads = ctx.i64(list(width[:, 0]) + list(width[:, 1]), 'pads')
    ins = [xs[0], pads]
    if onnx_mode == 'constant':
        cv = ctx.attr('constant_values', 0)
        if numpy.ndim(cv) != 0:
            cv = numpy.asarray(cv)
            if numpy.all(cv == cv.flat[0]):
                cv = cv.flat[0]
            else:
                raise ctx.unsupported('per-axis constant_values')
        ins.append(ctx.scalar(cv, ctx.in_dtype(0), 'pad_value'))
    ctx.emit('Pad', ins, ys, mode=onnx_mode)


@converter('Depth2Space')
def _cv_depth2space(ctx, xs, ys):
    ctx.emit('DepthToSpace', [xs[0]], ys, blocksize=int(ctx.require('r')),
             mode='DCR')


@converter('Space2Depth')
def _cv_space2depth(ctx, xs, ys):
    ctx.emit('SpaceToDepth', [xs[0]], ys, blocksize=int(ctx.require('r')))


# -- indexing -----------------------------------------------------------------

def _expand_index(ctx, items, nd):
    """Replace the ellipsis (or pad at the end) with full slices."""
    consumed = 0
    for it in items:
        if it[0] in ('newaxis', 'ellipsis'):
            continue
        if it[0] == 'array' and numpy.asarray(it[1]).dtype == bool:
            consumed += max(numpy.asarray(it[1]).ndim, 1)
        else:
            consumed += 1
    fill = [('slice', None, None, None)] * max(nd - consumed, 0)
    out = []
    done = False
    for it in items:
        if it[0] == 'ellipsis':
            if not done:
                out.extend(fill)
                done = True
            continue
        out.append(tuple(it))
    if not done:
        out.extend(fill)
    return out


@converter('GetItem')
def _cv_getitem(ctx, xs, ys):
    in_shape = ctx.in_shape(0)
    nd = len(in_shape)
    items = _expand_index(ctx, ctx.require('slices'), nd)
    info = ctx.in_batch(0)
    slices = []     # (axis, start, stop, step)
    gathers = []    # (axis, index array or int)
    newaxes = []    # output positions
    out_batch = None
    in_axis = out_axis = 0
    n_arrays = 0
    adv_positions = []
    for it in items:
        tag = it[0]
        if tag == 'newaxis':
            newaxes.append(out_axis)
            out_axis += 1
        elif tag == 'slice':
            start, stop, step = it[1], it[2], it[3]
            full = (start in (None, 0) and stop is None
                    and step in (None, 1))
            if not full:
                step = 1 if step is None else int(step)
                if step == 0:
                    raise ctx.unsupported('slice step 0')
                if info is None or info[0] != in_axis:
                    # A fixed axis: Python's bounds (ONNX clamps a start
                    # before the axis to its first element: x[-10::-1]).
                    start, stop, step = slice(start, stop, step).indices(
                        int(in_shape[in_axis]))
                    if not len(range(start, stop, step)):
                        start, stop, step = 0, 0, 1
                    elif stop < 0:
                        stop = INT64_MIN
                elif start is None:
                    start = 0 if step > 0 else -1
                if stop is None:
                    stop = INT64_MAX if step > 0 else INT64_MIN
                slices.append((in_axis, int(start), int(stop), step))
            if info is not None and info[0] == in_axis and full:
                out_batch = (out_axis, info[1])
            in_axis += 1
            out_axis += 1
        elif tag == 'index':
            gathers.append((in_axis, int(it[1])))
            adv_positions.append(in_axis)
            in_axis += 1
        elif tag == 'array':
            arr = numpy.asarray(it[1])
            if arr.dtype == bool:
                if arr.ndim != 1:
                    raise ctx.unsupported(
                        'boolean index arrays of %d dimensions' % arr.ndim)
                arr = numpy.nonzero(arr)[0]
            if arr.dtype.kind not in 'iu':
                raise ctx.unsupported('index array of dtype %s' % arr.dtype)
            n_arrays += 1
            gathers.append((in_axis, arr.astype(numpy.int64)))
            adv_positions.append(in_axis)
            in_axis += 1
            out_axis += arr.ndim
        else:
            raise ctx.unsupported('index item %r' % (tag,))
    if in_axis > nd:
        raise ctx.unsupported('too many indices for %d-d input' % nd)
    if n_arrays > 1:
        raise ctx.unsupported('more than one index array')
    if n_arrays == 1 and adv_positions != list(
            range(adv_positions[0], adv_positions[0] + len(adv_positions))):
        raise ctx.unsupported(
            'an index array combined with non-adjacent integer indices')

    x = xs[0]
    if slices:
        x = ctx.emit1('Slice', [
            x, ctx.i64([s[1] for s in slices], 'starts'),
            ctx.i64([s[2] for s in slices], 'ends'),
            ctx.i64([s[0] for s in slices], 'axes'),
            ctx.i64([s[3] for s in slices], 'steps')])
    for axis, idx in sorted(gathers, key=lambda g: -g[0]):
        if isinstance(idx, int):
            ind = ctx.const(numpy.asarray(idx, dtype=numpy.int64), 'index')
        else:
            ind = ctx.const(idx, 'indices')
        x = ctx.emit1('Gather', [x, ind], axis=axis)
    if newaxes:
        x = ctx.unsqueeze(x, newaxes)
    if x == xs[0]:
        ctx.emit('Identity', [x], ys)
    else:
        # Rename the last node's output to the op's output.
        last = ctx.nodes[-1]
        last.output[0] = ys[0]
    if out_batch is None:
        ctx.set_batch(0, None)
    else:
        ctx.set_batch(0, *out_batch)
