"""Random Chainer chains and call patterns for differential fuzzing.

An *example* is a ``Program`` (the Python source of a ``chainer.Chain``:
links built in ``__init__`` with explicit sizes, a ``forward`` made of random
layers ending in a loss) and a list of ``Step`` (how one training/eval step
calls the chain: train/eval, batch size, micro-batches, labels positional or
keyword, two calls per step, parameter replacement, inputs as arrays or
Variables).

``check_example`` builds the define-by-run chain and its static twin (the same
class body, the static one with ``forward = static_graph(body)``), gives both
the same parameters, seeds NumPy before every twin's step so dropout masks
agree, and compares after every step: every output, every input and
parameter gradient, the parameters after a MomentumSGD update and every
persistent value (BatchNorm ``avg_mean``/``avg_var``). Fallbacks to
define-by-run are allowed (the numbers must still agree); they are counted in
``STATS``.

The source of a failing example is its ``repr``, so hypothesis' minimal
failing example is a program one can paste and run.
"""
import collections
import itertools
import warnings

import numpy
from hypothesis import strategies as st

import chainer
import chainer.functions as F
import chainer.links as L
from chainer.utils import conv as conv_utils

from static_graph import StaticGraphWarning
from static_graph import diagnostics
from static_graph import static_graph
from static_graph.decorator import caches_of

DTYPES = ('float32', 'float64', 'float16')
# (rtol, atol) per dtype.
TOLERANCES = {
    'float64': (1e-10, 1e-12),
    'float32': (1e-5, 1e-6),
    'float16': (1e-2, 1e-2),
}
MAX_ELEMS = 80      # elements of one sample (non-batch part) at any layer
MAX_DIM = 8         # largest size of one axis
BATCH_SIZES = (2, 3, 4)
# Ops that hit the bugs reported with this file: wrong gradients from masks
# computed outside FunctionNodes (elu, selu, clip, max/min, maximum), a
# crash restoring a read-only static view (minimum of a broadcast
# parameter), outputs and attributes that are views of static buffers
# overwritten by later calls (return_h: returning the last hidden value;
# attr: ``self.kept = h``). ``benchmarks/fuzz.py --exclude-known`` leaves
# them out to look for other bugs.
KNOWN_BAD_OPS = ('elu', 'selu', 'clip', 'extreme', 'minmax_param',
                 'return_h', 'attr')


class Stats(object):
    """Totals over the examples checked in this process."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.examples = 0
        self.steps = 0
        self.calls = 0
        self.fallback_examples = 0
        self.fallback_reasons = collections.Counter()
        self.recordings = 0
        self.replays = 0
        self.fallback_calls = 0
        self.bit_exact_examples = 0
        self.dtypes = collections.Counter()
        self.ops = collections.Counter()

    def summary(self):
        lines = [
            'examples run: %d (steps %d, chain calls per twin %d)'
            % (self.examples, self.steps, self.calls),
            'examples with a fallback: %d' % self.fallback_examples,
            'static twin: %d recordings, %d replays, %d define-by-run calls '
            'after a fallback' % (self.recordings, self.replays,
                                  self.fallback_calls),
            'examples bit for bit equal to define-by-run: %d'
            % self.bit_exact_examples,
            'dtypes: %s' % dict(self.dtypes),
            'ops: %s' % dict(sorted(self.ops.items())),
        ]
        for reason, n in self.fallback_reasons.most_common():
            lines.append('  fallback x%d: %s' % (n, reason))
        return '\n'.join(lines)


STATS = Stats()


# -- programs -----------------------------------------------------------------
# Results that hold Variables beyond tuples, lists and dicts: a namedtuple,
# an object with attributes (as a distribution or a dataclass is).
Pair = collections.namedtuple('Pair', 'loss out')


class Holder(object):
    def __init__(self, loss, out):
        self.loss = loss
        self.extras = {'out': out, 'n': 2}


class Program(object):
    """The source of a chain class and what its forward expects."""

    def __init__(self, dtype, in_shape, head, n_classes, init_lines,
                 body_lines, ret, ops, param_count, ignore_labels=False):
        self.dtype = dtype
        self.ignore_labels = ignore_labels   # some labels -1 each batch
        self.in_shape = tuple(in_shape)   # one sample's shape
        self.head = head                  # 'ce' | 'sq'
        self.n_classes = n_classes
        self.ops = ops
        self.param_count = param_count
        self.backward_again = False   # every backward run twice
        sig = 'self, x, t' if head == 'ce' else 'self, x, t=None'
        lines = ['class Net(chainer.Chain):',
                 '    def __init__(self):',
                 '        super(Net, self).__init__()',
                 '        with self.init_scope():']
        lines += ['            ' + ln for ln in init_lines] or \
            ['            pass']
        lines += ['', '    def forward(%s):' % sig, '        h = x']
        lines += ['        ' + ln for ln in body_lines]
        lines += ['        return ' + ret]
        self.source = '\n'.join(lines) + '\n'

    def __repr__(self):
        return 'Program(dtype=%s, in_shape=%r, head=%s%s)\n%s' % (
            self.dtype, self.in_shape, self.head,
            ', every backward twice' if self.backward_again else '',
            self.source)

    def classes(self):
        """(define-by-run class, static class), fresh for every call."""
        ns = {'chainer': chainer, 'F': F, 'L': L, 'numpy': numpy,
              'DTYPE': numpy.dtype(self.dtype), 'Pair': Pair,
              'Holder': Holder}
        code = compile(self.source, '<fuzz program>', 'exec')
        exec(code, ns)
        net = ns['Net']
        static_net = type('StaticNet', (net,),
                          {'forward': static_graph(net.forward)})
        return net, static_net


def _prod(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def _bcol(ax):
    """Index prefix that keeps the batch axis and the axes before ``ax``."""
    return ', '.join([':'] * (ax + 1))


class _Builder(object):
    def __init__(self, draw, dtype, shape, exclude=()):
        self.draw = draw
        self.exclude = frozenset(exclude)
        self.dtype = dtype
        self.shape = tuple(shape)
        self.init = []
        self.body = []
        self.n = 0
        self.ops = []
        self.params = 0
        self.keeps_attr = False
        self.ignore_labels = False

    def name(self, prefix):
        self.n += 1
        return '%s%d' % (prefix, self.n)

    def ok(self, shape):
        return (0 < _prod(shape) <= MAX_ELEMS and
                all(1 <= d <= MAX_DIM * 2 for d in shape))

    def param(self, shape, low, high):
        n = self.name('p')
        self.init.append(
            'self.%s = chainer.Parameter(numpy.asarray('
            'numpy.random.uniform(%r, %r, %r), dtype=DTYPE))'
            % (n, low, high, tuple(shape)))
        self.params += 1
        return n


def _axes(shape, min_size=1):
    return [i for i, d in enumerate(shape) if d >= min_size]


def _op_linear(b):
    out = b.draw(st.integers(2, 6))
    nobias = b.draw(st.booleans())
    n = b.name('lin')
    b.init.append('self.%s = L.Linear(%d, %d%s)' % (
        n, _prod(b.shape), out, ', nobias=True' if nobias else ''))
    b.body.append('h = self.%s(h)' % n)
    b.shape = (out,)
    b.params += 1


def _op_conv(b):
    c, hh, ww = b.shape
    ksize = b.draw(st.integers(1, 3))
    stride = b.draw(st.integers(1, 2))
    pad = b.draw(st.integers(0, 1))
    cout = b.draw(st.integers(1, 4))
    groups = 1
    if c > 1 and b.draw(st.booleans()):
        # Grouped, depthwise when groups == c.
        groups = b.draw(st.sampled_from(
            [g for g in range(2, c + 1) if c % g == 0]))
        cout = groups * b.draw(st.integers(1, 2))
    oh = conv_utils.get_conv_outsize(hh, ksize, stride, pad)
    ow = conv_utils.get_conv_outsize(ww, ksize, stride, pad)
    if oh < 1 or ow < 1 or not b.ok((cout, oh, ow)):
        return _op_act(b)
    n = b.name('conv')
    b.init.append('self.%s = L.Convolution2D(%d, %d, %d, stride=%d, pad=%d%s)'
                  % (n, c, cout, ksize, stride, pad,
                     ', groups=%d' % groups if groups > 1 else ''))
    b.body.append('h = self.%s(h)' % n)
    b.shape = (cout, oh, ow)
    b.params += 1


def _op_bn(b):
    n = b.name('bn')
    decay = b.draw(st.sampled_from([0.9, 0.5]))
    b.init.append('self.%s = L.BatchNormalization(%d, decay=%r)'
                  % (n, b.shape[0], decay))
    b.body.append('h = self.%s(h)' % n)
    b.params += 1


def _op_dropout(b):
    ratio = b.draw(st.sampled_from([0.5, 0.1, 0.0]))
    b.body.append('h = F.dropout(h, %r)' % ratio)


ACTIVATIONS = collections.OrderedDict([
    ('relu', 'F.relu(h)'),
    ('tanh', 'F.tanh(h)'),
    ('sigmoid', 'F.sigmoid(h)'),
    ('leaky_relu', 'F.leaky_relu(h, slope=0.2)'),
    ('elu', 'F.elu(h, alpha=0.5)'),
    ('selu', 'F.selu(h)'),
    ('clipped_relu', 'F.clipped_relu(h, 1.0)'),
    ('hard_sigmoid', 'F.hard_sigmoid(h)'),
    ('softplus', 'F.softplus(h)'),
    ('absolute', 'F.absolute(h)'),
    ('clip', 'F.clip(h, -1.0, 1.0)'),
    ('gauss_bump', 'F.exp(-h * h)'),
    ('square', 'F.square(h) * 0.5'),
    ('sqrt', 'F.sqrt(h * h + 1.0)'),
])


def _op_act(b):
    names = [k for k in ACTIVATIONS if k not in b.exclude]
    name = b.draw(st.sampled_from(names))
    b.body.append('h = ' + ACTIVATIONS[name])
    b.ops.append(name)


def _factorizations(n, max_parts=3):
    out = set()
    for parts in range(1, max_parts + 1):
        for combo in itertools.product(range(1, min(n, MAX_DIM * 2) + 1),
                                       repeat=parts):
            if _prod(combo) == n:
                out.add(combo)
    return sorted(out)


def _op_reshape(b):
    options = [s for s in _factorizations(_prod(b.shape)) if s != b.shape]
    if not options:
        return _op_act(b)
    new = b.draw(st.sampled_from(options))
    if b.draw(st.booleans()):
        b.body.append('h = F.reshape(h, (-1,) + %r)' % (new,))
    else:
        b.body.append('h = F.reshape(h, (h.shape[0],) + %r)' % (new,))
    b.shape = new


def _op_transpose(b):
    perms = [p for p in itertools.permutations(range(len(b.shape)))
             if p != tuple(range(len(b.shape)))]
    perm = b.draw(st.sampled_from(perms))
    b.body.append('h = F.transpose(h, %r)'
                  % ((0,) + tuple(p + 1 for p in perm),))
    b.shape = tuple(b.shape[p] for p in perm)


def _op_getitem(b):
    ax = b.draw(st.sampled_from(_axes(b.shape, 2)))
    kinds = ['1:', ':-1', '::2', '::-1', '1::2']
    if len(b.shape) >= 2:
        kinds.append('int')
    kind = b.draw(st.sampled_from(kinds))
    d = b.shape[ax]
    if kind == 'int':
        i = b.draw(st.integers(-d, d - 1))
        b.body.append('h = h[%s, %d]' % (_bcol(ax), i))
        b.shape = b.shape[:ax] + b.shape[ax + 1:]
        return
    b.body.append('h = h[%s, %s]' % (_bcol(ax), kind))
    new = len(range(*slice(*[int(p) if p else None
                             for p in kind.split(':')]).indices(d)))
    b.shape = b.shape[:ax] + (new,) + b.shape[ax + 1:]


def _op_split_concat(b):
    ax = b.draw(st.sampled_from(_axes(b.shape, 2)))
    d = b.shape[ax]
    how = b.draw(st.sampled_from(['swap', 'glu', 'dup']))
    if how == 'glu' and d % 2 == 0:
        b.body.append('a, g = F.split_axis(h, 2, axis=%d)' % (ax + 1))
        b.body.append('h = a * F.sigmoid(g)')
        b.shape = b.shape[:ax] + (d // 2,) + b.shape[ax + 1:]
    elif how == 'dup' and b.ok(b.shape[:ax] + (2 * d,) + b.shape[ax + 1:]):
        b.body.append('h = F.concat([h, h * 0.5], axis=%d)' % (ax + 1))
        b.shape = b.shape[:ax] + (2 * d,) + b.shape[ax + 1:]
    else:
        k = b.draw(st.integers(1, d - 1))
        b.body.append('a, c = F.split_axis(h, [%d], axis=%d)' % (k, ax + 1))
        b.body.append('h = F.concat([c, F.tanh(a)], axis=%d)' % (ax + 1))


def _op_residual(b):
    if len(b.shape) == 1:
        n = b.name('res')
        b.init.append('self.%s = L.Linear(%d, %d)' % (n, b.shape[0],
                                                       b.shape[0]))
        b.body.append('h = h + F.relu(self.%s(h))' % n)
        b.params += 1
    elif len(b.shape) == 3:
        n = b.name('res')
        b.init.append('self.%s = L.Convolution2D(%d, %d, 3, pad=1)'
                      % (n, b.shape[0], b.shape[0]))
        b.body.append('h = F.relu(h + self.%s(h))' % n)
        b.params += 1
    else:
        b.body.append('h = h + F.tanh(h)')


def _op_pool(b):
    c, hh, ww = b.shape
    kind = b.draw(st.sampled_from(['max', 'avg']))
    ksize = b.draw(st.integers(2, 3))
    stride = b.draw(st.integers(1, 2))
    pad = b.draw(st.integers(0, ksize // 2))
    if kind == 'max':
        cover_all = b.draw(st.booleans())
        oh = conv_utils.get_conv_outsize(hh, ksize, stride, pad, cover_all)
        ow = conv_utils.get_conv_outsize(ww, ksize, stride, pad, cover_all)
        call = 'F.max_pooling_2d(h, %d, stride=%d, pad=%d, cover_all=%r)' % (
            ksize, stride, pad, cover_all)
    else:
        oh = conv_utils.get_conv_outsize(hh, ksize, stride, pad)
        ow = conv_utils.get_conv_outsize(ww, ksize, stride, pad)
        call = 'F.average_pooling_2d(h, %d, stride=%d, pad=%d)' % (
            ksize, stride, pad)
    if oh < 1 or ow < 1 or not b.ok((c, oh, ow)):
        return _op_act(b)
    b.body.append('h = ' + call)
    b.shape = (c, oh, ow)


def _broadcast_shape(b):
    shape = tuple(d if b.draw(st.booleans()) else 1 for d in b.shape)
    drop = b.draw(st.integers(0, len(shape)))
    return shape[drop:]


def _op_param_arith(b):
    shape = _broadcast_shape(b)
    how = b.draw(st.sampled_from(['*', '+']))
    if how == '*':
        n = b.param(shape, 0.5, 1.5)
        b.body.append('h = h * self.%s' % n)
    else:
        n = b.param(shape, -0.5, 0.5)
        b.body.append('h = self.%s + h' % n)


CONST_OPS = ('h * 0.5', 'h + 1.0', '2.0 - h', 'h / 2.0', '-h',
             'h * self.xp.full(h.shape[1:], 0.5, dtype=h.dtype)',
             'F.broadcast_to(self.xp.ones((1,) * h.ndim, dtype=h.dtype), '
             'h.shape) + h')


def _op_const_arith(b):
    b.body.append('h = ' + b.draw(st.sampled_from(CONST_OPS)))


def _op_reduce(b):
    ax = b.draw(st.sampled_from(range(len(b.shape))))
    fn = b.draw(st.sampled_from(['sum', 'mean']))
    keep = len(b.shape) == 1 or b.draw(st.booleans())
    b.body.append('h = F.%s(h, axis=%d, keepdims=%r)' % (fn, ax + 1, keep))
    b.shape = (b.shape[:ax] + ((1,) if keep else ()) + b.shape[ax + 1:])


def _op_softmax(b):
    fn = b.draw(st.sampled_from(['softmax', 'log_softmax']))
    b.body.append('h = F.%s(h, axis=1)' % fn)


def _op_extreme(b, fns=('max', 'min')):
    ax = b.draw(st.sampled_from(range(len(b.shape))))
    fn = b.draw(st.sampled_from(fns))
    keep = len(b.shape) == 1 or b.draw(st.booleans())
    if fn == 'logsumexp':
        b.body.append('h = F.logsumexp(h, axis=%d)' % (ax + 1))
        if keep:
            b.body.append('h = F.expand_dims(h, %d)' % (ax + 1))
    else:
        b.body.append('h = F.%s(h, axis=%d, keepdims=%r)'
                      % (fn, ax + 1, keep))
    b.shape = (b.shape[:ax] + ((1,) if keep else ()) + b.shape[ax + 1:])


def _op_logsumexp(b):
    _op_extreme(b, ('logsumexp',))


def _op_minmax_param(b):
    fn = b.draw(st.sampled_from(['maximum', 'minimum']))
    n = b.param(b.shape, -0.3, 0.3)
    b.body.append('h = F.%s(h, F.broadcast_to(self.%s, h.shape))' % (fn, n))


def _op_layer_norm(b):
    n = b.name('ln')
    b.init.append('self.%s = L.LayerNormalization(%d)' % (n, b.shape[0]))
    b.body.append('h = self.%s(h)' % n)
    b.params += 1


def _op_group_norm(b):
    """Its backward builds a node with an array that node's forward takes
    and clears (_XHatGrad's ``x_hat``)."""
    n = b.name('gn')
    b.init.append('self.%s = L.GroupNormalization(2, %d)' % (n, b.shape[0]))
    b.body.append('h = self.%s(h)' % n)
    b.params += 1


def _op_lrn(b):
    b.body.append('h = F.local_response_normalization(h, n=3)')


def _op_matmul(b):
    k = b.draw(st.integers(1, 5))
    n = b.param((b.shape[0], k), -0.5, 0.5)
    b.body.append('h = F.matmul(h, self.%s)' % n)
    b.shape = (k,)


def _op_deconv(b):
    c, hh, ww = b.shape
    cout = b.draw(st.integers(1, 3))
    ksize = b.draw(st.integers(1, 2))
    stride = b.draw(st.integers(1, 2))
    oh = conv_utils.get_deconv_outsize(hh, ksize, stride, 0)
    ow = conv_utils.get_deconv_outsize(ww, ksize, stride, 0)
    if not b.ok((cout, oh, ow)):
        return _op_act(b)
    n = b.name('deconv')
    b.init.append('self.%s = L.Deconvolution2D(%d, %d, %d, stride=%d)'
                  % (n, c, cout, ksize, stride))
    # Chainer 7's Deconvolution2DFunction.backward fails when its input
    # needs no gradient (_set_cover_all(x, W) gets Variables): scale the
    # input by a parameter so that it always does.
    p = b.param((c, 1, 1), 0.5, 1.5)
    b.body.append('h = self.%s(h * self.%s)' % (n, p))
    b.shape = (cout, oh, ow)
    b.params += 1


def _op_squeeze(b):
    ax = b.draw(st.integers(0, len(b.shape)))
    b.body.append('h = F.squeeze(F.expand_dims(h, %d), %d)'
                  % (ax + 1, ax + 1))


def _op_attr(b):
    """Keep a Variable on the chain (repeated at every replay), maybe on
    an attribute __init__ set to None (recorded as a plain value)."""
    if not b.keeps_attr and b.draw(st.booleans()):
        b.init.append('self.kept = None')
    b.body.append('self.kept = h')
    b.keeps_attr = True


def _op_held(b):
    """A constant array the chain holds (a positional encoding), fed to a
    function whole or through a view."""
    shape = _broadcast_shape(b)
    n = b.name('held')
    b.init.append('self.%s = numpy.asarray(numpy.random.uniform(-0.5, 0.5, '
                  '%r), dtype=DTYPE)' % (n, shape))
    view = b.draw(st.sampled_from(['', '[..., ::-1]'])) if shape else ''
    b.body.append('h = h + self.%s%s' % (n, view))


def _op_held_write(b):
    """Writes into an array the chain holds, then uses it: must fall back
    (and stay correct)."""
    _op_held(b)
    n = b.body[-1].split('self.')[1].split('[')[0]
    b.body.insert(-1, 'self.%s *= 0.5' % n)


def _op_branch(b):
    """Reads a value to branch: must fall back (and stay correct)."""
    b.body.append('if float(F.sum(h).array) > 0:')
    b.body.append('    h = F.relu(h)')
    b.body.append('else:')
    b.body.append('    h = h * -0.5')


def _op_inplace_write(b):
    """Writes into an activation in place: must fall back (and stay
    correct)."""
    b.body.append('h = chainer.as_variable(h)')
    b.body.append('h.array[...] *= 0.5')


def _op_numpy_const(b):
    """A non-uniform constant array: must fall back (and stay correct)."""
    b.body.append(
        'h = h + (self.xp.arange(%d).reshape(%r) * 0.01).astype(h.dtype)'
        % (_prod(b.shape), b.shape))


def _op_numpy_noise(b):
    """NumPy between Chainer functions, ops of the schedule
    (static_graph/numpy_calls.py): an array drawn from NumPy's global
    generator (DCGAN's add_noise) or from a generator the chain holds, or
    NumPy arithmetic on the activation's values."""
    sigma = b.draw(st.sampled_from([0.1, 0.5]))
    kind = b.draw(st.integers(0, 6))
    # On a device the host's arrays go there as user code sends them
    # (Chainer's DCGAN: xp.asarray of a draw), where the NumPy program
    # would mix host and device arrays.
    dev = '%s' if _device() is None else 'self.xp.asarray(%s)'
    b.body.append('h = chainer.as_variable(h)')
    if kind == 0:
        b.body.append('h = h + %r * %s' % (
            sigma, dev % 'numpy.random.randn(*h.shape)'))
    elif kind == 1:
        b.body.append('h = h * numpy.tanh(h.array * %r)' % sigma)
    elif kind == 2:
        b.body.append(
            'h = h + %s.astype(h.dtype) * %r' % (
                dev % '(numpy.random.uniform(-1, 1, size=h.shape) > 0)',
                sigma))
    elif kind == 3:
        n = b.name('rng')
        b.init.append('self.%s = numpy.random.RandomState(%d)'
                      % (n, b.draw(st.integers(0, 9))))
        b.body.append('h = h + %s.astype(h.dtype) * %r' % (
            dev % ('self.%s.standard_normal(h.shape)' % n), sigma))
    elif kind == 4:     # NumPy functions that work in place inside
        b.body.append('h = h * ((numpy.sort(h.array, axis=-1) - h.array.mean('
                      'axis=-1, keepdims=True)) * %r).astype(h.dtype)'
                      % sigma)
    elif kind == 5:     # an argmax per row (an array), one-hot
        b.body.append('h = h * (h.array.argmax(axis=-1)[..., None] == '
                      '%s.arange(h.shape[-1])).astype(h.dtype)'
                      % ('numpy' if _device() is None else 'self.xp'))
    else:               # ufuncs of a 0-d array (the loss's perplexity)
        b.body.append('h = h * (1 + numpy.tanh(F.mean(h).array) * %r)'
                      % sigma)


OPS = collections.OrderedDict([
    ('act', (_op_act, lambda s: True)),
    ('linear', (_op_linear, lambda s: True)),
    ('dropout', (_op_dropout, lambda s: True)),
    ('const', (_op_const_arith, lambda s: True)),
    ('param', (_op_param_arith, lambda s: True)),
    ('bn', (_op_bn, lambda s: True)),
    ('conv', (_op_conv, lambda s: len(s) == 3)),
    ('pool', (_op_pool, lambda s: len(s) == 3 and min(s[1:]) >= 2)),
    ('residual', (_op_residual, lambda s: True)),
    ('reshape', (_op_reshape, lambda s: True)),
    ('transpose', (_op_transpose, lambda s: len(s) >= 2)),
    ('getitem', (_op_getitem, lambda s: max(s) >= 2)),
    ('split', (_op_split_concat, lambda s: max(s) >= 2)),
    ('reduce', (_op_reduce, lambda s: True)),
    ('softmax', (_op_softmax, lambda s: s[0] >= 2)),
    ('extreme', (_op_extreme, lambda s: True)),
    ('logsumexp', (_op_logsumexp, lambda s: True)),
    ('minmax_param', (_op_minmax_param, lambda s: True)),
    ('layer_norm', (_op_layer_norm, lambda s: len(s) == 1 and s[0] >= 2)),
    ('group_norm', (_op_group_norm, lambda s: s[0] % 2 == 0 and
                    _prod(s) > 2)),
    ('lrn', (_op_lrn, lambda s: len(s) == 3)),
    ('matmul', (_op_matmul, lambda s: len(s) == 1)),
    ('deconv', (_op_deconv, lambda s: len(s) == 3)),
    ('squeeze', (_op_squeeze, lambda s: True)),
    ('attr', (_op_attr, lambda s: True)),
    ('held', (_op_held, lambda s: True)),
    ('numpy_noise', (_op_numpy_noise, lambda s: True)),
])
# Rare on purpose: they fall back. Drawn with low probability.
FALLBACK_OPS = collections.OrderedDict([
    ('branch', _op_branch),
    ('numpy_const', _op_numpy_const),
    ('inplace_write', _op_inplace_write),
    ('held_write', _op_held_write),
])


@st.composite
def programs(draw, dtypes=DTYPES, max_layers=6, fallback_ops=True,
             exclude=()):
    """Random chains. ``exclude``: names of ops or activations
    (``OPS``, ``FALLBACK_OPS``, ``ACTIVATIONS``) never to draw, and
    ``return_h`` to return the loss alone."""
    dtype = draw(st.sampled_from(dtypes))
    if draw(st.booleans()):
        in_shape = (draw(st.integers(2, 6)),)
    else:
        in_shape = (draw(st.integers(1, 3)), draw(st.integers(2, 5)),
                    draw(st.integers(2, 5)))
    b = _Builder(draw, dtype, in_shape, exclude)
    # Mostly start from a Variable; a raw input array (NumPy indexing and
    # arithmetic on it fall back) stays possible.
    raw_start = draw(st.integers(0, 4)) == 4
    if not raw_start:
        b.body.append('h = chainer.as_variable(h)')
    n_layers = draw(st.integers(1, max_layers))
    for _ in range(n_layers):
        rare = [k for k in FALLBACK_OPS if k not in b.exclude]
        if fallback_ops and rare and draw(st.integers(0, 39)) == 39:
            name = draw(st.sampled_from(rare))
            FALLBACK_OPS[name](b)
        else:
            choices = [k for k, (_, ok) in OPS.items()
                       if ok(b.shape) and k not in b.exclude]
            name = draw(st.sampled_from(choices))
            OPS[name][0](b)
        b.ops.append(name)
        assert b.ok(b.shape), (name, b.shape)
    head = draw(st.sampled_from(['sq', 'ce']))
    n_classes = 0
    if head == 'ce':
        n_classes = draw(st.integers(2, 4))
        n = b.name('out')
        b.init.append('self.%s = L.Linear(%d, %d)' % (n, _prod(b.shape),
                                                       n_classes))
        b.body.append('y = self.%s(h)' % n)
        b.params += 1
        if draw(st.integers(0, 3)) == 3:
            # An old-style Function: its backward computes the gradient in
            # NumPy and keeps its state on the Function object.
            b.body.append('loss = F.hinge(y, t)')
        else:
            b.body.append('loss = F.softmax_cross_entropy(y, t)')
            # Some labels ignored (-1), a different number every batch:
            # the loss divides by a count its gradient node is built with.
            b.ignore_labels = draw(st.booleans())
        if draw(st.booleans()):
            b.body.append("chainer.report({'loss': loss}, self)")
        last = 'y'
    else:
        reduce = draw(st.sampled_from(['F.sum(h * h)', 'F.mean(h * h)',
                                       'F.sum(F.square(h)) * 0.5']))
        b.body.append('loss = ' + reduce)
        last = 'h'
    rets = ['loss']
    if 'return_h' not in b.exclude:
        rets += ['(loss, %s)' % last, "{'loss': loss, 'out': %s}" % last,
                 'Pair(loss, %s)' % last, 'Holder(loss, %s)' % last]
    ret = draw(st.sampled_from(rets))
    prog = Program(dtype, in_shape, head, n_classes, b.init, b.body, ret,
                   b.ops, b.params, b.ignore_labels)
    prog.keeps_attr = b.keeps_attr
    # Every backward of the training loop is run a second time through the
    # same calls (the DCGAN updater backpropagates two losses so).
    prog.backward_again = 'again' not in b.exclude and \
        draw(st.integers(0, 4)) == 4
    return prog


# -- call patterns ------------------------------------------------------------
class Step(object):
    """One step of the training loop, applied identically to both twins."""

    __slots__ = ('mode', 'batch', 'micro', 'label_kw', 'twice', 'replace',
                 'x_as', 'update')

    def __init__(self, mode, batch, micro, label_kw, twice, replace, x_as,
                 update):
        # 'train' | 'eval' (no_backprop_mode) | 'eval_backprop' (train=False,
        # backward) | 'forward_only' (train=True, backprop on, no backward)
        self.mode = mode
        self.batch = batch
        self.micro = micro        # forward/backward passes before update
        self.label_kw = label_kw  # t=... instead of positional
        self.twice = twice        # None | 'sum' | 'separate'
        self.replace = replace    # None | int (param index) | 'persist'
        self.x_as = x_as          # 'array' | 'var' | 'var_nograd'
        self.update = update

    def __repr__(self):
        return 'Step(%s)' % ', '.join('%s=%r' % (k, getattr(self, k))
                                      for k in self.__slots__)


@st.composite
def steps(draw, min_steps=2, max_steps=5):
    n = draw(st.integers(min_steps, max_steps))
    out = []
    for _ in range(n):
        mode = draw(st.sampled_from(['train', 'train', 'eval',
                                     'eval_backprop', 'forward_only']))
        backprop = mode not in ('eval', 'forward_only')
        out.append(Step(
            mode=mode,
            batch=draw(st.sampled_from(BATCH_SIZES)),
            micro=draw(st.integers(1, 3)) if backprop else 1,
            label_kw=draw(st.booleans()),
            twice=draw(st.sampled_from([None, 'sum', 'separate'])),
            replace=draw(st.one_of(st.none(), st.integers(0, 50),
                                   st.just('persist'))),
            x_as=draw(st.sampled_from(['array', 'var', 'var_nograd'])),
            update=backprop and draw(st.sampled_from([True, True, False])),
        ))
    return out


@st.composite
def examples(draw, dtypes=DTYPES, max_layers=6, fallback_ops=True,
             max_steps=5, exclude=()):
    prog = draw(programs(dtypes=dtypes, max_layers=max_layers,
                         fallback_ops=fallback_ops, exclude=exclude))
    seq = draw(steps(max_steps=max_steps))
    seed = draw(st.integers(0, 2 ** 16))
    return prog, seq, seed


# -- running and comparing ----------------------------------------------------
class Divergence(AssertionError):
    pass


def _flat(out):
    if isinstance(out, chainer.Variable):
        return [out]
    if isinstance(out, (tuple, list)):
        return [v for o in out for v in _flat(o)]
    if isinstance(out, dict):
        return [v for k in sorted(out) for v in _flat(out[k])]
    if hasattr(out, 'shape'):
        return [out]
    if isinstance(out, Holder):
        return [out.loss] + _flat(out.extras)
    return []


def _array(v):
    return v.array if isinstance(v, chainer.Variable) else v


def _loss(out):
    if isinstance(out, tuple):
        return out[0]
    if isinstance(out, dict):
        return out['loss']
    if isinstance(out, Holder):
        return out.loss
    return out


# True: a result that is within tolerance but not bit for bit equal to
# define-by-run's is a divergence too (benchmarks/fuzz.py --exact).
EXACT = False

# A Chainer device specifier ('@cupy:0'): both twins, their inputs and the
# arrays they hold live there (benchmarks/fuzz.py --device). None: NumPy.
DEVICE = None


def _device():
    return chainer.get_device(DEVICE) if DEVICE is not None else None


def _seed(seed):
    """Seed the random draws of both twins' calls (NumPy's and, on a GPU,
    CuPy's: dropout draws there)."""
    numpy.random.seed(seed)
    dev = _device()
    if dev is not None and dev.xp is not numpy:
        dev.xp.random.seed(seed)


def _to_device(model, dev):
    """Move the chain, and the plain arrays its links hold (which
    ``to_device`` leaves alone), to ``dev``."""
    model.to_device(dev)
    for link in model.links():
        for name, value in list(vars(link).items()):
            if isinstance(value, numpy.ndarray):
                setattr(link, name, dev.send(value))


class _Compare(object):
    def __init__(self, dtype):
        self.rtol, self.atol = TOLERANCES[dtype]
        self.exact = True

    def __call__(self, a, b, what):
        a = chainer.backend.CpuDevice().send(
            a.array if isinstance(a, chainer.Variable) else a)
        b = chainer.backend.CpuDevice().send(
            b.array if isinstance(b, chainer.Variable) else b)
        if a is None or b is None:
            if (a is None) != (b is None):
                raise Divergence('%s: one twin has None (dbr %r, static %r)'
                                 % (what, a is None, b is None))
            return
        if a.shape != b.shape or a.dtype != b.dtype:
            raise Divergence('%s: dbr %s%s, static %s%s' % (
                what, a.dtype, a.shape, b.dtype, b.shape))
        if not numpy.array_equal(a, b, equal_nan=True):
            self.exact = False
            if EXACT:
                raise Divergence('%s: not bit for bit equal (max abs '
                                 'difference %g)' % (what, numpy.nanmax(
                                     numpy.abs(a.astype(numpy.float64) -
                                               b.astype(numpy.float64)))))
        try:
            numpy.testing.assert_allclose(
                a.astype(numpy.float64), b.astype(numpy.float64),
                rtol=self.rtol, atol=self.atol, err_msg='%s differs' % what)
        except AssertionError as e:
            raise Divergence(str(e))


def _inputs(prog, step, rs):
    """[(x, t)] per call of the step: micro-batches x (1 or 2 calls)."""
    calls = []
    per = 2 if step.twice else 1
    scale = 0.5 if prog.dtype == 'float16' else 1.0
    for _ in range(step.micro * per):
        x = (rs.standard_normal((step.batch,) + prog.in_shape) * scale
             ).astype(prog.dtype)
        t = rs.randint(0, max(prog.n_classes, 1), step.batch).astype(
            numpy.int32)
        if prog.ignore_labels:
            t[rs.rand(step.batch) < 0.4] = -1
        dev = _device()
        calls.append((x, t) if dev is None else (dev.send(x), dev.send(t)))
    return calls


def _call(model, prog, step, x, t):
    if step.x_as == 'var':
        xv = chainer.Variable(x.copy())
    elif step.x_as == 'var_nograd':
        xv = chainer.Variable(x.copy(), requires_grad=False)
    else:
        xv = x.copy()   # each twin its own: a method may write into it
    if prog.head == 'ce':
        out = model(xv, t=t) if step.label_kw else model(xv, t)
    else:
        out = model(xv, t=None) if step.label_kw else model(xv)
    return xv, out


def _run_step(model, opt, prog, step, calls, seed):
    """Run one step on one twin; returns (outputs, input Variables)."""
    outs, xs = [], []
    _seed(seed)
    backprop = step.mode not in ('eval', 'forward_only')
    train = step.mode in ('train', 'forward_only')
    per = 2 if step.twice else 1
    with chainer.using_config('train', train), \
            chainer.using_config('enable_backprop', step.mode != 'eval'):
        if backprop:
            model.cleargrads()
        for m in range(step.micro):
            pair = calls[m * per:(m + 1) * per]
            results = []
            for x, t in pair:
                xv, out = _call(model, prog, step, x, t)
                results.append(out)
                outs.append(out)
                xs.append(xv)
            if not backprop:
                continue
            losses = [_loss(r) for r in results]
            if step.twice == 'separate':
                for loss in losses:
                    loss.backward()
            elif step.twice == 'sum':
                (losses[0] + 2 * losses[1]).backward()
            else:
                losses[0].backward()
            if prog.backward_again:
                losses[-1].backward()
    return outs, xs


def _replace(step, models, rs, dtype):
    if step.replace is None:
        return
    if step.replace == 'persist':
        bns = [sorted((n, l) for n, l in m.namedlinks()
                      if isinstance(l, L.BatchNormalization)) for m in models]
        if not bns[0]:
            return
        for (n, link) in bns[0]:
            new = numpy.asarray(rs.uniform(0.5, 1.5, link.avg_var.shape),
                                dtype=link.avg_var.dtype)
            for m in models:
                d = dict(m.namedlinks())[n]
                d.avg_var = _like(link.avg_var, new)
        return
    names = sorted(n for n, _ in models[0].namedparams())
    if not names:
        return
    name = names[step.replace % len(names)]
    old = dict(models[0].namedparams())[name].array
    host = chainer.backend.CpuDevice().send(old)
    new = numpy.asarray(host * 0.9 + rs.uniform(-0.1, 0.1, old.shape),
                        dtype=old.dtype)
    for m in models:
        dict(m.namedparams())[name].array = _like(old, new)


def _like(where, array):
    """A fresh copy of the host ``array`` on the device of ``where``."""
    return chainer.backend.get_device_from_array(where).send(array.copy())


def check_example(prog, seq, seed, stats=STATS):
    """Train both twins through ``seq``; raise Divergence on a mismatch."""
    diagnostics.reset_warnings()
    net, static_net = prog.classes()
    with chainer.using_config('dtype', numpy.dtype(prog.dtype)):
        numpy.random.seed(seed)
        a = net()
        numpy.random.seed(seed)
        b = static_net()
    b.copyparams(a)
    # copyparams copies params only: persistents start equal by construction
    if _device() is not None:
        _to_device(a, _device())
        _to_device(b, _device())
    oa = chainer.optimizers.MomentumSGD(lr=0.01)
    ob = chainer.optimizers.MomentumSGD(lr=0.01)
    oa.setup(a)
    ob.setup(b)
    compare = _Compare(prog.dtype)
    rs = numpy.random.RandomState(seed)
    # Every array handed to the user (outputs, input and parameter
    # gradients, kept attributes), per twin in the same order: at the end
    # they must still agree (nothing handed out is overwritten later).
    handed = ([], [])
    caught = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter('always')
            for i, step in enumerate(seq):
                _one_step(i, step, prog, (a, b), (oa, ob), rs, compare,
                          handed, stats)
        for (u, what), (v, _) in zip(*handed):
            compare(u, v, 'at the end, the array handed out at %s' % what)
    finally:
        _count(prog, b, caught, compare, stats)
    return a, b


def _one_step(i, step, prog, models, opts, rs, compare, handed, stats):
    a, b = models
    _replace(step, models, rs, prog.dtype)
    calls = _inputs(prog, step, rs)
    where = 'step %d %r' % (i, step)
    outs_a, xs_a = _run_step(a, opts[0], prog, step, calls, 1000 + i)
    outs_b, xs_b = _run_step(b, opts[1], prog, step, calls, 1000 + i)
    stats.calls += len(outs_a)
    for k, (u, v) in enumerate(zip(outs_a, outs_b)):
        fu, fv = _flat(u), _flat(v)
        if len(fu) != len(fv):
            raise Divergence('%s: call %d returned %d vs %d values'
                             % (where, k, len(fu), len(fv)))
        for j, (p, q) in enumerate(zip(fu, fv)):
            what = '%s: call %d output %d' % (where, k, j)
            compare(p, q, what)
            for side, r in zip(handed, (p, q)):
                side.append((_array(r), what))
    for k, (u, v) in enumerate(zip(xs_a, xs_b)):
        if isinstance(u, chainer.Variable) and u.requires_grad:
            what = '%s: call %d input grad' % (where, k)
            compare(u.grad, v.grad, what)
            if u.grad is not None:
                handed[0].append((u.grad, what))
                handed[1].append((v.grad, what))
    if getattr(prog, 'keeps_attr', False):
        ka, kb = getattr(a, 'kept', None), getattr(b, 'kept', None)
        what = '%s: attribute self.kept' % where
        compare(ka, kb, what)
        if ka is not None:
            handed[0].append((_array(ka), what))
            handed[1].append((_array(kb), what))
    backprop = step.mode not in ('eval', 'forward_only')
    _compare_chains(a, b, compare, where, grads=backprop)
    if backprop:
        pa, pb = dict(a.namedparams()), dict(b.namedparams())
        for name in sorted(pa):
            if pa[name].grad is not None:
                what = '%s: grad of %s' % (where, name)
                handed[0].append((pa[name].grad, what))
                handed[1].append((pb[name].grad, what))
    if step.update:
        opts[0].update()
        opts[1].update()
        _compare_chains(a, b, compare, where + ' after update', grads=False)
    stats.steps += 1


def _count(prog, b, caught, compare, stats):
    fallback_msgs = []
    for w in caught or ():
        if issubclass(w.category, StaticGraphWarning):
            msg = str(w.message)
            if 'falls back' in msg or 'runs define-by-run' in msg:
                fallback_msgs.append(msg)
    stats.examples += 1
    stats.dtypes[prog.dtype] += 1
    for op in set(prog.ops):
        stats.ops[op] += 1
    cache = caches_of(b).get('forward')
    if cache is not None:
        stats.recordings += cache.recordings
        stats.replays += cache.replays
        stats.fallback_calls += cache.fallback_calls
        for e in cache.entries.values():
            if e.state == 'fallback':
                fallback_msgs.append(e.reason)
    if fallback_msgs:
        stats.fallback_examples += 1
        for m in set(_normalize(m) for m in fallback_msgs):
            stats.fallback_reasons[m] += 1
    if compare.exact:
        stats.bit_exact_examples += 1


def _normalize(msg):
    """A fallback reason without the varying parts (file:line, class)."""
    msg = msg.split(' for this call signature: ')[-1]
    msg = msg.split('runs define-by-run: ')[-1]
    return msg.split(' at ')[0]


def _compare_chains(a, b, compare, where, grads=True):
    pa = dict(a.namedparams())
    pb = dict(b.namedparams())
    if sorted(pa) != sorted(pb):
        raise Divergence('%s: parameter names differ' % where)
    for name in sorted(pa):
        compare(pa[name].array, pb[name].array, '%s: param %s'
                % (where, name))
        if grads:
            compare(pa[name].grad, pb[name].grad, '%s: grad of %s'
                    % (where, name))
    la, lb = dict(a.namedlinks()), dict(b.namedlinks())
    for name in sorted(la):
        for p in getattr(la[name], '_persistent', ()):
            u, v = getattr(la[name], p), getattr(lb[name], p)
            if hasattr(u, 'shape'):
                compare(u, v, '%s: persistent %s/%s' % (where, name, p))
            elif u != v:
                raise Divergence('%s: persistent %s/%s %r != %r'
                                 % (where, name, p, u, v))
