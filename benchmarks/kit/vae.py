"""examples/vae: ``net.py``'s VAE of Chainer 7 (an MLP encoder returning a
``chainer.distributions.Normal``, a decoder returning a ``Bernoulli``, a
learned ``Normal`` prior, ``AvgELBOLoss`` sampling ``k`` latents through
``q_z.sample``), Adam, trained through ``optimizer.update(model, x)``, on
synthetic binary 28x28 images. Two ways to decorate it: each network's
``forward`` (``vae``), or the whole loss (``vae-loss``: one recording
with the sampling inside)."""
import numpy

import chainer
import chainer.distributions as D
import chainer.functions as F
import chainer.links as L

from benchmarks.kit import common


class Encoder(chainer.Chain):

    def __init__(self, n_in, n_latent, n_h):
        super(Encoder, self).__init__()
        with self.init_scope():
            self.linear = L.Linear(n_in, n_h)
            self.mu = L.Linear(n_h, n_latent)
            self.ln_sigma = L.Linear(n_h, n_latent)

    def forward(self, x):
        h = F.tanh(self.linear(x))
        mu = self.mu(h)
        ln_sigma = self.ln_sigma(h)  # log(sigma)
        return D.Normal(loc=mu, log_scale=ln_sigma)


class Decoder(chainer.Chain):

    def __init__(self, n_in, n_latent, n_h, binary_check=False):
        super(Decoder, self).__init__()
        self.binary_check = binary_check
        with self.init_scope():
            self.linear = L.Linear(n_latent, n_h)
            self.output = L.Linear(n_h, n_in)

    def forward(self, z, inference=False):
        n_batch_axes = 1 if inference else 2
        h = F.tanh(self.linear(z, n_batch_axes=n_batch_axes))
        h = self.output(h, n_batch_axes=n_batch_axes)
        return D.Bernoulli(logit=h, binary_check=self.binary_check)


class Prior(chainer.Link):

    def __init__(self, n_latent):
        super(Prior, self).__init__()
        self.loc = numpy.zeros(n_latent, numpy.float32)
        self.scale = numpy.ones(n_latent, numpy.float32)
        self.register_persistent('loc')
        self.register_persistent('scale')

    def forward(self):
        return D.Normal(self.loc, scale=self.scale)


class AvgELBOLoss(chainer.Chain):

    def __init__(self, encoder, decoder, prior, beta=1.0, k=1):
        super(AvgELBOLoss, self).__init__()
        self.beta = beta
        self.k = k
        with self.init_scope():
            self.encoder = encoder
            self.decoder = decoder
            self.prior = prior

    def forward(self, x):
        q_z = self.encoder(x)
        z = q_z.sample(self.k)
        p_x = self.decoder(z)
        p_z = self.prior()

        reconstr = F.mean(F.sum(p_x.log_prob(
            F.broadcast_to(x[None, :], (self.k,) + x.shape)), axis=-1))
        kl_penalty = F.mean(F.sum(chainer.kl_divergence(q_z, p_z), axis=-1))
        loss = - (reconstr - self.beta * kl_penalty)
        chainer.report({'loss': loss}, self)
        chainer.report({'reconstr': reconstr}, self)
        chainer.report({'kl_penalty': kl_penalty}, self)
        return loss


def make_case(whole_loss=False, n_in=784, n_latent=20, n_h=500, batch=100,
              k=1, steps=12):
    def model(static):
        parts = static and not whole_loss
        enc = common.pick(Encoder, parts)(n_in, n_latent, n_h)
        dec = common.pick(Decoder, parts)(n_in, n_latent, n_h)
        pri = common.pick(Prior, parts)(n_latent)
        return common.pick(AvgELBOLoss, static and whole_loss)(
            enc, dec, pri, k=k)

    def optimizers(model):
        return [common.optimizer_with(chainer.optimizers.Adam(), model)]

    def batches(rs, n):
        # Blobs, binarized: images with some structure.
        out = []
        yy, xx = numpy.mgrid[:28, :28]
        for _ in range(n):
            cy = rs.uniform(6, 22, (batch, 1, 1))
            cx = rs.uniform(6, 22, (batch, 1, 1))
            r = rs.uniform(3, 8, (batch, 1, 1))
            img = ((yy - cy) ** 2 + (xx - cx) ** 2 < r ** 2)
            noise = rs.rand(batch, 28, 28) < 0.02
            out.append((img ^ noise).reshape(batch, n_in).astype(
                numpy.float32))
        return out

    def step(model, opts, batch):
        opt, = opts
        kept = []

        def lossfun(x):
            loss = model(x)
            kept.append(loss)
            return loss
        opt.update(lossfun, batch)
        return kept[0].array

    if whole_loss:
        name, decorated = 'vae-loss', 'AvgELBOLoss.forward'
    else:
        name = 'vae'
        decorated = 'Encoder.forward, Decoder.forward, Prior.forward'
    return common.Case(
        name, 'vae', decorated,
        'MLP VAE %d-%d-%d, Bernoulli decoder, k=%d, batch %d'
        % (n_in, n_h, n_latent, k, batch),
        model, optimizers, batches, step, steps=steps, warmup=3,
        targets=('all',), shapes='fixed')
