"""Cuts of the graph (``h.unchain()``, ``x.unchain_backward()``) that reach
a call the library runs as one node (a replayed call, a recording call).

Define-by-run cuts the functions that lie before the cut Variable; a call
that is one node has outputs computed from one another inside it (an RNN
step's ``h`` and ``y = out(h)``), and replay cannot stop a gradient inside
the call. So:

* ``unchain_backward`` reaching such a call before any backward ran
  through it (inside a BPTT window, an evaluation call with backprop
  enabled) while more than one of its outputs lives is an error
  (``unchain``): cutting the node as Chainer cuts one would cut all its
  outputs (a later backward through ``y`` lost its gradient, silently),
  and cutting fewer would let one flow on past ``h``. After a backward
  ran through it (the truncated BPTT loop's cut) the node is cut as
  Chainer cuts one: nothing differs, unless another backward comes
  through it after the cut (not told apart: docs/fallbacks.md).
* ``h.unchain()`` cuts ``h``'s edge alone, as in define-by-run; a backward
  that comes into the call afterwards raises where ``h`` is one of the
  outputs other ops of the call read (``check``). ``Variable.unchain`` is
  wrapped to note the cut on the node (``node.cut``), so it is seen also
  after ``h`` is dropped.
"""
import chainer

_orig_unchain = chainer.Variable.unchain


def _unchain(self):
    creator = self.creator_node
    cut = getattr(creator, 'cut', None)
    if cut is not None:
        for i, ref in enumerate(creator.outputs or ()):
            if ref() is self.node:
                cut.add(i)
    return _orig_unchain(self)


chainer.Variable.unchain = _unchain

MESSAGE = (
    'an output of a call of %s that another of its outputs was computed '
    'from was cut from the graph (h.unchain(), h.unchain_backward()) while '
    'a backward may still come through the call: define-by-run stops the '
    'gradient there; the call, run as one node, cannot. Cut after the '
    'backward (loss.unchain_backward()), or run this with '
    'chainer.config.use_static_graph = False')


def unchain(node, may_backward, method_name, default):
    """``FunctionNode.unchain`` for a call run as one node: an error while
    a backward may still come through it (``may_backward``) and more than
    one of its outputs lives; ``default(node)`` (Chainer's) otherwise."""
    if may_backward and node.outputs and sum(
            ref() is not None for ref in node.outputs) > 1:
        raise RuntimeError(MESSAGE % method_name)
    default(node)


def check(node, inside, method_name):
    """Raise where an output other ops of the call read (``inside``: their
    positions) was cut from the call (``node.cut``, or one found without
    its creator)."""
    outputs = node.outputs or ()
    for i in inside:
        vn = outputs[i]() if i < len(outputs) else None
        if i in node.cut or vn is not None and vn.creator_node is None:
            raise RuntimeError(MESSAGE % method_name)
