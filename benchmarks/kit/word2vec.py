"""examples/word2vec: ``train_word2vec.py``'s skip-gram and continuous
bag-of-words models with the hierarchical softmax
(``L.BinaryHierarchicalSoftmax`` over the Huffman tree of the word counts,
its weights zeroed) or negative sampling (``L.NegativeSampling``, 5
samples), Adam, trained through ``optimizer.update(model, center,
contexts)``; the example's window iterator over a synthetic corpus, whose
window (1 to 4 words each side) is drawn per batch, so the contexts'
shape changes among four values."""
import collections

import numpy

import chainer
import chainer.functions as F
import chainer.initializers as I
import chainer.links as L

from benchmarks.kit import common


class ContinuousBoW(chainer.Chain):

    def __init__(self, n_vocab, n_units, loss_func):
        super(ContinuousBoW, self).__init__()
        with self.init_scope():
            self.embed = L.EmbedID(
                n_vocab, n_units, initialW=I.Uniform(1. / n_units))
            self.loss_func = loss_func

    def forward(self, x, contexts):
        e = self.embed(contexts)
        h = F.sum(e, axis=1) * (1. / contexts.shape[1])
        loss = self.loss_func(h, x)
        chainer.report({'loss': loss}, self)
        return loss


class SkipGram(chainer.Chain):

    def __init__(self, n_vocab, n_units, loss_func):
        super(SkipGram, self).__init__()
        with self.init_scope():
            self.embed = L.EmbedID(
                n_vocab, n_units, initialW=I.Uniform(1. / n_units))
            self.loss_func = loss_func

    def forward(self, x, contexts):
        e = self.embed(contexts)
        batch_size, n_context, n_units = e.shape
        x = F.broadcast_to(x[:, None], (batch_size, n_context))
        e = F.reshape(e, (batch_size * n_context, n_units))
        x = F.reshape(x, (batch_size * n_context,))
        loss = self.loss_func(e, x)
        chainer.report({'loss': loss}, self)
        return loss


class WindowIterator(object):
    """The example's iterator: shuffled centre positions, a window drawn
    per batch (here from the data stream's own generator)."""

    def __init__(self, dataset, window, batch_size, rs):
        self.dataset = numpy.array(dataset, numpy.int32)
        self.window = window
        self.batch_size = batch_size
        self.rs = rs
        self.order = rs.permutation(
            len(dataset) - window * 2).astype(numpy.int32)
        self.order += window
        self.current_position = 0

    def next(self):
        i = self.current_position
        i_end = i + self.batch_size
        position = self.order[i:i_end]
        w = self.rs.randint(self.window - 1) + 1
        offset = numpy.concatenate([numpy.arange(-w, 0),
                                    numpy.arange(1, w + 1)])
        pos = position[:, None] + offset[None, :]
        contexts = self.dataset.take(pos)
        center = self.dataset.take(position)
        if i_end >= len(self.order):
            self.rs.shuffle(self.order)
            self.current_position = 0
        else:
            self.current_position = i_end
        return center, contexts


def corpus(n_vocab, length, seed=7):
    rs = numpy.random.RandomState(seed)
    p = 1.0 / numpy.arange(1, n_vocab + 1)
    return rs.choice(n_vocab, length, p=p / p.sum()).astype(numpy.int32)


def make_case(model_type='skipgram', out_type='hsm', n_vocab=1000,
              n_units=64, window=5, batch=500, negative_size=5, steps=12):
    train = corpus(n_vocab, 20000)
    counts = collections.Counter(train.tolist())
    for w in range(n_vocab):     # every word counted once at least
        counts[w] += 1

    def model(static):
        if out_type == 'hsm':
            HSM = L.BinaryHierarchicalSoftmax
            tree = HSM.create_huffman_tree(counts)
            loss_func = HSM(n_units, tree)
            loss_func.W.array[...] = 0
        elif out_type == 'ns':
            cs = [counts[w] for w in range(len(counts))]
            loss_func = L.NegativeSampling(n_units, cs, negative_size)
            loss_func.W.array[...] = 0
        cls = SkipGram if model_type == 'skipgram' else ContinuousBoW
        return common.pick(cls, static)(n_vocab, n_units, loss_func)

    def optimizers(model):
        return [common.optimizer_with(chainer.optimizers.Adam(), model)]

    def batches(rs, n):
        it = WindowIterator(train, window, batch, rs)
        return [it.next() for _ in range(n)]

    step = common.update_step

    cls = 'SkipGram' if model_type == 'skipgram' else 'ContinuousBoW'
    loss = {'hsm': 'hierarchical softmax',
            'ns': 'negative sampling (%d)' % negative_size}[out_type]
    return common.Case(
        'word2vec-%s-%s' % (model_type, out_type), 'word2vec',
        cls + '.forward',
        '%s, %s, %d units, batch %d, vocab %d'
        % (model_type, loss, n_units, batch, n_vocab),
        model, optimizers, batches, step, steps=steps, warmup=3,
        targets=('all',), shapes='window 1-%d words each side, drawn per '
        'batch' % (window - 1))
