"""Python control flow on values the recording must see: arrays held in
globals, containers and helper objects, globals read through a property or
a decorated helper, and a where= mask computed from the input."""
import functools
import types
import warnings

import numpy
import pytest

import chainer
import chainer.functions as F
import chainer.links as L

from static_graph import StaticGraphWarning
from static_graph import static_graph as static

GATE = numpy.array(1.0)
GAIN = 1.0
W4 = numpy.ones(4, 'f')


def _logged(fn):
    @functools.wraps(fn)
    def wrapper(*args):
        return fn(*args)
    return wrapper


@_logged
def _scaled(h):
    return h * GAIN


class Net(chainer.Chain):
    def __init__(self, kind):
        super(Net, self).__init__()
        self.kind = kind
        with self.init_scope():
            self.l = L.Linear(3, 4)
        self.gates = [numpy.array(1.0)]
        self.cfg = types.SimpleNamespace(gate=numpy.array(1.0))

    @property
    def gain(self):
        return GAIN

    def forward(self, x):
        h = self.l(x)
        kind = self.kind
        if kind == 'global':
            on = GATE > 0
        elif kind == 'list':
            on = self.gates[0] > 0
        elif kind == 'namespace':
            on = self.cfg.gate > 0
        elif kind == 'property':
            return F.sum(F.relu(h) * self.gain)
        elif kind == 'wrapped':
            return F.sum(_scaled(F.relu(h)))
        else:       # 'where': only the mask is traced
            return F.sum(h) * float(W4.sum(where=x[:, 0] > 0))
        return F.sum(F.relu(h) if on else h * h)


class StaticNet(Net):
    forward = static(Net.forward)


def _flip(m, step):
    """Only what the kind reads changes (a watched global that changes
    records again, whatever branch reads it)."""
    global GAIN
    v = 1.0 if step % 2 == 0 else -1.0
    if m.kind == 'global':
        GATE[...] = v                  # changed in place
    elif m.kind == 'list':
        m.gates[0][...] = v
    elif m.kind == 'namespace':
        m.cfg.gate[...] = v
    elif m.kind in ('property', 'wrapped'):
        GAIN = 1.0 + step % 2


@pytest.mark.parametrize('kind', ['global', 'list', 'namespace',
                                  'property', 'wrapped', 'where'])
def test_branches_and_numbers_follow_the_values(kind):
    dbr, ours = Net(kind), StaticNet(kind)
    ours.copyparams(dbr)
    rs = numpy.random.RandomState(0)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', StaticGraphWarning)
        for step in range(6):
            x = rs.randn(4, 3).astype('f')
            got = []
            for m in (dbr, ours):
                _flip(m, step)
                m.cleargrads()
                loss = m(x)
                loss.backward()
                got.append((loss.array, m.l.W.grad.copy()))
            for a, b in zip(*got):
                assert numpy.array_equal(a, b), step
