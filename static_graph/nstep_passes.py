"""Two ``NStepLoop`` nodes of one link that meet in one backward pass
(nstep_loop.py).

A link runs as one node only while it is used once per backward (its
first use watched: ``nstep_loop._once_per_backward``). That rule counts
any backward between two uses as the end of the first; but a backward
that does not reach it (another model's loss) or reaches it only in part
(an auxiliary loss over its outputs) leaves the first use's graph to a
later backward that also reaches the second. Define-by-run then adds the
two uses' unrolled steps' gradient contributions to the weights
interleaved, in the order its backward reaches them, which two nodes
cannot give: 1.5e-8 to 2.4e-7 off, at every step, unwarned, until this
module. A use whose state comes from the other's (truncated BPTT, the
state carried without ``unchain_backward()``) reaches its steps only
after the other's, and the two nodes give define-by-run's bits.

So each backward pass (``loss.backward()`` and ``chainer.grad``: both are
counted) notes the nodes of each link whose backward ran in it; a second
one whose steps define-by-run would not reach wholly before or wholly
after the other's warns once, and the link stays unrolled from then on. The pass where that is first seen has run as two
nodes (its weights' gradients possibly off in the last bits); so has one
in which the link's first, watched, use was unrolled and the second ran
as one node."""
import threading
import warnings
import weakref

from static_graph import diagnostics

_state = threading.local()
_count = [0]      # passes begun (any thread)

def in_pass(fn, args, kwargs):
    """``fn(*args, **kwargs)``, a backward pass: the passes it runs inside
    it (a ``chainer.grad`` inside a node's backward) are others."""
    _count[0] += 1
    stack = getattr(_state, 'stack', None)
    if stack is None:
        stack = _state.stack = []
    stack.append(_count[0])
    try:
        return fn(*args, **kwargs)
    finally:
        stack.pop()


def current():
    """The pass this thread's backward is in, or None."""
    stack = getattr(_state, 'stack', None)
    return stack[-1] if stack else None


def backward_ran(node, use):
    """``node``'s (an NStepLoop's) backward runs in the current pass;
    ``use``: its link's record in nstep_loop._uses (index 5: the pass and
    weak references to the nodes whose backward ran in it). True where
    another node of the link met it there without either feeding the
    other's state: the link is to stay unrolled (warned here)."""
    now = current()
    if now is None:
        return False
    seen, nodes = use[5]
    if seen != now:
        use[5] = (now, [weakref.ref(node)])
        return False
    for r in nodes:
        other = r()
        if other is None or other is node or \
                _reached_after(other, node) or _reached_after(node, other):
            continue
        warnings.warn(
            'static_graph: an NStep RNN that ran as one node per use met '
            'another use of its weights in one backward (a backward '
            'between the two uses, another model\'s or a loss over the '
            'first, did not end the first use\'s graph); define-by-run '
            'adds their steps\' gradients interleaved, so the weights\' '
            'gradients of this backward can differ from define-by-run in '
            'the last bits. Its loops stay unrolled from now on.',
            diagnostics.StaticGraphWarning)
        return True
    nodes.append(weakref.ref(node))
    return False


# How many nodes back a node's initial h is followed to find the other.
_MAX_NODES = 200


def _reached_after(first, later):
    """Does define-by-run's backward reach each weight's unrolled steps of
    ``first`` (an NStepLoop) only after all of ``later``'s? It takes nodes
    highest rank first, equal ranks in the order they joined its heap.
    Where ``later``'s initial h was computed from ``first``'s final state
    (``_from_state``), ``later``'s recurrent linears rank above every node
    of ``first`` unrolled, so all of ``later``'s nodes but its first
    layer's input linears come first, and those join the heap before any
    of ``first``'s; of ``first``'s input linears, which add to the same
    weights, none may then rank above them. Not so for a state carried in
    c alone (h starts at zeros), or where ``first``'s inputs sit deeper in
    the graph than ``later``'s (review44). (The nodes' own ranks are no
    guide: one node's outputs rank where its inputs do, not where its
    unrolled steps would.)"""
    w = 2 if later.cell == 'lstm' else 0   # (the stacked weights' rank)
    if min(max(r, w) for r in later.in_ranks[2]) < \
            max(max(r, w) for r in first.in_ranks[2]):
        return False
    return _from_state(first, later)


def _from_state(first, later):
    """Was ``later``'s initial h computed from ``first``'s final h or c
    (through other NStepLoop nodes' states too: a truncated sequence
    carried over several windows), within _MAX_NODES nodes?"""
    finals = [r() for r in (first.outputs or ())[:first.n_state]]
    todo = [later.inputs[0]]
    seen = set()
    while todo and len(seen) < _MAX_NODES:
        v = todo.pop()
        if any(v is f for f in finals):
            return True
        f = v.creator_node
        if f is None or f is first or id(f) in seen:
            continue
        seen.add(id(f))
        # (Through another loop, by its states: each of its outputs
        # ranks above them unrolled.)
        todo.extend(f.inputs[:f.n_state] if isinstance(f, type(later))
                    else f.inputs)
    return False
