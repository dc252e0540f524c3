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


def test_backward_ops_carry_their_forward_line():
    s = recorded()
    lines = [op.source.rsplit(':', 1)[1] for op in s.forward.ops
             if op.source]
    assert lines == ['26'] * 4 + ['27', '28', '28', '28'], lines
    by_kind = dict((op.kind, op.source.rsplit(':', 1)[1])
                   for op in s.backward.ops)
    assert by_kind['LinearGradWeight'] == '28'
    assert by_kind['DropoutGrad'] == '27'
    assert by_kind['ReLUGrad2'] == by_kind['Convolution2DGradW'] == '26'


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


class Wide(chainer.Chain):
    def __init__(self):
        super(Wide, self).__init__()
        with self.init_scope():
            self.l1 = L.Linear(1024, 1024)
            self.l2 = L.Linear(1024, 1024)
            self.l3 = L.Linear(1024, 10)

    @static_graph.static_graph
    def forward(self, x, t):
        h = F.relu(self.l1(x))
        h = F.relu(self.l2(h))
        return F.softmax_cross_entropy(self.l3(h), t)


def test_cache_entry_keeps_only_static_buffers():
    """Once built, an entry holds its static buffers (what nodes read by
    reference), not the recording's activations and gradients (about 25 MB
    here: two 4 MB weight gradients, 1 MB activations...), nor the arrays
    its backward nodes were built with (ReLUGrad2's ``b``: rebound at each
    replay, so not static either)."""
    import gc
    import tracemalloc
    from static_graph.decorator import caches_of
    m = Wide()
    rs = numpy.random.RandomState(0)
    x = rs.rand(256, 1024).astype('f')
    t = rs.randint(0, 10, 256).astype('i')
    gc.collect()
    tracemalloc.start()
    try:
        for _ in range(3):
            m.cleargrads()
            m(x, t).backward()
        m.cleargrads()
        gc.collect()
        held = tracemalloc.get_traced_memory()[0]
        (cache,) = caches_of(m).values()
        (entry,) = cache.entries.values()
        static_bytes = sum(
            buf.storage.nbytes for buf in entry.forward.buffers.values()
            if buf.static and buf.storage is not None and
            buf.storage.base is None)
        cache.entries.clear()
        del entry
        gc.collect()
        kept = held - tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert kept < static_bytes + (1 << 20), (kept, static_bytes)


def test_backward_nodes_get_their_arrays_as_inputs_not_static_buffers():
    """ReLU's backward node is built with the ReLU output (``b``) and
    BatchNormalization's with the batch mean and inverse std: replay passes
    the current arrays to those ops as inputs, so the buffers are ordinary
    saved activations (freed after their last backward use), and the nodes
    hold nothing between calls."""
    from static_graph.decorator import caches_of
    m = Net()
    rs = numpy.random.RandomState(0)
    for _ in range(3):
        m.cleargrads()
        m(rs.rand(5, 1, 8, 8).astype('f'),
          numpy.arange(5).astype('i') % 3).backward()
    (cache,) = caches_of(m).values()
    (entry,) = cache.entries.values()
    bufs = entry.forward.buffers
    producer = dict((b, op.kind) for op in entry.forward.ops
                    for b in op.outputs)
    relu_out = [b for b, k in producer.items() if k == 'ReLU']
    bn_state = [b for b, k in producer.items()
                if k == 'BatchNormalization' and bufs[b].role == 'state']
    assert len(relu_out) == 1 and len(bn_state) >= 2
    grad_ops = dict((op.kind, op) for op in entry.backward.ops)
    # The ReLU output reaches its backward op computed again (test_recompute)
    # from saved arrays: BatchNormalization's input, mean and inverse std.
    (again,) = [op for op in entry.backward.ops
                if op.kind == 'Recompute[BatchNormalization+ReLU]']
    assert again.attrs == {'of': '%%%d' % relu_out[0]}
    assert again.outputs[0] in grad_ops['ReLUGrad2'].inputs
    read = set(bn_state) & set(grad_ops['BatchNormalizationGrad'].inputs)
    assert len(read) == 2     # mean and inverse std
    assert read <= set(again.inputs)
    for b in relu_out + bn_state + list(again.outputs):
        assert not bufs[b].static, bufs[b]
    assert relu_out[0] not in entry.saved
    for b in sorted(read) + list(again.inputs):
        assert b in entry.saved
    from static_graph import arrayutil
    for op in entry.backward.ops:
        node = getattr(op.fn, '__self__', None)
        if node is not None:
            assert not any(arrayutil.is_array(v) and v.size > 1
                           for v in vars(node).values()), op.kind
    # Its forward runs the NumPy kernel, which returns the statistics as
    # results: the forward node keeps none of a call's arrays either.
    bn = [op for op in entry.forward.ops if op.kind == 'BatchNormalization']
    assert bn and all(op.fn.__name__ == 'numpy_BatchNormalization'
                      for op in bn)
    for op in bn:
        node = op._attrs.args[0]
        assert not any(arrayutil.is_array(v) and v.size > 1 and
                       k not in ('running_mean', 'running_var')
                       for k, v in vars(node).items()), vars(node).keys()


def test_plan_memory_off_for_comparison():
    """plan_memory=False: the same numbers, no reuse at all, more memory."""
    import gc
    import tracemalloc
    from tests.test_recompute import Block, batch
    from tests.twins import train_twins

    def make(static, **options):
        if not static:
            return Block()
        deco = static_graph.static_graph(**options)
        return type('StaticBlock', (Block,),
                    {'forward': deco(Block.forward)})()

    batches = [batch(16) for _ in range(4)]
    steps = [lambda m, b=b: m(*b) for b in batches]
    peaks = {}
    for on in (True, False):
        _, m = train_twins(lambda s: make(s, plan_memory=on), steps,
                           lambda: chainer.optimizers.MomentumSGD(0.1),
                           rtol=0, atol=0)
        (s,) = static_graph.cached(m)
        kernels = [getattr(op.fn, '__name__', '') for op in
                   s.forward.ops + s.backward.ops]
        source = s.entry.run_forward.source + s.entry.run_backward.source
        plan = s.memory_plan()
        if on:
            assert any('inplace' in k for k in kernels)
            assert '    del ' in source
            assert plan.arena_bytes < plan.total_bytes
        else:
            assert not any('inplace' in k or k == 'recompute'
                           for k in kernels), kernels
            assert '    del ' not in source
            assert plan.arena_bytes == plan.total_bytes
        gc.collect()
        tracemalloc.start()
        try:
            m.cleargrads()
            m(*batches[0]).backward()
            peaks[on] = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert peaks[True] < peaks[False], peaks
