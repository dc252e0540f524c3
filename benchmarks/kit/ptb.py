"""examples/ptb: a 2-layer LSTM language model trained with truncated
backpropagation through time (``train_ptb.py``'s ``RNNForLM`` inside
``L.Classifier``, SGD lr=1 with gradient clipping at 5; the loss of
``bproplen`` calls summed, then ``backward()``, ``unchain_backward()``,
``update()``), on a synthetic corpus read by the example's parallel
sequential iterator. The example never resets the state while training;
the kit resets it at each new epoch of its small corpus (and so exercises
``reset_state``)."""
import numpy

import chainer
import chainer.functions as F
import chainer.links as L

from benchmarks.kit import common


class RNNForLM(chainer.Chain):

    def __init__(self, n_vocab, n_units):
        super(RNNForLM, self).__init__()
        with self.init_scope():
            self.embed = L.EmbedID(n_vocab, n_units)
            self.l1 = L.LSTM(n_units, n_units)
            self.l2 = L.LSTM(n_units, n_units)
            self.l3 = L.Linear(n_units, n_vocab)
        for param in self.params():
            param.array[...] = numpy.random.uniform(-0.1, 0.1, param.shape)

    def reset_state(self):
        self.l1.reset_state()
        self.l2.reset_state()

    def forward(self, x):
        h0 = self.embed(x)
        h1 = self.l1(F.dropout(h0))
        h2 = self.l2(F.dropout(h1))
        y = self.l3(F.dropout(h2))
        return y


def corpus(rs, n_vocab, length):
    """Word ids with a Zipf-like frequency, as text has."""
    p = 1.0 / numpy.arange(1, n_vocab + 1)
    return rs.choice(n_vocab, length, p=p / p.sum()).astype(numpy.int32)


class ParallelSequentialIterator(object):
    """The example's iterator: ``batch_size`` positions spread over the
    corpus, each moving one word per call; (current words, next words)."""

    def __init__(self, dataset, batch_size):
        self.dataset = dataset
        self.batch_size = batch_size
        self.epoch = 0
        self.iteration = 0
        n = len(dataset)
        self.offsets = [i * n // batch_size for i in range(batch_size)]

    def words(self):
        n = len(self.dataset)
        return numpy.array([self.dataset[(o + self.iteration) % n]
                            for o in self.offsets], numpy.int32)

    def next(self):
        cur = self.words()
        self.iteration += 1
        nxt = self.words()
        epoch = self.iteration * self.batch_size // len(self.dataset)
        new_epoch = self.epoch < epoch
        self.epoch = epoch
        return cur, nxt, new_epoch


def make_case(n_units=64, batch=8, bproplen=35, n_vocab=500, steps=12,
              epoch_iterations=4, name=None):
    def model(static):
        rnn = common.pick(RNNForLM, static)(n_vocab, n_units)
        m = L.Classifier(rnn)
        m.compute_accuracy = False
        return m

    def optimizers(model):
        return [common.optimizer_with(
            chainer.optimizers.SGD(lr=1.0), model,
            chainer.optimizer_hooks.GradientClipping(5.0))]

    def batches(rs, n):
        data = corpus(rs, n_vocab, batch * bproplen * epoch_iterations)
        it = ParallelSequentialIterator(data, batch)
        out = []
        for _ in range(n):
            xs, ts, reset = [], [], False
            for _ in range(bproplen):
                x, t, new_epoch = it.next()
                xs.append(x)
                ts.append(t)
                reset = reset or new_epoch
            out.append((xs, ts, reset))
        return out

    def step(model, opts, batch):
        xs, ts, new_epoch = batch
        opt, = opts
        loss = 0
        for x, t in zip(xs, ts):
            loss += model(chainer.Variable(x), chainer.Variable(t))
        model.cleargrads()
        loss.backward()
        loss.unchain_backward()
        opt.update()
        if new_epoch:
            model.predictor.reset_state()
        return loss.array

    return common.Case(
        name or 'ptb-h%d-b%d' % (n_units, batch), 'ptb',
        'RNNForLM.forward',
        '2-layer LSTM LM, %d units, batch %d, BPTT %d, vocab %d'
        % (n_units, batch, bproplen, n_vocab),
        model, optimizers, batches, step, steps=steps, warmup=2,
        targets=('lstm-lm', 'all'), shapes='fixed, recurrent state')
