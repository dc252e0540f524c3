"""Where an ``NStepLoop`` node (nstep_loop.py) meets the rest of the graph
at define-by-run's ranks. Chainer's backward takes nodes highest rank
first, equal ranks in the order they joined its heap, and that order is
the order in which gradient contributions are added; one node runs its
backward at one rank, where the unrolled loop's nodes span many.

* Its outputs rank where the unrolled loop's do (``NStepLoop.out_ranks``,
  set by nstep_loop._impl): the nodes after them rank as define-by-run's
  (review45: ranked just above the node's inputs, a second link's uses on
  them were summed in another order).
* Its time steps' inputs reach it through an ``AtRank`` identity at the
  rank of the unrolled first layer's input linears (``staged``), and its
  initial states through two, at the ranks of Chainer's ``Separate`` and
  of what takes Separate's output first (``staged_state``): the inputs
  and states get their gradients, and what made them joins the heap,
  where the unrolled loop would hand them over (review46: a decoder's
  inputs that other functions used too were 1.2e-7 off at every step; an
  encoder's state used by the decoder and by other functions, 2.4e-7 to
  4.8e-7). Ties beyond those nodes (a state's other user two nodes
  deeper, say) can still come in another order, as they did before."""
import chainer
from chainer import function_node


class AtRank(function_node.FunctionNode):
    """The identity, at a rank of the unrolled loop's (``_at``)."""

    ranks_as_unrolled = True      # (nstep_passes._true_ranks)

    def forward(self, inputs):
        return inputs

    def backward(self, indexes, grad_outputs):
        return grad_outputs


def rank(v):
    """The rank of ``v`` (a Variable; 0 for an array or None)."""
    return v.rank if isinstance(v, chainer.Variable) else 0


def weight_rank(cell):
    """The rank of the weights a step's linears take unrolled: an LSTM's
    stacked anew at every step (``_stack_weight``: Stack, then Reshape),
    the weights themselves otherwise."""
    return 2 if cell == 'lstm' else 0


def _at(variables, rank):
    """``variables`` through one AtRank node of rank ``rank``."""
    node = AtRank()
    ys = node.apply(variables)
    if node.rank != rank:
        node.rank = rank
        for y in ys:
            y.node.creator_node = node      # (its rank: node's + 1)
    return ys


def _needs(v):
    return isinstance(v, chainer.Variable) and v.requires_grad


def staged(xs, w_rank):
    """``xs`` (the time steps' input Variables) through AtRank nodes, one
    per rank of the input linears they would meet unrolled: the highest
    of the input's and the stacked weights' (``w_rank``)."""
    groups = {}
    for i, x in enumerate(xs):
        if _needs(x):
            groups.setdefault(max(x.rank, w_rank), []).append(i)
    out = list(xs)
    for rank, which in groups.items():
        for i, y in zip(which, _at([xs[i] for i in which], rank)):
            out[i] = y
    return out


def staged_state(v, first_rank):
    """Initial state ``v`` (hx or cx) through an AtRank node where
    Chainer's ``Separate`` of it ranks (its own rank), then one at
    ``first_rank`` (for h, the rank of the first node that takes
    Separate's output, a step's recurrent linear; for c, just above c:
    nstep_loop._impl)."""
    if not _needs(v):
        return v
    separated, = _at((v,), v.rank)
    return _at((separated,), first_rank)[0]
