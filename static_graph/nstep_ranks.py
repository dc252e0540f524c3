"""Where an ``NStepLoop`` node (nstep_loop.py) meets the rest of the graph
at define-by-run's ranks: Chainer's backward takes nodes highest rank
first, equal ranks in the order they joined its heap, and that order is
the order in which gradient contributions are added.

* Its outputs rank where the unrolled loop's do (``NStepLoop.out_ranks``,
  set by nstep_loop._impl): the nodes after them rank as define-by-run's
  (review45: ranked just above the node's inputs, a second link's uses on
  them were summed in another order).
* Its time steps' inputs reach it through ``StepInputs``, an identity at
  the rank of the unrolled loop's first-layer input linears: the node
  runs its backward at its own rank (above its initial state, which may
  lie deep: an encoder's), but the steps' inputs get their gradients, and
  what made them (Chainer's ``TransposeSequence``) joins the heap, where
  the unrolled input linears would hand them over (review46: a decoder's
  inputs also used by other functions added their gradients in another
  order, 1.2e-7 off)."""
import chainer
from chainer import function_node


class StepInputs(function_node.FunctionNode):
    """The identity on an NStepLoop's time-step inputs, ranked where the
    unrolled first layer's input linears are."""

    ranks_as_unrolled = True      # (nstep_passes._true_ranks)

    def forward(self, inputs):
        return inputs

    def backward(self, indexes, grad_outputs):
        return grad_outputs


def staged(xs, w_rank):
    """``xs`` (the time steps' input Variables) through StepInputs nodes,
    one per rank of the input linears they would meet unrolled: the
    highest of the input's and the stacked weights' (``w_rank``)."""
    groups = {}
    for i, x in enumerate(xs):
        if isinstance(x, chainer.Variable) and x.requires_grad:
            groups.setdefault(max(x.rank, w_rank), []).append(i)
    out = list(xs)
    for rank, which in groups.items():
        node = StepInputs()
        ys = node.apply([xs[i] for i in which])
        if node.rank != rank:
            node.rank = rank
            for y in ys:
                y.node.creator_node = node      # (its rank: node's + 1)
        for i, y in zip(which, ys):
            out[i] = y
    return out
