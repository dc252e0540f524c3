"""Links a chain reaches other than as its children: a back-reference to
an owner (also through a weakref.proxy), a link kept outside
``init_scope``; the chain's own link hooks around a method installed as
``forward`` under another name; state another method left on the chain,
read by a decorated one."""
import types
import warnings
import weakref

import numpy
import pytest

import chainer
import chainer.functions as F
import chainer.links as L
from chainer.link_hooks import TimerHook

from static_graph import static_graph
from static_graph.decorator import caches_of


class Child(chainer.Chain):
    def __init__(self):
        super(Child, self).__init__()
        with self.init_scope():
            self.l = L.Linear(6, 3)

    def forward(self, x):
        owner = self.owner
        if isinstance(owner, weakref.ref):
            owner = owner()
        elif isinstance(owner, list):
            owner = owner[0]
        elif isinstance(owner, types.SimpleNamespace):
            owner = owner.model
        h = owner.head(F.relu(self.l(x))) * owner.mask
        return F.sum(h * owner.temp)


HOLDERS = {
    'plain': lambda p: p, 'proxy': weakref.proxy, 'ref': weakref.ref,
    'list': lambda p: [p], 'namespace': lambda p: types.SimpleNamespace(
        model=p)}


class Parent(chainer.Chain):
    def __init__(self, child_cls, holder):
        super(Parent, self).__init__()
        with self.init_scope():
            self.c = child_cls()
            self.head = L.Linear(3, 2)
        self.c.owner = HOLDERS[holder](self)
        self.mask = numpy.ones(2, 'f')
        self.temp = 1.0
        self.steps = 0

    def forward(self, x):
        # What the owner keeps for itself, which the child never reads:
        # no reason to record again.
        self.steps += 1
        self.last = self.head(F.relu(self.c.l(x)))
        return self.c(x)


def _change(m, what, i):
    if what == 'temp':
        m.temp = 1.0 + i
    elif what == 'mask':
        m.mask = numpy.full(2, 1.0 + i, 'f')
    else:
        numpy.random.seed(9 + i)
        m.head = L.Linear(3, 2)


@pytest.mark.parametrize('holder', sorted(HOLDERS))
@pytest.mark.parametrize('what', ['temp', 'mask', 'head', 'nothing'])
def test_what_an_owner_holds_is_watched(what, holder):
    """The decorated child reads its owner (a link held as a plain
    attribute, through a proxy, a weakref.ref, a list or a namespace): a
    scalar, an array or a child link of it changed between calls was
    replayed as recorded (2.6 off; the new head got no gradient),
    silently. What the owner changes at every call and the child never
    names (a counter, its last activations) does not stop replays."""
    Static = type('S', (Child,), {'forward': static_graph(Child.forward)})
    numpy.random.seed(0)
    a = Parent(Child, holder)
    numpy.random.seed(0)
    b = Parent(Static, holder)
    rs = numpy.random.RandomState(0)
    for i in range(6):
        x = rs.randn(5, 6).astype('f')
        if i in (3, 4) and what != 'nothing':
            for m in (a, b):
                _change(m, what, i)
        losses = []
        for m in (a, b):
            m.cleargrads()
            loss = m(x)
            loss.backward()
            losses.append(loss.array)
        numpy.testing.assert_array_equal(losses[0], losses[1])
        for (n, p), (_, q) in zip(sorted(a.namedparams()),
                                  sorted(b.namedparams())):
            assert (p.grad is None) == (q.grad is None), (i, n)
            if p.grad is not None:
                numpy.testing.assert_array_equal(p.grad, q.grad)
    assert caches_of(b.c)['forward'].replays >= (
        5 if what == 'nothing' else 2)


class Hooked(chainer.Chain):
    def __init__(self):
        super(Hooked, self).__init__()
        with self.init_scope():
            self.l = L.Linear(6, 3)

    def forward(self, x):
        return F.tanh(self.l(x))

    def impl(self, x):
        return F.tanh(self.l(x))


def _named_forward():
    def forward(self, x):        # (a loss method, named forward)
        return F.sum(self(x) ** 2)
    return forward


class _Override(Hooked):
    forward = static_graph(Hooked.forward)


class Override(_Override):
    def forward(self, x):         # (Link.__call__ calls this one)
        return super(Override, self).forward(x)


@pytest.mark.parametrize('install', ['loss', 'forward', 'override'])
def test_the_chains_own_hooks_by_how_the_method_is_installed(install):
    """Whether the chain's own link hooks ran inside the call was told by
    the function's name: a ``loss`` method whose function is named
    ``forward`` replayed without its hook (a TimerHook got 1 entry for 8);
    ``forward = static_graph(M.impl)`` never replayed."""
    if install == 'loss':
        cls = type('S', (Hooked,), {'loss': static_graph(_named_forward())})
        call = lambda m, x: m.loss(x)     # NOQA
        plain = lambda m, x: F.sum(m(x) ** 2)     # NOQA
    else:
        cls = Override if install == 'override' else type(
            'S', (Hooked,), {'forward': static_graph(Hooked.impl)})
        call = plain = lambda m, x: F.sum(m(x) ** 2)     # NOQA
    numpy.random.seed(0)
    a = Hooked()
    numpy.random.seed(0)
    b = cls()
    hooks = [TimerHook(), TimerHook()]
    a.add_hook(hooks[0])
    b.add_hook(hooks[1])
    rs = numpy.random.RandomState(0)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        for i in range(8):
            x = rs.randn(5, 6).astype('f')
            la, lb = plain(a, x), call(b, x)
            la.backward()
            lb.backward()
            numpy.testing.assert_array_equal(la.array, lb.array)
    assert len(hooks[0].call_history) == len(hooks[1].call_history) == 8
    if install != 'loss':
        name = 'impl' if install == 'forward' else 'forward'
        assert caches_of(b)[name].replays == 7


class Shared(chainer.Chain):
    def __init__(self):
        super(Shared, self).__init__()
        with self.init_scope():
            self.l1 = L.Linear(6, 4)
            self.l2 = L.Linear(4, 3)

    def read(self):
        return self.l2(self.h)

    def forward(self, x):
        self.h = F.relu(self.l1(x))     # written undecorated
        return F.sum(self.read() ** 2)


def test_a_method_reading_state_another_left_replays():
    """The state was also checked by identity as part of the chain's
    structure: every call recorded again (0 replays)."""
    numpy.random.seed(0)
    a = Shared()
    numpy.random.seed(0)
    b = type('S', (Shared,), {'read': static_graph(Shared.read)})()
    rs = numpy.random.RandomState(0)
    for i in range(6):
        x = rs.randn(5, 6).astype('f')
        for m in (a, b):
            m.cleargrads()
            m(x).backward()
        for p, q in zip(a.params(), b.params()):
            numpy.testing.assert_array_equal(p.grad, q.grad)
    assert caches_of(b)['read'].replays >= 4
