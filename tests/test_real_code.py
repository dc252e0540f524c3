"""Patterns of Chainer's own examples that broke replay: an index array
made from a shape (MemNN's temporal encoding), two backward passes through
one call (the DCGAN updater)."""
import warnings

import numpy
import pytest

import chainer
import chainer.functions as F
import chainer.links as L

from static_graph import StaticGraphWarning
from static_graph.decorator import caches_of
from tests.twins import static_twins


class Positions(chainer.Chain):
    """A position embedding looked up with ``xp.arange`` of the sentence
    length, as the MemNN example's temporal encoding does."""

    def __init__(self, how='arange'):
        super(Positions, self).__init__()
        self.how = how
        with self.init_scope():
            self.embed = L.EmbedID(10, 4)
            self.l = L.Linear(4, 3)

    def forward(self, x):
        n = x.shape[1]
        if self.how == 'arange':
            pos = self.xp.arange(n, dtype=numpy.int32)
        elif self.how == 'view':
            pos = self.xp.arange(10, dtype=numpy.int32)[:n]
        else:   # computed from the data: computed again by every replay
            pos = (x[0, :, 0] > 0).astype(numpy.int32)
        e = F.broadcast_to(self.embed(pos), x.shape)
        return F.sum(self.l(F.sum(x * e, axis=1)))


def cache(chain):
    (c,) = caches_of(chain).values()
    return c


def train_positions(how, lengths):
    """Twins of Positions(how) trained on inputs of ``lengths``, their
    gradients equal bit for bit after every call; the decorated one's
    cache and the StaticGraphWarnings."""
    a, b = static_twins(Positions, how)
    rs = numpy.random.RandomState(0)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        for n in lengths:
            x = rs.standard_normal((2, n, 4)).astype('f')
            for m in (a, b):
                m.cleargrads()
                m(x).backward()
            for (k, p), (_, q) in zip(sorted(a.namedparams()),
                                      sorted(b.namedparams())):
                numpy.testing.assert_array_equal(p.grad, q.grad, err_msg=k)
    return cache(b), [x for x in w
                      if issubclass(x.category, StaticGraphWarning)]


@pytest.mark.parametrize('how', ['arange', 'view'])
def test_an_index_made_from_a_shape_replays(how):
    c, _ = train_positions(how, [5, 5, 5, 5, 7])
    assert c.recordings == 2 and c.replays == 3 and c.fallback_calls == 0


def test_an_index_computed_from_the_data_is_computed_again():
    """``(x[0, :, 0] > 0).astype(int32)``, NumPy on an input, indexes the
    embedding: the comparison and the cast are ops of the schedule
    (numpy_calls.py), so each replay looks up this call's positions."""
    c, w = train_positions('data', [5] * 5)
    assert not w
    assert c.recordings == 1 and c.replays == 4 and c.fallback_calls == 0


class Gen(chainer.Chain):
    def __init__(self):
        super(Gen, self).__init__()
        with self.init_scope():
            self.l = L.Linear(2, 3)
            self.bn = L.BatchNormalization(3)

    def forward(self, z):
        return F.tanh(self.bn(self.l(z)))


class Dis(chainer.Chain):
    def __init__(self):
        super(Dis, self).__init__()
        with self.init_scope():
            self.l1 = L.Linear(3, 4)
            self.bn = L.BatchNormalization(4)
            self.l2 = L.Linear(4, 1)

    def forward(self, x):
        return self.l2(F.leaky_relu(self.bn(self.l1(x))))


def _gan_step(gen, dis, go, do, x_real, z):
    """The DCGAN example's updater: the discriminator's loss, then the
    generator's, both backpropagated through the discriminator's call on
    the fake batch and the generator's call."""
    n = len(x_real)
    y_real = dis(x_real)
    x_fake = gen(z)
    y_fake = dis(x_fake)

    def loss_dis(y_fake, y_real):
        return F.sum(F.softplus(-y_real)) / n + F.sum(F.softplus(y_fake)) / n

    def loss_gen(y_fake):
        return F.sum(F.softplus(-y_fake)) / n

    do.update(loss_dis, y_fake, y_real)
    go.update(loss_gen, y_fake)


@pytest.mark.parametrize('decorated', ['both', 'dis', 'gen'])
def test_two_backward_passes_through_one_call(decorated):
    """Bit for bit with define-by-run, BatchNormalization included; the
    second backward reads the discriminator's updated weights, as
    define-by-run's does."""
    twins = {}
    for name, cls in (('gen', Gen), ('dis', Dis)):
        if decorated in ('both', name):
            twins[name] = static_twins(cls)
        else:
            a = cls()
            b = cls()
            b.copyparams(a)
            twins[name] = (a, b)
    opts = {}
    for name in ('gen', 'dis'):
        for m in twins[name]:
            o = chainer.optimizers.Adam(alpha=0.01)
            o.setup(m)
            opts[id(m)] = o
    rs = numpy.random.RandomState(0)
    for i in range(6):
        x_real = rs.standard_normal((4, 3)).astype('f')
        z = rs.standard_normal((4, 2)).astype('f')
        for k in (0, 1):
            gen, dis = twins['gen'][k], twins['dis'][k]
            _gan_step(gen, dis, opts[id(gen)], opts[id(dis)], x_real, z)
        for name in ('gen', 'dis'):
            a, b = twins[name]
            for (n, p), (_, q) in zip(sorted(a.namedparams()),
                                      sorted(b.namedparams())):
                numpy.testing.assert_array_equal(
                    p.array, q.array, err_msg='%s %s step %d' % (name, n, i))
            numpy.testing.assert_array_equal(a.bn.avg_mean, b.bn.avg_mean)
    for name in ('gen', 'dis'):
        if decorated in ('both', name):
            c = cache(twins[name][1])
            assert c.fallback_calls == 0 and c.replays >= 5, name


def test_a_second_backward_first_seen_after_the_recording():
    """The recording call was backpropagated once: a replayed call's first
    backward freed what it saved, so a second one cannot be served (an
    error that says so, never wrong numbers); the key's later calls keep
    their saved activations and serve it."""
    a, b = static_twins(Dis)
    rs = numpy.random.RandomState(1)
    for i in range(3):
        b.cleargrads()
        F.sum(b(rs.standard_normal((4, 3)).astype('f'))).backward()
    x = rs.standard_normal((4, 3)).astype('f')
    y = b(x)
    F.sum(y).backward()
    with pytest.raises(RuntimeError, match='backward ran twice'):
        F.sum(y * y).backward()
    a.copyparams(b)
    a.bn.avg_mean[...] = b.bn.avg_mean
    a.bn.avg_var[...] = b.bn.avg_var
    rs = numpy.random.RandomState(2)
    for i in range(3):
        x = rs.standard_normal((4, 3)).astype('f')
        grads = []
        for m in (a, b):
            m.cleargrads()
            y = m(x)
            F.sum(y).backward()
            F.sum(y * y).backward()
            grads.append([p.grad.copy() for _, p in sorted(m.namedparams())])
        for u, v in zip(*grads):
            numpy.testing.assert_array_equal(u, v)
    assert cache(b).fallback_calls == 0


class SharedSum(chainer.Chain):
    def __init__(self):
        super(SharedSum, self).__init__()
        with self.init_scope():
            self.p = chainer.Parameter(numpy.full((2, 3), 0.3, 'f'))

    def forward(self, x):
        h = self.p + x     # Add's backward hands h's gradient on to both
        return F.sum(h * h)


class Branching(chainer.Chain):
    def __init__(self):
        super(Branching, self).__init__()
        with self.init_scope():
            self.lin = L.Linear(8, 2)

    def forward(self, x):
        h = F.concat([x, x * 0.5], axis=2)
        h = self.lin(F.relu(h))
        if float(F.sum(h).array) > 0:   # falls back from the first call
            h = F.relu(h)
        return F.sum(h * h)


def test_second_backward_through_a_recording_that_falls_back():
    """Its input (used twice inside) holds the first backward's gradient:
    the second adds it before the contributions, as define-by-run does
    (it was added after them: 1.5e-8 apart)."""
    a, b = static_twins(Branching)
    rs = numpy.random.RandomState(0)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', StaticGraphWarning)
        for i in range(3):
            x = rs.standard_normal((2, 1, 2, 2)).astype('f')
            grads = []
            for m in (a, b):
                m.cleargrads()
                xv = chainer.Variable(x.copy())
                loss = m(xv)
                loss.backward()
                loss.backward()
                grads.append((xv.grad, m.lin.W.grad.copy()))
            for u, v in zip(*grads):
                numpy.testing.assert_array_equal(u, v)


class Residual(chainer.Chain):
    def __init__(self):
        super(Residual, self).__init__()
        with self.init_scope():
            self.l = L.Linear(2, 2)

    def forward(self, x):
        h = x + self.l(x)          # x used twice, h's gradient a sum too
        return F.sum(h * h)


@pytest.mark.parametrize('cls', [SharedSum, Residual])
def test_earlier_gradients_join_the_inputs_own_sum_only(cls):
    """Gradients accumulated over calls without cleargrads, the input a
    Variable that needs a gradient. SharedSum: h's gradient (a sum of two
    contributions) is both p's and x's; replay added p's earlier gradient
    inside it (x got it too; found by the fuzzer with a second backward
    through one call). Residual: x's gradient is h's gradient plus what
    the Linear gives back, h's a sum that W's and b's gradients read; an
    earlier gradient of x joined h's sum (every gradient of the call off,
    0.43 here, 61 with a second backward)."""
    a, b = static_twins(cls)
    rs = numpy.random.RandomState(5)
    for i in range(4):
        xs = [rs.standard_normal((2, 3 if cls is SharedSum else 2))
              .astype('f') for _ in range(2)]
        grads = []
        for m in (a, b):
            m.cleargrads()
            vs = [chainer.Variable(x.copy()) for x in xs]
            m(vs[0]).backward()
            m(vs[0]).backward()     # a second call, same input, held
            m(vs[1]).backward()
            grads.append([v.grad for v in vs] +
                         [p.grad.copy() for _, p in sorted(m.namedparams())])
        for u, v in zip(*grads):
            numpy.testing.assert_array_equal(u, v)
    assert cache(b).replays >= 8
