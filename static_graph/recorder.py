"""See every FunctionNode application of a call, forward and backward.

While a thread records, ``FunctionNode.apply`` is wrapped: each application
becomes a ``RecordedOp`` over buffers (arrays identified by object identity),
together with the node's hidden state (arrays the forward left on ``self``)
and the attributes the forward changed (restored before each replay, so a
node such as Dropout draws a fresh mask instead of reusing the old one).
The wrappers are installed only while some recording is under way (from
its forward to the end of its recorded backward); calls of other threads,
and of this one between the two passes, pass straight through.
"""
import weakref

import numpy

import chainer
from chainer import configuration

from schedules import ir
from static_graph import apply_reasons
from static_graph import arrayutil
from static_graph import device_reads
from static_graph import key_constants
from static_graph import patches
from static_graph import places
from static_graph import reports
from static_graph import traced
from static_graph import unowned
from static_graph.key_constants import KeyConstant
from static_graph.arrayutil import MISSING, is_array, root_of
from static_graph.node_attrs import AdapterAttrs
from static_graph.patches import current  # NOQA  (recorder.current())

# Attributes FunctionNode.apply manages itself; never state, never restored.
APPLY_KEYS = frozenset((
    '_input_indexes_to_retain', '_output_indexes_to_retain',
    '_retained_output_data', 'inputs', 'outputs', 'rank', '_input_layouts',
    '_output_layouts', 'stack', 'chainerx_device',
    '_is_chainerx_fallback_mode', 'lazy_grad_sum', '_n_local_function_hooks',
    '_local_function_hooks', '_output_count',
))

_config = configuration.config


_Variable = chainer.Variable
# What a FunctionNode class is, on the class itself (a table keyed by the
# class kept every class a notebook cell defines again alive): (kind, user
# defined, side effects, declared pure); kind None for old-style Function
# adapters.
_TYPE_INFO = places.TYPE_INFO
_refused = weakref.WeakKeyDictionary()   # classes that refuse attributes


def _errstate():
    """NumPy's error state in this thread (``numpy.errstate`` sets it in
    a way ``geterrobj`` does not show on NumPy 1.26)."""
    return numpy.geterr(), numpy.geterrcall()


def _type_info(cls, node):
    info = _refused.get(cls)
    if info is None:
        info = _describe_type(node)
        try:
            setattr(cls, _TYPE_INFO, info)
        except Exception:      # (a metaclass that refuses: kept aside)
            _refused[cls] = info
    return info


def _describe_type(impl):
    if getattr(impl, '_function', None) is not None:
        return (None, False, False, False)
    cls = type(impl)
    module = cls.__module__ or ''
    user_defined = not (module == 'chainer' or module.startswith('chainer.'))
    return (cls.__name__, user_defined,
            bool(getattr(cls, 'static_graph_side_effects', False)),
            bool(getattr(cls, 'static_graph_pure', False)))


def user_defined(node):
    """Is ``node`` (or the old-style Function it adapts) defined outside
    Chainer?"""
    return _describe_type(getattr(node, '_function', None) or node)[1]


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
        # id(an argument's copy) -> the caller's array (what the
        # method's ``x.base``, ``x.flags`` see under define-by-run)
        self.callers = {}
        # (an argument's copy, the caller's array), also of copies that
        # share one memory (kept_memory.argument_memory)
        self.argument_copies = []
        self.container_writes = []   # (link_state.attr_changes)
        # id(an argument Variable's copy) -> (its path, the caller's, it)
        self.argument_paths = {}
        # A backward inside the method moved the recording so far onto the
        # caller's Variables (arguments.onto_caller)
        self.arguments_spliced = False
        # id(a detached leaf) -> the rank of the link's Variable it stands
        # for; -> the array it was made with
        self.detached_from, self.detached_arrays = {}, {}
        self.handed_out = {}      # id(array) -> (array, copy when traced)
        self.chain_held = set()   # ids of the links' array attributes
        self.container_held = set()   # of arrays in watched containers
        self.reports = []         # (observer, [(key, buffer id | const)])
        self.pending_backward_consts = []   # checked once captures are known
        self.held = set()         # buffers some node attribute refers to
        self.steps = []           # BackwardStep per node backward() call
        self.node_values = []     # (node attributes, name): user_nodes
        # Nodes defined outside Chainer whose backward read in Python the
        # values of an array they hold (patches._traced_attributes): their
        # (ids); the node whose backward runs now.
        self.held_reads = set()
        # Reasons taken after the analysis's own (capture._try_build).
        self.late_reasons = []
        self.reading_held = None
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
        # constants of the key ops took: {id: (array, its values then)}
        # (key_constants.check_taken)
        self.constants_taken = {}
        # their memory's values when made: {id(root): (root, copy)}
        self.made_values = {}
        self.call_frame = None    # id of capture._forward's frame
        # ids of traced 0-d arrays that stand for the NumPy scalars a ufunc
        # of 0-d arrays gives (numpy_calls.compute)
        self.scalar_like = set()
        self.scalar_views = []     # (views among them, held: their ids)
        self.alloc_hook = None
        self.carries_state = False   # (link_state.attr_changes)

    def step_of(self):
        """{backward op index: the BackwardStep whose ``backward()`` applied
        it}; the backward ops of no step are the sums of gradient
        contributions backprop made."""
        out = {}
        for step in self.steps:
            for j in range(step.start, step.end):
                out[j] = step
        return out

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
    def trace(self, array, check=True, kind=traced.TracedArray):
        """A traced view of ``array`` for user code; ``check``: compare its
        values after the call (check_writes); ``kind``: TracedArray or a
        subclass."""
        view = array.view(kind)
        self.traced_views[id(view)] = array
        self.arrays.append(view)
        if check and id(array) not in self.handed_out:
            self.handed_out[id(array)] = (array, array.copy())
        return view

    def as_define_by_run(self, view):
        """The array define-by-run's method holds where it holds ``view``,
        a traced view this recording made: the caller's for an argument's
        copy, else the array behind the view; None for another view."""
        array = self.traced_views.get(id(view))
        if array is None:
            return None
        return self.callers.get(id(array), array)

    def is_recorded(self, array):
        """Is ``array`` (or what it is a view of) an array of this
        recording or of its chain?"""
        while array is not None:
            if id(array) in self.by_id or id(array) in self.chain_held \
                    or id(array) in self.container_held:
                return True
            array = getattr(array, 'base', None)
        return False

    def check_writes(self):
        """Did user code change an array it was handed (an input, one read
        through ``Variable.array``) in place? Then replay, which does not
        run that code, would not repeat the write."""
        for array, before in self.handed_out.values():
            if arrayutil.changed(before, array):
                self.add_reason(
                    'user code changed the values of an array it was handed '
                    '(an input, one read through Variable.array or an array '
                    'attribute of a link) in place; replay would not repeat '
                    'the write')
                break
        self.handed_out = {}
        key_constants.check_taken(self)

    def untrace(self, a, kind):
        if not isinstance(a, traced.TracedArray):
            return a
        base = self.traced_views.get(id(a))
        if type(a) is KeyConstant:     # (a constant of the key, or was)
            plain = base if base is not None else traced.plain(a)
            key_constants.entering(self, a, plain, kind)
            return plain
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
                                  id(root) in self.chain_held or
                                  unowned.within_a_buffer(self, a, root))

    def check_device_computed(self, kind, a):
        """The CuPy counterpart of ``untrace`` for a node's attribute."""
        if self.computed_on_device(a) and id(a) not in self.by_id and \
                not self._view_of_buffer(a):
            self.add_reason(device_reads.computed_reason(
                kind, traced.user_location(1)))

    # -- hooks ----------------------------------------------------------------
    def on_apply(self, node, inputs):
        # The hot path of recording (every op, forward and backward): kept
        # to plain loops and dict lookups.
        cls = type(node)
        info = cls.__dict__.get(_TYPE_INFO)
        if info is None:
            info = _type_info(cls, node)
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
        if _config.debug:
            # (Turned on inside the method, or around the recording's
            # backward: its checks are per function, which replay skips.)
            self.add_reason("Chainer's debug mode is on for %s (turned on "
                            'inside the call or around its backward): its '
                            'checks are per function' % kind)
        if self.phase == 'forward' and _errstate() != self.errstate:
            # (``with numpy.errstate(divide='ignore'): F.log(...)`` in the
            # method: replay runs every op under the caller's state.)
            self.add_reason(
                "%s runs under another NumPy error state than the call's "
                '(numpy.errstate or numpy.seterr inside the method); replay '
                "runs it under the caller's" % kind)
        if type(inputs) is not tuple:
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
                    a = self.untrace(a, kind)
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
        held = apply_reasons.held_contents(d) if user_defined else None
        pre = d.copy()
        for k, v in pre.items():
            t = type(v)
            if t is TracedArray or t is KeyConstant:
                # Handed to the constructor, not as an input (F.where's
                # condition): a view of a buffer is fine, derived is not.
                reason = apply_reasons.sizes_from_data(self, kind, k, v)
                if reason is not None:
                    self.add_reason(reason)
                d[k] = pre[k] = self.untrace(v, kind)
            elif t is tuple or t is list:
                v = apply_reasons.nested_arrays(self, kind, v)
                if v is not pre[k]:
                    d[k] = pre[k] = v
            elif self.user_made:
                self.check_device_computed(kind, v)
        self.depth += 1
        try:
            outs = patches.orig_apply(node, inputs)
        except BaseException as e:
            reason = apply_reasons.raised(e, kind, pre, in_arrays)
            if reason is not None:
                self.add_reason('%s at %s; a method that catches it would '
                                'take that branch at every replay'
                                % (reason, traced.user_location(2)))
            raise
        finally:
            self.depth -= 1
        if held:
            reason = apply_reasons.held_changed(held, kind)
            if reason is not None:
                self.add_reason(reason)
        if check:
            for a, before in check:
                if arrayutil.changed(before, a):
                    self.add_reason(
                        '%s (defined outside Chainer) modifies its inputs '
                        'in place at %s' % (kind, traced.user_location(2)))
                    break
        self._record(node, kind, in_arrays, outs, pre, sources, d)
        if user_defined:
            # Its results may be memory it keeps between calls (a buffer it
            # hands out again): replay never writes into them.
            by_id = self.by_id
            self.held.update(by_id[id(y._data[0])] for y in outs
                             if id(y._data[0]) in by_id)
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
        out_arrays = [y._data[0] for y in outs]
        out_ids = []
        buffers, arrays = self.buffers, self.arrays
        for a in out_arrays:
            if type(a) is _ndarray:     # (new_buffer's, inline)
                bid = len(buffers)
                buffers[bid] = _Buffer(bid, a.shape, a.dtype, _TEMP, None,
                                       False, a)
                by_id[id(a)] = bid
                arrays.append(a)
                out_ids.append(bid)
            else:
                out_ids.append(self.new_buffer(a, _TEMP))
        # The attributes the forward set or replaced, in the node's order.
        changed = post.keys() - APPLY_KEYS
        if len(changed) == 1:     # (most often: one constructor argument)
            k, = changed
            changed = [k] if pre.get(k, MISSING) is not post[k] else []
        elif changed:
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
                    reason = apply_reasons.kept_arrays(kind, k, v)
                    if reason is not None:
                        self.add_reason(reason)
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
                if k not in post and k not in APPLY_KEYS:
                    restore.append((k, pre[k]))
        # (_source, inline)
        forward = self.phase == 'forward'
        op = RecordedOp(node, kind, tuple(in_ids), tuple(out_ids), select,
                        state, restore, traced.user_location(2) if forward
                        else self.backward_label, None)
        op.nones = nones
        if forward:
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
        """[(key, code)] of a report of the forward (reports.py), kept for
        replay."""
        items = [(k, reports.encode(self, k, v)) for k, v in values.items()]
        self.reports.append((observer, items))
        return items

    # -- activation -----------------------------------------------------------
    def __enter__(self):
        if current() is not None:
            raise RuntimeError('a recording is already active in this thread')
        self.errstate = _errstate()
        patches.begin(self)
        self.alloc_hook = device_reads.allocation_hook(self)
        if self.alloc_hook is not None:
            self.alloc_hook.__enter__()
        return self

    def __exit__(self, *exc):
        if self.alloc_hook is not None:
            self.alloc_hook.__exit__(None, None, None)
            self.alloc_hook = None
        patches.end()
        return False

    def computed_on_device(self, a):
        """Was CuPy array ``a`` computed by user code during this call
        (device_reads.allocation_hook)? Replay would freeze it."""
        return bool(self.user_made) and type(a) is not numpy.ndarray and \
            is_array(a) and device_reads.memory_of(a) in self.user_made
