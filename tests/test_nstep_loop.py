"""NStep LSTMs and RNNs run as one node (static_graph/nstep_loop.py) in the
define-by-run calls of decorated methods: the same bits as Chainer's
unrolled loop, gradients included, in every configuration."""
import contextlib
import warnings

import numpy
import pytest

import chainer
import chainer.functions as F
import chainer.links as L

import static_graph
from static_graph import nstep_loop
from static_graph.decorator import caches_of


def _loop_node(hy):
    node = hy.creator_node
    while node is not None and type(node).__name__ == 'Permutate':
        node = node.inputs[0].creator_node
    return type(node).__name__ == 'NStepLoop'


def _snapshot(a):
    return None if a is None else (a.copy(), a.strides, a.dtype)


def _same(a, b):
    if a is None or b is None:
        return a is None and b is None
    return a[0].tobytes() == b[0].tobytes() and a[1:] == b[1:] and \
        a[0].shape == b[0].shape



def _both(train):
    """``train(fused)`` run with the loops as one node and unrolled: (the
    first's result, the second's, the warnings the first gave)."""
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        ours = train(True)
    return ours, train(False), [str(x.message) for x in w]


_LINKS = {('lstm', False): L.NStepLSTM, ('lstm', True): L.NStepBiLSTM,
          ('tanh', False): L.NStepRNNTanh, ('tanh', True): L.NStepBiRNNTanh,
          ('relu', False): L.NStepRNNReLU, ('relu', True): L.NStepBiRNNReLU}


def _call(link, cell, hx, xs, fused=False):
    """(hy, cy or None, ys) of ``link``, inside ``nstep_loop.fused()``
    where ``fused``."""
    with nstep_loop.fused() if fused else contextlib.suppress():
        if cell == 'lstm':
            return link(hx, hx, xs)
        hy, ys = link(hx, xs)
        return hy, None, ys


def _train(cfg, seed, fused, steps=3):
    cell, n_layers, bi, lengths, outputs, hx_given, dropout, train, keep = \
        cfg
    numpy.random.seed(seed)
    link = _LINKS[cell, bi](n_layers, 5, 4, dropout)
    emb = L.EmbedID(30, 5)
    rs = numpy.random.RandomState(seed + 1)
    numpy.random.seed(seed + 2)
    seen, kinds, ranks = [], [], []
    for s in range(steps):
        if not keep or s == 0:
            link.cleargrads()
            emb.cleargrads()
        xs = [rs.randint(0, 30, size=(n,)).astype(numpy.int32)
              for n in lengths]
        exs = [emb(x) for x in xs]
        hx = None
        if hx_given:
            hx = chainer.Variable(rs.randn(
                n_layers * (2 if bi else 1), len(lengths), 4).astype('f'))
        with chainer.using_config('train', train):
            hy, cy, ys = _call(link, cell, hx, exs, fused)
        kinds.append(_loop_node(hy))
        ranks.append([v.rank for v in (hy, cy) + tuple(ys) if v is not None])
        loss = 0
        if 'h' in outputs:
            loss = loss + F.sum(hy * hy)
        if 'c' in outputs and cy is not None:
            loss = loss + F.sum(cy * 0.5)
        if 'y' in outputs:
            loss = loss + F.sum(F.concat(ys, axis=0) ** 3)
        loss.backward()
        seen.append(_snapshot(loss.array))
        if hx_given:
            seen.append(_snapshot(hx.grad))
        seen.extend(_snapshot(y.array) for y in ys)
    seen.extend(_snapshot(p.grad) for p in link.params())
    seen.extend(_snapshot(p.grad) for p in emb.params())
    return seen, kinds, ranks


def _configs(n):
    rs = numpy.random.RandomState(0)
    out = []
    for _ in range(n):
        lengths = list(rs.randint(1, 8, size=rs.randint(1, 6)))
        cell = str(rs.choice(['lstm', 'lstm', 'tanh', 'relu']))
        outputs = [o for o in ('hcy' if cell == 'lstm' else 'hy')
                   if rs.randint(2)] or ['h']
        out.append((cell,
                    int(rs.randint(1, 4)), bool(rs.randint(2)),
                    [int(v) for v in lengths], ''.join(outputs),
                    bool(rs.randint(2)), float(rs.choice([0.0, 0.3])),
                    bool(rs.randint(2)), bool(rs.randint(2))))
    return out


@pytest.mark.parametrize('cfg', _configs(36))
def test_the_loop_node_gives_the_unrolled_loops_bits(cfg):
    """LSTMs and tanh and ReLU RNNs, layers, both directions, lengths in
    any order (the link sorts them), which outputs get gradients, given
    initial states, dropout between layers, training or not, gradients
    accumulated over steps: losses, outputs, every gradient (values,
    dtype and strides) equal; and the outputs' ranks, which order the
    backward of what comes after them (review45: ranked just above the
    node's inputs, a second link's uses on them were summed in another
    order)."""
    ours, kinds, ranks = _train(cfg, 3, True)
    theirs, _, their_ranks = _train(cfg, 3, False)
    # The first use of a link is only noted; later ones run as one node.
    assert kinds == [False, True, True]
    assert ranks == their_ranks
    assert len(ours) == len(theirs)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert _same(a, b), (cfg, i)


def test_weights_used_twice_before_a_backward_stay_unrolled():
    """A link used twice per loss (a shared encoder) gets contributions
    from two places, which define-by-run interleaves step by step: its
    loops stay unrolled, and the bits stay define-by-run's."""
    def train(fused):
        numpy.random.seed(0)
        link = L.NStepLSTM(1, 3, 3, 0.0)
        rs = numpy.random.RandomState(1)
        kinds = []
        for _ in range(3):
            link.cleargrads()
            a = [rs.randn(n, 3).astype('f') for n in (4, 2)]
            b = [rs.randn(n, 3).astype('f') for n in (3, 3)]
            with nstep_loop.fused() if fused else contextlib.suppress():
                ha, _, _ = link(None, None, a)
                hb, _, _ = link(None, None, b)
            kinds += [_loop_node(ha), _loop_node(hb)]
            F.sum(ha * hb).backward()
        return [p.grad.copy() for p in link.params()], kinds
    ours, kinds = train(True)
    theirs, _ = train(False)
    assert not any(kinds)
    for a, b in zip(ours, theirs):
        assert a.tobytes() == b.tobytes()


def _second_order(fused, cell, bi, dropout):
    """A gradient penalty through an NStep RNN: d/dW of |dL/dx|^2."""
    numpy.random.seed(0)
    link = _LINKS[cell, bi](2, 3, 4, dropout)
    rs = numpy.random.RandomState(1)
    out = []
    for step in range(3):
        link.cleargrads()
        xs = [chainer.Variable(rs.randn(n, 3).astype('f'))
              for n in (4, 2, 3)]
        numpy.random.seed(10 + step)
        hy, _, ys = _call(link, cell, None, xs, fused)
        out.append(_loop_node(hy))
        loss = F.sum(hy * hy) + F.sum(F.concat(ys, axis=0))
        gxs = chainer.grad([loss], xs, enable_double_backprop=True)
        penalty = sum(F.sum(g * g) for g in gxs)
        (loss + penalty).backward()
    return out, [p.grad.copy() for p in link.params()]


@pytest.mark.parametrize('cell,bi,dropout', [
    ('lstm', False, 0.0), ('lstm', True, 0.3), ('tanh', True, 0.3),
    ('relu', False, 0.0)])
def test_a_second_order_gradient_through_the_loop_node(cell, bi, dropout):
    """The node's backward, asked for a graph (a gradient penalty), unrolls
    the loop again over its inputs with the dropout masks it drew: the
    same gradients up to the order of the parameters' sums, which one
    node cannot interleave with the unrolled graph's (warned once); the
    RNN stays unrolled from then on. A tanh or ReLU RNN's steps take the
    weights themselves: the double backward of its first, watched, use
    applies functions to them (another use, _other_use), and it stays
    unrolled from the start, with define-by-run's bits."""
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        kinds, ours = _second_order(True, cell, bi, dropout)
    _, theirs = _second_order(False, cell, bi, dropout)
    said = [x for x in w if 'second-order gradient' in str(x.message)]
    if cell == 'lstm':      # (its steps take the weights stacked)
        assert kinds == [False, True, False] and len(said) == 1
        for a, b in zip(ours, theirs):
            numpy.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    else:
        assert kinds == [False, False, False] and not said
        for a, b in zip(ours, theirs):
            assert a.tobytes() == b.tobytes()


class _Classifier(chainer.Chain):

    def __init__(self):
        super(_Classifier, self).__init__()
        with self.init_scope():
            self.embed = L.EmbedID(40, 6)
            self.rnn = L.NStepLSTM(1, 6, 5, 0.1)
            self.out = L.Linear(5, 3)

    def forward(self, xs, t):
        sections = numpy.cumsum([len(x) for x in xs[:-1]])
        exs = F.split_axis(self.embed(F.concat(xs, axis=0)), sections, 0)
        exs = [F.dropout(e, 0.1) for e in exs]
        hy, _, _ = self.rnn(None, None, exs)
        return F.softmax_cross_entropy(self.out(hy[-1]), t)


class _Decorated(_Classifier):

    @static_graph.static_graph
    def forward(self, xs, t):
        return _Classifier.forward(self, xs, t)


def test_a_decorated_method_with_new_lengths_in_every_batch(monkeypatch):
    """Once the method's keys prove not to repeat, its calls run
    define-by-run with the NStep LSTM as one node: trained next to an
    undecorated twin, every loss and parameter is the same."""
    calls = []
    forward = nstep_loop.NStepLoop.forward
    monkeypatch.setattr(nstep_loop.NStepLoop, 'forward',
                        lambda self, inputs: calls.append(1) or
                        forward(self, inputs))
    numpy.random.seed(0)
    ours = _Decorated()
    numpy.random.seed(0)
    theirs = _Classifier()
    opts = []
    for m in (ours, theirs):
        opt = chainer.optimizers.Adam()
        opt.setup(m)
        opts.append(opt)
    rs = numpy.random.RandomState(5)
    for step in range(14):
        xs = [rs.randint(0, 40, size=(n,)).astype(numpy.int32)
              for n in rs.randint(2, 12, size=4)]
        t = rs.randint(0, 3, size=4).astype(numpy.int32)
        losses = []
        for m, opt in zip((ours, theirs), opts):
            numpy.random.seed(100 + step)
            m.cleargrads()
            loss = m(xs, t)
            loss.backward()
            opt.update()
            losses.append(loss.array.copy())
        assert losses[0].tobytes() == losses[1].tobytes(), step
    for (name, a), (_, b) in zip(sorted(ours.namedparams()),
                                 sorted(theirs.namedparams())):
        assert a.array.tobytes() == b.array.tobytes(), name
    assert calls, 'no call ran the loop node'


class _Regularized(_Classifier):
    """An L2 term over the LSTM's parameters (``inside``), or its first
    weight tied to a Linear's (``tied``), in the method."""
    use = 'inside'

    @static_graph.static_graph
    def forward(self, xs, t):
        loss = _Classifier.forward(self, xs, t)
        if self.use == 'inside':
            for p in self.rnn.params():
                loss = loss + 1e-3 * F.sum(p * p)
        else:
            loss = loss + F.sum(F.linear(self.embed.W[:2],
                                         self.rnn.ws[0][0]))
        return loss


@pytest.mark.parametrize('use', ['inside', 'tied', 'caller'])
def test_weights_another_function_uses_stay_unrolled(use, monkeypatch):
    """Another function taking the LSTM's weights (an L2 term in the
    method or in the caller, a tied weight) adds to their gradients at a
    place among the unrolled steps that one node cannot give: the node's
    calls were 4.7e-10 to 9.5e-7 off (nstep31 hunt). Seen at the link's
    first, watched, use, its loops stay unrolled. (Gradients taken with
    the parameters fixed, each step compared on its own; the recording
    calls, before the method goes on probation, differ for ``caller``
    as documented: the term's contributions are added after the
    recorded node's.)"""
    calls = []
    forward = nstep_loop.NStepLoop.forward
    monkeypatch.setattr(nstep_loop.NStepLoop, 'forward',
                        lambda self, inputs: calls.append(1) or
                        forward(self, inputs))
    plain = type('Plain', (_Classifier,), {
        'use': use, 'forward': lambda self, xs, t:
        _Regularized.forward.__wrapped__(self, xs, t)})
    dec = type('Dec', (_Regularized,), {'use': use})
    models = []
    for cls in (dec, plain):
        numpy.random.seed(0)
        models.append(cls())
    rs = numpy.random.RandomState(5)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        for step in range(10):
            xs = [rs.randint(0, 40, size=(n,)).astype(numpy.int32)
                  for n in rs.randint(2, 12, size=4)]
            t = rs.randint(0, 3, size=4).astype(numpy.int32)
            seen = []
            for m in models:
                numpy.random.seed(100 + step)
                m.cleargrads()
                loss = m(xs, t)
                if use == 'caller':
                    for p in m.rnn.params():
                        loss = loss + 1e-3 * F.sum(p * p)
                loss.backward()
                seen.append([p.grad.tobytes() for _, p in
                             sorted(m.namedparams())])
            if step >= 4:      # (the define-by-run calls)
                assert seen[0] == seen[1], step
    assert not calls
    (c,) = caches_of(models[0]).values()
    assert c.fallback_calls >= 5


def test_a_gru_stays_unrolled():
    link = L.NStepGRU(1, 3, 3, 0.0)
    xs = [numpy.ones((2, 3), 'f')]
    for _ in range(3):
        with nstep_loop.fused():
            hy, _ = link(None, xs)
        assert not _loop_node(hy)
        F.sum(hy).backward()


class _Carried(chainer.Chain):
    """An NStep LSTM whose state the loop hands from call to call inside
    a window of three calls with one summed loss: the last call's state
    gets no gradient."""

    def __init__(self):
        super(_Carried, self).__init__()
        with self.init_scope():
            self.emb = L.EmbedID(11, 6)
            self.rnn = L.NStepLSTM(1, 6, 6, 0.0)
            self.out = L.Linear(6, 11)

    def forward(self, hx, cx, xs):
        hy, cy, ys = self.rnn(hx, cx, [self.emb(x) for x in xs])
        return F.softmax_cross_entropy(
            self.out(F.concat(ys, axis=0)), self.xp.concatenate(xs)), hy, cy


def test_a_carried_state_without_a_gradient_at_the_windows_end():
    """The last call of the window replayed with its state's gradient
    missing: the recorded backward's ops for that state (the permutation
    and stack that make ``hy``) were neither sums nor nodes that take
    None, and the call raised NotRecordedBackward where define-by-run
    trains. Those ops' nodes are never reached by define-by-run's
    backprop: left out, bit for bit. (The first window, whose calls all
    record, hands back their contributions summed: last bits, documented;
    so the parameters stay put, learning rate 0, and that window is
    compared to 1e-6.)"""
    S = type('S', (_Carried,), {'forward': static_graph.static_graph(
        _Carried.forward)})
    models = []
    for cls in (_Carried, S):
        numpy.random.seed(0)
        m = cls()
        models.append((m, chainer.optimizers.SGD(0.0).setup(m)))
    for w in range(4):
        seen = []
        for m, opt in models:
            hx = cx = None
            loss = 0
            for i in range(3):
                r = numpy.random.RandomState(10 * w + i)
                xs = [r.randint(0, 11, 4).astype('i') for _ in range(2)]
                l, hx, cx = m(hx, cx, xs)
                loss = loss + l
            m.cleargrads()
            loss.backward()
            loss.unchain_backward()
            opt.update()
            seen.append([loss.array] + [p.grad.copy() for p in m.params()])
        for a, b in zip(*seen):
            if w == 0:
                numpy.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
            else:
                assert numpy.array_equal(a, b), w
    assert sum(c.replays for c in caches_of(models[1][0]).values()) >= 6


def test_an_evaluation_with_backprop_on_between_steps_keeps_the_node():
    """An evaluation forward with backprop on whose graph is dropped (no
    backward reaches it) between training steps is no second use before
    one backward: no warning, the loop stays one node, the same bits
    (nlp30 hunt: it warned and unrolled the loop for good)."""
    def train(fused):
        numpy.random.seed(0)
        link = L.NStepLSTM(1, 3, 3, 0.0)
        rs = numpy.random.RandomState(1)
        kinds, grads = [], []
        for _ in range(4):
            link.cleargrads()
            xs = [rs.randn(n, 3).astype('f') for n in (4, 2)]
            with nstep_loop.fused() if fused else contextlib.suppress():
                with chainer.using_config('train', False):
                    link(None, None, xs)        # dropped at once
                hy, _, _ = link(None, None, xs)
            kinds.append(_loop_node(hy))
            F.sum(hy * hy).backward()
            grads += [p.grad.copy() for p in link.params()]
        return grads, kinds
    (ours, kinds), (theirs, _), w = _both(train)
    assert not [x for x in w if 'used twice' in x]
    assert all(kinds[1:])
    for a, b in zip(ours, theirs):
        assert a.tobytes() == b.tobytes()


def test_a_shared_encoder_under_chainer_grad_stays_unrolled():
    """The shared encoder of the test above, its gradients taken with
    ``chainer.grad`` (which counts as no backward pass) and each step's
    outputs gone before the next: the link's loops stay unrolled and the
    bits are define-by-run's at every step (a guard for a change of when
    two uses count as one backward's: review41)."""
    def train(fused):
        numpy.random.seed(0)
        link = L.NStepLSTM(1, 3, 3, 0.0)
        rs = numpy.random.RandomState(1)
        kinds, grads = [], []

        def step(a, b):     # (its outputs gone before the next step)
            with nstep_loop.fused() if fused else contextlib.suppress():
                ha, _, _ = link(None, None, a)
                hb, _, _ = link(None, None, b)
            kinds.extend([_loop_node(ha), _loop_node(hb)])
            grads.extend(chainer.grad([F.sum(ha * hb)], list(link.params())))
        for _ in range(4):
            step([rs.randn(n, 3).astype('f') for n in (4, 2)],
                 [rs.randn(n, 3).astype('f') for n in (3, 3)])
        return [g.array for g in grads], kinds
    ours, kinds = train(True)
    theirs, _ = train(False)
    assert not any(kinds)
    for a, b in zip(ours, theirs):
        assert a.tobytes() == b.tobytes()


def _uses_with_a_dropped_use(where, backward):
    """A shared encoder (two uses in one loss) with an evaluation use whose
    outputs are dropped at once, after both uses or between them
    (review41); its gradients at each step, fused or not."""
    def train(fused):
        numpy.random.seed(0)
        link = L.NStepLSTM(1, 3, 4, 0.0)
        rs = numpy.random.RandomState(1)
        grads = []
        for _ in range(5):
            link.cleargrads()
            a, b, v = [[rs.randn(n, 3).astype('f') for n in ns]
                       for ns in ((4, 2), (3, 3), (5,))]
            with nstep_loop.fused() if fused else contextlib.suppress():
                ha = link(None, None, a)[0]
                if where == 'between':
                    with chainer.using_config('train', False):
                        link(None, None, v)
                hb = link(None, None, b)[0]
                if where == 'after':
                    with chainer.using_config('train', False):
                        link(None, None, v)
            loss = F.sum(ha * ha) + F.sum(hb * hb)
            if backward == 'grad':
                grads += [g.array for g in chainer.grad(
                    [loss], list(link.params()))]
            else:
                loss.backward()
                grads += [p.grad.copy() for p in link.params()]
        return grads
    return train(True), train(False)


@pytest.mark.parametrize('where', ['between', 'after'])
@pytest.mark.parametrize('backward', ['backward', 'grad'])
def test_a_shared_encoder_with_a_dropped_use_stays_define_by_run(
        where, backward):
    """A third use whose outputs are gone at once, between the shared
    encoder's two uses or after them, does not hide that the two meet in
    one backward: a guard (review41: a rule tried and withdrawn let one
    run as one node, 1.5e-8 to 7e-7 off, silently)."""
    ours, theirs = _uses_with_a_dropped_use(where, backward)
    for a, b in zip(ours, theirs):
        assert a.tobytes() == b.tobytes()



def _backward_between(variant, fused, steps=5):
    """A link used twice per loss with a backward between the two uses
    (another model's loss, a loss over the first use, or the second use
    reading the first's outputs; with ``chainer.grad`` for the loss and
    another model's backward after it), or carrying the first use's state into
    the second ('state'; in c alone: 'c'; from a first use whose inputs
    sit deeper in the graph: 'deep', there another link's outputs:
    'stacked'), or with the first use unrolled, made
    outside (undecorated code calling the link too: 'mixed'); per step: the link's gradients, and whether each
    use ran as one node."""
    numpy.random.seed(0)
    link = L.NStepLSTM(1, 3, 3, 0.0)
    other = L.Linear(3, 3)
    below = L.NStepLSTM(1, 3, 3, 0.0)
    rs = numpy.random.RandomState(1)
    grads, kinds = [], []
    for _ in range(steps):
        for m in (link, other, below):
            m.cleargrads()
        a = [rs.randn(n, 3).astype('f') for n in (4, 2)]
        b = [rs.randn(n, 3).astype('f') for n in (3, 3)]
        if variant == 'deep':
            a = [F.tanh(F.tanh(F.tanh(x))) for x in a]
        if variant == 'mixed':     # (its first use outside: unrolled)
            h, c, ys = link(None, None, a)
        with nstep_loop.fused() if fused else contextlib.suppress():
            if variant == 'stacked':
                a = list(below(None, None, a)[2])
                b = [F.tanh(F.tanh(F.tanh(x))) for x in b]
            if variant != 'mixed':
                h, c, ys = link(None, None, a)
            if variant == 'other':
                F.sum(other(rs.randn(2, 3).astype('f'))).backward()
            else:
                F.sum(h * 0.5).backward()
            if variant in ('state', 'deep', 'stacked'):
                h2, _, _ = link(h, c, b)
            elif variant == 'c':
                h2, _, _ = link(None, c, b)
            elif variant == 'outputs':
                h2, _, _ = link(None, None, [y * 2 for y in ys])
            else:
                h2, _, _ = link(None, None, b)
        kinds.append((_loop_node(h), _loop_node(h2)))
        loss = F.sum(h * h2)
        if variant == 'grad':
            # (then another model's backward: the next step's first use
            # comes after a backward)
            grads.append([g.array for g in chainer.grad(
                [loss], list(link.params()))])
            F.sum(other(rs.randn(2, 3).astype('f'))).backward()
        else:
            loss.backward()
            grads.append([p.grad.copy() for p in link.params()])
    return grads, kinds


@pytest.mark.parametrize('variant', ['other', 'loss', 'outputs', 'grad',
                                     'c', 'deep', 'stacked', 'mixed'])
def test_two_uses_that_meet_in_one_backward_warn_and_unroll(variant):
    """A backward between a shared encoder's two uses that leaves the first
    use's graph to the later backward (found 2026-11-29: 1.5e-8 to 2.4e-7
    off at every step, unwarned): the pass where two nodes of the link meet
    warns once, and from the next step on its loops are unrolled and the
    bits are define-by-run's. Also where the second use starts from the
    first's state, but define-by-run's backward still interleaves their
    steps: the state carried in c alone, or the first use's inputs deeper
    in the graph than the second's, also where those are another link's
    outputs (review45); the first use unrolled, made outside the loops
    run as one node (review44)."""
    (ours, kinds), (theirs, _), w = _both(
        lambda fused: _backward_between(variant, fused))
    met = [x for x in w if 'met another use of its weights' in x]
    assert len(met) == 1
    # (both as one node, or the second, where the pass met)
    assert kinds[1] == (variant != 'mixed', True)
    assert not any(any(k) for k in kinds[2:])
    for step in range(2, len(ours)):
        for a, b in zip(ours[step], theirs[step]):
            assert a.tobytes() == b.tobytes()


def test_a_use_that_carries_the_others_state_keeps_the_node():
    """The second use starts from the first's final state (truncated BPTT
    without ``unchain_backward()``): its steps are reached after the
    first's, the two nodes give define-by-run's bits, and nothing warns."""
    (ours, kinds), (theirs, _), w = _both(
        lambda fused: _backward_between('state', fused))
    assert not [x for x in w if 'NStep' in x]
    assert all(kinds[1:]) and all(all(k) for k in kinds[1:])
    for a, b in zip(ours, theirs):
        for x, y in zip(a, b):
            assert x.tobytes() == y.tobytes()


def test_a_long_truncated_sequence_without_unchain_keeps_the_node():
    """Windows of a sequence, each window's state carried into the next
    without ``unchain_backward()``, each window's loss backpropagated, at
    batch 120 with its inputs embedded sequence by sequence: each pass
    reaches every earlier window's node through the states, and finds
    them by the states however many input nodes each window has (review44:
    a search through every input gave up, warned and unrolled the link)."""
    def train(fused):
        numpy.random.seed(0)
        emb = L.EmbedID(30, 3)
        link = L.NStepLSTM(1, 3, 3, 0.0)
        rs = numpy.random.RandomState(1)
        grads, kinds = [], []
        h = c = None
        for _ in range(5):
            link.cleargrads()
            emb.cleargrads()
            exs = [emb(rs.randint(0, 30, size=3).astype('i'))
                   for _ in range(120)]
            with nstep_loop.fused() if fused else contextlib.suppress():
                h, c, ys = link(h, c, exs)
            kinds.append(_loop_node(h))
            F.sum(F.concat(ys, axis=0) ** 2).backward()
            grads.append([p.grad.copy() for p in link.params()] +
                         [emb.W.grad.copy()])
        return grads, kinds
    (ours, kinds), (theirs, _), w = _both(train)
    assert not [x for x in w if 'NStep' in x]
    assert kinds == [False, True, True, True, True]
    for a, b in zip(ours, theirs):
        for x, y in zip(a, b):
            assert x.tobytes() == y.tobytes()


def test_a_link_that_never_ran_as_one_node_is_not_warned_about():
    """A link of an undecorated model in a process where NStep links run as
    one node elsewhere, its evaluation outputs (backprop on) kept while it
    trains: used twice before one backward, as before, but nothing of it
    ran as one node, and nothing warns that it did (a warning said so
    until 2026-11-29)."""
    with nstep_loop.fused():
        pass      # (the patches go in, as a decorated method puts them)
    numpy.random.seed(0)
    link = L.NStepLSTM(1, 3, 3, 0.0)
    rs = numpy.random.RandomState(1)
    kept = []
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        for _ in range(4):
            link.cleargrads()
            h, _, _ = link(None, None, [rs.randn(4, 3).astype('f')])
            F.sum(h).backward()
            kept.append(link(None, None, [rs.randn(4, 3).astype('f')])[0])
    assert not [x for x in w if 'static_graph' in str(x.message)]


@pytest.mark.parametrize('middle', [3, 8, 20])
def test_inputs_used_elsewhere_get_their_gradients_in_order(middle):
    """A decoder started from an encoder's state (its node ranks above
    that deep state) whose inputs other functions use too, one ranking
    above the node, one between the node and the decoder's unrolled input
    linears: each input gets its three gradients in define-by-run's order
    (nstep_ranks.StepInputs; review46: 1.2e-7 off at every step, in a
    window of depths that moved with the ranks of the encoder's
    outputs)."""
    def train(fused):
        numpy.random.seed(0)
        enc = L.NStepLSTM(1, 3, 3, 0.0)
        dec = L.NStepLSTM(1, 3, 3, 0.0)
        rs = numpy.random.RandomState(3)
        seen, kinds = [], []
        for _ in range(4):
            enc.cleargrads()
            dec.cleargrads()
            src = [rs.randn(n, 3).astype('f') for n in (6, 5, 3)]
            tgt = [chainer.Variable(rs.randn(n, 3).astype('f'))
                   for n in (4, 3, 2)]
            with nstep_loop.fused() if fused else contextlib.suppress():
                hx, cx, _ = enc(None, None, src)
                hy, _, ys = dec(hx, cx, tgt)
            kinds.append(_loop_node(hy))
            loss = F.sum(F.concat(ys, axis=0))
            for x in tgt:
                deep = med = chainer.Variable(numpy.full(x.shape, .7, 'f'))
                for _ in range(60):
                    deep = deep * 1.001
                for _ in range(middle):
                    med = med * 1.01
                loss = loss + F.sum(F.tanh(x) * deep) + \
                    F.sum(F.sigmoid(x) * med)
            loss.backward()
            seen += [x.grad for x in tgt]
            seen += [p.grad for link in (enc, dec) for p in link.params()]
        return seen, kinds
    (ours, kinds), (theirs, _), w = _both(train)
    assert kinds[1:] == [True] * 3
    for a, b in zip(ours, theirs):
        assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize('deep_inputs,depth', [
    (False, 0), (False, 1), (True, 0), (True, 3), (True, 8)])
def test_states_used_elsewhere_get_their_gradients_in_order(deep_inputs,
                                                            depth):
    """A decoder started from an encoder's final state, which other
    functions use too (a tanh of h, a sigmoid of c, a linear ``depth``
    multiplications further), or whose inputs lie ``depth`` nodes deeper
    (``deep_inputs``; the linear on the state itself then): the
    encoder's state gets its gradients where define-by-run's Separate
    would hand them over (nstep_ranks.staged_state: until 2026-11-29 2.4e-7
    to 9.5e-7 off at every step, in patterns that moved when the node's
    outputs took define-by-run's ranks). A user two nodes after the state
    is still off (as it was before): a tie further into the unrolled
    graph."""
    def train(fused):
        numpy.random.seed(0)
        enc = L.NStepLSTM(1, 3, 3, 0.0)
        dec = L.NStepLSTM(1, 3, 3, 0.0)
        bridge = L.Linear(3, 3)
        rs = numpy.random.RandomState(3)
        seen, kinds = [], []
        for _ in range(4):
            for link in (enc, dec, bridge):
                link.cleargrads()
            src = [rs.randn(n, 3).astype('f') for n in (6, 5, 3)]
            tgt = [rs.randn(n, 3).astype('f') for n in (4, 3, 2)]
            with nstep_loop.fused() if fused else contextlib.suppress():
                hx, cx, _ = enc(None, None, src)
                if deep_inputs:
                    tgt = [F.tanh(chainer.Variable(x)) for x in tgt]
                    for _ in range(depth):
                        tgt = [x * 1.0 for x in tgt]
                hy, _, ys = dec(hx, cx, tgt)
            kinds.append(_loop_node(hy))
            h = hx
            for _ in range(0 if deep_inputs else depth):
                h = h * 1.01
            loss = F.sum(F.concat(ys, axis=0)) + F.sum(hy) + \
                F.sum(bridge(h[0])) + F.sum(F.tanh(hx)) + \
                F.sum(F.sigmoid(cx))
            loss.backward()
            seen += [p.grad for link in (enc, dec, bridge)
                     for p in link.params()]
        return seen, kinds
    (ours, kinds), (theirs, _), w = _both(train)
    assert kinds[1:] == [True] * 3
    for a, b in zip(ours, theirs):
        assert a.tobytes() == b.tobytes()


def test_loops_stay_unrolled_when_turned_off(monkeypatch):
    """``nstep_loop.enabled = False``: the escape for models whose RNN
    inputs or states other functions use too (docs/fallbacks.md); the
    loops stay Chainer's, so the bits are define-by-run's."""
    monkeypatch.setattr(nstep_loop, 'enabled', False)
    cfg = _configs(1)[0]
    ours, kinds, _ = _train(cfg, 3, True)
    theirs, _, _ = _train(cfg, 3, False)
    assert not any(kinds)
    for a, b in zip(ours, theirs):
        assert _same(a, b)
