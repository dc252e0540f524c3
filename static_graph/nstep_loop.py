"""An NStep RNN run as one node: Chainer's unrolled loop, without the graph.

Chainer's CPU ``n_step_lstm`` unrolls the recurrence into about a dozen
FunctionNodes per layer and time step (the gate weights stacked again at
every step, two linears, an add, the LSTM cell, a split and a concat where
the batch shrinks), and its backward walks all of them. The op list follows
the lengths of the batch, so a schedule recorded for one batch does not
replay another; but the loop itself is the same for every batch.
``NStepLoop`` is that loop as one FunctionNode: its forward runs the
same NumPy operations on the same operands in the same order as the
unrolled graph, and its backward the same gradient operations, adding
each weight's contributions in the order Chainer's backward would reach
the unrolled steps (highest rank first, then the order they joined its
heap; the node computes the ranks those nodes would have, and gives its
outputs theirs), so the results are the same bits; not always where the
steps' inputs or the initial states have other users too, whose
gradients Chainer's backward adds in an order one node cannot give in
general (nstep_ranks.py, docs/fallbacks.md; ``enabled = False`` keeps
the loops unrolled).

Used for the define-by-run calls of a decorated method (``fused()``): a
method whose keys do not repeat (sentences of new lengths in every batch)
runs define-by-run, and its NStep LSTMs and RNNs (``n_step_lstm``,
``n_step_rnn``, tanh or ReLU, and their bidirectional forms) then cost one
node each. Not where one node cannot give define-by-run's order: weights
used twice before one backward (the first use of a link is only
watched; two of its nodes that meet in one backward pass unroll it:
nstep_passes.py), or taken by another function too (an L2 term, a tied
weight: ``_other_use``, told of every application by patches.py); not for
GRUs (their step's ops and the order of its gradient sums are not written
here), CuPy.
"""
import contextlib
import threading
import warnings
import weakref

import numpy

import chainer
from chainer import function_node
from chainer.functions.noise import dropout as dropout_module
from chainer.functions.rnn import n_step_lstm as n_step_lstm_module
from chainer.functions.rnn import n_step_rnn as n_step_rnn_module

from static_graph import diagnostics
from static_graph import nstep_passes
from static_graph import nstep_ranks
from static_graph import nstep_steps
from static_graph import patches
from static_graph import recorder

_state = threading.local()
_original_impl = n_step_rnn_module.n_step_rnn_impl
_original_backprop = chainer._backprop._backprop_to_all
_original_grad_backprop = function_node._backprop    # (chainer.grad's)
_backwards = [0]     # backward passes run since the patches went in
# Per NStep link, by id of its first weight (Parameters are unhashable):
# [backward count at its last use, uses that came after a backward, whether
# it was used twice before one, a weak reference to the weight, weak
# references to its last use's output nodes, the backward pass its nodes'
# backward last ran in and those nodes (nstep_passes), whether its last use
# ran as one node, whether any did]
_uses = {}
# False: NStep RNNs stay unrolled in define-by-run calls too (where their
# inputs or initial states are used by other functions as well, one node
# can add their gradients in another order: docs/fallbacks.md).
enabled = True


class NStepLoop(function_node.FunctionNode):
    """``n_step_lstm``/``n_step_bilstm`` or ``n_step_rnn``/``n_step_birnn``
    (Chainer's CPU path) as one node. Inputs: hx, cx (LSTM only), the
    weights and biases of every layer and direction (8 each for an LSTM,
    2 for an RNN; flat), then the time steps' inputs; outputs: hy, cy
    (LSTM only), then the time steps' outputs."""

    def __init__(self, cell, n_layers, dropout_ratio, bi, train, ranks,
                 step=None):
        self.step = step           # Chainer's step function (``_impl``'s f)
        self.cell = cell
        self.n_w = 8 if cell == 'lstm' else 2
        self.n_state = 2 if cell == 'lstm' else 1
        self.in_ranks = ranks      # hx's, cx's, and the steps' inputs'
        self.n_layers = n_layers
        self.dropout_ratio = dropout_ratio
        self.bi = bi
        self.train = train

    @property
    def label(self):
        return 'NStepLoop(%s)' % self.cell

    def _layout(self):
        n = self.n_layers * (2 if self.bi else 1)
        w0 = self.n_state
        b0 = w0 + self.n_w * n
        return n, w0, b0, b0 + self.n_w * n

    ranks_as_unrolled = True     # (nstep_passes._true_ranks)

    def steps_in(self):
        """The nodes of the time steps' inputs (nstep_passes), before
        nstep_ranks.staged."""
        return self.step_nodes

    def _split(self, inputs):
        """(hx, cx or None, ws, bs, xs) of the node's flat inputs."""
        n, w0, b0, x0 = self._layout()
        k = self.n_w
        return (inputs[0], inputs[1] if self.n_state == 2 else None,
                [list(inputs[w0 + k * i:w0 + k * i + k]) for i in range(n)],
                [list(inputs[b0 + k * i:b0 + k * i + k]) for i in range(n)],
                list(inputs[x0:]))

    def forward(self, inputs):
        d = 2 if self.bi else 1
        hx, cx, ws, bs, xs = self._split(inputs)
        # (for a second-order gradient, which unrolls the loop again)
        self.retain_inputs(tuple(range(len(inputs))))
        self._n_steps = len(xs)
        self._loops = []
        self._masks = []
        hy, cy = [], []
        xs_next = xs
        hx_rank, cx_rank, ranks_next = self.in_ranks
        for layer in range(self.n_layers):
            layer_masks = []
            for direction in range(d):
                idx = d * layer + direction
                in_ranks = ranks_next
                if layer == 0:
                    layer_in = xs_next
                    layer_masks.append(None)
                else:
                    layer_in, masks = self._dropout(xs_next)
                    layer_masks.append(masks)
                    if masks is not None:
                        in_ranks = [r + 1 for r in in_ranks]
                if direction == 1:
                    layer_in = layer_in[::-1]
                    in_ranks = in_ranks[::-1]
                loop = nstep_steps.Loop(self.cell, ws[idx], bs[idx])
                # (hx and cx reach the loops through Separate)
                out, h, c, out_ranks = loop.run(
                    layer_in, hx[idx], None if cx is None else cx[idx],
                    in_ranks, hx_rank + 1, cx_rank + 1)
                self._loops.append(loop)
                hy.append(h)
                cy.append(c)
                if direction == 0:
                    h_forward, f_ranks = out, out_ranks
                else:
                    h_backward, b_ranks = out[::-1], out_ranks[::-1]
            self._masks.append(layer_masks)
            if self.bi:
                xs_next = [numpy.concatenate([f, b], axis=1)
                           for f, b in zip(h_forward, h_backward)]
                ranks_next = [max(f, b) + 1 for f, b in zip(f_ranks, b_ranks)]
            else:
                xs_next, ranks_next = h_forward, f_ranks
        self._widths = [h.shape[1] for h in hy]
        # The ranks of the unrolled graph's outputs: hy and cy stacked from
        # the loops' last states, ys the top layer's (``_impl`` gives them
        # to the outputs' nodes).
        finals = [loop.final_ranks for loop in self._loops]
        self.out_ranks = [max(h for h, _ in finals) + 1]
        if cx is not None:
            self.out_ranks.append(max(c for _, c in finals) + 1)
        self.out_ranks += list(ranks_next)
        states = (numpy.stack(hy),)
        if cx is not None:
            states += (numpy.stack(cy),)
        return states + tuple(xs_next)

    def _dropout(self, xs):
        """``_dropout_sequence``: a Dropout node per step while training
        (its draws in the same order), the inputs themselves otherwise."""
        if not self.train:
            return list(xs), None
        out, masks = [], []
        for x in xs:
            node = dropout_module.Dropout(self.dropout_ratio)
            y, = node.forward((x,))
            out.append(y)
            masks.append(node.mask)
        return out, masks

    def backward_accumulate(self, target_input_indexes, grad_outputs,
                            grad_inputs):
        if chainer.config.enable_backprop:
            return self._unrolled_grads(target_input_indexes, grad_outputs,
                                        grad_inputs)
        use = _uses.get(getattr(self, 'use_key', None))
        if use is not None:
            nstep_passes.backward_ran(self, use)
        held = dict((i, g.array) for i, g in
                    zip(target_input_indexes, grad_inputs) if g is not None)
        grads = self._grads(target_input_indexes,
                            [None if g is None else g.array
                             for g in grad_outputs], held)
        out = []
        for i in target_input_indexes:
            g = grads.get(i, held.get(i))
            out.append(None if g is None else chainer.Variable(g))
        return tuple(out)

    def _unrolled_grads(self, indexes, grad_outputs, grad_inputs):
        """A backward that must itself be differentiable (a second-order
        gradient): Chainer's unrolled loop built again over the retained
        inputs, its dropout masks the ones this node drew, and its
        gradients taken with ``chainer.grad`` (the held gradients first,
        as define-by-run adds them)."""
        if self.step is None:
            raise NotImplementedError(
                'a second-order gradient through an NStepLoop node made '
                'without its step function')
        inputs = self.get_retained_inputs()
        use = _uses.get(id(inputs[self.n_state]))
        if use is not None and not use[2]:
            use[2] = True
            warnings.warn(
                'static_graph: a second-order gradient through an NStep '
                'RNN that ran as one node (a define-by-run call of a '
                'decorated method): its loop is unrolled again for it, but '
                'the parameters\' gradients of this backward are added in '
                'another order than define-by-run adds them (last bits). '
                'This RNN stays unrolled from now on.',
                diagnostics.StaticGraphWarning)
        hx, cx, ws, bs, xs = self._split(inputs)
        masks = iter([m for layer in self._masks for m in layer
                      if m is not None])

        def drawn_dropout(xs, ratio):
            return [dropout_module.dropout(x, ratio=ratio, mask=m)
                    for x, m in zip(xs, next(masks))]
        sequence = n_step_rnn_module._dropout_sequence
        n_step_rnn_module._dropout_sequence = drawn_dropout
        try:
            with chainer.using_config('train', self.train):
                hy, cy, ys = _original_impl(
                    self.step, self.n_layers, self.dropout_ratio, hx, cx,
                    ws, bs, xs, self.bi)
        finally:
            n_step_rnn_module._dropout_sequence = sequence
        outs = [hy] + ([cy] if cx is not None else []) + list(ys)
        given = [(y, g) for y, g in zip(outs, grad_outputs) if g is not None]
        if not given:
            return tuple(grad_inputs)
        return tuple(chainer.grad(
            [y for y, _ in given], [inputs[i] for i in indexes],
            [g for _, g in given], grad_inputs=list(grad_inputs),
            enable_double_backprop=True))

    def _grads(self, indexes, g_outputs, held):
        """{input index: gradient} for ``indexes``; ``held``: gradients
        the inputs held already, added where define-by-run adds them."""
        d = 2 if self.bi else 1
        n, w0, b0, first_x = self._layout()
        wanted = set(indexes)
        ghy = g_outputs[0]
        gcy = g_outputs[1] if self.n_state == 2 else None
        g_ys = g_outputs[self.n_state:]
        want_xs = any(i >= first_x for i in wanted)
        out = {}
        h0 = [None] * n
        c0 = [None] * n
        # the gradient of each time step's output of the layer above
        g_next = list(g_ys)
        for layer in range(self.n_layers - 1, -1, -1):
            g_in_layer = [None] * self._n_steps   # of the layer's inputs
            for direction in range(d):
                idx = d * layer + direction
                loop = self._loops[idx]
                if self.bi:
                    w = self._widths[idx - direction]
                    g_out = [None if g is None else
                             (g[:, :w] if direction == 0 else g[:, w:])
                             for g in g_next]
                else:
                    g_out = g_next
                if direction == 1:
                    g_out = g_out[::-1]
                gxs, gh, gc, contributions = loop.backward(
                    g_out, None if ghy is None else ghy[idx],
                    None if gcy is None else gcy[idx],
                    layer > 0 or want_xs, 0 in wanted)
                h0[idx], c0[idx] = gh, gc
                self._weight_grads(idx, contributions, out, held)
                if direction == 1:
                    gxs = gxs[::-1]
                masks = self._masks[layer][direction]
                for t, g in enumerate(gxs):
                    if g is None:
                        continue
                    if masks is not None:
                        g = g * masks[t]
                    g_in_layer[t] = nstep_steps.add(g_in_layer[t], g)
            g_next = g_in_layer
        for t, g in enumerate(g_next):
            i = first_x + t
            if i in wanted and g is not None:
                out[i] = g if i not in held else held[i] + g
        states = ((0, h0), (1, c0)) if self.n_state == 2 else ((0, h0),)
        for i, parts in states:
            if i in wanted and any(g is not None for g in parts):
                shape = self.inputs[i].shape[1:]
                g = numpy.stack([
                    numpy.zeros(shape, self.inputs[i].dtype) if g is None
                    else g for g in parts])
                out[i] = g if i not in held else held[i] + g
        return out

    def _weight_grads(self, idx, contributions, out, held):
        """Each weight's and bias's gradient: its part of the steps'
        gradients, added up in the order define-by-run reaches the steps
        (input side: ``x_path_order``; recurrent side: the latest step
        first, their ranks rising with the steps)."""
        if not contributions:
            return
        n, w0, b0, _ = self._layout()
        k = self.n_w
        x_order = self._loops[idx].x_path_order(contributions)
        half = k // 2
        for part, base, steps in (
                (1, w0 + k * idx, x_order),
                (2, w0 + k * idx + half, contributions),
                (3, b0 + k * idx, x_order),
                (4, b0 + k * idx + half, contributions)):
            if self.cell == 'lstm':
                views = [nstep_steps.gate_views(c[part]) for c in steps]
                slots = [(base + j, g) for g, j in
                         enumerate(nstep_steps.GATE_ORDER)]
            else:
                views = [(c[part],) for c in steps]
                slots = [(base, 0)]
            for i, g in slots:
                total = held.get(i)
                for v in views:
                    total = v[g] if total is None else total + v[g]
                out[i] = total


def _usable(hx, cx, ws, bs, xs):
    """Whether the loop node computes what the unrolled graph would here:
    NumPy arrays of one float dtype, parameters that want gradients, the
    lengths not increasing, no function hooks, no debug mode, no lazy
    gradient sums, backprop as usual."""
    if chainer.get_function_hooks() or chainer.is_debug() or \
            getattr(chainer.config, 'lazy_grad_sum', False) or \
            chainer.config.use_ideep != 'never':
        return False
    if hx is None or not xs:
        return False
    flat = [v for group in ws for v in group] + \
        [v for group in bs for v in group]
    if any(not isinstance(v, chainer.Variable) or not v.requires_grad
           for v in flat):
        return False
    arrays = [hx] + ([] if cx is None else [cx]) + flat + list(xs)
    dtype = None
    for a in arrays:
        a = a.array if isinstance(a, chainer.Variable) else a
        if type(a) is not numpy.ndarray or a.dtype.kind != 'f':
            return False
        if dtype is None:
            dtype = a.dtype
        elif a.dtype != dtype:
            return False
    sizes = [len(x) for x in xs]
    return all(a >= b for a, b in zip(sizes, sizes[1:])) and \
        sizes[0] <= hx.shape[1]


def _rnn_step_code():
    """The code of ``n_step_rnn_base``'s step function (a closure)."""
    for c in n_step_rnn_module.n_step_rnn_base.__code__.co_consts:
        if getattr(c, 'co_name', None) == 'f' and \
                c.co_freevars == ('activation',):
            return c
    return None


_RNN_STEP = _rnn_step_code()


# id(a weight or bias of a watched NStep link) -> (a weak reference to it,
# its _uses key)
_watched = {}


def _watch(ws, bs, key):
    """Note the link's weights and biases: an application of any other
    function to one of them (an L2 term over the link's params, a tied
    weight ``F.linear(x, rnn.ws[0][0])``, inside the method or in the
    caller) adds to their gradients in define-by-run's order among the
    unrolled steps, which one node cannot give (nstep31 hunt: 4.7e-10 to
    9.5e-7 off): the link stays unrolled from then on (_other_use)."""
    for group in list(ws) + list(bs):
        for v in group:
            if id(v) not in _watched:
                _watched[id(v)] = (weakref.ref(
                    v, lambda _, k=id(v): _watched.pop(k, None)), key)
    if _other_use not in patches.apply_watchers:
        patches.apply_watchers.append(_other_use)


def _other_use(node, inputs):
    # (Called at every application: the inputs looked up first. Under
    # backprop off, a backward's own nodes among them, no application adds
    # to a gradient.)
    for x in inputs:
        hit = _watched.get(id(x))
        if hit is None or hit[0]() is not x:
            continue
        if getattr(_state, 'inside', False) or \
                getattr(node, 'whole_call', False) or \
                not chainer.config.enable_backprop:
            return
        use = _uses.get(hit[1])
        if use is None or use[2]:
            continue
        use[2] = True
        if use[7]:
            warnings.warn(
                'static_graph: the weights of an NStep RNN that ran as one '
                'node are used by another function too (%s: an L2 term, a '
                'tied weight); that use adds to their gradients at a place '
                'among the unrolled steps one node cannot give, so the '
                'gradients of calls that ran as one node since it began '
                'can differ from define-by-run in the last bits. Its loops '
                'stay unrolled from now on.' % type(node).__name__,
                diagnostics.StaticGraphWarning)


@contextlib.contextmanager
def _inside():
    """The NStep call's own applications (its unrolled steps, or the
    node): no other use."""
    was = getattr(_state, 'inside', False)
    _state.inside = True
    try:
        yield
    finally:
        _state.inside = was


def _once_per_backward(ws):
    """Whether these NStep weights have been used once per backward so far
    (at least once before, with a backward since each use), noting this
    use. Weights used twice before one backward (a shared encoder, a
    method called twice per loss) get contributions from two places,
    which define-by-run adds step by step in an order one node per use
    cannot give: their loops stay unrolled from then on."""
    first = ws[0][0]
    key = id(first)
    use = _uses.get(key)
    now = _backwards[0]
    if use is None or use[3]() is not first:
        _uses[key] = [now, 0, False, weakref.ref(
            first, lambda _, key=key: _uses.pop(key, None)), (), (None, []),
            False, False]
        return False
    if use[0] == now and not any(r() is not None for r in use[4]):
        # (The earlier use's outputs are all gone: an evaluation with
        # backprop on whose graph was dropped, which no backward reaches;
        # nlp30 hunt.)
        use[0] = now - 1
    if use[0] == now:
        if not use[2] and use[6]:
            warnings.warn(
                'static_graph: an NStep RNN used once per backward until '
                'now was used twice before one backward; the earlier use '
                'ran as one node, so its weights\' gradients in this '
                'backward can differ from define-by-run in the last bits. '
                'Its loops stay unrolled from now on.',
                diagnostics.StaticGraphWarning)
        use[2] = True
        return False
    use[0] = now
    use[1] += 1
    return not use[2]


def _cell(f, cx):
    """'lstm', 'tanh' or 'relu' for the step functions of Chainer's
    ``n_step_lstm`` and ``n_step_rnn`` (a closure over its activation);
    None for others (``n_step_gru``'s: not built)."""
    if f is n_step_lstm_module._lstm:
        return 'lstm' if cx is not None else None
    code = getattr(f, '__code__', None)
    if code is not _RNN_STEP or cx is not None:
        return None
    activation = f.__closure__[0].cell_contents
    return activation if activation in ('tanh', 'relu') else None


def _impl(f, n_layers, dropout_ratio, hx, cx, ws, bs, xs, use_bi_direction):
    cell = _cell(f, cx)
    if cell is None:
        return _original_impl(f, n_layers, dropout_ratio, hx, cx, ws, bs, xs,
                              use_bi_direction)
    fuse = enabled and getattr(_state, 'active', False) and \
        recorder.current() is None and _usable(hx, cx, ws, bs, xs)
    use = None
    if chainer.config.enable_backprop:
        # (every use counts, fused or not)
        fuse = _once_per_backward(ws) and fuse
        use = _uses[id(ws[0][0])]
        use[6] = fuse       # (this use runs as one node)
        use[7] = use[7] or fuse
        _watch(ws, bs, id(ws[0][0]))
    if not fuse:
        with _inside():
            outs = _original_impl(f, n_layers, dropout_ratio, hx, cx, ws, bs,
                                  xs, use_bi_direction)
        if use is not None and use[7] and not use[2]:
            # (a link that runs as one node elsewhere: this use's backward
            # is watched too)
            nstep_passes.watch_unrolled(use, cell, hx, cx, ws, bs, xs, outs)
        return _outputs_noted(ws, outs)
    rank = nstep_ranks.rank
    node = NStepLoop(cell, n_layers, dropout_ratio, use_bi_direction,
                     bool(chainer.config.train),
                     (rank(hx), rank(cx), [rank(x) for x in xs]), f)
    node.use_key = id(ws[0][0])
    node.step_nodes = [x.node for x in xs if isinstance(x, chainer.Variable)]
    w_rank = nstep_ranks.weight_rank(cell)
    with _inside():
        # (h's first taker: a step's recurrent linear; c's is its cell,
        # but c's second identity ranks just above c itself: at the
        # cell's rank it handed h's and c's gradients over in another
        # order elsewhere, review48)
        states = [nstep_ranks.staged_state(hx, max(rank(hx) + 1, w_rank))]
        if cx is not None:
            states.append(nstep_ranks.staged_state(cx, rank(cx) + 1))
        xs = nstep_ranks.staged(xs, w_rank)
        args = states + [v for group in ws for v in group] + \
            [v for group in bs for v in group] + list(xs)
        outs = node.apply(args)
    for v, r in zip(outs, node.out_ranks):
        # (rank where define-by-run's outputs do, not just above the
        # inputs: the nodes after them, and Chainer's backward order among
        # them, are define-by-run's then; review45)
        v.node._rank = max(v.node.rank, r)
    if cx is None:
        return _outputs_noted(ws, (outs[0], None, tuple(outs[1:])))
    return _outputs_noted(ws, (outs[0], outs[1], tuple(outs[2:])))


def _outputs_noted(ws, outs):
    """``outs`` (hy, cy, ys), whose graph nodes the weights' use notes
    weakly (_once_per_backward: a use whose outputs are gone joins no
    backward)."""
    use = _uses.get(id(ws[0][0]))
    if use is not None and chainer.config.enable_backprop:
        hy, cy, ys = outs
        use[4] = tuple(weakref.ref(v.node) for v in (hy, cy) + tuple(ys)
                       if v is not None)
    return outs


@contextlib.contextmanager
def fused():
    """NStep LSTMs and RNNs called inside run as ``NStepLoop`` nodes (this
    thread)."""
    was = getattr(_state, 'active', False)
    _state.active = True
    if n_step_rnn_module.n_step_rnn_impl is not _impl:
        n_step_rnn_module.n_step_rnn_impl = _impl
        chainer._backprop._backprop_to_all = _counting_backprop
        function_node._backprop = _counting_grad_backprop
        # (FunctionNode.apply's wrapper, which stays once installed, tells
        # _other_use of every application; a decorated method's recordings
        # have put it in already)
        patches.install()
        patches.uninstall()
    try:
        yield
    finally:
        _state.active = was


def _counting_backprop(*args, **kwargs):
    _backwards[0] += 1
    return nstep_passes.in_pass(_original_backprop, args, kwargs)


def _counting_grad_backprop(*args, **kwargs):
    # (chainer.grad: a backward pass that counts as none for
    # _once_per_backward)
    return nstep_passes.in_pass(_original_grad_backprop, args, kwargs)
