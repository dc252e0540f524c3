"""Replay one call from a complete cache entry: the ReplayNode runs the
forward schedule (its backward the backward schedule); then the recorded
reports and attribute writes are repeated and the outputs rebuilt."""
import chainer

from static_graph import arrayutil
from static_graph import nodes
from static_graph import outputs
from static_graph import reports


def replay(e, leaves):
    node = nodes.ReplayNode(e)
    outs = node.apply(list(leaves) + e.params)
    if node.handed:
        nodes.retain_outputs(outs, e.saved_outputs)
    outs = nodes.detach_outputs(outs, e.no_grad_outs, e.leaf_outs)
    exposed = node.exposed
    node.exposed = None
    vals = []
    for v, kind in zip(outs, e.out_kinds):
        vals.append(outputs.handed(v, kind))
    _side_effects(e, exposed, outs)
    return outputs.rebuild(e.out_spec, vals[:e.n_outs])


def _side_effects(e, exposed, outs):
    """Repeat the recorded reports and attribute writes."""
    if not e.reports and not e.attr_writes:
        return
    values = dict(zip(e.expose, exposed or ()))
    by_out = {}
    for b, v in zip(e.forward.outputs, outs):
        # (One buffer returned as an array and kept as a Variable,
        # ``self.loss = loss; return loss.array``: the attribute gets the
        # hidden output, in the graph.)
        if b not in by_out or v.requires_grad and \
                not by_out[b].requires_grad:
            by_out[b] = v

    def var(b):
        if b in by_out:
            return by_out[b]
        return chainer.Variable(values[b], requires_grad=False)

    def value(b):
        if b in by_out:
            return by_out[b].raw_array
        # (The chain's memory, ``self.l.W.array[0]``: as define-by-run
        # shows it.)
        return arrayutil.hand_out(values[b], e.aliases[b]) \
            if b in e.aliases else values[b]

    for observer_ref, items in e.reports:
        observer = observer_ref() if observer_ref is not None else None
        if observer_ref is not None and observer is None:
            continue
        chainer.reporter.report(dict(
            (k, reports.decode(code, var, value)) for k, code in items),
            observer)
    for d, k, b, kind in e.attr_writes:
        if kind == 'V':
            d[k] = var(b)
        elif kind == 'N':
            d[k] = None
        else:
            d[k] = value(b)
