"""A backward through a call whose outputs get fewer gradients than the
recorded backward had.

A recurrent step hands its new state out as a hidden output: a call's state
gets a gradient from the next call, but the last call of a truncated
sequence has no next one. Define-by-run then backpropagates with ``None``
for those outputs: a sum of gradient contributions (made by Chainer's
backprop) takes the other operand whole, and a node's backward gets the
``None`` (L.LSTM's hands its output gradients on to LSTMGrad, which reads
``None`` as no contribution). ``mask_ops`` rewrites the recorded backward
the same way, where each consumer of a missing gradient is one of those;
anything else leaves the backward as it is (and the call raises as
before). The rewrite works on the ops as recorded (the nodes' own
kernels), so no kernel writes into a buffer that now stands for another.
"""
from schedules import ir
from static_graph import kernels

# Ops whose kernel is a node that takes None for a missing gradient, as
# define-by-run hands it to them (chainer.functions.rnn.lstm.LSTMGrad).
NONE_TAKING_KINDS = frozenset(('LSTMGrad',))


def mask_ops(ops, sums, missing, outputs):
    """``ops`` (with ``sums``: per op, whether it is a sum of gradient
    contributions) with the buffers ``missing`` standing for no gradient.
    Returns (ops, outputs with aliases resolved), or None where a missing
    gradient reaches an op that is neither a sum nor NONE_TAKING_KINDS, or
    a schedule output."""
    none = set(missing)
    alias = {}
    out = []
    for op, is_sum in zip(ops, sums):
        ins = tuple(alias.get(b, b) for b in op.inputs)
        gone = tuple(j for j, b in enumerate(ins) if b in none)
        if not gone:
            new = op.copy()
            new.inputs = ins
            out.append(new)
        elif is_sum:
            kept = [b for b in ins if b not in none]
            if len(op.outputs) != 1 or len(kept) > 1:
                return None
            if kept:
                alias[op.outputs[0]] = kept[0]
            else:
                none.update(op.outputs)
        elif op.kind in NONE_TAKING_KINDS and op.fn is not None:
            out.append(ir.Op(op.kind, tuple(b for b in ins if b not in none),
                             op.outputs, op.attrs, op.source,
                             kernels.none_filling_kernel(op.fn, gone, len(ins)), op.select))
        else:
            return None
    outs = tuple(alias.get(b, b) for b in outputs)
    if any(b in none for b in outs):
        return None
    return out, outs
