"""Gradients Chainer hands a call that no node of this backward computed.

Chainer's backward, for each node it runs, takes each output's gradient
from its table of this backward, or, where the output has none there, from
the output Variable's own ``grad`` (``GradTable.pop``: what an earlier
``backward(retain_grad=True)`` left on it, or what the user set), which it
clears. Define-by-run runs the node that made an output of a decorated
call only where something of this backward reaches it: a gradient taken
from ``y.grad`` of ``y, h = call(x)``, in a backward from a loss of ``h``
alone, is never used there (``l2`` of ``y = l2(h)`` is not reached). The
call, one node, is reached through ``h``, and Chainer hands it ``y.grad``
too. ``take`` finds such gradients (``_grad_var_from_alive_node`` is
wrapped to mark the outputs it read), so that the call leaves them out,
and puts them back on their Variables, where define-by-run leaves them.
"""
import weakref

from chainer import _backprop_utils

_FLAG = '_static_graph_reloaded'
_orig = getattr(_backprop_utils, '_grad_var_from_alive_node', None)


def _reloaded(node):
    gv = _orig(node)
    if gv is not None:
        node.__dict__[_FLAG] = weakref.ref(gv)
    return gv


if _orig is not None:
    _backprop_utils._grad_var_from_alive_node = _reloaded


def take(node, grad_outputs):
    """Positions of ``grad_outputs`` (of our ``node``'s outputs) that
    Chainer took from the output Variables' ``grad``; each Variable gets
    its gradient back."""
    out = []
    for i, ref in enumerate(node.outputs or ()):
        vn = ref()
        if vn is None:
            continue
        ref = vn.__dict__.pop(_FLAG, None)
        gv = ref() if ref is not None else None
        if gv is None or i >= len(grad_outputs) or \
                grad_outputs[i] is not gv:
            continue
        out.append(i)
        var = vn.get_variable_or_none()
        if var is not None and var.grad_var is None:
            var.grad_var = gv
    return out
