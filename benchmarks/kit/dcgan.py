"""examples/dcgan: ``net.py``'s generator (linear, deconvolutions with
batch normalization) and discriminator (convolutions with batch
normalization and Gaussian noise added to every layer's input by
``add_noise``, drawn from NumPy's global generator), and ``updater.py``'s
step: the discriminator on the real and the generated batch, then
``dis_optimizer.update(loss_dis, ...)`` and ``gen_optimizer.update(loss_gen,
...)``: two losses backpropagated through the one call of the
discriminator on the generated batch. Adam (alpha 2e-4, beta1 0.5) with
weight decay 1e-4 on both; synthetic 32x32 images."""
import numpy

import chainer
import chainer.functions as F
import chainer.links as L
from chainer import Variable

from benchmarks.kit import common


def add_noise(device, h, sigma=0.2):
    if chainer.config.train:
        # (the example's ChainerX branch left out: the kit runs NumPy)
        randn = device.xp.random.randn(*h.shape)
        return h + sigma * randn
    else:
        return h


class Generator(chainer.Chain):

    def __init__(self, n_hidden, bottom_width=4, ch=512, wscale=0.02):
        super(Generator, self).__init__()
        self.n_hidden = n_hidden
        self.ch = ch
        self.bottom_width = bottom_width

        with self.init_scope():
            w = chainer.initializers.Normal(wscale)
            self.l0 = L.Linear(self.n_hidden, bottom_width * bottom_width * ch,
                               initialW=w)
            self.dc1 = L.Deconvolution2D(ch, ch // 2, 4, 2, 1, initialW=w)
            self.dc2 = L.Deconvolution2D(ch // 2, ch // 4, 4, 2, 1, initialW=w)
            self.dc3 = L.Deconvolution2D(ch // 4, ch // 8, 4, 2, 1, initialW=w)
            self.dc4 = L.Deconvolution2D(ch // 8, 3, 3, 1, 1, initialW=w)
            self.bn0 = L.BatchNormalization(bottom_width * bottom_width * ch)
            self.bn1 = L.BatchNormalization(ch // 2)
            self.bn2 = L.BatchNormalization(ch // 4)
            self.bn3 = L.BatchNormalization(ch // 8)

    def make_hidden(self, batchsize):
        dtype = chainer.get_dtype()
        return numpy.random.uniform(-1, 1, (batchsize, self.n_hidden, 1, 1))\
            .astype(dtype)

    def forward(self, z):
        h = F.reshape(F.relu(self.bn0(self.l0(z))),
                      (len(z), self.ch, self.bottom_width, self.bottom_width))
        h = F.relu(self.bn1(self.dc1(h)))
        h = F.relu(self.bn2(self.dc2(h)))
        h = F.relu(self.bn3(self.dc3(h)))
        x = F.sigmoid(self.dc4(h))
        return x


class Discriminator(chainer.Chain):

    def __init__(self, bottom_width=4, ch=512, wscale=0.02):
        w = chainer.initializers.Normal(wscale)
        super(Discriminator, self).__init__()
        with self.init_scope():
            self.c0_0 = L.Convolution2D(3, ch // 8, 3, 1, 1, initialW=w)
            self.c0_1 = L.Convolution2D(ch // 8, ch // 4, 4, 2, 1, initialW=w)
            self.c1_0 = L.Convolution2D(ch // 4, ch // 4, 3, 1, 1, initialW=w)
            self.c1_1 = L.Convolution2D(ch // 4, ch // 2, 4, 2, 1, initialW=w)
            self.c2_0 = L.Convolution2D(ch // 2, ch // 2, 3, 1, 1, initialW=w)
            self.c2_1 = L.Convolution2D(ch // 2, ch // 1, 4, 2, 1, initialW=w)
            self.c3_0 = L.Convolution2D(ch // 1, ch // 1, 3, 1, 1, initialW=w)
            self.l4 = L.Linear(bottom_width * bottom_width * ch, 1, initialW=w)
            self.bn0_1 = L.BatchNormalization(ch // 4, use_gamma=False)
            self.bn1_0 = L.BatchNormalization(ch // 4, use_gamma=False)
            self.bn1_1 = L.BatchNormalization(ch // 2, use_gamma=False)
            self.bn2_0 = L.BatchNormalization(ch // 2, use_gamma=False)
            self.bn2_1 = L.BatchNormalization(ch // 1, use_gamma=False)
            self.bn3_0 = L.BatchNormalization(ch // 1, use_gamma=False)

    def forward(self, x):
        device = self.device
        h = add_noise(device, x)
        h = F.leaky_relu(add_noise(device, self.c0_0(h)))
        h = F.leaky_relu(add_noise(device, self.bn0_1(self.c0_1(h))))
        h = F.leaky_relu(add_noise(device, self.bn1_0(self.c1_0(h))))
        h = F.leaky_relu(add_noise(device, self.bn1_1(self.c1_1(h))))
        h = F.leaky_relu(add_noise(device, self.bn2_0(self.c2_0(h))))
        h = F.leaky_relu(add_noise(device, self.bn2_1(self.c2_1(h))))
        h = F.leaky_relu(add_noise(device, self.bn3_0(self.c3_0(h))))
        return self.l4(h)


class GAN(chainer.Chain):
    """Holds both networks, so that the kit compares all their
    parameters; not part of the example."""

    def __init__(self, gen, dis):
        super(GAN, self).__init__()
        with self.init_scope():
            self.gen = gen
            self.dis = dis


def loss_dis(dis, y_fake, y_real):
    batchsize = len(y_fake)
    L1 = F.sum(F.softplus(-y_real)) / batchsize
    L2 = F.sum(F.softplus(y_fake)) / batchsize
    loss = L1 + L2
    chainer.report({'loss': loss}, dis)
    return loss


def loss_gen(gen, y_fake):
    batchsize = len(y_fake)
    loss = F.sum(F.softplus(-y_fake)) / batchsize
    chainer.report({'loss': loss}, gen)
    return loss


def make_case(n_hidden=100, ch=64, batch=16, steps=12):
    def model(static):
        return GAN(common.pick(Generator, static)(n_hidden, ch=ch),
                   common.pick(Discriminator, static)(ch=ch))

    def optimizers(model):
        out = []
        for net in (model.gen, model.dis):
            out.append(common.optimizer_with(
                chainer.optimizers.Adam(alpha=0.0002, beta1=0.5), net,
                chainer.optimizer_hooks.WeightDecay(0.0001)))
        return out

    def batches(rs, n):
        return [rs.randint(0, 256, (batch, 3, 32, 32)).astype(numpy.float32)
                for _ in range(n)]

    def step(model, opts, batch):
        gen_optimizer, dis_optimizer = opts
        gen, dis = model.gen, model.dis
        x_real = Variable(batch) / 255.
        batchsize = len(batch)
        y_real = dis(x_real)
        z = Variable(numpy.asarray(gen.make_hidden(batchsize)))
        x_fake = gen(z)
        y_fake = dis(x_fake)
        kept = []

        def keep(fn):
            def lossfun(*args):
                loss = fn(*args)
                kept.append(loss.array.copy())
                return loss
            return lossfun
        dis_optimizer.update(keep(loss_dis), dis, y_fake, y_real)
        gen_optimizer.update(keep(loss_gen), gen, y_fake)
        return numpy.array(kept)

    return common.Case(
        'dcgan', 'dcgan', 'Generator.forward, Discriminator.forward',
        'DCGAN 32x32, ch %d, n_hidden %d, batch %d, two optimizers, two '
        'losses through one call' % (ch, n_hidden, batch),
        model, optimizers, batches, step, steps=steps, warmup=3,
        targets=('all',), shapes='fixed')
