"""Cheaper CPU kernels (static_graph/lowering.py): used where they give the
recorded outputs bit for bit, and replay stays identical to define-by-run."""
import numpy
import pytest

import chainer
import chainer.functions as F

from static_graph import static_graph
from static_graph.decorator import caches_of


class Net(chainer.Chain):
    def __init__(self, dtype):
        super(Net, self).__init__()
        with self.init_scope():
            self.p = chainer.Parameter(numpy.full((3, 4), 0.5, dtype))

    def forward(self, x, y):
        h = F.tanh(x * self.p) * 0.9 + y     # Mul, Tanh, MulConstant, Add
        h = h + 0.25                          # AddConstant
        return F.sum(F.tanh(h) * h)


Static = type('Static', (Net,), {'forward': static_graph(Net.forward)})


def kernels(chain):
    (cache,) = caches_of(chain).values()
    (entry,) = cache.entries.values()
    return [(op.kind, getattr(op.fn, '__name__', None))
            for s in (entry.forward, entry.backward) for op in s.ops]


@pytest.mark.parametrize('dtype', [numpy.float16, numpy.float32,
                                   numpy.float64])
def test_fast_kernels_replay_bit_for_bit(dtype):
    rs = numpy.random.RandomState(0)
    a, b = Net(dtype), Static(dtype)
    for i in range(4):
        x = rs.standard_normal((3, 4)).astype(dtype)
        y = rs.standard_normal((3, 4)).astype(dtype)
        for m in (a, b):
            m.cleargrads()
            m(x, y).backward()
        numpy.testing.assert_array_equal(a.p.grad, b.p.grad)
    used = dict(kernels(b))
    for kind in ('Tanh', 'TanhGrad', 'Mul', 'MulConstant', 'Add',
                 'AddConstant'):
        assert used[kind] == 'numpy_' + kind, used


def test_zero_dim_results_keep_the_node_kernel():
    """A 0-d result of NumPy arithmetic is a NumPy scalar, not an array:
    such ops keep the node's own kernel, and replay gives arrays."""
    class Sc(chainer.Chain):
        def __init__(self):
            super(Sc, self).__init__()
            with self.init_scope():
                self.p = chainer.Parameter(numpy.ones(4, numpy.float32))

        @static_graph
        def forward(self, x):
            s = F.sum(x * self.p)
            return s + s * 2.0 + F.sum(x + self.p)

    m = Sc()
    rs = numpy.random.RandomState(1)
    for i in range(3):
        m.cleargrads()
        x = rs.standard_normal((2, 4)).astype(numpy.float32)
        loss = m(x)
        assert type(loss.array) is numpy.ndarray
        loss.backward()
        with chainer.using_config('use_static_graph', False):
            ref = Sc()
            ref.p.array[...] = m.p.array
            want = ref(x)
        assert loss.array == want.array
    # s * 2.0 (and its backward) are 0-d: the node's own kernel.
    zero_dim = [name for kind, name in kernels(m) if kind == 'MulConstant']
    assert zero_dim and all(not n.startswith('numpy_') for n in zero_dim)
