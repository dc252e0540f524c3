"""From a finished Recording to schedules: classify arrays, find captures.

Two questions decide how replay treats a buffer:

* What is an array that no recorded op produced? A parameter or persistent
  value of the chain (looked up by identity), a view of a recorded buffer, or
  a constant. In the forward pass a constant that is not uniform (all
  elements equal) was most likely computed from data outside Chainer
  functions, so the call falls back instead of freezing it.
* Is a buffer *captured*: does any recorded node hold a reference to it (a
  backward node built with ``self.mask``, ``self.y``, ``self.indexes``...)?
  Captured buffers become static: replay writes into the recorded array, so
  every holder sees the current iteration's values. All other buffers are
  rebound to fresh results at no cost.
"""
import numpy

import chainer
from chainer import function_node

from schedules import ir
from static_graph import arrayutil
from static_graph import device_reads
from static_graph import node_attrs
from static_graph import recorder
from static_graph import unowned
from static_graph import user_nodes

SCAN_DEPTH = 4
# Buffers whose arrays are new on every call (not the chain's, not
# constants): a reference to one must be refreshed (static) or rebound.
_PER_CALL_ROLES = unowned.PER_CALL_ROLES
_SKIP_TYPES = (type, type(numpy), type(len))   # and links (is_link)
# Attribute values that hold no array, node or number of interest.
_ATOMIC = frozenset((type(None), bool, int, str, bytes))
_NOTHING = frozenset()


def own_attrs(d):
    """(key, value) of a node's attributes other than those
    FunctionNode.apply manages, and other than plain ints, bools, strings
    and None: what ``mark_captured`` looks at, in the node's order."""
    skip = recorder.APPLY_KEYS
    return [(k, v) for k, v in d.items()
            if type(v) not in _ATOMIC and k not in skip]


def held_arrays(link):
    """(name, array) of the NumPy array attributes of ``link`` that are
    neither parameters nor persistents: constants of the chain while they
    are not replaced (a positional encoding, a causal mask)."""
    persistent = getattr(link, '_persistent', ())
    return [(k, v) for k, v in link.__dict__.items()
            if type(v) is numpy.ndarray and k not in persistent]


def chain_arrays(chain, written=(), held=None):
    """id(array) -> (role, path, owner, attr) for params, persistents and
    the links' other NumPy array attributes (a positional encoding, a causal
    mask, class weights), except those in ``written``, the (id(__dict__),
    name) pairs the method itself assigned. The last are constants of the
    chain, handed to the method traced (decorator._trace_held_arrays), so a
    write into one is caught; replay reads the same array object, so a
    change in place between calls shows; one replaced is a new recording
    (Entry.matches)."""
    from static_graph import link_state
    found = {}
    if held is None:
        held = link_state.held_links(chain)
    # (A link held other than as a child, a teacher kept outside
    # init_scope: its parameters are the call's too, read also where no
    # graph reaches them, under no_backprop_mode.)
    for path, param in _params_with_held(chain, held):
        if param.array is not None and id(param.array) not in found:
            found[id(param.array)] = (ir.PARAM, path, param, None)
    for path, link in list(chain.namedlinks()) + held:
        d = link.__dict__
        items = [(name, d.get(name), ir.PERSIST)
                 for name in getattr(link, '_persistent', ())]
        items += [(name, value, ir.CONST) for name, value in
                  held_arrays(link) if (id(d), name) not in written]
        for name, value, role in items:
            if arrayutil.is_array(value) and id(value) not in found:
                found[id(value)] = (role, path.rstrip('/') + '/' + name,
                                    link, name)
    return found


def _params_with_held(chain, held):
    """(path, Parameter) of the chain's parameters, then those of the
    links ``held`` (link_state.held_links: each with the links under it,
    so only its own here)."""
    out = list(chain.namedparams())
    for path, link in held:
        out.extend((path.rstrip('/') + q, param) for q, param in
                   link.namedparams(include_uninit=False)
                   if '/' not in q[1:])
    return out


def shared_parameter_arrays(chain, rec, params, held=None):
    """Parameters of ``chain`` that hold the array of another, one the
    recording read, as [(the path of the one in ``params``, the other's
    path, buffer id, the other Parameter)]. Recorded buffers are arrays
    by identity: classify_unknown gave the buffer to one of them only."""
    from static_graph import link_state
    claimed = dict((b, path) for b, path, _ in params)
    mine = set(id(p) for _, _, p in params)
    out = []
    # (Also of a link held other than as a child: ``t.W.array =
    # self.l.W.array`` on a link kept outside init_scope.)
    if held is None:
        held = link_state.held_links(chain)
    for path, param in _params_with_held(chain, held):
        b = rec.by_id.get(id(param.array))
        if b in claimed and id(param) not in mine:
            mine.add(id(param))
            out.append((claimed[b], path, b, param))
    return out


def _shape_derived(a):
    """What Chainer's backward code builds from shapes, not from values:
    small integer vectors (split indices, sizes) and single-element arrays
    (``xp.zeros(())`` in ``F.where``'s backward). Treated as constants; a
    larger array, even uniform, may be a data mask."""
    return a.dtype.kind in 'iu' and a.ndim <= 1 or a.size <= 1


def classify_unknown(rec, chain_map):
    """Settle the role of every array no op produced. Returns param buffers
    as [(buffer id, path, Parameter)] and persist as [(id, path, array)]."""
    params, persists = [], []
    unknown, rec.unknown = rec.unknown, []
    grads = None
    siblings = unowned.lazy_views(rec)
    for bid, phase, kind, source in unknown:
        buf = rec.buffers[bid]
        a = buf.storage
        hit = chain_map.get(id(a))
        if hit is not None:
            role, path, owner, attr = hit
            buf.role = role
            buf.name = path
            if role == ir.PARAM:
                params.append((bid, path, owner))
            elif role == ir.PERSIST:
                persists.append((bid, path, a))
            continue
        root = arrayutil.root_of(a)
        if root is not a and chain_map.get(id(root), (None,))[0] in (
                ir.CONST, ir.PARAM):
            # A view of the chain's memory (self.pe[:n]): current values.
            buf.name = 'view of ' + chain_map[id(root)][1]
            continue
        rbid = rec.by_id.get(id(root)) if root is not a else None
        if rbid is None and root is not a:
            # Memory a recorded buffer shows without owning it (a 0-d
            # loss, a view of the sum Chainer computed): the very same
            # view follows that buffer; another part of it would be frozen.
            # (Only buffers made before this one entered the recording:
            # a later one showing that memory, F.broadcast_to's result,
            # is a view of this array, not where its values came from.)
            rbid, shown = unowned.shown_by(rec, siblings(), a, root, bid)
            if rbid is None and shown:
                rec.add_reason(
                    'an array that shares memory with %%%d, a result of '
                    'this call, enters %s at %s; replay would freeze it'
                    % (shown[0], kind, source))
                buf.name = buf.name or 'const'
                continue
        if rbid is not None and rec.buffers[rbid].role in _PER_CALL_ROLES:
            # A view of a recorded buffer: keep the recorded view, make its
            # base static so the view always shows current values.
            rec.buffers[rbid].static = True
            buf.name = 'view of %%%d' % rbid
            continue
        if grads is None:
            grads = _parameter_gradients(chain_map)
        path = grads.get(id(a), grads.get(id(root)))
        if path is not None:
            # Not a constant even where it is uniform (the NaN a fresh
            # gradient holds, zeros after zerograds): a new array, or new
            # values, at every step.
            rec.add_reason(
                'it reads the gradient of %s (%s at %s); replay would '
                'freeze it' % (path, kind, source))
            buf.name = buf.name or 'const'
            continue
        if phase != 'forward':
            # Even a uniform one: a mask that is all True at recording
            # (every element inside a clip range) need not be later.
            rec.pending_backward_consts.append((a, kind, source, bid))
        elif rec.computed_on_device(a):
            rec.add_reason(device_reads.computed_reason(kind, source))
        elif not arrayutil.uniform(a) and id(arrayutil.root_of(a)) not in \
                rec.shape_made and id(a) not in rec.shape_made:
            rec.add_reason(
                'an array not produced by a Chainer function enters %s '
                'at %s; replay would freeze its recorded value'
                % (kind, source))
        buf.name = buf.name or 'const'
    return params, persists


def _parameter_gradients(chain_map):
    """id(gradient array) -> path of the parameters in ``chain_map``."""
    out = {}
    for role, path, owner, _ in chain_map.values():
        if role == ir.PARAM:
            try:
                g = owner.grad
            except RuntimeError:     # (not valid: none to read either)
                continue
            if g is not None:
                out[id(g)] = path
    return out


def scan(obj, depth, arrays, nodes):
    if arrayutil.is_array(obj):
        arrays.append(obj)
        return
    if depth == 0 or obj is None or isinstance(obj, (str, bytes, int, float)):
        return
    if isinstance(obj, (list, tuple, set, frozenset)):
        for o in obj:
            scan(o, depth - 1, arrays, nodes)
    elif isinstance(obj, dict):
        for o in obj.values():
            scan(o, depth - 1, arrays, nodes)
    elif isinstance(obj, function_node.FunctionNode):
        nodes.append(obj)
    elif isinstance(obj, chainer.Variable):
        arrays.append(obj.raw_array)
    elif isinstance(obj, chainer.variable.VariableNode):
        data = getattr(obj, '_data', None)
        if data is not None:
            arrays.append(data)
    elif isinstance(obj, _SKIP_TYPES) or arrayutil.is_link(obj) or \
            callable(obj) and not hasattr(obj, '__dict__'):
        return
    elif hasattr(obj, '__dict__'):
        scan(vars(obj), depth - 1, arrays, nodes)


def _rebindable(rec, op, v):
    """Is attribute value v exactly a recorded buffer's array (not one of
    the op's own outputs) that replay can pass in afresh?"""
    if not arrayutil.is_array(v):
        return False
    bid = rec.by_id.get(id(v))
    return bid is not None and bid not in op.outputs and \
        rec.buffers[bid].role in _PER_CALL_ROLES


def _scalar_keys(op):
    """The attributes op's forward set to a scalar (``self._coeff``)."""
    d = node_attrs.attrs(op.node)
    return [k for k, _ in op.restore
            if arrayutil.is_scalar_value(d.get(k, arrayutil.MISSING))]


def forward_scalars(rec):
    """id(value) -> (forward op, attribute) for the scalars each recorded
    forward set on its node (``self._coeff = ...``): values of this call
    that a backward node may have been built with."""
    out = {}
    for op in rec.forward_ops:
        if not op.restore:      # (it set nothing)
            continue
        d = node_attrs.attrs(op.node)
        for k in _scalar_keys(op):
            out.setdefault(id(d[k]), (op, k))
    return out


def scalar_state(rec, fop, key):
    """The buffer through which forward op ``fop`` hands the scalar it sets
    on ``key`` to later ops: added to its state (returned after its results
    by every replay, like a dropout mask) on first use."""
    for k, b in fop.state:
        if k == key:
            return b
    bid = rec.new_buffer(node_attrs.attrs(fop.node)[key], ir.STATE,
                         name='%s.%s' % (fop.kind, key))
    n_results = len(fop.outputs) - len(fop.state)
    fop.state.append((key, bid))
    fop.outputs = fop.outputs + (bid,)
    fop.select = fop.select + (n_results + len(fop.state) - 1,)
    return bid


def mark_captured(rec, chain_map):
    """Mark static every buffer some recorded node holds a reference to.

    An array a backward node holds (or takes as input) that is no recorded
    buffer, no parameter and no constant the forward already held was
    computed by Python code in a ``backward()`` method (a mask such as
    ``x1 >= x2``): replay would freeze it, so the recording falls back.

    A scalar a backward node was built with that is (by identity) one a
    forward set on its node in this call is handed to it afresh by every
    replay, like a captured array (``forward_scalars``).
    """
    ops = rec.forward_ops + rec.backward_ops
    scalars = forward_scalars(rec)
    by_node = {id(op.node): op for op in ops}
    n_forward = len(rec.forward_ops)
    step_of = rec.step_of()

    def reruns_ok(step):
        """Can this step be replayed by calling its backward() again?"""
        return id(step.node) in by_node and \
            by_node[id(step.node)] in rec.forward_ops and \
            step.resolve(rec.by_id)

    def python_array(j, reason):
        """Backward op j depends on an array computed in Python: its step
        replays by calling the node's backward() again, or, where that
        cannot be done, the recording falls back."""
        step = step_of.get(j)
        if step is not None and reruns_ok(step):
            step.rerun = True
        else:
            rec.add_reason(reason)
    user_nodes.rerun_scalar_steps(rec, reruns_ok)
    user_nodes.rerun_communicating_steps(rec, reruns_ok)
    forward_consts = set()
    # NumPy scalars forward nodes were built with (``x * numpy.float32(2)``):
    # constants a backward node may be built with too. Filled while the
    # forward ops are visited, before any backward op reads it.
    forward_numbers = set()
    referenced = set()   # ids of nodes another node holds
    siblings = unowned.lazy_views(rec)
    for i, op in enumerate(ops):
        # What the forward itself sets (self.x = x) is refreshed by every
        # replay; what the node was constructed with (ctor arguments) is a
        # reference that must see current values, even to its own input.
        set_by_forward = {k for k, _ in op.restore} if op.restore else \
            _NOTHING
        arrays, nodes = [], []
        d = node_attrs.attrs(op.node)
        for k, pre in list(op.restore) if op.restore else ():
            # What the node was built with and its forward replaced
            # (GroupNormalization's _XHatGrad takes ``x_hat`` and sets it
            # to None): every replay restores it before the forward, so it
            # is held like any attribute; an array of this call is handed
            # in afresh instead of restoring the recorded one.
            if pre is arrayutil.MISSING or d.get(k, arrayutil.MISSING) is pre:
                continue
            if i >= n_forward and _rebindable(rec, op, pre):
                op.rebind.append((k, rec.by_id[id(pre)]))
                op.restore = [(kk, v) for kk, v in op.restore if kk != k]
                continue
            found = []
            scan(pre, SCAN_DEPTH, found, nodes)
            arrays.extend((a, False) for a in found)
        attrs = own_attrs(d)
        if i < n_forward and attrs:
            forward_numbers.update([
                id(v) for k, v in attrs
                if isinstance(v, numpy.generic) and k not in set_by_forward])
        for k, v in attrs:
            if i >= n_forward and k not in set_by_forward and \
                    _rebindable(rec, op, v):
                # A backward node built with a recorded array (ReLUGrad2's
                # ``b = y``): replay hands it the current one as an extra
                # input, so the buffer need not be static.
                op.rebind.append((k, rec.by_id[id(v)]))
                continue
            if i >= n_forward and k not in set_by_forward and \
                    id(v) in scalars and arrayutil.is_scalar_value(v):
                # Built with a number the forward computed this call
                # (SoftmaxCrossEntropyGrad's ``coeff``): the same, for the
                # forward's current value.
                fop, key = scalars[id(v)]
                op.rebind.append((k, scalar_state(rec, fop, key)))
                continue
            if i >= n_forward and k not in set_by_forward and \
                    arrayutil.numpy_number(v) and id(v) not in forward_numbers:
                # A NumPy number made in a backward() (``1 / self.std``):
                # like a mask built in Python.
                python_array(
                    i - n_forward,
                    'the backward of %s computes a number in Python (held '
                    'by %s) from values that replay would freeze'
                    % (op.source or 'an op', op.kind))
                continue
            if type(v) is float:
                continue
            found = []
            scan(v, SCAN_DEPTH, found, nodes)
            if found:
                refreshed = k in set_by_forward
                arrays.extend([(a, refreshed) for a in found])
        own = None
        for a, refreshed in arrays:
            if a is None:
                continue
            bid, shown = unowned.held_buffer(rec, a, siblings)
            if bid is None:
                if id(a) in chain_map or id(arrayutil.root_of(a)) in chain_map:
                    continue
                if shown and i < n_forward:
                    rec.add_reason(
                        '%s holds an array that shares memory with %%%d, a '
                        'result of this call (a part of it), at %s; replay '
                        'would freeze it' % (op.kind, shown[0],
                                             op.source or 'an op'))
                    continue
                if i < n_forward:
                    forward_consts.add(id(a))
                elif id(a) not in forward_consts and not _shape_derived(a):
                    python_array(
                        i - n_forward,
                        'the backward of %s computes an array in Python '
                        '(held by %s) from values that replay would freeze'
                        % (op.source or 'an op', op.kind))
                continue
            # Read through the attribute, not as an op input: replay must
            # never write into it (lower_pass donations).
            rec.held.add(bid)
            if refreshed:
                if own is None:
                    own = set(op.inputs)
                    own.update(op.outputs)
                if bid in own:
                    continue
            buf = rec.buffers[bid]
            if buf.role in _PER_CALL_ROLES:
                buf.static = True
        for node in nodes:
            other = by_node.get(id(node))
            if other is not None and other is not op:
                # It may read the other node's state live: keep it static.
                for _, bid in other.state:
                    rec.buffers[bid].static = True
                referenced.add(id(node))
    for op in rec.backward_ops:
        if op.rebind and id(op.node) in referenced:
            # Another node may read the attribute between replays: keep
            # the recorded reference and the buffer static instead.
            for _, bid in op.rebind:
                rec.buffers[bid].static = True
            op.rebind = []
    for b, buf in rec.buffers.items():
        if buf.static and not arrayutil.is_array(buf.storage):
            # A number cannot be refreshed in place for a node that reads
            # it through another node.
            rec.add_reason(
                'a node reads %s, a number computed from the data, through '
                'another node; replay could not refresh it' % buf.name)
    promote_view_roots(rec)
    returned_by = _returned_by(rec)
    for a, kind, source, bid in rec.pending_backward_consts:
        step = returned_by.get(id(a))
        if step is not None and id(a) not in forward_consts:
            # A gradient a backward() computed in Python and returned (an
            # old-style chainer.Function's backward_cpu, F.hinge): that
            # step runs again at replay and makes it afresh.
            if reruns_ok(step):
                step.rerun = True
                step.python_made.add(bid)
                rec.buffers[bid].role = ir.TEMP
                rec.buffers[bid].name = None
            else:
                rec.add_reason(
                    'the backward of %s computes a gradient in Python that '
                    'replay could not compute again' % (step.label or 'an op'))
            continue
        if id(a) not in forward_consts and not _shape_derived(a):
            reason = ('the backward of %s feeds %s an array computed in '
                      'Python from values that replay would freeze'
                      % (source or 'an op', kind))
            users = [j for j, op in enumerate(rec.backward_ops)
                     if bid in op.inputs]
            for j in users or [None]:
                python_array(j, reason)
    # A backward() that changes an array its forward made in place and
    # returns it as a gradient (connectionist_temporal_classification
    # scales its softmax output so): the schedule would hand back the
    # forward's values.
    forward_made = set(b for op in rec.forward_ops for b in op.outputs)
    made_ids = set(id(rec.buffers[b].storage) for b in forward_made)
    for step in rec.steps:
        if step.raw is not None:
            for g in step.raw[1]:
                if id(getattr(g, 'raw_array', None)) in made_ids:
                    break
            else:
                continue   # returned no array the forward made
        if not step.resolve(rec.by_id):
            continue
        made = set(b for op in rec.backward_ops[step.start:step.end]
                   for b in op.outputs)
        for b in step.gx:
            if b is not None and b in forward_made and b not in made and \
                    b not in step.gy:
                rec.add_reason(
                    'the backward of %s returns as a gradient an array its '
                    'forward made (%s), changed in place; replay would hand '
                    'back the forward\'s values'
                    % (step.label or 'an op', rec.buffers[b].name or
                       '%%%d' % b))
    for step in rec.steps:
        if step.rerun:
            # backward() runs again at replay: hand it the numbers its
            # forward computed this call, with the arrays it kept.
            fop = by_node[id(step.node)]
            for key in _scalar_keys(fop):
                scalar_state(rec, fop, key)
    _check_reruns(rec, by_node)


def _returned_by(rec):
    """id(array) -> the BackwardStep whose backward() returned it as a
    gradient (while the recording's arrays are alive)."""
    out = {}
    for step in rec.steps:
        if step.raw is None:
            continue
        for g in step.raw[1]:
            a = getattr(g, 'raw_array', None)
            if a is not None:
                out.setdefault(id(a), step)
    return out


def _check_reruns(rec, by_node):
    """A step replayed by calling backward() again must touch nothing but
    what that call is handed (the output gradients, the node's retained
    arrays and state, the chain's arrays, constants, the forward's static
    buffers: refreshed before any backward step, a node holding one,
    ModifiedXLogX's ``_logx``, reads this call's) and leave behind nothing
    but the gradients it returns; otherwise the recording falls back."""
    steps = [s for s in rec.steps if s.rerun]
    if not steps:
        return
    bufs = rec.buffers
    inside = {}
    for step in steps:
        for op in rec.backward_ops[step.start:step.end]:
            for b in op.outputs:
                inside[b] = step
    for j, op in enumerate(rec.backward_ops):
        for b in op.inputs:
            step = inside.get(b)
            if step is not None and not step.start <= j < step.end and \
                    b not in step.gx:
                step.rerun = False
    for b in rec.held:
        step = inside.get(b)
        if step is not None and b not in step.gx:
            step.rerun = False
    forward_static = set(b for op in rec.forward_ops
                         for b in op.outputs + op.inputs if bufs[b].static)
    for step in steps:
        fop = by_node[id(step.node)]
        given = set(b for b in step.gy if b is not None)
        given.update(forward_static)
        given.update(b for _, b in step.retained_in)
        given.update(step.retained_out)
        given.update(b for _, b in fop.state)
        made = set(step.python_made)
        for op in rec.backward_ops[step.start:step.end]:
            for b in op.inputs:
                if b not in made and b not in given and \
                        bufs[b].role not in (ir.PARAM, ir.PERSIST, ir.CONST):
                    step.rerun = False
            made.update(op.outputs)
        if any(b is not None and b not in made for b in step.gx):
            step.rerun = False    # hands back an array it did not make
        if not step.rerun:
            rec.add_reason(
                'the backward of %s computes an array in Python and reads '
                'or leaves arrays that calling it again at replay would not '
                'see' % (step.label or 'an op'))


def promote_view_roots(rec):
    """A captured buffer that is a view of a recorded buffer follows its
    base: the base becomes static, so replay refreshes the memory the view
    shows (a view may be read-only, as ``broadcast_to`` gives, and is never
    written itself)."""
    for buf in list(rec.buffers.values()):
        a = buf.storage
        if not buf.static or a is None:
            continue
        root = arrayutil.root_of(a)
        if root is a:
            continue
        rbid = rec.by_id.get(id(root))
        if rbid is not None and rec.buffers[rbid].role in _PER_CALL_ROLES:
            rec.buffers[rbid].static = True
