"""ONNX export: IR-level tests, describe() on real nodes, and end-to-end.

(a) IR-level tests build ``Schedule`` objects by hand, or from a define-by-run
    forward through a small tracing harness (``trace`` below: a FunctionHook
    that records every FunctionNode applied, with ``describe()`` attrs), and
    check the exported model with ``onnx.checker`` and onnxruntime against
    Chainer at two batch sizes.
(b) ``describe()`` on real Chainer function nodes.
(c) Integration through ``static_graph.export_onnx`` (skipped until the core
    provides it): MLP, small CNN and the ImageNet example models.

Tests that need onnx / onnxruntime skip when they are not installed.
"""
import ast
import importlib.util
import os
import sys
import warnings

import numpy
import pytest

import chainer
import chainer.functions as F
import chainer.links as L

import static_graph
from schedules import ir
from schedules import onnx_export
from schedules.onnx_export import UnsupportedOpError
from static_graph import describe as describe_mod
from static_graph.describe import describe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

RECORD_BATCH = 2
OTHER_BATCH = 3

# Max abs differences (ONNX Runtime vs Chainer), reported at the end.
DIFFS = {}


def _onnx():
    return pytest.importorskip(
        'onnx', reason='onnx is not installed '
        '(pip install chainer-static-graph[onnx])')


def _ort():
    _onnx()
    return pytest.importorskip(
        'onnxruntime', reason='onnxruntime is not installed '
        '(pip install chainer-static-graph[onnx])')


def _session(model):
    ort = _ort()
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 2
    opts.inter_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), opts,
                                providers=['CPUExecutionProvider'])


def _check(model):
    onnx = _onnx()
    onnx.checker.check_model(model, full_check=True)


def _tol(ref):
    # rtol 1e-5; atol 1e-5 relative to the output's magnitude (float32
    # rounding of the intermediate values grows with it).
    scale = float(numpy.max(numpy.abs(ref))) if ref.size else 0.0
    return dict(rtol=1e-5, atol=1e-5 * max(scale, 1e-6))


def _compare(key, got, want, record_property=None):
    got = numpy.asarray(got)
    want = numpy.asarray(want)
    assert got.shape == want.shape, (key, got.shape, want.shape)
    if want.dtype.kind == 'f':
        diff = float(numpy.max(numpy.abs(got.astype(numpy.float64) -
                                          want))) if want.size else 0.0
        DIFFS[key] = max(DIFFS.get(key, 0.0), diff)
        if record_property is not None:
            record_property('max_abs_diff_' + key.replace(' ', '_'), diff)
        numpy.testing.assert_allclose(got, want, err_msg=key, **_tol(want))
    else:
        numpy.testing.assert_array_equal(got, want, err_msg=key)


# ----------------------------------------------------------------------------
# Tracing harness (tests only): a define-by-run forward -> Schedule
# ----------------------------------------------------------------------------

class _Tracer(chainer.FunctionHook):
    name = 'onnx_test_tracer'

    def __init__(self):
        self.calls = []

    def forward_postprocess(self, function, in_data):
        self.calls.append((function, tuple(in_data)))


def _undecorated(obj, method='forward'):
    f = getattr(type(obj), method)
    return getattr(f, '__wrapped__', f).__get__(obj, type(obj))


def trace(fn, args, link=None):
    """Run ``fn(*args)`` define-by-run and record it as a Schedule.

    Returns ``(schedule, values, outputs)``. Parameters of ``link`` become
    PARAM buffers, its persistent arrays PERSIST buffers, other arrays fed to
    functions CONST buffers.
    """
    params, persist = {}, {}
    if link is not None:
        for name, p in link.namedparams():
            if p.array is not None:
                params[id(p.array)] = (name, p.array)
        for path, sub in link.namedlinks():
            for pname in sub._persistent:
                v = getattr(sub, pname)
                if isinstance(v, numpy.ndarray):
                    full = '/' + pname if path == '/' else path + '/' + pname
                    persist[id(v)] = (full, v)
    tracer = _Tracer()
    with chainer.using_config('train', False), \
            chainer.force_backprop_mode(), tracer:
        ys = fn(*args)
    single = not isinstance(ys, (tuple, list))
    ys = [ys] if single else list(ys)

    buffers = {}
    keep = []

    def new(shape, dtype, role, name=None, storage=None):
        bid = len(buffers)
        buffers[bid] = ir.Buffer(bid, shape, dtype, role, name,
                                 storage=storage)
        return bid

    arr_map, node_map, values = {}, {}, {}
    inputs = []
    for i, a in enumerate(args):
        bid = new(a.shape, a.dtype, ir.INPUT,
                  'x' if len(args) == 1 else 'args[%d]' % i)
        arr_map[id(a)] = bid
        inputs.append(bid)
    ops = []
    for k, (f, in_data) in enumerate(tracer.calls):
        ins = []
        for vn, a in zip(f.inputs, in_data):
            if id(vn) in node_map:
                ins.append(node_map[id(vn)])
                continue
            if id(a) not in arr_map:
                if id(a) in params:
                    name, arr = params[id(a)]
                    bid = new(a.shape, a.dtype, ir.PARAM, name)
                    values[bid] = numpy.array(arr)
                elif id(a) in persist:
                    name, arr = persist[id(a)]
                    bid = new(a.shape, a.dtype, ir.PERSIST, name)
                    values[bid] = numpy.array(arr)
                else:
                    bid = new(a.shape, a.dtype, ir.CONST,
                              storage=numpy.array(a))
                arr_map[id(a)] = bid
            ins.append(arr_map[id(a)])
        outs = []
        for ref in f.outputs:
            vn = ref()
            if vn is None:
                outs.append(new((), numpy.float32, ir.TEMP))
            else:
                bid = new(vn.shape, vn.dtype, ir.TEMP)
                node_map[id(vn)] = bid
                keep.append(vn)
                outs.append(bid)
        ops.append(ir.Op(describe_mod.kind_of(f), ins, outs, describe(f),
                         source='trace.py:%d' % (k + 1)))
    outputs = [node_map[id(y.node)] for y in ys]
    sched = ir.Schedule('traced', buffers, ops, inputs, outputs)
    sched.verify()
    return sched, values, [numpy.array(y.array) for y in ys]


def _run_chainer(fn, args):
    with chainer.using_config('train', False), chainer.no_backprop_mode():
        ys = fn(*args)
    if not isinstance(ys, (tuple, list)):
        ys = [ys]
    return [numpy.array(y.array) for y in ys]


def _feeds(sess, args):
    return {i.name: a for i, a in zip(sess.get_inputs(), args)}


def export_and_compare(key, fn, make_args, link=None, dynamic=True,
                       opset=13, record_property=None):
    args = make_args(RECORD_BATCH)
    _run_chainer(fn, args)      # initialise lazy parameters first
    sched, values, ref = trace(fn, args, link)
    model = onnx_export.schedule_to_onnx(sched, values, opset=opset,
                                         dynamic_batch=dynamic)
    _check(model)
    sess = _session(model)
    got = sess.run(None, _feeds(sess, args))
    for i, (g, r) in enumerate(zip(got, ref)):
        _compare('%s[%d] b=%d' % (key, i, RECORD_BATCH), g, r,
                 record_property)
    if dynamic:
        args = make_args(OTHER_BATCH)
        ref = _run_chainer(fn, args)
        got = sess.run(None, _feeds(sess, args))
        for i, (g, r) in enumerate(zip(got, ref)):
            _compare('%s[%d] b=%d' % (key, i, OTHER_BATCH), g, r,
                     record_property)
    return model, sched


# ----------------------------------------------------------------------------
# (a) IR-level tests on hand-built schedules
# ----------------------------------------------------------------------------

def _linear_relu_schedule(batch=2, n_in=4, n_out=3, op_kind='ReLU',
                          source='model.py:7'):
    bufs = {
        0: ir.Buffer(0, (batch, n_in), numpy.float32, ir.INPUT, 'x'),
        1: ir.Buffer(1, (n_out, n_in), numpy.float32, ir.PARAM, '/l1/W'),
        2: ir.Buffer(2, (n_out,), numpy.float32, ir.PARAM, '/l1/b'),
        3: ir.Buffer(3, (batch, n_out), numpy.float32, ir.TEMP),
        4: ir.Buffer(4, (batch, n_out), numpy.float32, ir.TEMP),
    }
    ops = [ir.Op('LinearFunction', (0, 1, 2), (3,), {}, 'model.py:6'),
           ir.Op(op_kind, (3,), (4,), {}, source)]
    sched = ir.Schedule('forward', bufs, ops, (0,), (4,))
    sched.verify()
    rs = numpy.random.RandomState(0)
    values = {1: rs.randn(n_out, n_in).astype(numpy.float32),
              2: rs.randn(n_out).astype(numpy.float32)}
    return sched, values


def test_linear_relu_schedule():
    onnx = _onnx()
    sched, values = _linear_relu_schedule()
    model = onnx_export.schedule_to_onnx(sched, values)
    _check(model)
    assert model.opset_import[0].version == 13
    g = model.graph
    assert [i.name for i in g.initializer] == ['l1.W', 'l1.b']
    assert [i.name for i in g.input] == ['x']
    assert [o.name for o in g.output] == ['output']
    dims = g.input[0].type.tensor_type.shape.dim
    assert dims[0].dim_param == 'batch' and dims[1].dim_value == 4
    assert g.output[0].type.tensor_type.shape.dim[0].dim_param == 'batch'
    assert [n.op_type for n in g.node] == ['Gemm', 'Relu']
    assert g.node[0].doc_string == 'LinearFunction at model.py:6'
    sess = _session(model)
    W, b = values[1], values[2]
    for batch in (2, 5):
        x = numpy.random.RandomState(batch).randn(batch, 4).astype('f')
        got, = sess.run(None, {'x': x})
        _compare('hand linear+relu b=%d' % batch, got,
                 numpy.maximum(x.dot(W.T) + b, 0))
    del onnx


def test_fixed_batch_option():
    _onnx()
    sched, values = _linear_relu_schedule()
    model = onnx_export.schedule_to_onnx(sched, values, dynamic_batch=False,
                                         input_names=['data'],
                                         output_names=['prob'],
                                         graph_name='mlp')
    _check(model)
    g = model.graph
    assert g.name == 'mlp'
    assert g.input[0].name == 'data' and g.output[0].name == 'prob'
    assert g.input[0].type.tensor_type.shape.dim[0].dim_value == 2
    with pytest.raises(ValueError):
        onnx_export.schedule_to_onnx(sched, values, input_names=['a', 'b'])
    with pytest.raises(ValueError):
        onnx_export.schedule_to_onnx(sched, values, output_names=[])


def test_reshape_recorded_with_concrete_batch():
    _onnx()
    # x: (2, 3, 4) -> Reshape((2, 12)) -> Linear -> Reshape((2, 1, 5))
    bufs = {
        0: ir.Buffer(0, (2, 3, 4), numpy.float32, ir.INPUT, 'x'),
        1: ir.Buffer(1, (2, 12), numpy.float32, ir.TEMP),
        2: ir.Buffer(2, (5, 12), numpy.float32, ir.PARAM, '/fc/W'),
        3: ir.Buffer(3, (2, 5), numpy.float32, ir.TEMP),
        4: ir.Buffer(4, (2, 1, 5), numpy.float32, ir.TEMP),
    }
    ops = [ir.Op('Reshape', (0,), (1,), {'shape': (2, 12)}),
           ir.Op('LinearFunction', (1, 2), (3,)),
           ir.Op('Reshape', (3,), (4,), {'shape': (2, 1, 5)})]
    sched = ir.Schedule('forward', bufs, ops, (0,), (4,))
    W = numpy.random.RandomState(1).randn(5, 12).astype('f')
    model = onnx_export.schedule_to_onnx(sched, {2: W})
    _check(model)
    sess = _session(model)
    for batch in (2, 7):
        x = numpy.random.RandomState(batch).randn(batch, 3, 4).astype('f')
        got, = sess.run(None, {'x': x})
        want = x.reshape(batch, 12).dot(W.T).reshape(batch, 1, 5)
        _compare('hand reshape b=%d' % batch, got, want)


def test_outputs_that_are_inputs_or_params_or_repeated():
    _onnx()
    sched, values = _linear_relu_schedule()
    sched.outputs = (4, 0, 4, 1)
    model = onnx_export.schedule_to_onnx(sched, values)
    _check(model)
    assert [o.name for o in model.graph.output] == [
        'output_0', 'output_1', 'output_2', 'output_3']
    sess = _session(model)
    x = numpy.ones((3, 4), 'f')
    y, x2, y2, w = sess.run(None, {'x': x})
    numpy.testing.assert_array_equal(y, y2)
    numpy.testing.assert_array_equal(x2, x)
    numpy.testing.assert_array_equal(w, values[1])


def test_const_buffer_falls_back_to_storage_and_missing_param_fails():
    _onnx()
    c = numpy.arange(3, dtype=numpy.float32)
    bufs = {0: ir.Buffer(0, (2, 3), numpy.float32, ir.INPUT, 'x'),
            1: ir.Buffer(1, (3,), numpy.float32, ir.CONST, storage=c),
            2: ir.Buffer(2, (2, 3), numpy.float32, ir.TEMP)}
    sched = ir.Schedule('f', bufs, [ir.Op('Add', (0, 1), (2,))], (0,), (2,))
    model = onnx_export.schedule_to_onnx(sched, {})
    _check(model)
    got, = _session(model).run(None, {'x': numpy.ones((4, 3), 'f')})
    numpy.testing.assert_array_equal(got, numpy.ones((4, 3), 'f') + c)
    p, _ = _linear_relu_schedule()
    with pytest.raises(ValueError, match='l1/W'):
        onnx_export.schedule_to_onnx(p, {})


def test_unsupported_op_names_kind_and_source_and_writes_nothing(tmp_path):
    _onnx()
    sched, values = _linear_relu_schedule(op_kind='FancyNewOp',
                                          source='my_model.py:42')
    path = tmp_path / 'model.onnx'
    with pytest.raises(UnsupportedOpError) as e:
        onnx_export.export_schedule(sched, values, str(path))
    err = e.value
    assert isinstance(err, ValueError)
    assert err.kind == 'FancyNewOp' and err.source == 'my_model.py:42'
    assert 'FancyNewOp' in str(err) and 'my_model.py:42' in str(err)
    assert not path.exists()
    assert os.listdir(str(tmp_path)) == []
    # An existing file is left untouched.
    path.write_bytes(b'old')
    with pytest.raises(UnsupportedOpError):
        onnx_export.export_schedule(sched, values, str(path))
    assert path.read_bytes() == b'old'
    assert os.listdir(str(tmp_path)) == ['model.onnx']


def test_all_unsupported_ops_are_listed():
    _onnx()
    sched, values = _linear_relu_schedule(op_kind='FancyA', source='a.py:1')
    sched.ops[0].kind = 'FancyB'
    sched.ops[0].source = 'b.py:2'
    with pytest.raises(UnsupportedOpError) as e:
        onnx_export.schedule_to_onnx(sched, values)
    assert e.value.kind == 'FancyB' and e.value.source == 'b.py:2'
    assert 'FancyA at a.py:1' in str(e.value)


def test_state_outputs_and_select():
    # The recorder appends an op's hidden state (STATE buffers) to its
    # outputs, and ``select`` maps outputs to result positions: results
    # without a buffer (unused) are skipped.
    _onnx()
    bufs = {
        0: ir.Buffer(0, (2, 3, 4, 4), numpy.float32, ir.INPUT, 'x'),
        1: ir.Buffer(1, (2, 3, 2, 2), numpy.float32, ir.TEMP),
        2: ir.Buffer(2, (2, 3, 2, 2), numpy.int64, ir.STATE,
                     'MaxPoolingND.indexes'),
        3: ir.Buffer(3, (2, 2, 2, 2), numpy.float32, ir.TEMP),
        4: ir.Buffer(4, (2, 2, 2, 2), numpy.float32, ir.TEMP),
    }
    ops = [ir.Op('MaxPoolingND', (0,), (1, 2),
                 {'ndim': 2, 'ksize': (2, 2), 'stride': (2, 2),
                  'pad': (0, 0), 'cover_all': True}, 'a.py:1'),
           # split 3 channels into [1, 2]: only the second chunk is used.
           ir.Op('SplitAxis', (1,), (3,), {'axis': 1, 'indices': (1,)},
                 'a.py:2', select=(1,)),
           ir.Op('ReLU', (3,), (4,), {}, 'a.py:3')]
    sched = ir.Schedule('forward', bufs, ops, (0,), (4,))
    sched.verify()
    model = onnx_export.schedule_to_onnx(sched, {})
    _check(model)
    sess = _session(model)
    for b in (2, 3):
        x = _rand(b, 3, 4, 4)
        got, = sess.run(None, {'x': x})
        want = numpy.maximum(
            x.reshape(b, 3, 2, 2, 2, 2).max(axis=(3, 5))[:, 1:], 0)
        _compare('hand state+select b=%d' % b, got, want)


def test_params_among_schedule_inputs_become_initializers():
    # The core's compiled forward binds parameters as schedule inputs.
    _onnx()
    sched, values = _linear_relu_schedule()
    sched.inputs = (0, 1, 2)
    model = onnx_export.schedule_to_onnx(sched, values)
    _check(model)
    assert [i.name for i in model.graph.input] == ['x']
    assert [i.name for i in model.graph.initializer] == ['l1.W', 'l1.b']


def test_dead_unsupported_op_is_pruned():
    _onnx()
    sched, values = _linear_relu_schedule()
    b = sched.buffers
    b[5] = ir.Buffer(5, (), numpy.float32, ir.TEMP)
    sched.ops.append(ir.Op('SoftmaxCrossEntropy', (4,), (5,), {}, 'x.py:1'))
    model = onnx_export.schedule_to_onnx(sched, values)
    _check(model)
    assert [n.op_type for n in model.graph.node] == ['Gemm', 'Relu']


def test_save_onnx_is_atomic(tmp_path, monkeypatch):
    _onnx()
    sched, values = _linear_relu_schedule()
    model = onnx_export.schedule_to_onnx(sched, values)
    path = tmp_path / 'm.onnx'
    onnx_export.save_onnx(model, str(path))
    onnx = _onnx()
    loaded = onnx.load(str(path))
    _check(loaded)

    def broken_replace(src, dst):
        raise OSError('disk full')
    monkeypatch.setattr(onnx_export.api.os, 'replace', broken_replace)
    path2 = tmp_path / 'm2.onnx'
    with pytest.raises(OSError, match='disk full'):
        onnx_export.save_onnx(model, str(path2))
    assert sorted(os.listdir(str(tmp_path))) == ['m.onnx']


@pytest.mark.parametrize('opset', [7, 12, '12'])
def test_opset_below_13_rejected(opset):
    _onnx()
    sched, values = _linear_relu_schedule()
    with pytest.raises(ValueError, match='opset 13 or newer'):
        onnx_export.schedule_to_onnx(sched, values, opset=opset)


@pytest.mark.parametrize('opset', [13.5, '13.5', None, True])
def test_opset_not_an_integer_rejected(opset):
    _onnx()
    sched, values = _linear_relu_schedule()
    with pytest.raises(ValueError, match='must be an integer'):
        onnx_export.schedule_to_onnx(sched, values, opset=opset)


@pytest.mark.parametrize('names', [dict(input_names=['']),
                                   dict(output_names=[''])])
def test_empty_tensor_names_rejected(names):
    _onnx()
    sched, values = _linear_relu_schedule()
    with pytest.raises(ValueError, match='non-empty'):
        onnx_export.schedule_to_onnx(sched, values, **names)


def test_missing_directory_named(tmp_path):
    _onnx()
    sched, values = _linear_relu_schedule()
    path = tmp_path / 'no' / 'm.onnx'
    with pytest.raises(FileNotFoundError, match='no directory'):
        onnx_export.export_schedule(sched, values, str(path))


def test_opset_too_new_rejected():
    onnx = _onnx()
    sched, values = _linear_relu_schedule()
    with pytest.raises(ValueError, match='newer'):
        onnx_export.schedule_to_onnx(
            sched, values, opset=onnx.defs.onnx_opset_version() + 1)


def test_missing_onnx_gives_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, 'onnx', None)
    sched, values = _linear_relu_schedule()
    with pytest.raises(ImportError,
                       match=r'pip install chainer-static-graph\[onnx\]'):
        onnx_export.schedule_to_onnx(sched, values)


def test_exporter_does_not_import_chainer():
    package = os.path.join(ROOT, 'schedules', 'onnx_export')
    paths = sorted(os.path.join(package, f) for f in os.listdir(package)
                   if f.endswith('.py'))
    assert os.path.join(package, '__init__.py') in paths
    for path in paths:
        tree = ast.parse(open(path).read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or '']
            else:
                continue
            for n in names:
                assert n.split('.')[0] not in ('chainer', 'static_graph'), \
                    (path, n)


def test_supported_kinds_cover_the_contract():
    want = {'LinearFunction', 'Convolution2DFunction',
            'Deconvolution2DFunction', 'ReLU', 'LeakyReLU', 'Sigmoid', 'Tanh',
            'ClippedReLU', 'MaxPooling2D', 'MaxPoolingND', 'AveragePooling2D',
            'FixedBatchNormalization', 'BatchNormalization',
            'LocalResponseNormalization', 'Dropout', 'Concat', 'Reshape',
            'Transpose', 'Add', 'AddConstant', 'Sub', 'Mul', 'MulConstant',
            'Div', 'Softmax', 'LogSoftmax', 'Sum', 'Mean', 'Average',
            'BroadcastTo', 'GetItem', 'Exp', 'Log'}
    assert want <= set(onnx_export.supported_kinds())


# -- converters checked against Chainer through the tracing harness ---------

def _rand(*shape, **kw):
    seed = kw.pop('seed', 0)
    lo, hi = kw.pop('low', -1.0), kw.pop('high', 1.0)
    rs = numpy.random.RandomState(seed + shape[0])
    return rs.uniform(lo, hi, shape).astype(numpy.float32)


def _x(*rest, **kw):
    return lambda b: (_rand(b, *rest, **kw),)


def _xy(*rest, **kw):
    return lambda b: (_rand(b, *rest, **kw), _rand(b, *rest, seed=7, **kw))


def _v(x):
    return chainer.as_variable(x)


class _Links(chainer.Chain):
    def __init__(self, **links):
        super(_Links, self).__init__()
        with self.init_scope():
            for k, v in links.items():
                setattr(self, k, v)


def _bn_link(n, **kw):
    bn = L.BatchNormalization(n, **kw)
    rs = numpy.random.RandomState(3)
    bn.avg_mean[...] = rs.randn(*bn.avg_mean.shape)
    bn.avg_var[...] = rs.uniform(0.5, 2.0, bn.avg_var.shape)
    if getattr(bn, 'gamma', None) is not None:
        bn.gamma.array[...] = rs.uniform(0.5, 1.5, bn.gamma.shape)
    if getattr(bn, 'beta', None) is not None:
        bn.beta.array[...] = rs.randn(*bn.beta.shape)
    return bn


_W33 = numpy.random.RandomState(5).randn(4, 3, 3, 3).astype('f') * 0.3
_COND = numpy.random.RandomState(6).rand(3, 4) > 0.5

# (id, links factory or None, fn(links, *xs), inputs(batch), dynamic batch)
CASES = [
    # connections
    ('linear', lambda: _Links(l=L.Linear(5, 4)),
     lambda m, x: m.l(x), _x(5), True),
    ('linear_3d_n_batch_axes', lambda: _Links(l=L.Linear(4, 3)),
     lambda m, x: m.l(_v(x), n_batch_axes=2), _x(5, 4), True),
    ('linear_flatten', lambda: _Links(l=L.Linear(None, 3)),
     lambda m, x: m.l(_v(x)), _x(2, 3, 3), True),
    ('conv', lambda: _Links(c=L.Convolution2D(3, 4, 3, stride=2, pad=1)),
     lambda m, x: m.c(x), _x(3, 9, 9), True),
    ('conv_cover_all', None,
     lambda m, x: F.convolution_2d(x, _W33, stride=2, cover_all=True),
     _x(3, 8, 8), True),
    ('conv_dilate_groups', lambda: _Links(c=L.Convolution2D(
        4, 6, 3, pad=2, dilate=2, groups=2)),
     lambda m, x: m.c(x), _x(4, 7, 6), True),
    ('conv_nd', lambda: _Links(c=L.ConvolutionND(3, 2, 3, 3, pad=1)),
     lambda m, x: m.c(x), _x(2, 4, 5, 3), True),
    ('deconv', lambda: _Links(d=L.Deconvolution2D(3, 2, 4, stride=2, pad=1)),
     lambda m, x: m.d(x), _x(3, 5, 5), True),
    ('deconv_outsize', lambda: _Links(d=L.Deconvolution2D(
        3, 2, 3, stride=2, pad=1, outsize=(10, 10))),
     lambda m, x: m.d(x), _x(3, 5, 5), True),
    ('deconv_groups', lambda: _Links(d=L.Deconvolution2D(
        4, 6, 3, stride=1, pad=0, groups=2, nobias=True)),
     lambda m, x: m.d(x), _x(4, 4, 4), True),
    ('deconv_nd', lambda: _Links(d=L.DeconvolutionND(3, 2, 2, 2, stride=2)),
     lambda m, x: m.d(x), _x(2, 3, 3, 3), True),
    ('embed_id', lambda: _Links(e=L.EmbedID(10, 4, ignore_label=-1)),
     lambda m, x: m.e(x),
     lambda b: (numpy.arange(b * 3).reshape(b, 3).astype(numpy.int32) % 11
                - 1,), True),
    ('matmul', None, lambda m, x, y: F.matmul(x, y, transb=True),
     _xy(3, 4), True),
    ('matmul_transa', None, lambda m, x, y: F.matmul(x, y, transa=True),
     lambda b: (_rand(b, 3, 4), _rand(b, 3, 5)), True),
    # pooling
    ('max_pool_cover_all', None, lambda m, x: F.max_pooling_2d(x, 3, 2, 1),
     _x(3, 8, 8), True),
    ('max_pool_cover_all_odd', None, lambda m, x: F.max_pooling_2d(x, 3, 2),
     _x(2, 8, 9), True),
    ('max_pool_no_cover_all', None,
     lambda m, x: F.max_pooling_2d(x, 2, 2, cover_all=False),
     _x(2, 7, 7), True),
    ('max_pool_nd', None, lambda m, x: F.max_pooling_nd(x, 2, 1, 1),
     _x(2, 3, 4, 3), True),
    ('avg_pool', None, lambda m, x: F.average_pooling_2d(x, 3, 2, 1),
     _x(3, 8, 8), True),
    ('avg_pool_nd_exclude_pad', None,
     lambda m, x: F.average_pooling_nd(x, 3, 2, 1, pad_value=None),
     _x(3, 7, 7), True),
    # normalization
    ('bn_fixed', lambda: _Links(bn=_bn_link(3)), lambda m, x: m.bn(x),
     _x(3, 4, 4), True),
    ('bn_fixed_2d', lambda: _Links(bn=_bn_link(5)), lambda m, x: m.bn(x),
     _x(5), True),
    ('bn_fixed_no_gamma', lambda: _Links(bn=_bn_link(3, use_gamma=False,
                                                     use_beta=False)),
     lambda m, x: m.bn(x), _x(3, 2, 2), True),
    ('bn_fixed_axis', lambda: _Links(bn=_bn_link(3, axis=(0, 1))),
     lambda m, x: m.bn(x), _x(4, 3), True),
    ('bn_batch_stats', None,
     lambda m, x: F.batch_normalization(x, _rand(3, low=0.5), _rand(3)),
     _x(3, 2, 2), True),
    ('lrn', None, lambda m, x: F.local_response_normalization(x, n=5),
     _x(7, 3, 3, low=0, high=3), True),
    ('lrn_even', None,
     lambda m, x: F.local_response_normalization(x, n=4, k=1, alpha=1e-2,
                                                 beta=0.5),
     _x(6, 2, 2, low=0, high=3), True),
    ('layer_norm', lambda: _Links(ln=L.LayerNormalization(6)),
     lambda m, x: m.ln(x), _x(6), True),
    ('group_norm', lambda: _Links(gn=L.GroupNormalization(2, 4)),
     lambda m, x: m.gn(x), _x(4, 3, 2), True),
    ('normalize_l2', None, lambda m, x: F.normalize(x), _x(4), True),
    # activations
    ('relu_sigmoid_tanh', None,
     lambda m, x: F.tanh(F.sigmoid(F.relu(x))), _x(4), True),
    ('leaky_relu', None, lambda m, x: F.leaky_relu(x, 0.1), _x(4), True),
    ('clipped_relu', None, lambda m, x: F.clipped_relu(x, 0.5), _x(4), True),
    ('elu', None, lambda m, x: F.elu(x, 0.7), _x(4), True),
    ('softplus', None, lambda m, x: F.softplus(x, beta=2.0) + F.softplus(x),
     _x(4), True),
    ('hard_sigmoid', None, lambda m, x: F.hard_sigmoid(_v(x) * 4), _x(4),
     True),
    ('swish', lambda: _Links(s=L.Swish((3,))), lambda m, x: m.s(x),
     _x(3, 2, 2), True),
    ('prelu', lambda: _Links(p=L.PReLU((3,), init=0.3)),
     lambda m, x: m.p(x), _x(3, 2, 2), True),
    ('crelu', None, lambda m, x: F.crelu(x), _x(3, 2), True),
    ('softmax', None, lambda m, x: F.softmax(x), _x(5), True),
    ('softmax_axis2', None, lambda m, x: F.softmax(x, axis=2), _x(2, 5), True),
    ('log_softmax', None, lambda m, x: F.log_softmax(x), _x(5), True),
    # arithmetic
    ('binary', None, lambda m, x, y: (_v(x) + y) * y - x / (F.absolute(y)
                                                           + 1),
     _xy(4), True),
    ('constants', None,
     lambda m, x: (2 - (_v(x) + 1) * 3) / 4 + 1 / (F.absolute(_v(x)) + 1),
     _x(4), True),
    ('pow', None, lambda m, x: _v(x) ** 2 + 2 ** _v(x) + F.absolute(_v(x))
     ** _v(x), _x(4), True),
    ('max_min', None, lambda m, x, y: F.maximum(x, y) - F.minimum(x, y),
     _xy(4), True),
    ('unary_math', None,
     lambda m, x: F.exp(x) + F.log(F.absolute(x) + 1) + F.sqrt(F.absolute(x))
     + F.square(x) - x + F.sin(x) * F.cos(x) + F.log2(F.absolute(x) + 1)
     + F.log10(F.absolute(x) + 1) + F.expm1(x) + F.log1p(F.absolute(x))
     + F.tan(x) + F.arctan(x) + F.erf(x),
     _x(4), True),
    ('unary_math_2', None,
     lambda m, x: -_v(x) + F.sinh(x) + F.cosh(x) + F.arcsin(_v(x) * 0.9)
     + F.arccos(_v(x) * 0.9) + F.arctanh(_v(x) * 0.9) + F.identity(x)
     + F.copy(x, -1), _x(4), True),
    ('clip', None, lambda m, x: F.clip(x, -0.5, 0.25), _x(4), True),
    ('fmod', None,
     lambda m, x: F.fmod(_v(x) * 5, F.absolute(_v(x)) + 1), _x(4), True),
    ('cast', None, lambda m, x: F.cast(_v(x) * 10, numpy.int32), _x(4), True),
    ('where', None, lambda m, x, y: F.where(_COND, x, y), _xy(3, 4), True),
    ('dropout_identity', None, lambda m, x: F.dropout(x, 0.5) * 2, _x(4),
     True),
    ('sum_multi_add', None, lambda m, x, y: F.add(x, y, x), _xy(4), True),
    # reductions
    ('sum', None, lambda m, x: F.sum(x, axis=1), _x(3, 4), True),
    ('sum_keepdims', None, lambda m, x: F.sum(x, axis=(1, 2), keepdims=True),
     _x(3, 4), True),
    ('sum_all', None, lambda m, x: F.sum(x), _x(3), True),
    ('mean_gap', None, lambda m, x: F.mean(x, axis=(2, 3)), _x(3, 4, 4),
     True),
    ('max_min_prod', None,
     lambda m, x: F.max(x, axis=1) + F.min(x, axis=-1) + F.prod(x, axis=1),
     _x(3, 3), True),
    ('logsumexp', None, lambda m, x: F.logsumexp(x, axis=1), _x(5), True),
    ('argmax', None, lambda m, x: F.argmax(x, axis=1), _x(5), True),
    ('argmin_all', None, lambda m, x: F.argmin(x), _x(5), True),
    ('cumsum', None, lambda m, x: F.cumsum(x, axis=1), _x(4), True),
    # shapes
    ('reshape_flatten', None, lambda m, x: F.reshape(x, (x.shape[0], -1)),
     _x(3, 2, 2), True),
    ('reshape_fold_batch', None,
     lambda m, x: F.reshape(F.relu(F.reshape(x, (-1, 4))), (x.shape[0], 3,
                                                            4)),
     _x(3, 4), True),
    ('transpose', None, lambda m, x: F.transpose(x, (0, 2, 1)), _x(3, 4),
     True),
    ('transpose_batch_moves', None,
     lambda m, x: F.reshape(F.transpose(x, (1, 0, 2)), (3, -1)),
     _x(3, 4), True),
    ('swap_roll_move', None,
     lambda m, x: F.rollaxis(F.moveaxis(F.swapaxes(x, 1, 2), 3, 1), 2),
     _x(3, 4, 5), True),
    ('squeeze_expand_dims', None,
     lambda m, x: F.squeeze(F.expand_dims(x, 1), axis=1) + F.squeeze(
         F.expand_dims(x, -1)), _x(3), True),
    ('concat', None, lambda m, x, y: F.concat((x, y, x), axis=1),
     _xy(2, 3), True),
    ('concat_batch_then_reshape', None,
     lambda m, x, y: F.reshape(F.concat((x, y), axis=0), (-1,)),
     _xy(3), True),
    ('stack', None, lambda m, x, y: F.stack((x, y), axis=1), _xy(3), True),
    ('stack_axis0', None, lambda m, x, y: F.stack((x, y), axis=0), _xy(3),
     True),
    ('separate', None, lambda m, x: F.separate(x, axis=1), _x(3, 2), True),
    ('split_axis', None, lambda m, x: F.split_axis(x, [1, 3], axis=1),
     _x(5), True),
    ('split_axis_sections', None, lambda m, x: F.split_axis(x, 2, axis=2),
     _x(2, 4), True),
    ('hstack', None, lambda m, x, y: F.hstack((x, y)), _xy(3), True),
    ('vstack', None, lambda m, x, y: F.vstack((x, y)), _xy(3), False),
    ('getitem_basic', None, lambda m, x: _v(x)[:, 1:3, ::2], _x(4, 5), True),
    ('getitem_int_ellipsis', None, lambda m, x: _v(x)[..., -1], _x(3, 4),
     True),
    ('getitem_newaxis', None, lambda m, x: _v(x)[:, None, 0, :], _x(3, 4),
     True),
    ('getitem_negative_step', None, lambda m, x: _v(x)[:, ::-1, -2::-2],
     _x(3, 5), True),
    ('getitem_array', None, lambda m, x: _v(x)[:, [0, 2, 2]], _x(3, 2),
     True),
    ('getitem_bool', None,
     lambda m, x: _v(x)[:, numpy.array([True, False, True])], _x(3), True),
    ('getitem_int_then_array', None, lambda m, x: _v(x)[:, 1, [0, 1]],
     _x(3, 2), True),
    ('getitem_batch_slice', None, lambda m, x: _v(x)[1:, 0], _x(3), True),
    ('broadcast_to', lambda: _Links(b=L.Bias(axis=1, shape=(3,))),
     lambda m, x: m.b(x), _x(3, 2), True),
    ('scale', lambda: _Links(s=L.Scale(axis=1, W_shape=(3,),
                                       bias_term=True)),
     lambda m, x: m.s(x), _x(3, 2, 2), True),
    ('broadcast', None,
     lambda m, x: F.prod(F.stack(F.broadcast(x, _rand(1, 4))), axis=0),
     _x(4), True),
    ('tile', None, lambda m, x: F.tile(x, (1, 2)) + F.tile(x, 1)[:, :1],
     _x(3), True),
    ('flip', None, lambda m, x: F.flip(x, 1) + F.fliplr(x) + 0 * F.flipud(x),
     _x(3), False),
    ('pad', None,
     lambda m, x: F.pad(x, ((0, 0), (1, 2), (0, 1)), 'constant',
                        constant_values=0.5), _x(2, 3), True),
    ('pad_edge', None, lambda m, x: F.pad(x, ((0, 0), (1, 1)), 'edge'),
     _x(3), True),
    ('depth2space', None, lambda m, x: F.depth2space(x, 2), _x(8, 2, 3),
     True),
    ('space2depth', None, lambda m, x: F.space2depth(x, 2), _x(2, 4, 6),
     True),
]


@pytest.mark.parametrize('case', CASES, ids=[c[0] for c in CASES])
def test_converter_matches_chainer(case, record_property):
    _ort()
    key, make_link, fn, make_args, dynamic = case
    link = make_link() if make_link is not None else None
    with warnings.catch_warnings():
        warnings.simplefilter('error')   # no 'fixed batch' reshape warnings
        export_and_compare(key, lambda *xs: fn(link, *xs), make_args,
                           link=link, dynamic=dynamic,
                           record_property=record_property)


@pytest.mark.parametrize('key', ['mean_gap', 'max_min_prod', 'logsumexp',
                                 'split_axis', 'bn_batch_stats'])
def test_converter_opset_18(key, record_property):
    # Opset 18 moved the axes of ReduceMean/Max/... to an input.
    _ort()
    key_, make_link, fn, make_args, dynamic = [c for c in CASES
                                               if c[0] == key][0]
    link = make_link() if make_link is not None else None
    model, _ = export_and_compare(key + ' opset18',
                                  lambda *xs: fn(link, *xs), make_args,
                                  link=link, dynamic=dynamic, opset=18,
                                  record_property=record_property)
    assert model.opset_import[0].version == 18


def test_reshape_mixing_batch_warns_and_keeps_recorded_shape():
    _onnx()
    # (B, 3, 4) -> (3, B, 4) by reshape: the batch cannot be followed.
    fn = lambda x: F.reshape(x, (3, 2, 4))  # NOQA
    sched, values, ref = trace(fn, (_rand(2, 3, 4),))
    with pytest.warns(UserWarning, match='batch size 2'):
        model = onnx_export.schedule_to_onnx(sched, values)
    _check(model)


def test_unsupported_getitem_use_names_op_and_source():
    _onnx()
    x = _rand(2, 3, 4)
    fn = lambda x: _v(x)[:, [0, 1], [1, 2]]  # NOQA
    sched, values, ref = trace(fn, (x,))
    with pytest.raises(UnsupportedOpError, match='GetItem.*trace.py:1'):
        onnx_export.schedule_to_onnx(sched, values)


def test_traced_conv_net_initializer_names():
    _onnx()
    link = _Links(conv=L.Convolution2D(3, 4, 3), bn=_bn_link(4),
                  fc=L.Linear(None, 2))
    fn = lambda x: link.fc(F.relu(link.bn(link.conv(x))))  # NOQA
    x = _rand(2, 3, 5, 5)
    _run_chainer(fn, (x,))      # initialise fc.W
    sched, values, ref = trace(fn, (x,), link)
    model = onnx_export.schedule_to_onnx(sched, values)
    names = sorted(i.name for i in model.graph.initializer)
    for want in ('conv.W', 'conv.b', 'bn.gamma', 'bn.beta', 'bn.avg_mean',
                 'bn.avg_var', 'fc.W', 'fc.b'):
        assert want in names


# ----------------------------------------------------------------------------
# (b) describe() on real Chainer function nodes
# ----------------------------------------------------------------------------

def _is_plain(v):
    if v is None or isinstance(v, (bool, int, float, str)):
        return True
    if isinstance(v, numpy.ndarray):
        return True
    if isinstance(v, tuple):
        return all(_is_plain(e) for e in v)
    return False


def _creator(y):
    node = y.creator
    assert node is not None
    return node


def _desc(y):
    d = describe(_creator(y))
    assert isinstance(d, dict)
    for k, v in d.items():
        assert _is_plain(v), (k, v)
    return d


def test_describe_convolution():
    x = _rand(1, 3, 8, 8)
    y = F.convolution_2d(x, _W33, stride=(2, 1), pad=1, cover_all=True)
    assert describe_mod.kind_of(y.creator) == 'Convolution2DFunction'
    assert _desc(y) == {'stride': (2, 1), 'pad': (1, 1), 'dilate': (1, 1),
                        'groups': 1, 'cover_all': True}
    W = _rand(4, 2, 3, 3)
    y = F.convolution_2d(_rand(1, 4, 8, 8), W, dilate=2, groups=2)
    assert _desc(y) == {'stride': (1, 1), 'pad': (0, 0), 'dilate': (2, 2),
                        'groups': 2, 'cover_all': False}


def test_describe_deconvolution_and_nd():
    y = F.deconvolution_2d(_rand(1, 3, 4, 4), _rand(3, 2, 3, 3), stride=2,
                           pad=1, outsize=(8, 8))
    assert _desc(y) == {'stride': (2, 2), 'pad': (1, 1), 'dilate': (1, 1),
                        'groups': 1, 'outsize': (8, 8)}
    y = F.convolution_nd(_rand(1, 2, 4, 4, 4), _rand(3, 2, 2, 2, 2), pad=1)
    assert _desc(y) == {'ndim': 3, 'stride': (1, 1, 1), 'pad': (1, 1, 1),
                        'dilate': (1, 1, 1), 'groups': 1, 'cover_all': False}


def test_describe_pooling():
    y = F.max_pooling_2d(_rand(1, 3, 8, 8), 3, stride=2, pad=1)
    assert type(y.creator).__name__ == 'MaxPoolingND'
    assert _desc(y) == {'ndim': 2, 'ksize': (3, 3), 'stride': (2, 2),
                        'pad': (1, 1), 'cover_all': True,
                        'return_indices': False}
    y = F.average_pooling_2d(_rand(1, 3, 8, 8), 2)
    assert type(y.creator).__name__ == 'AveragePooling2D'
    assert _desc(y) == {'ksize': (2, 2), 'stride': (2, 2), 'pad': (0, 0),
                        'cover_all': False, 'return_indices': False,
                        'count_include_pad': True}
    y = F.average_pooling_nd(_rand(1, 3, 8, 8), 3, 2, 1, pad_value=None)
    assert _desc(y)['count_include_pad'] is False


def test_describe_reshape_transpose_concat():
    x = _rand(2, 3, 4)
    assert _desc(F.reshape(x, (2, -1))) == {'shape': (2, -1)}
    assert _desc(F.transpose(x, (0, 2, 1))) == {'axes': (0, 2, 1)}
    assert _desc(F.transpose(x)) == {'axes': None}
    assert _desc(F.concat((x, x), axis=2)) == {'axis': 2}
    assert _desc(F.stack((x, x), axis=-1)) == {'axis': -1}
    assert _desc(F.split_axis(x, [1], axis=1)[0]) == {'axis': 1,
                                                      'indices': (1,)}
    assert _desc(F.split_axis(x, 2, axis=2)[0]) == {'axis': 2,
                                                    'sections': 2}
    assert _desc(F.broadcast_to(_rand(1, 4), (3, 4))) == {'shape': (3, 4)}
    assert _desc(F.expand_dims(x, 1)) == {'axis': 1}
    assert _desc(F.squeeze(_rand(2, 1, 3))) == {'axis': None}
    assert _desc(F.swapaxes(x, 0, 2)) == {'axis1': 0, 'axis2': 2}


def test_describe_normalizations():
    x = _rand(2, 7, 3, 3)
    d = _desc(F.local_response_normalization(x, n=3, k=1, alpha=1e-3,
                                             beta=0.5))
    assert d == {'n': 3, 'k': 1, 'alpha': 1e-3, 'beta': 0.5}
    g = numpy.ones(7, 'f')
    d = _desc(F.fixed_batch_normalization(x, g, g * 0, g * 0, g, eps=1e-3))
    assert d == {'eps': 1e-3, 'axis': (0, 2, 3), 'key_axis': (1,)}
    d = _desc(F.batch_normalization(x, g, g * 0, eps=1e-4))
    assert d['eps'] == 1e-4 and d['axis'] == (0, 2, 3)


def test_describe_activations_and_constants():
    x = _rand(2, 4)
    assert _desc(F.leaky_relu(x, 0.3)) == {'slope': 0.3}
    assert _desc(F.clipped_relu(x, 6.)) == {'z': 6.0}
    assert _desc(F.elu(x, 0.5)) == {'alpha': 0.5}
    assert _desc(F.softmax(x, axis=0)) == {'axis': 0}
    assert _desc(F.log_softmax(x)) == {'axis': 1}
    assert _desc(F.relu(x)) == {}
    d = _desc(_v(x) + 2.5)
    assert d == {'value': 2.5} and type(d['value']) is float
    d = _desc(_v(x) * numpy.float32(3))
    assert d == {'value': 3.0}
    assert _desc(2 - _v(x)) == {'value': 2.0}
    assert _desc(_v(x) ** 2) == {'value': 2.0}
    y = _v(x) + numpy.arange(4, dtype='f')     # Add with a CONST input
    assert describe_mod.kind_of(y.creator) == 'Add' and _desc(y) == {}
    assert _desc(F.clip(x, -1.0, 1.0)) == {'x_min': -1.0, 'x_max': 1.0}


def test_describe_reductions_and_dropout():
    x = _rand(2, 3, 4)
    assert _desc(F.sum(x, axis=1)) == {'axis': (1,), 'keepdims': False}
    assert _desc(F.sum(x)) == {'axis': None, 'keepdims': False}
    assert _desc(F.mean(x, axis=(1, 2), keepdims=True)) == {
        'axis': (1, 2), 'keepdims': True}
    assert describe_mod.kind_of(F.mean(x).creator) == 'Mean'
    assert _desc(F.max(x, axis=-1)) == {'axis': (-1,), 'keepdims': False}
    assert _desc(F.argmax(x, axis=2)) == {'axis': 2}
    with chainer.using_config('train', True):
        assert _desc(F.dropout(x, 0.25)) == {'ratio': 0.25}


def test_describe_getitem_slices():
    x = chainer.Variable(_rand(2, 3, 4, 5))
    d = _desc(x[:, 1:3, None, ..., -1])
    assert d == {'slices': (('slice', None, None, None),
                            ('slice', 1, 3, None), ('newaxis',),
                            ('ellipsis',), ('index', -1))}
    d = _desc(x[numpy.array([1, 0]), ::-2])
    assert d['slices'][1] == ('slice', None, None, -2)
    tag, arr = d['slices'][0]
    assert tag == 'array'
    numpy.testing.assert_array_equal(arr, [1, 0])
    d = _desc(x[numpy.int64(1)])
    assert d == {'slices': (('index', 1),)}


def test_describe_misc_array_ops():
    x = _rand(2, 3)
    assert _desc(F.cast(x, numpy.float64)) == {'dtype': 'float64'}
    assert _desc(F.tile(x, (2, 1))) == {'reps': (2, 1)}
    assert _desc(F.flip(x, 1)) == {'axis': 1}
    d = _desc(F.pad(x, ((0, 0), (1, 2)), 'constant', constant_values=3))
    assert d == {'pad_width': ((0, 0), (1, 2)), 'mode': 'constant',
                 'constant_values': 3}
    assert _desc(F.depth2space(_rand(1, 4, 2, 2), 2)) == {'r': 2}
    d = _desc(F.where(numpy.array([[True, False, True]]), x, x))
    numpy.testing.assert_array_equal(d['condition'], [[True, False, True]])
    assert _desc(F.matmul(x, x, transb=True)) == {
        'transa': False, 'transb': True, 'transc': False}
    assert _desc(F.embed_id(numpy.array([1, 2], numpy.int32), x.T,
                            ignore_label=-1)) == {'ignore_label': -1}


class _Custom(chainer.FunctionNode):
    def forward(self, inputs):
        return inputs[0] * 2,


class Reshape(chainer.FunctionNode):
    """A user FunctionNode that shares a name with Chainer's Reshape."""

    def forward(self, inputs):
        return inputs[0].copy(),


class LeakyReLU(chainer.FunctionNode):
    @property
    def slope(self):
        raise RuntimeError('boom')

    def forward(self, inputs):
        return inputs[0].copy(),


class _OldStyle(chainer.Function):
    def forward(self, inputs):
        return inputs[0] + 1,


def test_describe_unknown_and_broken_nodes_never_raise():
    x = _rand(2, 3)
    y, = _Custom().apply((x,))
    assert describe(y.creator) == {}
    y, = Reshape().apply((x,))
    assert describe(y.creator) == {}      # no 'shape' attribute: left out
    y, = LeakyReLU().apply((x,))
    assert describe(y.creator) == {}      # raising attribute: left out
    assert describe(object()) == {}
    assert describe(None) == {}


def test_describe_old_style_function():
    y = _OldStyle()(_rand(2, 3))
    assert describe_mod.kind_of(y.creator) == '_OldStyle'
    assert describe(y.creator) == {}


def test_describe_under_no_backprop_mode():
    # The core calls describe() on nodes applied under no_backprop_mode
    # (they keep no inputs/outputs): attrs must not depend on them.
    seen = []

    class Hook(chainer.FunctionHook):
        name = 'describe_test'

        def forward_postprocess(self, function, in_data):
            seen.append((describe_mod.kind_of(function),
                         describe(function)))
    x = _rand(2, 3, 8, 8)
    g = numpy.ones(3, 'f')
    with chainer.no_backprop_mode(), chainer.using_config('train', False), \
            Hook():
        h = F.convolution_2d(x, _rand(3, 3, 3, 3), pad=1)
        h = F.fixed_batch_normalization(h, g, g, g, g)
        h = F.transpose(F.max_pooling_2d(h, 2))
        F.reshape(h, (-1,))
    kinds = [k for k, _ in seen]
    assert kinds == ['Convolution2DFunction', 'FixedBatchNormalization',
                     'MaxPoolingND', 'Transpose', 'Reshape']
    attrs = dict(seen)
    assert attrs['FixedBatchNormalization']['axis'] == (0, 2, 3)
    assert attrs['Transpose'] == {'axes': None}
    assert attrs['Reshape'] == {'shape': (-1,)}


# ----------------------------------------------------------------------------
# Whole models through the tracing harness (no core needed)
# ----------------------------------------------------------------------------

def _load_models():
    name = '_onnx_test_imagenet_models'
    if name in sys.modules:
        return sys.modules[name]
    path = os.path.join(ROOT, 'examples', 'imagenet', 'models.py')
    if not os.path.exists(path):
        return None
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception:
        return None
    sys.modules[name] = module
    return module


IMAGENET_MODELS = ['ResNet50', 'GoogLeNet', 'VGG16', 'MobileNetV2']
INSIZE = 32


def _model_class(name):
    models = _load_models()
    cls = getattr(models, name, None) if models is not None else None
    if cls is None:
        pytest.skip('examples/imagenet/models.py has no %s' % name)
    return cls


def _images(b, seed=0):
    rs = numpy.random.RandomState(seed + b)
    return rs.uniform(-1, 1, (b, 3, INSIZE, INSIZE)).astype(numpy.float32)


def _randomize_bn_stats(model):
    # Non-trivial BatchNorm statistics so that the export of PERSIST buffers
    # is actually exercised.
    rs = numpy.random.RandomState(11)
    for link in model.links():
        if isinstance(link, L.BatchNormalization):
            link.avg_mean[...] = rs.uniform(-0.1, 0.1, link.avg_mean.shape)
            link.avg_var[...] = rs.uniform(0.5, 1.5, link.avg_var.shape)


@pytest.mark.parametrize('name', IMAGENET_MODELS)
def test_traced_imagenet_model(name, record_property):
    _ort()
    cls = _model_class(name)
    model = cls(n_class=10, insize=INSIZE)
    _randomize_bn_stats(model)
    fwd = _undecorated(model)
    export_and_compare('traced %s' % name, fwd, lambda b: (_images(b),),
                       link=model, record_property=record_property)


# ----------------------------------------------------------------------------
# Schedules recorded by the core (static_graph.cached), exported directly
# ----------------------------------------------------------------------------

def _core_forward_schedule(chain, x):
    cached = getattr(static_graph, 'cached', None)
    if cached is None:
        pytest.skip('core not available (static_graph.cached missing)')
    with chainer.using_config('train', False), chainer.no_backprop_mode():
        chain(x)
        chain(x)
    entries = [e for e in cached(chain) if e.forward is not None]
    if not entries or entries[-1].state != 'complete':
        pytest.skip('the core did not compile a schedule: %s'
                    % (entries[-1].reason if entries else 'no entry'))
    sched = entries[-1].forward
    values = {b: buf.storage for b, buf in sched.buffers.items()
              if buf.role in (ir.PARAM, ir.PERSIST, ir.CONST)}
    return sched, values


@pytest.mark.parametrize('key', ['MLP', 'SmallCNN', 'MobileNetV2',
                                 'GoogLeNet'])
def test_core_recorded_schedule(key, record_property):
    _ort()
    if key == 'MLP':
        chain, make_x = MLP(), lambda b: _rand(b, 12)
    elif key == 'SmallCNN':
        chain, make_x = SmallCNN(), lambda b: _rand(b, 3, 8, 8)
    else:
        chain, make_x = _model_class(key)(n_class=10, insize=INSIZE), _images
    _randomize_bn_stats(chain)
    sched, values = _core_forward_schedule(chain, make_x(RECORD_BATCH))
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        model = onnx_export.schedule_to_onnx(sched, values)
    _check(model)
    assert [i.name for i in model.graph.input] == ['x']
    sess = _session(model)
    fwd = _undecorated(chain)
    for b in (RECORD_BATCH, OTHER_BATCH):
        x = make_x(b)
        want, = _run_chainer(fwd, (x,))
        got, = sess.run(None, {'x': x})
        _compare('recorded %s b=%d' % (key, b), got, want, record_property)


# ----------------------------------------------------------------------------
# (c) Integration through the core: static_graph.export_onnx
# ----------------------------------------------------------------------------

def _export_onnx():
    fn = getattr(static_graph, 'export_onnx', None)
    if fn is None:
        pytest.skip('core not available (static_graph.export_onnx missing)')
    return fn


class MLP(chainer.Chain):
    def __init__(self):
        super(MLP, self).__init__()
        with self.init_scope():
            self.l1 = L.Linear(12, 16)
            self.l2 = L.Linear(16, 16)
            self.l3 = L.Linear(16, 5)

    @static_graph.static_graph
    def forward(self, x):
        h = F.relu(self.l1(x))
        h = F.relu(self.l2(h))
        return self.l3(h)


class SmallCNN(chainer.Chain):
    def __init__(self):
        super(SmallCNN, self).__init__()
        with self.init_scope():
            self.c1 = L.Convolution2D(3, 8, 3, pad=1)
            self.bn1 = L.BatchNormalization(8)
            self.c2 = L.Convolution2D(8, 16, 3, stride=2, pad=1)
            self.fc = L.Linear(None, 4)

    @static_graph.static_graph
    def forward(self, x):
        h = F.relu(self.bn1(self.c1(x)))
        h = F.max_pooling_2d(h, 2)
        h = F.leaky_relu(self.c2(h))
        h = F.dropout(h, 0.3)
        return F.softmax(self.fc(h))


def _integration(key, chain, make_x, tmp_path, record_property):
    onnx = _onnx()
    _ort()
    export_onnx = _export_onnx()
    path = str(tmp_path / ('%s.onnx' % key.replace(' ', '_')))
    fwd = _undecorated(chain)
    x = make_x(RECORD_BATCH)
    with chainer.using_config('train', False), chainer.no_backprop_mode():
        chain(x)       # initialise lazy links (Linear(None, ...))
    export_onnx(chain, (x,), path, method='forward', opset=13,
                dynamic_batch=True)
    assert os.path.exists(path)
    model = onnx.load(path)
    _check(model)
    sess = _session(model)
    for b in (RECORD_BATCH, OTHER_BATCH):
        x = make_x(b)
        want, = _run_chainer(fwd, (x,))
        got, = sess.run(None, _feeds(sess, (x,)))
        _compare('%s b=%d' % (key, b), got, want, record_property)


def test_integration_mlp(tmp_path, record_property):
    _integration('core MLP', MLP(),
                 lambda b: _rand(b, 12), tmp_path, record_property)


def test_integration_small_cnn(tmp_path, record_property):
    model = SmallCNN()
    _randomize_bn_stats(model)
    _integration('core SmallCNN', model,
                 lambda b: _rand(b, 3, 8, 8), tmp_path, record_property)


@pytest.mark.parametrize('name', IMAGENET_MODELS)
def test_integration_imagenet_model(name, tmp_path, record_property):
    _export_onnx()
    cls = _model_class(name)
    model = cls(n_class=10, insize=INSIZE)
    _randomize_bn_stats(model)
    _integration('core %s' % name, model, _images, tmp_path,
                 record_property)


class _WithBody(chainer.Chain):
    """A static chain with one lazily initialized Linear ``l`` whose
    forward is ``body(self, x)``."""
    def __init__(self, body):
        super(_WithBody, self).__init__()
        self.body = body
        with self.init_scope():
            self.l = L.Linear(None, 4)

    @static_graph.static_graph
    def forward(self, x):
        return self.body(self, x)


def _view_net(view):
    """Views of the input array taken with NumPy (by the method or by
    Chainer's own code) were exported as constants holding the export
    call's data (off by up to 1.07 for any other input)."""
    return _WithBody(lambda self, x: self.l(F.relu(view(x))))


_NUMPY_VIEWS = {
    'L.Linear on a 4-D array': lambda x: x,   # Chainer reshapes with NumPy
    'x[::-1]': lambda x: x[::-1],
    'x[:, ::-1] (BGR)': lambda x: x[:, ::-1],
    'x[:, 1:, ::2]': lambda x: x[:, 1:, ::2],
    'x[:, None]': lambda x: x[:, None],
    'x.reshape(len(x), -1)': lambda x: x.reshape(len(x), -1),
}


@pytest.mark.parametrize('name', sorted(_NUMPY_VIEWS))
def test_integration_numpy_view_of_the_input(name, tmp_path,
                                             record_property):
    _integration('core view %s' % name, _view_net(_NUMPY_VIEWS[name]),
                 lambda b: _rand(b, 3, 2, 4), tmp_path, record_property)


@pytest.mark.parametrize('view', [lambda x: x[0], lambda x: x[:1],
                                  lambda x: x.transpose(0, 2, 1, 3)])
def test_numpy_view_that_cannot_be_exported(view, tmp_path):
    _onnx()
    path = tmp_path / 'view.onnx'
    with pytest.raises(UnsupportedOpError, match='NumPy view of an input'):
        _export_onnx()(_view_net(view), (_rand(2, 3, 2, 4),), str(path))
    assert not path.exists()


@pytest.mark.parametrize('body', [
    lambda self, x: F.where(x.array > 0, x, x * 3),
    lambda self, x: F.get_item(x, (slice(None), numpy.argsort(x.array[0]))),
], ids=['F.where of a NumPy mask', 'F.get_item of a NumPy index'])
def test_an_attribute_computed_at_every_call_is_not_exported(body, tmp_path):
    """A condition or an index the method computes with NumPy from its
    input (an op of the schedule, replayed right) was exported as a
    constant holding the export call's values: off by 3.96 and 2.92 for
    another input. It is refused, naming the attribute."""
    _onnx()
    path = tmp_path / 'model.onnx'
    with pytest.raises(UnsupportedOpError, match='computed at every call'):
        _export_onnx()(_WithBody(body), (chainer.Variable(_rand(2, 6)),),
                       str(path))
    assert not path.exists()


@pytest.mark.parametrize('shape', [(2, 7), (2, 7, 4)])
def test_lrn_of_other_than_4d_is_refused(shape, tmp_path):
    """Chainer's LRN takes 2-D and up, ONNX's 4-D only: the export made a
    model onnxruntime could not run."""
    _onnx()
    body = lambda self, x: F.local_response_normalization(x)  # NOQA
    with pytest.raises(UnsupportedOpError, match='4-D only'):
        _export_onnx()(_WithBody(body), (_rand(*shape),),
                       str(tmp_path / 'lrn.onnx'))


def _siamese(self, x):
    h = self.l(x)
    h = F.reshape(F.concat([h, F.tanh(h)], axis=0), (2, x.shape[0], 4))
    return h[0] - h[1]


_BATCH_SHAPED = {
    # Recorded at batch 2, the fixed 2 was taken for the batch size: at
    # other sizes the exported model gave another shape (silently).
    'reshape to (2, B, C)': _siamese,
    'reshape to (2, -1)': lambda self, x: F.reshape(self.l(x), (2, -1)),
    'split of the batch axis': lambda self, x: F.split_axis(
        self.l(x), 2, axis=0)[0],
}


@pytest.mark.parametrize('name', sorted(_BATCH_SHAPED))
def test_result_not_following_the_batch_size_raises(name, tmp_path):
    """With dynamic_batch, the method is recorded at twice the batch size
    too; a result whose shape the exported graph would not follow raises
    instead of writing a model wrong (or failing) at other sizes."""
    _onnx()
    model = _WithBody(_BATCH_SHAPED[name])
    path = tmp_path / 'm.onnx'
    with pytest.raises(UnsupportedOpError, match='dynamic_batch=False'):
        _export_onnx()(model, (_rand(2, 3),), str(path))
    assert not path.exists()
    _export_onnx()(model, (_rand(2, 3),), str(path), dynamic_batch=False)
    assert path.exists()


def test_integration_leading_axes_merged_by_numpy(tmp_path, record_property):
    """L.Linear(n_batch_axes=2) reshapes (B, 3, 4) to (3B, 4) with NumPy."""
    model = _WithBody(lambda self, x: self.l(x, n_batch_axes=2))
    _integration('core n_batch_axes=2', model, lambda b: _rand(b, 3, 4),
                 tmp_path, record_property)


def _pieces(self, x):
    h = F.relu(x)
    a, b, c = F.split_axis(h, [4, 2], axis=1)   # overlapping, one empty
    return F.concat([a, b, c, h[:, -10::-1], h[:, ::-2]], axis=1)


def test_integration_numpy_slicing_bounds(tmp_path, record_property):
    """Split indices out of order ([4, 2]: pieces of 4, 0 and 4 of 6, as
    NumPy gives) were exported as an invalid Split; a negative start
    before the axis with a negative step (x[:, -10::-1], empty) as one
    element."""
    _integration('core slicing bounds', _WithBody(_pieces),
                 lambda b: _rand(b, 6), tmp_path, record_property)


def test_integration_unsupported_op_leaves_no_file(tmp_path):
    _onnx()
    export_onnx = _export_onnx()

    class WithUnsupported(chainer.Chain):
        @static_graph.static_graph
        def forward(self, x):
            return _Custom().apply((F.relu(x),))[0]

    path = tmp_path / 'bad.onnx'
    with pytest.raises(UnsupportedOpError, match='_Custom'):
        export_onnx(WithUnsupported(), (_rand(2, 1, 2, 2),), str(path))
    assert not path.exists()
    assert os.listdir(str(tmp_path)) == []


@pytest.mark.parametrize('body, match', [
    (lambda m, x: m.l(x) + m.l(numpy.zeros((len(x), 3), 'f')),
     'makes an array of shape'),
    (lambda m, x: F.get_item(m.l(x), slice(-10, None, -1)),
     'backwards from a negative start'),
    (lambda m, x: F.get_item(m.l(x)[:, :, None], (slice(None), [1, 0],
                                                  None, 0)),
     'non-adjacent'),
], ids=['constant sized by the batch', 'batch slice from a negative start',
        'index array and int apart'])
def test_export_refuses_what_onnx_would_compute_otherwise(body, match,
                                                          tmp_path):
    """Each was exported as a graph that computes something else: a
    constant kept its recorded batch size (two rows at batch 1), a
    backwards slice from before the batch took row 0, NumPy's placement of
    index dimensions apart was not followed."""
    _ort()
    export_onnx = _export_onnx()
    m = _WithBody(body)
    x = _rand(2, 3)
    with chainer.using_config('train', False), chainer.no_backprop_mode():
        m(x)
    with pytest.raises(ValueError, match=match):
        export_onnx(m, (x,), str(tmp_path / 'm.onnx'))


def test_export_of_one_example_array_for_two_inputs(tmp_path):
    """export_onnx(m, (x, x), ...): the schedule had one input for both and
    the graph read its second input for both (x - 2y came out y - 2y)."""
    _ort()
    export_onnx = _export_onnx()

    class Two(chainer.Chain):
        @static_graph.static_graph
        def forward(self, x, y):
            return F.identity(x) - 2 * F.identity(y)

    m = Two()
    ex = _rand(2, 4)
    model = export_onnx(m, (ex, ex), str(tmp_path / 'two.onnx'))
    assert [i.name for i in model.graph.input] == ['x', 'y']
    p, q = _rand(2, 4, seed=1), _rand(2, 4, seed=2)
    got, = _session(model).run(None, {'x': p, 'y': q})
    numpy.testing.assert_allclose(got, p - 2 * q, rtol=1e-6)


def test_dropout_applied_at_inference_exports_as_dropout(tmp_path):
    """Monte-Carlo dropout (train=True inside the method) was exported as
    the identity: no mask, no scaling."""
    _ort()
    export_onnx = _export_onnx()

    class MC(chainer.Chain):
        @static_graph.static_graph
        def forward(self, x):
            with chainer.using_config('train', True):
                return F.dropout(x, 0.5)

    x = numpy.ones((4, 50), 'f')
    model = export_onnx(MC(), (x,), str(tmp_path / 'mc.onnx'))
    assert 'Dropout' in [n.op_type for n in model.graph.node]
    got, = _session(model).run(None, {'x': x})
    assert set(numpy.unique(got)) == {0.0, 2.0}


# ----------------------------------------------------------------------------

def test_zz_report_max_abs_diffs(record_property):
    """Print the max abs differences seen (run with -s to see them)."""
    if not DIFFS:
        pytest.skip('no ONNX comparisons ran')
    width = max(len(k) for k in DIFFS)
    lines = ['%-*s  %.3g' % (width, k, v) for k, v in sorted(DIFFS.items())]
    print('\nONNX Runtime vs Chainer, max abs diff:\n' + '\n'.join(lines))
    record_property('onnx_max_abs_diffs', dict(DIFFS))


@pytest.mark.parametrize('fn', [F.fix, F.floor, F.sign],
                         ids=['fix', 'floor', 'sign'])
def test_a_numpy_result_returned_is_not_exported(fn, tmp_path):
    """``return F.fix(x)``: Chainer computes it with NumPy, a call of the
    schedule, and the output is a view of its result in planned memory.
    The exporter took that view for a constant: ``F.fix`` exported as the
    export call's values (9.0 off for another input), ``F.floor`` raised
    an internal error. It is the NumPy call's refusal now."""
    _onnx()
    path = tmp_path / 'model.onnx'
    with pytest.raises(UnsupportedOpError, match='NumpyCall'):
        _export_onnx()(_WithBody(lambda self, x: fn(x * 3)),
                       (_rand(2, 3),), str(path))
    assert not path.exists()


class _KeepsState(chainer.Chain):
    def __init__(self):
        super(_KeepsState, self).__init__()
        with self.init_scope():
            self.l1 = L.Linear(4, 3)

    @static_graph.static_graph
    def forward(self, x):
        self.h = F.relu(self.l1(x))      # kept for later inspection
        return F.softmax(self.h)


def test_a_method_that_keeps_state_is_exported(tmp_path, record_property):
    """A method that keeps a Variable on the chain (``self.h = ...``): its
    keys hold whether that slot holds one, which the export's lookup did
    not, and export_onnx said nothing was recorded."""
    m = _KeepsState()
    x = _rand(2, 4)
    with chainer.using_config('train', False), chainer.no_backprop_mode():
        for _ in range(3):
            m(x)
    _integration('keeps state', m, lambda b: _rand(b, 4), tmp_path,
                 record_property)


class EmbedText(chainer.Chain):
    """Ids -> EmbedID (ignore_label outside the table) -> Linear over the
    flattened embeddings: a text model's first layers."""

    def __init__(self):
        super(EmbedText, self).__init__()
        with self.init_scope():
            self.e = L.EmbedID(10, 4, ignore_label=-100)
            self.l = L.Linear(20, 3)

    @static_graph.static_graph
    def forward(self, t):
        return self.l(self.e(t))


def test_integration_embed_then_linear(tmp_path, record_property):
    """The EmbedID's result keeps its ids' batch axis (it was refused under
    dynamic_batch: a fixed size taken for the batch size), and an id
    equal to an ignore_label outside the table looks up no row (the
    runtime failed: index out of bounds); onnx hunt."""
    def ids(b):
        t = numpy.random.RandomState(b).randint(0, 10, (b, 5))
        t[0, 1] = -100
        return t.astype(numpy.int32)

    _integration('core EmbedText', EmbedText(), ids, tmp_path,
                 record_property)


def test_mixed_float_types_are_refused(tmp_path):
    """A float32 input into a Linear of float64 weights: Chainer computes
    it, ONNX's Gemm takes one type; the export refuses with the reason
    where it wrote a model that was not valid (onnx hunt)."""
    export_onnx = _export_onnx()
    chain = MLP()
    chain.l2.W.array = chain.l2.W.array.astype(numpy.float64)
    x = _rand(RECORD_BATCH, 12)
    path = str(tmp_path / 'mixed.onnx')
    with pytest.raises(onnx_export.UnsupportedOpError,
                       match='mix float32 and float64'):
        export_onnx(chain, (x,), path, method='forward', opset=13)
    assert not os.path.exists(path)


class MaskedSin(chainer.Chain):
    def __init__(self):
        super(MaskedSin, self).__init__()
        self.mask = numpy.array([True, False, True, False, True])

    @static_graph.static_graph
    def forward(self, x):
        x = chainer.as_variable(x)
        return F.where(F.broadcast_to(self.mask, x.shape).array, x,
                       F.sin(x))


def test_integration_where_of_a_mask_broadcast_to_the_batch(
        tmp_path, record_property):
    """F.where's constant condition broadcast to ``x.shape`` was exported
    at the recorded batch size, and the runtime failed at any other (onnx
    hunt): one row of it now broadcasts."""
    _integration('core MaskedSin', MaskedSin(), lambda b: _rand(b, 5),
                 tmp_path, record_property)


class Doubled(chainer.Chain):
    @static_graph.static_graph
    def forward(self, x):
        x = chainer.as_variable(x)
        return F.vstack((x, x[1:]))


def test_an_output_that_changes_with_the_batch_is_not_declared_fixed(
        tmp_path, record_property):
    """``F.vstack((x, x[1:]))`` (2B - 1 rows): the output was declared with
    the recorded rows, and the runtime warned of a shape mismatch at any
    other batch size (onnx hunt); that axis is left unnamed."""
    _integration('core Doubled', Doubled(), lambda b: _rand(b, 3), tmp_path,
                 record_property)
    model = _onnx().load(str(tmp_path / 'core_Doubled.onnx'))
    dim = model.graph.output[0].type.tensor_type.shape.dim[0]
    assert not dim.HasField('dim_value')


class Mixed16BN(chainer.Chain):
    def __init__(self):
        super(Mixed16BN, self).__init__()
        with chainer.using_config('dtype', chainer.mixed16), \
                self.init_scope():
            self.c = L.Convolution2D(3, 4, 3, pad=1)
            self.bn = L.BatchNormalization(4)

    @static_graph.static_graph
    def forward(self, x):
        return F.relu(self.bn(self.c(x)))


def test_a_mixed16_batch_normalization_exports_from_opset_15(tmp_path):
    """float16 activations into BatchNormalization's float32 parameters:
    ONNX's BatchNormalization takes them from opset 15 (review28: the
    check of mixed floating types refused it); at opset 13 it is refused,
    where the model written would not be valid."""
    onnx = _onnx()
    _ort()
    export_onnx = _export_onnx()
    chain = Mixed16BN()
    x = _rand(2, 3, 5, 5).astype(numpy.float16)
    with chainer.using_config('train', False):
        chain(x)
        with pytest.raises(onnx_export.UnsupportedOpError, match='mix'):
            export_onnx(chain, (x,), str(tmp_path / 'm13.onnx'), opset=13)
        path = str(tmp_path / 'm17.onnx')
        export_onnx(chain, (x,), path, opset=17)
    _check(onnx.load(path))
    sess = _session(onnx.load(path))
    got, = sess.run(None, _feeds(sess, (x,)))
    with chainer.using_config('train', False):
        want = _undecorated(chain)(x).array
    numpy.testing.assert_allclose(got.astype(numpy.float32),
                                  want.astype(numpy.float32), rtol=2e-3,
                                  atol=2e-3)
