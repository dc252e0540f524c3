"""Recording -> schedules: turn a finished recording into an entry's
compiled forward and backward schedules.

The stages, in order (``build``): the recorded applications become IR ops
(``ir_ops``: kernels, views of stable memory skipped, backward steps that
rerun ``backward()``); the forward's buffers the backward reads are saved
for it; cheap activations are computed again in the backward instead
(``schedules.recompute.rematerialize`` with ``recompute_rules``); the
schedules are made and verified by the IR, lowered to cheaper kernels that
may write into dying inputs (``lower_pass.lower``), and wrapped in the
executor's tiers (interpreted, then compiled; CUDA graphs on CuPy,
``graphs``). Then the recording lets go of what only it needed
(``release_recording``).
"""
import functools
import os

import chainer

from schedules import executor
from schedules import ir
from schedules import recompute as schedule_recompute
from static_graph import arrayutil
from static_graph import describe
from static_graph import graphs
from static_graph import kernels
from static_graph import lower_pass
from static_graph import lowering
from static_graph import node_attrs
from static_graph import recompute_rules
from static_graph import recorder
from static_graph import reports as report_codes
from static_graph import signature
from static_graph import split_kernels
from static_graph.link_values import size as _dict_size
from static_graph.entry import (
    COMPLETE, ESCAPE_ROLES, STABLE_ROLES, link_hooks, link_structure)


# Ops whose outputs are views of their input: when the input's memory is
# stable (a parameter, persistent or constant array, or a static buffer) the
# recorded view stays valid, so replay skips the op.
VIEW_KINDS = frozenset((
    'Reshape', 'BroadcastTo', 'Transpose', 'GetItem', 'ExpandDims', 'Squeeze',
    'Swapaxes', 'Moveaxis', 'Rollaxis'))


def stable_roots(bufs):
    """id(array) -> buffer id, for buffers that own their memory and keep
    it across calls (parameters, persistents, constants, static buffers).
    A view of such memory shows current values without being recomputed."""
    out = {}
    for b, buf in bufs.items():
        a = buf.storage
        if (buf.static or buf.role in STABLE_ROLES) and a is not None and \
                arrayutil.root_of(a) is a:
            out.setdefault(id(a), b)
    return out


def _view_once(rop, bufs, roots):
    if rop.kind not in VIEW_KINDS or rop.state:
        return False
    for b in rop.outputs:
        a = bufs[b].storage
        if a is arrayutil.root_of(a) or \
                id(arrayutil.root_of(a)) not in roots:
            return False
    return True


def build(e, rec, chain, n_leaves, leaf_bids, out_bids, out_kinds, out_spec,
          params, persists, grad_in=None, grad_targets=None,
          grad_out_bids=None, attr_writes=(), reports=(),
          link_values=None, recompute=True, plan_memory=True,
          cuda_graph=True, threads=None, keep_nodes=False,
          aliases=None):
    """Turn a finished recording into compiled schedules. recompute:
    let the backward compute cheap activations again instead of saving
    them (recompute_rules.py); plan_memory=False: no memory reuse at
    all (no early frees, no kernel writing into a dying input, nothing
    recomputed), for comparison; cuda_graph: on CuPy, replay each
    schedule as one CUDA graph launch once it has run (graphs.py);
    threads: how many threads a large in-place element-wise kernel may
    be split across (split_kernels.py; None: the cores).
    With ``TRACE`` on, ``e.passes`` holds each stage's schedules as
    text, [(stage, text)]."""
    e.plan_memory = plan_memory
    e.cuda_graph = cuda_graph
    e.threads = threads
    e.passes = [] if TRACE else None
    bufs = rec.buffers
    e.n_leaves = n_leaves
    e.link_values = link_values
    e.params = [p for _, _, p in params]
    param_bids = [b for b, _, _ in params]
    e.param_bids = tuple(param_bids)
    # Each holds the parameter's array as recorded (or as rebound):
    # replay needs a new recording where the Parameter holds another.
    e.param_bufs = tuple(bufs[b] for b in param_bids)
    e.param_rebindable = _rebindable_params(
        bufs, params, rec.held, rec.input_sources)
    # (Not what the method writes, nor the state it reads as an input of
    # each replay: ``self.h`` another method or the caller left.)
    e.structure, e.link_sets = link_structure(
        chain, [w[:2] for w in attr_writes] + list(e.recurrent),
        getattr(link_values, 'held', ()))
    if link_values is not None:
        link_values.held = ()    # (the entry keeps no held link alive)
    # Parameters not initialized at recording (``L.Linear(None, 3)``): one
    # initialized since (its link called outside the method) is a new
    # recording (``if self.t.W.array is not None`` took the other branch).
    e.uninit_params = tuple(
        v for _, _, v, _ in e.structure
        if isinstance(v, chainer.Parameter) and v.raw_array is None)
    e.out_spec = out_spec
    e.node_values = tuple(rec.node_values)
    e.out_kinds = out_kinds
    e.reports = reports
    e.attr_writes = attr_writes
    e.aliases = aliases or {}
    expose = []
    for _, items in reports:
        for _, code in items:
            expose.extend(report_codes.buffers(code))
    expose.extend(w[2] for w in attr_writes if w[2] is not None)
    e.expose = tuple(sorted(set(expose)))
    f_inputs = list(leaf_bids) + param_bids
    backward = grad_targets is not None

    # Stage 1: the recorded applications as IR ops.
    # (The views ir_ops marks static own no memory: the roots stay.)
    roots = stable_roots(bufs)
    fops = ir_ops(rec, rec.forward_ops, roots)
    bops = ir_ops(rec, rec.backward_ops, roots) if backward else None
    forward_defined = set(f_inputs) | set(b for op in fops
                                          for b in op.outputs)
    # Stage 2: what the backward reads of the forward is saved for it...
    saved = _saved_for_backward(bufs, bops, grad_in, forward_defined,
                                param_bids) if backward else []
    _trace(e, 'recorded', bufs, fops, bops, f_inputs, out_bids, saved)
    # ... unless it is cheap to compute again there.
    groups = None
    if saved and recompute and plan_memory:
        groups = lower_pass.memory_groups(bufs)
        recipes = recompute_rules.recipes(
            rec, saved, param_bids,
            set(out_bids) | set(e.expose) | set(grad_in), bops, groups)
        if recipes:
            fops, bops, saved = schedule_recompute.rematerialize(
                bufs, fops, bops, saved, recipes, live=param_bids)
            groups = None     # (it adds buffers over recorded memory)
            _trace(e, 'rematerialize', bufs, fops, bops, f_inputs, out_bids,
                   saved)
    e.saved = tuple(saved)
    # Outputs the backward reads as saved (position in e.saved): where the
    # caller gives one's Variable another array, replay's backward reads
    # that (nodes.replaced_outputs).
    e.saved_outputs = dict((i, e.saved.index(b)) for i, b in
                           enumerate(out_bids) if b in e.saved)

    # Stage 3: the schedules, lowered to cheaper kernels, in their tiers.
    e.forward = ir.Schedule('forward', bufs, fops, f_inputs, out_bids,
                            keep=e.saved + e.expose)
    # Never written in place: what is handed out or saved for backward,
    # and what nodes read through attributes.
    handed_out = set(out_bids) | set(e.expose) | rec.held
    # Which buffers share memory: the same for both schedules (built
    # over one set of buffers, none added from here on).
    if groups is None:
        groups = lower_pass.memory_groups(bufs)
    roots = lower_pass.array_roots(bufs)
    _forward_tier(e, rec, chain, f_inputs, out_bids, forward_defined,
                  handed_out, groups, roots)
    if backward:
        _backward_tier(e, rec, bops, fops, f_inputs, out_bids, grad_in,
                       grad_targets, grad_out_bids, param_bids, handed_out,
                       groups, roots)
    if TRACE:
        e.passes.append(('lowered', _text(e.forward, e.backward)))

    e.link_sizes = tuple((link, _dict_size(link.__dict__),
                          link_hooks(link.__dict__))
                         for link, _, _ in e.link_sets)
    e.global_link_hooks = tuple(chainer._get_link_hooks().values())
    # The recording call's own saved arrays, for a second backward
    # through it (RecordNode.bind takes them at once).
    e.recording_saved = recorded_values(e.forward, e.saved)
    release_recording(rec, keep_nodes)
    e.move(COMPLETE)


# Keep each stage's schedules as text on the entry (``entry.passes``), to
# read what a stage changed; set by tests and by hand, off by default.
TRACE = bool(os.environ.get('STATIC_GRAPH_TRACE_PASSES'))


def _text(*schedules):
    return '\n'.join(str(s) for s in schedules if s is not None)


def _trace(e, stage, bufs, fops, bops, f_inputs, out_bids, saved):
    if not TRACE:
        return
    fwd = ir.Schedule('forward', bufs, list(fops), f_inputs, out_bids,
                      keep=tuple(saved))
    bwd = None if bops is None else ir.Schedule(
        'backward', bufs, list(bops), (), ())
    e.passes.append((stage, _text(fwd, bwd)))


def _saved_for_backward(bufs, bops, grad_in, forward_defined, param_bids):
    """The buffers the forward defines and the backward reads (or hands
    out as a gradient), in the order the backward first needs them;
    static buffers and parameters stay where they are."""
    needed = []
    for op in bops:
        needed.extend(op.inputs)
    needed.extend(b for b in grad_in if b is not None)
    saved, seen = [], set()
    for b in needed:
        if b in forward_defined and b not in seen and \
                not bufs[b].static and b not in param_bids:
            saved.append(b)
            seen.add(b)
    return saved


def _forward_tier(e, rec, chain, f_inputs, out_bids, forward_defined,
                  handed_out, groups, roots=None):
    """Lower the forward schedule and wrap it in its runners."""
    bufs = rec.buffers
    # (The chain's memory, returned as an array: as define-by-run hands it
    # out, arrayutil.chain_alias; other outputs of it are copies.)
    e.out_copy = tuple(e.aliases[b] if b in e.aliases and k == 'A' else
                       bool(e.reused(bufs, b) or
                            bufs[b].role in (ir.PARAM, ir.PERSIST))
                       for b, k in zip(out_bids, e.out_kinds))
    copyto = arrayutil.copyto_for([bufs[b].storage for b in f_inputs] or [])
    e.copyto = copyto
    e.graphs = graphs.wants_graphs(e, copyto)
    if e.graphs is not None:
        # What nodes may update in place besides static buffers
        # (BatchNormalization's running statistics, held by its node).
        e.persistent_arrays = [
            v for link in chain.links()
            for v in (link.__dict__.get(k)
                      for k in getattr(link, '_persistent', ()))
            if arrayutil.is_array(v)]
    lower_pass.lower(e.forward, handed_out | set(e.saved),
                     donate=e.plan_memory, groups=groups, roots=roots,
                     threads=e.threads)
    e.run_forward = executor.TieredSchedule(
        e.forward, copyto, before_compile=lower_pass.lower_ops,
        free=e.plan_memory, copy=arrayutil.copy_exact,
        pair=split_kernels.pairing(e.threads),
        extra_outputs=e.forward.keep,
        copy_outputs=set(b for b in e.expose if e.reused(bufs, b) and
                         b not in e.aliases))
    if e.graphs is not None:
        e.run_forward = graphs.forward_tier(e, e.run_forward, e.graphs)
    # What a later call overwrites, and so what a pending call's backward
    # needs put back: static buffers the forward writes. Views of stable
    # memory follow their base and are never written; a view of memory
    # no op recorded (Chainer's CPU convolution returns one) is written
    # like an owner.
    roots = stable_roots(bufs)
    e.static_storages = [
        bufs[b].storage for b in bufs
        if bufs[b].static and b in forward_defined and
        bufs[b].view_of is None and bufs[b].role not in STABLE_ROLES and
        (id(bufs[b].storage) in roots or
         id(arrayutil.root_of(bufs[b].storage)) not in roots)]


def _backward_tier(e, rec, bops, fops, f_inputs, out_bids, grad_in,
                   grad_targets, grad_out_bids, param_bids, handed_out,
                   groups, roots=None):
    """Make, lower and wrap the backward schedule, and what a backward
    that accumulates into held gradients needs."""
    bufs = rec.buffers
    gouts = [b for b in grad_out_bids if b is not None]
    b_inputs = gouts + list(e.saved) + param_bids
    grad_bids = [b for b in grad_in if b is not None]
    e.backward = ir.Schedule('backward', bufs, bops, b_inputs, grad_bids)
    # The incoming gradients' memory layouts, and the ops as recorded
    # (their nodes' own kernels, which never write into their inputs): a
    # backward whose gradients come in another layout runs these (see
    # ReplayNode.backward).
    e.grad_out_layouts = tuple(
        signature.layout(bufs[b].storage) for b in gouts)
    uses = {}
    for op in fops:
        for b in op.inputs:
            uses[b] = uses.get(b, 0) + 1
    used = [f_inputs[t] for t in grad_targets]
    e.sum_chains = sum_chains(
        bops, rec.sum_ops, [b if uses.get(u, 0) > 1 else None
                            for b, u in zip(grad_in, used)])
    e.late_sums = late_sums(bops, grad_in, e.sum_chains, bufs, groups,
                            handed_out, into=e.plan_memory)
    e.accumulating = {}
    e.plain_backward_ops = [op.copy() for op in bops]
    # Which of them sum gradient contributions (masked.py).
    e.plain_sums = tuple(id(op) in rec.sum_ops for op in bops)
    e.plain_node_gys = tuple(rec.op_node_gys.get(id(op)) for op in bops)
    e.grad_out_bids = tuple(grad_out_bids)
    e.plain_backward_run = None
    lower_pass.lower(e.backward, handed_out | set(grad_bids),
                     donate=e.plan_memory, groups=groups, roots=roots,
                     threads=e.threads)
    e.backward_copies = set(
        b for b in grad_bids if e.reused(bufs, b) or
        bufs[b].role in ESCAPE_ROLES)
    e.run_backward = e.backward_runner(
        e.backward, before_compile=lower_pass.lower_ops)
    e.grad_slots = tuple(grad_in)        # per target; None = none
    # Per target with a gradient: its place among the backward's outputs.
    e.out_position = dict(
        (k, n) for n, k in enumerate(
            k for k, b in enumerate(grad_in) if b is not None))
    e.grad_targets = tuple(grad_targets)  # outer input positions
    e.target_position = dict((t, k) for k, t in enumerate(grad_targets))
    e.grad_out_mask = tuple(b is not None for b in grad_out_bids)
    # Outputs of no elements (ChainerMN's delegate variables): an empty
    # gradient where Chainer gives None (empty_gradients).
    e.empty_outputs = tuple(bufs[b].storage for b in out_bids) \
        if any(bufs[b].storage is not None and
               bufs[b].storage.size == 0 for b in out_bids) else ()


def ir_ops(rec, rops, roots=None):
    """The IR ops of the recorded applications ``rops`` (forward or
    backward); ``roots``: stable_roots of the recording's buffers, if
    known."""
    ops = []
    bufs = rec.buffers
    if roots is None:
        roots = stable_roots(bufs)
    sums = set()     # ids of rops no backward() applied (the sums of
    #                  gradient contributions backprop makes)
    node_gys = {}
    if rops is rec.backward_ops:
        inside = rec.step_of()
        sums = set(id(rop) for j, rop in enumerate(rops) if j not in inside)
        rec.sum_ops = set()   # ids of their IR ops
        # id(IR op) -> the gradients its node's backward() was handed
        # (buffer ids), masked.py's: where none of them comes, define-by-
        # run's backprop never reaches the node.
        rec.op_node_gys = {}
        node_gys = dict((id(rop), _node_gys(rec, inside[j]))
                        for j, rop in enumerate(rops) if j in inside)
        by_node = dict((id(op.node), op) for op in rec.forward_ops)
        # In the order backprop ran them; a step that applied no node (its
        # backward() computed everything in Python) is empty but still runs
        # before the ops that follow it.
        reruns = [step for step in rec.steps if step.rerun]
        skip_to = 0
        kept = []
        k = 0
        for j, rop in enumerate(rops):
            while k < len(reruns) and reruns[k].start <= j:
                kept.append(reruns[k])
                skip_to = max(skip_to, reruns[k].end)
                k += 1
            if j >= skip_to:
                kept.append(rop)
        kept.extend(reruns[k:])
        rops = kept
    for rop in rops:
        if isinstance(rop, recorder.BackwardStep):
            ops.append(kernels.rerun_op(rop, by_node[id(rop.node)]))
            rec.op_node_gys[id(ops[-1])] = _node_gys(rec, rop)
            continue
        if rop.kind in VIEW_KINDS and _view_once(rop, bufs, roots):
            for b in rop.outputs:
                bufs[b].static = True
                bufs[b].view_of = roots[id(arrayutil.root_of(bufs[b].storage))]
            ops.append(ir.Op(rop.kind, rop.inputs, rop.outputs,
                             functools.partial(describe.describe, rop.node),
                             rop.source, None, rop.select))
            continue
        static_attrs = [(k, bufs[b].storage) for k, b in rop.state
                        if bufs[b].static] if rop.state else ()
        op = ir.Op(rop.kind, rop.inputs + tuple([b for _, b in rop.rebind])
                   if rop.rebind else rop.inputs,
                   rop.outputs,
                   functools.partial(describe.describe, rop.node),
                   rop.source, kernels.make_kernel(
                       rop, static_attrs, [bufs[b].shape for b in rop.outputs]),
                   rop.select)
        if lowering.candidate(rop):
            op.lower_from = rop     # kernel chosen by lower_pass.lower
        if id(rop) in sums:
            rec.sum_ops.add(id(op))
        elif id(rop) in node_gys:
            rec.op_node_gys[id(op)] = node_gys[id(rop)]
        ops.append(op)
    return ops


def _node_gys(rec, step):
    """The buffer ids of the gradients ``step``'s node was handed (None
    for an output it got none for), or None where one is no buffer."""
    if step.gy is not None:
        return step.gy
    if step.raw is None:
        return None
    out = []
    for g in step.raw[0]:
        if g is None or g.raw_array is None:
            out.append(None)
            continue
        b = rec.by_id.get(id(g.raw_array))
        if b is None:
            return None
        out.append(b)
    return tuple(out)


def _rebindable_params(bufs, params, held, sources):
    """Per parameter: does the recording read its array only through the
    Parameter, as an op input? Not where a node holds it in an attribute
    (``held``), another buffer is a view of it (``W.T`` taken once at plan
    time, a user's ``W.array[0]``), or an op got it as a raw array or in
    another Variable (``self.frozen = self.b.array``, a global): those may
    still read the old array after ``W.array = new``."""
    roots = {}
    for buf in bufs.values():
        if arrayutil.is_array(buf.storage):
            r = id(arrayutil.root_of(buf.storage))
            roots[r] = roots.get(r, 0) + 1
    out = []
    for b, _, p in params:
        a = bufs[b].storage
        out.append(b not in held and arrayutil.root_of(a) is a and
                   roots.get(id(a)) == 1 and
                   sources.get(b, set()) <= set([id(p)]))
    return tuple(out)


def release_arrays(rec, keep_stable=False):
    """Let go of the arrays the recording holds: its buffers' (but, with
    ``keep_stable``, static buffers, parameters, persistents and
    constants), and the gradients its backward steps computed. The
    recorded nodes keep what they retained."""
    for buf in rec.buffers.values():
        if not keep_stable or not (buf.static or buf.role in STABLE_ROLES):
            buf.storage = None
    rec.arrays = []
    rec.traced_views = {}
    rec.by_id = {}
    for step in rec.steps:
        step.raw = None     # the recorded call's gradients
    rec.steps = []


def release_recording(rec, keep_nodes=False):
    """Let go of what only the recording needed: the arrays of buffers
    replay rebinds every call (activations, gradients), and (unless
    ``keep_nodes``: a backward may run through them again) the data that
    recorded nodes retained for a backward that replay never runs through
    them. Static buffers, parameters, persistents and constants stay."""
    release_arrays(rec, keep_stable=True)
    if not keep_nodes:
        release_nodes(rec)


def release_nodes(rec):
    """What the recorded nodes retained (``release_recording``)."""
    for rop in rec.forward_ops + rec.backward_ops:
        node = rop.node
        if rop.rebind:
            d = node_attrs.attrs(node)
            for k, _ in rop.rebind:
                d[k] = None
        if node.__dict__.get('_retained_output_data') is not None:
            node._retained_output_data = None
        for vn in node.inputs or ():
            # A live variable's node (a parameter's) is not ours to touch.
            if vn.get_variable_or_none() is None:
                vn._data = None


def recorded_values(schedule, bids):
    """The recording call's arrays of buffers ``bids``. One no recorded op
    made (a copy of a parameter the forward takes for the backward to
    compute an activation again, recompute.py) is made now, from the
    recorded arrays and the parameters as they are."""
    bufs = schedule.buffers
    made = {}
    for op in schedule.ops:
        for b in op.outputs:
            made.setdefault(b, op)
    out = []
    for b in bids:
        a = bufs[b].storage
        op = made.get(b)
        if a is None and op is not None and op.fn is not None and all(
                bufs[i].storage is not None for i in op.inputs):
            r = op.fn(tuple(bufs[i].storage for i in op.inputs))
            a = r[op.select[op.outputs.index(b)]]
        out.append(a)
    return out


def sum_chains(bops, sum_ids, grad_in):
    """{target position: (its first gradient contribution, index in bops
    of the first sum)} for targets whose gradient Chainer summed from two
    or more contributions as it went (``(c1 + c2) + c3``). ``grad_in``
    holds None for a target the forward used once: a sum that makes its
    gradient is then an inner variable's (``h = p + x; h * h``: the Add's
    backward hands on h's gradient as x's), which define-by-run adds to
    x's earlier gradient whole."""
    producer, readers = {}, {}
    for i, op in enumerate(bops):
        for b in op.outputs:
            producer[b] = i
        for b in op.inputs:
            readers[b] = readers.get(b, 0) + 1
    out = {}
    for k, b in enumerate(grad_in):
        first = None
        # Each partial sum of the chain feeds the next sum alone (the final
        # one no op): a sum another op reads is an inner variable's
        # gradient (``h = x + f(x); h * h``: h's two contributions), which
        # define-by-run completes before x's sum takes it.
        while b is not None and readers.get(b, 0) == (first is not None):
            i = producer.get(b)
            if i is None or id(bops[i]) not in sum_ids or \
                    bops[i].kind != 'Add' or len(bops[i].inputs) != 2 or \
                    bops[i].fn is None:
                break
            first, b = i, bops[i].inputs[0]
        if first is not None:
            out[k] = (b, first)
    return out


def late_sums(bops, grad_in, chains, bufs, groups, handed_out, into=True):
    """{target position: (its gradient buffer, index in bops of the op
    after which that buffer is complete, may the sum be written into it,
    (array type, shape, dtype, device) of the gradient)}
    for targets outside ``chains`` whose gradient an op makes. Given the
    gradient such a target held before, define-by-run adds it as soon as
    the backward step that made the contribution has run
    (``_backprop_utils.backprop_step``: ``earlier + contribution``), not
    after the whole call's backward: so does the replay
    (``Entry.accumulating_backward``). The sum may go into the
    contribution's own memory (same bits, no new array) where nothing
    else can see it: a temporary of its own memory, not static, handed
    out once, as this target's gradient only; ``into=False``
    (``plan_memory=False``): never."""
    producer, last = {}, {}
    for i, op in enumerate(bops):
        for b in op.outputs:
            producer[b] = i
            last[b] = i
        for b in op.inputs:
            last[b] = i
    times = {}
    for b in grad_in:
        times[b] = times.get(b, 0) + 1
    out = {}
    for k, b in enumerate(grad_in):
        if b is None or k in chains or b not in producer:
            continue
        buf = bufs[b]
        a = buf.storage
        ok = into and times[b] == 1 and buf.role == ir.TEMP and \
            not buf.static and buf.view_of is None and \
            b not in handed_out and arrayutil.is_array(a) and \
            arrayutil.root_of(a) is a and \
            groups.get(id(a)) == [b]
        if arrayutil.is_array(a):
            out[k] = (b, last[b], ok, (a.__class__, buf.shape, buf.dtype,
                                       signature.device_tag(a)))
    return out
