"""What a recording of a call that reads recurrent state must check.

A replayed call's backward sums gradient contributions in the order its
own recorded graph gave; define-by-run sums them in the order of its
whole graph of chained calls. Where those orders can differ (``order_tie``)
the method runs define-by-run (capture.py)."""


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

