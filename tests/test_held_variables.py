"""Variables the method reads that are neither its arguments nor the
chain's Parameters: a Variable attribute whose array the loop replaces,
one that is learned without being a Parameter, and the Parameters of a
link kept outside ``init_scope``. Each twin pair trains alike, bit for
bit."""
import collections
import warnings

import numpy
import pytest

import chainer
import chainer.functions as F
import chainer.links as L

import static_graph
from static_graph import static_graph as static

HELD = {}     # a module global the method reads


def _body(self, x):
    h = self.l(x)
    if self.kind == 'attribute':
        h = h + self.v
    elif self.kind == 'in a dict':
        h = h + self.d['v']
    elif self.kind == 'global':
        h = h + HELD[self.key]
    elif self.kind == 'learned':
        h = F.tanh(h + self.v)
    else:                       # an unregistered link
        h = F.tanh(self.outside(h))
    return F.sum(F.tanh(h))


class Net(chainer.Chain):
    def __init__(self, kind, key, outside=None):
        super(Net, self).__init__()
        self.kind, self.key = kind, key
        with self.init_scope():
            self.l = L.Linear(3, 4)
        self.outside = outside    # (not registered: no init_scope)
        v = chainer.Variable(numpy.zeros((1, 4), 'f'),
                             requires_grad=kind == 'learned')
        self.v = v
        self.d = {'v': v}
        HELD[key] = v

    def forward(self, x):
        return _body(self, x)


class StaticNet(Net):
    @static
    def forward(self, x):
        return _body(self, x)


def _replace(m, step):
    """The loop gives the held Variable a new array (uniform, as a buffer
    initialised with zeros is: a constant of the recording before)."""
    a = numpy.full((1, 4), float(step), 'f')
    if m.kind == 'global':
        HELD[m.key].array = a
    else:
        m.v.array = a


@pytest.mark.parametrize('kind', ['attribute', 'in a dict', 'global'])
def test_a_held_variable_given_a_new_array(kind):
    dbr = Net(kind, 'dbr ' + kind)
    ours = StaticNet(kind, 'ours ' + kind)
    ours.copyparams(dbr)
    rs = numpy.random.RandomState(0)
    for step in range(4):
        x = rs.randn(2, 3).astype('f')
        losses = []
        for m in (dbr, ours):
            _replace(m, step)
            m.cleargrads()
            loss = m(x)
            loss.backward()
            losses.append(loss.array)
        assert numpy.array_equal(*losses), step


@pytest.mark.parametrize('kind', ['learned', 'zeros link', 'random link'])
def test_learned_without_being_the_chains_parameter(kind):
    """A Variable attribute that needs a gradient, and a link kept outside
    init_scope with its own optimizer: define-by-run gives them gradients,
    and so do the recording and the replays."""
    outside = [None, None]
    if kind != 'learned':
        for i in range(2):
            numpy.random.seed(1)
            outside[i] = L.Bias(shape=(4,)) if kind == 'zeros link' else \
                L.Linear(4, 4)
    dbr = Net(kind, 'dbr ' + kind, outside[0])
    ours = StaticNet(kind, 'ours ' + kind, outside[1])
    ours.copyparams(dbr)
    learned = [list(m.outside.params()) if m.outside is not None else [m.v]
               for m in (dbr, ours)]
    rs = numpy.random.RandomState(0)
    for step in range(4):
        x = rs.randn(2, 3).astype('f')
        losses = []
        for m, vs in zip((dbr, ours), learned):
            m.cleargrads()
            for v in vs:
                v.cleargrad()
            loss = m(x)
            loss.backward()
            losses.append(loss.array)
            for v in vs:
                v.array -= 0.1 * v.grad     # the user's own update
        assert numpy.array_equal(*losses), step
        for a, b in zip(*learned):
            assert numpy.array_equal(a.array, b.array), step
    # They replay (none of them is a reason to fall back).
    assert ' 0 replays' not in static_graph.explain(ours)
    assert 'define-by-run calls after a fallback' in \
        static_graph.explain(ours)
    assert '0 define-by-run calls after a fallback' in \
        static_graph.explain(ours)


class _WithPrior(chainer.Chain):
    """A VAE's prior kept on the chain as a distribution, learnable (from
    Parameters) or fixed (from arrays): its cached properties
    (``Normal.scale``, ``variance``) are filled by the first call and read
    by every later one."""

    def __init__(self, learnable):
        super(_WithPrior, self).__init__()
        with self.init_scope():
            self.l = chainer.links.Linear(3, 8)
            if learnable:
                self.mu = chainer.Parameter(numpy.zeros((6, 4), 'f'))
                self.log_s = chainer.Parameter(numpy.zeros((6, 4), 'f'))
        if learnable:
            self.prior = chainer.distributions.Normal(
                self.mu, log_scale=self.log_s)
        else:
            self.prior = chainer.distributions.Normal(
                numpy.zeros((6, 4), 'f'),
                log_scale=numpy.full((6, 4), 0.5, 'f'))

    def forward(self, x):
        h = self.l(x)
        q = chainer.distributions.Normal(h[:, :4], log_scale=h[:, 4:])
        return F.sum(chainer.kl_divergence(q, self.prior))


def _sgd_twins(plain, decorated, lr, *args):
    """[(chain, its SGD)] of ``plain`` and ``decorated`` built alike."""
    out = []
    for cls in (plain, decorated):
        numpy.random.seed(0)
        m = cls(*args)
        out.append((m, chainer.optimizers.SGD(lr).setup(m)))
    return out


def _train_alike(models, shape, after=None, steps=5):
    """Train the twins on the same batches (``after(chain)`` after each
    update): losses and parameters agree bit for bit at every step.
    Returns the library's warnings."""
    rs = numpy.random.RandomState(1)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        for step in range(steps):
            x = rs.randn(*shape).astype('f')
            seen = []
            for m, opt in models:
                m.cleargrads()
                loss = m(x)
                loss.backward()
                opt.update()
                if after is not None:
                    after(m)
                seen.append([loss.array] + [p.array.copy()
                                            for p in m.params()])
            for a, b in zip(*seen):
                assert numpy.array_equal(a, b), step
    return [str(x.message) for x in w
            if issubclass(x.category, static_graph.StaticGraphWarning)]


@pytest.mark.parametrize('learnable', [True, False])
def test_a_distribution_kept_on_the_chain(learnable):
    """Chainer caches ``scale = exp(log_scale)`` on the prior at the first
    call; later calls read that Variable, whose graph leads into the
    first call and to ``log_s``. Replay computed it again from the current
    ``log_s`` (loss 20.04 for 20.45, silently). A learnable prior now
    falls back at its first call, its reason naming the cache; a fixed
    one, whose cache holds constants, replays."""
    S = type('S', (_WithPrior,), {
        'forward': static(_WithPrior.forward)})
    models = _sgd_twins(_WithPrior, S, 0.001, learnable)
    w = _train_alike(models, (6, 3))
    text = static_graph.explain(models[1][0])
    if learnable:
        assert len(w) == 1 and "keeps this call's graph behind it" in w[0]
        assert ' 4 define-by-run calls' in text
    else:
        assert not w and ' 0 replays' not in text, text


class _History(chainer.Chain):
    """Keeps the states of earlier calls in a container and adds the last
    one to this call's: the loss backpropagates into the earlier call's
    graph, as in define-by-run."""

    def __init__(self, kind, on_helper):
        super(_History, self).__init__()
        with self.init_scope():
            self.l = L.Linear(3, 3)
        holder = _Holder() if on_helper else self
        holder.states = kind()
        self.holder = holder

    def forward(self, x):
        h = self.l(x)
        states = self.holder.states
        if len(states):
            h = h + states[-1]
        states.append(h)
        return F.sum(h * h)


class _Holder(object):
    pass


_STATES = []     # a module global holding earlier calls' states


class _GlobalHistory(_History):
    def __init__(self, kind, on_helper):
        super(_GlobalHistory, self).__init__(kind, on_helper)
        del _STATES[:]

    def forward(self, x):
        h = self.l(x)
        if _STATES:
            h = h + _STATES[-1]
        _STATES.append(h)
        del _STATES[:-2]
        return F.sum(h * h)


def test_states_kept_in_a_global_list():
    """The same with a module-level list (one model at a time): it
    recorded twice and raised in the backward."""
    models = []
    for cls in (_GlobalHistory, type('S', (_GlobalHistory,), {
            'forward': static(_GlobalHistory.forward)})):
        numpy.random.seed(0)
        m = cls(list, False)
        opt = chainer.optimizers.SGD(0.01).setup(m)
        seen = []
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter('always')
            for step in range(4):
                x = numpy.random.RandomState(step).randn(2, 3).astype('f')
                m.cleargrads()
                loss = m(x)
                loss.backward()
                opt.update()
                seen.append(loss.array)
        models.append((seen, [str(x.message) for x in w]))
    for a, b in zip(models[0][0], models[1][0]):
        assert numpy.array_equal(a, b)
    assert any('in a list at global _STATES' in x for x in models[1][1])


def test_a_view_of_a_parameter_in_a_list_replays():
    """A list the chain holds with a view of a Parameter made before any
    call (weight tying: ``self.tied = [self.l.W.T]``) is no Variable the
    call made: the calls replay (review of the container reason)."""
    class Tied(chainer.Chain):
        def __init__(self):
            super(Tied, self).__init__()
            with self.init_scope():
                self.l = L.Linear(3, 3)
            self.tied = [self.l.W.T]

        @static
        def forward(self, x):
            return F.sum(self.l(x) ** 2)

    m = Tied()
    for step in range(4):
        m.cleargrads()
        m(numpy.ones((2, 3), 'f')).backward()
    text = static_graph.explain(m)
    assert ' 3 replays' in text, text


@pytest.mark.parametrize('on_helper', [False, True])
@pytest.mark.parametrize('kind', [list, collections.deque])
def test_states_kept_in_a_container(kind, on_helper):
    """A list or deque of earlier calls' states, on the chain or on a
    helper object: a replay builds no graph behind what it leaves there,
    which the next call backpropagates through. Only a list on a helper
    fell back; the others recorded a second time and raised in the
    backward (the first recording's graph released). Now each falls back
    at its first call, its reason naming the container."""
    S = type('S', (_History,), {'forward': static(_History.forward)})
    models = _sgd_twins(_History, S, 0.01, kind, on_helper)

    def keep_two(m):
        if len(m.holder.states) > 2:
            del m.holder.states[0]
    w = _train_alike(models, (2, 3), keep_two)
    assert len(w) == 1 and 'in a %s at attribute self.%sstates' % (
        kind.__name__, 'holder.' if on_helper else '') in w[0], w
    assert ' 1 recordings' in static_graph.explain(models[1][0])
