"""One recording call, from the first application to the built entry.

``Capture`` is the whole recording step of one call: ``forward`` runs the
method define-by-run under the recorder on copies of its arguments and
hands out the results through a ``RecordNode``; that node's backward calls
``backward``, which records the first backward, then builds the entry
(``Entry.build``) or falls back. Nothing else calls into a capture: it
reads the recorder, the analysis and the entry, and they never call back.

    decorator.wrapper -> Capture.forward -> recorder (the method runs)
                                         -> link_state (what it did to
                                            the chain)
    RecordNode.backward -> Capture.backward -> recorder (the backward runs)
                                            -> Capture.build -> Entry.build
"""
import sys
import weakref

import chainer

from static_graph import arrayutil
from static_graph import analysis
from static_graph import arguments
from static_graph import build
from static_graph import cuts
from static_graph import cache as cache_module
from static_graph import diagnostics
from static_graph import early_bound
from static_graph import entry as entry_module
from static_graph import generators
from static_graph import key_constants
from static_graph import kept_memory
from static_graph import link_state
from static_graph import link_values
from static_graph import nodes
from static_graph import outputs
from static_graph import patches
from static_graph import reach
from static_graph import recorder
from static_graph import recurrent
from static_graph import reloads
from static_graph import signature
from static_graph import splice
from static_graph.gc_pause import with_gc_paused


class Unreplayable(Exception):
    """Found while building: the recording cannot be replayed faithfully."""


class Capture(object):
    """The recording of one call of ``method`` on ``chain`` for ``key``
    (``prev``: the key's earlier entry, if any; ``why``: why it records
    again, for the retrace warning)."""

    def __init__(self, chain, method, name, cache, key, why=None,
                 prev=None, stand_in=False):
        self.chain = chain
        self.stand_in = stand_in   # (stand_in.py)
        self.spliced = False       # its nodes moved onto the caller's
        self.failed = False        # its recorded backward raised
        self.unreachable = False   # its key lacks slots it found (cache.kept)
        self.carries_state = False
        self.on_probation = False  # (recorded as calls waited: decorator)
        self.base = None           # (its key's arguments, config): decorator
        self.method = method
        self.name = name
        self.cache = cache
        self.key = key
        self.why = why
        self.prev = prev
        self.rec = recorder.Recording(chain)
        self.entry = entry_module.Entry(key, name)
        self.entry.label = '%s.%s' % (type(chain).__name__, name)
        # Another call of this key records and waits for its backward (a
        # loss summed over calls: PTB's truncated BPTT): not a retrace.
        self.repeat = prev is not None and \
            prev.state == entry_module.RECORDING
        self.served_by = None   # the entry that serves this key, if not ours
        # The recorded nodes keep what they retained after the build: another
        # output may still get a backward of its own (RecordNode.backward).
        self.keep_graph = False
        # State outputs whose gradient the caller added to (recurrent.py).
        self.state_summed = ()

    # -- the forward ----------------------------------------------------------
    @with_gc_paused
    def forward(self, args, kwargs, leaves, paths):
        """Run the method on copies of its arguments while recording;
        returns what the call returns (outputs of a RecordNode when a
        backward is to be recorded)."""
        # (The wrappers installed once for the forward and its backward.)
        self.patched = patches.Hold()
        try:
            out = self._forward(args, kwargs, leaves, paths)
        except BaseException:
            self.patched.release()
            raise
        if self.entry.state != entry_module.RECORDING:
            self.patched.release()   # no backward to record
        return out

    def _forward(self, args, kwargs, leaves, paths):
        rec, chain, e = self.rec, self.chain, self.entry
        rec.call_frame = id(sys._getframe())    # (key_constants.maker)
        inner, leaf_bids = arguments.inner_arguments(rec, leaves, paths)
        made = []
        new_args, new_kwargs = signature.rebuild(args, kwargs, inner, made)
        held_args = arguments.containers(new_args, new_kwargs)
        detached = link_state.detach_link_variables(
            chain, rec, self.cache.written + self.cache.state_slots)
        snapshot = link_state.snapshot_links(chain)
        held_links = link_state.held_links(chain)
        links = list(chain.links())
        classes = set(type(link) for link in links)
        named = []
        functions = reach.reachable_functions(
            self.method, classes,
            set(link.__class__ for _, link in held_links),
            links + [l for _, l in held_links], named)
        root_hooks, around = link_state.hook_scopes(
            chain, self.name, self.method, held_links)
        watch = link_values.Watch(snapshot, functions,
                                  list(classes) + named, root_hooks,
                                  held=held_links, around=around)
        held = link_state.trace_held_arrays(chain, rec)
        rngs = generators.snapshot(chain, watch.named_globals,
                                   watch.named_closures, watch.classes_seen)
        stand_ins, draws = generators.stand_ins(rngs)
        stand_ins += early_bound.stand_ins(chain, watch)
        with rec:
            shown = watch.trace_arrays(rec)
            try:
                out = self.method(chain, *new_args, **new_kwargs)
            except BaseException:
                arguments.sync_gradients(None, inner, leaves, paths)
                arguments.check_containers(None, held_args, made, inner,
                                           leaves, self.method, chain)
                generators.put_back(stand_ins)
                link_state.put_back(detached)   # the caller's Variables
                link_state.untrace_held(chain, held)
                watch.put_back_arrays(shown)
                raise
            generators.put_back(stand_ins)
            link_state.untrace_held(chain, held)
            watch.put_back_arrays(shown)
            arguments.sync_gradients(rec, inner, leaves, paths)
            arguments.attributes_set(rec)
            arguments.check_containers(rec, held_args, made, inner, leaves,
                                       self.method, chain)
            for what in generators.unseen(rngs, draws):
                rec.add_reason(generators.reason(what))
            rec.check_writes()
            link_state.left_in_containers(rec, watch, snapshot)
            outside = splice.outside_graph(
                rec, set(id(d[3]) for d in detached))
            if outside:
                rec.add_reason(outside)
            watch.drop_call_outputs()
            recheck = (watch.changed_by_call() +
                       link_state.added_or_deleted(snapshot)) or None
            if recheck:
                kept_memory.untrace_containers(rec,
                                               watch.changed_containers())
            if recheck and self.prev is not None and self.prev.recheck:
                # A memo fills once; this changes at every call.
                for what in recheck:
                    rec.add_reason(
                        'the method changes %s at every call (a list '
                        'appended to, a dict entry, a global or a '
                        "helper object's attribute set); replay would not "
                        'repeat that' % what)
            link_state.write_back_inputs(rec, leaves, inner, leaf_bids)
            out_spec, inner_outs, out_bids, out_kinds = outputs.recorded(
                rec, out, lambda: outputs.live_ids(outputs.roots(
                    snapshot, functions, classes, args, kwargs)))
            attr_writes = link_state.attr_changes(
                rec, snapshot, set(id(d[3]) for d in detached),
                watch.helper_snapshot)
            copies = set(id(v) for v, a in zip(inner, leaves)
                         if v is not a and isinstance(a, chainer.Variable))
            for d, k, _, kind in attr_writes:
                if kind == 'V' and id(d[k]) in copies:
                    rec.add_reason('it keeps an argument Variable on self '
                                   '(%s = x), which replay would not' % k)
            recurrent = link_state.reattach(rec, detached)
            n_outs = len(out_bids)
            # (output index, link __dict__, name) per Variable the method
            # left on a link that is an output of the call
            self.out_slots = []
            if chainer.config.enable_backprop:
                # A kept Variable in the graph (``self.hidden = h``) is a
                # hidden output, so a loss computed from it outside
                # backpropagates; unless the method returns that very
                # Variable (not its array: ``return loss.array``).
                for d, k, b, kind in attr_writes:
                    v = d[k]
                    if kind != 'V' or not v.requires_grad or \
                            v.creator is None:
                        continue
                    i = next((i for i, o in enumerate(inner_outs)
                              if v is o), None)
                    if i is None:
                        i = len(inner_outs)
                        out_bids.append(b)
                        out_kinds.append('V')
                        inner_outs.append(v)
                    self.out_slots.append((i, d, k))
        rec.phase = 'done'
        self.cache.tally[0] += 1     # (Cache.recordings)
        if self.repeat:
            self.cache.repeats += 1
        else:
            cache_module.maybe_warn_retrace(self.cache, self.key, self.why)
        # Recurrent state (Variables the links hold from an earlier call,
        # L.LSTM's h and c) that the method read: inputs of this call and
        # of every replay of its key, after the arguments; its gradient
        # flows into the earlier call, as in define-by-run. What such state
        # holds (None after reset_state(), its shape) is part of the key
        # from now on.
        leaves = list(leaves) + [r[2] for r in recurrent]
        inner = inner + [r[3] for r in recurrent]
        leaf_bids = leaf_bids + [r[5] for r in recurrent]
        e.recurrent = tuple((r[0], r[1]) for r in recurrent)
        if recurrent or self.out_slots:   # (kept on links, maybe long)
            self.patched.release()
        before = len(self.cache.kept), self.cache.kept_epoch
        self.cache.note_slots(
            e.recurrent,
            [(d, k) for d, k, _, kind in attr_writes if kind == 'V'],
            [(d, k) for d, k, _, kind in attr_writes if kind in 'VA'])
        # Keys from now on say whether those slots hold one (cache.kept):
        # none will be this one, whose entry is built for its own backward
        # only.
        self.unreachable = (len(self.cache.kept),
                            self.cache.kept_epoch) != before
        # (Where it kept Variables, recurrent state, or carried an array
        # from call to call: the next call would fall back too; arrays
        # alone may be a memo the next call reuses and replays: fall_back.)
        self.carries_state = rec.carries_state or any(
            kind == 'V' for _, _, _, kind in attr_writes)
        written = set((id(d), k) for d, k, _, _ in attr_writes)
        self.written = written
        held_links = link_state.held_links(chain)    # (after the call)
        self.chain_map = analysis.chain_arrays(chain, written, held_links)
        self.foreign = link_state.foreign_parameters(rec, self.chain_map)
        if self.foreign:
            self.chain_map.update(self.foreign)
        params, persists = analysis.classify_unknown(rec, self.chain_map)
        self.aliases = outputs.chain_aliases(rec, self.chain_map, out_bids,
                                             out_kinds, attr_writes)
        shared = analysis.shared_parameter_arrays(chain, rec, params,
                                                  held_links)
        if shared:
            rec.add_reason('parameters %s and %s hold the same array; '
                           'replay would give its gradients to one of them '
                           'only (share the Parameter or link instead)'
                           % tuple(sorted(shared[0][:2])))
            # This call's backward still gives each its gradient.
            params += [(bid, path, p) for _, path, bid, p in shared]

        e.recheck = recheck
        e.n_outs = n_outs   # the method's outputs; hidden ones follow
        e.no_grad_outs, e.leaf_outs = outputs.detached(rec, inner_outs,
                                                       out_bids)
        e.sibling_outputs = reloads.sibling_outputs(rec, inner_outs,
                                                    out_bids)
        self.leaves, self.inner, self.leaf_bids = leaves, inner, leaf_bids
        self.inner_outs, self.out_bids, self.out_kinds = \
            inner_outs, out_bids, out_kinds
        self.out_spec, self.n_outs = out_spec, n_outs
        self.attr_writes, self.watch = attr_writes, watch
        self.params, self.persists = params, persists
        self.param_objs = [p for _, _, p in params]
        self.reports = [(weakref.ref(obs) if obs is not None else None, items)
                        for obs, items in rec.reports]
        need_backward = any(
            v.requires_grad and v.creator is not None for v in inner_outs)
        if need_backward and not chainer.config.enable_backprop:
            # (``chainer.force_backprop_mode()`` inside, called under
            # no_backprop_mode: the key says no graph, the call made one.)
            rec.add_reason(
                'it makes a graph under force_backprop_mode() while called '
                'under no_backprop_mode(), which replay, keyed by the '
                "caller's mode, would not")
        if not need_backward:
            return self._finish_without_backward(out)
        if rec.reasons:
            self.fall_back(rec.reasons[0])
            if not self.stand_in and splice.into_caller(
                    [op.node for op in rec.forward_ops],
                    list(zip(inner, leaves)), inner_outs):
                # No recording node: this call is define-by-run's, its
                # arguments returned or kept the caller's Variables.
                self.patched.release()
                return self._handed_out(
                    inner_outs, zip(map(id, inner), leaves))
        else:
            self.cache.put(self.key, e)  # pending until its backward is seen
        # (A Variable given twice gets its gradient once, at its first
        # position: one inner Variable gathered every use's.)
        self.targets = [
            i for i, leaf in enumerate(leaves)
            if isinstance(leaf, chainer.Variable) and leaf.requires_grad
            and leaf_bids.index(leaf_bids[i]) == i]
        self.targets += [len(leaves) + j for j in range(len(params))]
        self.target_vars = [inner[i] if i < len(leaves) else
                            self.param_objs[i - len(leaves)]
                            for i in self.targets]
        node = nodes.RecordNode(
            self, [v.raw_array for v in inner_outs], e,
            outputs.hand_modes(self.aliases, out_bids, out_kinds))
        # Whether a backward comes through this call, for the cache once
        # the node is let go (evaluation outside no_backprop_mode).
        self.seen = [False]
        # (A stand-in recording's capture outlives the node: its backward
        # is recorded at the next call, from a stand-in gradient.)
        weakref.finalize(node, self.cache.recording_died, self.key, e,
                         self.seen, self if self.stand_in else None)
        weakref.finalize(node, self.patched.release)
        e.dissolvable = weakref.ref(node) if self.on_probation else None
        e.rank_depth = nodes.output_depth(inner_outs)
        e.cut_reach = cuts.reach_of(inner_outs,
                                    list(inner) + self.param_objs)
        with chainer.force_backprop_mode():  # (forced inside: see above)
            applied = node.apply(list(leaves) + self.param_objs)
        outs = nodes.retain_outputs(nodes.deepen(node, applied, e.rank_depth))
        outs = nodes.detach_outputs(outs, e.no_grad_outs, e.leaf_outs)
        # An argument's array returned (``return loss, z``): the caller's
        # own, as define-by-run and replay hand it back, not the copy the
        # recording ran on.
        callers = dict((b, a.raw_array if isinstance(a, chainer.Variable)
                        else a) for b, a in zip(leaf_bids, leaves))
        vals = [callers.get(b, v.raw_array) if k == 'A' else
                outputs.handed(v, k)
                for v, k, b in zip(outs, out_kinds, out_bids)]
        link_state.keep_attrs(attr_writes, outputs.by_inner(inner_outs, outs),
                              rec, self.aliases, bool(rec.reasons))
        return outputs.rebuild(out_spec, vals[:n_outs])

    def _finish_without_backward(self, out):
        """No backward to record (no_backprop_mode, or nothing needs a
        gradient): build the forward-only entry now."""
        rec, e = self.rec, self.entry
        if rec.reasons:
            self.fall_back(rec.reasons[0])
            return out
        if not self._try_build():
            return out
        if not self.unreachable:
            self.cache.put(self.key, e)
        vals = []
        for v, how in zip(self.inner_outs, e.out_copy):
            vals.append(chainer.Variable(arrayutil.hand_out(v.raw_array, how),
                                         requires_grad=v.requires_grad)
                        if how else v)
        return self._handed_out(vals)

    def _handed_out(self, vals, more=()):
        """The call's result from ``vals`` (per inner output, what takes
        its place; ``more``: (id, object) pairs, the same for others), and
        the attributes the method set, as it leaves them."""
        by_inner = dict(more)
        vals = [by_inner.get(id(v), v) for v in vals]
        by_inner.update(outputs.by_inner(self.inner_outs, vals))
        link_state.keep_attrs(self.attr_writes, by_inner, self.rec,
                              self.aliases, bool(self.rec.reasons))
        vals = [outputs.handed(v, k) for v, k in zip(vals, self.out_kinds)]
        return outputs.rebuild(self.out_spec, vals[:self.n_outs])

    # -- finishing ------------------------------------------------------------
    def fall_back(self, reason):
        """The key runs define-by-run from now on, and says why once."""
        e = self.entry
        e.move(entry_module.FALLBACK, reason)
        self.cache.put(self.key, e)
        if self.unreachable and self.base is not None and \
                self.carries_state:
            # (Under the key the next call will have, the state it left.)
            spec, config = self.base
            self.cache.put(signature.Key(
                (spec + (self.cache.state_key(),), config)), e)
        self.cache.fell_back(self.key, reason)
        diagnostics.warn_once(
            (type(self.chain), self.name, reason),
            '%s.%s falls back to define-by-run for this call signature: %s'
            % (type(self.chain).__name__, self.name, reason))

    def _try_build(self, **backward):
        """Build and verify the entry; False (and the key falls back) where
        the recording cannot replay or the build fails."""
        rec = self.rec
        try:
            analysis.mark_captured(rec, self.chain_map)
            for reason in rec.late_reasons:
                rec.add_reason(reason)
            if rec.reasons:
                raise Unreplayable(rec.reasons[0])
            build.build(
                self.entry, rec, self.chain, len(self.leaves), self.leaf_bids,
                self.out_bids, self.out_kinds, self.out_spec, self.params,
                self.persists, attr_writes=self.attr_writes,
                reports=self.reports, link_values=self.watch,
                recompute=self.cache.recompute,
                plan_memory=self.cache.plan_memory,
                cuda_graph=self.cache.cuda_graph, aliases=self.aliases,
                threads=self.cache.threads, keep_nodes=self.keep_graph,
                **backward)
            self.entry.verify()
        except Unreplayable as err:
            self.fall_back(str(err))
            return False
        except Exception as err:   # never replay what did not verify
            self.fall_back('could not build a schedule (%s: %s)'
                           % (type(err).__name__, err))
            return False
        return True

    # -- the backward ---------------------------------------------------------
    def _backprop(self, outs, gys, more, earlier=None, **options):
        # ``return h, h``: chainer.grad keeps one gradient per output
        # Variable, so the gradients of the copies are added first (an op
        # of the recorded backward).
        for i, g in more:
            gys[i] = gys[i] + g
        # chainer.grad runs only the nodes on a path to the targets;
        # Variable.backward (define-by-run) runs every node whose input
        # needs a gradient. A node on no such path matters by its side
        # effects (ChainerMN's recv sends the gradient back in its
        # backward, from a Variable it made inside the method): the
        # method's own leaf Variables are targets too, their gradients
        # dropped.
        rec, target_vars = self.rec, self.target_vars
        extra = link_state.inner_leaves(rec, target_vars)
        if earlier is not None:
            # Gradients the targets hold already, added where define-by-run
            # adds them (before the contributions, in their order).
            options['grad_inputs'] = list(earlier) + [None] * len(extra)
        grads = chainer.grad(outs, target_vars + extra, grad_outputs=gys,
                             **options)
        n = len(target_vars)
        if rec.phase == 'backward':
            # What those backward() steps returned for them: buffers, so
            # that the steps resolve (their gradients go nowhere).
            for g in grads[n:]:
                if g is not None and g.raw_array is not None:
                    rec.buffer_of(g.raw_array, 'a gradient')
        return grads[:n]

    @with_gc_paused
    def backward(self, grad_outputs, earlier=None):
        """The recording call's backward (RecordNode.backward); called
        again for a second backward through it where no entry was built,
        with ``earlier``: {input position: the gradient it holds}, which
        the results include."""
        self.seen[0] = True
        if chainer.config.enable_backprop:
            return splice.double_backprop(self, grad_outputs)
        rec, e, targets = self.rec, self.entry, self.targets
        recording = e.state == entry_module.RECORDING and not self.failed
        given = grad_outputs
        if recording:
            grad_outputs = recurrent.state_gradients(self, grad_outputs)
        # (Not recording: the gradients as Chainer handed them, as the
        # nodes get them under define-by-run; a node that writes into its
        # gradient, F.hinge, writes into what other nodes read.)
        outs_for_grad, gys, more, grad_out_bids = \
            reloads.outputs_and_gradients(self, grad_outputs, keep=recording)
        if recording:
            rec.phase = 'backward'
            rec.labels = {id(op.node): op.source for op in rec.forward_ops}
            try:
                with rec:
                    grads = self._backprop(outs_for_grad, gys, more)
            finally:
                self.patched.release()
            if grad_outputs is given:
                self._write_back_gradients()
        else:
            grads = self._backprop(
                outs_for_grad, gys, more, earlier=None if earlier is None
                else [earlier.get(pos) for pos in targets])
        arrays = [g.raw_array if g is not None else None for g in grads]
        result = [None] * (len(self.leaves) + len(self.param_objs))
        for pos, a in zip(targets, arrays):
            result[pos] = a
        if recording:
            if grad_outputs is not given:
                # This call's own gradients: its state got none; the
                # inner graph's backward again, as define-by-run runs it
                # (not recorded), before the build lets the graph go.
                rec.phase = 'done'
                true = self._backprop(*reloads.outputs_and_gradients(
                    self, given, keep=False)[:3])
                true = [None if g is None else
                        arrayutil.copy_exact(g.raw_array) for g in true]
            result = self._finish(arrays, grad_out_bids, result)
            if grad_outputs is not given:
                result = [None] * len(result)
                for pos, a in zip(targets, true):
                    result[pos] = a
            recurrent.check_state_outputs(self)
        return [chainer.Variable(a) if a is not None else None
                for a in result]

    def _write_back_gradients(self):
        """What a node of the recorded backward wrote into the copy of a
        gradient it was handed (an old-style Function dividing its
        ``grad_outputs`` in place: F.hinge), written into the gradient
        Chainer handed this call: under define-by-run that node writes
        into it, and other nodes that read it after see the change."""
        arrayutil.write_back(self.grad_copies)
        self.grad_copies = []

    def _finish(self, arrays, grad_out_bids, result):
        """After the recorded backward: build the entry (or fall back, or
        discard the recording); the gradients handed out."""
        rec, e, targets = self.rec, self.entry, self.targets
        rec.phase = 'done'
        grad_in = [rec.buffer_of(a, 'a gradient') if a is not None
                   else None for a in arrays]
        more_params, _ = analysis.classify_unknown(rec, self.chain_map)
        if more_params:
            rec.add_reason('a parameter is used only in backward')
        key_constants.check_taken(rec, 'between the forward and the '
                                  'backward (written by the caller)')
        recurrent.check_sums(self, grad_in, grad_out_bids)
        now = analysis.chain_arrays(self.chain, self.written)
        now.update(link_state.foreign_parameters(rec, now)
                   if self.foreign else ())
        # (A recording of another thread may have traced views of the
        # links' arrays on them now.)
        views = link_state.HELD_VIEWS
        replaced = set(views.get(i, i) for i in now) != set(self.chain_map)
        # (A stand-in backward runs at the method's next call, not where a
        # backward of the user's would: arrays replaced before it are not
        # replaced midway; the entry is let go and the key records again.)
        if replaced and self.stand_in and \
                self.cache.replaced_between(self.key) >= 2:
            # (Before each call: recording each would cost more than
            # define-by-run.)
            rec.add_reason(cache_module.REPLACED_BETWEEN)
        if replaced and not self.stand_in and \
                self.cache.replaced_midway(self.key):
            # The second recording of this key to see it: its calls do
            # this every time, and recording each would cost more than
            # define-by-run.
            rec.add_reason(cache_module.REPLACED_MIDWAY)
        if replaced and not rec.reasons:
            # A parameter or persistent array was replaced (W.array = ...)
            # between the call and this backward, which read the new one:
            # not a recording of one consistent call. The next call records
            # again.
            self.cache.discard(self.key, e)
            e.move(entry_module.DISCARDED)
            diagnostics.logger.info(
                '%s.%s: a parameter array was replaced between the '
                'recorded call and its backward; not kept, the next call '
                'records again', type(self.chain).__name__, self.name)
        elif rec.reasons:
            self.fall_back(rec.reasons[0])
        elif getattr(self.cache.get(self.key), 'state',
                     None) == entry_module.FALLBACK:
            # Another call of this key fell back meanwhile (its backward
            # asked for double backpropagation): the key stays so.
            e.move(entry_module.DISCARDED)
            build.release_arrays(rec)
        elif (served := self.cache.covering(self.key, e, tuple(
                b is not None for b in grad_out_bids), self.chain)):
            # A later call of this key, recorded before this backward (a
            # loss summed over calls), built an entry that replays this
            # call too: building it again would give the same schedules
            # (34 of PTB's 35 calls in its first step). A second backward
            # through this call tells that entry (RecordNode.backward_from).
            self.served_by = served
            e.move(entry_module.DISCARDED)
            # (What a build would have let go of: the recorded nodes keep
            # what a second backward through them reads.)
            build.release_arrays(rec)
        elif self._try_build(grad_in=grad_in, grad_targets=targets,
                             grad_out_bids=grad_out_bids):
            # Calls of a truncated sequence record in one backward (the
            # last one's state gets no gradient): an entry whose outputs
            # got more gradients stays.
            kept = self.cache.covering(self.key, e, e.grad_out_mask,
                                       self.chain)
            if self.unreachable:
                self.cache.discard(self.key, e)
            elif kept is None or kept.grad_out_mask == e.grad_out_mask:
                self.cache.put(self.key, e)
        if e.state != entry_module.COMPLETE:
            return result
        bufs = rec.buffers
        result = [None] * len(result)
        for pos, a, b in zip(targets, arrays, grad_in):
            if a is not None and (bufs[b].static or bufs[b].role in
                                  entry_module.ESCAPE_ROLES):
                a = arrayutil.copy_exact(a)
            result[pos] = a
        return result
