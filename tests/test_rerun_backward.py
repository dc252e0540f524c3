"""Backward steps that compute a mask in Python (F.clip, F.maximum, F.max,
F.maxout, mean_absolute_error...) replay by calling the forward node's
backward() again, handed the current arrays: training stays define-by-run's
bit for bit, and such chains replay instead of falling back."""
import types

import numpy
import pytest

import chainer
import chainer.functions as F
import chainer.links as L

from static_graph import static_graph
from static_graph.decorator import caches_of
from tests.twins import twin_optimizers

MASKED = {
    'clip': lambda h, p: F.clip(h, -0.5, 0.5),
    'maximum': lambda h, p: F.maximum(h, F.broadcast_to(p, h.shape)),
    'max': lambda h, p: F.max(h, axis=1, keepdims=True) * h,
    'min': lambda h, p: F.min(h, axis=0),
    'maxout': lambda h, p: F.maxout(h, 2),
    'crelu': lambda h, p: F.crelu(h),
    'mean_absolute_error': lambda h, p: F.mean_absolute_error(
        h, F.broadcast_to(p, h.shape)),
}


def twins(fn):
    class Net(chainer.Chain):
        def __init__(self):
            super(Net, self).__init__()
            with self.init_scope():
                self.l1 = L.Linear(3, 6)
                self.p = chainer.Parameter(
                    numpy.linspace(-0.3, 0.3, 6).astype(numpy.float32))

        def forward(self, x):
            y = fn(self.l1(x), self.p)
            return F.sum(y * y)

    Static = type('Static', (Net,), {'forward': static_graph(Net.forward)})
    numpy.random.seed(0)
    a = Net()
    numpy.random.seed(0)
    b = Static()
    b.copyparams(a)
    return a, b


def entry_of(chain):
    (cache,) = caches_of(chain).values()
    (entry,) = cache.entries.values()
    return cache, entry


def same_bits(a, b):
    for (n, p), (_, q) in zip(sorted(a.namedparams()),
                              sorted(b.namedparams())):
        assert p.array.tobytes() == q.array.tobytes(), 'param ' + n
        assert (p.grad is None) == (q.grad is None), 'grad ' + n
        if p.grad is not None:
            assert p.grad.tobytes() == q.grad.tobytes(), 'grad ' + n


@pytest.mark.parametrize('name', sorted(MASKED))
def test_masked_backward_replays_bit_for_bit(name):
    a, b = twins(MASKED[name])
    opts = twin_optimizers((a, b), lambda: chainer.optimizers.MomentumSGD(
        lr=0.01))
    rs = numpy.random.RandomState(1)
    for i in range(6):
        # the sign pattern and the argmax move from call to call
        x = (rs.standard_normal((4, 3)) * (1 + i % 3)).astype(numpy.float32)
        for m, o in zip((a, b), opts):
            m.cleargrads()
            loss = m(x)
            loss.backward()
            o.update()
        same_bits(a, b)
    cache, entry = entry_of(b)
    assert entry.state == 'complete', entry.reason
    assert cache.replays == 5
    reruns = [op for op in entry.backward.ops if op.kind.endswith('.backward')]
    assert reruns and all(op.fn.__name__ == 'rerun_backward' for op in reruns)
    import static_graph as sg
    said = sg.explain(b).split('define-by-run in backward')[1]
    assert __file__.rstrip('c') in said   # names the user's line


def test_two_calls_then_one_backward():
    """Two calls of the chain before one backward: each call's backward
    step gets its own call's arrays, not the later call's."""
    a, b = twins(MASKED['maximum'])
    rs = numpy.random.RandomState(2)
    for i in range(4):
        x1 = rs.standard_normal((4, 3)).astype(numpy.float32)
        x2 = -rs.standard_normal((4, 3)).astype(numpy.float32)
        for m in (a, b):
            m.cleargrads()
            (m(x1) + 2 * m(x2)).backward()
        same_bits(a, b)
    # The second call of the first iteration records again (the first
    # recording had no backward yet); all later calls replay.
    assert entry_of(b)[0].replays == 6


def test_gradient_accumulation_and_batch_change():
    a, b = twins(MASKED['clip'])
    rs = numpy.random.RandomState(3)
    for m in (a, b):
        m.cleargrads()
    for n in (4, 4, 2, 4, 2):
        x = rs.standard_normal((n, 3)).astype(numpy.float32)
        for m in (a, b):
            m(x).backward()        # accumulates: no cleargrads
        same_bits(a, b)
    (cache,) = caches_of(b).values()
    assert sorted(e.state for e in cache.entries.values()) == \
        ['complete', 'complete']


def test_a_step_that_hands_back_its_input_still_falls_back():
    """F.fmod's backward returns the output gradient itself as one input's
    gradient: calling it again could not be told apart from the ops around
    it, so the call falls back, says why, and stays correct."""
    a, b = twins(lambda h, p: F.fmod(h, F.broadcast_to(p + 0.7, h.shape)))
    rs = numpy.random.RandomState(4)
    with pytest.warns(Warning, match='computes an array in Python'):
        for i in range(3):
            x = rs.standard_normal((4, 3)).astype(numpy.float32)
            for m in (a, b):
                m.cleargrads()
                m(x).backward()
            same_bits(a, b)
    cache, entry = entry_of(b)
    assert entry.state == 'fallback'


def test_masked_ops_on_inputs_and_parameters_directly():
    """The node's retained input is the call's input (an ndarray or a
    Variable that requires grad) or a parameter: each replay hands the
    backward the current one."""
    class Net(chainer.Chain):
        def __init__(self):
            super(Net, self).__init__()
            with self.init_scope():
                self.l = L.Linear(3, 3)
                self.p = chainer.Parameter(
                    numpy.array([0.3, -0.2, 0.1], numpy.float32))

        def forward(self, x):
            h = self.l(F.clip(x, -0.5, 0.5)) * F.clip(self.p, -0.15, 0.15)
            return F.sum(h ** 2) + F.sum(F.max(x, axis=1))

    Static = type('Static', (Net,), {'forward': static_graph(Net.forward)})
    numpy.random.seed(0)
    a = Net()
    b = Static()
    b.copyparams(a)
    opts = twin_optimizers((a, b), lambda: chainer.optimizers.SGD(lr=0.1))
    rs = numpy.random.RandomState(5)
    for i in range(6):
        x = rs.standard_normal((4, 3)).astype(numpy.float32)
        gxs = []
        for m, o in zip((a, b), opts):
            m.cleargrads()
            v = chainer.Variable(x.copy()) if i % 2 else x.copy()
            m(v).backward()
            o.update()
            gxs.append(v.grad if i % 2 else None)
        same_bits(a, b)
        if i % 2:
            assert gxs[0].tobytes() == gxs[1].tobytes()
    (cache,) = caches_of(b).values()
    assert all(e.state == 'complete' for e in cache.entries.values())
    assert cache.replays == 4


def test_recording_variable_kept_alive():
    """The method keeps its input Variable (in a list on a module object,
    for debugging, which the link-values watch leaves out: filled during
    the recording call only): the recording's own variable stays alive,
    and a replayed backward step that retained that input must still read
    the current call's. (A list the method's closure names directly, or
    one on a helper object, would make it fall back: test_footguns.)"""
    box = types.ModuleType('box')
    box.seen = []

    class Net(chainer.Chain):
        def forward(self, x):
            box.seen.append(x)
            return F.sum(F.clip(x, -0.5, 0.5) * F.max(x, axis=1,
                                                       keepdims=True))

    Static = type('Static', (Net,), {'forward': static_graph(Net.forward)})
    a, b = Net(), Static()
    rs = numpy.random.RandomState(6)
    for i in range(4):
        x = rs.standard_normal((4, 3)).astype(numpy.float32)
        grads = []
        for m in (a, b):
            v = chainer.Variable(x.copy())
            m(v).backward()
            grads.append(v.grad)
        assert grads[0].tobytes() == grads[1].tobytes(), i
    (cache,) = caches_of(b).values()
    assert cache.replays == 3


@pytest.mark.parametrize('axis', [1, 2])
def test_fuzz_found_min_with_micro_batches(axis):
    """Found by fuzzing (--exact): F.min's backward step retains its input
    and its output; with micro-batches whose inputs and outputs the caller
    keeps, the recording's own variables stay alive, and the replayed step
    must still read each call's arrays, both of them (over the axis of
    length one the mask is all ones whatever it reads; over axis 2 not)."""
    from tests import fuzz_grammar as grammar
    prog = grammar.Program(
        'float64', (1, 2, 3), 'sq', 0, [],
        ['h = chainer.as_variable(h)',
         'h = F.min(h, axis=%d, keepdims=False)' % axis,
         'loss = F.sum(h * h)'], '(loss, h)', ['extreme'], 0)
    seq = [grammar.Step(mode='train', batch=2, micro=3, label_kw=False,
                        twice=None, replace=0, x_as='var_nograd',
                        update=True),
           grammar.Step(mode='train', batch=4, micro=2, label_kw=False,
                        twice=None, replace='persist', x_as='var',
                        update=True)]
    exact = grammar.EXACT
    grammar.EXACT = True
    try:
        grammar.check_example(prog, seq, 0, grammar.Stats())
    finally:
        grammar.EXACT = exact


def test_rerun_steps_hold_no_arrays_of_the_recording():
    """A rerun step's kernel keeps the forward node, not the recording
    call's gradients (4 MB here)."""
    import gc
    import tracemalloc

    class Net(chainer.Chain):
        def __init__(self):
            super(Net, self).__init__()
            with self.init_scope():
                self.l = L.Linear(1000, 1000)

        @static_graph
        def forward(self, x):
            return F.sum(F.clip(self.l(x), -0.1, 0.1) ** 2)

    m = Net()
    x = numpy.random.RandomState(8).rand(500, 1000).astype(numpy.float32)
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        m(x).backward()
        m.cleargrads()
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    (cache,) = caches_of(m).values()
    (entry,) = cache.entries.values()
    assert [op.kind for op in entry.backward.ops
            if op.kind.endswith('.backward')] == ['Clip.backward']
    assert held < (1 << 20), held


# -- gradients a backward() computes in Python and returns ---------------------
class _ScaledSquare(chainer.Function):
    """An old-style Function, as legacy user code writes them: its state
    lives on the Function object and its backward_cpu returns an array it
    computed in NumPy (no node)."""

    def forward_cpu(self, inputs):
        x, = inputs
        self.scale = numpy.abs(x).max() + 1     # data-dependent state
        self.twice_x = 2 * x / self.scale
        return (x * x / self.scale).astype(x.dtype),

    def backward_cpu(self, inputs, grad_outputs):
        gy, = grad_outputs
        return (gy * self.twice_x).astype(gy.dtype),


def _old_style_twins(loss):
    class Net(chainer.Chain):
        def __init__(self):
            super(Net, self).__init__()
            with self.init_scope():
                self.l1 = L.Linear(4, 3)
                self.l2 = L.Linear(3, 3)

        def forward(self, x, t):
            return loss(self.l2(F.relu(self.l1(x))), t)

    Static = type('Static', (Net,), {'forward': static_graph(Net.forward)})
    numpy.random.seed(0)
    a = Net()
    b = Static()
    b.copyparams(a)
    return a, b


OLD_STYLE = {
    'hinge': lambda y, t: F.hinge(y, t),
    'user_function': lambda y, t: F.sum(_ScaledSquare()(y)),
}


@pytest.mark.parametrize('name', sorted(OLD_STYLE))
def test_gradient_computed_in_python_by_a_backward_follows_the_data(name):
    """F.hinge (an old-style Function) computes its input gradient in
    backward_cpu with NumPy and returns it: replay must call that backward
    again, not freeze its gradient (the recording's was replayed before,
    parameter gradients off by up to 1.4); and with two calls before the
    first backward, each backward reads its own call's state (kept on the
    Function object, not the node)."""
    models = _old_style_twins(OLD_STYLE[name])
    rs = numpy.random.RandomState(3)
    opts = twin_optimizers(models, lambda: chainer.optimizers.SGD(lr=0.1))
    for it in range(4):
        batches = [(rs.randn(5, 4).astype(numpy.float32) * (1 + k),
                    rs.randint(0, 3, 5).astype(numpy.int32))
                   for k in range(2)]
        grads = []
        for m in models:
            m.cleargrads()
            l1, l2 = [m(x, t) for x, t in batches]
            l1.backward()
            first = [p.grad.copy() for _, p in sorted(m.namedparams())]
            l2.backward()
            grads.append((first, float(l1.array), float(l2.array)))
        numpy.testing.assert_array_equal(grads[0][1:], grads[1][1:])
        for u, v in zip(grads[0][0], grads[1][0]):
            numpy.testing.assert_array_equal(u, v)
        for (_, p), (_, q) in zip(sorted(models[0].namedparams()),
                                  sorted(models[1].namedparams())):
            numpy.testing.assert_array_equal(p.grad, q.grad)
        for o in opts:
            o.update()
    cache, = caches_of(models[1]).values()
    assert [e.state for e in cache.entries.values()] == ['complete']
    assert cache.replays == 6    # both calls of the first step record
    backward = str(list(cache.entries.values())[0].backward)
    assert 'rerun_backward' in backward and ' const' not in backward


def test_batch_renormalization_replays_and_trains_alike():
    """BatchRenormalization computes its gradients in Python (an old-style
    Function): it used to fall back; it replays now, bit for bit, with its
    running statistics."""
    class Net(chainer.Chain):
        def __init__(self):
            super(Net, self).__init__()
            with self.init_scope():
                self.l = L.Linear(4, 3)
                self.bn = L.BatchRenormalization(3, rmax=1.5, dmax=0.5)

        def forward(self, x):
            return F.sum(self.bn(self.l(x)) ** 2)

    Static = type('Static', (Net,), {'forward': static_graph(Net.forward)})
    numpy.random.seed(0)
    a, b = Net(), Static()
    b.copyparams(a)
    rs = numpy.random.RandomState(4)
    opts = twin_optimizers((a, b), lambda: chainer.optimizers.MomentumSGD(
        lr=0.05))
    for it in range(5):
        x = (rs.randn(6, 4) * (1 + it)).astype(numpy.float32)
        for m, o in zip((a, b), opts):
            m.cleargrads()
            m(x).backward()
            o.update()
        for (_, p), (_, q) in zip(sorted(a.namedparams()),
                                  sorted(b.namedparams())):
            numpy.testing.assert_array_equal(p.array, q.array)
        for k in ('avg_mean', 'avg_var'):
            numpy.testing.assert_array_equal(getattr(a.bn, k),
                                             getattr(b.bn, k))
    cache, = caches_of(b).values()
    assert [e.state for e in cache.entries.values()] == ['complete']


class _HeldMask(chainer.FunctionNode):
    """Keeps arrays computed in forward on itself, and its backward reads
    their values in Python: a branch, a float."""

    def __init__(self, read):
        self.read = read

    def forward(self, inputs):
        x, = inputs
        self.mask = x > 0
        self.n = numpy.asarray(float(self.mask.sum()) + 1, x.dtype)
        return x * 2,

    def backward(self, indexes, grad_outputs):
        gy, = grad_outputs
        if self.read == 'branch':
            return (gy * 3 if self.mask.sum() > 6 else gy * -1),
        if self.read == 'float':
            return gy * float(self.n),
        if self.read == 'derived':
            return (gy * 3 if (self.mask * 1).sum() > 6 else gy * -1),
        if self.read == 'asarray':
            return (gy * 3 if numpy.asarray(self.mask).sum() > 6
                    else gy * -1),
        return gy * self.mask.astype(gy.dtype),    # arithmetic only


@pytest.mark.parametrize('read', ['branch', 'float', 'arithmetic',
                                  'derived', 'asarray'])
def test_a_users_backward_reading_arrays_it_holds(read):
    """A user FunctionNode's backward read the values of an array its
    forward left on it (``if self.mask.sum() > 3``, ``float(self.n)``):
    replay repeated the recording's branch (19-44 off in l.W.grad),
    silently. That backward now runs again at every replay."""
    def fn(h, p):
        return _HeldMask(read).apply((h + p,))[0]

    a, b = twins(fn)
    rs = numpy.random.RandomState(0)
    for it in range(6):
        x = rs.randn(4, 3).astype(numpy.float32) * (1 + it % 3)
        for m in (a, b):
            m.cleargrads()
            m(x.copy()).backward()
        same_bits(a, b)
    cache, entry = entry_of(b)
    assert entry.state == 'complete' and cache.replays == 5
    assert 'rerun_backward' in str(entry.backward)
