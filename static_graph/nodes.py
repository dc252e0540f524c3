"""How a call of a static chain plugs into Chainer's autograd: one
FunctionNode per call. ``ReplayNode``: a replayed call (its forward runs the
entry's forward schedule, its backward the backward schedule).
``RecordNode``: the recording call (its forward ran define-by-run; its first
backward records the backward and builds the entry, a later one runs the
built schedule). Their inputs are the call's arrays followed by the
parameters the recording used, so Chainer's own gradient accumulation,
optimizers and hooks see ordinary gradients.

Static buffers (see analysis.py) are shared by every call of an entry. When a
chain is called again before the previous call's backward ran, the previous
call's static values are copied aside and put back when its backward runs.
"""
import weakref

import numpy

import chainer
from chainer import backend
from chainer import configuration
from chainer import function_node

from static_graph import arrayutil
from static_graph import cuts
from static_graph import diagnostics
from static_graph import masked
from static_graph.reloads import accumulate, empty_gradients, raw
from static_graph import signature
from static_graph import splice


def output_depth(inner_outs):
    """The rank the nodes that made the recording's outputs got, its
    leaves being of rank 0 (fresh copies, parameters): the deepest."""
    return max([v.creator_node.rank for v in inner_outs
                if isinstance(v, chainer.Variable) and
                v.creator_node is not None] or [0])


def deepen(node, outs, depth):
    """Give ``node`` (applied: the rank of its deepest input) the rank
    its method's last node has under define-by-run, ``depth`` more, and
    its outputs theirs: Chainer's backward takes nodes by rank, and the
    order matters where nodes outside the call share a gradient with it
    (an old-style Function's backward dividing its ``grad_outputs`` in
    place: F.hinge) or add into one gradient."""
    if depth and chainer.config.enable_backprop:
        node.rank += depth
        for y in outs:
            if isinstance(y, chainer.Variable) and y.creator_node is node:
                y.node.creator_node = node      # (its rank: node's + 1)
    return outs


def replaced_outputs(node, handed):
    """{output index: its array now} for the outputs ``handed`` names
    ({index: the array the call handed out}) that the caller gave another
    array after the call (``y.array = y.array * 0.5``): define-by-run's
    backward reads the new one wherever a node kept the output (tanh's,
    sigmoid's, softmax's own backward reads it), from the output's node
    (``retain_outputs``), also where the Variable itself is gone."""
    out = {}
    outputs = node.outputs or ()
    for i, h in handed.items():
        vn = outputs[i]() if i < len(outputs) else None
        if vn is None:
            continue
        a = vn.data
        if a is None:
            v = vn.get_variable_or_none()
            a = v.raw_array if v is not None else None
        if a is not None and a is not h:
            out[i] = a
    return out


def retain_outputs(outs, which=None):
    """The nodes of outputs ``which`` (all by default) keep their arrays,
    as a node that retains its outputs makes them keep them: a caller's
    ``y.array = new`` updates it there (replaced_outputs). Returns outs."""
    for i in range(len(outs)) if which is None else which:
        y = outs[i]
        if isinstance(y, chainer.Variable) and y.raw_array is not None:
            y.node.data = y.raw_array
    return outs


def detach_outputs(outs, which, leaves=()):
    """Outputs that needed no gradient at recording (computed from arrays
    alone: ``F.identity(x)``) as Variables that do not require one, and
    outputs ``leaves`` (outputs.leaves: no graph behind them) as Variables
    of no graph that do, as define-by-run gives them; a gradient for them
    is dropped there (or left on them, as on any leaf)."""
    if not which and not leaves:
        return outs
    outs = list(outs)
    for i in which:
        outs[i] = chainer.Variable(outs[i].raw_array, requires_grad=False)
    for i in leaves:
        outs[i] = chainer.Variable(outs[i].raw_array)
    return outs


def _snapshot(entry):
    """A call's values of the static buffers, as (storage, copy) pairs:
    put back into those very buffers (a graph captured meanwhile adds
    buffers of its own, which a call from before it does not read)."""
    return [(s, s.copy()) for s in entry.static_storages]


def _on_device(entry, fn, arrays):
    """``fn(arrays)``; for CuPy arrays on their device, as
    ``FunctionNode.apply`` runs a forward."""
    if entry.copyto is numpy.copyto:
        return fn(arrays)
    with chainer.using_device(backend.get_device_from_array(*arrays)):
        return fn(arrays)


def _variable(array, requires_grad=True):
    """``chainer.Variable(array, requires_grad=...)`` for an array replay
    made (NumPy or CuPy, never ChainerX): without re-checking its type."""
    return chainer.Variable._init_unchecked(
        array, requires_grad=requires_grad, is_chainerx_array=False)


def _read_inside(node):
    """Positions of a call's outputs that other ops of its forward read
    (``h``, where ``y = out(h)``), or that another output is (``h,
    F.identity(h)``: one array): of its entry's forward schedule, or of
    the recording's ops while it records."""
    entry = node.entry
    if entry is not None:
        inside = entry.__dict__.get('outputs_read_inside')
        if inside is None:
            inside = entry.outputs_read_inside = _inside(
                entry.forward.ops, entry.forward.outputs)
        return inside
    capture = getattr(node, 'capture', None)
    if capture is None:
        return ()
    return _inside(capture.rec.forward_ops, capture.out_bids)


def _inside(ops, outputs):
    read = set(b for op in ops for b in op.inputs)
    twice = set(b for b in outputs if outputs.count(b) > 1)
    return tuple(i for i, b in enumerate(outputs) if b in read or b in twice)


def _node_values(entry):
    """This call's values of ``entry.node_values`` (user_nodes), put back
    on the nodes for its backward."""
    return tuple(d.get(k, arrayutil.MISSING) for d, k in entry.node_values)


class _Replayed(object):
    """The backward of a call of a built entry, by its schedule: a replayed
    call (``ReplayNode``), or the recording call once its entry is built
    (``RecordNode``). Such a node has ``entry``; ``saved``, the activations
    its backward reads; ``snapshot``, its values of the static buffers put
    aside while a later call used them; ``done`` once no backward can come
    any more."""

    whole_call = True     # (nstep_loop: the method's own use of a link)

    def unchain(self):
        """A cut through this call (cuts.py): Chainer's, or an error while
        a backward may still come through it."""
        cuts.unchain_call(self, function_node.FunctionNode.unchain)

    def backward_from(self, indexes, grad_outputs, earlier=()):
        """The gradients for ``indexes``, and the indexes whose gradient
        already includes the one given in ``earlier`` (the gradients the
        inputs held before, per index, or None)."""
        entry = self.entry
        cuts.check(self, _read_inside(self), entry.method_name)
        self.backward_ran = True     # (cuts.py)
        if configuration.config.debug:
            diagnostics.warn_once(
                (entry.method_name, 'debug backward'),
                "Chainer's debug mode is on in the backward of a replayed "
                'call of %s: its checks are per function, which the '
                "call's backward, one node, does not make (a NaN a later "
                'step masks goes unseen); turn it on before the call, '
                'which then runs define-by-run' % entry.method_name)
        if self.saved is None and not self.done:
            # (Its first backward raised partway, a node's backward or
            # KeyboardInterrupt: kernels may have written into the saved
            # activations already.)
            entry.repeat_backward = True
            raise RuntimeError(
                'backward ran again through a replayed call of %s whose '
                'first backward raised partway: that backward used up the '
                'activations the call saved, so this one cannot run. Run '
                'the forward again; calls of this key keep their '
                'activations for another backward from the next call on'
                % entry.method_name)
        if self.saved is None and self.done:
            entry.repeat_backward = True
            raise RuntimeError(
                'backward ran twice through one replayed call of %s, whose '
                'first backward freed the activations it saved: the '
                'recording call was backpropagated once. Calls of this key '
                'keep them for another backward from the next call on; for '
                'this one, run the pattern with '
                'chainer.config.use_static_graph = False' % entry.method_name)
        if chainer.config.enable_backprop:
            raise NotImplementedError(
                'double backpropagation through a replayed static graph is '
                'not supported; run this chain with '
                'chainer.config.use_static_graph = False')
        gys = []
        absent = []   # outputs recorded with a gradient, without one now
        if entry.empty_outputs:
            grad_outputs = empty_gradients(entry.empty_outputs,
                                           grad_outputs)
        for i, (g, has) in enumerate(zip(grad_outputs, entry.grad_out_mask)):
            if has == (g is not None):
                if has:
                    gys.append(raw(g))
                continue
            if has:
                absent.append(i)
                continue
            raise masked.not_recorded(entry, i, has)
        with entry.lock:
            if entry.static_storages:
                owner = entry.owner() if entry.owner is not None else None
                if owner is not self:
                    if self.snapshot is None:
                        raise RuntimeError(
                            'backward ran again through a replayed call whose '
                            'buffers were reused by a later call')
                    if owner is not None and not owner.done:
                        owner.snapshot = _snapshot(entry)
                    for s, v in self.snapshot:
                        entry.copyto(s, v)
                    self.snapshot = None
                    entry.owner = weakref.ref(self)
            # Another backward may come: no kernel writes into the saved
            # activations (the ops' own kernels).
            repeat = entry.repeat_backward
            run = entry.plain_backward() if repeat else entry.run_backward
            held = {}   # target position -> the gradient it holds already
            for i, g in zip(indexes, earlier):
                if g is not None:
                    k = entry.target_position[i]
                    if k in entry.sum_chains or entry.adds_late(k, raw(g)):
                        held[k] = raw(g)
            if absent:
                run = entry.accumulating_backward(
                    frozenset(held), True, frozenset(absent))
                if run is None:
                    raise masked.not_recorded(entry, absent[0], True)
            elif held:
                run = entry.accumulating_backward(frozenset(held), repeat)
            if not absent and any(
                    signature.layout(g) != lay
                    for g, lay in zip(gys, entry.grad_out_layouts)):
                # A gradient in another memory layout than the recorded
                # one (the loss outside changed): which results are views
                # of it may differ, so no kernel may write into an input.
                run, held = entry.plain_backward(), {}
                diagnostics.logger.info(
                    '%s: a gradient came in another memory layout than at '
                    'recording; this backward runs the ops\' own kernels',
                    entry.method_name)
            if self.handed:
                self._replaced()
            args = list(gys)
            args.extend(self.saved)
            if not repeat:
                self.saved = None   # the schedule frees each at last use
            args.extend(p.array for p in entry.params)
            args.extend(held[k] for k in sorted(held))
            values = self.__dict__.get('node_values')
            if values is not None:
                for (d, k), v in zip(entry.node_values, values):
                    if v is arrayutil.MISSING:
                        d.pop(k, None)
                    else:
                        d[k] = v
            grads = _on_device(entry, run, args)
            if not repeat:
                entry.pending.discard(self)
        if not repeat:
            self.done = True
        by_input = {}
        it = iter(grads)
        for target, slot in zip(entry.grad_targets, entry.grad_slots):
            by_input[target] = next(it) if slot is not None else None
        included = set(entry.grad_targets[k] for k in held)
        return tuple(
            _variable(by_input[i]) if by_input.get(i) is not None
            else None for i in indexes), included


    def _replaced(self):
        """Saved outputs the caller gave another array: a copy of it in
        the saved one's place (kernels may write into what they read), for
        this backward and any after it."""
        entry = self.entry
        new = replaced_outputs(self, self.handed)
        if not new:
            return
        saved = list(self.saved)
        for i, a in new.items():
            j = entry.saved_outputs[i]
            old = self.handed[i]
            if a.dtype != old.dtype:
                raise RuntimeError(
                    'output %d of %s was given an array of another dtype '
                    '(%s, was %s) before its backward; run this pattern '
                    'with chainer.config.use_static_graph = False'
                    % (i, entry.method_name, a.dtype, old.dtype))
            # (Of another shape too: what reads it fails as define-by-run's
            # nodes would, and what does not, as there, does not.)
            saved[j] = arrayutil.copy_exact(a)
            self.handed[i] = a
        self.saved = tuple(saved)


class ReplayNode(_Replayed, function_node.FunctionNode):
    """One call of a static chain: forward and backward schedules."""

    def __init__(self, entry):
        self.entry = entry
        self.saved = None
        self.handed = None    # the outputs' arrays, until the backward
        self.exposed = None
        self.snapshot = None
        self.done = False
        self.cut = set()      # outputs cut from it (cuts.py)
        self.state_grads = None   # (recurrent.note_state_gradients)

    def _check_data_type_forward(self, in_data):
        pass   # checked by the cache key

    @property
    def label(self):
        return 'StaticGraph(%s)' % self.entry.method_name

    def apply(self, inputs):
        """``FunctionNode.apply`` without the checks the cache key and the
        entry's match already made (array types, devices, dtypes). It
        leaves the node and its outputs as ``FunctionNode.apply`` would:
        same attributes, ranks, edges and retained data (none). Function
        hooks, memory layouts and Chainer's own static graph take the full
        ``apply``. (Under debug mode nothing replays: the decorator runs
        the call define-by-run.)"""
        if chainer.get_function_hooks() or \
                configuration.config.schedule_func is not None:
            return deepen(self, super(ReplayNode, self).apply(inputs),
                          self.entry.rank_depth)
        Variable = chainer.Variable
        input_vars = [x if isinstance(x, Variable) else
                      Variable(x, requires_grad=False) for x in inputs]
        for x in input_vars:
            if x._layout is not None or x._has_chainerx_array:
                return deepen(
                    self, super(ReplayNode, self).apply(inputs),
                    self.entry.rank_depth)
        in_data = tuple([x._data[0] for x in input_vars])
        self._input_layouts = (None,) * len(input_vars)
        self._input_indexes_to_retain = None
        self._output_indexes_to_retain = None
        outputs = _on_device(self.entry, self.forward, in_data)
        self._output_layouts = (None,) * len(outputs)
        self._output_count = len(outputs)
        requires_grad = any([x.requires_grad for x in input_vars])
        ret = tuple([_variable(y, requires_grad) for y in outputs])
        if configuration.config.enable_backprop:
            self.rank = (max([x.rank for x in input_vars])
                         if input_vars else 0) + self.entry.rank_depth
            for y in ret:
                y.creator_node = self
            self.inputs = tuple([x.node for x in input_vars])
            self.outputs = tuple([weakref.ref(y.node) for y in ret])
            self.lazy_grad_sum = configuration.config.lazy_grad_sum
        return ret


    def forward(self, inputs):
        entry = self.entry
        with entry.lock:
            if entry.static_storages and entry.owner is not None:
                owner = entry.owner()
                if owner is not None and not owner.done:
                    owner.snapshot = _snapshot(entry)
            elif entry.bind_pending and entry.unbound_snapshot is None:
                # (The recording call, whose backward built the entry in
                # another thread, is not bound to it yet: its values.)
                entry.unbound_snapshot = (
                    _snapshot(entry) if entry.static_storages else None,
                    _node_values(entry) if entry.node_values else None)
            # (Also while there are no static storages: a graph captured
            # in this very call adds some.)
            entry.owner = weakref.ref(self)
            entry.quiet = not entry.pending
            result = entry.run_forward(inputs)
            if entry.node_values:
                self.node_values = _node_values(entry)
            n = len(entry.forward.outputs)
            # Copy what later calls rewrite while no other thread can.
            outs = tuple(arrayutil.hand_out(o, how) if how else o
                         for o, how in zip(result[:n], entry.out_copy))
            if entry.backward is not None and \
                    chainer.config.enable_backprop:
                # (Under the lock: a call of another thread must see this
                # one waiting, before it captures a graph.)
                entry.pending.add(self)
                self.saved = result[n:n + len(entry.saved)]
                if entry.saved_outputs:
                    self.handed = dict((i, outs[i])
                                       for i in entry.saved_outputs)
            else:
                self.done = True
        self.exposed = result[n + len(entry.saved):]
        return outs

    backward_accumulate = accumulate

    def backward(self, indexes, grad_outputs):
        return self.backward_from(indexes, grad_outputs)[0]


def _repeats_backward(entry):
    """A second backward came through a recording call of ``entry``'s key:
    its calls keep their saved activations for another backward."""
    if not entry.repeat_backward:
        entry.repeat_backward = True
        diagnostics.logger.info(
            '%s: a second backward through one call; calls keep their '
            'saved activations for another backward', entry.method_name)


class RecordNode(_Replayed, function_node.FunctionNode):
    """The recording call: forward already ran define-by-run; backward runs
    the inner graph's backward while recording it, then builds the entry.
    A second backward (the DCGAN updater's) runs the built backward
    schedule on the recording's own saved arrays (``bind``), or, where no
    entry was built, the inner graph's backward again."""

    def __init__(self, capture, out_arrays, entry, how):
        self.capture = capture   # capture.Capture: records the backward
        self.out_arrays = out_arrays
        self.how = how    # per output: a copy, or the chain's memory
        self.built = entry     # the entry this call's backward builds
        self.handed = None
        self.again = None     # the capture, for a backward through the inner
        #                       graph again
        self.entry = None
        self.saved = None
        self.snapshot = None
        self.done = False
        self.cut = set()      # outputs cut from it (cuts.py)
        self.state_grads = None   # (recurrent.note_state_gradients)

    def _check_data_type_forward(self, in_data):
        pass

    @property
    def label(self):
        return 'StaticGraphRecording'

    backward_accumulate = accumulate

    def forward(self, inputs):
        self.handed = tuple(arrayutil.hand_out(a, how)
                            for a, how in zip(self.out_arrays, self.how))
        return self.handed

    def bind(self, entry):
        """The entry built from this call: the static buffers hold this
        call's values, its saved arrays are the recording's."""
        self.entry = entry
        with entry.lock:
            self.saved, entry.recording_saved = entry.recording_saved, None
            self.bound_replays = entry.replays
            unbound, entry.unbound_snapshot = entry.unbound_snapshot, None
            entry.bind_pending = False
            if unbound is None:
                if entry.node_values:
                    self.node_values = _node_values(entry)
                entry.owner = weakref.ref(self)
            else:
                # A call of another thread replayed since the build: the
                # static buffers and the nodes hold its values; this
                # call's were put aside (ReplayNode.forward). (That replay
                # counts as one since: it rebound what the recorded nodes
                # hold.)
                self.snapshot, values = unbound
                if values is not None:
                    self.node_values = values
                self.bound_replays -= 1

    def backward_from(self, indexes, grad_outputs, earlier=()):
        self.backward_ran = True     # (cuts.py)
        if self.capture is not None:
            cuts.check(self, _read_inside(self), self.capture.name)
            return self.backward(indexes, grad_outputs), ()
        if self.entry is not None:
            _repeats_backward(self.entry)
            try:
                return _Replayed.backward_from(self, indexes, grad_outputs,
                                               earlier)
            except masked.NotRecordedBackward:
                if self.again is None or \
                        self.entry.replays != self.bound_replays:
                    # (A replay since rebinds what the recorded nodes
                    # hold: a dropout's mask, a user node's values.)
                    raise
                # (The key falls back; this call's inner graph is kept.)
        if self.again.served_by is not None:
            # (The entry built from another call of this key.)
            _repeats_backward(self.again.served_by)
        held = dict((i, g) for i, g in zip(indexes, earlier)
                    if g is not None)
        grads = self.again.backward(grad_outputs, held)
        return tuple(grads[i] for i in indexes), set(held)

    def take_caller_writes(self, capture):
        """What the caller did to the outputs since the call, the
        recorded nodes see as define-by-run's would."""
        new = replaced_outputs(self, dict(enumerate(self.handed)))
        for i, (mine, out) in enumerate(zip(self.handed, self.out_arrays)):
            if i in new:
                # Given another array (``y.array = y.array * 3``): the
                # recorded nodes that kept it read a copy of that, as
                # define-by-run's read the new one; a recording that saw
                # this does not replay.
                capture.inner_outs[i].array = arrayutil.copy_exact(new[i])
                capture.rec.add_reason(
                    'output %d was given another array (y.array = ...) '
                    'before the backward of the recording call' % i)
            elif arrayutil.changed(out, mine):
                # The caller wrote into it (``y.array *= 3``): nodes that
                # retained it (sigmoid, tanh, relu) see the change under
                # define-by-run, and in replay (the same array).
                arrayutil.copyto_for((out,))(out, mine)
        self.handed = None

    def backward(self, indexes, grad_outputs):
        capture, self.capture = self.capture, None
        if capture is None:
            return self.backward_from(indexes, grad_outputs)[0]
        self.take_caller_writes(capture)
        # With more than one output alive, another backward may come
        # through other outputs than this one's (feature matching: ``y``,
        # then ``h``), which the schedules built from this one would not
        # know: the recorded nodes keep what they retained while this node
        # lives, as define-by-run's would.
        capture.keep_graph = sum(
            ref() is not None for ref in self.outputs or ()) > 1
        built = self.built
        built.bind_pending = True       # (until self.bind)
        try:
            grads = capture.backward(grad_outputs)
        except BaseException:
            # (A node's backward raised, or KeyboardInterrupt: this
            # recording builds nothing. A backward again, loss.backward()
            # retried, runs the inner graph's, unrecorded.)
            _no_bind(built)
            capture.failed = True
            self.built = None
            self.again = capture
            raise
        if capture.spliced:
            # Its recorded nodes are the caller's: define-by-run's graph
            # from now on, without this node.
            splice.outputs_onto(self, capture.inner_outs, capture.made)
        e, self.built = self.built, None
        if e.recording_saved is not None:
            self.bind(e)
            if capture.keep_graph:
                self.again = capture
                from static_graph import build
                weakref.finalize(self, build.release_nodes, capture.rec)
        else:
            _no_bind(e)
            self.again = capture
        return tuple(grads[i] for i in indexes)


def _no_bind(entry):
    with entry.lock:
        entry.bind_pending = False
        entry.unbound_snapshot = None
