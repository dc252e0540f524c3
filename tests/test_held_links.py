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


def _step_both(models, x, call=lambda m, x: m(x)):
    """A training step of each twin (cleargrads, the call, backward):
    their losses equal, bit for bit."""
    losses = []
    for m in models:
        m.cleargrads()
        loss = call(m, x)
        loss.backward()
        losses.append(loss.array)
    numpy.testing.assert_array_equal(losses[0], losses[1])


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
        self.keeps = False

    def forward(self, x):
        if self.keeps:
            # What the owner keeps for itself at every call.
            self.steps += 1
            self.last = self.head(F.relu(self.c.l(x)))
        return self.c(x)


def _change(m, what, i):
    if what == 'temp':
        m.temp = 1.0 + i
    elif what == 'mask':
        m.mask = numpy.full(2, 1.0 + i, 'f')
    elif what == 'W':
        with m.head.init_scope():
            m.head.W = chainer.Parameter(m.head.W.array * 2 + 1)
    else:
        numpy.random.seed(9 + i)
        m.head = L.Linear(3, 2)


@pytest.mark.parametrize('holder', sorted(HOLDERS))
@pytest.mark.parametrize('what', ['temp', 'mask', 'head', 'W', 'nothing'])
def test_what_an_owner_holds_is_watched(what, holder):
    """The decorated child reads its owner (a link held as a plain
    attribute, through a proxy, a weakref.ref, a list or a namespace): a
    scalar, an array, a child link of it or its child's Parameter changed
    between calls was replayed as recorded (2.6 off; the new head got no
    gradient), silently."""
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
        _step_both((a, b), x)
        for (n, p), (_, q) in zip(sorted(a.namedparams()),
                                  sorted(b.namedparams())):
            assert (p.grad is None) == (q.grad is None), (i, n)
            if p.grad is not None:
                numpy.testing.assert_array_equal(p.grad, q.grad)
    assert caches_of(b.c)['forward'].replays >= (
        5 if what == 'nothing' else 2)


def test_an_owner_that_changes_its_own_state_at_every_call():
    """An owner that keeps a counter and its last activations: every
    attribute of it is watched (the method may read any, by getattr or
    through Chainer's own code), so every call records again and the key
    runs define-by-run, naming the attribute; the numbers stay equal."""
    Static = type('S', (Child,), {'forward': static_graph(Child.forward)})
    numpy.random.seed(0)
    a = Parent(Child, 'plain')
    numpy.random.seed(0)
    b = Parent(Static, 'plain')
    rs = numpy.random.RandomState(0)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        for i in range(8):
            a.keeps = b.keeps = True
            _step_both((a, b), rs.randn(5, 6).astype('f'))
    said = ' '.join(str(x.message) for x in w)
    assert 'self.owner.steps' in said or 'self.owner.last' in said, said


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


class SharedBN(chainer.Chain):
    """A BatchNormalization kept outside ``init_scope`` (shared with
    another model), called by the method: Chainer's own code reads its
    ``eps``, which the method's code never names."""

    def __init__(self, bn):
        super(SharedBN, self).__init__()
        with self.init_scope():
            self.l = L.Linear(6, 4)
        self.bn = bn

    def forward(self, x):
        name = 'te' + 'mp'
        return F.sum(self.bn(self.l(x)) * getattr(self.bn, name))


def test_a_link_held_outside_init_scope_is_watched_whole():
    """``bn.eps`` changed, and an attribute read by ``getattr`` with a
    name the code builds, were replayed as recorded (7.33 for 15.0),
    silently, while only the attributes the code names were watched."""
    models = []
    for cls in (SharedBN, type('S', (SharedBN,), {
            'forward': static_graph(SharedBN.forward)})):
        numpy.random.seed(0)
        bn = L.BatchNormalization(4)
        bn.temp = 1.0
        models.append(cls(bn))
    rs = numpy.random.RandomState(0)
    for i in range(6):
        x = rs.randn(5, 6).astype('f')
        for m in models:
            if i == 3:
                m.bn.eps = 0.5
            if i == 4:
                m.bn.temp = 3.0
        _step_both(models, x)
    for u, v in zip(models[0].bn.avg_mean, models[1].bn.avg_mean):
        assert u == v


class Count(chainer.LinkHook):
    name = 'Count'

    def __init__(self):
        self.n = 0

    def forward_preprocess(self, args):
        self.n += 1


class Recursive(Hooked):
    def forward(self, x):
        if x.shape[0] > 1:
            return self.loss(x)
        return F.tanh(self.l(x))

    def loss(self, x):
        return F.sum(self(x[:1]) ** 2) + F.sum(self.l(x))


def test_hooks_of_a_call_inside_the_method_called_from_forward():
    """``forward`` calls a decorated ``loss`` that calls ``self(x)``: the
    chain's hook runs inside that call, though the call itself is inside
    the chain's ``Link.__call__``; replay skipped it (7 counts for 12)."""
    numpy.random.seed(0)
    a = Recursive()
    numpy.random.seed(0)
    b = type('S', (Recursive,), {'loss': static_graph(Recursive.loss)})()
    hooks = [Count(), Count()]
    a.add_hook(hooks[0])
    b.add_hook(hooks[1])
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        for i in range(6):
            x = numpy.full((3, 6), 0.1 * i, 'f')
            la, lb = a(x), b(x)
            numpy.testing.assert_array_equal(la.array, lb.array)
    assert hooks[0].n == hooks[1].n == 12


class Kinds(chainer.Chain):
    def __init__(self):
        super(Kinds, self).__init__()
        with self.init_scope():
            self.l = L.Linear(3, 2)
        self.s = 0.0
        self.sizes = (2, 3)
        self.names = ('a', 'b')
        self.tags = {2}
        self.c = 0j

    @static_graph
    def forward(self, x):
        sign = numpy.copysign(1.0, self.s)
        return F.sum(self.l(x) * sign * self.sizes[0]) + len(self.names)


@pytest.mark.parametrize('attr, value', [
    ('s', -0.0), ('sizes', (2.0, 3)), ('sizes', (True, 3)),
    ('names', ('a', 'c')), ('tags', {2.0}), ('c', complex(0, -0.0))])
def test_the_watch_still_tells_equal_values_of_other_kinds_apart(
        attr, value):
    """(Its check of kinds now looks twice only at zeros and at tuples
    holding numbers.) A zero's sign, 2.0 for 2 inside a tuple, and a
    changed string each record again."""
    m = Kinds()
    x = numpy.ones((2, 3), 'f')
    for _ in range(3):
        m(x).backward()
    setattr(m, attr, value)
    for _ in range(2):
        m(x).backward()
    c = caches_of(m)['forward']
    assert c.recordings == 2 and c.replays == 3, (c.recordings, c.replays)


class Student(chainer.Chain):
    """Holds a helper link weakly; adds its output while it lives."""

    def __init__(self, aux, proxy):
        super(Student, self).__init__()
        with self.init_scope():
            self.l = L.Linear(3, 4)
        self.proxy = proxy
        self.aux = weakref.proxy(aux) if proxy else weakref.ref(aux)

    def forward(self, x):
        y = self.l(x)
        if self.proxy:
            try:
                y = y + self.aux(y)
            except ReferenceError:
                pass
        else:
            aux = self.aux()
            if aux is not None:
                y = y + aux(y)
        return y


@pytest.mark.parametrize('proxy', [False, True])
def test_a_weakly_held_link_that_goes(proxy):
    """Dropped by the user: define-by-run finds it gone; replay went on
    adding its output (1.36 off) and the entry kept it alive."""
    import gc
    outs = []
    for cls in (Student, type('S', (Student,), {
            'forward': static_graph(Student.forward)})):
        numpy.random.seed(0)
        aux = L.Linear(4, 4)
        numpy.random.seed(1)
        m = cls(aux, proxy)
        x = numpy.ones((2, 3), 'f')
        for _ in range(3):
            m(x)
        gone = weakref.ref(aux)
        del aux
        gc.collect()
        assert gone() is None
        with warnings.catch_warnings():
            warnings.simplefilter('ignore')
            outs.append(m(x).array)
    numpy.testing.assert_array_equal(outs[0], outs[1])


def test_a_global_link_hook_is_watched():
    """A ``with hook:`` link hook runs in every link's call, inside the
    call: its state was not watched (a TimerHook saw 7 calls for 15)."""
    from chainer.link_hooks import TimerHook
    counts = []
    for cls in (Hooked, type('S', (Hooked,), {
            'forward': static_graph(Hooked.forward)})):
        m = cls()
        hook = TimerHook()
        with warnings.catch_warnings():
            warnings.simplefilter('ignore')
            with hook:
                for _ in range(5):
                    m(numpy.ones((2, 6), 'f'))
        counts.append(len(hook.call_history))
    assert counts[0] == counts[1] == 10, counts


class Teacher(chainer.Chain):
    """A student with a teacher kept outside ``init_scope``, called under
    no_backprop_mode; a dead proxy among its attributes."""

    def __init__(self):
        super(Teacher, self).__init__()
        with self.init_scope():
            self.l = L.Linear(6, 3)
        numpy.random.seed(5)
        self.teacher = chainer.Sequential(L.Linear(6, 3),
                                          L.BatchNormalization(3))
        gone = L.Linear(1, 1)
        self.teacher.dead = weakref.proxy(gone)
        del gone

    def forward(self, x):
        with chainer.no_backprop_mode(), \
                chainer.using_config('train', False):
            t = self.teacher(x)
        return F.mean_squared_error(self.l(x), t.array)


def test_a_teacher_held_outside_init_scope_replays():
    """Its parameters, read under no_backprop_mode, were taken for arrays
    made outside Chainer (the key fell back); a dead proxy among its
    attributes raised ReferenceError."""
    a = Teacher()
    b = type('S', (Teacher,), {'forward': static_graph(Teacher.forward)})()
    b.copyparams(a)
    b.teacher.copyparams(a.teacher)
    rs = numpy.random.RandomState(0)
    for i in range(5):
        x = rs.randn(4, 6).astype('f')
        _step_both((a, b), x)
    assert caches_of(b)['forward'].replays == 4


class _Gone(object):
    pass


def test_dead_proxies_in_containers_and_globals():
    """A dead ``weakref.proxy`` in a list or dict on the chain, or in a
    dict global the method names: any use of it raises, and the watch
    (freezing the list, looking for helper objects, for functions in a
    registry) raised ReferenceError at the first call."""
    gone = _Gone()
    proxy = weakref.proxy(gone)
    del gone
    _REGISTRY['gone'] = proxy

    class Net(chainer.Chain):
        def __init__(self):
            super(Net, self).__init__()
            with self.init_scope():
                self.l = L.Linear(3, 2)
            self.items = [proxy]
            self.named = {'p': proxy}

        def forward(self, x):
            return F.sum(self.l(x)) * (2.0 if _REGISTRY else 1.0)

    S = type('S', (Net,), {'forward': static_graph(Net.forward)})
    m = S()
    for i in range(3):
        m.cleargrads()
        m(numpy.ones((1, 3), 'f')).backward()
    assert caches_of(m)['forward'].replays == 2


_REGISTRY = {}


def test_a_held_links_own_hooks_and_a_shared_array():
    """A teacher's own counting hook (the global-hook block had swallowed
    the held links' hooks: 1 count for 6, silently) makes the key run
    define-by-run; a held link's Parameter holding the array of one of
    the chain's got no gradient at all (None for define-by-run's)."""
    a = Teacher()
    b = type('S', (Teacher,), {'forward': static_graph(Teacher.forward)})()
    b.copyparams(a)
    b.teacher.copyparams(a.teacher)
    hooks = [Count(), Count()]
    a.teacher.add_hook(hooks[0])
    b.teacher.add_hook(hooks[1])
    rs = numpy.random.RandomState(0)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        for i in range(5):
            _step_both((a, b), rs.randn(4, 6).astype('f'))
    assert hooks[0].n == hooks[1].n == 5

    class Tied(chainer.Chain):
        def __init__(self):
            super(Tied, self).__init__()
            with self.init_scope():
                self.l = L.Linear(3, 3)
            self.t = L.Linear(3, 3)
            self.t.W.array = self.l.W.array

        def forward(self, x):
            return F.sum(self.t(self.l(x)))

    numpy.random.seed(0)
    a = Tied()
    numpy.random.seed(0)
    b = type('S', (Tied,), {'forward': static_graph(Tied.forward)})()
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        for i in range(3):
            _step_both((a, b), numpy.full((2, 3), 0.5 + i, 'f'))
            numpy.testing.assert_array_equal(a.t.W.grad, b.t.W.grad)


class Lazy(chainer.Chain):
    def __init__(self):
        super(Lazy, self).__init__()
        with self.init_scope():
            self.l = L.Linear(3, 3)
            self.t = L.Linear(None, 3)

    def forward(self, x):
        y = F.sum(self.l(x))
        if self.t.W.array is not None:
            y = y + F.sum(self.t.W)
        return y


def test_a_parameter_initialized_between_calls():
    """``L.Linear(None, 3)`` initialized by a call outside the method:
    replay kept the branch of the uninitialized one (164.27 for 164.69),
    and the parameter got no gradient, silently."""
    numpy.random.seed(0)
    a = Lazy()
    numpy.random.seed(0)
    b = type('S', (Lazy,), {'forward': static_graph(Lazy.forward)})()
    for i in range(6):
        x = numpy.full((2, 3), 0.5 + i, 'f')
        if i == 3:
            for m in (a, b):
                numpy.random.seed(1)
                m.t(x)
        _step_both((a, b), x)
        if i >= 3:
            numpy.testing.assert_array_equal(a.t.W.grad, b.t.W.grad)
    assert caches_of(b)['forward'].replays == 4


def test_an_owners_own_hook_runs_around_the_call():
    """A TimerHook on the owner (which holds the decorated child) runs
    around the owner's forward, outside the child's call: watching it
    made the child record again at every call (0 replays)."""
    from chainer.link_hooks import TimerHook
    Static = type('S', (Child,), {'forward': static_graph(Child.forward)})
    numpy.random.seed(0)
    a = Parent(Child, 'plain')
    numpy.random.seed(0)
    b = Parent(Static, 'plain')
    hooks = [TimerHook(), TimerHook()]
    a.add_hook(hooks[0])
    b.add_hook(hooks[1])
    rs = numpy.random.RandomState(0)
    for i in range(8):
        _step_both((a, b), rs.randn(5, 6).astype('f'))
    assert len(hooks[0].call_history) == len(hooks[1].call_history) == 8
    assert caches_of(b.c)['forward'].replays == 7


def test_held_links_in_a_list_are_named_by_their_place():
    """Two links in one list attribute sharing an array: the message named
    both ``/ts/W``."""
    class Pair(chainer.Chain):
        def __init__(self):
            super(Pair, self).__init__()
            with self.init_scope():
                self.l = L.Linear(3, 3)
            self.ts = [L.Linear(3, 3), L.Linear(3, 3)]
            self.ts[1].W.array = self.ts[0].W.array

        @static_graph
        def forward(self, x):
            return F.sum(self.ts[1](self.ts[0](self.l(x))))

    m = Pair()
    with pytest.warns(Warning, match=r'/ts\[0\]/W and /ts\[1\]/W'):
        m(numpy.ones((2, 3), 'f')).backward()
