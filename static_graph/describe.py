"""Static attributes of a Chainer function node, as plain data.

``describe(node)`` is called once per recorded op, right after the node's
forward ran, and its result becomes ``Op.attrs``. Exporters (ONNX, printing)
read these attributes instead of the FunctionNode object, so everything here
is a plain Python value: ints, floats, bools, strings, None, tuples of those,
or small numpy arrays (copied, on the CPU).

Shapes of the node's inputs are not available in general (under
``no_backprop_mode`` a FunctionNode keeps no references to its inputs), so
attributes that depend on them (a transposition's default axes, ...) are left
as given (None, negative axes) and resolved by the consumer from the buffers.

``describe`` never raises: an attribute that cannot be read is left out, and a
kind it does not know gives ``{}``.
"""
import numbers

import numpy


def describe(node):
    """Return a dict of the static attributes of ``node`` (a FunctionNode).

    For an old-style ``chainer.Function`` (wrapped in a ``FunctionAdapter``)
    the wrapped Function is described, under its own class name.
    """
    out = {}
    try:
        target = _unwrap(node)
        fn = _DESCRIBERS.get(type(target).__name__)
        if fn is None:
            return out
        fn(target, out)
    except Exception:  # never let an exporter helper break a recording
        pass
    return out


def kind_of(node):
    """The op kind for ``node``: its class name (wrapped Function's class)."""
    try:
        return type(_unwrap(node)).__name__
    except Exception:
        return type(node).__name__


def _unwrap(node):
    # chainer.function.FunctionAdapter wraps an old-style Function.
    if type(node).__name__ == 'FunctionAdapter':
        f = getattr(node, '_function', None)
        if f is None:
            f = getattr(node, 'function', None)
        if f is not None:
            return f
    return node


# -- plain values -------------------------------------------------------------

def _plain(v):
    """Convert ``v`` to plain Python / numpy data (raises if it cannot)."""
    if v is None or isinstance(v, (bool, str)):
        return v
    if isinstance(v, numpy.bool_):
        return bool(v)
    if isinstance(v, numbers.Integral):
        return int(v)
    if isinstance(v, numbers.Real):
        return float(v)
    if isinstance(v, numpy.dtype):
        return v.name
    if isinstance(v, type) and issubclass(v, numpy.generic):
        return numpy.dtype(v).name
    if isinstance(v, (tuple, list)):
        return tuple(_plain(e) for e in v)
    if isinstance(v, slice):
        return ('slice', _plain(v.start), _plain(v.stop), _plain(v.step))
    if isinstance(v, numpy.ndarray):
        return numpy.array(v, copy=True)
    return _to_numpy(v)


def _to_numpy(a, copy=True):
    """A device array (cupy, chainerx, ideep) copied to a numpy array; a
    numpy array copied too, or (``copy=False``) itself: the ONNX exporter
    tells an index or a condition computed at every call by its memory
    (onnx_export.graph.constant_attr)."""
    if isinstance(a, numpy.ndarray):
        return numpy.array(a, copy=True) if copy else a
    get = getattr(a, 'get', None)          # cupy
    if callable(get):
        return numpy.asarray(get())
    import chainer                          # chainerx, ideep, ...
    return numpy.array(chainer.backend.CpuDevice().send(a), copy=True)


def _set(out, key, fn):
    """``out[key] = fn()`` unless reading it fails."""
    try:
        out[key] = fn()
    except Exception:
        pass


def _attr(out, key, node, name, conv=_plain):
    if hasattr(node, name):
        _set(out, key, lambda: conv(getattr(node, name)))


def _pair(a, b):
    return (int(a), int(b))


def _tuple_or_none(v):
    if v is None:
        return None
    if isinstance(v, numbers.Integral):
        return (int(v),)
    return tuple(int(e) for e in v)


# -- serialised indexing (GetItem) --------------------------------------------

def encode_slices(slices):
    """Encode a NumPy index expression as a tuple of plain tuples.

    Each element is one of ``('slice', start, stop, step)``, ``('index', i)``,
    ``('newaxis',)``, ``('ellipsis',)`` or ``('array', ndarray)`` (integer or
    boolean index array).
    """
    if not isinstance(slices, tuple):
        slices = (slices,)
    out = []
    for s in slices:
        if s is None:
            out.append(('newaxis',))
        elif s is Ellipsis:
            out.append(('ellipsis',))
        elif isinstance(s, slice):
            out.append(('slice', _opt_int(s.start), _opt_int(s.stop),
                        _opt_int(s.step)))
        elif isinstance(s, (bool, numpy.bool_)):
            out.append(('array', numpy.array(bool(s))))
        elif isinstance(s, numbers.Integral):
            out.append(('index', int(s)))
        elif isinstance(s, list):
            out.append(('array', numpy.asarray(s)))
        else:
            a = _to_numpy(s, False)
            if a.ndim == 0 and a.dtype.kind in 'iu':
                out.append(('index', int(a)))
            else:
                out.append(('array', a))
    return tuple(out)


def _opt_int(v):
    if v is None:
        return None
    return int(v)


# -- describers, one per kind -------------------------------------------------

def _conv2d(n, out):
    _set(out, 'stride', lambda: _pair(n.sy, n.sx))
    _set(out, 'pad', lambda: _pair(n.ph, n.pw))
    _set(out, 'dilate', lambda: _pair(n.dy, n.dx))
    _attr(out, 'groups', n, 'groups')
    _attr(out, 'cover_all', n, 'cover_all')


def _convnd(n, out):
    _attr(out, 'ndim', n, 'ndim')
    _attr(out, 'stride', n, 'stride')
    _attr(out, 'pad', n, 'pad')
    _attr(out, 'dilate', n, 'dilate')
    _attr(out, 'groups', n, 'groups')
    _attr(out, 'cover_all', n, 'cover_all')


def _deconv2d(n, out):
    _set(out, 'stride', lambda: _pair(n.sy, n.sx))
    _set(out, 'pad', lambda: _pair(n.ph, n.pw))
    _set(out, 'dilate', lambda: _pair(n.dy, n.dx))
    _attr(out, 'groups', n, 'groups')
    _set(out, 'outsize', lambda: (
        None if n.outh is None else _pair(n.outh, n.outw)))


def _deconvnd(n, out):
    _attr(out, 'ndim', n, 'ndim')
    _attr(out, 'stride', n, 'stride')
    _attr(out, 'pad', n, 'pad')
    _attr(out, 'dilate', n, 'dilate')
    _attr(out, 'groups', n, 'groups')
    _set(out, 'outsize', lambda: _tuple_or_none(n.outs))


def _pool2d(n, out):
    _set(out, 'ksize', lambda: _pair(n.kh, n.kw))
    _set(out, 'stride', lambda: _pair(n.sy, n.sx))
    _set(out, 'pad', lambda: _pair(n.ph, n.pw))
    _attr(out, 'cover_all', n, 'cover_all')
    _attr(out, 'return_indices', n, 'return_indices')


def _avgpool2d(n, out):
    _pool2d(n, out)
    # chainer pads with zeros and always divides by the window size
    out['count_include_pad'] = True


def _poolnd(n, out):
    _attr(out, 'ndim', n, 'ndim')
    _attr(out, 'ksize', n, 'ksize')
    _attr(out, 'stride', n, 'stride')
    _attr(out, 'pad', n, 'pad')
    _attr(out, 'cover_all', n, 'cover_all')
    _attr(out, 'return_indices', n, 'return_indices')


def _avgpoolnd(n, out):
    _poolnd(n, out)
    out.pop('return_indices', None)
    _set(out, 'count_include_pad', lambda: n.pad_value is not None)


def _unpool2d(n, out):
    _pool2d(n, out)
    _set(out, 'outsize', lambda: (
        None if n.outh is None else _pair(n.outh, n.outw)))


def _bn(n, out):
    _attr(out, 'eps', n, 'eps')
    _set(out, 'axis', lambda: _tuple_or_none(n.axis))
    if hasattr(n, 'key_axis'):
        _set(out, 'key_axis', lambda: _tuple_or_none(n.key_axis))
    _attr(out, 'decay', n, 'decay')


def _fixed_bn(n, out):
    _attr(out, 'eps', n, 'eps')
    _set(out, 'axis', lambda: _tuple_or_none(n.axis))
    if hasattr(n, 'key_axis'):
        _set(out, 'key_axis', lambda: _tuple_or_none(n.key_axis))


def _lrn(n, out):
    _attr(out, 'n', n, 'n')
    _attr(out, 'k', n, 'k')
    _attr(out, 'alpha', n, 'alpha')
    _attr(out, 'beta', n, 'beta')


def _axis_keepdims(n, out):
    _set(out, 'axis', lambda: _tuple_or_none(n.axis))
    _set(out, 'keepdims', lambda: bool(getattr(n, 'keepdims', False)))


def _attrs(**names):
    """A describer copying node attributes: ``key=attribute_name``."""
    def fn(n, out):
        for key, name in names.items():
            _attr(out, key, n, name)
    return fn


def _getitem(n, out):
    _set(out, 'slices', lambda: encode_slices(n.slices))


def _split_axis(n, out):
    _attr(out, 'axis', n, 'axis')
    if getattr(n, 'indices', None) is not None:
        _set(out, 'indices', lambda: tuple(int(i) for i in n.indices))
    if getattr(n, 'sections', None) is not None:
        _set(out, 'sections', lambda: int(n.sections))


def _transpose(n, out):
    _set(out, 'axes', lambda: _tuple_or_none(n.axes))


def _reshape(n, out):
    _set(out, 'shape', lambda: tuple(int(s) for s in n.shape))


def _broadcast_to(n, out):
    _set(out, 'shape', lambda: tuple(int(s) for s in n._shape))


def _cast(n, out):
    _set(out, 'dtype', lambda: numpy.dtype(n.type).name)


def _pad(n, out):
    _set(out, 'pad_width', lambda: _plain(numpy.asarray(n.pad_width).astype(
        numpy.int64).tolist()))
    _attr(out, 'mode', n, 'mode')
    _set(out, 'constant_values',
         lambda: _plain(n.keywords.get('constant_values', 0)))


def _dropout(n, out):
    _attr(out, 'ratio', n, 'dropout_ratio')


def _constant(n, out):
    _attr(out, 'value', n, 'value')


def _clip(n, out):
    _attr(out, 'x_min', n, 'x_min')
    _attr(out, 'x_max', n, 'x_max')


def _where(n, out):
    _set(out, 'condition', lambda: _to_numpy(n.condition, False).astype(
        bool, copy=False))


def _numpy_call(n, out):
    # (the call's Python constants, as the printout shows them)
    _attr(out, 'call', n, 'name')
    if n.draws:
        _set(out, 'draws', lambda: True)
    _set(out, 'args', lambda: tuple(
        '%' if a is None else repr(a) for a in n.args))
    if n.kwargs:
        _set(out, 'kwargs', lambda: tuple(
            '%s=%s' % (k, '%' if v is None else repr(v))
            for k, v in sorted(n.kwargs.items())))


def _resize(n, out):
    _set(out, 'output_shape', lambda: _pair(n.out_H, n.out_W))
    _attr(out, 'mode', n, 'mode')
    _attr(out, 'align_corners', n, 'align_corners')


_DESCRIBERS = {
    # connection
    'Convolution2DFunction': _conv2d,
    'ConvolutionND': _convnd,
    'Deconvolution2DFunction': _deconv2d,
    'DeconvolutionND': _deconvnd,
    'EmbedIDFunction': _attrs(ignore_label='ignore_label'),
    # pooling
    'MaxPooling2D': _pool2d,
    'AveragePooling2D': _avgpool2d,
    'MaxPoolingND': _poolnd,
    'AveragePoolingND': _avgpoolnd,
    'Unpooling2D': _unpool2d,
    # normalization
    'BatchNormalization': _bn,
    'FixedBatchNormalization': _fixed_bn,
    'LocalResponseNormalization': _lrn,
    'LayerNormalization': _attrs(eps='eps'),
    'NormalizeL2': _attrs(eps='eps', axis='axis'),
    'GroupNormalization': _attrs(groups='groups', eps='eps'),
    # activations
    'LeakyReLU': _attrs(slope='slope'),
    'ClippedReLU': _attrs(z='cap'),
    'ELU': _attrs(alpha='alpha'),
    'Softplus': _attrs(beta='beta'),
    'Softmax': _attrs(axis='axis'),
    'LogSoftmax': _attrs(axis='axis'),
    'CReLU': _attrs(axis='axis'),
    # noise
    'Dropout': _dropout,
    # arithmetic with a constant
    'AddConstant': _constant,
    'SubFromConstant': _constant,
    'MulConstant': _constant,
    'DivFromConstant': _constant,
    'PowVarConst': _constant,
    'PowConstVar': _constant,
    'Clip': _clip,
    'MatMul': _attrs(transa='transa', transb='transb', transc='transc'),
    'BatchMatMul': _attrs(transa='transa', transb='transb'),
    # reductions
    'Sum': _axis_keepdims,
    'Mean': _axis_keepdims,
    'Average': _axis_keepdims,
    'Max': _axis_keepdims,
    'Min': _axis_keepdims,
    'Prod': _axis_keepdims,
    'LogSumExp': _axis_keepdims,
    'ArgMax': _attrs(axis='axis'),
    'ArgMin': _attrs(axis='axis'),
    'Cumsum': _attrs(axis='axis'),
    'SumTo': _attrs(shape='_shape'),
    # arrays
    'Reshape': _reshape,
    'Transpose': _transpose,
    'Concat': _attrs(axis='axis'),
    'Stack': _attrs(axis='axis'),
    'Separate': _attrs(axis='axis'),
    'SplitAxis': _split_axis,
    'GetItem': _getitem,
    'BroadcastTo': _broadcast_to,
    'Squeeze': _attrs(axis='axis'),
    'ExpandDims': _attrs(axis='axis'),
    'Swapaxes': _attrs(axis1='axis1', axis2='axis2'),
    'Rollaxis': _attrs(axis='axis', start='start'),
    'Moveaxis': _attrs(source='source', destination='destination'),
    'Flip': _attrs(axis='axis'),
    'Tile': _attrs(reps='reps'),
    'Repeat': _attrs(repeats='repeats', axis='axis'),
    'Pad': _pad,
    'Cast': _cast,
    'Where': _where,
    'Depth2Space': _attrs(r='r'),
    'Space2Depth': _attrs(r='r'),
    'ResizeImages': _resize,
    # NumPy calls of a recorded forward (numpy_calls.py)
    'NumpyCall': _numpy_call,
}


def described_kinds():
    """The op kinds ``describe`` knows attributes for."""
    return sorted(_DESCRIBERS)
