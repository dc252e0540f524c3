"""A cache entry: the schedules of one key and what a call checks before it
replays them (``matches``). Its life is a small state machine (``move``);
build.py fills it from a recording, the FunctionNodes in nodes.py run it."""
import threading
import weakref

import numpy

import chainer

from schedules import blas_stream
from schedules import executor
from schedules import parallel
from schedules import planner
from schedules import ir
from static_graph import arrayutil
from static_graph import diagnostics
from static_graph import frozen_values
from static_graph import graphs
from static_graph import link_values
from static_graph import lower_pass
from static_graph import masked
from static_graph import signature
from static_graph import split_kernels

# Roles of buffers whose arrays are not the schedule's own: handed out,
# they are copies.
ESCAPE_ROLES = (ir.CONST, ir.PARAM, ir.PERSIST, ir.GRAD_OUT, ir.INPUT)

# An entry's life: made by a recording call, it is complete once built from
# that call's forward and backward (or from the forward alone), or falls back
# to define-by-run for its key, or is discarded (the next call records
# again). A complete entry falls back when a backward asks for what replay
# cannot give.
RECORDING, COMPLETE, FALLBACK, DISCARDED = (
    'recording', 'complete', 'fallback', 'discarded')
_MOVES = {RECORDING: (COMPLETE, FALLBACK, DISCARDED),
          COMPLETE: (FALLBACK,), FALLBACK: (), DISCARDED: ()}


STABLE_ROLES = (ir.PARAM, ir.PERSIST, ir.CONST)


def link_hooks(d):
    """The hooks of the link whose __dict__ is ``d``, in order."""
    hooks = d.get('_local_link_hooks')
    return tuple(hooks.values()) if hooks else ()


def link_structure(chain, written=(), held=()):
    """What replay assumes of the chain's structure: (dict, name, object)
    for every child link, Parameter, persistent array (nodes may hold it by
    reference: BatchNorm's running statistics) and other array or Variable
    attribute of its links (except those the method itself writes; a
    Variable that is no Parameter with its array), and
    each link's sets of parameter and child names; of ``held``
    (link_values.Watch.held: (path, weakref to a held link)) too."""
    same, sets = [], []
    skip = set((id(d), k) for d, k in written)
    links = list(chain.links())
    own = len(links)
    links += [link for link in (ref() for _, ref in held)
              if link is not None]
    for i, link in enumerate(links):
        d = link.__dict__
        persistent = getattr(link, '_persistent', ())
        children = getattr(link, '_children', None)
        for k, v in d.items():
            if (id(d), k) in skip and k not in persistent:
                continue
            if link_values.structural(v):
                # (A Variable that is no Parameter with its array too:
                # ``self.mask.array = new`` between calls.)
                same.append((d, k, v, frozen_values.variable_array(v)))
        # Chain: a set of names; ChainList: a list of links. (Not of a
        # held link: the entry would keep it alive, where its owner may
        # hold it weakly.)
        if i < own:
            sets.append((link, set(link._params), None if children is None
                         else type(children)(children)))
    return same, sets


class Entry(object):
    """Schedules and bookkeeping for one cache key."""

    def __init__(self, key, method_name):
        self.key = key
        self.method_name = method_name
        self.label = method_name     # ('Class.method', for warnings)
        self.state = RECORDING       # see _MOVES
        # What the recording call changed on the links or in globals (a
        # memo filled): the next call records again to see whether it
        # changes them at every call (then it falls back).
        self.recheck = None
        self.no_grad_outs = ()
        self.leaf_outs = ()      # (outputs.detached)
        # Outputs an inner node made together with others (F.split_axis):
        # define-by-run may use a gradient Chainer takes from their .grad
        # (reloads.sibling_outputs).
        self.sibling_outputs = {}
        # (link __dict__, name) of the recurrent state the call takes as
        # inputs after its arguments (capture.py).
        self.recurrent = ()
        # [(node attributes, name)]: values a user's node's forward leaves
        # on the node (not numbers) for its backward, which runs again
        # (user_nodes): each call keeps its own (nodes.py).
        self.node_values = ()
        self.reason = None
        self.forward = None
        self.backward = None
        self.saved_outputs = {}      # build.py
        self.aliases = {}            # build.py: outputs of chain memory
        self.passes = None           # build.TRACE: [(stage, schedules)]
        self.lock = threading.RLock()
        self._reused_roots = None
        self.owner = None            # weakref to the ReplayNode whose values
        #                              are in the static buffers
        self.replays = 0
        # Recordings of the key before this one, in a row, that no longer
        # matched the chain at their next call and never replayed.
        self.stale = 0
        self.cuda_graph = True
        self.quiet = True            # no earlier call waits for its backward
        self.pending = weakref.WeakSet()   # calls that wait for it
        # A recording made on probation (cache.must_repeat), waiting for
        # its backward: a weakref to its RecordNode (splice.let_go_waiting).
        self.dissolvable = None
        self.graph_static = []       # the forward graph's saved activations
        # A call's backward may run twice (the DCGAN updater backpropagates
        # two losses through one call): calls keep their saved activations
        # until they die, and their backward writes into none of them.
        self.repeat_backward = False
        self.recording_saved = None
        # While the recording call's backward builds the entry and until
        # it binds the call to it (nodes.RecordNode.backward): the
        # recording's values of the static buffers, put aside by a replay
        # of another thread that runs meanwhile.
        self.bind_pending = False
        # Per output, the input positions a cut's walk from it goes on
        # into (cuts.reach_of, capture.py).
        self.cut_reach = None
        self.unbound_snapshot = None
        self.uninit_params = ()      # build.py
        self.empty_outputs = ()
        # The rank of the recording's last node (nodes.deepen), which each
        # replayed call's node takes beyond its inputs'.
        self.rank_depth = 0
        self.graph_owned = set()     # (their ids)
        # State outputs whose gradient the backward adds to the call's own
        # contribution (recurrent.summed_elsewhere); the method's cache.
        self.summed_state_outputs = frozenset()
        self.cache_ref = None

    def move(self, state, reason=None):
        """The next state of the entry's life (``_MOVES``); ``reason``: why
        it falls back."""
        if state not in _MOVES[self.state]:
            raise RuntimeError('cache entry of %s: %s -> %s' % (
                self.method_name, self.state, state))
        self.state = state
        if reason is not None:
            self.reason = reason

    def accumulating_backward(self, ks, plain=False, absent=frozenset()):
        """The backward schedule for a call whose targets ``ks`` (positions
        in ``grad_targets``) already hold a gradient, which becomes an
        input: define-by-run adds it to the first contribution and then
        each next one (``((g + c1) + c2) + c3``); compiled on first use.
        plain: from the ops as recorded (``plain_backward``'s). absent:
        outputs (indexes) that got a gradient at recording and none now
        (masked.py; then always from the ops as recorded); None where
        replay cannot give that backward."""
        if absent:
            plain = True
        key = (ks, plain, absent)
        if key in self.accumulating:
            return self.accumulating[key]
        bufs = self.backward.buffers
        if not plain:
            # The small ops' kernels, which lower deferred to the compile of
            # the backward schedule: the variant's copies need them now
            # (the variant may be all that ever runs).
            lower_pass.lower_ops(self.backward)
        ops = [op.copy() for op in (self.plain_backward_ops if plain
                                    else self.backward.ops)]
        before, after = {}, {}
        extra = []
        outputs = list(self.backward.outputs)
        for k in sorted(ks):
            if k not in self.sum_chains:
                # One contribution: the earlier gradient added to it once
                # it is complete (late_sums).
                b, i, into, _ = self.late_sums[k]
                g = ir.add_buffer(bufs, bufs[b], ir.GRAD_OUT,
                                  'earlier gradient')
                s = ir.add_buffer(bufs, bufs[b], ir.TEMP)
                extra.append(g)
                after.setdefault(i, []).append(ir.Op(
                    'Add', (g, b), (s,), None, ops[i].source,
                    _AddInto(self.threads) if into and not plain else
                    _add_kernel))
                outputs[self.out_position[k]] = s
                continue
            first, i = self.sum_chains[k]
            g = ir.add_buffer(bufs, bufs[first], ir.GRAD_OUT,
                              'earlier gradient')
            s = ir.add_buffer(bufs, bufs[first], ir.TEMP)
            extra.append(g)
            before[i] = ir.Op('Add', (g, first), (s,), None, ops[i].source,
                              _add_kernel)
            ops[i].inputs = (s,) + ops[i].inputs[1:]
        sums, new_ops, node_gys = [], [], []
        for i, (op, is_sum, gys) in enumerate(zip(
                ops, self.plain_sums, self.plain_node_gys)):
            if i in before:
                sums.append(True)
                new_ops.append(before[i])
                node_gys.append(None)
            sums.append(is_sum)
            new_ops.append(op)
            node_gys.append(gys)
            for add in after.get(i, ()):
                sums.append(True)
                new_ops.append(add)
                node_gys.append(None)
        ops = new_ops
        inputs = tuple(self.backward.inputs) + tuple(extra)
        outputs = tuple(outputs)
        name = 'backward (accumulating)' if ks else 'backward'
        if absent:
            missing = [self.grad_out_bids[i] for i in absent]
            masked_ops = masked.mask_ops(ops, sums, missing, outputs,
                                         node_gys)
            if masked_ops is None:
                self.accumulating[key] = None
                return None
            ops, outputs = masked_ops
            inputs = tuple(b for b in inputs if b not in missing)
            name += ' without gradients for outputs %s' % ', '.join(
                map(str, sorted(absent)))
        sched = ir.Schedule(name, bufs, ops, inputs, outputs)
        sched.verify(preset=self._forward_defined())
        run = self.accumulating[key] = self.backward_runner(sched)
        return run

    def adds_late(self, k, g):
        """Does the backward add ``g``, the gradient target ``k`` held
        before, to the target's one contribution (build.late_sums)? Where
        it is an array of that contribution's type, shape, dtype and
        device; anything else Chainer adds after the backward
        (``reloads.accumulate``), raising where define-by-run raises."""
        late = self.late_sums.get(k)
        if late is None:
            return False
        cls, shape, dtype, device = late[3]
        return g.__class__ is cls and g.shape == shape and \
            g.dtype == dtype and signature.device_tag(g) == device

    def plain_backward(self):
        """The backward schedule with every op's own node kernel: no kernel
        that writes into an input, whose safety was decided on the
        recording's memory layouts (compiled on first use)."""
        if self.plain_backward_run is None:
            sched = ir.Schedule('backward (as recorded)', self.backward.buffers,
                                self.plain_backward_ops,
                                self.backward.inputs, self.backward.outputs)
            self.plain_backward_run = self.backward_runner(sched)
        return self.plain_backward_run

    def backward_runner(self, schedule, **options):
        """How a backward schedule (or a variant over its buffers) runs:
        gradients that later calls could overwrite are handed out as
        copies in their own layout."""
        run = executor.TieredSchedule(
            schedule, self.copyto, free=self.plan_memory,
            copy=arrayutil.copy_exact, copy_outputs=self.backward_copies,
            pair=split_kernels.pairing(self.threads),
            stream=split_kernels.streaming(self.threads), **options)
        if self.graphs is not None:
            run = graphs.backward_tier(self, run, self.graphs)
        return run

    def reused(self, bufs, b):
        """Is buffer b memory that a later call writes again (static, or a
        view of static memory) or shares (a constant)? Then what is handed
        out must be a copy."""
        if self._reused_roots is None:
            self._reused_roots = set(
                id(arrayutil.root_of(buf.storage)) for buf in bufs.values()
                if (buf.static or buf.role == ir.CONST) and
                buf.storage is not None)
        buf = bufs[b]
        return buf.static or buf.role == ir.CONST or \
            id(arrayutil.root_of(buf.storage)) in self._reused_roots

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

    def _forward_defined(self):
        """The buffers the forward defines, which a backward reads
        (static buffers among them) without their being its inputs."""
        return set(self.forward.inputs) | set(
            b for op in self.forward.ops for b in op.outputs)

    def verify(self):
        self.forward.verify()
        if self.backward is not None:
            self.backward.verify(preset=self._forward_defined())
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

    def first_structure_change(self):
        """How a message names the first array, Variable or link
        attribute that holds another object than at recording (``self.h``
        of an owner that keeps its last activations), or None."""
        for d, name, v, a in self.structure:
            if d.get(name) is not v or (
                    a is not None and v.raw_array is not a):
                watch = self.link_values
                return watch.name_of(d, name) if watch is not None else name
        for p in self.uninit_params:
            if p.raw_array is not None:
                return 'the initialization of parameter %s' % p.name
        return None

    def _matches_links(self):
        # The same child links, Parameter objects, persistent and other
        # array attributes (a link swapped, a Parameter, running statistics
        # or class weights replaced)...
        for d, name, v, a in self.structure:
            if d.get(name) is not v or (
                    a is not None and v.raw_array is not a):
                return False
        for p in self.uninit_params:
            if p.raw_array is not None:
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
            if link_values.size(d) != n or link_hooks(d) != hooks:
                return False
        if tuple(chainer._get_link_hooks().values()) != \
                self.global_link_hooks:
            return False
        # ... and so does any other value on the links the method may have
        # read (a temperature, a function, a dict of hyper-parameters).
        return self.link_values is None or self.link_values.holds()


def _add_kernel(a):
    return (chainer.utils.force_array(a[0] + a[1]),)


class _AddInto(object):
    """``earlier + contribution`` (``_add_kernel``'s bits) written into
    the contribution, a result of this very backward that nothing else
    sees (build.late_sums), where it is memory of its own in the earlier
    gradient's layout; else a new array. A large NumPy one is split along
    its first axis across ``threads`` where that measures faster (each
    element is one addition either way: the same bits)."""

    __name__ = 'add_into'
    overwrites = (1,)     # (stream.select: it may write its input 1)

    def __init__(self, threads):
        self.threads = split_kernels.threads_of(threads)
        self.ranges = None

    def stream_task(self, a):
        """The sum written into x as a task of the stream's C worker,
        or None (schedules/stream.py)."""
        t = blas_stream.add_task(a[0], a[1])
        return None if t is None else ([t[0]], (t[1],))

    def __call__(self, a):
        g, x = a
        if not (x.base is None and g.__class__ is x.__class__ and
                g.shape == x.shape and g.dtype == x.dtype and
                g.strides == x.strides and x.ndim and
                getattr(x.flags, 'writeable', True) and
                getattr(g, 'device', None) == getattr(x, 'device', None)):
            return _add_kernel(a)
        if self.threads < 2 or x.__class__ is not numpy.ndarray or \
                x.size < split_kernels.MIN_ELEMENTS or \
                len(x) < self.threads:
            chainer.backend.get_array_module(x).add(g, x, out=x)
            return (x,)
        ranges = self.ranges
        if ranges is None or ranges.n != len(x):
            ranges = self.ranges = parallel.Ranges(self.threads, len(x))

        def add_into(lo, hi):
            numpy.add(g[lo:hi], x[lo:hi], out=x[lo:hi])
        ranges(add_into)
        return (x,)
