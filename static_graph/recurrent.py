"""What a recording of a call that reads recurrent state must check.

A replayed call's backward sums gradient contributions in the order its
own recorded graph gave; define-by-run sums them in the order of its
whole graph of chained calls. Where those orders can differ (``order_tie``)
the method runs define-by-run (capture.py). And the state outputs of a
recording (Variables it leaves on its links for the next call): which
they are, the zero gradients a last call of a sequence gets, and whether
the built entry can run without them."""
import weakref

from chainer import backend as backend_module

from static_graph import diagnostics
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


def state_sum_tie(sums, state_in_grads, state_out_grads):
    """Where the call's state input has several consumers (its gradient a
    sum of their contributions) and its state output a consumer inside the
    call (the incoming gradient added to that one's): define-by-run adds
    each consumer's contribution of the next call to the state's gradient
    in its rank order, between this call's own (L.StatefulMGU: ``h`` feeds
    three nodes of the next call and ``self.o(h)`` of this one: 3e-8 off),
    where a replay adds their sum (``sums``: _sums'). Returns a text, or
    None."""
    summed_into, summed_from = sums
    if any(b in summed_into for b in state_in_grads if b is not None) and \
            any(b in summed_from for b in state_out_grads if b is not None):
        return 'the contributions to its state input\'s gradient (used ' \
            'several times) and to its state output\'s (used inside the ' \
            'call too)'
    return None


def _sums(rec):
    """The sums of the recorded backward (those backprop made, not a
    node's): [their ops], the buffers they write, those they read."""
    inside = rec.step_of()
    ops = [rop for j, rop in enumerate(rec.backward_ops) if j not in inside]
    summed_into, summed_from = set(), set()
    for rop in ops:
        summed_into.update(rop.outputs)
        summed_from.update(rop.inputs)
    return ops, summed_into, summed_from


def check_sums(cap, grad_in, grad_out_bids):
    """After the recording call's backward: the method runs define-by-run
    from now on (the recording falls back) where its backward sums
    gradient contributions in an order that depends on the whole graph of
    calls (``order_tie``, ``state_sum_tie``, a state output the caller
    added to: ``summed_elsewhere``). ``grad_in``: the buffers of the
    gradients of the call's inputs; ``grad_out_bids``: its outputs'."""
    rec, e = cap.rec, cap.entry
    sum_ops, summed_into, summed_from = _sums(rec)
    state = state_outputs(cap)
    tie = None
    if e.recurrent:
        first_state = len(cap.leaves) - len(e.recurrent)
        tie = order_tie(rec)
        if tie is not None:
            tie = 'the gradient contributions of %s, of one rank' % tie
        else:
            tie = state_sum_tie(
                (summed_into, summed_from),
                [b for t, b in zip(cap.targets, grad_in)
                 if first_state <= t < len(cap.leaves)],
                [grad_out_bids[i] for i in state])
    if tie is None:
        tie = output_sum_tie(state, grad_out_bids, sum_ops)
    # (The state outputs whose incoming gradient the recorded backward adds
    # to a contribution from inside the call: summed_elsewhere.)
    e.summed_state_outputs = frozenset(
        i for i in state
        if grad_out_bids[i] is not None and grad_out_bids[i] in summed_from)
    e.cache_ref = weakref.ref(cap.cache)
    summed = e.summed_state_outputs.intersection(cap.state_summed)
    if tie is not None:
        # For the whole method: a key that replayed next to calls of
        # define-by-run would change the order of their sums.
        reason = (
            'it reads recurrent state, and its backward sums %s: '
            'define-by-run orders them by its whole graph of calls, which a '
            'replayed call cannot know (the last bits could differ); the '
            'method runs define-by-run from now on' % tie)
    elif summed:
        reason = STATE_SUMMED % ', '.join(str(j) for j in sorted(summed))
    else:
        return
    rec.add_reason(reason)
    cap.cache.define_by_run = reason


def output_sum_tie(state, grad_out_bids, sum_ops):
    """A sum of the recorded backward over the gradient of a state output,
    that of another output and a third contribution (``return loss,
    F.identity(h)`` of L.LSTM's h, whose identity the caller adds to its
    loss): the caller's graph decides where define-by-run adds the other
    output's, between the next call's and this call's own (7e-9 to 3e-8
    off). ``state``: the state outputs' indexes; ``sum_ops``: the
    backward's sums (_sums). As text, or None."""
    state_bids = set(grad_out_bids[i] for i in state
                     if grad_out_bids[i] is not None)
    other = set(b for i, b in enumerate(grad_out_bids)
                if b is not None and i not in state)
    if not state_bids or not other:
        return None
    leaves = {}      # buffer -> the contributions a sum made it of
    for rop in sum_ops:
        parts = frozenset().union(*[leaves.get(b, frozenset([b]))
                                    for b in rop.inputs])
        for b in rop.outputs:
            leaves[b] = parts
        if len(parts) >= 3 and parts & state_bids and parts & other:
            return ('the gradient of a state output with that of another '
                    'output (the caller\'s) and its own use')
    return None


def state_outputs(cap):
    """Indexes of the outputs that are recurrent state: left on the links
    where a later call read its state (hidden outputs, or outputs the
    method also returns: ``return y, h`` of L.LSTM's ``h``)."""
    state = set((id(d), k) for d, k in cap.cache.state_slots)
    return sorted(set(i for i, d, k in cap.out_slots if (id(d), k) in state))


def check_state_outputs(cap):
    """A built entry whose state outputs got gradients must also run
    its backward without them (the last call of a sequence replays
    it too): where it cannot (masked.py), the key falls back."""
    e = cap.entry
    if e.state != entry_module.COMPLETE or e.backward is None:
        return
    outs = frozenset(i for i in state_outputs(cap) if e.grad_out_mask[i])
    if any(m and i not in outs for i, m in enumerate(e.grad_out_mask)):
        cases = [outs]
    else:
        # Every output that got a gradient is state (``return h`` of
        # L.LSTM's h, c kept): a call whose outputs all get none has no
        # backward; one whose state another link took in part (``h``
        # only) gets some.
        cases = [frozenset([i]) for i in outs] if len(outs) > 1 else []
    if any(e.accumulating_backward(frozenset(), True, absent) is None
           for absent in cases):
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


# -- a state output's gradient summed outside the call -------------------------
# A call's state output (L.LSTM's h) that the call also uses inside gets, in
# define-by-run, the next call's contribution, its own consumer's, and any
# the caller adds (a loss of ``model.rnn.h``: activation regularization).
# Three or more contributions sum in an order that depends on the whole graph
# of calls; a replayed call gets the outside ones already summed and adds its
# own last. Chainer hands a node the very gradient Variable that one consumer
# returned where that consumer was alone: so a call that finds another one
# there than the next call of ours returned for it knows of a third.

MIXED = object()   # the state input's gradient included another's


def note_state_gradients(node, indexes, grads, held):
    """After the backward of our ``node``: the gradient it returned for
    each input that is an output of another call of ours (that call's
    ``state_grads``: output index -> (id of ``node``, the Variable, or
    MIXED where it included a gradient held before or a second call read
    it))."""
    inputs = node.inputs
    for i, r, g in zip(indexes, grads, held):
        if r is None:
            continue
        vn = inputs[i]
        creator = vn.creator_node
        if creator is None or not hasattr(creator, 'state_grads'):
            continue
        for j, ref in enumerate(creator.outputs):
            if ref() is vn:
                break
        else:
            continue
        if creator.state_grads is None:
            creator.state_grads = {}
        seen = creator.state_grads
        # (The same node again: a later backward pass, the creator not
        # reached in the earlier one: ``chainer.grad`` with respect to h.)
        had = seen.get(j)
        seen[j] = (id(node), MIXED if g is not None or (
            had is not None and had[0] != id(node)) else r)


def summed_elsewhere(node, grad_outputs):
    """Before the backward of our ``node``: the outputs whose gradient is
    not the one a later call of ours returned for them alone (the caller
    added its own); the recording's capture notes them for its build, a
    replayed call's method runs define-by-run from its next call where
    its backward adds such a state output's gradient to its own."""
    seen, node.state_grads = node.state_grads, None
    outs = set(j for j, (_, got) in seen.items()
               if grad_outputs[j] is not None and
               (got is MIXED or grad_outputs[j] is not got))
    if not outs:
        return
    capture = getattr(node, 'capture', None)
    if capture is not None:
        capture.state_summed = outs
        return
    entry = node.entry
    if entry is None or not outs & entry.summed_state_outputs:
        return
    cache = entry.cache_ref() if entry.cache_ref is not None else None
    if cache is None or cache.define_by_run is not None:
        return
    cache.define_by_run = STATE_SUMMED % ', '.join(
        str(j) for j in sorted(outs & entry.summed_state_outputs))
    diagnostics.warn_once(
        ('state summed', entry.label),
        '%s runs define-by-run from its next call: %s'
        % (entry.label, cache.define_by_run))


STATE_SUMMED = (
    'its state output %s (a Variable it leaves on a link for the next call, '
    'also used inside the call) got a gradient from the caller too (a loss '
    'of the state: activation regularization): define-by-run orders those '
    'three or more contributions by its whole graph of calls, which a '
    'replayed call cannot know (the last bits could differ)')
