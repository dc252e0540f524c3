"""examples/mnist: ``train_mnist_custom_loop.py``, the loop written out
instead of a Trainer: ``models.MLP`` (three linear layers, ReLU) inside
``L.Classifier``, Adam, ``optimizer.update(model, x, t)`` per batch, and at
each epoch's end an evaluation over the test set under
``using_config('train', False)`` with backprop still enabled, ``loss =
model(x, t)`` summed through ``float(loss.data)`` and
``model.accuracy.data``: calls whose outputs never get a backward. On
synthetic 784-pixel digits; one step of the kit is one epoch of the small
training set and its evaluation."""
import numpy

import chainer
import chainer.functions as F
import chainer.links as L

from benchmarks.kit import common


class MLP(chainer.Chain):

    def __init__(self, n_units, n_out):
        super(MLP, self).__init__()
        with self.init_scope():
            # the size of the inputs to each layer will be inferred
            self.l1 = L.Linear(None, n_units)  # n_in -> n_units
            self.l2 = L.Linear(None, n_units)  # n_units -> n_units
            self.l3 = L.Linear(None, n_out)  # n_units -> n_out

    def forward(self, x):
        h1 = F.relu(self.l1(x))
        h2 = F.relu(self.l2(h1))
        return self.l3(h2)


def make_case(n_units=100, batch=100, train_batches=4, test_batches=4,
              steps=12):
    def model(static):
        m = L.Classifier(common.pick(MLP, static)(n_units, 10))
        m(numpy.zeros((1, 784), numpy.float32),
          numpy.zeros(1, numpy.int32))   # the lazy layers' weights
        return m

    def optimizers(model):
        return [common.optimizer_with(chainer.optimizers.Adam(), model)]

    def digits(rs, n):
        # Ten blurred prototypes and noise: classes a model can learn.
        proto = numpy.random.RandomState(7).rand(10, 784)
        t = rs.randint(0, 10, n).astype(numpy.int32)
        x = (proto[t] + 0.5 * rs.rand(n, 784)).astype(numpy.float32)
        return x, t

    def batches(rs, n):
        return [([digits(rs, batch) for _ in range(train_batches)],
                 [digits(rs, batch) for _ in range(test_batches)])
                for _ in range(n)]

    def step(model, opts, epoch):
        opt, = opts
        train, test = epoch
        for x, t in train:
            opt.update(model, chainer.Variable(x), chainer.Variable(t))
        sum_loss = sum_accuracy = 0.0
        with chainer.using_config('train', False):
            for x, t in test:
                loss = model(chainer.Variable(x), chainer.Variable(t))
                sum_loss += float(loss.data) * len(t)
                sum_accuracy += float(model.accuracy.data) * len(t)
        return numpy.array([sum_loss, sum_accuracy])

    return common.Case(
        'mnist-custom-loop', 'mnist', 'MLP.forward',
        'MLP 784-%d-%d-10, batch %d; a step: %d training batches, then %d '
        'test batches evaluated with backprop on'
        % (n_units, n_units, batch, train_batches, test_batches),
        model, optimizers, batches, step, steps=steps, warmup=3,
        targets=('all',), shapes='fixed')
