"""Objects a link holds that the method reads or changes, other than
scalars, lists, dicts and the user's own classes: Python's other
containers, a partial, an itertools counter, and Chainer's and Python's
stateful objects. Each changes between calls or by the call; each twin
pair trains alike, bit for bit, and the keys replay where nothing
changed. (Found by a hunt: all replayed what the recording read,
silently.)"""
import array
import collections
import functools
import gc
import itertools
import queue
import threading
import weakref

import numpy
import pytest

import chainer
import chainer.functions as F
import chainer.links as L

import static_graph
from tests.twins import train_alike


class Base(chainer.Chain):
    def __init__(self):
        super(Base, self).__init__()
        with self.init_scope():
            self.l1 = L.Linear(5, 6)
            self.l2 = L.Linear(6, 3)

    def head(self, h, t, scale):
        return F.softmax_cross_entropy(self.l2(h), t) + scale * F.mean(h * h)


SCALE = [1.0]


@functools.lru_cache(maxsize=None)
def _scale():
    return SCALE[0]


def _set(name, value):
    def before(m, i):
        setattr(m, name, value(m, i))
    return before


# name: (state made in __init__, read in forward, change before step i)
CASES = {
    'deque appended to': (
        lambda m: collections.deque([1.0]),
        lambda m: m.s[-1],
        lambda m, i: m.s.append(1.0 + i)),
    'deque popped by the call': (
        lambda m: collections.deque(float(k) for k in range(20)),
        lambda m: m.s.popleft(),
        None),
    'array.array': (
        lambda m: array.array('f', [1.0]),
        lambda m: m.s[0],
        lambda m, i: m.s.__setitem__(0, 1.0 + i)),
    'bytearray': (
        lambda m: bytearray(b'\x01'),
        lambda m: float(m.s[0]),
        lambda m, i: m.s.__setitem__(0, i + 1)),
    'ChainMap': (
        lambda m: collections.ChainMap({}, {'k': 1.0}),
        lambda m: m.s['k'],
        lambda m, i: m.s.maps[1].__setitem__('k', 1.0 + i)),
    'UserDict': (
        lambda m: collections.UserDict(k=1.0),
        lambda m: m.s['k'],
        lambda m, i: m.s.__setitem__('k', 1.0 + i)),
    'partial keywords': (
        lambda m: functools.partial(max, default=1.0),
        lambda m: m.s([]),
        lambda m, i: m.s.keywords.__setitem__('default', 1.0 + i)),
    'itertools.count': (
        lambda m: itertools.count(1),
        lambda m: float(next(m.s)),
        None),
    'queue.Queue': (
        lambda m: _queue(20),
        lambda m: m.s.get(),
        None),
    'threading.Event': (
        lambda m: threading.Event(),
        lambda m: 2.0 if m.s.is_set() else 1.0,
        lambda m, i: m.s.set() if i == 2 else None),
    'optimizer.t': (
        lambda m: chainer.optimizers.SGD(0.1),
        lambda m: min(1.0, m.s.t / 4.0),
        lambda m, i: setattr(m.s, 't', i)),
    'Hyperparameter': (
        lambda m: _hyperparameter(),
        lambda m: m.s.lr,
        lambda m, i: setattr(m.s, 'lr', 0.5 ** i)),
    'lru_cache': (
        lambda m: None,
        lambda m: _scale(),
        lambda m, i: (SCALE.__setitem__(0, 1.0 + i), _scale.cache_clear())),
}


def _queue(n):
    q = queue.Queue()
    for k in range(n):
        q.put(float(k))
    return q


def _hyperparameter():
    hp = chainer.optimizer.Hyperparameter()
    hp.lr = 1.0
    return hp


def _twins(read, setup):
    """An undecorated and a decorated chain whose forward scales a penalty
    by ``read(self)``, built under one seed; ``setup(m)`` gives each its
    state."""
    def forward(self, x, t):
        return self.head(F.relu(self.l1(x)), t, read(self))

    models = []
    for deco in (False, True):
        cls = type('Net', (Base,), {
            'forward': static_graph.static_graph(forward) if deco
            else forward})
        numpy.random.seed(0)
        m = cls()
        setup(m)
        models.append(m)
    return models


@pytest.mark.parametrize('case', sorted(CASES))
def test_state_held_on_the_chain(case):
    make, read, change = CASES[case]
    models = _twins(read, lambda m: setattr(m, 's', make(m)))
    SCALE[0] = 1.0
    _scale.cache_clear()

    def before(m, i):
        if change is None:
            return
        if m is not models[0] and case == 'lru_cache':
            _scale.cache_clear()       # (the global is the twins' one)
        else:
            change(m, i)

    train_alike(models, before, label=case)


def test_a_deque_nothing_changes_replays():
    """Watched by value, a deque that stays as it is replays."""
    class Net(Base):
        def __init__(self):
            super(Net, self).__init__()
            self.s = collections.deque([0.5, 2.0], maxlen=4)

        @static_graph.static_graph
        def forward(self, x, t):
            return self.head(F.relu(self.l1(x)), t, self.s[-1])

    m = Net()
    x = numpy.ones((4, 5), 'f')
    t = numpy.zeros(4, 'i')
    for _ in range(4):
        m.cleargrads()
        m(x, t).backward()
    assert ' 3 replays' in static_graph.explain(m)


def _nan_array():
    return array.array('d', [float('nan'), 0.0])


def _released_view():
    v = memoryview(bytearray(b'ab'))
    v.release()
    return v


# Held on the chain, unchanged or changed only where the method does not
# look: the key replays. (A first version of the wider watch recorded such
# keys again at every call: an optimizer kept on the chain, whose ``t``
# every update changes; an array.array holding a NaN; a set of
# functions, before it too.)
UNREAD = {
    'an optimizer set up on the chain': lambda m: _own_optimizer(m),
    'an iterator': lambda m: chainer.iterators.SerialIterator(
        [numpy.zeros(2, 'f')] * 8, 2),
    'a timer hook': lambda m: chainer.function_hooks.TimerHook(),
    'array.array with a NaN': lambda m: _nan_array(),
    'a released memoryview': lambda m: _released_view(),
    'a set of functions': lambda m: {F.relu, F.tanh},
    'a weak-valued dict': lambda m: weakref.WeakValueDictionary(),
}


def _own_optimizer(m):
    opt = chainer.optimizers.Adam()
    opt.setup(m)
    return opt


@pytest.mark.parametrize('case', sorted(UNREAD))
def test_state_the_method_does_not_read(case):
    class Net(Base):
        @static_graph.static_graph
        def forward(self, x, t):
            return self.head(F.relu(self.l1(x)), t, 1.0)

    m = Net()
    m.held = UNREAD[case](m)
    opt = getattr(m.held, 'update', None)
    it = getattr(m.held, 'next', None)
    x = numpy.ones((4, 5), 'f')
    t = numpy.zeros(4, 'i')
    for _ in range(5):
        m.cleargrads()
        m(x, t).backward()
        if isinstance(m.held, chainer.Optimizer):
            opt()
        elif isinstance(m.held, chainer.dataset.Iterator):
            it()
    assert ' 4 replays' in static_graph.explain(m)


def test_a_weak_dict_lets_its_values_go():
    """The watch holds what a weak dict holds weakly (a first version of
    it kept the values alive: the dict never emptied)."""
    class Net(Base):
        @static_graph.static_graph
        def forward(self, x, t):
            return self.head(F.relu(self.l1(x)), t, float(len(self.reg)))

    class Thing(object):
        pass

    m = Net()
    m.reg = weakref.WeakValueDictionary()
    thing = Thing()
    m.reg['a'] = thing
    x = numpy.ones((4, 5), 'f')
    t = numpy.zeros(4, 'i')
    for _ in range(2):
        m.cleargrads()
        m(x, t).backward()
    del thing
    gc.collect()
    assert len(m.reg) == 0


class _Cfg(object):
    """A helper object of the user's holding the optimizer: the method
    runs its method, never naming ``opt``."""

    def __init__(self, opt):
        self.opt = opt

    def weight(self):
        return min(1.0, self.opt.t / 4.0)


# How the method reaches an optimizer the loop advances (``t``).
REACHED = {
    'through a helper object': lambda m: m.cfg.weight(),
    'getattr(self, name)': lambda m: min(1.0, getattr(m, 'opt').t / 4.0),
    "self.__dict__['opt']": lambda m: min(1.0, m.__dict__['opt'].t / 4.0),
}


@pytest.mark.parametrize('case', sorted(REACHED))
def test_an_optimizer_reached_without_its_name(case):
    """The wider watch looked into an optimizer only where the method's
    code names the attribute holding it: one held by a helper object
    (whose method reads it) or reached by a string replayed the old ``t``
    (0.31 for 4.14). Now objects a helper holds are watched named or not,
    and the code's strings count as names."""
    def setup(m):
        m.opt = chainer.optimizers.SGD(0.1)
        m.opt.setup(m)
        m.cfg = _Cfg(m.opt)

    train_alike(_twins(REACHED[case], setup),
                after=lambda m: m.opt.update(), label=case)


class _Sched(object):
    def __init__(self):
        self.t = 0

    def w(self):
        return min(1.0, self.t / 4.0)


_KEEP = []


@pytest.mark.parametrize('kind', ['ref', 'proxy'])
def test_a_helper_held_through_a_weak_reference(kind):
    """A schedule object the chain holds through a ``weakref.ref`` or
    ``weakref.proxy`` (its owner keeps it): the watch saw only whether it
    was alive, and replay kept the recorded ``t``, silently (21 off)."""
    def read(m):
        return (m.sched() if kind == 'ref' else m.sched).w()

    def before(m, i):
        _KEEP[0].t = i

    _KEEP[:] = [_Sched()]
    refer = weakref.ref if kind == 'ref' else weakref.proxy
    train_alike(_twins(read, lambda m: setattr(m, 'sched', refer(_KEEP[0]))),
                before, label=kind)
