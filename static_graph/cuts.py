"""Cuts of the graph (``h.unchain()``, ``x.unchain_backward()``) that reach
a call the library runs as one node (a replayed call, a recording call).

Define-by-run cuts the functions that lie before the cut Variable; a call
that is one node has outputs computed from one another inside it (an RNN
step's ``h`` and ``y = out(h)``), and cutting the node as Chainer cuts one
would cut all of them: ``y`` lost its way into ``out``'s parameters,
silently. So the node cuts only its outputs that lie on the cut's path
(``unchain_backward`` walks the graph first to find them: ``on_path``),
remembers which (``node.cut``), and its backward raises where a cut output
is one its other outputs were computed from (``check``): replay cannot
stop a gradient inside the call. Where no backward comes through it (the
truncated BPTT loop cuts after its backward; evaluation calls), nothing
differs.

Installed once, on import: ``Variable.unchain`` and ``unchain_backward``
do Chainer's work as before, plus that bookkeeping while such nodes live.
"""
import threading
import weakref

import chainer

_local = threading.local()
# The nodes of calls run as one (nodes._Replayed), while they live.
LIVE = weakref.WeakSet()

_orig_unchain = chainer.Variable.unchain
_orig_unchain_backward = chainer.Variable.unchain_backward


def on_path(variable):
    """{id(call node): set of its output VariableNodes on the path} of a
    cut from ``variable``: the walk Chainer's ``unchain_backward`` makes,
    made first, while the graph is whole."""
    live = set(id(n) for n in LIVE)
    paths = {}
    creator = variable.creator_node
    if creator is None:
        return paths
    if id(creator) in live:
        paths.setdefault(id(creator), set()).add(variable.node)
    cand, seen = [creator], {id(creator)}
    while cand:
        func = cand.pop()
        for var in func.inputs or ():
            c = var.creator_node
            if c is None:
                continue
            if id(c) in live:
                paths.setdefault(id(c), set()).add(var)
            if id(c) not in seen:
                seen.add(id(c))
                cand.append(c)
    return paths


def _unchain_backward(self):
    if not LIVE:
        return _orig_unchain_backward(self)
    _local.paths = on_path(self)
    try:
        return _orig_unchain_backward(self)
    finally:
        _local.paths = None


def _unchain(self):
    creator = self.creator_node
    if creator is not None and LIVE and creator in LIVE:
        for i, ref in enumerate(creator.outputs or ()):
            if ref() is self.node:
                creator.cut.add(i)
    return _orig_unchain(self)


chainer.Variable.unchain = _unchain
chainer.Variable.unchain_backward = _unchain_backward


def deps_of(ops, outputs):
    """[set of output positions] per output of a call: the outputs among
    its ancestors inside the call and those made with them by one op,
    itself included (``y = out(h)``: y's holds h's, and L.LSTM's c). ``ops``: the call's forward ops in order, with ``inputs``
    and ``outputs`` buffer ids; ``outputs``: the call's output buffers."""
    pos = {}
    for i, b in enumerate(outputs):
        pos.setdefault(b, set()).add(i)
    anc = {}
    for op in ops:
        a = set()
        for b in op.inputs:
            a |= anc.get(b, pos.get(b, set()))
        for b in op.outputs:
            # (an op's results go together: define-by-run's cut of the
            # function cuts all of them, L.LSTM's c with its h)
            a |= pos.get(b, set())
        for b in op.outputs:
            anc[b] = a
    return [anc.get(b, pos.get(b, set())) | {i}
            for i, b in enumerate(outputs)]


def unchain(node, deps, default):
    """``FunctionNode.unchain`` for a call run as one node (``deps``: its
    outputs' deps_of, or None): the outputs on the cut's path and those
    they were computed from, where others of its outputs live on;
    ``default(node)`` (Chainer's) otherwise."""
    paths = getattr(_local, 'paths', None)
    on = paths.get(id(node)) if paths is not None else None
    if on is not None and deps is not None and node.outputs:
        alive = [ref() for ref in node.outputs]
        cut = set()
        for i, vn in enumerate(alive):
            if vn is not None and vn in on:
                cut |= deps[i]
        if any(vn is not None and i not in cut
               for i, vn in enumerate(alive)):
            for i in cut:
                if alive[i] is not None:
                    alive[i].creator_node = None
            node.cut |= cut
            return
    default(node)


def check(node, deps, given, method_name):
    """Raise where a gradient comes in (``given``: per output, whether one
    does) through an output computed inside the call from an output cut
    since (``node.cut``, or one found without its creator)."""
    outputs = node.outputs or ()
    cut = set(node.cut)
    for i, ref in enumerate(outputs):
        vn = ref()
        if vn is not None and vn.creator_node is None:
            cut.add(i)
    if not cut:
        return
    for k, g in enumerate(given):
        if g and k not in cut and deps[k] & cut:
            raise RuntimeError(
                'an output of a call of %s that another of its outputs was '
                'computed from was cut from the graph (h.unchain(), '
                'h.unchain_backward()) before this backward through the '
                'call: define-by-run stops the gradient there; the call, '
                'run as one node, cannot. Cut after the backward '
                '(loss.unchain_backward()), or run this with '
                'chainer.config.use_static_graph = False' % method_name)
