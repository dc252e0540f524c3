"""What a recording of a call that reads recurrent state must check.

A replayed call's backward sums gradient contributions in the order its
own recorded graph gave; define-by-run sums them in the order of its
whole graph of chained calls. Where those orders can differ (``order_tie``)
the method runs define-by-run (capture.py). And the state outputs of a
recording (Variables it leaves on its links for the next call): which
they are, the zero gradients a last call of a sequence gets, and whether
the built entry can run without them."""
from chainer import backend as backend_module

from static_graph import entry as entry_module
from static_graph import user_nodes


def order_tie(rec):
    """A sum of gradient contributions in the recorded backward whose
    summands come from forward nodes of equal rank, as text, or None.
    Chainer's backprop takes nodes by rank, and nodes of one rank in
    the order it found them: in a graph of several chained calls it
    finds them in an order the call's own graph need not give (the
    embedding of L.StatefulGRU feeds three linear layers of one rank:
    1e-7 off), where nodes of different ranks keep their order."""
    step_of = rec.step_of()
    made = {}      # buffer id -> ranks of the forward nodes behind it
    for j, rop in enumerate(rec.backward_ops):
        st = step_of.get(j)
        if st is not None:
            r = (getattr(st.node, 'rank', None),)
            for b in rop.outputs:
                made[b] = r
            continue
        ranks = [made.get(b) for b in rop.inputs]
        if len(ranks) == 2 and None not in ranks and \
                None not in ranks[0] + ranks[1] and \
                set(ranks[0]) & set(ranks[1]):
            return '%s and %s' % tuple(
                _label(rec, b) for b in rop.inputs)
        joined = tuple(x for r in ranks if r for x in r)
        for b in rop.outputs:
            made[b] = joined
    return None


def _label(rec, b):
    """The op (its source line) whose backward made buffer ``b``."""
    for st in rec.steps:
        for rop in rec.backward_ops[st.start:st.end]:
            if b in rop.outputs:
                return '%s (%s)' % (type(st.node).__name__,
                                    st.label or '?')
    return 'a sum'


def state_sum_tie(rec, state_in_grads, state_out_grads):
    """Where the call's state input has several consumers (its gradient a
    sum of their contributions) and its state output a consumer inside the
    call (the incoming gradient added to that one's): define-by-run adds
    each consumer's contribution of the next call to the state's gradient
    in its rank order, between this call's own (L.StatefulMGU: ``h`` feeds
    three nodes of the next call and ``self.o(h)`` of this one: 3e-8 off),
    where a replay adds their sum. Returns a text, or None."""
    inside = rec.step_of()
    summed_into, summed_from = set(), set()
    for j, rop in enumerate(rec.backward_ops):
        if j not in inside:      # a sum backprop made
            summed_into.update(rop.outputs)
            summed_from.update(rop.inputs)
    if any(b in summed_into for b in state_in_grads if b is not None) and \
            any(b in summed_from for b in state_out_grads if b is not None):
        return 'the contributions to its state input\'s gradient (used ' \
            'several times) and to its state output\'s (used inside the ' \
            'call too)'
    return None


def state_outputs(cap):
    """Indexes of the hidden outputs that are recurrent state: left on
    the links where a later call read its state."""
    state = set((id(d), k) for d, k in cap.cache.state_slots)
    return [i for i, (d, k) in enumerate(cap.hidden_slots, cap.n_outs)
            if (id(d), k) in state]


def check_state_outputs(cap):
    """A built entry whose state outputs got gradients must also run
    its backward without them (the last call of a sequence replays
    it too): where it cannot (masked.py), the key falls back."""
    e = cap.entry
    if e.state != entry_module.COMPLETE or e.backward is None:
        return
    outs = frozenset(i for i in state_outputs(cap) if e.grad_out_mask[i])
    if outs and e.accumulating_backward(frozenset(), True, outs) is None:
        cap.fall_back(
            'its state outputs (Variables it leaves on its links for '
            'the next call) get a gradient in some calls and none in '
            'others (the last call of a sequence), and replay can run '
            'its backward without one only where the missing gradient '
            'is added to others or reaches LSTMGrad')


def state_gradients(cap, grad_outputs):
    """``grad_outputs`` with zeros for the state outputs (Variables the
    method left on its links where a later call read its state) that got
    no gradient, if any: the last call of a truncated sequence has no next
    call to give one. The backward is recorded with them, so that it
    serves every call of the key; calls whose state gets none run it
    without (masked.py). Not where a node of the recording communicates
    (ChainerMN): its backward would run twice."""
    fill = [i for i in state_outputs(cap) if grad_outputs[i] is None and
            cap.inner_outs[i].requires_grad]
    if not fill or any(user_nodes.communicates(op.node)
                       for op in cap.rec.forward_ops):
        return grad_outputs
    out = list(grad_outputs)
    for i in fill:
        a = cap.inner_outs[i].raw_array
        out[i] = backend_module.get_array_module(a).zeros_like(a)
    return tuple(out)
