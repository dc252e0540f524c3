"""The LSTM cell's compiled loops (static_graph/lstm_kernels.py): the same
bits and layouts as Chainer's LSTM and LSTMGrad code, on random shapes
(a batch shorter than the cell state too) and values that probe rounding,
signed zeros, subnormals, infinities and NaNs; Chainer's own code where
the loops do not apply; and the kernels in a replayed LSTM model."""
import numpy
import pytest

import chainer
import chainer.links as L
from chainer.functions.rnn import lstm as lstm_module

from schedules import native
from static_graph import lstm_kernels as K
from static_graph import static_graph
from static_graph.decorator import caches_of
from tests import twins

pytestmark = pytest.mark.skipif(native.compiler() is None,
                                reason='no C compiler here')


def _values(rs, shape, dtype, special):
    x = rs.standard_normal(shape) * 10.0 ** rs.uniform(-3, 1.5)
    if special:
        fi = numpy.finfo(dtype)
        flat = x.reshape(-1)
        picks = [0.0, -0.0, numpy.inf, -numpy.inf, numpy.nan, fi.tiny / 4,
                 -fi.tiny, fi.max, 30.0, -30.0]
        idx = rs.choice(flat.size, min(flat.size, len(picks)),
                        replace=False)
        flat[idx] = picks[:len(idx)]
    return x.astype(dtype)


def _same(want, got):
    assert len(want) == len(got)
    for w, g in zip(want, got):
        assert w.dtype == g.dtype and w.shape == g.shape
        assert w.strides == g.strides
        assert w.tobytes() == g.tobytes()


@pytest.mark.parametrize('dtype', [numpy.float32, numpy.float64])
@pytest.mark.parametrize('special', [False, True])
def test_forward_and_gradient_give_chainers_bits(dtype, special):
    rs = numpy.random.RandomState(7 + special)
    with numpy.errstate(all='ignore'):
        for _ in range(40):
            units, rows = rs.randint(1, 70), rs.randint(1, 12)
            batch = rs.randint(1, rows + 1)
            c = _values(rs, (rows, units), dtype, special)
            x = _values(rs, (batch, 4 * units), dtype, special)
            want = lstm_module.LSTM().forward((c, x))
            _same(want, K.forward(c, x))
            c_next = want[0]
            gc = _values(rs, (rows, units), dtype, special)
            gh = _values(rs, (batch, units), dtype, special)
            a = (c, x, c_next, gc, gh)
            _same(lstm_module.LSTMGrad().forward(a), K.grad(*a))


def test_chainers_code_where_the_loops_do_not_apply():
    """A missing gradient, a strided or float16 operand, NumPy set to
    raise: Chainer's own code runs (the same results, its errors)."""
    rs = numpy.random.RandomState(0)
    c = rs.standard_normal((3, 5)).astype(numpy.float32)
    x = rs.standard_normal((3, 20)).astype(numpy.float32)
    c_next, h = K.forward(c, x)
    _same(lstm_module.LSTMGrad().forward((c, x, c_next, None, h)),
          K.grad(c, x, c_next, None, h))
    xf = numpy.asfortranarray(x)
    _same(lstm_module.LSTM().forward((c, xf)), K.forward(c, xf))
    c16, x16 = c.astype(numpy.float16), x.astype(numpy.float16)
    _same(lstm_module.LSTM().forward((c16, x16)), K.forward(c16, x16))
    assert K.for_lstm(None, None, (c16, x16)) is None
    big = numpy.full((3, 20), 1e38, numpy.float32)
    with numpy.errstate(over='raise'):
        with pytest.raises(FloatingPointError):
            K.grad(c, big, c_next, numpy.full((3, 5), 1e38, numpy.float32),
                   numpy.full((3, 5), 1e38, numpy.float32))


class LM(chainer.Chain):
    units = 128

    def __init__(self):
        super(LM, self).__init__()
        with self.init_scope():
            self.embed = L.EmbedID(30, self.units)
            self.lstm = L.LSTM(self.units, self.units)
            self.out = L.Linear(self.units, 30)

    def forward(self, x):
        return self.out(self.lstm(self.embed(x)))


class StaticLM(LM):
    forward = static_graph(LM.forward)


@pytest.mark.parametrize('units,batch', [(128, 16), (16, 4)])
def test_replayed_lm_runs_the_loops_bit_for_bit(units, batch):
    """A truncated-BPTT LM with L.LSTM, decorated and not: the replay's
    LSTM and LSTMGrad ops run the loops, also in the backward variant that
    adds to gradients held from the later calls (which is what runs; at 16
    units its ops are under 64 kB, whose kernels lower_pass defers to the
    compile of the backward schedule), and both twins train to the same
    bits."""
    models = []
    for cls in (LM, StaticLM):
        numpy.random.seed(0)
        m = type(cls.__name__, (cls,), {'units': units})()
        opt = chainer.optimizers.SGD(lr=0.5)
        opt.setup(m)
        models.append((m, opt))
    rs = numpy.random.RandomState(1)
    for it in range(4):
        xs = [rs.randint(0, 30, batch).astype(numpy.int32)
              for _ in range(6)]
        for m, opt in models:
            twins.bptt_window(m, opt, xs)
    for (na, pa), (nb, pb) in zip(sorted(models[0][0].namedparams()),
                                  sorted(models[1][0].namedparams())):
        assert na == nb and pa.array.tobytes() == pb.array.tobytes(), na
    forward, accumulating = [], []
    for cache in caches_of(models[1][0]).values():
        for e in cache.entries.values():
            forward += _kernels(e.forward, 'LSTM')
            for (ks, _, _), run in e.accumulating.items():
                if ks and run is not None:
                    accumulating += _kernels(run.schedule, 'LSTMGrad')
    # (a large op's kernel is checked on its first call: probe_ until then)
    assert 'c_LSTM' in forward
    assert accumulating and set(accumulating) <= {'c_LSTMGrad',
                                                  'probe_c_LSTMGrad'}


def _kernels(schedule, kind):
    return [getattr(op.fn, '__name__', None) for op in schedule.ops
            if op.kind == kind]
