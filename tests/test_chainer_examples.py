"""Chainer 7's VAE and DCGAN examples, their models decorated as shipped
(``@static_graph`` on every forward), trained side by side with the same
models define-by-run: bit for bit equal. Sizes are CPU-sized; the
structure is the examples' (the VAE's encoder returns a
``chainer.distributions.Normal``, its decoder a ``Bernoulli``; the DCGAN
updater backpropagates two losses through the discriminator's call on the
fake batch and the generator's call)."""
import warnings

import numpy

import chainer
import chainer.functions as F
import chainer.links as L

from benchmarks.kit.vae import AvgELBOLoss, Decoder, Encoder, Prior
from static_graph import static_graph
from static_graph import StaticGraphWarning, cached
from static_graph.decorator import caches_of


def both_ways(cls):
    """(define-by-run class, the class with ``forward`` decorated)."""
    return cls, type('Static' + cls.__name__, (cls,),
                     {'forward': static_graph(cls.forward)})


def same_params(a, b, what):
    for (n, p), (_, q) in zip(sorted(a.namedparams()),
                              sorted(b.namedparams())):
        numpy.testing.assert_array_equal(p.array, q.array,
                                         err_msg='%s %s' % (what, n))


# -- the VAE example (examples/vae/net.py; its models are the kit's) -------
def test_vae_example():
    models = []
    for static in (False, True):
        enc, dec, pri = (both_ways(c)[static]
                         for c in (Encoder, Decoder, Prior))
        numpy.random.seed(0)
        m = AvgELBOLoss(enc(16, 2, 8), dec(16, 2, 8), pri(2))
        o = chainer.optimizers.Adam()
        o.setup(m)
        models.append((m, o))
    rs = numpy.random.RandomState(0)
    for i in range(8):
        x = (rs.rand(5, 16) > 0.5).astype('f')
        losses = []
        for m, o in models:
            numpy.random.seed(i)      # q_z.sample draws from it
            o.update(m, x)
            with chainer.no_backprop_mode():   # the example's evaluation
                q = m.encoder(x)
                rec = m.decoder(q.mean, inference=True).mean
            losses.append((m.encoder(x).loc.array, q.scale.array, rec.array))
        for u, v in zip(*losses):
            numpy.testing.assert_array_equal(u, v)
        same_params(models[0][0], models[1][0], 'step %d' % i)
    static = models[1][0]
    for link in (static.encoder, static.decoder, static.prior):
        for cache in caches_of(link).values():
            assert cache.replays > 0 and cache.fallback_calls == 0


# -- the DCGAN example (examples/dcgan/net.py and updater.py) --------------
def add_noise(h, sigma=0.2):
    xp = chainer.backend.get_array_module(h.data)
    if chainer.config.train:
        return h + sigma * xp.random.randn(*h.shape)
    return h


class Generator(chainer.Chain):
    def __init__(self, n_hidden, bottom_width=2, ch=16, wscale=0.02):
        super(Generator, self).__init__()
        self.n_hidden, self.ch, self.bottom_width = n_hidden, ch, bottom_width
        with self.init_scope():
            w = chainer.initializers.Normal(wscale)
            self.l0 = L.Linear(n_hidden, bottom_width * bottom_width * ch,
                               initialW=w)
            self.dc1 = L.Deconvolution2D(ch, ch // 2, 4, 2, 1, initialW=w)
            self.dc2 = L.Deconvolution2D(ch // 2, ch // 4, 4, 2, 1,
                                         initialW=w)
            self.dc3 = L.Deconvolution2D(ch // 4, ch // 8, 4, 2, 1,
                                         initialW=w)
            self.dc4 = L.Deconvolution2D(ch // 8, 3, 3, 1, 1, initialW=w)
            self.bn0 = L.BatchNormalization(bottom_width * bottom_width * ch)
            self.bn1 = L.BatchNormalization(ch // 2)
            self.bn2 = L.BatchNormalization(ch // 4)
            self.bn3 = L.BatchNormalization(ch // 8)

    def make_hidden(self, batchsize):
        return numpy.random.uniform(-1, 1, (batchsize, self.n_hidden, 1, 1)) \
            .astype(numpy.float32)

    def forward(self, z):
        h = F.reshape(F.relu(self.bn0(self.l0(z))),
                      (len(z), self.ch, self.bottom_width, self.bottom_width))
        h = F.relu(self.bn1(self.dc1(h)))
        h = F.relu(self.bn2(self.dc2(h)))
        h = F.relu(self.bn3(self.dc3(h)))
        return F.sigmoid(self.dc4(h))


class Discriminator(chainer.Chain):
    def __init__(self, bottom_width=2, ch=16, wscale=0.02):
        super(Discriminator, self).__init__()
        w = chainer.initializers.Normal(wscale)
        with self.init_scope():
            self.c0_0 = L.Convolution2D(3, ch // 8, 3, 1, 1, initialW=w)
            self.c0_1 = L.Convolution2D(ch // 8, ch // 4, 4, 2, 1, initialW=w)
            self.c1_0 = L.Convolution2D(ch // 4, ch // 4, 3, 1, 1, initialW=w)
            self.c1_1 = L.Convolution2D(ch // 4, ch // 2, 4, 2, 1, initialW=w)
            self.c2_0 = L.Convolution2D(ch // 2, ch // 2, 3, 1, 1, initialW=w)
            self.c2_1 = L.Convolution2D(ch // 2, ch, 4, 2, 1, initialW=w)
            self.l4 = L.Linear(bottom_width * bottom_width * ch, 1,
                               initialW=w)
            self.bn0_1 = L.BatchNormalization(ch // 4, use_gamma=False)
            self.bn1_0 = L.BatchNormalization(ch // 4, use_gamma=False)
            self.bn1_1 = L.BatchNormalization(ch // 2, use_gamma=False)
            self.bn2_0 = L.BatchNormalization(ch // 2, use_gamma=False)
            self.bn2_1 = L.BatchNormalization(ch, use_gamma=False)

    def forward(self, x):
        h = add_noise(x)
        h = F.leaky_relu(add_noise(self.c0_0(h)))
        h = F.leaky_relu(add_noise(self.bn0_1(self.c0_1(h))))
        h = F.leaky_relu(add_noise(self.bn1_0(self.c1_0(h))))
        h = F.leaky_relu(add_noise(self.bn1_1(self.c1_1(h))))
        h = F.leaky_relu(add_noise(self.bn2_0(self.c2_0(h))))
        h = F.leaky_relu(add_noise(self.bn2_1(self.c2_1(h))))
        return self.l4(h)


def loss_dis(dis, y_fake, y_real):
    n = len(y_fake)
    return F.sum(F.softplus(-y_real)) / n + F.sum(F.softplus(y_fake)) / n


def loss_gen(gen, y_fake):
    return F.sum(F.softplus(-y_fake)) / len(y_fake)


def dcgan_step(gen, dis, go, do, batch):
    x_real = chainer.Variable(batch) / 255.
    y_real = dis(x_real)
    z = chainer.Variable(numpy.asarray(gen.make_hidden(len(batch))))
    x_fake = gen(z)
    y_fake = dis(x_fake)
    do.update(loss_dis, dis, y_fake, y_real)
    go.update(loss_gen, gen, y_fake)


def test_dcgan_example():
    """Both networks replay, bit for bit: the discriminator draws its
    noise from NumPy's global generator inside its forward (add_noise),
    and that draw and the NumPy arithmetic on it are ops of its schedule
    (numpy_calls.py), drawn again at every replay in define-by-run's
    order."""
    twins = []
    for static in (False, True):
        gen_cls, dis_cls = (both_ways(c)[static]
                            for c in (Generator, Discriminator))
        numpy.random.seed(0)
        gen, dis = gen_cls(4), dis_cls()
        opts = []
        for m in (gen, dis):
            o = chainer.optimizers.Adam(alpha=0.0002, beta1=0.5)
            o.setup(m)
            o.add_hook(chainer.optimizer_hooks.WeightDecay(0.0001))
            opts.append(o)
        twins.append((gen, dis, opts))
    rs = numpy.random.RandomState(0)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        for i in range(6):
            batch = rs.randint(0, 256, (4, 3, 16, 16)).astype('f')
            for gen, dis, (go, do) in twins:
                numpy.random.seed(100 + i)
                dcgan_step(gen, dis, go, do, batch)
            same_params(twins[0][0], twins[1][0], 'generator, step %d' % i)
            same_params(twins[0][1], twins[1][1], 'discriminator, step %d'
                        % i)
    gen, dis = twins[1][0], twins[1][1]
    (gc,) = caches_of(gen).values()
    assert gc.replays == 5 and gc.fallback_calls == 0
    (dc,) = caches_of(dis).values()
    assert dc.replays == 10 and dc.fallback_calls == 0
    assert not [x for x in w if issubclass(x.category, StaticGraphWarning)]
    (s,) = cached(dis)
    calls = [op.attrs.get('call') for op in s.forward.ops
             if op.kind == 'NumpyCall']
    assert calls.count('numpy.random.randn') == calls.count('multiply') \
        >= 1, calls
