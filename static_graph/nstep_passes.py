"""NStep loops of one link that meet in one backward pass (nstep_loop.py).

A link runs as one node only while it is used once per backward (its
first use watched: ``nstep_loop._once_per_backward``). That rule counts
any backward between two uses as the end of the first; but a backward
that does not reach it (another model's loss) or reaches it only in part
(an auxiliary loss over its outputs) leaves the first use's graph to a
later backward that also reaches the second. Define-by-run then adds the
two uses' unrolled steps' gradient contributions to the weights
interleaved, in the order its backward reaches them, which two nodes
cannot give: 1.5e-8 to 2.4e-7 off, at every step, unwarned, until this
module.

So each backward pass (``loss.backward()`` and ``chainer.grad``: both are
counted) notes the ``NStepLoop`` nodes of each link whose backward ran in
it, and the unrolled uses of a link that runs as one node elsewhere
(``watch_unrolled``: undecorated code calling it too). Two of them that
meet there, one a node, warn once, and the link stays unrolled from then
on; but not a use whose h starts from the other's final state (truncated
BPTT, the state carried without ``unchain_backward()``) with inputs no
deeper than the other's: define-by-run reaches all its steps first, and
the two nodes give its bits (``_reached_after``). The pass where a
meeting is first seen has run as before (the weights' gradients possibly
off in the last bits); so has the one before it, where the link's first,
watched, use was unrolled and the second ran as one node."""
import threading
import warnings
import weakref

import chainer

from static_graph import diagnostics
from static_graph import nstep_ranks

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
    """``node``'s (an NStepLoop's, or an Unrolled use's) backward runs in
    the current pass; ``use``: its link's record in nstep_loop._uses
    (index 2: whether the link stays unrolled; index 5: the pass and weak
    references to the nodes whose backward ran in it). Where another of
    the link's met it there, their steps interleaved in define-by-run's
    backward (_reached_after), the link is to stay unrolled: warned, and
    noted in ``use[2]``."""
    now = current()
    if now is None or use[2]:
        return
    seen, nodes = use[5]
    if seen != now:
        use[5] = (now, [weakref.ref(node)])
        return
    if any(r() is node for r in nodes):
        return      # (an unrolled use: one of its nodes did)
    for r in nodes:
        other = r()
        if other is None or isinstance(other, Unrolled) and \
                isinstance(node, Unrolled) or \
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
        use[2] = True
        return
    nodes.append(weakref.ref(node))


# How many nodes back the graph is followed (_true_ranks, _from_state).
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
    if isinstance(later, Unrolled):
        # (Its input linears rank where its inputs do, and ``first``'s
        # node, if one, where its own inputs do: either may come first.)
        return False
    w = nstep_ranks.weight_rank(later.cell)
    if min(max(r, w) for r in later.in_ranks[2]) < \
            max(max(r, w) for r in first.in_ranks[2]):
        return False
    return _from_state(first, later) and _true_ranks(first) and \
        _true_ranks(later)


def _true_ranks(use):
    """Are the ranks of ``use``'s inputs (its time steps') define-by-run's,
    within _MAX_NODES nodes back? Not behind a decorated call's node,
    whose outputs all rank where its deepest would. (An NStepLoop's
    outputs rank where the unrolled loop's do, since review45 found
    inputs read from another link's node ranked just above its inputs:
    4.8e-7 to 9.5e-7 off at every step.)"""
    todo = list(use.steps_in())
    seen = set()
    while todo:
        f = todo.pop().creator_node
        if f is None or id(f) in seen:
            continue
        if len(seen) >= _MAX_NODES or \
                type(f).__module__.startswith('static_graph') and \
                not getattr(f, 'ranks_as_unrolled', False):
            return False
        seen.add(id(f))
        todo.extend(f.inputs)
    return True


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


class Unrolled(object):
    """A use of a link that ran as Chainer's unrolled loop while the link
    runs as one node elsewhere (undecorated code of the chain calling it
    too, a recording call): what backward_ran and _reached_after read of
    an NStepLoop node (review44: such a use meeting one node in a pass was
    1.5e-8 to 6e-8 off at every step, unwarned)."""

    def __init__(self, cell, hx, cx, xs, hy, cy):
        self.cell = cell
        self.n_state = 1 if cx is None else 2
        rank = nstep_ranks.rank
        self.in_ranks = (rank(hx), rank(cx), [rank(x) for x in xs])
        self.xs = [x.node for x in xs if isinstance(x, chainer.Variable)]
        self.outputs = tuple(weakref.ref(v.node)
                             for v in (hy, cy) if v is not None)

    def steps_in(self):
        return self.xs


def watch_unrolled(use, cell, hx, cx, ws, bs, xs, outs):
    """Watch the backward of an unrolled use (``outs``: hy, cy, ys) of a
    link (``use``: its record): each of its nodes that takes a weight or
    bias (a step's Stack of the gates' weights, a Linear) tells the pass
    when its backward runs."""
    hy, cy, ys = outs
    record = Unrolled(cell, hx, cx, xs, hy, cy)
    params = set(id(v.node) for group in list(ws) + list(bs)
                 for v in group)
    inside = params | set(id(v.node) for v in [hx, cx] + list(xs)
                          if isinstance(v, chainer.Variable))
    todo = [v.creator_node for v in (hy, cy) + tuple(ys) if v is not None]
    seen = set()
    while todo:
        f = todo.pop()
        if f is None or id(f) in seen:
            continue
        seen.add(id(f))
        if any(id(x) in params for x in f.inputs):
            _tell(f, record, use)
        todo.extend(x.creator_node for x in f.inputs if id(x) not in inside)


def _tell(f, record, use):
    """``f``'s backward (by its class), telling backward_ran first. (The
    node weakly: its own attribute would hold it otherwise.)"""
    backward = type(f).backward
    ref = weakref.ref(f)

    def told(indexes, grad_outputs):
        backward_ran(record, use)
        return backward(ref(), indexes, grad_outputs)

    f.backward = told
