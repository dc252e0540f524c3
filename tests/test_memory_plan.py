"""The memory plan of a recorded call: valid, visible, and drawable."""
import os
import sys

import numpy
import pytest

import chainer
import chainer.functions as F
import chainer.links as L

import static_graph
from schedules import planner


class Net(chainer.Chain):
    def __init__(self):
        super(Net, self).__init__()
        with self.init_scope():
            self.c = L.Convolution2D(1, 4, 3, pad=1)
            self.bn = L.BatchNormalization(4)
            self.l = L.Linear(4 * 4 * 4, 3)

    @static_graph.static_graph
    def forward(self, x, t):
        h = F.max_pooling_2d(F.relu(self.bn(self.c(x))), 2)
        h = F.dropout(h, 0.2)
        return F.softmax_cross_entropy(self.l(h), t)


def recorded():
    m = Net()
    x = numpy.random.RandomState(0).rand(5, 1, 8, 8).astype('f')
    t = numpy.arange(5).astype('i') % 3
    m(x, t).backward()
    return [s for s in static_graph.cached(m) if s.state == 'complete'][0]


def test_plan_is_valid_and_shown():
    s = recorded()
    p = s.memory_plan()
    assert planner.check_plan(p.sizes, p.lifetimes, p.offsets, p.pinned)
    assert 0 < p.arena_bytes <= p.total_bytes
    last = max(l for _, l in p.lifetimes.values())
    for b, buf in s.forward.buffers.items():
        if buf.static:   # read through captured references until the end
            assert p.lifetimes[b][1] == last, b
    text = str(s.backward)
    assert 'plan_memory:' in text and '@' in text
    assert 'static' in str(s.forward)


def test_plot(tmp_path):
    pytest.importorskip('matplotlib', reason='plotting needs matplotlib')
    from schedules import plot
    s = recorded()
    path = str(tmp_path / 'plan.png')
    plot.plot_plan([s.forward, s.backward], s.memory_plan(), path)
    with open(path, 'rb') as f:
        assert f.read(8) == b'\x89PNG\r\n\x1a\n'


def test_plot_command(tmp_path):
    pytest.importorskip('matplotlib', reason='plotting needs matplotlib')
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, os.path.join(root, 'benchmarks'))
    import plot_plan
    out = str(tmp_path / 'mlp.png')
    p = plot_plan.main(['--case', 'mlp-b8', '--out', out])
    assert os.path.getsize(out) > 1000 and p.arena_bytes < p.total_bytes
