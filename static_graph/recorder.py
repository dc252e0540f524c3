"""See every FunctionNode application of a call, forward and backward.

While a thread records, ``FunctionNode.apply`` is wrapped: each application
becomes a ``RecordedOp`` over buffers (arrays identified by object identity),
together with the node's hidden state (arrays the forward left on ``self``)
and the attributes the forward changed (restored before each replay, so a
node such as Dropout draws a fresh mask instead of reusing the old one).
The wrappers are installed only while some thread records; other threads
pass straight through.
"""
import random
import sys
import threading

import numpy

import chainer
from chainer import backend
from chainer import _backprop_utils
from chainer import function_node
from chainer import reporter as reporter_module
from chainer import variable as variable_module

from schedules import ir
from static_graph import device_reads
from static_graph import traced

_local = threading.local()
traced._active = _local

_orig_apply = function_node.FunctionNode.apply
_orig_get_array = variable_module.Variable._get_array
_orig_report = reporter_module.Reporter.report
_orig_backprop_step = _backprop_utils.backprop_step
# NumPy's array constructors do not dispatch on their argument: a traced
# array would come back plain (numpy.asarray(h.array)), its values no
# longer seen. While recording they keep it traced.
_NUMPY_CONSTRUCTORS = ('asarray', 'array', 'ascontiguousarray',
                       'asfortranarray')
_orig_numpy = dict((name, getattr(numpy, name))
                   for name in _NUMPY_CONSTRUCTORS)
_VARIABLE_FILE = variable_module.__file__.replace('.pyc', '.py')


def _global_rng_functions(module, instance, skip):
    """The module-level functions of ``module`` that are methods of its
    global generator ``instance`` (numpy.random.rand, random.random...)."""
    return dict((name, fn) for name, fn in vars(module).items()
                if getattr(fn, '__self__', None) is instance and
                not name.startswith('_') and name not in skip)


def _flag_draw(module_name, name):
    orig = _orig_rng[module_name, name]

    def draw(*args, **kwargs):
        rec = getattr(_local, 'recording', None)
        if rec is not None and not rec.depth and not sys._getframe(
                1).f_code.co_filename.startswith(traced.INTERNAL_DIRS):
            rec.add_reason(
                'user code draws random numbers (%s.%s) at %s; replay '
                'would freeze them (use Chainer functions such as '
                'F.dropout or F.gaussian, or pass them in as arguments)'
                % (module_name, name, traced.user_location(2)))
        return orig(*args, **kwargs)

    draw.__name__ = name
    draw.__doc__ = orig.__doc__
    return draw


# The global generators of numpy.random and of Python's random module, whose
# draws user code makes between Chainer functions (a mixup coefficient, a
# random augmentation): not repeated by replay. While recording, such a
# draw (or a reseeding) from user code is a reason to fall back.
_RNG_MODULES = {'numpy.random': numpy.random, 'random': random}
_orig_rng = {}
for _m, _inst, _skip in (
        ('numpy.random', numpy.random.mtrand._rand, ('get_state',)),
        ('random', random._inst, ('getstate', 'getrandbits'))):
    for _name, _fn in _global_rng_functions(
            _RNG_MODULES[_m], _inst, _skip).items():
        _orig_rng[_m, _name] = _fn
del _m, _inst, _skip, _name, _fn
_patched_rng = dict((key, _flag_draw(*key)) for key in _orig_rng)

_install_lock = threading.Lock()
_install_count = 0

MISSING = object()

# Attributes FunctionNode.apply manages itself; never state, never restored.
_APPLY_KEYS = frozenset((
    '_input_indexes_to_retain', '_output_indexes_to_retain',
    '_retained_output_data', 'inputs', 'outputs', 'rank', '_input_layouts',
    '_output_layouts', 'stack', 'chainerx_device',
    '_is_chainerx_fallback_mode', 'lazy_grad_sum', '_n_local_function_hooks',
    '_local_function_hooks', '_output_count',
))


def current():
    """The recording active in this thread, or None."""
    return getattr(_local, 'recording', None)


def is_array(v):
    return isinstance(v, numpy.ndarray) or (
        type(v).__name__ == 'ndarray' and hasattr(v, '__cuda_array_interface__'))


def root_of(a):
    while getattr(a, 'base', None) is not None and is_array(a.base):
        a = a.base
    return a


def copyto_for(arrays):
    """``copyto`` of the arrays' module (NumPy's for none)."""
    xp = backend.get_array_module(*arrays) if arrays else numpy
    return xp.copyto


def copy_exact(a):
    """A copy of ``a`` in fresh memory with ``a``'s very strides (a view's
    gaps and a broadcast's zero strides included), so that NumPy's
    reductions over it sum in the same order as over ``a``. Other arrays
    (CuPy) get a copy in ``a``'s memory order."""
    if type(a) is not numpy.ndarray or a.flags.c_contiguous or \
            a.flags.f_contiguous or a.size == 0 or \
            any(s % a.itemsize for s in a.strides):
        return a.copy(order='K')
    lo = sum(s * (n - 1) for s, n in zip(a.strides, a.shape) if s < 0)
    hi = sum(s * (n - 1) for s, n in zip(a.strides, a.shape) if s > 0)
    flat = numpy.empty((hi - lo) // a.itemsize + 1, a.dtype)
    out = numpy.lib.stride_tricks.as_strided(
        flat[-lo // a.itemsize:], a.shape, a.strides)
    numpy.copyto(out, a)
    return out


def op_kind(node):
    fn = getattr(node, '_function', None)   # old-style chainer.Function
    return type(fn if fn is not None else node).__name__


_FUNCTION = '_function.'


class AdapterAttrs(object):
    """The attributes of an old-style ``chainer.Function``'s adapter node
    and of the Function it wraps, as one mapping: the Function's under
    ``'_function.' + name``. An old-style Function keeps its hidden state
    (F.hinge's ``bottom_diff``) on itself, not on the node; this lets that
    state be recorded, restored and handed back like a node's."""

    __slots__ = ('node', 'fn')

    def __init__(self, node):
        self.node = node.__dict__
        self.fn = node._function.__dict__

    def _where(self, k):
        if k.startswith(_FUNCTION):
            return self.fn, k[len(_FUNCTION):]
        return self.node, k

    def __getitem__(self, k):
        d, k = self._where(k)
        return d[k]

    def __setitem__(self, k, v):
        d, k = self._where(k)
        d[k] = v

    def __contains__(self, k):
        d, k = self._where(k)
        return k in d

    def get(self, k, default=None):
        d, k = self._where(k)
        return d.get(k, default)

    def pop(self, k, default=None):
        d, k = self._where(k)
        return d.pop(k, default)

    def update(self, pairs):
        for k, v in (pairs.items() if isinstance(pairs, dict) else pairs):
            self[k] = v

    def items(self):
        out = [(k, v) for k, v in self.node.items() if k != '_function']
        out.extend((_FUNCTION + k, v) for k, v in self.fn.items())
        return out

    def keys(self):
        return dict(self.items()).keys()

    def __iter__(self):
        return iter(self.keys())

    def __len__(self):
        return len(self.items())

    def copy(self):
        return dict(self.items())


def attrs(node):
    """A node's attributes as a mapping: its ``__dict__``, or for an
    old-style Function's adapter, ``AdapterAttrs``."""
    if getattr(node, '_function', None) is not None:
        return AdapterAttrs(node)
    return node.__dict__


_Variable = chainer.Variable
_type_info = {}   # FunctionNode class -> (kind, user defined, side effects,
#                   declared pure); kind None for old-style Function adapters


def _describe_type(impl):
    if getattr(impl, '_function', None) is not None:
        return (None, False, False, False)
    cls = type(impl)
    module = cls.__module__ or ''
    user_defined = not (module == 'chainer' or module.startswith('chainer.'))
    return (cls.__name__, user_defined,
            bool(getattr(cls, 'static_graph_side_effects', False)),
            bool(getattr(cls, 'static_graph_pure', False)))


def _changed(before, after):
    if before.shape != after.shape:
        return True
    if before.dtype.kind in 'fc':
        return not numpy.array_equal(before, after, equal_nan=True)
    return not numpy.array_equal(before, after)


def _patched_apply(self, inputs):
    rec = getattr(_local, 'recording', None)
    if rec is None or rec.depth:
        return _orig_apply(self, inputs)
    return rec.on_apply(self, inputs)


def _patched_get_array(self):
    a = _orig_get_array(self)
    rec = getattr(_local, 'recording', None)
    if rec is None or rec.depth or type(a) is not numpy.ndarray:
        return a
    f = sys._getframe(1)
    while f is not None and f.f_code.co_filename == _VARIABLE_FILE:
        f = f.f_back
    if f is None or f.f_code.co_filename.startswith(traced.INTERNAL_DIRS):
        return a
    return rec.trace(a)


def _keeps_traced(name):
    orig = _orig_numpy[name]
    TracedArray = traced.TracedArray

    def constructor(a, *args, **kwargs):
        out = orig(a, *args, **kwargs)
        if type(a) is not TracedArray or type(out) is not numpy.ndarray:
            return out
        rec = getattr(_local, 'recording', None)
        if rec is None:
            return out
        if numpy.shares_memory(out, traced.plain(a)):
            # A view: traced, and known to be one (a Chainer function
            # taking it sees the recorded buffer behind it).
            return rec.trace(out)
        return out.view(TracedArray)   # a copy: computed from the values

    constructor.__name__ = name
    constructor.__doc__ = orig.__doc__
    return constructor


_patched_numpy = dict((name, _keeps_traced(name))
                      for name in _NUMPY_CONSTRUCTORS)


def _shape_maker(name):
    """numpy.arange and the like: a result made by user code from Python
    values alone is noted as a constant of the key (device_reads has
    CuPy's)."""
    orig = _orig_numpy[name]

    def maker(*args, **kwargs):
        out = orig(*args, **kwargs)
        rec = getattr(_local, 'recording', None)
        if rec is not None and not rec.depth and \
                device_reads.numbers_only(args, kwargs):
            rec.shape_made[id(out)] = out   # (alive: its id stays its own)
        return out

    maker.__name__ = name
    maker.__doc__ = orig.__doc__
    return maker


for _name in device_reads.SHAPE_MAKERS:
    _orig_numpy[_name] = getattr(numpy, _name)
    _patched_numpy[_name] = _shape_maker(_name)


def _detached_copy(v):
    if isinstance(v, chainer.Variable):
        a = v.raw_array
        return chainer.Variable(
            a if a is None else copy_exact(traced.untraced(a)),
            requires_grad=False)
    if is_array(v):
        return copy_exact(traced.untraced(v))
    return v


def _patched_report(self, values, observer=None):
    rec = getattr(_local, 'recording', None)
    if rec is not None and not rec.depth and rec.phase == 'forward':
        rec.on_report(values, observer)
        if not chainer.config.keep_graph_on_report:
            # Which arrays replay will rewrite in place is known only once
            # the backward is recorded: report copies.
            values = {k: _detached_copy(v) for k, v in values.items()}
    return _orig_report(self, values, observer)


def _patched_backprop_step(func, target_input_indexes, grad_outputs,
                           grad_inputs, is_debug):
    rec = getattr(_local, 'recording', None)
    if rec is None or rec.depth or rec.phase != 'backward':
        return _orig_backprop_step(func, target_input_indexes, grad_outputs,
                                   grad_inputs, is_debug)
    # Ops this step applies are labelled with the forward op's source.
    label = rec.labels.get(id(func), MISSING)
    rec.backward_label = label if label is not MISSING else \
        'backward of %s' % op_kind(func)
    # See what the node's backward() returns (backprop_step only files it
    # into grad_inputs): wrap it on the instance for this one step.
    start = len(rec.backward_ops)
    returned = []
    d = func.__dict__
    had = d.get('backward', MISSING)
    bound = func.backward

    def backward(indexes, gys):
        gxs = bound(indexes, gys)
        # Ops after this (the sums of gradients backprop_step makes) are
        # not the node's.
        returned.append((gxs, len(rec.backward_ops)))
        return gxs

    d['backward'] = backward
    try:
        _orig_backprop_step(func, target_input_indexes, grad_outputs,
                            grad_inputs, is_debug)
    finally:
        if had is MISSING:
            d.pop('backward', None)
        else:
            d['backward'] = had
    rec.on_backward_step(func, target_input_indexes, grad_outputs, returned,
                         start)


# What install() puts in place, as (namespace dict, {name: patched}, {name:
# original}): one dict update per namespace each way (the 67 global
# generator functions alone took ~30 us as setattr calls, cache cold).
_PATCHES = (
    (function_node.FunctionNode, {'apply': _patched_apply},
     {'apply': _orig_apply}),
    (variable_module.Variable, {'_get_array': _patched_get_array},
     {'_get_array': _orig_get_array}),
    (reporter_module.Reporter, {'report': _patched_report},
     {'report': _orig_report}),
    (_backprop_utils.__dict__, {'backprop_step': _patched_backprop_step},
     {'backprop_step': _orig_backprop_step}),
    (numpy.__dict__, _patched_numpy, _orig_numpy),
) + tuple(
    (module.__dict__,
     dict((n, fn) for (m, n), fn in _patched_rng.items() if m == name),
     dict((n, fn) for (m, n), fn in _orig_rng.items() if m == name))
    for name, module in _RNG_MODULES.items())
for _cupy_patch in (device_reads.patches(MISSING),   # CuPy (GPU) only
                    device_reads.constant_patches()):
    if _cupy_patch is not None:
        _PATCHES += (_cupy_patch,)


def _put(which):
    for where, patched, orig in _PATCHES:
        pairs = patched if which else orig
        if isinstance(where, dict):
            where.update(pairs)
        else:           # a class: its __dict__ is read-only
            for name, fn in pairs.items():
                if fn is MISSING:   # inherited: the patch goes again
                    delattr(where, name)
                else:
                    setattr(where, name, fn)


def install():
    global _install_count
    with _install_lock:
        if _install_count == 0:
            _put(True)
        _install_count += 1


def uninstall():
    global _install_count
    with _install_lock:
        _install_count -= 1
        if _install_count == 0:
            _put(False)


_RANGES = tuple(tuple(range(n)) for n in range(8))
_ndarray = numpy.ndarray
_Buffer = ir.Buffer
_TEMP = ir.TEMP


class RecordedOp(object):
    __slots__ = ('node', 'kind', 'inputs', 'outputs', 'select', 'state',
                 'restore', 'source', 'attrs', 'rebind', 'nones')

    def __init__(self, node, kind, inputs, outputs, select, state, restore,
                 source, attrs):
        self.node = node
        self.kind = kind
        self.inputs = inputs      # buffer ids
        self.outputs = outputs    # buffer ids (arrays returned, then state)
        self.select = select      # positions in the (results + state) tuple
        self.state = state        # [(attr, buffer id)] hidden state
        self.restore = restore    # [(attr, value before forward)]
        self.source = source
        self.attrs = attrs
        # [(attr, buffer id)]: arrays the node was built with, passed to it
        # as extra inputs at every replay (analysis.mark_captured).
        self.rebind = []
        # Positions of the node's inputs that were None (LSTMGrad's
        # gradient of an unused cell state): not buffers; None again at
        # every replay.
        self.nones = ()


class BackwardStep(object):
    """One call of a forward node's ``backward()`` while recording: the
    backward ops it applied (``rec.backward_ops[start:end]``) and what it
    was handed and returned. When those ops cannot replay as recorded (the
    method computed a mask in Python), the step is replayed by calling
    ``backward()`` again (``rerun``); ``resolve`` then names the buffers it
    reads and returns."""
    __slots__ = ('node', 'target', 'start', 'end', 'label', 'rerun', 'raw',
                 'gy', 'gx', 'retained_in', 'retained_out', 'python_made')

    def __init__(self, node, target, grad_outputs, gxs, start, end, label):
        self.node = node
        self.target = target              # input indexes given gradients
        self.start, self.end = start, end
        self.label = label
        self.rerun = False
        self.raw = (grad_outputs, gxs)
        self.gy = self.gx = None          # buffer id or None per output,
        self.retained_in = None           # per target; [(index, buffer)]
        self.retained_out = None          # [buffer id]
        self.python_made = set()          # gradients backward() made in
        #                                   Python (no node), by buffer id

    def resolve(self, by_id):
        """Buffer ids of what the step read and returned (while the
        recording's arrays are alive); False if one is no buffer."""
        if self.gy is not None:
            return True
        grad_outputs, gxs = self.raw
        func = self.node
        if len(gxs) == len(func.inputs):
            gxs = tuple(gxs[i] for i in self.target)
        if len(gxs) != len(self.target):
            return False

        def bid(a):
            return by_id.get(id(a), MISSING)

        gy = tuple(None if g is None or g.raw_array is None else
                   bid(g.raw_array) for g in grad_outputs)
        gx = tuple(None if g is None or g.raw_array is None else
                   bid(g.raw_array) for g in gxs)
        retained_in = [(i, bid(func.inputs[i].data))
                       for i in func._input_indexes_to_retain or ()]
        retained_out = [bid(a) for a in func._retained_output_data or ()]
        if MISSING in gy + gx + tuple(b for _, b in retained_in) + \
                tuple(retained_out):
            return False
        self.gy, self.gx = gy, gx
        self.retained_in, self.retained_out = retained_in, retained_out
        return True


class Recording(object):
    """Buffers and ops of one call, forward then backward."""

    def __init__(self, chain):
        self.chain = chain
        self.buffers = {}
        self.by_id = {}
        self.arrays = []          # keeps recorded arrays alive (ids unique)
        self.forward_ops = []
        self.backward_ops = []
        self.phase = 'forward'
        self.depth = 0
        self.reasons = []
        self.unknown = []         # (buffer id, phase, kind, source)
        self.traced_views = {}    # id(view) -> plain array
        self.handed_out = {}      # id(array) -> (array, copy when traced)
        self.chain_held = set()   # ids of the links' array attributes
        self.reports = []         # (observer, [(key, buffer id | const)])
        self.pending_backward_consts = []   # checked once captures are known
        self.held = set()         # buffers some node attribute refers to
        self.steps = []           # BackwardStep per node backward() call
        self.backward_label = None
        self.labels = {}          # id(forward node) -> its source
        # buffer id -> ids of the Variables that handed its array to ops
        # (None: handed as a raw array, from ``.array`` or an attribute)
        self.input_sources = {}
        # memory user code allocated with CuPy in the forward pass, outside
        # Chainer functions (device_reads): arrays computed from values
        self.user_made = set()
        # ids of arrays user code made from Python values alone
        # (numpy.arange(n)): constants of the key, uniform or not
        self.shape_made = {}
        self.alloc_hook = None

    # -- buffers ------------------------------------------------------------
    def new_buffer(self, array, role, name=None):
        bid = len(self.buffers)
        if type(array) is _ndarray:   # most (every op's results come here)
            shape, dtype = array.shape, array.dtype
        else:
            shape = getattr(array, 'shape', ())
            dtype = getattr(array, 'dtype', None)
            if dtype is None:   # a Python number (analysis.scalar_state)
                dtype = numpy.asarray(array).dtype
        self.buffers[bid] = _Buffer(bid, shape, dtype, role, name, False,
                                    array)
        self.by_id[id(array)] = bid
        self.arrays.append(array)
        return bid

    def buffer_of(self, array, kind=None):
        bid = self.by_id.get(id(array))
        if bid is None:
            bid = self.new_buffer(array, ir.CONST)
            self.unknown.append((bid, self.phase, kind, self._source()))
        return bid

    def add_reason(self, reason):
        if reason not in self.reasons:
            self.reasons.append(reason)

    def _source(self):
        if self.phase == 'forward':
            return traced.user_location(3)
        return self.backward_label

    # -- tracing of raw arrays handed to user code ----------------------------
    def trace(self, array):
        view = array.view(traced.TracedArray)
        self.traced_views[id(view)] = array
        self.arrays.append(view)
        if id(array) not in self.handed_out:
            self.handed_out[id(array)] = (array, array.copy())
        return view

    def is_recorded(self, array):
        """Is ``array`` (or what it is a view of) an array of this
        recording?"""
        while array is not None:
            if id(array) in self.by_id or id(array) in self.chain_held:
                return True
            array = getattr(array, 'base', None)
        return False

    def check_writes(self):
        """Did user code change an array it was handed (an input, one read
        through ``Variable.array``) in place? Then replay, which does not
        run that code, would not repeat the write."""
        for array, before in self.handed_out.values():
            if _changed(before, array):
                self.add_reason(
                    'user code changed the values of an array it was handed '
                    '(an input, one read through Variable.array or an array '
                    'attribute of a link) in place; replay would not repeat '
                    'the write')
                break
        self.handed_out = {}

    def _untrace(self, a, kind):
        if not isinstance(a, traced.TracedArray):
            return a
        base = self.traced_views.get(id(a))
        if base is not None:
            return base
        plain = traced.plain(a)
        if self._view_of_buffer(plain):
            # x[:, None], x[::-1], a reshape: the recorded view, whose base
            # replay keeps static, shows every call's values.
            return plain
        self.add_reason(
            'an array computed with NumPy from input or Variable values '
            'enters %s at %s; replay would freeze it (use Chainer '
            'functions instead)' % (kind, traced.user_location(3)))
        return plain

    def _view_of_buffer(self, a):
        root = root_of(a)
        return root is not a and (id(root) in self.by_id or
                                  id(root) in self.chain_held)

    def _check_device_computed(self, kind, a):
        """The CuPy counterpart of ``_untrace`` for a node's attribute."""
        if self.computed_on_device(a) and id(a) not in self.by_id and \
                not self._view_of_buffer(a):
            self.add_reason(device_reads.computed_reason(
                kind, traced.user_location(1)))

    def _check_nested(self, kind, value):
        """Arrays held inside a node's tuple or list attribute (GetItem's
        ``slices``): a view of a recorded buffer is seen like any, one
        computed from values is not, and a boolean mask decides the shape
        of the result."""
        for x in value:
            if type(x) in (tuple, list):
                self._check_nested(kind, x)
            elif isinstance(x, traced.TracedArray):
                if x.dtype == numpy.bool_:
                    self.add_reason(
                        '%s indexes with a boolean mask from the data at '
                        '%s: the shape of its result depends on the '
                        'values' % (kind, traced.user_location(4)))
                else:
                    self._untrace(x, kind)
            elif self.user_made:
                self._check_device_computed(kind, x)

    # -- hooks ----------------------------------------------------------------
    def on_apply(self, node, inputs):
        # The hot path of recording (every op, forward and backward): kept
        # to plain loops and dict lookups.
        cls = type(node)
        info = _type_info.get(cls)
        if info is None:
            info = _type_info[cls] = _describe_type(node)
        kind, user_defined, side_effects, pure = info
        if kind is None:      # old-style Function: per wrapped class
            kind, user_defined, side_effects, pure = _describe_type(
                node._function)
            d = AdapterAttrs(node)
        else:
            d = node.__dict__
        if side_effects:
            self.add_reason('%s declares side effects '
                            '(static_graph_side_effects = True)' % kind)
        inputs = tuple(inputs)
        in_arrays = []
        sources = []
        TracedArray = traced.TracedArray
        traced_seen = False
        for x in inputs:
            if isinstance(x, _Variable):
                a = x._data[0]
                sources.append(id(x))
            else:
                a = x
                sources.append(None)
            if isinstance(a, TracedArray):
                traced_seen = True
            in_arrays.append(a)
        if traced_seen:
            fixed = []
            for x, a in zip(inputs, in_arrays):
                if isinstance(a, TracedArray):
                    a = self._untrace(a, kind)
                    if isinstance(x, _Variable):
                        x.array = a
                    else:
                        x = a
                fixed.append(x)
            inputs = tuple(fixed)
            in_arrays = [x._data[0] if isinstance(x, _Variable) else x
                         for x in inputs]
        # Ops defined outside Chainer are unknown: make sure they leave their
        # inputs alone (a mutation would not be repeated faithfully).
        check = None
        if user_defined and not pure:
            check = [(a, a.copy()) for a in in_arrays
                     if isinstance(a, numpy.ndarray)]
        pre = d.copy()
        for k, v in pre.items():
            t = type(v)
            if t is TracedArray:
                # Handed to the constructor, not as an input (F.where's
                # condition): a view of a buffer is fine, derived is not.
                d[k] = pre[k] = self._untrace(v, kind)
            elif t is tuple or t is list:
                self._check_nested(kind, v)
            elif self.user_made:
                self._check_device_computed(kind, v)
        self.depth += 1
        try:
            outs = _orig_apply(node, inputs)
        finally:
            self.depth -= 1
        if check:
            for a, before in check:
                if _changed(before, a):
                    self.add_reason(
                        '%s (defined outside Chainer) modifies its inputs '
                        'in place at %s' % (kind, traced.user_location(2)))
                    break
        self._record(node, kind, in_arrays, outs, pre, sources, d)
        return outs

    def _record(self, node, kind, in_arrays, outs, pre, sources, post):
        nones = ()
        for i, a in enumerate(in_arrays):
            if a is None:
                nones += (i,)
            elif type(a) is not _ndarray and not is_array(a):
                self.add_reason('%s got a %s input'
                                % (kind, type(a).__name__))
                return
        if nones:
            sources = [v for v, a in zip(sources, in_arrays) if a is not None]
            in_arrays = [a for a in in_arrays if a is not None]
        by_id = self.by_id
        in_ids = []
        input_sources = self.input_sources
        for a, v in zip(in_arrays, sources):
            b = by_id.get(id(a))
            if b is None:
                b = self.buffer_of(a, kind)
            in_ids.append(b)
            known = input_sources.get(b)
            if known is None:
                input_sources[b] = {v}
            else:
                known.add(v)
        new_buffer = self.new_buffer
        out_arrays = [y._data[0] for y in outs]
        out_ids = [new_buffer(a, _TEMP) for a in out_arrays]
        # The attributes the forward set or replaced, in the node's order.
        changed = post.keys() - _APPLY_KEYS
        if changed:
            changed = [k for k in post if k in changed and
                       pre.get(k, MISSING) is not post[k]]
        state = []
        restore = []
        if changed:
            seen = None
            for k in changed:
                v = post[k]
                restore.append((k, pre.get(k, MISSING)))
                if not is_array(v):
                    continue
                if seen is None:
                    seen = {id(a) for a in in_arrays}
                    seen.update([id(a) for a in out_arrays])
                if id(v) not in seen:
                    bid = self.new_buffer(v, ir.STATE,
                                          name='%s.%s' % (kind, k))
                    state.append((k, bid))
                    out_ids.append(bid)
        n_out = len(out_ids)
        select = _RANGES[n_out] if n_out < len(_RANGES) else \
            tuple(range(n_out))
        if pre and len(pre) > len(post) - len(changed):
            for k in pre:
                if k not in post and k not in _APPLY_KEYS:
                    restore.append((k, pre[k]))
        op = RecordedOp(node, kind, tuple(in_ids), tuple(out_ids), select,
                        state, restore, self._source(), None)
        op.nones = nones
        if self.phase == 'forward':
            self.forward_ops.append(op)
        else:
            self.backward_ops.append(op)

    def on_backward_step(self, func, target, grad_outputs, returned, start):
        if len(returned) == 1:   # not backward_accumulate: left as recorded
            gxs, end = returned[0]
            self.steps.append(BackwardStep(func, tuple(target), grad_outputs,
                                           gxs, start, end,
                                           self.backward_label))

    def on_report(self, values, observer):
        if self.phase != 'forward':
            return
        items = []
        for k, v in values.items():
            if isinstance(v, chainer.Variable):
                if chainer.config.keep_graph_on_report and \
                        v.creator is not None:
                    self.add_reason(
                        'it reports a Variable (%s) under keep_graph_on_report'
                        '=True; replay reports its value without the graph'
                        % k)
                v = v.raw_array
            if isinstance(v, traced.TracedArray):
                v = self._untrace(v, 'chainer.report')
            if is_array(v):
                items.append((k, 'buffer', self.buffer_of(v, 'report')))
            else:
                items.append((k, 'const', v))
        self.reports.append((observer, items))

    # -- activation -----------------------------------------------------------
    def __enter__(self):
        if current() is not None:
            raise RuntimeError('a recording is already active in this thread')
        install()
        _local.recording = self
        self.alloc_hook = device_reads.allocation_hook(self)
        if self.alloc_hook is not None:
            self.alloc_hook.__enter__()
        return self

    def __exit__(self, *exc):
        if self.alloc_hook is not None:
            self.alloc_hook.__exit__(None, None, None)
            self.alloc_hook = None
        _local.recording = None
        uninstall()
        return False

    def computed_on_device(self, a):
        """Was CuPy array ``a`` computed by user code during this call
        (device_reads.allocation_hook)? Replay would freeze it."""
        return bool(self.user_made) and type(a) is not numpy.ndarray and \
            is_array(a) and device_reads.memory_of(a) in self.user_made
