"""The backward computes BatchNormalization and ReLU outputs again instead of
keeping them from the forward: the same bits, less memory."""
import gc
import tracemalloc

import numpy
import pytest

import chainer
import chainer.functions as F
import chainer.links as L

import static_graph
from schedules import ir
from schedules import recompute
from static_graph import recompute_rules
from tests.twins import compare_chains, static_twins, train_twins

rs = numpy.random.RandomState(11)


# -- the schedule rewrite, on its own ----------------------------------------
def _buffers(n):
    return dict((b, ir.Buffer(b, (2, 3), 'f', ir.TEMP)) for b in range(n))


def test_rematerialize_computes_before_first_use_and_renames_readers():
    bufs = _buffers(8)
    bufs[1].role = ir.PARAM
    # forward: %2 = f(%0, %1); %3 = g(%2); backward reads %2 twice.
    fops = [ir.Op('f', (0, 1), (2,)), ir.Op('g', (2,), (3,))]
    bops = [ir.Op('h', (4,), (5,)), ir.Op('k', (5, 2), (6,)),
            ir.Op('m', (2, 6), (7,))]
    recipe = recompute.Recipe('Recompute[f]', (0, 1), fn=None,
                              attrs={'of': '%2'})
    fops2, bops2, saved = recompute.rematerialize(
        bufs, fops, bops, (2, 0), {2: recipe}, live=(1,))
    # A copy of the parameter %1 is taken at the end of the forward.
    assert [op.kind for op in fops2] == ['f', 'g', 'Snapshot']
    snap = fops2[-1].outputs[0]
    assert fops2[-1].inputs == (1,) and bufs[snap].role == ir.TEMP
    assert [op.kind for op in bops2] == ['h', 'Recompute[f]', 'k', 'm']
    again = bops2[1].outputs[0]
    assert bops2[1].inputs == (0, snap)
    assert bops2[2].inputs == (5, again) and bops2[3].inputs == (again, 6)
    assert saved == (0, snap)
    assert bufs[again].shape == bufs[2].shape and \
        bufs[again].name == 'recomputed %2'
    ir.Schedule('forward', bufs, fops2, (0, 1), (3,), keep=saved).verify()
    ir.Schedule('backward', bufs, bops2, (4,) + saved, (7,)).verify()


def test_rematerialize_refuses_a_recipe_reading_a_recomputed_buffer():
    bufs = _buffers(4)
    recipes = {2: recompute.Recipe('a', (0,), None),
               3: recompute.Recipe('b', (2,), None)}
    with pytest.raises(ValueError, match='reads a recomputed buffer'):
        recompute.rematerialize(bufs, [], [ir.Op('x', (2, 3), ())],
                                (2, 3), recipes)


# -- on Chainer models -------------------------------------------------------
class Block(chainer.Chain):
    """conv-BN-ReLU twice with a residual addition, as in a ResNet."""

    def __init__(self):
        super(Block, self).__init__()
        with self.init_scope():
            self.c1 = L.Convolution2D(3, 8, 3, pad=1, nobias=True)
            self.b1 = L.BatchNormalization(8)
            self.c2 = L.Convolution2D(8, 8, 3, pad=1, nobias=True)
            self.b2 = L.BatchNormalization(8)
            self.l = L.Linear(8, 4)

    def forward(self, x, t):
        h = F.relu(self.b1(self.c1(x)))
        h = F.relu(self.b2(self.c2(h)) + h)
        return F.softmax_cross_entropy(self.l(F.average(h, axis=(2, 3))), t)


def block(static, **options):
    if not static:
        return Block()
    deco = static_graph.static_graph(**options) if options else \
        static_graph.static_graph
    return type('StaticBlock', (Block,), {'forward': deco(Block.forward)})()


def batch(n=6):
    return (rs.standard_normal((n, 3, 8, 8)).astype('f'),
            rs.randint(0, 4, n).astype('i'))


def entry_of(model):
    (s,) = [s for s in static_graph.cached(model) if s.state == 'complete']
    return s


@pytest.mark.parametrize('optimizer', [
    lambda: chainer.optimizers.SGD(0.1),
    lambda: chainer.optimizers.MomentumSGD(0.1),
    lambda: chainer.optimizers.Adam()])
def test_trains_bit_for_bit(optimizer):
    batches = [batch() for _ in range(5)]
    steps = [lambda m, b=b: m(*b) for b in batches]
    a, b = train_twins(block, steps, optimizer, rtol=0, atol=0)
    s = entry_of(b)
    kinds = [op.kind for op in s.backward.ops]
    assert kinds.count('Recompute[BatchNormalization+ReLU]') == 1
    # The second ReLU's input is an addition: no rule, its output is saved.
    relu = [op.outputs[0] for op in s.forward.ops if op.kind == 'ReLU']
    assert relu[0] not in s.entry.saved and relu[1] in s.entry.saved


def test_less_memory_than_without():
    x, t = batch(32)
    peaks = {}
    for recompute_on in (True, False):
        # (The replay on NumPy, not through the CUDA-graph stand-in of
        # STATIC_GRAPH_FAKE_CUDA_GRAPH=1, whose memory this would measure;
        # on one thread: whether a schedule uses the second one is measured,
        # and the two ways allocate differently, so the peaks compared
        # would depend on the machine's load.)
        m = block(True, recompute=recompute_on, cuda_graph=False, threads=1)
        for _ in range(6):   # (past the compile at the fourth call)
            m.cleargrads()
            m(x, t).backward()
        gc.collect()
        tracemalloc.start()
        try:
            m.cleargrads()
            m(x, t).backward()
            peaks[recompute_on] = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        kinds = [op.kind for op in entry_of(m).backward.ops]
        assert ('Recompute[BatchNormalization+ReLU]' in kinds) == \
            recompute_on
    # One (32, 8, 8, 8) float32 ReLU output (64 KiB) is no longer held from
    # the forward to the backward.
    assert peaks[True] <= peaks[False] - 60 * 1024, peaks


def test_a_recipe_that_does_not_give_the_recorded_values_is_not_used(
        monkeypatch):
    def off_by_a_bit(rop, bufs):
        inputs, fn = recompute_rules._relu(rop, bufs)
        return inputs, lambda a, owned: numpy.maximum(a[0], 1e-30,
                                                      dtype=a[0].dtype)

    monkeypatch.setitem(recompute_rules.RULES, 'ReLU', off_by_a_bit)
    steps = [lambda m, b=b: m(*b) for b in [batch() for _ in range(3)]]
    a, b = train_twins(block, steps, lambda: chainer.optimizers.SGD(0.1),
                       rtol=0, atol=0)
    s = entry_of(b)
    assert not any(op.kind.startswith('Recompute') for op in s.backward.ops)
    relu = [op.outputs[0] for op in s.forward.ops if op.kind == 'ReLU']
    assert relu[0] in s.entry.saved


def test_parameters_changed_between_forward_and_backward():
    """Define-by-run keeps the forward's ReLU output; recomputing it from
    gamma and beta after they changed in place would give other numbers.
    The forward keeps a copy of them for the backward."""
    models = block(False), block(True)
    models[1].copyparams(models[0])
    for i in range(4):
        x, t = batch()
        losses = [m(x, t) for m in models]
        for m in models:
            m.cleargrads()
            if i:   # the first call records, with a plain backward
                m.b1.gamma.array *= 1.5
                m.b1.beta.array += 0.25
        for loss in losses:
            loss.backward()
        compare_chains(*models, rtol=0, atol=0)
    assert any(op.kind == 'Snapshot' for op in entry_of(models[1]).forward.ops)


class OnInput(chainer.Chain):
    """BatchNormalization on the caller's array; its input also returned."""

    def __init__(self):
        super(OnInput, self).__init__()
        with self.init_scope():
            self.bn = L.BatchNormalization(3)
            self.c = L.Convolution2D(3, 3, 1)
            self.bn2 = L.BatchNormalization(3)

    def forward(self, x):
        h = self.c(F.relu(self.bn(x)))
        return F.sum(F.relu(self.bn2(h)) * 2), h


@pytest.mark.parametrize('change', ['input', 'output'])
def test_arrays_the_user_may_change_before_backward_are_not_read(change):
    """Define-by-run's backward uses the ReLU outputs of its forward. A
    recipe reading the caller's array, or one handed back, would see what
    user code wrote into it after the forward."""
    models = static_twins(OnInput)
    for i in range(4):
        x = rs.standard_normal((4, 3, 5, 5)).astype('f')
        for m in models:
            m.cleargrads()
            mine = x.copy()
            loss, h = m(mine)
            # Not in the recording call: it runs on its own copies.
            if i and change == 'input':
                mine += 1
            elif i:
                h.array += 1
            loss.backward()
        compare_chains(*models, rtol=0, atol=0)
    s = entry_of(models[1])
    assert not any(op.kind.startswith('Recompute')
                   for op in s.backward.ops)


class Aliases(chainer.Chain):
    """BatchNormalization and ReLU whose input shares memory with the
    caller's array, a parameter, or a view the method hands out."""

    def __init__(self, how):
        super(Aliases, self).__init__()
        self.how = how
        with self.init_scope():
            self.c = L.Convolution2D(3, 3, 3, pad=1, nobias=True)
            self.gamma = chainer.Parameter(numpy.ones(3, 'f'))
            self.beta = chainer.Parameter(numpy.zeros(3, 'f'))
            self.c2 = L.Convolution2D(3, 2, 3, pad=1)

    def forward(self, x):
        how = self.how
        a = F.cast(x, numpy.float32) if how == 'input' else self.c(x)
        gamma = F.identity(self.gamma) if how == 'param' else self.gamma
        h = F.relu(F.batch_normalization(a, gamma, self.beta))
        return F.sum(self.c2(h) ** 2), F.transpose(a)


@pytest.mark.parametrize('how', ['input', 'param', 'output'])
def test_no_recipe_reads_memory_user_code_can_change(how):
    """The caller's input reached through F.cast (the same array), a
    parameter through F.identity, BatchNormalization's input handed out as a
    transposed view: changed in place between the call and its backward,
    define-by-run's saved ReLU output does not see it, so nothing is
    recomputed from that memory (no recipe formed before the fix here)."""
    models = static_twins(Aliases, how)
    for i in range(4):
        x = rs.standard_normal((4, 3, 5, 5)).astype('f')
        for m in models:
            m.cleargrads()
            mine = x.copy()
            loss, view = m(mine)
            if i:   # not in the recording call: it runs on its own copies
                if how == 'input':
                    mine *= -1
                elif how == 'param':
                    m.gamma.array *= -2
                else:
                    view.array *= -1
            loss.backward()
        compare_chains(*models, rtol=0, atol=0)
    assert static_graph.decorator.caches_of(models[1])['forward'].replays == 3


def test_two_calls_before_one_backward():
    models = block(False), block(True)
    models[1].copyparams(models[0])
    for i in range(3):
        b1, b2 = batch(), batch(4)
        for m in models:
            m.cleargrads()
            (m(*b1) + m(*b1) * 0.5 + m(*b2)).backward()
        compare_chains(*models, rtol=0, atol=0)


def test_option_is_checked():
    with pytest.raises(TypeError, match='recompute must be True or False'):
        static_graph.static_graph(recompute='yes')

