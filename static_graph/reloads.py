"""Gradients Chainer hands a call's node: ``accumulate`` (our nodes'
``backward_accumulate``), the recording's copies of them
(``outputs_and_gradients``), and those no node of this backward computed.

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
wrapped to mark the outputs it read), so that the call leaves them out
and puts them back on their Variables, where define-by-run leaves them
(``left_out``); but one of an output whose node made others too
(``F.split_axis``) is used where define-by-run runs that node.
"""
import weakref

import chainer
from chainer import _backprop_utils
from chainer import backend

from schedules import ir
from static_graph import arrayutil
from static_graph import recurrent

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
    Chainer took from the output Variables' ``grad``."""
    out = []
    for i, ref in enumerate(node.outputs or ()):
        vn = ref()
        if vn is None:
            continue
        ref = vn.__dict__.pop(_FLAG, None)
        gv = ref() if ref is not None else None
        if gv is not None and i < len(grad_outputs) and \
                grad_outputs[i] is gv:
            out.append(i)
    return out


def untouched(vn, g):
    """Is ``g`` the gradient Chainer took from the Variable of ``vn``
    (a leaf: a parameter) in this backward, nothing added to it yet?"""
    ref = vn.__dict__.get(_FLAG)
    return ref is not None and ref() is g


def left_out(node, grad_outputs, taken, siblings):
    """``grad_outputs`` without those at ``taken`` that define-by-run
    would not use, which go back on their Variables (where define-by-run
    leaves them). It uses one where the node that made that output made
    others too, and runs (``siblings``: ``sibling_outputs``'s), and the
    output's value reaches no output given a gradient of this backward."""
    given = set(j for j, g in enumerate(grad_outputs)
                if g is not None and j not in taken)
    out = list(grad_outputs)
    for i in taken:
        own, others = siblings.get(i, ((), ()))
        if given.intersection(others) and not given.intersection(own):
            continue
        out[i] = None
        vn = node.outputs[i]()
        var = vn.get_variable_or_none() if vn is not None else None
        if var is not None and var.grad_var is None:
            var.grad_var = grad_outputs[i]
    return tuple(out)


def sibling_outputs(rec, inner_outs, out_bids):
    """{output i: (outputs that i's value reaches inside the call, outputs
    that the other outputs of the node that made i reach)} for each output
    made by a node with several (``F.split_axis``); that node runs in a
    define-by-run backward if an output of the second kind gets a
    gradient, and takes i's ``.grad`` there unless one of the first kind
    got one (then i's gradient is of this backward)."""
    by_node = dict((id(op.node), op) for op in rec.forward_ops)
    everything = frozenset(range(len(out_bids)))
    out = {}
    for i, v in enumerate(inner_outs):
        node = v.creator_node
        if node is None or len(node.outputs) < 2:
            continue
        op = by_node.get(id(node))
        mine = out_bids[i]
        if op is None or mine not in op.outputs:
            out[i] = (frozenset(), everything - {i})    # (unknown: any)
            continue
        out[i] = (_reached(rec, (mine,), out_bids) - {i},
                  _reached(rec, [b for b in op.outputs if b != mine],
                           out_bids) - {i})
    return out


def _reached(rec, bids, out_bids):
    reach = set(bids)
    for op in rec.forward_ops:       # (in the order they ran)
        if reach.intersection(op.inputs):
            reach.update(op.outputs)
    return frozenset(j for j, b in enumerate(out_bids) if b in reach)


def empty_gradients(outs, grad_outputs):
    """``grad_outputs`` with an empty gradient for each output of no
    elements that needs one and got None. Define-by-run runs the backward
    of every node it reaches, gradient or not: ChainerMN's ``send``
    returns such an empty "delegate variable", whose backward (receiving
    the gradient from the other process) runs when it is backpropagated
    without one. An empty gradient carries no number, so this changes no
    result; it makes the recorded and replayed backward go through it."""
    if all(g is not None for g in grad_outputs):
        return grad_outputs
    out = list(grad_outputs)
    for i, (o, g) in enumerate(zip(outs, grad_outputs)):
        a = o.raw_array if isinstance(o, chainer.Variable) else o
        if g is None and a is not None and a.size == 0 and (
                not isinstance(o, chainer.Variable) or o.requires_grad):
            out[i] = backend.get_array_module(a).empty_like(a)
    return tuple(out)


def raw(g):
    """A gradient's array: Chainer passes on what chainer.grad's
    ``grad_outputs`` got, a Variable or an array."""
    return g.raw_array if isinstance(g, chainer.Variable) else g


def accumulate(node, target_input_indexes, grad_outputs, grad_inputs):
    """``backward_accumulate`` for our nodes. Chainer takes the gradients
    accumulated so far out of the input variables before calling it; if our
    backward fails (an exception, KeyboardInterrupt) one that no node of
    this backward added to yet is put back, so parameters keep their
    gradients; one that other calls' contributions were added to stays
    taken, as define-by-run leaves it (Chainer's table of the failed
    backward is dropped). A replay adds such a gradient where
    define-by-run does (``ReplayNode.backward``'s ``earlier``). A
    gradient Chainer took from an output's ``.grad`` is left out
    (reloads.py)."""
    if node.state_grads:
        recurrent.summed_elsewhere(node, grad_outputs)
    taken = take(node, grad_outputs)
    if taken:
        entry = node.entry if node.entry is not None else getattr(
            node, 'built', None)
        grad_outputs = left_out(
            node, grad_outputs, taken,
            entry.sibling_outputs if entry is not None else {})
        if all(g is None for g in grad_outputs):
            return tuple(grad_inputs)
    try:
        gxs, included = node.backward_from(
            target_input_indexes, grad_outputs, grad_inputs)
    except BaseException:
        for i, g in zip(target_input_indexes, grad_inputs):
            if g is None:
                continue
            vn = node.inputs[i]
            var = vn.get_variable_or_none()
            if var is not None and var.grad_var is None and \
                    untouched(vn, g):
                var.grad_var = g
        raise
    out = tuple(gx if g is None or i in included else
                g if gx is None else g + gx
                for i, gx, g in zip(target_input_indexes, gxs, grad_inputs))
    recurrent.note_state_gradients(node, target_input_indexes, out,
                                   grad_inputs)
    return out


def outputs_and_gradients(cap, grad_outputs, keep):
    """Of the recording call ``cap`` (capture.Capture): the distinct
    outputs that get a gradient, their gradients, and
    [(index, gradient)] for an output returned again. ``keep``: the
    gradients as copies in GRAD_OUT buffers, whose ids come fourth
    (None for an output without one); else as Chainer handed them
    (double backpropagation follows their graph)."""
    rec = cap.rec
    outs, gys, more, bids = [], [], [], []
    cap.grad_copies = []
    position = {}   # id(output Variable) -> its index in outs
    grad_outputs = empty_gradients(cap.inner_outs, grad_outputs)
    for o, g in zip(cap.inner_outs, grad_outputs):
        if g is None or not o.requires_grad:
            bids.append(None)
            continue
        if keep:
            ga = arrayutil.copy_exact(raw(g))
            bids.append(rec.new_buffer(ga, ir.GRAD_OUT, name='grad'))
            cap.grad_copies.append((raw(g), ga))
            g = chainer.Variable(ga)
        else:
            g = chainer.as_variable(g)
        if id(o) in position:
            more.append((position[id(o)], g))
            continue
        position[id(o)] = len(outs)
        gys.append(g)
        outs.append(o)
    return outs, gys, more, bids
