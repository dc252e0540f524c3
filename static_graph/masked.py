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

A backward that gives gradients to other outputs than the recorded one
did (``not_recorded``) is an error, and its key runs define-by-run from
its next call; the recording call itself runs such a backward through its
own recorded nodes (nodes.RecordNode).
"""
from schedules import ir
from static_graph import diagnostics
from static_graph import kernels

# Ops whose kernel is a node that takes None for a missing gradient, as
# define-by-run hands it to them (chainer.functions.rnn.lstm.LSTMGrad).
NONE_TAKING_KINDS = frozenset(('LSTMGrad',))


def mask_ops(ops, sums, missing, outputs, node_gys=None):
    """``ops`` (with ``sums``: per op, whether it is a sum of gradient
    contributions) with the buffers ``missing`` standing for no gradient.
    ``node_gys``: per op, the gradients its node's ``backward()`` was
    handed at the recording (buffer ids; None for a sum, or where not
    known). Returns (ops, outputs with aliases resolved), or None where a
    missing gradient reaches an op that is neither a sum nor
    NONE_TAKING_KINDS, of a node that gets some gradient, or a schedule
    output. The ops of a node none of whose gradients comes are left out,
    their results missing too: define-by-run's backprop never reaches
    that node (the permutation and the stack an NStep RNN makes its last
    state with). Not per op: a node that gets a gradient for another
    output may make one of the missing ones up (zeros, a term of its
    own) and run ops on it."""
    none = set(missing)
    alias = {}
    out = []
    if node_gys is None:
        node_gys = (None,) * len(ops)
    for op, is_sum, gys in zip(ops, sums, node_gys):
        ins = tuple(alias.get(b, b) for b in op.inputs)
        gone = tuple(j for j, b in enumerate(ins) if b in none)
        if not is_sum and gys is not None and any(
                b is not None for b in gys) and all(
                alias.get(b, b) in none for b in gys if b is not None):
            none.update(op.outputs)
            continue
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


class NotRecordedBackward(RuntimeError):
    """A backward gives gradients to other outputs of a call than its
    recorded backward did: replay does not know it."""


def not_recorded(entry, i, had):
    """The error for a backward that gives output ``i`` a gradient where
    the recorded one gave none (or none where it gave one: ``had``); the
    key runs define-by-run from its next call (its calls get backward
    passes the schedules do not know: feature matching backpropagates
    ``y`` and then ``h`` of one call)."""
    from static_graph import entry as entry_module
    if entry.state == entry_module.COMPLETE:
        reason = ('a backward through its calls gave output %d %s gradient '
                  'where the recorded backward gave it %s (backward passes '
                  'through different outputs of one call), which replay does '
                  'not know' % (i, 'no' if had else 'a',
                                'one' if had else 'none'))
        entry.move(entry_module.FALLBACK, reason)
        diagnostics.warn_once(
            ('not recorded backward', entry.label),
            '%s falls back to define-by-run for this call signature from '
            'its next call: %s' % (entry.label, reason))
    return NotRecordedBackward(
        'the static graph of %s was recorded with%s a gradient for its '
        'output %d, and this backward gives %s; replay only knows the '
        'recorded backward, and this key runs define-by-run from its next '
        'call. For this call, run the pattern with '
        'chainer.config.use_static_graph = False'
        % (entry.method_name, '' if had else 'out', i,
           'none' if had else 'one'))
