"""The recording pipeline's own contracts: the entry's life cycle is a
state machine that refuses a move it does not allow, and the build stages
can be printed one after the other (build.TRACE)."""
import numpy
import pytest

import chainer
import chainer.functions as F
import chainer.links as L

import static_graph
from static_graph import build
from static_graph import entry
from static_graph.decorator import caches_of
from tests.twins import compare_chains, static_twins

rs = numpy.random.RandomState(5)


def test_entry_moves_only_as_its_life_allows():
    e = entry.Entry(('key',), 'forward')
    assert e.state == entry.RECORDING
    e.move(entry.COMPLETE)
    e.move(entry.FALLBACK, 'a reason')
    assert (e.state, e.reason) == (entry.FALLBACK, 'a reason')
    for to in (entry.RECORDING, entry.COMPLETE, entry.FALLBACK):
        with pytest.raises(RuntimeError, match='fallback -> '):
            e.move(to)
    d = entry.Entry(('key',), 'forward')
    d.move(entry.DISCARDED)
    with pytest.raises(RuntimeError):
        d.move(entry.COMPLETE)
    r = entry.Entry(('key',), 'forward')
    with pytest.raises(RuntimeError, match='recording -> recording'):
        r.move(entry.RECORDING)


class Plain(chainer.Chain):
    def __init__(self):
        super(Plain, self).__init__()
        with self.init_scope():
            self.c = L.Convolution2D(3, 4, 3, pad=1, nobias=True)
            self.bn = L.BatchNormalization(4)
            self.l = L.Linear(36 * 4, 2)

    def forward(self, x):
        return self.l(F.relu(self.bn(self.c(x))))


class ConvBNReLU(Plain):
    forward = static_graph.static_graph(Plain.forward)


def _one_call(model):
    x = rs.standard_normal((2, 3, 6, 6)).astype('f')
    model.cleargrads()
    F.sum(model(x) ** 2).backward()
    (e,) = caches_of(model)['forward'].entries.values()
    return e


def test_build_stages_print_one_after_the_other(monkeypatch):
    monkeypatch.setattr(build, 'TRACE', True)
    e = _one_call(ConvBNReLU())
    assert e.state == entry.COMPLETE
    stages = [name for name, _ in e.passes]
    # BatchNormalization's and ReLU's outputs are computed again in the
    # backward instead of being saved: a stage of its own.
    assert stages == ['recorded', 'rematerialize', 'lowered']
    recorded, remat, lowered = [text for _, text in e.passes]
    assert 'schedule forward' in recorded and 'schedule backward' in recorded
    assert 'Recompute' not in recorded and 'Recompute' in remat
    assert remat != lowered
    # The last stage is what replays.
    assert lowered == '%s\n%s' % (e.forward, e.backward)


def test_build_keeps_no_stage_text_by_default():
    assert not build.TRACE
    assert _one_call(ConvBNReLU()).passes is None


def test_traced_build_replays_the_same_numbers(monkeypatch):
    monkeypatch.setattr(build, 'TRACE', True)
    models = static_twins(Plain)
    for _ in range(3):
        x = rs.standard_normal((2, 3, 6, 6)).astype('f')
        for m in models:
            m.cleargrads()
            F.sum(m(x) ** 2).backward()
        compare_chains(*models, rtol=0, atol=0)
    assert caches_of(models[1])['forward'].replays == 2


class _ManyPieces(chainer.Chain):
    def __init__(self):
        super(_ManyPieces, self).__init__()
        with self.init_scope():
            self.l = L.Linear(4, 4)

    def forward(self, x):
        # 300 pieces (an RNN's states over 300 steps): the backward of the
        # stack has 300 results, the separate 300 outputs.
        return F.sum(F.stack(F.separate(self.l(x), axis=0)) ** 2)


def test_an_op_of_300_results_compiles():
    """Python compiles ``a, b, *_ = r`` for at most 255 names: a compiled
    schedule of such an op raised SyntaxError at every call from the
    third on."""
    a = _ManyPieces()
    b = type('S', (_ManyPieces,),
             {'forward': static_graph.static_graph(_ManyPieces.forward)})()
    b.copyparams(a)
    x = rs.randn(300, 4).astype('f')
    for _ in range(5):
        for m in (a, b):
            m.cleargrads()
            m(x).backward()
        compare_chains(a, b, rtol=0, atol=0)
    assert caches_of(b)['forward'].replays == 4
