"""What a hunt of the library's life cycle and API edges found: a branch on
whether a parameter has a gradient, one warning per shape where one per
method was meant, explain()'s config flags, ``python -m static_graph
--help``."""
import subprocess
import sys
import warnings

import numpy
import pytest

import chainer
import chainer.functions as F
import chainer.links as L

import static_graph
from static_graph import StaticGraphWarning


class Accumulates(chainer.Chain):
    def __init__(self, read):
        super(Accumulates, self).__init__()
        self.read = read
        with self.init_scope():
            self.l = L.Linear(3, 2, initialW=numpy.eye(2, 3, dtype='f'))

    def forward(self, x):
        y = self.l(x)
        W = self.l.W
        g = {'grad': lambda: W.grad, 'grad_var': lambda: W.grad_var,
             'node.grad': lambda: W.node.grad,
             'node.grad_var': lambda: W.node.grad_var}[self.read]()
        if g is None:                  # the first call of an accumulation
            return F.sum(y)
        return F.sum(y) * 2


@pytest.mark.parametrize('first', ['cleared', 'zeroed'])
@pytest.mark.parametrize('read', ['grad', 'grad_var', 'node.grad',
                                  'node.grad_var'])
def test_a_branch_on_whether_a_parameter_has_a_gradient(read, first):
    """Replayed the recording call's branch (8 for 16 at every second
    call), with no warning; also where the recording call saw a gradient
    (zeroed, or a fresh Parameter's NaN-filled one), and through
    ``W.node``."""
    a = Accumulates(read)
    b = type('S', (Accumulates,), {
        'forward': static_graph.static_graph(Accumulates.forward)})(read)
    x = numpy.ones((4, 3), 'f')
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        for i in range(4):
            losses = []
            for m in (a, b):
                if i == 0 and first == 'zeroed':
                    m.zerograds()
                elif i % 2 == 0:
                    m.cleargrads()
                loss = m(x)
                loss.backward()
                losses.append(float(loss.array))
            assert losses[0] == losses[1], i
    said = [str(x.message) for x in w
            if issubclass(x.category, StaticGraphWarning)]
    assert len(said) == 1 and 'it reads a gradient (.grad' in said[0], said


class TwoOutputs(chainer.Chain):
    def __init__(self):
        super(TwoOutputs, self).__init__()
        with self.init_scope():
            self.l = L.Linear(8, 4)

    @static_graph.static_graph
    def forward(self, x):
        y = self.l(x)
        return y, F.relu(y)


def test_evaluation_over_many_shapes_warns_once_why_it_runs_define_by_run():
    """Evaluation with backprop enabled of a method with two outputs over
    50 batch sizes: 50 identical warnings, one per shape. One now: its
    keys do not repeat (within the cache's 16), and the calls recorded on
    probation are let go (splice.let_go_waiting); before that, that
    their calls get no backward."""
    m = TwoOutputs()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        kept = []     # (the last output kept while it calls again)
        for rep in range(3):
            for i in range(200):
                kept[:] = [m(numpy.ones((1 + i % 50, 8), 'f'))]
    said = [str(x.message) for x in w if 'get no backward' in
            str(x.message) or 'do not repeat' in str(x.message)]
    assert len(said) == 1, said


def test_explain_shows_config_flags_as_values():
    m = TwoOutputs()
    with chainer.no_backprop_mode():
        m(numpy.ones((2, 8), 'f'))
    text = static_graph.explain(m)
    assert 'train=True enable_backprop=False' in text, text


def test_explain_tells_apart_keys_that_differ_in_dtype_or_byte_order():
    """Keys recorded under config dtypes float32 and float16, and for
    arguments of either byte order, printed alike."""
    class Twice(chainer.Chain):
        @static_graph.static_graph
        def forward(self, x):
            return x * 2

    m = Twice()
    x = numpy.ones((2, 8), 'f')
    with chainer.no_backprop_mode():
        for dt in (numpy.float32, numpy.float16):
            with chainer.using_config('dtype', dt):
                m(x)
        m(x.astype('>f4'))
    lines = [line for line in static_graph.explain(m).splitlines()
             if line.startswith('  (')]
    assert len(lines) == len(set(lines)) == 3, lines
    assert any('dtype=float16' in line for line in lines), lines
    assert any('f32[2,8] big-endian' in line for line in lines), lines


def test_the_command_line_help():
    run = subprocess.run([sys.executable, '-m', 'static_graph', '--help'],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         universal_newlines=True)
    assert run.returncode == 0 and 'chainer-import' in run.stdout
    run = subprocess.run([sys.executable, '-m', 'static_graph', 'nonsense'],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         universal_newlines=True)
    assert run.returncode == 2 and 'usage' in run.stderr


class Elman(chainer.Chain):
    def __init__(self):
        super(Elman, self).__init__()
        self.h = None
        with self.init_scope():
            self.x2h = L.Linear(3, 4)
            self.h2h = L.Linear(4, 4, nobias=True)
            self.out = L.Linear(4, 2)

    def forward(self, x):
        h = self.x2h(x)
        if self.h is not None:
            h = h + self.h2h(self.h)
        self.h = F.tanh(h)
        return F.sum(self.out(self.h) ** 2)


def _window(m, xs, cut=None):
    loss = 0
    for i, x in enumerate(xs):
        loss += m(x)
        if cut is not None and i == 1:
            getattr(m.h, cut)()
    loss.backward()
    loss.unchain_backward()


@pytest.mark.parametrize('cut', ['unchain', 'unchain_backward'])
def test_cutting_the_state_inside_a_window_is_an_error(cut):
    """``self.h.unchain()`` (or ``unchain_backward()``) between the calls
    of a window, before its backward: define-by-run stops the gradient at
    h; a replayed call (one node) went on through it into the parameters
    (0.2 off), silently. Now an error; windows cut after their backward
    stay exact."""
    a = Elman()
    b = type('S', (Elman,), {
        'forward': static_graph.static_graph(Elman.forward)})()
    b.copyparams(a)
    rs = numpy.random.RandomState(0)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        for window in range(3):
            xs = [rs.randn(5, 3).astype('f') for _ in range(3)]
            for m in (a, b):
                m.cleargrads()
                _window(m, xs)
            assert numpy.array_equal(a.x2h.W.grad, b.x2h.W.grad), window
        xs = [rs.randn(5, 3).astype('f') for _ in range(3)]
        _window(a, xs, cut)
        with pytest.raises(RuntimeError, match='cut from the graph'):
            _window(b, xs, cut)


class FunctionalRNN(chainer.Chain):
    def __init__(self):
        super(FunctionalRNN, self).__init__()
        with self.init_scope():
            self.x2h = L.Linear(4, 5)
            self.h2h = L.Linear(5, 5, nobias=True)
            self.out = L.Linear(5, 3)

    def forward(self, x, h):
        z = self.x2h(x)
        if h is not None:
            z = z + self.h2h(h)
        h = F.tanh(z)
        return h, self.out(h)


class SameArrayRNN(FunctionalRNN):
    """Its second output is the state's own array (F.identity, or a copy
    to the device it is on): no op of the call reads h."""

    def __init__(self, second):
        super(SameArrayRNN, self).__init__()
        self.second = second

    def forward(self, x, h):
        h, _ = FunctionalRNN.forward(self, x, h)
        return h, (F.identity(h) if self.second == 'identity'
                   else F.copy(h, -1))


@pytest.mark.parametrize('second', ['identity', 'copy'])
def test_cutting_an_output_another_output_is(second):
    """``h.unchain()`` inside a window where the other output is h's
    array: define-by-run stops the gradient at h; replay went on (2.4-3.4
    off in x2h.W.grad), silently. Now the error of a cut before the
    backward."""
    a = SameArrayRNN(second)
    b = type('S', (SameArrayRNN,), {
        'forward': static_graph.static_graph(SameArrayRNN.forward)})(second)
    b.copyparams(a)
    rs = numpy.random.RandomState(0)
    for window in range(4):
        xs = rs.randn(3, 5, 4).astype('f')
        for m in (a, b):
            h, loss = None, 0
            for t, x in enumerate(xs):
                h, y = m(x, h)
                loss += F.sum(y * y)
                if window == 3 and t == 1:
                    h.unchain()
            m.cleargrads()
            if m is b and window == 3:
                with pytest.raises(RuntimeError, match='cut from the graph'):
                    loss.backward()
            else:
                loss.backward()
            loss.unchain_backward()
        if window < 3:
            assert numpy.array_equal(a.x2h.W.grad, b.x2h.W.grad), window


def test_truncated_bptt_cutting_the_state_after_the_backward():
    """``loss.backward(); h.unchain_backward()`` every third call, the
    state passed in and returned: the check for a cut before the backward
    raised here (the recording call's node never counted as done)."""
    a = FunctionalRNN()
    b = type('S', (FunctionalRNN,), {
        'forward': static_graph.static_graph(FunctionalRNN.forward)})()
    b.copyparams(a)
    rs = numpy.random.RandomState(0)
    xs = rs.randn(12, 2, 4).astype('f')
    ts = rs.randint(0, 3, (12, 2)).astype('i')
    grads = []
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        for m in (a, b):
            h, loss, gs = None, 0, []
            for i in range(12):
                h, y = m(xs[i], h)
                loss += F.softmax_cross_entropy(y, ts[i])
                if (i + 1) % 3 == 0:
                    m.cleargrads()
                    loss.backward()
                    h.unchain_backward()
                    loss = 0
                    gs.append([p.grad.copy() for p in m.params()])
            grads.append(gs)
    for ga, gb in zip(*grads):
        for u, v in zip(ga, gb):
            assert numpy.array_equal(u, v)


def _two_losses_cut_between(m, xs, second):
    h, ys, loss = None, [], 0
    for x in xs:
        h, y = m(x, h)
        ys.append(y)
        loss += F.sum(y * y)
    m.cleargrads()
    loss.backward()
    h.unchain_backward()
    if second == 'y':       # y = out(h): define-by-run keeps out's nodes
        sum(F.sum(y) for y in ys).backward()
    else:                   # h's own nodes were cut: nothing flows
        F.sum(h).backward()


@pytest.mark.parametrize('second', ['y', 'h'])
def test_a_cut_between_two_backward_passes(second):
    """``loss.backward(); h.unchain_backward()``, then a second loss of
    the outputs computed from h (``y = out(h)``): define-by-run's walk from
    h leaves out's nodes, and the second backward gives out.W a gradient;
    the calls, each cut whole, gave nothing (2.3 off), silently. Now an
    error, at the recording's window too; a second backward that
    define-by-run also stops (from h itself) stays exact."""
    a = FunctionalRNN()
    b = type('S', (FunctionalRNN,), {
        'forward': static_graph.static_graph(FunctionalRNN.forward)})()
    b.copyparams(a)
    rs = numpy.random.RandomState(0)
    for window in range(3):
        xs = rs.randn(3, 2, 4).astype('f')
        _two_losses_cut_between(a, xs, second)
        if second == 'y':
            assert a.out.W.grad is not None
            with pytest.raises(RuntimeError, match='after a cut'):
                _two_losses_cut_between(b, xs, second)
            b.copyparams(a)
        else:
            _two_losses_cut_between(b, xs, second)
            for p, q in zip(a.params(), b.params()):
                assert numpy.array_equal(p.grad, q.grad), window
    assert ' 6 replays' in static_graph.explain(b)


class _StateAfter(chainer.Chain):
    """An RNN whose state is an op after h: ``h * 1.0`` (no parameter),
    or a projection ``h2h(h)`` (a parameter: define-by-run's next window
    gives h2h.W a gradient through the last call's kept node)."""

    def __init__(self, project):
        super(_StateAfter, self).__init__()
        self.project, self.h = project, None
        with self.init_scope():
            self.x2h = L.Linear(4, 5)
            self.h2h = L.Linear(5, 5, nobias=True)
            self.out = L.Linear(5, 3)

    def forward(self, x):
        z = self.x2h(x)
        if self.h is not None:
            z = z + self.h
        h = F.tanh(z)
        self.h = self.h2h(h) if self.project else F.identity(h) * 1.0
        return self.out(h)


@pytest.mark.parametrize('project', [False, True])
def test_state_after_h_with_the_loss_cut_after_its_backward(project):
    """``loss.backward(); loss.unchain_backward()`` (PTB's loop), the
    state kept as an op after h: the walk from the loss leaves that op.
    With no parameter on it the next window's gradient reaches nothing
    define-by-run shows: exact (a first version of the severed outputs
    raised here). With ``h2h(h)`` it reaches h2h.W, which the call, cut
    whole, cannot give: an error, also for the recording call of a key
    that fell back at its build (before: 1.05 for 0.41 by window 6,
    silently)."""
    S = type('S', (_StateAfter,), {
        'forward': static_graph.static_graph(_StateAfter.forward)})
    xs = numpy.random.RandomState(1).randn(4, 3, 2, 4).astype('f')
    losses = []
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        for cls in (_StateAfter, S):
            numpy.random.seed(0)
            m = cls(project)
            opt = chainer.optimizers.SGD(0.1).setup(m)
            losses.append([])
            for w in range(4):
                loss = sum(F.sum(m(xs[w, t]) ** 2) for t in range(3))
                m.cleargrads()
                if cls is S and project and w == 1:
                    with pytest.raises(RuntimeError, match='after a cut'):
                        loss.backward()
                    return
                loss.backward()
                loss.unchain_backward()
                opt.update()
                losses[-1].append(loss.array.copy())
    assert not project
    for a, b in zip(*losses):
        assert numpy.array_equal(a, b)


class _Zoneout(chainer.Chain):
    def __init__(self):
        super(_Zoneout, self).__init__()
        with self.init_scope():
            self.embed = L.EmbedID(12, 6)
            self.rnn = L.StatefulZoneoutLSTM(6, 6, 0.3, 0.4)
            self.out = L.Linear(6, 12)

    def forward(self, x):
        return self.out(self.rnn(self.embed(x)))


def test_zoneout_lstm_in_the_ptb_loop_trains():
    """``L.StatefulZoneoutLSTM`` in PTB's loop (five calls, ``backward()``,
    ``loss.unchain_backward()``, the update): its ``c`` mixes the previous
    ``c`` with this call's and is not what the output was computed from,
    so the cut, entering the call through ``h``, left a creator on it that
    raised when the next window's backward reached it (where Chainer
    trains on: its gradient stops at the Variables the walk cut). The
    key falls back at the first backward (a documented tie: the first
    window's calls last bits off); training goes on."""
    S = type('S', (_Zoneout,), {
        'forward': static_graph.static_graph(_Zoneout.forward)})
    params = []
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        for cls in (_Zoneout, S):
            numpy.random.seed(0)
            net = cls()
            opt = chainer.optimizers.SGD(0.5).setup(net)
            for window in range(3):
                loss = 0
                for i in range(5):
                    r = numpy.random.RandomState(window * 5 + i)
                    loss += F.softmax_cross_entropy(
                        net(r.randint(0, 12, 4).astype('i')),
                        r.randint(0, 12, 4).astype('i'))
                net.cleargrads()
                loss.backward()
                loss.unchain_backward()
                opt.update()
            params.append([p.array for p in net.params()])
    assert 'sums the gradient contributions of Zoneout' in \
        static_graph.explain(net)
    for p, q in zip(*params):
        numpy.testing.assert_allclose(p, q, rtol=0, atol=1e-6)


def test_outputs_a_cut_leaves_classified():
    """``cuts.uncut_outputs``: an output that a cut entering through
    output 0 leaves uncut raises at a later backward where define-by-run
    would carry its gradient on (to a parameter, to an input whose graph
    the walk did not cut), and drops it where it would stop at an input
    the walk cut (an input read by an op the walk reached)."""
    from types import SimpleNamespace as Op
    from static_graph import cuts
    # inputs: 1 (state, read by the reached op: its creator cut), 2 (a
    # parameter), 3 (state read only outside the reached ops); op 0
    # reached, ops 1-3 not
    ops = [Op(inputs=[1, 2], outputs=[10]),     # h = f(c_prev, W)
           Op(inputs=[1, 10], outputs=[11]),    # c = mix(c_prev, h)
           Op(inputs=[2, 10], outputs=[12]),    # m = g(W, h)
           Op(inputs=[3], outputs=[13])]        # n = k(n_prev)
    outputs = [10, 11, 12, 13]
    assert cuts.uncut_outputs(ops, outputs, {0}, {1, 2, 3}, cut={1}) == \
        ([2, 3], [1])
    # n_prev's creator cut too (the walk reached it another way).
    assert cuts.uncut_outputs(ops, outputs, {0}, {1, 2, 3}, cut={1, 3}) \
        == ([2], [1, 3])
    # Without the walk's cuts known, every such output raises (as before).
    assert cuts.uncut_outputs(ops, outputs, {0}, {1, 2, 3}) == \
        ([1, 2, 3], [])


class _TwoStates(chainer.Chain):
    """h goes on through the calls; c too, on a path of its own (l3), and
    ``y`` is computed from c alone."""

    def __init__(self, use):
        super(_TwoStates, self).__init__()
        self.use = use
        with self.init_scope():
            self.l1 = L.Linear(3, 4)
            self.l2 = L.Linear(4, 4, nobias=True)
            self.l3 = L.Linear(4, 4)

    def forward(self, x, h, c):
        h2 = F.tanh(self.l1(x) + self.l2(h))
        c2 = F.tanh(self.l3(c))
        return h2, c2, (c2 * c if self.use == 'c' else c2 * 2.0)


@pytest.mark.parametrize('use', ['c', 'scaled'])
def test_a_cut_from_h_leaves_the_other_state_path(use):
    """``F.sum(h).backward(); h.unchain_backward()``, then a loss of an
    earlier call's ``y``, computed from c alone: define-by-run's walk from
    h never reaches c's functions, and the second backward gives l3 its
    gradient. The walk through the calls, run as one node each, went on
    into every input, c too, so the earlier calls counted c's ops as cut:
    l3 got nothing, silently (a first version of the dropped outputs; and
    with ``y = c2 * 2`` before it). Now the walk goes only where
    define-by-run's would, and such a backward is the error of a cut
    between two backward passes."""
    S = type('S', (_TwoStates,), {
        'forward': static_graph.static_graph(_TwoStates.forward)})
    rs = numpy.random.RandomState(1)
    models = []
    for cls in (_TwoStates, S):
        numpy.random.seed(0)
        models.append(cls(use))
    for window in range(3):
        c0 = rs.randn(2, 4).astype('f')
        xs = rs.randn(3, 2, 3).astype('f')
        for m in models:
            cls = type(m)
            h = chainer.Variable(numpy.zeros((2, 4), 'f'))
            c = chainer.Variable(c0.copy())
            ys = []
            for x in xs:
                h, c, y = m(x, h, c)
                ys.append(y)
            F.sum(h).backward()
            h.unchain_backward()
            m.cleargrads()
            if cls is S:
                with pytest.raises(RuntimeError, match='after a cut'):
                    F.sum(ys[1]).backward()
            else:
                F.sum(ys[1]).backward()
                assert m.l3.W.grad is not None
    assert ' 6 replays' in static_graph.explain(models[1])


def test_a_list_of_variables_is_no_costly_key():
    """The key's cost counted a list of 256 Variables as 256 values, past
    the limit for a small model: it ran define-by-run (2.7x slower than
    its replay). Only numbers, strings and the like count."""
    class Stack(chainer.Chain):
        def __init__(self):
            super(Stack, self).__init__()
            with self.init_scope():
                self.l = L.Linear(8, 4)

        @static_graph.static_graph
        def forward(self, xs):
            return F.sum(self.l(F.stack(xs)))

    m = Stack()
    rs = numpy.random.RandomState(0)
    xs = [chainer.Variable(rs.randn(8).astype('f')) for _ in range(256)]
    for _ in range(4):
        m.cleargrads()
        m(xs).backward()
    assert 'runs define-by-run' not in static_graph.explain(m)
    assert ' 3 replays' in static_graph.explain(m)


def test_a_cut_after_two_backward_passes_is_exact():
    """Two losses backpropagated through the same calls, then the state
    cut (an RNN in a GAN's updater): a key that keeps its activations for
    a second backward raised at that cut, though no backward could come
    any more."""
    a = Elman()
    b = type('S', (Elman,), {
        'forward': static_graph.static_graph(Elman.forward)})()
    b.copyparams(a)
    rs = numpy.random.RandomState(0)
    for window in range(5):
        xs = [rs.randn(5, 3).astype('f') for _ in range(3)]
        for m in (a, b):
            m.cleargrads()
            ys = [m(x) for x in xs]
            l1, l2 = sum(ys), sum(y * 2 for y in ys)
            l1.backward()
            l2.backward()
            l2.unchain_backward()
            l1.unchain_backward()
        for p, q in zip(a.params(), b.params()):
            assert numpy.array_equal(p.grad, q.grad), window


def test_iterating_over_an_integer_variable_replays():
    """``for t_step in t`` over an int Variable ends with GetItem's
    IndexError, which the shape decides: it fell back."""
    class Steps(chainer.Chain):
        def __init__(self):
            super(Steps, self).__init__()
            with self.init_scope():
                self.l = L.Linear(4, 3)

        @static_graph.static_graph
        def forward(self, x, t):
            loss = 0
            for t_step in t:
                loss += F.softmax_cross_entropy(self.l(x), t_step)
            return loss

    m = Steps()
    rs = numpy.random.RandomState(0)
    for _ in range(4):
        m.cleargrads()
        m(rs.randn(3, 4).astype('f'),
          chainer.Variable(rs.randint(0, 3, (5, 3)).astype('i'))).backward()
    assert ' 3 replays' in static_graph.explain(m)


class ThreeOutputs(chainer.Chain):
    def __init__(self):
        super(ThreeOutputs, self).__init__()
        with self.init_scope():
            self.x2h = L.Linear(3, 4)
            self.h2h = L.Linear(4, 4, nobias=True)
            self.out = L.Linear(4, 2)
            self.side = L.Linear(3, 2)

    def forward(self, x, h):
        z = self.x2h(x)
        if h is not None:
            z = z + self.h2h(h)
        h = F.tanh(z)
        return h, F.sum(self.out(F.relu(z)) ** 2), F.sum(self.side(x) ** 2)


def _three_output_window(m, xs, cut=None):
    h, ys = None, []
    for t, x in enumerate(xs):
        h, y, z = m(x, h)
        ys.append(y + z)
        if cut and t == 1:
            getattr(h, cut)()
    (sum(ys) + F.sum(h)).backward()


def test_cuts_that_reach_a_call_before_its_backward_are_errors():
    """A cut of h1 walked back into call 0 and cut its y0 (2.5 off); an
    intermediate two outputs share, not an output itself, hid the cut
    (13 off). Windows cut after their backward stay exact."""
    cut = 'unchain_backward'
    a = ThreeOutputs()
    b = type('S', (ThreeOutputs,), {
        'forward': static_graph.static_graph(ThreeOutputs.forward)})()
    b.copyparams(a)
    rs = numpy.random.RandomState(0)
    for w in range(3):
        xs = [rs.randn(5, 3).astype('f') for _ in range(3)]
        for m in (a, b):
            m.cleargrads()
            _three_output_window(m, xs)
        for p, q in zip(a.params(), b.params()):
            assert numpy.array_equal(p.grad, q.grad), w
    xs = [rs.randn(5, 3).astype('f') for _ in range(3)]
    for m in (a, b):
        m.cleargrads()
    _three_output_window(a, xs, cut)
    with pytest.raises(RuntimeError, match='cut from the graph'):
        _three_output_window(b, xs, cut)


class Counts(chainer.FunctionNode):
    def __init__(self):
        self.st = {}

    def forward(self, inputs):
        x, = inputs
        self.st['k'] = int((x > 0).sum())
        return x * numpy.float32(self.st['k']),

    def backward(self, indexes, gy):
        return gy[0] * float(self.st['k']),


def test_a_users_node_writing_into_its_own_dict_falls_back():
    """Its forward writes into a dict it holds: no attribute changes, so
    its backward read the recording call's count (300 off)."""
    class Net(chainer.Chain):
        def __init__(self):
            super(Net, self).__init__()
            with self.init_scope():
                self.l = L.Linear(6, 5)

        def forward(self, x):
            return F.sum(Counts().apply((self.l(x),))[0] ** 2)

    a = Net()
    b = type('S', (Net,), {
        'forward': static_graph.static_graph(Net.forward)})()
    b.copyparams(a)
    rs = numpy.random.RandomState(0)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        for i in range(5):
            x = rs.randn(7, 6).astype('f') + (0.8 if i % 2 else -0.8)
            for m in (a, b):
                m.cleargrads()
                m(x).backward()
            assert numpy.array_equal(a.l.W.grad, b.l.W.grad), i


def test_one_function_decorated_twice_keeps_each_decorations_options():
    """``forward = static_graph(cache_size=1)(f)`` and ``fwd2 =
    static_graph(cache_size=8)(f)`` on one class shared one cache: the
    second's options were ignored, silently."""
    class Twice(chainer.Chain):
        def __init__(self):
            super(Twice, self).__init__()
            with self.init_scope():
                self.l = L.Linear(3, 2)

        def f(self, x):
            return F.sum(self.l(x))

        forward = static_graph.static_graph(cache_size=1)(f)
        fwd2 = static_graph.static_graph(cache_size=8)(f)

    m = Twice()
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        for n in (2, 3, 2, 3):
            m.cleargrads()
            m(numpy.ones((n, 3), 'f')).backward()
            m.cleargrads()
            m.fwd2(numpy.ones((n, 3), 'f')).backward()
    from static_graph.decorator import caches_of
    sizes = sorted((c.size, c.replays) for c in caches_of(m).values())
    assert sizes == [(1, 0), (8, 2)], sizes


class _Step(chainer.Chain):
    """An RNN step's links: input, state and output projections."""

    def __init__(self):
        super(_Step, self).__init__()
        with self.init_scope():
            self.wx = L.Linear(3, 4)
            self.wh = L.Linear(4, 4, nobias=True)
            self.oy = L.Linear(4, 4)


class _PassesOn(_Step):
    """A step that hands a memory ``m`` back as it is."""

    def forward(self, x, h, m):
        h2 = F.tanh(self.wx(x) + self.wh(h))
        return h2, m, self.oy(h2)


def test_an_argument_returned_as_it_is_keeps_its_graph_after_a_cut():
    """``loss.backward(); loss.unchain_backward()`` over the ys, then a
    loss of the ``m`` the step returned as it is (an encoder's output):
    define-by-run's ``m`` is the encoder's Variable, which the walk never
    reached; the call, cut whole, left its ``m`` without a creator, and
    the encoder got no gradient (0.44 in define-by-run), silently. Now
    such an output's gradient goes on to the argument."""
    S = type('S', (_PassesOn,), {
        'forward': static_graph.static_graph(_PassesOn.forward)})
    grads = []
    for cls in (_PassesOn, S):
        numpy.random.seed(0)
        cell, enc, rd = cls(), L.Linear(3, 4), L.Linear(4, 1)
        rs = numpy.random.RandomState(1)
        m = F.tanh(enc(rs.randn(2, 3).astype('f')))
        h = chainer.Variable(numpy.zeros((2, 4), 'f'))
        grads.append([])
        for window in range(4):
            ys = []
            for t in range(3):
                h, m, y = cell(rs.randn(2, 3).astype('f'), h, m)
                ys.append(y)
            loss = sum(F.sum(y * y) for y in ys)
            loss.backward()
            loss.unchain_backward()
            enc.cleargrads()
            F.sum(rd(m)).backward()
            grads[-1].append(enc.W.grad)
    for a, b in zip(*grads):
        assert a is not None and numpy.array_equal(a, b)
    assert ' 9 replays' in static_graph.explain(cell)


class _ReadsWithoutEdge(_Step):
    """A step that reads its argument ``m`` without a graph edge."""

    def __init__(self, how):
        super(_ReadsWithoutEdge, self).__init__()
        self.how = how

    def forward(self, x, h, m):
        a = self.wx(x) + self.wh(h)
        if self.how == 'no_backprop_mode':
            with chainer.no_backprop_mode():
                s = F.sigmoid(m)
        else:
            s = chainer.Variable(m.array)
        h2 = F.tanh(a * s)
        return h2, self.oy(h2)


@pytest.mark.parametrize('how', ['no_backprop_mode', 'Variable'])
def test_a_cut_does_not_walk_into_an_argument_read_without_an_edge(how):
    """``loss.unchain_backward()`` after the loss of the ys, then an
    auxiliary loss of the argument ``m`` (an encoder's output) that the
    step read only without a graph edge: define-by-run's walk never
    reaches m and the encoder gets its gradient (1.3 to 1.6); the walk
    through the calls followed their schedule, whose ops read m's array,
    cut the encoder's graph, and it got nothing, silently. The walk now
    follows the recording's edges (cuts.reach_of)."""
    S = type('S', (_ReadsWithoutEdge,), {
        'forward': static_graph.static_graph(_ReadsWithoutEdge.forward)})
    grads = []
    for cls in (_ReadsWithoutEdge, S):
        numpy.random.seed(0)
        cell, enc = cls(how), L.Linear(3, 4)
        rs = numpy.random.RandomState(1)
        h = chainer.Variable(numpy.zeros((2, 4), 'f'))
        grads.append([])
        for window in range(4):
            m = F.tanh(enc(rs.randn(2, 3).astype('f')))
            ys = []
            for t in range(3):
                h, y = cell(rs.randn(2, 3).astype('f'), h, m)
                ys.append(y)
            loss = sum(F.sum(y * y) for y in ys)
            loss.backward()
            loss.unchain_backward()
            enc.cleargrads()
            F.sum(m * m).backward()
            grads[-1].append(enc.W.grad)
    for a, b in zip(*grads):
        assert a is not None and numpy.array_equal(a, b)
    assert ' 9 replays' in static_graph.explain(cell)
