"""examples/cifar: ``models/VGG.py``'s VGG for 32x32 images (13
convolution-batch normalization-ReLU blocks in five stages with dropout
between them and max pooling after each, then dropout, a linear layer with
batch normalization, dropout and the classifier; the convolutions'
input sizes inferred at the first call, as the example's ``None`` does)
with its channels divided by ``width``, inside ``L.Classifier``,
MomentumSGD (lr 0.05) with weight decay 5e-4, trained through
``optimizer.update(model, x, t)``; synthetic images."""
import numpy

import chainer
import chainer.functions as F
import chainer.links as L

from benchmarks.kit import common


class Block(chainer.Chain):

    def __init__(self, out_channels, ksize, pad=1):
        super(Block, self).__init__()
        with self.init_scope():
            self.conv = L.Convolution2D(None, out_channels, ksize, pad=pad,
                                        nobias=True)
            self.bn = L.BatchNormalization(out_channels)

    def forward(self, x):
        h = self.conv(x)
        h = self.bn(h)
        return F.relu(h)


class VGG(chainer.Chain):

    def __init__(self, class_labels=10, width=8):
        super(VGG, self).__init__()
        c = [64 // width, 128 // width, 256 // width, 512 // width]
        with self.init_scope():
            self.block1_1 = Block(c[0], 3)
            self.block1_2 = Block(c[0], 3)
            self.block2_1 = Block(c[1], 3)
            self.block2_2 = Block(c[1], 3)
            self.block3_1 = Block(c[2], 3)
            self.block3_2 = Block(c[2], 3)
            self.block3_3 = Block(c[2], 3)
            self.block4_1 = Block(c[3], 3)
            self.block4_2 = Block(c[3], 3)
            self.block4_3 = Block(c[3], 3)
            self.block5_1 = Block(c[3], 3)
            self.block5_2 = Block(c[3], 3)
            self.block5_3 = Block(c[3], 3)
            self.fc1 = L.Linear(None, c[3], nobias=True)
            self.bn_fc1 = L.BatchNormalization(c[3])
            self.fc2 = L.Linear(None, class_labels, nobias=True)

    def forward(self, x):
        # 64 channel blocks:
        h = self.block1_1(x)
        h = F.dropout(h, ratio=0.3)
        h = self.block1_2(h)
        h = F.max_pooling_2d(h, ksize=2, stride=2)

        # 128 channel blocks:
        h = self.block2_1(h)
        h = F.dropout(h, ratio=0.4)
        h = self.block2_2(h)
        h = F.max_pooling_2d(h, ksize=2, stride=2)

        # 256 channel blocks:
        h = self.block3_1(h)
        h = F.dropout(h, ratio=0.4)
        h = self.block3_2(h)
        h = F.dropout(h, ratio=0.4)
        h = self.block3_3(h)
        h = F.max_pooling_2d(h, ksize=2, stride=2)

        # 512 channel blocks:
        h = self.block4_1(h)
        h = F.dropout(h, ratio=0.4)
        h = self.block4_2(h)
        h = F.dropout(h, ratio=0.4)
        h = self.block4_3(h)
        h = F.max_pooling_2d(h, ksize=2, stride=2)

        # 512 channel blocks:
        h = self.block5_1(h)
        h = F.dropout(h, ratio=0.4)
        h = self.block5_2(h)
        h = F.dropout(h, ratio=0.4)
        h = self.block5_3(h)
        h = F.max_pooling_2d(h, ksize=2, stride=2)

        h = F.dropout(h, ratio=0.5)
        h = self.fc1(h)
        h = self.bn_fc1(h)
        h = F.relu(h)
        h = F.dropout(h, ratio=0.5)
        return self.fc2(h)


def make_case(width=8, batch=32, n_class=10, steps=12):
    def model(static):
        return L.Classifier(common.pick(VGG, static)(n_class, width))

    def optimizers(model):
        return [common.optimizer_with(
            chainer.optimizers.MomentumSGD(0.05), model,
            chainer.optimizer_hooks.WeightDecay(5e-4))]

    def batches(rs, n):
        return [(rs.rand(batch, 3, 32, 32).astype(numpy.float32),
                 rs.randint(0, n_class, batch).astype(numpy.int32))
                for _ in range(n)]

    def step(model, opts, batch):
        opt, = opts
        opt.update(model, *batch)
        return model.loss.array

    return common.Case(
        'cifar-vgg', 'cifar', 'VGG.forward',
        'VGG (13 conv+BN blocks, dropout) with channels / %d, 32x32, '
        'batch %d' % (width, batch),
        model, optimizers, batches, step, steps=steps, warmup=3,
        targets=('all',), shapes='fixed')
