"""Benchmark models, each in three variants built from one body:

* ``dbr``: plain define-by-run,
* ``chainer``: Chainer's own ``chainer.static_graph`` decorator,
* ``ours``: this library's ``static_graph``.
"""
import contextlib
import io
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import static_graph  # NOQA  (before chainer: Python 3.12+/NumPy 2)
import numpy  # NOQA

import chainer  # NOQA
import chainer.functions as F  # NOQA
import chainer.links as L  # NOQA

from static_graph import static_graph  # NOQA
try:
    from chainer import static_graph as chainer_static_graph
except ImportError:   # older Chainer
    chainer_static_graph = None

VARIANTS = ('dbr', 'chainer', 'ours')


def variants(base):
    """{variant: class} with ``forward`` decorated per variant."""
    out = {'dbr': base}
    out['ours'] = type(base.__name__, (base,),
                       {'forward': static_graph(base.forward)})
    if chainer_static_graph is not None:
        out['chainer'] = type(base.__name__, (base,),
                              {'forward': chainer_static_graph(base.forward)})
    return out


@contextlib.contextmanager
def quiet():
    """chainer.static_graph prints to stdout; keep the report clean."""
    with contextlib.redirect_stdout(io.StringIO()):
        yield


class Tiny(chainer.Chain):
    """200 tiny element-wise ops on a (2, 3) array."""

    def __init__(self):
        super(Tiny, self).__init__()
        with self.init_scope():
            self.p = chainer.Parameter(numpy.ones((2, 3), 'f'))

    def forward(self, x):
        h = x * self.p
        for i in range(199):
            h = h * 0.999 + x if i % 2 else F.tanh(h)
        return F.sum(h)


class MLP(chainer.Chain):
    """784-1000-1000-10 with softmax cross-entropy inside."""

    def __init__(self, n_units=1000):
        super(MLP, self).__init__()
        with self.init_scope():
            self.l1 = L.Linear(784, n_units)
            self.l2 = L.Linear(n_units, n_units)
            self.l3 = L.Linear(n_units, 10)

    def forward(self, x, t):
        h = F.relu(self.l1(x))
        h = F.relu(self.l2(h))
        return F.softmax_cross_entropy(self.l3(h), t)


class CNN(chainer.Chain):
    """The small MNIST CNN of the examples (two conv + pool, two linear)."""

    def __init__(self):
        super(CNN, self).__init__()
        with self.init_scope():
            self.c1 = L.Convolution2D(1, 20, 5)
            self.c2 = L.Convolution2D(20, 50, 5)
            self.l1 = L.Linear(800, 500)
            self.l2 = L.Linear(500, 10)

    def forward(self, x, t):
        h = F.max_pooling_2d(F.relu(self.c1(x)), 2)
        h = F.max_pooling_2d(F.relu(self.c2(h)), 2)
        h = F.relu(self.l1(h))
        return F.softmax_cross_entropy(self.l2(h), t)


class MaskedMLP(chainer.Chain):
    """An MLP whose backward steps build their masks in Python (maxout
    units, a clipped layer): replay calls those steps' backward() again."""

    def __init__(self):
        super(MaskedMLP, self).__init__()
        with self.init_scope():
            self.l1 = L.Linear(784, 2 * 256)
            self.l2 = L.Linear(256, 256)
            self.l3 = L.Linear(256, 10)

    def forward(self, x, t):
        h = F.maxout(self.l1(x), 2)
        h = F.clip(self.l2(h), -1.0, 1.0)
        return F.softmax_cross_entropy(self.l3(h), t)


def mnist_batch(n, rs, image=False):
    shape = (n, 1, 28, 28) if image else (n, 784)
    return (rs.rand(*shape).astype(numpy.float32),
            rs.randint(0, 10, n).astype(numpy.int32))


class Classify(chainer.Chain):
    """Wraps an ImageNet-example architecture with its loss."""

    def __init__(self, arch, insize):
        super(Classify, self).__init__()
        with self.init_scope():
            self.net = arch()
        self.insize = insize

    def forward(self, x, t):
        return F.softmax_cross_entropy(self.net(x), t)


def imagenet_arch(name):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, os.path.join(root, 'examples', 'imagenet'))
    import models
    table = {'resnet50': 'ResNet50', 'googlenet': 'GoogLeNet',
             'vgg16': 'VGG16', 'mobilenetv2': 'MobileNetV2'}
    cls = getattr(models, table[name])
    # The examples decorate the architecture's forward; the benchmark
    # decorates (or not) the outer chain, so the inner one must be plain:
    # otherwise the define-by-run variant would replay too.
    return type(cls.__name__, (cls,),
                {'forward': getattr(cls.forward, '__wrapped__', cls.forward)})


def small_resnet():
    """A small ResNet for 32x32 images: a 3x3 stem and two stages of two
    bottleneck blocks (the examples' BottleNeck, with BatchNormalization)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, os.path.join(root, 'examples', 'imagenet'))
    import models

    class SmallResNet(chainer.Chain):
        def __init__(self, n_class=10):
            super(SmallResNet, self).__init__()
            with self.init_scope():
                self.conv1 = L.Convolution2D(3, 32, 3, 1, 1, nobias=True)
                self.bn1 = L.BatchNormalization(32)
                self.res2 = models.ResBlock(2, 32, 16, 64, 1)
                self.res3 = models.ResBlock(2, 64, 32, 128, 2)
                self.fc = L.Linear(128, n_class)

        def forward(self, x):
            h = F.relu(self.bn1(self.conv1(x)))
            h = self.res3(self.res2(h))
            return self.fc(F.average(h, axis=(2, 3)))

    return SmallResNet
