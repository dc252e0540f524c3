"""A cache entry: the schedules of one key, built from a recording (the
recorded ops as IR ops with their kernels, lowering, recomputation, the
compiled and graphed runners) and what a call checks before it replays
(``matches``). The FunctionNodes that replay a call are in nodes.py, the
kernels in kernels.py."""
import functools
import threading
import weakref

import chainer

from schedules import executor
from schedules import planner
from schedules import ir
from schedules import recompute as schedule_recompute
from static_graph import describe
from static_graph import diagnostics
from static_graph import graphs
from static_graph import kernels
from static_graph import link_values
from static_graph import lower_pass
from static_graph import lowering
from static_graph import recompute_rules
from static_graph import recorder
from static_graph import signature

_ESCAPE_ROLES = (ir.CONST, ir.PARAM, ir.PERSIST, ir.GRAD_OUT, ir.INPUT)


# Ops whose outputs are views of their input: when the input's memory is
# stable (a parameter, persistent or constant array, or a static buffer) the
# recorded view stays valid, so replay skips the op.
VIEW_KINDS = frozenset((
    'Reshape', 'BroadcastTo', 'Transpose', 'GetItem', 'ExpandDims', 'Squeeze',
    'Swapaxes', 'Moveaxis', 'Rollaxis'))
_STABLE_ROLES = (ir.PARAM, ir.PERSIST, ir.CONST)


def stable_roots(bufs):
    """id(array) -> buffer id, for buffers that own their memory and keep
    it across calls (parameters, persistents, constants, static buffers).
    A view of such memory shows current values without being recomputed."""
    out = {}
    for b, buf in bufs.items():
        a = buf.storage
        if (buf.static or buf.role in _STABLE_ROLES) and a is not None and \
                recorder.root_of(a) is a:
            out.setdefault(id(a), b)
    return out


def _view_once(rop, bufs, roots):
    if rop.kind not in VIEW_KINDS or rop.state:
        return False
    for b in rop.outputs:
        a = bufs[b].storage
        if a is recorder.root_of(a) or \
                id(recorder.root_of(a)) not in roots:
            return False
    return True


def link_hooks(d):
    """The hooks of the link whose __dict__ is ``d``, in order."""
    hooks = d.get('_local_link_hooks')
    return tuple(hooks.values()) if hooks else ()


def link_structure(chain, written=()):
    """What replay assumes of the chain's structure: (dict, name, object)
    for every child link, Parameter, persistent array (nodes may hold it by
    reference: BatchNorm's running statistics) and other array or Variable
    attribute of its links (except those the method itself writes), and
    each link's sets of parameter and child names."""
    same, sets = [], []
    skip = set((id(d), k) for d, k in written)
    for link in chain.links():
        d = link.__dict__
        persistent = getattr(link, '_persistent', ())
        children = getattr(link, '_children', None)
        for k, v in d.items():
            if (id(d), k) in skip and k not in persistent:
                continue
            if link_values.structural(v):
                same.append((d, k, v))
        # Chain: a set of names; ChainList: a list of links.
        sets.append((link, set(link._params),
                     None if children is None else type(children)(children)))
    return same, sets


def _ir_ops(rec, rops):
    ops = []
    bufs = rec.buffers
    roots = stable_roots(bufs)
    sums = set()     # ids of rops no backward() applied (the sums of
    #                  gradient contributions backprop makes)
    if rops is rec.backward_ops:
        inside = set()
        for step in rec.steps:
            inside.update(range(step.start, step.end))
        sums = set(id(rop) for j, rop in enumerate(rops) if j not in inside)
        rec.sum_ops = set()   # ids of their IR ops
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
            continue
        if _view_once(rop, bufs, roots):
            for b in rop.outputs:
                bufs[b].static = True
                bufs[b].view_of = roots[id(recorder.root_of(bufs[b].storage))]
            ops.append(ir.Op(rop.kind, rop.inputs, rop.outputs,
                             functools.partial(describe.describe, rop.node),
                             rop.source, None, rop.select))
            continue
        static_attrs = [(k, bufs[b].storage) for k, b in rop.state
                        if bufs[b].static]
        op = ir.Op(rop.kind, rop.inputs + tuple(b for _, b in rop.rebind),
                   rop.outputs,
                   functools.partial(describe.describe, rop.node),
                   rop.source, kernels.make_kernel(rop, static_attrs), rop.select)
        if lowering.candidate(rop):
            op.lower_from = rop     # kernel chosen by lower_pass.lower
        if id(rop) in sums:
            rec.sum_ops.add(id(op))
        ops.append(op)
    return ops


def _rebindable_params(bufs, params, held, sources):
    """Per parameter: does the recording read its array only through the
    Parameter, as an op input? Not where a node holds it in an attribute
    (``held``), another buffer is a view of it (``W.T`` taken once at plan
    time, a user's ``W.array[0]``), or an op got it as a raw array or in
    another Variable (``self.frozen = self.b.array``, a global): those may
    still read the old array after ``W.array = new``."""
    roots = {}
    for buf in bufs.values():
        if recorder.is_array(buf.storage):
            r = id(recorder.root_of(buf.storage))
            roots[r] = roots.get(r, 0) + 1
    out = []
    for b, _, p in params:
        a = bufs[b].storage
        out.append(b not in held and recorder.root_of(a) is a and
                   roots.get(id(a)) == 1 and
                   sources.get(b, set()) <= set([id(p)]))
    return tuple(out)


def release_recording(rec):
    """Let go of what only the recording needed: the arrays of buffers
    replay rebinds every call (activations, gradients), and the data that
    recorded nodes retained for a backward that replay never runs through
    them. Static buffers, parameters, persistents and constants stay."""
    for buf in rec.buffers.values():
        if not buf.static and buf.role not in _STABLE_ROLES:
            buf.storage = None
    rec.arrays = []
    rec.traced_views = {}
    rec.by_id = {}
    for step in rec.steps:
        step.raw = None     # the recorded call's gradients
    rec.steps = []
    for rop in rec.forward_ops + rec.backward_ops:
        node = rop.node
        d = recorder.attrs(node)
        for k, _ in rop.rebind:
            d[k] = None
        if node.__dict__.get('_retained_output_data') is not None:
            node._retained_output_data = None
        for vn in node.inputs or ():
            # A live variable's node (a parameter's) is not ours to touch.
            if vn.get_variable_or_none() is None:
                vn._data = None


class Entry(object):
    """Schedules and bookkeeping for one cache key."""

    def __init__(self, key, method_name):
        self.key = key
        self.method_name = method_name
        self.state = 'recording'     # -> 'complete' | 'fallback'
        # What the recording call changed on the links or in globals (a
        # memo filled): the next call records again to see whether it
        # changes them at every call (then it falls back).
        self.recheck = None
        self.no_grad_outs = ()
        self.reason = None
        self.forward = None
        self.backward = None
        self.lock = threading.RLock()
        self._reused_roots = None
        self.owner = None            # weakref to the ReplayNode whose values
        self.replays = 0             # are in the static buffers
        self.cuda_graph = True
        self.quiet = True            # no earlier call waits for its backward
        self.pending = weakref.WeakSet()   # calls that wait for it
        self.graph_static = []       # the forward graph's saved activations
        # A call's backward may run twice (the DCGAN updater backpropagates
        # two losses through one call): calls keep their saved activations
        # until they die, and their backward writes into none of them.
        self.repeat_backward = False
        self._recording_saved = None
        self.empty_outputs = ()
        self.graph_owned = set()     # (their ids)

    # -- building -------------------------------------------------------------
    def build(self, rec, chain, n_leaves, leaf_bids, out_bids, out_kinds, out_spec,
              params, persists, grad_in=None, grad_targets=None,
              grad_out_bids=None, attr_writes=(), reports=(),
              link_values=None, recompute=True, plan_memory=True,
              cuda_graph=True):
        """Turn a finished recording into compiled schedules. recompute:
        let the backward compute cheap activations again instead of saving
        them (recompute_rules.py); plan_memory=False: no memory reuse at
        all (no early frees, no kernel writing into a dying input, nothing
        recomputed), for comparison; cuda_graph: on CuPy, replay each
        schedule as one CUDA graph launch once it has run (graphs.py)."""
        self.plan_memory = plan_memory
        self.cuda_graph = cuda_graph
        recompute = recompute and plan_memory
        bufs = rec.buffers
        self.n_leaves = n_leaves
        self.link_values = link_values
        self.params = [p for _, _, p in params]
        param_bids = [b for b, _, _ in params]
        self.param_bids = tuple(param_bids)
        # Each holds the parameter's array as recorded (or as rebound):
        # replay needs a new recording where the Parameter holds another.
        self.param_bufs = tuple(bufs[b] for b in param_bids)
        self.param_rebindable = _rebindable_params(
            bufs, params, rec.held, rec.input_sources)
        self.structure, self.link_sets = link_structure(
            chain, [w[:2] for w in attr_writes])
        self.out_spec = out_spec
        self.out_kinds = out_kinds
        self.reports = reports
        self.attr_writes = attr_writes
        f_inputs = list(leaf_bids) + param_bids
        fops = _ir_ops(rec, rec.forward_ops)
        fwd_written = set(b for op in fops for b in op.outputs)
        forward_defined = set(f_inputs) | fwd_written
        saved = []
        if grad_targets is not None:
            bops = _ir_ops(rec, rec.backward_ops)
            needed = []
            for op in bops:
                needed.extend(op.inputs)
            needed.extend(b for b in grad_in if b is not None)
            seen = set()
            for b in needed:
                if b in forward_defined and b not in seen and \
                        not bufs[b].static and b not in param_bids:
                    saved.append(b)
                    seen.add(b)
        expose = []
        for _, items in reports:
            expose.extend(v for _, how, v in items if how == 'buffer')
        expose.extend(w[2] for w in attr_writes)
        self.expose = tuple(sorted(set(expose)))
        if saved and recompute:
            recipes = recompute_rules.recipes(
                rec, saved, param_bids,
                set(out_bids) | set(self.expose) | set(grad_in), bops)
            if recipes:
                fops, bops, saved = schedule_recompute.rematerialize(
                    bufs, fops, bops, saved, recipes, live=param_bids)
        self.saved = tuple(saved)
        self.out_copy = tuple(self._reused(bufs, b) or
                              bufs[b].role in (ir.PARAM, ir.PERSIST)
                              for b in out_bids)
        copyto = recorder.copyto_for([bufs[b].storage for b in f_inputs] or [])
        self._copyto = copyto
        self._graphs = graphs.wants_graphs(self, copyto)
        if self._graphs is not None:
            # What nodes may update in place besides static buffers
            # (BatchNormalization's running statistics, held by its node).
            self.persistent_arrays = [
                v for link in chain.links()
                for v in (link.__dict__.get(k)
                          for k in getattr(link, '_persistent', ()))
                if recorder.is_array(v)]
        self.forward = ir.Schedule('forward', bufs, fops, f_inputs, out_bids,
                                   keep=self.saved + self.expose)
        # Never written in place: what is handed out or saved for backward,
        # and what nodes read through attributes.
        handed_out = set(out_bids) | set(self.expose) | rec.held
        # Which buffers share memory: the same for both schedules (built
        # over one set of buffers, none added from here on).
        groups = lower_pass.memory_groups(bufs)
        lower_pass.lower(self.forward, handed_out | set(self.saved),
                         donate=plan_memory, groups=groups)
        self.run_forward = executor.TieredSchedule(
            self.forward, copyto, before_compile=lower_pass.lower_ops,
            free=plan_memory, copy=recorder.copy_exact,
            extra_outputs=self.forward.keep,
            copy_outputs=set(b for b in self.expose
                             if self._reused(bufs, b)))
        if self._graphs is not None:
            self.run_forward = graphs.forward_tier(self, self.run_forward,
                                                   self._graphs)
        # What a later call overwrites, and so what a pending call's backward
        # needs put back: static buffers the forward writes. Views of stable
        # memory follow their base and are never written; a view of memory
        # no op recorded (Chainer's CPU convolution returns one) is written
        # like an owner.
        roots = stable_roots(bufs)
        self.static_storages = [
            bufs[b].storage for b in bufs
            if bufs[b].static and b in forward_defined and
            bufs[b].view_of is None and bufs[b].role not in _STABLE_ROLES and
            (id(bufs[b].storage) in roots or
             id(recorder.root_of(bufs[b].storage)) not in roots)]
        if grad_targets is not None:
            gouts = [b for b in grad_out_bids if b is not None]
            b_inputs = gouts + list(self.saved) + param_bids
            grad_bids = [b for b in grad_in if b is not None]
            self.backward = ir.Schedule('backward', bufs, bops, b_inputs,
                                        grad_bids)
            # The incoming gradients' memory layouts, and the ops as
            # recorded (their nodes' own kernels, which never write into
            # their inputs): a backward whose gradients come in another
            # layout runs these (see ReplayNode.backward).
            self.grad_out_layouts = tuple(
                signature.layout(bufs[b].storage) for b in gouts)
            uses = {}
            for op in fops:
                for b in op.inputs:
                    uses[b] = uses.get(b, 0) + 1
            used = [f_inputs[t] for t in grad_targets]
            self._sum_chains = _sum_chains(
                bops, rec.sum_ops, [b if uses.get(u, 0) > 1 else None
                                    for b, u in zip(grad_in, used)])
            self._accumulating = {}
            self._plain_backward_ops = [op.copy() for op in bops]
            self._plain_backward = None
            lower_pass.lower(self.backward, handed_out | set(grad_bids),
                             donate=plan_memory, groups=groups)
            self._backward_copies = set(
                b for b in grad_bids if self._reused(bufs, b) or
                bufs[b].role in _ESCAPE_ROLES)
            self.run_backward = self._backward_runner(
                self.backward, before_compile=lower_pass.lower_ops)
            self.grad_slots = tuple(grad_in)        # per target; None = none
            self.grad_targets = tuple(grad_targets)  # outer input positions
            self.target_position = dict(
                (t, k) for k, t in enumerate(grad_targets))
            self.grad_out_mask = tuple(b is not None for b in grad_out_bids)
            # Outputs of no elements (ChainerMN's delegate variables): an
            # empty gradient where Chainer gives None (empty_gradients).
            self.empty_outputs = tuple(bufs[b].storage for b in out_bids) \
                if any(bufs[b].storage is not None and
                       bufs[b].storage.size == 0 for b in out_bids) else ()
        self.link_sizes = tuple((link, len(link.__dict__),
                                 link_hooks(link.__dict__))
                                for link, _, _ in self.link_sets)
        self.global_link_hooks = tuple(chainer._get_link_hooks().values())
        # The recording call's own saved arrays, for a second backward
        # through it (RecordNode.bind takes them at once).
        self._recording_saved = _recorded_values(self.forward, self.saved)
        release_recording(rec)
        self.state = 'complete'

    def accumulating_backward(self, ks, plain=False):
        """The backward schedule for a call whose targets ``ks`` (positions
        in ``grad_targets``) already hold a gradient, which becomes an
        input: define-by-run adds it to the first contribution and then
        each next one (``((g + c1) + c2) + c3``); compiled on first use.
        plain: from the ops as recorded (``plain_backward``'s)."""
        run = self._accumulating.get((ks, plain))
        if run is not None:
            return run
        bufs = self.backward.buffers
        ops = [op.copy() for op in (self._plain_backward_ops if plain
                                    else self.backward.ops)]
        before = {}
        extra = []
        for k in sorted(ks):
            first, i = self._sum_chains[k]
            g = ir.add_buffer(bufs, bufs[first], ir.GRAD_OUT,
                              'earlier gradient')
            s = ir.add_buffer(bufs, bufs[first], ir.TEMP)
            extra.append(g)
            before[i] = ir.Op('Add', (g, first), (s,), None, ops[i].source,
                              _add_kernel)
            ops[i].inputs = (s,) + ops[i].inputs[1:]
        ops = [o for i, op in enumerate(ops)
               for o in ((before[i], op) if i in before else (op,))]
        sched = ir.Schedule('backward (accumulating)', bufs, ops,
                            tuple(self.backward.inputs) + tuple(extra),
                            self.backward.outputs)
        run = self._accumulating[ks, plain] = self._backward_runner(sched)
        return run

    def plain_backward(self):
        """The backward schedule with every op's own node kernel: no kernel
        that writes into an input, whose safety was decided on the
        recording's memory layouts (compiled on first use)."""
        if self._plain_backward is None:
            sched = ir.Schedule('backward (as recorded)', self.backward.buffers,
                                self._plain_backward_ops,
                                self.backward.inputs, self.backward.outputs)
            self._plain_backward = self._backward_runner(sched)
        return self._plain_backward

    def _backward_runner(self, schedule, **options):
        """How a backward schedule (or a variant over its buffers) runs:
        gradients that later calls could overwrite are handed out as
        copies in their own layout."""
        run = executor.TieredSchedule(
            schedule, self._copyto, free=self.plan_memory,
            copy=recorder.copy_exact, copy_outputs=self._backward_copies,
            **options)
        if self._graphs is not None:
            run = graphs.backward_tier(self, run, self._graphs)
        return run

    def _reused(self, bufs, b):
        """Is buffer b memory that a later call writes again (static, or a
        view of static memory) or shares (a constant)? Then what is handed
        out must be a copy."""
        if self._reused_roots is None:
            self._reused_roots = set(
                id(recorder.root_of(buf.storage)) for buf in bufs.values()
                if (buf.static or buf.role == ir.CONST) and
                buf.storage is not None)
        buf = bufs[b]
        return buf.static or buf.role == ir.CONST or \
            id(recorder.root_of(buf.storage)) in self._reused_roots

    def memory_plan(self, alignment=64):
        """The liveness-based memory plan of one call (forward, then
        backward): ``planner.Plan`` with ``arena_bytes`` against
        ``total_bytes`` (equal under ``plan_memory=False``). Computed on
        first request; it also sets the buffers' arena offsets, which the
        printout then shows."""
        if getattr(self, '_plan', None) is None:
            scheds = [self.forward]
            # Static buffers are read through references nodes hold, not
            # only as op inputs: alive to the end.
            keep = list(self.forward.outputs) + list(self.expose) + [
                b for b, buf in self.forward.buffers.items() if buf.static]
            if self.backward is not None:
                scheds.append(self.backward)
                keep += list(self.backward.outputs)
            if not self.plan_memory:   # nothing is reused
                keep = list(self.forward.buffers)
            self._plan = planner.plan_schedules(scheds, keep=keep,
                                                alignment=alignment)
        return self._plan

    def verify(self):
        self.forward.verify()
        if self.backward is not None:
            self.backward.verify(preset=set(self.forward.inputs) | set(
                b for op in self.forward.ops for b in op.outputs))
        return True

    # -- replay -----------------------------------------------------------------
    def matches(self, chain):
        """True if the chain's parameters and persistents are the recorded
        arrays and its links' plain attributes have the recorded values.
        A parameter array replaced by one of the same type, shape, dtype
        and strides (``optimizer.use_fp32_update()``, weight clipping by
        ``W.array = clip(W.array)``) is taken in its place where the entry
        reads it only as an input; other replacements (``to_gpu``, a new
        shape) need a new recording."""
        replaced = None
        for k, (p, buf) in enumerate(zip(self.params, self.param_bufs)):
            if p.array is not buf.storage:
                if not self._can_rebind(k, p.array):
                    return False
                replaced = (replaced or []) + [k]
        if not self._matches_links():
            return False
        if replaced:
            self._rebind_params(replaced)
        return True

    def _can_rebind(self, k, a):
        old = self.param_bufs[k].storage
        return self.param_rebindable[k] and type(a) is type(old) and \
            a.shape == old.shape and a.dtype == old.dtype and \
            a.strides == old.strides and \
            signature.device_tag(a) == signature.device_tag(old)

    def _rebind_params(self, replaced):
        with self.lock:
            for k in replaced:
                # Printouts and the ONNX exporter read it there too.
                self.param_bufs[k].storage = self.params[k].array
        diagnostics.logger.debug(
            '%s: replaced parameter arrays taken without a new recording',
            self.method_name)

    def _matches_links(self):
        # The same child links, Parameter objects, persistent and other
        # array attributes (a link swapped, a Parameter, running statistics
        # or class weights replaced)...
        for d, name, v in self.structure:
            if d.get(name) is not v:
                return False
        # ... and none added.
        for link, params, children in self.link_sets:
            if link._params != params or \
                    getattr(link, '_children', children) != children:
                return False
        # An attribute added or deleted (an instance attribute now
        # shadowing a class default) needs a new recording; so do link
        # hooks (WeightStandardization) added or removed: the recording
        # holds what they did...
        for link, n, hooks in self.link_sizes:
            d = link.__dict__
            if len(d) != n or link_hooks(d) != hooks:
                return False
        if tuple(chainer._get_link_hooks().values()) != \
                self.global_link_hooks:
            return False
        # ... and so does any other value on the links the method may have
        # read (a temperature, a function, a dict of hyper-parameters).
        return self.link_values is None or self.link_values.holds()


def _recorded_values(schedule, bids):
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


def _sum_chains(bops, sum_ids, grad_in):
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


def _add_kernel(a):
    return (chainer.utils.force_array(a[0] + a[1]),)
