"""ImageNet-style networks whose ``forward`` is decorated ``@static_graph``.

Every model takes NCHW float32 images and returns logits (no softmax).  All
of them end with a pooling over whatever spatial size is left (or, for VGG16,
size their first fully-connected layer from ``insize``), so they work for
``insize`` from 224 down to 32 (handy for CPU tests).
"""
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import static_graph  # NOQA  (before chainer: Python 3.12+/NumPy 2)
import chainer  # NOQA
import chainer.functions as F  # NOQA
import chainer.links as L  # NOQA

from static_graph import static_graph  # NOQA


def _global_average_pooling(h):
    return F.mean(h, axis=(2, 3))


# --------------------------------------------------------------------------
# ResNet50
# --------------------------------------------------------------------------

class BottleNeck(chainer.Chain):
    """1x1 -> 3x3 -> 1x1 bottleneck with a projection or identity shortcut."""

    def __init__(self, in_ch, mid_ch, out_ch, stride=1,
                 zero_init_residual=True):
        super(BottleNeck, self).__init__()
        w = chainer.initializers.HeNormal()
        self.project = in_ch != out_ch or stride != 1
        with self.init_scope():
            self.conv1 = L.Convolution2D(in_ch, mid_ch, 1, 1, 0,
                                         initialW=w, nobias=True)
            self.bn1 = L.BatchNormalization(mid_ch)
            self.conv2 = L.Convolution2D(mid_ch, mid_ch, 3, stride, 1,
                                         initialW=w, nobias=True)
            self.bn2 = L.BatchNormalization(mid_ch)
            self.conv3 = L.Convolution2D(mid_ch, out_ch, 1, 1, 0,
                                         initialW=w, nobias=True)
            # gamma = 0 on the branch's last BN: each block starts as the
            # identity (Goyal et al., 2017), which trains much more stably.
            self.bn3 = L.BatchNormalization(
                out_ch, initial_gamma=0 if zero_init_residual else None)
            if self.project:
                self.conv4 = L.Convolution2D(in_ch, out_ch, 1, stride, 0,
                                             initialW=w, nobias=True)
                self.bn4 = L.BatchNormalization(out_ch)

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        h = F.relu(self.bn2(self.conv2(h)))
        h = self.bn3(self.conv3(h))
        shortcut = self.bn4(self.conv4(x)) if self.project else x
        return F.relu(h + shortcut)


class ResBlock(chainer.ChainList):

    def __init__(self, n_layers, in_ch, mid_ch, out_ch, stride,
                 zero_init_residual=True):
        super(ResBlock, self).__init__()
        z = zero_init_residual
        self.add_link(BottleNeck(in_ch, mid_ch, out_ch, stride, z))
        for _ in range(n_layers - 1):
            self.add_link(BottleNeck(out_ch, mid_ch, out_ch, 1, z))

    def forward(self, x):
        for f in self.children():
            x = f(x)
        return x


class ResNet50(chainer.Chain):
    """ResNet50 (v1.5: stride on the 3x3 convolution of each bottleneck).

    ``zero_init_residual=False`` gives the classic initialisation (every BN
    gamma = 1) instead of a zero gamma at the end of each residual branch.
    """

    def __init__(self, n_class=1000, insize=224, zero_init_residual=True):
        super(ResNet50, self).__init__()
        self.insize = insize
        with self.init_scope():
            self.conv1 = L.Convolution2D(
                3, 64, 7, 2, 3, initialW=chainer.initializers.HeNormal(),
                nobias=True)
            self.bn1 = L.BatchNormalization(64)
            z = zero_init_residual
            self.res2 = ResBlock(3, 64, 64, 256, 1, z)
            self.res3 = ResBlock(4, 256, 128, 512, 2, z)
            self.res4 = ResBlock(6, 512, 256, 1024, 2, z)
            self.res5 = ResBlock(3, 1024, 512, 2048, 2, z)
            self.fc = L.Linear(2048, n_class)

    @static_graph
    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        h = F.max_pooling_2d(h, 3, stride=2, pad=1)
        h = self.res2(h)
        h = self.res3(h)
        h = self.res4(h)
        h = self.res5(h)
        return self.fc(_global_average_pooling(h))


# --------------------------------------------------------------------------
# GoogLeNet (Inception v1, without the auxiliary classifiers)
# --------------------------------------------------------------------------

class GoogLeNet(chainer.Chain):

    def __init__(self, n_class=1000, insize=224):
        super(GoogLeNet, self).__init__()
        self.insize = insize
        with self.init_scope():
            self.conv1 = L.Convolution2D(3, 64, 7, stride=2, pad=3)
            self.conv2_reduce = L.Convolution2D(64, 64, 1)
            self.conv2 = L.Convolution2D(64, 192, 3, stride=1, pad=1)
            # L.Inception(in, out1, proj3, out3, proj5, out5, proj_pool)
            self.inc3a = L.Inception(192, 64, 96, 128, 16, 32, 32)
            self.inc3b = L.Inception(256, 128, 128, 192, 32, 96, 64)
            self.inc4a = L.Inception(480, 192, 96, 208, 16, 48, 64)
            self.inc4b = L.Inception(512, 160, 112, 224, 24, 64, 64)
            self.inc4c = L.Inception(512, 128, 128, 256, 24, 64, 64)
            self.inc4d = L.Inception(512, 112, 144, 288, 32, 64, 64)
            self.inc4e = L.Inception(528, 256, 160, 320, 32, 128, 128)
            self.inc5a = L.Inception(832, 256, 160, 320, 32, 128, 128)
            self.inc5b = L.Inception(832, 384, 192, 384, 48, 128, 128)
            self.loss3_fc = L.Linear(1024, n_class)

    @static_graph
    def forward(self, x):
        h = F.relu(self.conv1(x))
        h = F.local_response_normalization(
            F.max_pooling_2d(h, 3, stride=2), n=5)
        h = F.relu(self.conv2_reduce(h))
        h = F.relu(self.conv2(h))
        h = F.max_pooling_2d(
            F.local_response_normalization(h, n=5), 3, stride=2)
        h = self.inc3a(h)
        h = self.inc3b(h)
        h = F.max_pooling_2d(h, 3, stride=2)
        h = self.inc4a(h)
        h = self.inc4b(h)
        h = self.inc4c(h)
        h = self.inc4d(h)
        h = self.inc4e(h)
        h = F.max_pooling_2d(h, 3, stride=2)
        h = self.inc5a(h)
        h = self.inc5b(h)
        h = _global_average_pooling(h)
        h = F.dropout(h, 0.4)
        return self.loss3_fc(h)


# --------------------------------------------------------------------------
# VGG16
# --------------------------------------------------------------------------

class VGG16(chainer.Chain):
    """VGG16 (configuration D).

    ``fc6`` is sized from ``insize``: 7x7x512 inputs at 224, 1x1x512 at 32.
    """

    def __init__(self, n_class=1000, insize=224):
        super(VGG16, self).__init__()
        self.insize = insize
        spatial = max(insize // 32, 1)
        with self.init_scope():
            self.conv1_1 = L.Convolution2D(3, 64, 3, 1, 1)
            self.conv1_2 = L.Convolution2D(64, 64, 3, 1, 1)
            self.conv2_1 = L.Convolution2D(64, 128, 3, 1, 1)
            self.conv2_2 = L.Convolution2D(128, 128, 3, 1, 1)
            self.conv3_1 = L.Convolution2D(128, 256, 3, 1, 1)
            self.conv3_2 = L.Convolution2D(256, 256, 3, 1, 1)
            self.conv3_3 = L.Convolution2D(256, 256, 3, 1, 1)
            self.conv4_1 = L.Convolution2D(256, 512, 3, 1, 1)
            self.conv4_2 = L.Convolution2D(512, 512, 3, 1, 1)
            self.conv4_3 = L.Convolution2D(512, 512, 3, 1, 1)
            self.conv5_1 = L.Convolution2D(512, 512, 3, 1, 1)
            self.conv5_2 = L.Convolution2D(512, 512, 3, 1, 1)
            self.conv5_3 = L.Convolution2D(512, 512, 3, 1, 1)
            self.fc6 = L.Linear(512 * spatial * spatial, 4096)
            self.fc7 = L.Linear(4096, 4096)
            self.fc8 = L.Linear(4096, n_class)

    @static_graph
    def forward(self, x):
        h = F.relu(self.conv1_1(x))
        h = F.relu(self.conv1_2(h))
        h = F.max_pooling_2d(h, 2, stride=2)
        h = F.relu(self.conv2_1(h))
        h = F.relu(self.conv2_2(h))
        h = F.max_pooling_2d(h, 2, stride=2)
        h = F.relu(self.conv3_1(h))
        h = F.relu(self.conv3_2(h))
        h = F.relu(self.conv3_3(h))
        h = F.max_pooling_2d(h, 2, stride=2)
        h = F.relu(self.conv4_1(h))
        h = F.relu(self.conv4_2(h))
        h = F.relu(self.conv4_3(h))
        h = F.max_pooling_2d(h, 2, stride=2)
        h = F.relu(self.conv5_1(h))
        h = F.relu(self.conv5_2(h))
        h = F.relu(self.conv5_3(h))
        h = F.max_pooling_2d(h, 2, stride=2)
        h = F.dropout(F.relu(self.fc6(h)), 0.5)
        h = F.dropout(F.relu(self.fc7(h)), 0.5)
        return self.fc8(h)


# --------------------------------------------------------------------------
# MobileNetV2
# --------------------------------------------------------------------------

def _relu6(x):
    return F.clipped_relu(x, 6.)


class ConvBN(chainer.Chain):

    def __init__(self, in_ch, out_ch, ksize, stride=1, groups=1, act=True):
        super(ConvBN, self).__init__()
        self.act = act
        with self.init_scope():
            self.conv = L.Convolution2D(
                in_ch, out_ch, ksize, stride, ksize // 2, nobias=True,
                groups=groups, initialW=chainer.initializers.HeNormal())
            self.bn = L.BatchNormalization(out_ch)

    def forward(self, x):
        h = self.bn(self.conv(x))
        return _relu6(h) if self.act else h


class InvertedResidual(chainer.Chain):
    """Expand (1x1) -> depthwise 3x3 -> linear projection (1x1)."""

    def __init__(self, in_ch, out_ch, stride, expand_ratio):
        super(InvertedResidual, self).__init__()
        hidden = in_ch * expand_ratio
        self.use_residual = stride == 1 and in_ch == out_ch
        self.expand = expand_ratio != 1
        with self.init_scope():
            if self.expand:
                self.pw = ConvBN(in_ch, hidden, 1)
            self.dw = ConvBN(hidden, hidden, 3, stride, groups=hidden)
            self.pwl = ConvBN(hidden, out_ch, 1, act=False)

    def forward(self, x):
        h = self.pw(x) if self.expand else x
        h = self.pwl(self.dw(h))
        return x + h if self.use_residual else h


class MobileNetV2(chainer.Chain):

    # expansion t, output channels c, repeats n, first stride s
    settings = [(1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2),
                (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1)]

    def __init__(self, n_class=1000, insize=224):
        super(MobileNetV2, self).__init__()
        self.insize = insize
        with self.init_scope():
            self.stem = ConvBN(3, 32, 3, 2)
            self.blocks = chainer.ChainList()
            in_ch = 32
            for t, c, n, s in self.settings:
                for i in range(n):
                    self.blocks.add_link(
                        InvertedResidual(in_ch, c, s if i == 0 else 1, t))
                    in_ch = c
            self.head = ConvBN(in_ch, 1280, 1)
            self.fc = L.Linear(1280, n_class)

    @static_graph
    def forward(self, x):
        h = self.stem(x)
        for block in self.blocks:
            h = block(h)
        h = self.head(h)
        h = _global_average_pooling(h)
        h = F.dropout(h, 0.2)
        return self.fc(h)


ARCHS = {
    'resnet50': ResNet50,
    'googlenet': GoogLeNet,
    'vgg16': VGG16,
    'mobilenetv2': MobileNetV2,
}
