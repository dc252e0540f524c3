"""examples/text_classification: ``nets.py``'s ``TextClassifier`` over its
encoders (``RNNEncoder``: NStepLSTM over the variable-length sentences;
``CNNEncoder``: convolutions over the batch padded to its longest sentence
inside the forward, max over time, MLP; ``BOWEncoder``: the mean of the
embeddings of the padded batch), Adam with weight decay 1e-4, trained
through ``optimizer.update(model, xs, ys)`` as the StandardUpdater does, on
synthetic labelled sentences: variable lengths (every batch a new shape,
as in the example) or all of one length (what changing shapes cost)."""
import numpy

import chainer
import chainer.functions as F
import chainer.links as L

from benchmarks.kit import common

embed_init = chainer.initializers.Uniform(.25)


def sequence_embed(embed, xs, dropout=0.):
    x_len = [len(x) for x in xs]
    x_section = numpy.cumsum(x_len[:-1])
    ex = embed(F.concat(xs, axis=0))
    ex = F.dropout(ex, ratio=dropout)
    exs = F.split_axis(ex, x_section, 0)
    return exs


def block_embed(embed, x, dropout=0.):
    e = embed(x)
    e = F.dropout(e, ratio=dropout)
    e = F.transpose(e, (0, 2, 1))
    e = e[:, :, :, None]
    return e


class TextClassifier(chainer.Chain):

    def __init__(self, encoder, n_class, dropout=0.1):
        super(TextClassifier, self).__init__()
        with self.init_scope():
            self.encoder = encoder
            self.output = L.Linear(encoder.out_units, n_class)
        self.dropout = dropout

    def forward(self, xs, ys):
        concat_outputs = self.predict(xs)
        concat_truths = F.concat(ys, axis=0)

        loss = F.softmax_cross_entropy(concat_outputs, concat_truths)
        accuracy = F.accuracy(concat_outputs, concat_truths)
        chainer.report({'loss': loss}, self)
        chainer.report({'accuracy': accuracy}, self)
        return loss

    def predict(self, xs):
        concat_encodings = F.dropout(self.encoder(xs), ratio=self.dropout)
        return self.output(concat_encodings)


class RNNEncoder(chainer.Chain):

    def __init__(self, n_layers, n_vocab, n_units, dropout=0.1):
        super(RNNEncoder, self).__init__()
        with self.init_scope():
            self.embed = L.EmbedID(n_vocab, n_units, initialW=embed_init)
            self.encoder = L.NStepLSTM(n_layers, n_units, n_units, dropout)
        self.n_layers = n_layers
        self.out_units = n_units
        self.dropout = dropout

    def forward(self, xs):
        exs = sequence_embed(self.embed, xs, self.dropout)
        last_h, last_c, ys = self.encoder(None, None, exs)
        assert(last_h.shape == (self.n_layers, len(xs), self.out_units))
        concat_outputs = last_h[-1]
        return concat_outputs


class MLP(chainer.ChainList):

    def __init__(self, n_layers, n_units, dropout=0.1):
        super(MLP, self).__init__()
        for i in range(n_layers):
            self.add_link(L.Linear(None, n_units))
        self.dropout = dropout
        self.out_units = n_units

    def forward(self, x):
        for i, link in enumerate(self.children()):
            x = F.dropout(x, ratio=self.dropout)
            x = F.relu(link(x))
        return x


class CNNEncoder(chainer.Chain):

    def __init__(self, n_layers, n_vocab, n_units, dropout=0.1):
        out_units = n_units // 3
        super(CNNEncoder, self).__init__()
        with self.init_scope():
            self.embed = L.EmbedID(n_vocab, n_units, ignore_label=-1,
                                   initialW=embed_init)
            self.cnn_w3 = L.Convolution2D(
                n_units, out_units, ksize=(3, 1), stride=1, pad=(2, 0),
                nobias=True)
            self.cnn_w4 = L.Convolution2D(
                n_units, out_units, ksize=(4, 1), stride=1, pad=(3, 0),
                nobias=True)
            self.cnn_w5 = L.Convolution2D(
                n_units, out_units, ksize=(5, 1), stride=1, pad=(4, 0),
                nobias=True)
            self.mlp = MLP(n_layers, out_units * 3, dropout)
        self.out_units = out_units * 3
        self.dropout = dropout

    def forward(self, xs):
        x_block = chainer.dataset.convert.concat_examples(xs, padding=-1)
        ex_block = block_embed(self.embed, x_block, self.dropout)
        h_w3 = F.max(self.cnn_w3(ex_block), axis=2)
        h_w4 = F.max(self.cnn_w4(ex_block), axis=2)
        h_w5 = F.max(self.cnn_w5(ex_block), axis=2)
        h = F.concat([h_w3, h_w4, h_w5], axis=1)
        h = F.relu(h)
        h = F.dropout(h, ratio=self.dropout)
        h = self.mlp(h)
        return h


class BOWEncoder(chainer.Chain):

    def __init__(self, n_vocab, n_units, dropout=0.1):
        super(BOWEncoder, self).__init__()
        with self.init_scope():
            self.embed = L.EmbedID(n_vocab, n_units, ignore_label=-1,
                                   initialW=embed_init)
        self.out_units = n_units
        self.dropout = dropout

    def forward(self, xs):
        x_block = chainer.dataset.convert.concat_examples(xs, padding=-1)
        ex_block = block_embed(self.embed, x_block)
        x_len = self.xp.array([len(x) for x in xs], numpy.int32)[:, None, None]
        h = F.sum(ex_block, axis=2) / x_len
        return h


def make_case(encoder='rnn', variable=True, n_layers=1, n_units=64,
              batch=32, n_vocab=500, n_class=4, dropout=0.4, min_len=5,
              max_len=40, fixed_len=20, steps=12):
    def model(static):
        if encoder == 'rnn':
            enc = RNNEncoder(n_layers, n_vocab, n_units, dropout)
        elif encoder == 'cnn':
            enc = CNNEncoder(n_layers, n_vocab, n_units, dropout)
        else:
            enc = BOWEncoder(n_vocab, n_units, dropout)
        m = common.pick(TextClassifier, static)(enc, n_class)
        if encoder == 'cnn':    # MLP's Linear(None, ...): as the example's
            with chainer.using_config('train', False), \
                    chainer.using_config('use_static_graph', False):
                m.predict([numpy.zeros(8, numpy.int32)])
        return m

    def optimizers(model):
        return [common.optimizer_with(
            chainer.optimizers.Adam(), model,
            chainer.optimizer_hooks.WeightDecay(1e-4))]

    def batches(rs, n):
        out = []
        for _ in range(n):
            lens = (common.lengths(rs, batch, min_len, max_len) if variable
                    else [fixed_len] * batch)
            xs = common.sequences(rs, lens, n_vocab)
            ys = [numpy.array([rs.randint(n_class)], numpy.int32)
                  for _ in range(batch)]
            out.append((xs, ys))
        return out

    step = common.update_step

    kind = 'var' if variable else 'fixed'
    targets = ['all']
    if encoder == 'rnn' and variable:
        targets.insert(0, 'textclass-rnn-var')
    desc = {'rnn': '%d-layer NStepLSTM encoder' % n_layers,
            'cnn': 'CNN encoder (3 widths, max over time, %d-layer MLP)'
            % n_layers,
            'bow': 'bag-of-words encoder (mean of embeddings)'}[encoder]
    return common.Case(
        'textclass-%s-%s' % (encoder, kind), 'text_classification',
        'TextClassifier.forward',
        '%s, %d units, batch %d, vocab %d, %d classes'
        % (desc, n_units, batch, n_vocab, n_class),
        model, optimizers, batches, step, steps=steps, warmup=3,
        targets=targets,
        shapes=('lengths %d-%d' % (min_len, max_len) if variable
                else 'all of length %d' % fixed_len)
        + (', padded in the forward' if encoder != 'rnn' else ''))
