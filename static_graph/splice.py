"""A recording that falls back while its forward runs becomes the
define-by-run call it stands for (capture.py).

The recording ran the method on its own copies of the caller's Variables
(and of the state its links hold from earlier calls). Its forward is
define-by-run's, on equal arrays; only the copies stand between that graph
and the caller's. ``into_caller`` moves the graph onto the caller's
Variables: the nodes that read a copy read the caller's Variable instead,
and every node's rank is what define-by-run would have given it. The
caller's backward then runs through those nodes in define-by-run's order,
summing gradient contributions where define-by-run sums them (a
recording node in their place sums the call's own contributions first).
"""
import weakref

import chainer

from schedules import ir


def into_caller(nodes, pairs, roots):
    """Rewire the recorded forward onto the caller's Variables.

    nodes: the recording's forward nodes, in the order they ran (and those
        a double backpropagation through them made, after them: ``Made``).
    pairs: (copy, caller's Variable) for each Variable the method got a
        copy of.
    roots: the Variables the call hands out (its outputs, those it keeps).

    Returns False, and changes nothing, where a node the recording did not
    see reads a copy (it would not be moved). (Nodes of the caller's graph
    that the method reached otherwise, through a Variable it found
    elsewhere, are define-by-run's already.)
    """
    to_caller = _to_caller(pairs)
    recorded = set(map(id, nodes))
    seen, stack = set(), [v.creator_node for v in roots
                          if v.creator_node is not None]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        for vn in node.inputs:
            if id(node) not in recorded and id(vn) in to_caller:
                return False
            if vn.creator_node is not None:
                stack.append(vn.creator_node)
    ranks = _caller_ranks(nodes, to_caller)
    for node in nodes:
        inputs = node.inputs
        if inputs is None:       # (applied without backprop)
            continue
        if any(id(vn) in to_caller for vn in inputs):
            new = []
            for vn in inputs:
                caller = to_caller.get(id(vn))
                if caller is not None:
                    if vn.data is not None:     # retained by the node
                        caller.retain_data()
                    vn = caller
                new.append(vn)
            node.inputs = tuple(new)
        node.rank = ranks[id(node)]
        for ref in node.outputs:
            out = ref()
            if out is not None:
                out._rank = node.rank + 1
    return True


def _to_caller(pairs):
    """{id(a copy's node): the caller's Variable's node}."""
    return dict((id(copy.node), caller.node) for copy, caller in pairs
                if copy is not caller and isinstance(caller, chainer.Variable))


def _caller_ranks(nodes, to_caller):
    """{id: rank} of the recorded ``nodes`` and their outputs' nodes once
    they read the caller's Variables (``to_caller``): FunctionNode.apply's
    ranks, from the caller's (into_caller sets them; _ranks_kept compares
    them first)."""
    rank = {}
    for f in nodes:
        if f.inputs is None:     # (applied without backprop)
            continue
        rank[id(f)] = f_rank = max(
            [to_caller[id(vn)].rank if id(vn) in to_caller else
             rank.get(id(vn), vn.rank) for vn in f.inputs] or [0])
        for ref in f.outputs:
            out = ref()
            if out is not None:
                rank[id(out)] = f_rank + 1
    return rank


def outside_graph(rec, own):
    """Why replay would lose gradients, where a recorded op reads a
    Variable from outside the call that is no argument and no state of the
    chain's links (found in a global, a dict or a helper object): one made
    by a node outside the call (replay would read its array and not
    backpropagate into its graph), or a leaf that needs a gradient and
    holds an array the call did not make (SAC's ``log_alpha`` kept on the
    agent: replay would give it none). ``own``: ids of the leaves the
    recording made (the links' state, detached). None where there is
    none."""
    recorded = set(id(op.node) for op in rec.forward_ops)
    for op in rec.forward_ops:
        for vn in op.node.inputs or ():
            creator = vn.creator_node
            if creator is not None:
                # (One that takes no gradient has none to lose.)
                if id(creator) not in recorded and vn.requires_grad:
                    return ('the op at %s (%s) reads a Variable made '
                            'outside the call (by %s) that is no argument; '
                            'replay would not backpropagate into its graph '
                            '(pass it as an argument)'
                            % (op.source, op.node.label, creator.label))
                continue
            v = vn.get_variable_or_none() if vn.requires_grad else None
            if v is None or isinstance(v, chainer.Parameter) or \
                    id(v) in own or v.raw_array is None or \
                    v.raw_array.size == 0:   # (ChainerMN's delegate)
                continue
            b = rec.by_id.get(id(v.raw_array))
            if b is None or rec.buffers[b].role == ir.CONST:
                return ('the op at %s (%s) reads a Variable that needs a '
                        'gradient, no function made and no argument or '
                        'Parameter is (a global, a helper object\'s '
                        'attribute); replay would give it none (pass it '
                        'as an argument, or make it a Parameter of a link)'
                        % (op.source, op.node.label))
    return None


def movable(inner_outs):
    """Can ``outputs_onto`` make the call's outputs the recorded nodes'?
    Not where an output has no recorded node behind it (an argument
    returned as it is) or one recorded Variable is handed out twice
    (``return y, y``; kept on ``self`` and returned): define-by-run's one
    Variable is two of the recording node's."""
    ids = [id(v) for v in inner_outs]
    return len(set(ids)) == len(ids) and all(
        v.creator_node is not None for v in inner_outs)


def outputs_onto(node, inner_outs, nodes):
    """The recording node's output Variables made the recorded Variables
    ``inner_outs`` (``movable``): the nodes that made them, and the nodes
    that read them (``nodes``, as for ``into_caller``), take the node's
    outputs instead. Once its nodes are the caller's (``into_caller``), the
    node leaves the graph and a later backward runs define-by-run's."""
    moves = {}
    for ref, inner in zip(node.outputs, inner_outs):
        outer = ref()
        if outer is not None:
            moves[id(inner.node)] = outer
    for inner in inner_outs:
        outer = moves.get(id(inner.node))
        if outer is None:
            continue
        inner = inner.node
        creator = inner.creator_node
        creator.outputs = tuple(weakref.ref(outer) if r() is inner else r
                                for r in creator.outputs)
        outer.creator_node = creator
        if inner.data is not None:        # (retained by its node)
            outer.data = inner.data
    for f in nodes:
        if f.inputs is not None and any(id(vn) in moves for vn in f.inputs):
            f.inputs = tuple(moves.get(id(vn), vn) for vn in f.inputs)


def let_go_waiting(cache):
    """Calls of ``cache``'s method wait for their backward
    (``cache.calls_waiting``) only as recordings made while its new keys
    were on probation (``cache.must_repeat``; an earlier call's output
    alive, no backward yet: evaluation with backprop on, over keys that do
    not repeat): each becomes the define-by-run call it stands for
    (``dissolve``), so that a call can run define-by-run next to them.
    False where calls still wait (a replay, another recording)."""
    with cache.lock:
        waiting = [e for e in cache.entries.values()
                   if e.state == 'recording' or e.pending]
    if any(e.pending or e.dissolvable is None for e in waiting):
        return False
    for e in waiting:
        node = e.dissolvable()
        if node is not None and not dissolve(node):
            return False
    return not cache.calls_waiting()


def _ranks_kept(node, nodes, pairs, inner_outs):
    """Would each of ``node``'s outputs keep its rank, once the recorded
    nodes read the caller's Variables (``into_caller``) and make them
    (``outputs_onto``)? The caller's nodes built on an output since took
    their ranks from it; the node gives every output the deepest one's
    (``nodes.deepen``), so a shallower output of a call with several
    would leave them above define-by-run's, and its backward would take
    nodes in another order (review40: gradients 3.8e-6 off)."""
    rank = _caller_ranks(nodes, _to_caller(pairs))
    for ref, inner in zip(node.outputs, inner_outs):
        outer = ref()
        if outer is not None and \
                rank.get(id(inner.node), inner.node.rank) != outer.rank:
            return False
    return True


def dissolve(node):
    """The recording node ``node`` (nodes.RecordNode), whose call waits for
    its backward, becomes the define-by-run call it stands for: its
    recorded nodes read the caller's Variables (``into_caller``) and make
    its outputs (``outputs_onto``), with what the caller did to the
    outputs since; the recording is let go (its key records again). So a
    call that is to run define-by-run (``let_go_waiting``) does so next
    to define-by-run's graph, summing gradients where define-by-run does.
    False, changing nothing, where it cannot: a stand-in recording, one
    that carries state from earlier calls, outputs not ``movable``, a
    backward that came already."""
    from static_graph import entry as entry_module
    capture = node.capture
    if capture is None or node.handed is None or capture.stand_in or \
            capture.carries_state or capture.entry.recurrent or \
            not movable(capture.inner_outs):
        return False
    made = [op.node for op in capture.rec.forward_ops]
    pairs = list(zip(capture.inner, capture.leaves))
    if not _ranks_kept(node, made, pairs, capture.inner_outs) or \
            not into_caller(made, pairs, capture.inner_outs):
        return False
    node.take_caller_writes(capture)
    outputs_onto(node, capture.inner_outs, made)
    node.capture = None
    capture.patched.release()
    e, cache = capture.entry, capture.cache
    with cache.lock:
        if e.state == entry_module.RECORDING:
            e.move(entry_module.DISCARDED)
        cache.discard(capture.key, e)
    return True


class Made(chainer.FunctionHook):
    """The nodes applied while it is on (in this thread), in order: those a
    double backpropagation through the recorded nodes makes."""

    name = 'static_graph_made'

    def __init__(self):
        self.nodes = []

    def forward_postprocess(self, function, in_data):
        self.nodes.append(function)


def double_backprop(capture, grad_outputs):
    """The backward of recording ``capture`` (capture.Capture) asked for
    double backpropagation (an input-gradient penalty): the gradients
    keep their graph, through the recorded call's own nodes, moved onto
    the caller's Variables (``into_caller``), to the parameters and the
    inputs. Replay cannot give either, so the key runs define-by-run from
    now on."""
    from static_graph import entry as entry_module
    from static_graph import reloads
    e = capture.entry
    reason = ('its backward was asked for double backpropagation '
              '(enable_double_backprop=True), which replay cannot give')
    if e.state in (entry_module.RECORDING, entry_module.COMPLETE):
        capture.fall_back(reason)
    n = len(capture.leaves)
    can_move = movable(capture.inner_outs)
    outs, gys, more, _ = reloads.outputs_and_gradients(
        capture, grad_outputs, keep=False)
    made = Made()
    if can_move or not any(t < n for t in capture.targets):
        with made:
            grads = capture._backprop(outs, gys, more,
                                   enable_double_backprop=True)
    # (RecordNode.backward then makes the call's outputs theirs.)
    capture.made = [op.node for op in capture.rec.forward_ops] + made.nodes
    capture.spliced = can_move and into_caller(
        capture.made, list(zip(capture.inner, capture.leaves)), capture.inner_outs)
    if not capture.spliced and any(t < n for t in capture.targets):
        raise NotImplementedError(
            'double backpropagation through the recording call of a '
            'static graph to its input Variables is not supported '
            'here: %s falls back to define-by-run from its next call; '
            'run this call with chainer.config.use_static_graph = False'
            % capture.name)
    result = [None] * (len(capture.leaves) + len(capture.param_objs))
    for pos, g in zip(capture.targets, grads):
        result[pos] = g
    return result
