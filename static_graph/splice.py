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


def into_caller(forward_ops, pairs, roots):
    """Rewire the recorded forward onto the caller's Variables.

    forward_ops: the recording's forward ops, in the order they ran.
    pairs: (copy, caller's Variable) for each Variable the method got a
        copy of.
    roots: the Variables the call hands out (its outputs, those it keeps).

    Returns False, and changes nothing, where a node the recording did not
    see reads a copy (it would not be moved). (Nodes of the caller's graph
    that the method reached otherwise, through a Variable it found
    elsewhere, are define-by-run's already.)
    """
    to_caller = {}
    for copy, caller in pairs:
        if copy is not caller and isinstance(caller, chainer.Variable):
            to_caller[id(copy.node)] = caller.node
    recorded = set(id(op.node) for op in forward_ops)
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
    for op in forward_ops:
        node = op.node
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
        # (FunctionNode.apply's ranks, from the caller's.)
        node.rank = max([vn.rank for vn in node.inputs]) \
            if node.inputs else 0
        for ref in node.outputs:
            out = ref()
            if out is not None:
                out._rank = node.rank + 1
    return True


def outside_graph(forward_ops):
    """Why replay would lose gradients, where a recorded op reads a
    Variable made by a node outside the call (a Variable with a graph
    found in a global, a dict or a helper object, no argument and no state
    of the chain's links): replay reads its array and would not
    backpropagate into its graph. None where there is none."""
    recorded = set(id(op.node) for op in forward_ops)
    for op in forward_ops:
        for vn in op.node.inputs or ():
            creator = vn.creator_node
            if creator is not None and id(creator) not in recorded:
                return ('the op at %s (%s) reads a Variable made outside '
                        'the call (by %s) that is no argument; replay '
                        'would not backpropagate into its graph (pass it '
                        'as an argument)' % (op.source, op.node.label,
                                             creator.label))
    return None


def outputs_onto(node, inner_outs):
    """The recording node's output Variables made outputs of the recorded
    nodes that made ``inner_outs``: once its nodes are the caller's
    (``into_caller``), the node leaves the graph and a later backward runs
    define-by-run's. Returns False, and changes nothing, where an output
    has no recorded node behind it (an argument returned as it is) or one
    recorded Variable is returned twice."""
    moves, seen = [], set()
    for ref, inner in zip(node.outputs, inner_outs):
        outer = ref()
        if outer is None:
            continue
        creator = inner.creator_node
        if creator is None or id(inner.node) in seen:
            return False
        seen.add(id(inner.node))
        moves.append((outer, inner.node, creator))
    for outer, inner, creator in moves:
        creator.outputs = tuple(weakref.ref(outer) if r() is inner else r
                                for r in creator.outputs)
        outer.creator_node = creator
    return True
