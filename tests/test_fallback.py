"""Never silently wrong: what cannot be replayed falls back, once, loudly."""
import logging
import warnings

import numpy
import pytest

import chainer
import chainer.functions as F
import chainer.links as L

import static_graph
from static_graph import StaticGraphWarning
from static_graph.decorator import caches_of
from tests.twins import assert_close, compare_chains, twin_optimizers

rs = numpy.random.RandomState(0)


def data(*shape):
    return rs.standard_normal(shape).astype(numpy.float32)


class Base(chainer.Chain):
    def __init__(self):
        super(Base, self).__init__()
        with self.init_scope():
            self.l1 = L.Linear(4, 4)
            self.l2 = L.Linear(4, 4)


class OneLinear(Base):
    @static_graph.static_graph
    def forward(self, x):
        return self.l1(x)


def run_twins(body, inputs, **kw):
    """Build dbr and static chains whose forward is ``body``; run each input
    through both (forward+backward), compare; return (static chain, warnings).
    """
    plain = type('Plain', (Base,), {'forward': body})
    static = type('Static', (Base,), {'forward': static_graph.static_graph(
        body)})
    a, b = plain(), static()
    b.copyparams(a)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        for x in inputs:
            outs = []
            for m in (a, b):
                m.cleargrads()
                y = m(x, **kw)
                F.sum(y * y).backward()
                outs.append(y.array)
            assert_close(outs[0], outs[1], 'output')
            compare_chains(a, b)
    ours = [w for w in caught if issubclass(w.category, StaticGraphWarning)]
    return b, ours


def only_cache(chain):
    caches = caches_of(chain)
    assert len(caches) == 1
    return list(caches.values())[0]


def fell_back(chain):
    cache = only_cache(chain)
    return [e.reason for e in cache.entries.values() if e.state == 'fallback']


def branchy_inputs():
    # Alternate the sign so a frozen branch would give wrong numbers.
    return [data(3, 4) * s for s in (1, -1, 1, -1)]


@pytest.mark.parametrize('read', ['float', 'bool', 'int', 'item', 'tolist',
                                  'compare'])
def test_value_reads_on_variables_fall_back(read):
    def body(self, x):
        h = self.l1(x)
        s = F.sum(h)
        if read == 'float':
            positive = float(s.array) > 0
        elif read == 'bool':
            positive = bool(s.array > 0)
        elif read == 'int':
            positive = int(s.array > 0) == 1
        elif read == 'item':
            positive = s.item() > 0
        elif read == 'tolist':
            positive = s.array.tolist() > 0
        else:
            positive = (s.array > 0).all()
            if positive:
                positive = True
        return self.l2(h) if positive else -self.l2(h) * 3
    b, ws = run_twins(body, branchy_inputs())
    reasons = fell_back(b)
    assert len(reasons) == 1 and 'reads array values' in reasons[0]
    assert 'test_fallback.py' in reasons[0]
    assert len(ws) == 1, [str(w.message) for w in ws]
    assert 'test_fallback.py' in str(ws[0].message)
    # Issued at the caller's line (run_twins), not inside the library.
    assert ws[0].filename == __file__


def test_branch_on_raw_input_array_falls_back():
    def body(self, x):
        if x.sum() > 0:
            return self.l1(x)
        return self.l2(x)
    b, ws = run_twins(body, branchy_inputs())
    assert fell_back(b) and len(ws) == 1


def test_loop_count_from_input_values_falls_back():
    def body(self, x, n=None):
        h = x
        for _ in range(int(numpy.abs(x).max() * 2) % 3 + 1):
            h = F.tanh(self.l1(h))
        return h
    b, ws = run_twins(body, [data(3, 4) * k for k in (0.2, 1.0, 0.6)])
    assert fell_back(b)


def test_numpy_preprocessing_of_inputs_replays():
    """NumPy arithmetic on an input is an op of the schedule
    (numpy_calls.py; bit-for-bit twins in test_numpy_calls.py)."""
    def body(self, x):
        return self.l1(x / 2.0 + 1.0)
    b, ws = run_twins(body, [data(3, 4) for _ in range(3)])
    assert not fell_back(b) and not ws
    assert only_cache(b).replays == 2


def test_numpy_on_variable_array_replays():
    def body(self, x):
        h = self.l1(x)
        return self.l2(numpy.tanh(h.array))
    b, ws = run_twins(body, [data(3, 4) for _ in range(3)])
    assert not fell_back(b) and not ws
    assert only_cache(b).replays == 2


def test_stop_gradient_through_array_is_replayed():
    def body(self, x):
        h = self.l1(x)
        return self.l2(h.array) + h   # .array as a stop-gradient, no values
    b, ws = run_twins(body, [data(3, 4) for _ in range(3)])
    assert not fell_back(b) and not ws
    assert only_cache(b).replays == 2


def test_constants_replay_but_data_constant_falls_back():
    """A uniform constant, and one made from a shape alone (arange, eye:
    the same at every call of the key), replay; so does a NumPy function of
    the input's values (numpy.sort, an op of the schedule, made again from
    each call's input); an array computed from a number read from them
    falls back."""
    def uniform(self, x):
        return self.l1(x) + self.xp.ones((3, 4), 'f')
    b, ws = run_twins(uniform, [data(3, 4) for _ in range(3)])
    assert not fell_back(b)

    def from_shape(self, x):
        return self.l1(x) + self.xp.arange(12, dtype='f').reshape(3, 4) + \
            self.xp.eye(3, 4, dtype='f')
    b, ws = run_twins(from_shape, [data(3, 4) for _ in range(3)])
    assert not fell_back(b) and only_cache(b).replays == 2

    def sorted_data(self, x):
        return self.l1(x) + self.xp.sort(x, axis=1)
    b, ws = run_twins(sorted_data, [data(3, 4) for _ in range(3)])
    assert not fell_back(b) and only_cache(b).replays == 2

    def from_data(self, x):
        return self.l1(x) + self.xp.full((3, 4), x.max(), 'f')
    b, ws = run_twins(from_data, [data(3, 4) for _ in range(3)])
    assert fell_back(b)


def test_attribute_side_effect_falls_back():
    def body(self, x):
        self.calls = getattr(self, 'calls', 0) + 1
        return self.l1(x) * self.calls
    b, ws = run_twins(body, [data(3, 4) for _ in range(3)])
    assert fell_back(b)
    assert b.calls == 3


def test_variable_attribute_is_kept_current():
    def body(self, x):
        self.hidden = self.l1(x)
        return self.l2(self.hidden)
    b, ws = run_twins(body, [data(3, 4) for _ in range(3)])
    assert not fell_back(b)
    x = data(3, 4)
    b(x)
    with chainer.no_backprop_mode():
        expected = b.l1(x).array
    assert_close(b.hidden.array, expected, 'attribute')


class Scale(chainer.FunctionNode):
    """A user-defined pure op: replayed generically."""

    def forward(self, inputs):
        x, = inputs
        self.retain_inputs(())
        return x * 3.0,

    def backward(self, indexes, grad_outputs):
        return grad_outputs[0] * 3.0,


class InPlace(chainer.FunctionNode):
    """A user-defined op that mutates its input."""

    def forward(self, inputs):
        x, = inputs
        x *= 2.0
        return x + 0,

    def backward(self, indexes, grad_outputs):
        return grad_outputs[0] * 2.0,


class Declared(Scale):
    static_graph_side_effects = True


def test_user_pure_op_is_replayed():
    def body(self, x):
        return Scale().apply((self.l1(x),))[0]
    b, ws = run_twins(body, [data(3, 4) for _ in range(3)])
    assert not fell_back(b) and not ws


@pytest.mark.parametrize('op', [InPlace, Declared])
def test_user_op_with_side_effects_falls_back(op):
    def body(self, x):
        return op().apply((self.l1(x),))[0]
    b, ws = run_twins(body, [data(3, 4) for _ in range(3)])
    reasons = fell_back(b)
    assert reasons and op.__name__ in reasons[0]


def test_nested_static_chains_are_inlined():
    class Inner(chainer.Chain):
        def __init__(self):
            super(Inner, self).__init__()
            with self.init_scope():
                self.l = L.Linear(4, 4)

        @static_graph.static_graph
        def forward(self, x):
            return F.relu(self.l(x))

    class Outer(chainer.Chain):
        def __init__(self):
            super(Outer, self).__init__()
            with self.init_scope():
                self.inner = Inner()
                self.l = L.Linear(4, 2)

        def forward(self, x):
            return self.l(self.inner(x))

    class StaticOuter(Outer):
        forward = static_graph.static_graph(Outer.forward)

    a, b = Outer(), StaticOuter()
    b.copyparams(a)
    with chainer.using_config('use_static_graph', False):
        pass
    for i in range(3):
        x = data(3, 4)
        for m in (a, b):
            m.cleargrads()
            F.sum(m(x)).backward()
        compare_chains(a, b)
    assert caches_of(b)['forward'].replays == 2
    assert 'forward' not in caches_of(b.inner)   # inlined, never cached


def test_use_static_graph_flag_off_is_define_by_run():
    m = OneLinear()
    with chainer.using_config('use_static_graph', False):
        for _ in range(3):
            y = m(data(3, 4))
            assert y.creator is not None
            assert type(y.creator).__name__ == 'LinearFunction'
    assert not caches_of(m)


def test_unsupported_argument_type_falls_back_with_its_name():
    class Net(Base):
        @static_graph.static_graph
        def forward(self, x, options):
            return self.l1(x) * options.scale

    class Options(object):
        scale = 2.0

    m = Net()
    with pytest.warns(StaticGraphWarning, match="options has type Options"):
        m(data(3, 4), Options())
    y = m(data(3, 4), Options())   # still works, warns once only
    assert y.shape == (3, 4)


def test_fallback_logs_to_static_graph_logger(caplog):
    def body(self, x):
        return self.l1(x) if float(x.sum()) > 0 else self.l2(x)
    with caplog.at_level(logging.WARNING, logger='static_graph'):
        run_twins(body, branchy_inputs())
    assert any('falls back' in r.getMessage() for r in caplog.records)


def test_library_prints_nothing(capsys):
    def body(self, x):
        return self.l1(x) if float(x.sum()) > 0 else self.l2(x)
    run_twins(body, branchy_inputs())

    def good(self, x):
        return F.relu(self.l1(x))
    run_twins(good, [data(3, 4) for _ in range(3)])
    out, err = capsys.readouterr()
    assert out == ''


def test_exception_while_recording_leaves_no_entry():
    class Net(Base):
        @static_graph.static_graph
        def forward(self, x, fail=False):
            h = self.l1(x)
            if fail:
                raise ValueError('boom')
            return h

    m = Net()
    with pytest.raises(ValueError):
        m(data(3, 4), fail=True)
    cache = caches_of(m)['forward']
    assert not cache.entries
    F.sum(m(data(3, 4))).backward()
    F.sum(m(data(3, 4))).backward()
    assert cache.recordings == 1 and cache.replays == 1


# -- recurrent state kept on links ----------------------------------------------
class _Recurrent(chainer.Chain):
    """A chain whose link keeps a Variable of the previous call's graph
    (recurrent state): L.LSTM, or hand-written state."""

    def __init__(self, kind):
        super(_Recurrent, self).__init__()
        self.kind = kind
        with self.init_scope():
            if kind == 'lstm':
                self.rnn = L.LSTM(4, 3)
            else:
                self.rnn = L.Linear(4, 3)
                self.lateral = L.Linear(3, 3)
            self.out = L.Linear(3, 2)
        self.rnn.state = None

    def reset(self):
        if self.kind == 'lstm':
            self.rnn.reset_state()
        else:
            self.rnn.state = None

    def forward(self, x, t):
        if self.kind == 'lstm':
            h = self.rnn(x)
        else:
            h = self.rnn(x)
            if self.rnn.state is not None:
                h = h + self.lateral(self.rnn.state)
            h = F.tanh(h)
            self.rnn.state = h
        return F.softmax_cross_entropy(self.out(h), t)


@pytest.mark.parametrize('kind', ['lstm', 'hand_written'])
def test_recurrent_state_on_links_trains_like_define_by_run(kind):
    """Truncated backpropagation through time, as Chainer's PTB example
    does it (a loss summed over a few calls, one backward, then
    unchain_backward): the method reads the state its previous call left
    on a link. The state is an input of the call (the recording and its
    replays) and part of its key (none after reset); the new state is a
    hidden output the next call reads; the last call of a chunk gets no
    gradient for it (masked.py). Replays, bit for bit like define-by-run,
    without a warning."""
    Static = type('Static', (_Recurrent,), {
        'forward': static_graph.static_graph(_Recurrent.forward)})
    numpy.random.seed(0)
    a = _Recurrent(kind)
    b = Static(kind)
    b.copyparams(a)
    opts = twin_optimizers((a, b), lambda: chainer.optimizers.SGD(lr=0.1))
    rs = numpy.random.RandomState(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        for seq in range(2):
            for m in (a, b):
                m.reset()
            steps = [(rs.randn(5, 4).astype(numpy.float32),
                      rs.randint(0, 2, 5).astype(numpy.int32))
                     for _ in range(6)]
            for chunk in (steps[:3], steps[3:]):
                losses = []
                for m, o in zip((a, b), opts):
                    loss = 0
                    for x, t in chunk:
                        loss += m(x, t)
                    m.cleargrads()
                    loss.backward()
                    loss.unchain_backward()
                    o.update()
                    losses.append(loss.array)
                numpy.testing.assert_array_equal(*losses)
                for (_, p), (_, q) in zip(sorted(a.namedparams()),
                                          sorted(b.namedparams())):
                    numpy.testing.assert_array_equal(p.array, q.array)
    ours = [w for w in caught if issubclass(w.category, StaticGraphWarning)]
    assert not ours, [str(w.message) for w in ours]
    cache = caches_of(b)['forward']
    # First chunk: every call records (the first one's key knows of no
    # state yet; the third one's recording still waits for its backward);
    # then the keys with state (None after reset, or Variables) replay.
    assert (cache.recordings, cache.replays, cache.fallback_calls) == \
        (4, 8, 0)
    assert "runs define-by-run" not in static_graph.explain(b)


def test_recurrent_state_survives_a_method_that_raises():
    """A recording swaps a link's graph Variables for detached leaves; a
    method that raises before it touches them leaves the caller's
    Variables on the link."""
    class Net(chainer.Chain):
        def __init__(self):
            super(Net, self).__init__()
            with self.init_scope():
                self.rnn = L.LSTM(4, 3)

        @static_graph.static_graph
        def forward(self, x, fail=False):
            if fail:
                raise ValueError('boom')
            return F.sum(self.rnn(x))

    m = Net()
    m(numpy.ones((2, 4), numpy.float32))
    h, c = m.rnn.h, m.rnn.c
    assert h.creator is not None
    with pytest.raises(ValueError):
        m(numpy.ones((2, 4), numpy.float32), fail=True)
    assert m.rnn.c is c and m.rnn.h is h


def test_debug_mode_runs_define_by_run():
    """Chainer's debug mode checks every function's results for NaN and
    names the function that made one. A replayed call could check only its
    own outputs, so under debug mode the call runs define-by-run (warned
    once) and replays again once debug mode is off."""
    class Net(Base):
        @static_graph.static_graph
        def forward(self, x):
            return self.l1(x) * F.sqrt(x)
    m = Net()
    m.cleargrads()   # not the NaN-filled gradients a new Parameter holds
    good = numpy.abs(data(3, 4)) + 0.5
    with chainer.using_config('debug', True):
        with pytest.warns(StaticGraphWarning, match="debug mode"):
            F.sum(m(good)).backward()
        with warnings.catch_warnings():
            warnings.simplefilter('error', StaticGraphWarning)
            y = m(good)   # warned once only
        assert type(y.creator).__name__ == 'Mul'   # not a ReplayNode
        F.sum(y).backward()
        with pytest.raises(RuntimeError, match='forward computation of sqrt'):
            m(-good)
    assert not caches_of(m)
    for _ in range(3):
        y = m(good)
        F.sum(y).backward()
    assert caches_of(m)['forward'].replays == 2
    assert type(y.creator).__name__ == 'ReplayNode'


def test_export_under_debug_mode_says_why():
    """Exporting needs a recording, which debug mode does not make: the
    error names debug mode, not 'nothing was recorded'."""
    from static_graph import export

    m = OneLinear()
    with chainer.using_config('debug', True):
        with warnings.catch_warnings():
            warnings.simplefilter('ignore', StaticGraphWarning)
            with pytest.raises(ValueError, match='debug mode is on'):
                export.inference_schedule(m, (data(2, 4),))
    assert export.inference_schedule(m, (data(2, 4),)).state == 'complete'


class _Seq(chainer.Chain):
    """An embedding, a recurrent link (or a hand-written Elman step) and
    an output layer: a language model's step."""

    def __init__(self, kind):
        super(_Seq, self).__init__()
        self.kind = kind
        with self.init_scope():
            self.embed = L.EmbedID(20, 8)
            if kind == 'gru':
                self.rnn = L.StatefulGRU(8, 8)
            elif kind == 'mgu':
                self.rnn = L.StatefulMGU(8, 8)
            elif kind == 'lstm':
                self.rnn = L.LSTM(8, 8)
            else:
                self.rnn = L.Linear(8, 8)
                self.lat = L.Linear(8, 8)
            self.out = L.Linear(8, 20)
        self.h = None

    def reset(self):
        if self.kind == 'elman':
            self.h = None
        else:
            self.rnn.reset_state()

    def forward(self, x, t):
        e = self.embed(x)
        if self.kind == 'elman':
            h = self.rnn(e)
            if self.h is not None:
                h = h + self.lat(self.h)
            h = self.h = F.tanh(h)
        else:
            h = self.rnn(e)
        return F.softmax_cross_entropy(self.out(F.dropout(h, 0.2)), t)


def _train_sequences(kind, last_batch=5, epochs=3):
    Static = type('Static', (_Seq,), {
        'forward': static_graph.static_graph(_Seq.forward)})
    numpy.random.seed(0)
    a, b = _Seq(kind), Static(kind)
    b.copyparams(a)
    opts = twin_optimizers((a, b), lambda: chainer.optimizers.SGD(lr=0.5))
    rs = numpy.random.RandomState(1)
    equal = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        for epoch in range(epochs):
            for m in (a, b):
                m.reset()
            for it in range(4):
                n = 5 if it < 3 else last_batch
                xs = [rs.randint(0, 20, n).astype('i') for _ in range(5)]
                for m, o in zip((a, b), opts):
                    numpy.random.seed(epoch * 10 + it)
                    loss = 0
                    for i in range(4):
                        loss += m(xs[i], xs[i + 1])
                    m.cleargrads()
                    loss.backward()
                    loss.unchain_backward()
                    o.update()
                equal.append(all(
                    numpy.array_equal(p.array, q.array) for (_, p), (_, q)
                    in zip(sorted(a.namedparams()), sorted(b.namedparams()))))
    ours = [str(w.message) for w in caught
            if issubclass(w.category, StaticGraphWarning)]
    return equal, caches_of(b)['forward'], ours


def test_recurrent_elman_replays_bit_for_bit():
    equal, cache, ours = _train_sequences('elman')
    assert all(equal) and not ours
    assert cache.replays > 3 * cache.recordings


def test_recurrent_step_with_tied_gradient_sums_runs_define_by_run():
    """L.StatefulGRU's embedding feeds three linear layers of one rank:
    define-by-run sums their gradient contributions in an order decided by
    the whole graph of calls, which a replayed call cannot know. The
    method runs define-by-run once a recording sees that (the first
    sequence's recorded calls can differ in the last bits, as before)."""
    equal, cache, ours = _train_sequences('gru')
    assert cache.define_by_run is not None and \
        'of one rank' in cache.define_by_run
    assert cache.replays == 0
    assert any('of one rank' in m for m in ours)


def test_state_used_by_several_nodes_of_the_next_call_runs_define_by_run():
    """L.StatefulMGU's h feeds three nodes of the next call, and the output
    layer of its own: define-by-run adds the next call's contributions to
    h's gradient one by one in its rank order, around this call's own,
    where a replay added their sum (3e-8 off, every replayed window). The
    method runs define-by-run once a recording sees that; from then on
    the numbers are define-by-run's."""
    equal, cache, ours = _train_sequences('mgu')
    assert cache.define_by_run is not None and \
        "state output's (used inside the call too)" in cache.define_by_run
    assert cache.replays == 0
    assert all(equal[1:]), equal


def test_lstm_with_a_smaller_last_batch_stays_define_by_runs_numbers():
    """The last, smaller batch (L.LSTM splits its state) sums
    contributions of one rank: the method goes define-by-run then, and
    the numbers stay define-by-run's throughout."""
    equal, cache, ours = _train_sequences('lstm', last_batch=3)
    assert all(equal), equal
    assert cache.replays > 0 and cache.define_by_run is not None


class _Frozen(chainer.Chain):
    def __init__(self):
        super(_Frozen, self).__init__()
        with self.init_scope():
            self.l1 = L.Linear(5, 7)
            self.l2 = L.Linear(7, 3)

    def forward(self, x):
        h = F.tanh(self.l1(x))            # the caller's mode: no graph
        with chainer.force_backprop_mode():
            return F.sum(self.l2(h) ** 2)


def test_force_backprop_mode_inside_a_call_under_no_backprop_mode():
    """A frozen extractor and a trainable head built under
    ``force_backprop_mode()``, the method called under
    ``no_backprop_mode()``: the recording's backward raised a TypeError
    and replays returned a loss without a creator (no gradient at all,
    silently). Now define-by-run, the reason given."""
    S = type('S', (_Frozen,), {
        'forward': static_graph.static_graph(_Frozen.forward)})
    numpy.random.seed(0)
    a = _Frozen()
    b = S()
    b.copyparams(a)
    rs = numpy.random.RandomState(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        for i in range(4):
            x = rs.randn(6, 5).astype(numpy.float32)
            for m in (a, b):
                m.cleargrads()
                with chainer.no_backprop_mode():
                    loss = m(x)
                loss.backward()
            assert a.l1.W.grad is None and b.l1.W.grad is None
            assert numpy.array_equal(a.l2.W.grad, b.l2.W.grad)
    assert any('force_backprop_mode' in str(w.message) for w in caught)


class _DebugInside(Base):
    def forward(self, x):
        h = self.l1(x)
        with chainer.using_config('debug', True):
            h = F.sqrt(h)                  # NaN for negative inputs
        return F.sum(self.l2(F.relu(h)))


def test_debug_mode_turned_on_inside_the_method():
    """``using_config('debug', True)`` around part of the method: Chainer
    raises on the NaN a later batch makes; the replay ran on, returning
    NaN. Now the key runs define-by-run, which raises as Chainer does."""
    S = type('S', (_DebugInside,), {
        'forward': static_graph.static_graph(_DebugInside.forward)})
    b = S()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        for i in range(3):
            b(numpy.full((2, 4), 1.0, numpy.float32))
        with pytest.raises(RuntimeError, match='NaN is detected'):
            b(numpy.full((2, 4), -1.0, numpy.float32))
    assert any("debug mode is on for Sqrt" in str(w.message)
               for w in caught)
    assert caches_of(b) and list(caches_of(b).values())[0].replays == 0


def test_debug_mode_around_a_replayed_backward_warns():
    """Debug mode turned on around the backward of a replayed call: its
    per-function checks cannot run inside the call's one node; said once."""
    b = OneLinear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        for i in range(3):
            b.cleargrads()
            loss = F.sum(b(data(2, 4)))
            with chainer.using_config('debug', i == 2):
                loss.backward()
    assert [w for w in caught if 'debug mode is on in the backward'
            in str(w.message)]


def test_many_calls_waiting_for_their_backward_warn_once(monkeypatch):
    """``kept.append(model(x))`` under backprop, never backpropagated:
    each call of the key records while the first waits for its backward
    (as a loss summed over calls must), 4x define-by-run's time, silently.
    Now one warning says so and names no_backprop_mode."""
    from static_graph import cache as cache_module
    monkeypatch.setattr(cache_module, 'WAITING_WARN', 5)
    b = OneLinear()
    kept = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        for i in range(12):
            kept.append(b(data(2, 4)))
    said = [w for w in caught if 'waits for its backward' in str(w.message)]
    assert len(said) == 1 and 'no_backprop_mode' in str(said[0].message)
    assert list(caches_of(b).values())[0].recordings == 12


def test_calls_that_raise_are_no_keys_that_did_not_repeat():
    """A call whose recording raises (Chainer's TypeError for a list of
    repeats, a wrong input dtype) counted as a new key recorded and never
    replayed: after four, the method went on probation ("its keys do not
    repeat") and later good keys ran define-by-run three times before
    recording."""
    class Repeats(Base):
        @static_graph.static_graph
        def forward(self, x, bad):
            h = self.l1(x)
            return F.sum(F.repeat(h, [1, 2] if bad else 2, axis=1))

    m = Repeats()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        for i in range(6):
            with pytest.raises(TypeError):
                m(data(2, 4), True)
        for i in range(3):
            m(data(3 + i, 4), False)
    assert not [w for w in caught if 'do not repeat' in str(w.message)]
    c = list(caches_of(m).values())[0]
    assert c.recordings == 3 and c.fallback_calls == 0


def test_a_gans_sampling_calls_are_not_new_keys_again():
    """A GAN's loop: the generator's output for the discriminator's step
    cut (``unchain_backward``), the generator's step, and a sample under
    ``train=False`` with backprop on at every step, which gets no
    backward. The sampling key records, is let go, records again and
    then from a stand-in gradient: each counted as a new key, which put
    the method on probation at its third step ("its keys do not repeat",
    two define-by-run calls; gans31 hunt)."""
    class Gen(Base):
        @static_graph.static_graph
        def forward(self, z):
            return F.tanh(self.l2(F.relu(self.l1(z))))

    g = Gen()
    opt = chainer.optimizers.Adam(2e-4, beta1=0.5).setup(g)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        for i in range(8):
            fake = g(data(6, 4))
            fake.unchain_backward()
            loss = F.mean(g(data(6, 4)) ** 2)
            g.cleargrads()
            loss.backward()
            opt.update()
            with chainer.using_config('train', False):
                g(data(3, 4))
    assert not [w for w in caught if 'do not repeat' in str(w.message)]
    c = list(caches_of(g).values())[0]
    assert c.fallback_calls == 0 and c.replays >= 8 * 3 - 6


@pytest.mark.parametrize('what', ['cleargrad', 'set'])
def test_an_arguments_gradient_changed_before_a_backward_inside(what):
    """The method clears or sets the gradient of a Variable argument (that
    held one), then runs a backward inside, with another argument from the
    caller's graph: the recording call moves onto the caller's Variables
    for that backward, and takes what the method did to the gradient with
    it (the caller's x.grad was 100 too much, silently)."""
    def body(self, x, h):
        if what == 'cleargrad':
            x.cleargrad()
        else:
            x.grad = numpy.zeros_like(x.array)
        F.sum(self.l3(x) * h).backward()
        return F.sum(self.l3(x) + h)

    a, b = _state_arg_twins(what, body)
    seen = []
    for m in (a, b):
        for i in range(2):
            rs = numpy.random.RandomState(i)
            x = chainer.Variable(rs.randn(4, 6).astype('f'))
            x.grad = numpy.full((4, 6), 100, 'f')
            h = F.tanh(m.l1(rs.randn(4, 5).astype('f')))
            m.cleargrads()
            y = m(x, h)
            seen.append(x.grad.copy())
            y.backward()
            seen.extend([x.grad, m.l1.W.grad, m.l3.W.grad])
    half = len(seen) // 2
    for p, q in zip(seen[:half], seen[half:]):
        assert numpy.array_equal(p, q)


class _StateOnLink(chainer.Chain):
    def __init__(self):
        super(_StateOnLink, self).__init__()
        with self.init_scope():
            self.u = L.Linear(4, 4)
            self.l = L.Linear(4, 4)
        self.h = None

    def forward(self, x):
        k = self.l(x) + self.h
        self.h = k
        return F.sum(k * 10 if self.h.rank > 5 else k)


def test_the_rank_of_another_decorated_calls_output():
    """A Variable another decorated chain returned, reached other than
    as an argument (a dict the loop keeps), its rank read inside the
    recording: a replayed call's output has define-by-run's rank, which
    the walk through the recorded nodes must not recompute (it answered
    2 for 4, and the recording call took the other way, silently)."""
    class Enc(chainer.Chain):
        def __init__(self):
            super(Enc, self).__init__()
            with self.init_scope():
                self.l = L.Linear(4, 4)

        def forward(self, x):
            return F.tanh(F.tanh(self.l(x)))

    store = {}

    class Dec(chainer.Chain):
        def __init__(self):
            super(Dec, self).__init__()
            with self.init_scope():
                self.l = L.Linear(4, 4)

        def forward(self, x):
            z = store['z'] * 1
            y = self.l(x) + z
            return F.sum(y * 10 if z.rank > 3 else y)

    seen = []
    for static in (False, True):
        deco = static_graph.static_graph if static else (lambda f: f)
        E = type('E', (Enc,), {'forward': deco(Enc.forward)})
        D = type('D', (Dec,), {'forward': deco(Dec.forward)})
        numpy.random.seed(0)
        enc, dec = E(), D()
        out = []
        for i in range(4):
            rs = numpy.random.RandomState(i)
            store['z'] = enc(rs.randn(2, 4).astype('f'))
            loss = dec(rs.randn(2, 4).astype('f'))
            enc.cleargrads()
            dec.cleargrads()
            loss.backward()
            out.append((loss.array, enc.l.W.grad.copy()))
        seen.append(out)
    for a, b in zip(*seen):
        for p, q in zip(a, b):
            assert numpy.array_equal(p, q)


def test_the_rank_of_state_a_link_holds_from_earlier_calls():
    """``self.h.rank`` of the state an earlier call left (deep in the
    caller's graph): the recording swaps in a detached leaf for it, and
    the method got its rank (0), not define-by-run's, so the other way
    (loss -2.11 for -21.12); before that, reading the rank of a leaf that
    is no argument raised AttributeError."""
    S = type('S', (_StateOnLink,), {
        'forward': static_graph.static_graph(_StateOnLink.forward)})
    seen = []
    for cls in (_StateOnLink, S):
        numpy.random.seed(0)
        m = cls()
        m.h = F.tanh(F.tanh(F.tanh(m.u(numpy.ones((2, 4), 'f')))))
        out = []
        for i in range(3):
            x = numpy.random.RandomState(i).randn(2, 4).astype('f')
            m.cleargrads()
            y = m(x)
            y.backward()
            out.append((y.array, m.u.W.grad.copy(), m.l.W.grad.copy()))
        seen.append(out)
    for a, b in zip(*seen):
        for p, q in zip(a, b):
            assert numpy.array_equal(p, q)


class _StateArg(chainer.Chain):
    def __init__(self, use):
        super(_StateArg, self).__init__()
        self.use = use
        with self.init_scope():
            self.l1 = L.Linear(5, 6)
            self.l3 = L.Linear(6, 6)
            self.l2 = L.Linear(6, 3)

    def forward(self, x, h):
        if self.use == 'creator' and h.creator is None:
            h = h + 1.0
        elif self.use == 'node.creator' and h.node.creator_node is None:
            h = h + 1.0
        elif self.use == 'rank':
            h = h * float(h.rank + 1)
        elif self.use == 'derived rank':
            h = h * float((h * 2).rank + 1)
        elif self.use == 'own rank':
            h = h * float(self.l3(h).rank + self.l3.W.rank + 1)
        elif self.use == 'unchain_backward':
            h.unchain_backward()
        elif self.use == 'inner backward':
            F.sum(self.l3(h) ** 2).backward()
        elif self.use == 'inner grad retained':
            chainer.grad([F.sum(self.l3(h) ** 2)], [h], retain_grad=True)
        h = F.tanh(self.l1(x) + self.l3(h))
        if self.use == 'inner cut':
            h.unchain_backward()         # (walks back into the argument)
            h = F.tanh(self.l1(x) + self.l3(h))
        return F.sum(self.l2(h) ** 2), h


def _state_arg_twins(use, forward=_StateArg.forward):
    """(define-by-run, decorated) _StateArg twins with ``forward``, of the
    same parameters."""
    A = type('A', (_StateArg,), {'forward': forward})
    S = type('S', (_StateArg,), {
        'forward': static_graph.static_graph(forward)})
    numpy.random.seed(0)
    a = A(use)
    b = S(use)
    b.copyparams(a)
    return a, b


@pytest.mark.parametrize('first', ['a leaf', "the caller's"])
@pytest.mark.parametrize('use', ['creator', 'node.creator', 'rank',
                                 'derived rank', 'own rank',
                                 'unchain_backward',
                                 'inner cut', 'inner backward',
                                 'inner grad retained'])
def test_the_graph_of_an_argument_used_inside_the_method(use, first):
    """The state of an RNN handed in as an argument (``forward(x, h)``),
    its graph used by the method: ``if h.creator is None``, ``h.rank``,
    ``h.unchain_backward()``, a cut inside the call that walks back into
    it, a backward inside that goes on into it, the rank of a Variable
    made from it (which replayed the recording's way at every call: loss
    -1.63 for -16.29, silently). The recording runs on a
    copy of the argument, which has no graph: it took the other branch
    (loss 1.33 for 1.23), or cut nothing where define-by-run cuts the
    earlier calls (0.43 off in l1.W.grad), silently; each is a reason.
    Where the first call's state already has a graph (the caller's, made
    from ``v0``), the recording call itself is define-by-run's too: it
    answers with the caller's graph, cuts it, backpropagates into it
    (before 2026-11-28 it took the other branch: loss -6.04 for -12.07;
    or left v0 without its gradient)."""
    a, b = _state_arg_twins(use)
    seen = []
    for m in (a, b):
        v0 = chainer.Variable(numpy.full((4, 6), 0.5, 'f'))
        h = v0 if first == 'a leaf' else v0 * 2.0
        h0, loss, losses = h, 0, []
        for s in range(3):
            x = numpy.random.RandomState(s).randn(4, 5).astype('f')
            l, h = m(x, h)
            loss += l
            losses.append(l.array)
        m.cleargrads()
        loss.backward()
        seen.append([losses, v0.grad, h0.grad, h0.creator is None])
    for x, y in zip(*seen):
        if x is None or y is None or type(x) is bool:
            assert x is y
        else:
            assert numpy.array_equal(x, y)
    for p, q in zip(a.params(), b.params()):
        assert numpy.array_equal(p.grad, q.grad)
    assert 'fallback' in static_graph.explain(b)


def test_a_link_hook_reading_values_is_named_in_the_reason():
    """A discriminator whose links carry SpectralNormalization: the hook's
    power iteration calls numpy.linalg.norm on the weights, so the key
    falls back. The reason named the user's line alone ("user code reads
    array values (numpy.norm()) at <the forward's line>"; gans31 hunt);
    it names the hook's line in Chainer, reached from the user's."""
    from chainer.link_hooks import SpectralNormalization

    class D(chainer.Chain):
        def __init__(self):
            super(D, self).__init__()
            with self.init_scope():
                self.l1 = L.Linear(8, 4).add_hook(SpectralNormalization())

        @static_graph.static_graph
        def forward(self, x):
            return F.sum(self.l1(x))

    d = D()
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', StaticGraphWarning)
        for _ in range(2):
            d(numpy.ones((2, 8), 'f')).backward()
    text = static_graph.explain(d)
    assert "Chainer's code reads array values (numpy.norm() at " \
        'chainer/link_hooks/spectral_normalization.py:' in text, text
    assert 'reached from %s:' % __file__ in text, text
