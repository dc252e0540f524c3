"""Recurrent state that is also an output of the call: L.LSTM's ``h``
returned by the method (a decoder step ``return loss, h``), or read by
the caller from the link and used in the loss (activation
regularization). Twins trained side by side, bit for bit."""
import warnings

import numpy
import pytest

import chainer
import chainer.functions as F
import chainer.links as L

import static_graph
from static_graph import StaticGraphWarning
from static_graph.decorator import caches_of


class _Decoder(chainer.Chain):
    def __init__(self):
        super(_Decoder, self).__init__()
        with self.init_scope():
            self.embed = L.EmbedID(20, 8)
            self.rnn = L.LSTM(8, 8)
            self.out = L.Linear(8, 20)

    def forward(self, y, t):
        h = self.rnn(self.embed(y))
        return F.softmax_cross_entropy(self.out(h), t), h


def _train(calls, windows=6, state_loss=lambda w: False, keep_h=False,
           reset=True, cls=_Decoder, returned_loss=False):
    """Truncated BPTT of ``calls`` calls per window on twins of ``cls``,
    from the same parameters at each window (drawn anew, so that each
    window is compared on its own); per window, whether every gradient was
    equal; the static twin's cache and its warnings. ``state_loss(window)``:
    whether the caller adds ``0.01 * F.sum(model.rnn.h)`` after each call;
    ``returned_loss``: ``0.01 * F.sum`` of the second value returned."""
    Static = type('Static', (cls,), {
        'forward': static_graph.static_graph(cls.forward)})
    a, b = cls(), Static()
    rs = numpy.random.RandomState(1)
    equal = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        for w in range(windows):
            data = [(rs.randint(0, 20, 3).astype(numpy.int32),
                     rs.randint(0, 20, 3).astype(numpy.int32))
                    for _ in range(calls)]
            for _, p in sorted(a.namedparams()):
                p.array[...] = rs.uniform(-0.5, 0.5, p.shape)
            b.copyparams(a)
            for m in (a, b):
                if reset or w == 0:
                    m.rnn.reset_state()
                loss = 0
                kept = []
                for y, t in data:
                    l, h = m(y, t)
                    loss += l
                    if state_loss(w):
                        loss += 0.01 * F.sum(m.rnn.h)
                    if returned_loss:
                        loss += 0.01 * F.sum(h)
                    if keep_h:
                        kept.append(h)
                m.cleargrads()
                loss.backward()
                loss.unchain_backward()
            equal.append(all(
                numpy.array_equal(p.grad, q.grad) for (_, p), (_, q)
                in zip(sorted(a.namedparams()), sorted(b.namedparams()))))
    ours = [str(x.message) for x in caught
            if issubclass(x.category, StaticGraphWarning)]
    return equal, caches_of(b)['forward'], ours


@pytest.mark.parametrize('calls', [2, 3, 4, 5])
@pytest.mark.parametrize('keep_h', [False, True])
def test_returned_state_replays_bit_for_bit(calls, keep_h):
    """The state output the method also returns gets no gradient in the
    last call of a window and one in the others: the recording of a last
    call is built with a zero gradient for it (as for a state output the
    method does not return), so the key's other calls replay it. Three
    calls a window raised NotRecordedBackward at the second window: the
    key's entry came from the window's last call alone."""
    equal, cache, ours = _train(calls, keep_h=keep_h)
    assert all(equal), equal
    assert not ours, ours
    assert cache.replays >= 3 * (calls - 1)


def test_returned_state_without_reset_replays_bit_for_bit():
    equal, cache, ours = _train(3, reset=False)
    assert all(equal), equal
    assert cache.replays > 0 and not ours


def test_a_loss_of_the_state_runs_define_by_run_from_the_recording():
    """``loss += 0.01 * F.sum(model.rnn.h)``: h gets the next call's
    contribution, its own consumer's inside the call and the caller's;
    define-by-run orders those by its whole graph of calls (replayed
    windows were 2e-9 to 1.5e-8 off). The recording sees it in its
    backward and the method runs define-by-run from then on."""
    equal, cache, ours = _train(2, state_loss=lambda w: True)
    assert cache.define_by_run is not None and \
        'got a gradient from the caller too' in cache.define_by_run
    assert cache.replays == 0
    # (The recorded window's calls can differ in the last bits, as for
    # L.StatefulMGU's: the rest is define-by-run's.)
    assert all(equal[1:]), equal
    assert sum('from the caller too' in m for m in ours) == 1


def test_a_loss_of_the_state_added_after_replays_began():
    """The caller starts adding the state to the loss at window 3: the
    replayed calls' backward sees it there (the incoming gradient is not
    the one the next call returned), warns, and the method runs
    define-by-run from its next call; the windows after are equal."""
    equal, cache, ours = _train(3, state_loss=lambda w: w >= 3)
    assert all(equal[:3]), equal
    assert cache.replays > 0
    assert cache.define_by_run is not None and \
        'got a gradient from the caller too' in cache.define_by_run
    assert all(equal[4:]), equal
    said = [m for m in ours if 'from the caller too' in m]
    assert len(said) == 1 and said[0].startswith(
        'Static.forward runs define-by-run from its next call'), said


def test_a_loss_of_the_last_state_only_replays():
    """Only the window's last state in the loss: two contributions (the
    call's own and the caller's), which sum the same in either order."""
    Static = type('Static', (_Decoder,), {
        'forward': static_graph.static_graph(_Decoder.forward)})
    numpy.random.seed(0)
    a, b = _Decoder(), Static()
    b.copyparams(a)
    rs = numpy.random.RandomState(3)
    for w in range(5):
        data = [(rs.randint(0, 20, 3).astype(numpy.int32),
                 rs.randint(0, 20, 3).astype(numpy.int32)) for _ in range(3)]
        for m in (a, b):
            m.rnn.reset_state()
            loss = 0
            for y, t in data:
                loss += m(y, t)[0]
            loss += 0.01 * F.sum(m.rnn.h)
            m.cleargrads()
            loss.backward()
            loss.unchain_backward()
        for (_, p), (_, q) in zip(sorted(a.namedparams()),
                                  sorted(b.namedparams())):
            assert numpy.array_equal(p.grad, q.grad), (w, p.name)
    cache = caches_of(b)['forward']
    assert cache.replays > 0 and cache.define_by_run is None


def test_a_gradient_with_respect_to_a_state_then_the_backward_replays():
    """``chainer.grad([loss], [hs[1]])`` (a saliency) runs the next call's
    backward but not that of h's call, then ``loss.backward()`` runs both:
    the gradient the next call returned in the first pass is not taken for
    a second call's (a third contribution), and the method keeps
    replaying, its training gradients bit for bit."""
    Static = type('Static', (_Decoder,), {
        'forward': static_graph.static_graph(_Decoder.forward)})
    a, b = _Decoder(), Static()
    b.copyparams(a)
    rs = numpy.random.RandomState(7)
    for step in range(6):
        data = [(rs.randint(0, 20, 3).astype(numpy.int32),
                 rs.randint(0, 20, 3).astype(numpy.int32)) for _ in range(4)]
        grads = []
        for m in (a, b):
            m.rnn.reset_state()
            loss, hs = 0, []
            for y, t in data:
                l, h = m(y, t)
                loss += l
                hs.append(h)
            chainer.grad([loss], [hs[1]])
            m.cleargrads()
            loss.backward()
            loss.unchain_backward()
            grads.append([p.grad.copy() for _, p in sorted(m.namedparams())])
        assert all(numpy.array_equal(u, v) for u, v in zip(*grads)), step
    cache = caches_of(b)['forward']
    assert cache.replays >= 3 * 5 and cache.define_by_run is None


class _IdentityState(_Decoder):
    def forward(self, y, t):
        h = self.rnn(self.embed(y))
        return F.softmax_cross_entropy(self.out(h), t), F.identity(h)


def test_the_state_handed_out_through_an_identity_runs_define_by_run():
    """``return loss, F.identity(h)``, the identity added to the loss: h
    sums the next call's contribution, the identity's (the caller's) and
    the output layer's, in an order the caller's graph decides (replays
    were 7e-9 to 3e-8 off in every window). The recording sees the three
    in one sum and the method runs define-by-run; windows after the
    recorded one are equal."""
    equal, cache, _ = _train(4, windows=5, cls=_IdentityState,
                             returned_loss=True)
    assert cache.replays == 0 and cache.define_by_run is not None
    assert all(equal[1:]), equal
