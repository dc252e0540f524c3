"""examples/pos: ``postagging.py``'s ``CRF`` (word features from an
``EmbedID``, ``L.CRF1d`` with ``transpose=True`` over the variable-length
sentences, the loss and the tagging accuracy's counts reported from the
forward), Adam with weight decay 1e-4, trained through
``optimizer.update(model, xs, ys)``; and the same with a bidirectional
LSTM between the embedding and the CRF (the usual BiLSTM-CRF tagger), on
synthetic tagged sentences of variable lengths."""
import numpy

import chainer
import chainer.functions as F
import chainer.links as L

from benchmarks.kit import common


class CRF(chainer.Chain):

    def __init__(self, n_vocab, n_pos):
        super(CRF, self).__init__()
        with self.init_scope():
            self.feature = L.EmbedID(n_vocab, n_pos)
            self.crf = L.CRF1d(n_pos)

    def features(self, xs):
        return [self.feature(x) for x in xs]

    def forward(self, xs, ys):
        # h[i] is feature vector for each batch of words.
        hs = self.features(xs)
        loss = self.crf(hs, ys, transpose=True)
        chainer.report({'loss': loss}, self)

        # To predict labels, call argmax method.
        _, predict = self.crf.argmax(hs, transpose=True)
        correct = 0
        total = 0
        for y, p in zip(ys, predict):
            # NOTE y is ndarray because
            # it does not pass to transpose_sequence
            correct += self.xp.sum(y == p)
            total += len(y)
        chainer.report({'correct': correct}, self)
        chainer.report({'total': total}, self)

        return loss


class BiLSTMCRF(CRF):

    def __init__(self, n_vocab, n_pos, n_units, dropout=0.1):
        chainer.Chain.__init__(self)
        with self.init_scope():
            self.feature = L.EmbedID(n_vocab, n_units)
            self.bilstm = L.NStepBiLSTM(1, n_units, n_units, dropout)
            self.out = L.Linear(2 * n_units, n_pos)
            self.crf = L.CRF1d(n_pos)

    def features(self, xs):
        sections = numpy.cumsum([len(x) for x in xs[:-1]])
        exs = F.split_axis(self.feature(F.concat(xs, axis=0)), sections, 0)
        _, _, hs = self.bilstm(None, None, exs)
        h = self.out(F.concat(hs, axis=0))
        return F.split_axis(h, sections, 0)


def make_case(bilstm=False, n_units=32, batch=30, n_vocab=500, n_pos=20,
              min_len=3, max_len=25, steps=12):
    def model(static):
        if bilstm:
            return common.pick(BiLSTMCRF, static)(n_vocab, n_pos, n_units)
        return common.pick(CRF, static)(n_vocab, n_pos)

    def optimizers(model):
        return [common.optimizer_with(
            chainer.optimizers.Adam(), model,
            chainer.optimizer_hooks.WeightDecay(1e-4))]

    def batches(rs, n):
        out = []
        for _ in range(n):
            lens = common.lengths(rs, batch, min_len, max_len)
            xs = common.sequences(rs, lens, n_vocab)
            # Tags that depend on the words, so there is something to learn.
            ys = [((x * 7 + 3) % n_pos).astype(numpy.int32) for x in xs]
            out.append((xs, ys))
        return out

    step = common.update_step

    if bilstm:
        name, decorated = 'pos-bilstm-crf-var', 'BiLSTMCRF.forward'
        desc = ('embedding, 1-layer NStepBiLSTM (%d units), linear, CRF1d'
                % n_units)
    else:
        name, decorated = 'pos-crf-var', 'CRF.forward'
        desc = 'embedding features, CRF1d'
    return common.Case(
        name, 'pos', decorated,
        '%s, %d tags, batch %d, vocab %d' % (desc, n_pos, batch, n_vocab),
        model, optimizers, batches, step, steps=steps, warmup=3,
        targets=('all',), shapes='lengths %d-%d' % (min_len, max_len))
