"""examples/memnn: ``memnn.py``'s end-to-end memory network (bag-of-words
sentence encoding, temporal encodings, 3 hops with adjacent weight
sharing, the answer from the last embedding's matrix) inside
``L.Classifier(label_key='answer')``, Adam, trained through
``optimizer.update(model, **batch)`` as the StandardUpdater does with the
example's converter, then ``fix_ignore_label()`` (the example's extension,
every iteration); synthetic bAbI-like stories of a fixed size."""
import numpy

import chainer
import chainer.functions as F
from chainer import initializers
import chainer.links as L

from benchmarks.kit import common


def bow_encode(embed, sentences):
    e = embed(sentences)
    s = F.sum(e, axis=-2)
    return s


class Memory(object):

    def __init__(self, A, C, TA, TC, encoder):
        self.A = A
        self.C = C
        self.TA = TA
        self.TC = TC
        self.encoder = encoder

    def register_all(self, sentences):
        self.m = self.encoder(self.A, sentences)
        self.c = self.encoder(self.C, sentences)

    def query(self, u):
        xp = chainer.backend.get_array_module(u)
        size = self.m.shape[1]
        inds = xp.arange(size - 1, -1, -1, dtype=numpy.int32)
        tm = self.TA(inds)
        tc = self.TC(inds)
        tm = F.broadcast_to(tm, self.m.shape)
        tc = F.broadcast_to(tc, self.c.shape)
        p = F.softmax(F.batch_matmul(self.m + tm, u))
        o = F.batch_matmul(F.swapaxes(self.c + tc, 2, 1), p)
        o = F.squeeze(o, -1)
        u = o + u
        return u


class MemNN(chainer.Chain):

    def __init__(self, n_units, n_vocab, encoder, max_memory, hops):
        super(MemNN, self).__init__()
        with self.init_scope():
            self.embeds = chainer.ChainList()
            self.temporals = chainer.ChainList()
        normal = initializers.Normal()
        # Shares both embeded matrixes in adjacent layres
        for _ in range(hops + 1):
            self.embeds.append(L.EmbedID(n_vocab, n_units, initialW=normal))
            self.temporals.append(
                L.EmbedID(max_memory, n_units, initialW=normal))
        self.memories = [
            Memory(self.embeds[i], self.embeds[i + 1],
                   self.temporals[i], self.temporals[i + 1], encoder)
            for i in range(hops)
        ]
        # The question embedding is same as the input embedding of the
        # first layer
        self.B = self.embeds[0]
        # The answer prediction matrix W is same as the final output layer
        self.W = lambda u: F.linear(u, self.embeds[-1].W)
        self.encoder = encoder
        self.n_units = n_units
        self.max_memory = max_memory
        self.hops = hops

    def fix_ignore_label(self):
        for embed in self.embeds:
            embed.W.array[0, :] = 0

    def register_all(self, sentences):
        for memory in self.memories:
            memory.register_all(sentences)

    def query(self, question):
        u = self.encoder(self.B, question)
        for memory in self.memories:
            u = memory.query(u)
        a = self.W(u)
        return a

    def forward(self, sentences, question):
        self.register_all(sentences)
        a = self.query(question)
        return a


def make_case(n_units=20, n_vocab=40, max_memory=50, sentence_len=8,
              hops=3, batch=100, steps=12):
    def model(static):
        net = common.pick(MemNN, static)(n_units, n_vocab, bow_encode,
                                         max_memory, hops)
        net.fix_ignore_label()
        return L.Classifier(net, label_key='answer')

    def optimizers(model):
        return [common.optimizer_with(chainer.optimizers.Adam(), model)]

    def batches(rs, n):
        out = []
        for _ in range(n):
            sentences = numpy.zeros((batch, max_memory, sentence_len),
                                    numpy.int32)
            question = numpy.zeros((batch, sentence_len), numpy.int32)
            for b in range(batch):
                n_sent = rs.randint(2, max_memory + 1)
                for j in range(n_sent):
                    k = rs.randint(3, sentence_len + 1)
                    sentences[b, j, :k] = rs.randint(1, n_vocab, k)
                k = rs.randint(3, sentence_len + 1)
                question[b, :k] = rs.randint(1, n_vocab, k)
            answer = rs.randint(1, n_vocab, batch).astype(numpy.int32)
            out.append(dict(sentences=sentences, question=question,
                            answer=answer))
        return out

    def step(model, opts, batch):
        opt, = opts
        opt.update(model, **batch)
        model.predictor.fix_ignore_label()
        return model.loss.array

    return common.Case(
        'memnn', 'memnn', 'MemNN.forward',
        'end-to-end memory network, BoW encoding, %d hops, %d units, '
        'memory %d x %d words, batch %d, vocab %d'
        % (hops, n_units, max_memory, sentence_len, batch, n_vocab),
        model, optimizers, batches, step, steps=steps, warmup=3,
        targets=('all',), shapes='fixed')
