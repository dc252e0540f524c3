"""The conversion context: ONNX names, initializers, value infos, the
batch axis followed through the ops, and the building of the model from
the live ops of a schedule with the converters of ``CONVERTERS``."""
import numpy

from schedules import ir
from schedules import liveness
from schedules.onnx_export.common import (
    CONVERTERS, INT64_MIN, UnsupportedOpError, _address, _arrays_in,
    _as_slices, _onnx_dtype, _root, _to_numpy, float_types_alike,
    sanitize_name)


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
        self._per_call_bufs = None
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

    def constant_attr(self, key):
        """Attribute ``key`` of the op, which becomes an ONNX constant:
        refused where an array in it (a tuple of them at any depth) shows
        memory that replay refreshes at every call (F.where's condition or
        F.get_item's index computed with NumPy from the input): a constant
        would freeze the recorded call's values."""
        value = self.require(key)
        for a in _arrays_in(value):
            b = self._per_call_memory().get(id(_root(a)))
            if b is not None:
                raise self.unsupported(
                    'its %s is computed at every call (from %%%d, with '
                    'NumPy), which an ONNX constant would freeze; compute '
                    'it with Chainer functions to export' % (key, b))
        return value

    def _per_call_memory(self):
        """id(root array) -> buffer id, for the buffers that hold each
        call's values (not parameters, persistents or constants)."""
        if self._per_call is None:
            self._per_call = dict(
                (id(o.storage), k) for k, o in self._per_call_buffers()
                if _root(o.storage) is o.storage)
        return self._per_call

    def _per_call_buffers(self):
        """(buffer id, buffer) of the buffers with storage that hold each
        call's values."""
        if self._per_call_bufs is None:
            self._per_call_bufs = [
                (k, o) for k, o in self.buffers.items()
                if o.role not in (ir.PARAM, ir.PERSIST, ir.CONST) and
                o.storage is not None]
        return self._per_call_bufs

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
        found = self._per_call_memory().get(id(_root(buf.storage)))
        if found is None:
            # A view of memory a buffer of each call's values lives in,
            # planned into a larger block (``F.fix(x)``'s result, a view
            # of its NumPy call's): that buffer's values, not constants.
            for k, o in self._per_call_buffers():
                if numpy.may_share_memory(o.storage, buf.storage):
                    return k
        return found

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

        # Live ops only; a view's ops are those of what it views (an
        # output that is a view of a NumPy call's result needs that call).
        def bases(b):
            base = bufs[b].view_of
            if base is None:
                base = self._view_base(b)
            return () if base is None else (base,)

        producer, live, _ = liveness.ancestors(sched.ops, sched.outputs,
                                               bases)

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
            if op.kind != 'FixedBatchNormalization':
                # (Its converter decides: ONNX's takes a mixed16 model's
                # from opset 15.)
                float_types_alike(self, op)
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
            if self.dynamic_batch and self.other_batch is not None:
                # (An axis that changes with the batch otherwise than as
                # a multiple of it: ``x[1:]``, ``F.vstack((x, x))``.)
                other = self.other_batch[1].get(b)
                if other is not None and len(other) == len(dims):
                    dims = [None if d != o and not isinstance(d, str) else d
                            for d, o in zip(dims, other)]
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
