"""NumPy kernels for Linear, its gradients, Sum and softmax_cross_entropy
(static_graph/lowering.py), and the replay node's own ``apply``: chosen
where they give Chainer's results bit for bit, and training stays define-
by-run's exactly."""
import numpy
import pytest

import chainer
import chainer.functions as F
import chainer.links as L
from chainer import function_node

from static_graph import nodes
from static_graph import static_graph
from tests.test_lowering import kernels
from tests.twins import twin_optimizers


class MLP(chainer.Chain):
    def __init__(self, dtype, nobias=False, class_weight=None):
        super(MLP, self).__init__()
        self.class_weight = class_weight
        with self.init_scope(), chainer.using_config('dtype', dtype):
            self.l1 = L.Linear(6, 5, initialW=chainer.initializers.Normal(
                0.5, dtype), initial_bias=0.1, nobias=nobias)
            self.l2 = L.Linear(5, 4, initialW=chainer.initializers.Normal(
                0.5, dtype))

    def forward(self, x, t):
        h = F.relu(self.l1(x))
        return F.softmax_cross_entropy(self.l2(h), t,
                                       class_weight=self.class_weight)


StaticMLP = type('StaticMLP', (MLP,), {'forward': static_graph(MLP.forward)})


def train_twins(dtype, labels, nobias=False, class_weight=None, x_of=None):
    """Train an MLP and its static twin with SGD on the given label
    batches; every loss, gradient and parameter must agree bit for bit."""
    rs = numpy.random.RandomState(3)
    a = MLP(dtype, nobias, class_weight)
    b = StaticMLP(dtype, nobias, class_weight)
    b.copyparams(a)
    opts = twin_optimizers((a, b), lambda: chainer.optimizers.SGD(lr=0.1))
    for t in labels:
        x = rs.standard_normal((len(t), 6)).astype(dtype)
        if x_of is not None:
            x = x_of(x)
        losses = []
        for m, o in zip((a, b), opts):
            m.cleargrads()
            loss = m(x, t)
            loss.backward()
            losses.append(loss.array.tobytes())
            o.update()
        assert losses[0] == losses[1]
        for (n, p), (_, q) in zip(sorted(a.namedparams()),
                                  sorted(b.namedparams())):
            assert p.array.tobytes() == q.array.tobytes(), n
    return b


LABELS = [numpy.array(t, numpy.int32) for t in (
    [0, 3, 1], [2, -1, 3], [-1, -1, -1], [1, 1, 0], [3, 2, -1], [0, 1, 2])]


@pytest.mark.parametrize('dtype', [numpy.float16, numpy.float32,
                                   numpy.float64])
@pytest.mark.parametrize('nobias', [False, True])
def test_linear_and_loss_kernels_train_bit_for_bit(dtype, nobias):
    b = train_twins(dtype, LABELS, nobias)
    used = kernels(b)
    names = [n for _, n in used]
    assert names.count('numpy_LinearFunction') == 2, used
    assert names.count('numpy_LinearGradWeight') == 2, used
    assert names.count('numpy_LinearGradData') == 1, used
    assert names.count('numpy_Sum') == (1 if nobias else 2), used
    assert dict(used)['SoftmaxCrossEntropy'] == \
        'numpy_SoftmaxCrossEntropy', used


def test_loss_kernel_checked_on_a_call_without_valid_labels():
    """The first replay (where the kernel is checked) ignores every label:
    the loss's normalising coefficient is then a Python float, not a NumPy
    one, and still compared exactly."""
    labels = [LABELS[0], LABELS[2]] + LABELS[3:]
    b = train_twins(numpy.float32, labels)
    assert dict(kernels(b))['SoftmaxCrossEntropy'] == \
        'numpy_SoftmaxCrossEntropy'


def test_weighted_loss_keeps_chainers_kernel():
    w = numpy.array([1, 2, 0.5, 1], numpy.float32)
    b = train_twins(numpy.float32, LABELS, class_weight=w)
    assert dict(kernels(b))['SoftmaxCrossEntropy'] == 'kernel'


def test_strided_input_with_a_unit_axis_keeps_chainers_kernel():
    """Chainer copies such an input before its dot (chainer issue 2744);
    the NumPy kernel is not offered there."""
    def strided(x):
        return numpy.repeat(x, 2, axis=1)[:, ::2]
    labels = [numpy.array([t[0]], numpy.int32) for t in LABELS]
    b = train_twins(numpy.float32, labels, x_of=strided)
    used = kernels(b)
    assert used[0] == ('LinearFunction', 'kernel'), used


# -- the replay node's apply ----------------------------------------------------
def _replay_once(model, x, t):
    out = model(x, t)
    return out, out.creator


def _node_state(node, out):
    return dict(
        rank=node.rank, inputs=node.inputs, outputs=[r() for r in
                                                     node.outputs],
        output_count=node._output_count, lazy=node.lazy_grad_sum,
        in_layouts=node._input_layouts, out_layouts=node._output_layouts,
        retain=(node._input_indexes_to_retain,
                node._output_indexes_to_retain),
        requires_grad=out.requires_grad, creator=out.creator_node is node,
        output_node=out.node)


def test_replay_apply_leaves_what_function_node_apply_leaves(monkeypatch):
    rs = numpy.random.RandomState(0)
    m = StaticMLP(numpy.float32)
    x = rs.standard_normal((3, 6)).astype('f')
    t = LABELS[0]
    for _ in range(3):
        m.cleargrads()
        m(x, t).backward()
    states = []

    def chainers(node, inputs):
        # (Chainer's apply, then the define-by-run rank of the method's
        # last node: nodes.deepen)
        return nodes.deepen(node, function_node.FunctionNode.apply(
            node, inputs), node.entry.rank_depth)
    for apply in (nodes.ReplayNode.apply, chainers):
        monkeypatch.setattr(nodes.ReplayNode, 'apply', apply)
        m.cleargrads()
        out, node = _replay_once(m, x, t)
        assert isinstance(node, nodes.ReplayNode)
        s = _node_state(node, out)
        # The same parameters' nodes, the output's own node.
        assert s.pop('inputs')[2:] == tuple(p.node for p in m.params())
        assert s.pop('outputs') == [s.pop('output_node')]
        states.append(s)
        out.backward()
        states[-1]['grads'] = [p.grad.tobytes() for p in m.params()]
    assert states[0] == states[1]


def test_replay_apply_takes_chainers_path_under_function_hooks():
    rs = numpy.random.RandomState(0)
    m = StaticMLP(numpy.float32)
    x = rs.standard_normal((3, 6)).astype('f')
    for _ in range(3):
        m.cleargrads()
        m(x, LABELS[0]).backward()
    seen = []

    class Hook(chainer.FunctionHook):
        name = 'seen'

        def forward_preprocess(self, function, in_data):
            seen.append(function.label)

    m.cleargrads()
    with Hook():
        m(x, LABELS[0]).backward()
    assert seen == ['StaticGraph(forward)']


def test_replay_outputs_have_no_graph_without_backprop():
    rs = numpy.random.RandomState(0)
    a, b = MLP(numpy.float32), StaticMLP(numpy.float32)
    b.copyparams(a)
    x = rs.standard_normal((3, 6)).astype('f')
    with chainer.no_backprop_mode():
        for _ in range(3):
            outs = [m(x, LABELS[0]) for m in (a, b)]
    assert [(o.creator, o.requires_grad) for o in outs] == [(None, True)] * 2
    assert outs[0].array.tobytes() == outs[1].array.tobytes()
