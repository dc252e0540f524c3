"""examples/seq2seq: an NStepLSTM encoder-decoder (``seq2seq.py``'s
``Seq2seq``: source reversed, EOS prepended/appended to the target,
``sequence_embed`` of the concatenated batch, the summed cross entropy over
the batch, reports of the loss and the perplexity), Adam, trained through
``optimizer.update(model, xs, ys)`` as the StandardUpdater does, on
synthetic sentence pairs: variable lengths (every batch a new shape, as in
the example) or all of one length (what changing shapes cost)."""
import numpy

import chainer
import chainer.functions as F
import chainer.links as L

from benchmarks.kit import common

UNK = 0
EOS = 1


def sequence_embed(embed, xs):
    x_len = [len(x) for x in xs]
    x_section = numpy.cumsum(x_len[:-1])
    ex = embed(F.concat(xs, axis=0))
    exs = F.split_axis(ex, x_section, 0)
    return exs


class Seq2seq(chainer.Chain):

    def __init__(self, n_layers, n_source_vocab, n_target_vocab, n_units):
        super(Seq2seq, self).__init__()
        with self.init_scope():
            self.embed_x = L.EmbedID(n_source_vocab, n_units)
            self.embed_y = L.EmbedID(n_target_vocab, n_units)
            self.encoder = L.NStepLSTM(n_layers, n_units, n_units, 0.1)
            self.decoder = L.NStepLSTM(n_layers, n_units, n_units, 0.1)
            self.W = L.Linear(n_units, n_target_vocab)
        self.n_layers = n_layers
        self.n_units = n_units

    def forward(self, xs, ys):
        xs = [x[::-1] for x in xs]

        eos = self.xp.array([EOS], numpy.int32)
        ys_in = [F.concat([eos, y], axis=0) for y in ys]
        ys_out = [F.concat([y, eos], axis=0) for y in ys]

        # Both xs and ys_in are lists of arrays.
        exs = sequence_embed(self.embed_x, xs)
        eys = sequence_embed(self.embed_y, ys_in)

        batch = len(xs)
        # None represents a zero vector in an encoder.
        hx, cx, _ = self.encoder(None, None, exs)
        _, _, os = self.decoder(hx, cx, eys)

        # It is faster to concatenate data before calculating loss
        # because only one matrix multiplication is called.
        concat_os = F.concat(os, axis=0)
        concat_ys_out = F.concat(ys_out, axis=0)
        loss = F.sum(F.softmax_cross_entropy(
            self.W(concat_os), concat_ys_out, reduce='no')) / batch

        chainer.report({'loss': loss}, self)
        n_words = concat_ys_out.shape[0]
        perp = self.xp.exp(loss.array * batch / n_words)
        chainer.report({'perp': perp}, self)
        return loss


def make_case(variable=True, n_layers=3, n_units=64, batch=16, n_vocab=200,
              min_len=4, max_len=20, fixed_len=12, steps=12):
    def model(static):
        return common.pick(Seq2seq, static)(n_layers, n_vocab, n_vocab,
                                            n_units)

    def optimizers(model):
        return [common.optimizer_with(chainer.optimizers.Adam(), model)]

    def batches(rs, n):
        out = []
        for _ in range(n):
            if variable:
                lx = common.lengths(rs, batch, min_len, max_len)
                ly = common.lengths(rs, batch, min_len, max_len)
            else:
                lx = ly = [fixed_len] * batch
            out.append((common.sequences(rs, lx, n_vocab, 2),
                        common.sequences(rs, ly, n_vocab, 2)))
        return out

    step = common.update_step

    if variable:
        name, shapes = 'seq2seq-var', 'lengths %d-%d' % (min_len, max_len)
        targets = ('seq2seq-var', 'all')
    else:
        name, shapes = 'seq2seq-fixed', 'all of length %d' % fixed_len
        targets = ('all',)
    return common.Case(
        name, 'seq2seq', 'Seq2seq.forward',
        '%d-layer NStepLSTM encoder-decoder, %d units, batch %d, vocab %d'
        % (n_layers, n_units, batch, n_vocab),
        model, optimizers, batches, step, steps=steps, warmup=3,
        targets=targets, shapes=shapes)
