"""Containers too big to compare by value (more than MAX_ITEMS elements in
all) whose contents the call changes without changing their length: items
replaced, a full deque or a rolling list appended to, a list in a dict
appended to. Watched by the identities of what they hold (places.Contents),
so each twin trains bit for bit with define-by-run, and the containers
hold what define-by-run's hold. Before, they were watched by identity and
length only and replayed silently (review30)."""
import collections
import warnings

import numpy
import pytest

import chainer
import chainer.functions as F
import chainer.links as L

from static_graph import static_graph as static
from static_graph import traced
from static_graph.decorator import caches_of
from tests.test_kept_outputs import _twin_steps


def _z(*shape):
    return numpy.zeros(shape or (3,), numpy.float32)


def _flat(c, depth=4):
    """The items of container ``c`` and of the containers in it."""
    items = list(c.values()) if isinstance(c, dict) else list(c)
    out = []
    for x in items:
        if depth and isinstance(x, (list, dict, collections.deque)):
            out.extend(_flat(x, depth - 1))
        else:
            out.append(x)
    return out


def _same_contents(a, b):
    """Do containers ``a`` (define-by-run's) and ``b`` hold equal arrays,
    plain ones (no recording's traced array left in ``b``)?"""
    fa, fb = _flat(a), _flat(b)
    assert len(fa) == len(fb)
    for u, v in zip(fa, fb):
        assert type(v) is not traced.TracedArray
        assert type(u) is type(v)
        assert numpy.array_equal(u, v)


def _trained(cls, steps, after):
    """The static twin's cache after ``cls`` and its twin trained ``steps``
    steps (_twin_steps, ``after`` each), equal bit for bit at every step."""
    bufs = [numpy.zeros((4, 6), numpy.float32) for _ in range(2)]
    losses, a, b = _twin_steps(cls, bufs, steps=steps, after=after)
    assert all(numpy.array_equal(u, v) for u, v in losses)
    return caches_of(b)['forward']


def _net(init, forward, n_layers=1):
    class Net(chainer.Chain):
        def __init__(self):
            super(Net, self).__init__()
            self.c = init()
            with self.init_scope():
                self.layers = chainer.ChainList(
                    *[L.Linear(6, 6) for _ in range(n_layers)])

        def forward(self, x):
            return forward(self, x)
    return Net


def _feature_dict(self, x):
    h = x
    for i, link in enumerate(self.layers):
        h = F.tanh(link(h))
        self.c[i] = h.array
    return F.sum(h * h)


def _deque_append(self, x):
    h = self.layers[0](x)
    self.c.append(h.array[0])
    return F.sum(h * h)


def _rolling(self, x):
    h = self.layers[0](x)
    self.c.pop(0)
    self.c.append(h.array[0])
    return F.sum(h * h)


def _nested_append(self, x):
    h = self.layers[0](x)
    self.c['h'].append(h.array)
    return F.sum(h * h)


def _read_and_replace(self, x):
    h = self.layers[0](x)
    prev = self.c[0]
    self.c[0] = h.array
    return F.sum((h + prev) ** 2)


def _counter(self, x):
    self.c[0] = self.c[0] + 1.0
    return F.sum((self.layers[0](x) * self.c[0]) ** 2)


# name: (the container, forward, layers); each changes it at every call
EVERY_CALL = {
    '70 layer activations in a dict': (dict, _feature_dict, 70),
    'a full deque appended to': (
        lambda: collections.deque([_z(6)] * 100, maxlen=100),
        _deque_append, 1),
    'a rolling list': (lambda: [_z(6)] * 100, _rolling, 1),
    'a list in a dict appended to': (
        lambda: {'h': [_z(4, 6)] * 100}, _nested_append, 1),
    'an activation read and replaced': (
        lambda: {i: _z(4, 6) for i in range(100)}, _read_and_replace, 1),
    'a counter in a dict of floats': (
        lambda: {i: 0.0 for i in range(100)}, _counter, 1),
}


@pytest.mark.parametrize('case', sorted(EVERY_CALL))
def test_a_big_container_changed_at_every_call_falls_back(case):
    """Replaced in place at every call, the same length: (review30) the
    dict of 70 activations kept the recording's, the deque and the rolling
    list were not appended to, the nested list 101 items long for
    define-by-run's 106, the activation read back and the counter frozen
    (losses 7.92 for 62.9 from step 1). Now the second call records again
    and the key falls back, as for a smaller container."""
    init, forward, n = EVERY_CALL[case]
    cls = _net(init, forward, n)

    def same(step, a, b):
        _same_contents(a.c, b.c)

    bufs = [numpy.zeros((4, 6), numpy.float32) for _ in range(2)]
    numpy.random.seed(0)
    losses, a, b = _twin_steps(cls, bufs, steps=5, after=same)
    assert all(numpy.array_equal(u, v) for u, v in losses)
    cache = caches_of(b)['forward']
    assert cache.replays == 0
    assert cache.fallback_calls == 3


@pytest.mark.parametrize('every_call', [True, False])
def test_a_list_in_a_big_dict_appended_to(every_call):
    """``self.c['h'].append(...)`` where ``self.c['h']`` holds 100 items,
    the method reading the last item: ``h.array`` at every call (falls
    back), or a scale once after reading the last (a memo: the next call
    records again, then replays with it; before, the replays read the
    recorded 1.0 for define-by-run's 2.0)."""
    def forward(self, x):
        h = self.layers[0](x)
        hist = self.c['h']
        if every_call:
            hist.append(h.array)
            return F.sum((h - hist[-1]) ** 2)
        scale = hist[-1]
        if len(hist) == 100:
            hist.append(2.0)
        return F.sum((h * scale) ** 2)

    cls = _net(lambda: {'h': [_z(4, 6)] * 99 + [1.0]}, forward)

    def same(step, a, b):
        _same_contents(a.c, b.c)

    cache = _trained(cls, 5, same)
    assert cache.recordings == 2
    assert cache.replays == (0 if every_call else 3)


@pytest.mark.parametrize('new_arrays', [False, True])
def test_a_memo_of_an_argument_view_in_a_big_container(new_arrays):
    """``m = self.c['m']`` (100 items); ``if len(m) == 100: m.append(
    x[0])``; ``x = x + m[-1]``: define-by-run keeps the first call's view
    (of the caller's buffer, which the caller refills, or of its first
    array); replay recomputed x[0] from each new input (review30: 127.8
    for 469.6 at step 1). The memo is the caller's memory, as
    define-by-run's."""
    def forward(self, x):
        m = self.c['m']
        if len(m) == 100:
            m.append(x[0])
        return F.sum(self.layers[0](x + m[-1]) ** 2)

    cls = _net(lambda: {'m': [_z(6)] * 100}, forward)
    bufs = [numpy.zeros((4, 6), numpy.float32) for _ in range(2)]
    step_input = (lambda buf: buf.copy()) if new_arrays else (lambda b: b)
    losses, a, b = _twin_steps(cls, bufs, step_input, steps=4)
    assert all(numpy.array_equal(u, v) for u, v in losses)
    _same_contents(a.c, b.c)
    assert numpy.shares_memory(b.c['m'][-1], bufs[1]) != new_arrays
    assert caches_of(b)['forward'].replays == 0


RECENT = collections.deque()


def test_a_full_global_deque_appended_to():
    """A module-global ``deque(maxlen=100)``, full, that the method
    appends ``h.array`` to: replayed without appending (review30: the
    last 8 items differed from define-by-run's)."""
    global RECENT

    class Net(chainer.Chain):
        def __init__(self):
            super(Net, self).__init__()
            with self.init_scope():
                self.l = L.Linear(6, 3)

        def forward(self, x):
            h = self.l(x)
            RECENT.append(h.array)
            return F.sum(h * h)

    Static = type('Static', (Net,), {'forward': static(Net.forward)})
    kept, losses = [], []
    for cls in (Net, Static):
        numpy.random.seed(0)
        RECENT = collections.deque([_z(4, 3)] * 100, maxlen=100)
        m = cls()
        opt = chainer.optimizers.SGD(0.1)
        opt.setup(m)
        with warnings.catch_warnings():
            warnings.simplefilter('ignore')
            for s in range(5):
                m.cleargrads()
                loss = m(numpy.random.RandomState(s).randn(4, 6).astype(
                    numpy.float32))
                loss.backward()
                opt.update()
                losses.append(loss.array)
        kept.append(RECENT)
    assert all(numpy.array_equal(u, v) for u, v in zip(losses[:5],
                                                       losses[5:]))
    _same_contents(*kept)
    assert caches_of(m)['forward'].replays == 0


def test_a_float_in_a_big_dict_set_between_calls():
    """A dict of 100 float scales the method reads one of: the loop
    setting it to an equal float (another object) keeps replaying (values
    are what the method reads); to another value, or to an equal int (the
    kind ``==`` does not see), records again. Before, 2.0 replayed with
    the recorded 1.0."""
    def forward(self, x):
        return F.sum((self.layers[0](x) * self.c[3]) ** 2)

    cls = _net(lambda: {i: 1.0 for i in range(100)}, forward)
    values = {2: float('1.0'), 3: 2.0, 4: 2}

    def set_scale(step, a, b):
        if step in values:
            a.c[3] = b.c[3] = values[step]
        if step == 2:
            assert caches_of(b)['forward'].recordings == 1

    cache = _trained(cls, 6, set_scale)
    assert cache.recordings == 3
    assert cache.replays == 3


def test_an_item_replaced_between_calls_in_a_big_list_of_lists():
    """A list of 100 lists the method reads a scalar of (``self.c[7][0]``):
    the loop replacing that scalar records again (before: replayed the
    recorded one); nothing changed, the key replays."""
    def forward(self, x):
        return F.sum((self.layers[0](x) + self.c[7][0]) ** 2)

    cls = _net(lambda: [[0.5] for _ in range(100)], forward)

    def set_item(step, a, b):
        if step == 1:
            a.c[7][0] = b.c[7][0] = -3.0

    cache = _trained(cls, 4, set_item)
    assert cache.recordings == 2
    assert cache.replays == 2


@pytest.mark.parametrize('n', [10, 100])
def test_an_array_in_a_dict_read_as_a_number(n):
    """A dict of 0-d temperatures the loop anneals in place, one of them
    read as a number (``float(self.c[0])``): a value read, whatever the
    dict's size (review33: of 100 entries, not handed traced, it replayed
    the recorded temperature, silently)."""
    def forward(self, x):
        return F.sum(self.layers[0](x) ** 2) / float(self.c[0])

    cls = _net(lambda: dict((i, numpy.array(1.0, numpy.float32))
                            for i in range(n)), forward)

    def anneal(step, a, b):
        for m in (a, b):
            m.c[0][...] = 1.0 + 0.5 * step

    cache = _trained(cls, 5, anneal)
    assert cache.replays == 0 and cache.fallback_calls == 4


def test_a_dict_view_on_the_chain():
    """``self.c = weights.values()`` (the dict itself kept elsewhere), the
    loop reweighting a class: watched by what the view shows (review33:
    replayed the recorded weights, silently)."""
    def forward(self, x):
        return F.sum(self.layers[0](x) ** 2) * (sum(self.c) / len(self.c))

    weights = [dict(('c%d' % i, 1.0) for i in range(10)) for _ in range(2)]
    made = iter(weights)
    cls = _net(lambda: next(made).values(), forward)

    def reweight(step, a, b):
        if step == 2:
            for w in weights:
                w['c0'] = 3.0

    cache = _trained(cls, 5, reweight)
    assert cache.recordings == 2 and cache.replays == 3


def _replace(i, value):
    def change(c):
        c[i] = value
    return change


# name: (container of more than MAX_ITEMS items, change, still holds?)
CHANGES = {
    'nothing': (lambda: [_z() for _ in range(100)], lambda c: None, True),
    'an array replaced': (
        lambda: [_z() for _ in range(100)], _replace(5, _z()), False),
    'a 1-element array replaced by an equal one': (
        lambda: [_z(1) for _ in range(100)], _replace(5, _z(1)), False),
    'a float replaced by an equal float': (
        lambda: [0.5] * 100, _replace(5, float('0.5')), True),
    'a float replaced by an equal int': (
        lambda: [1.0] * 100, _replace(5, 1), False),
    'a zero replaced by a negative zero': (
        lambda: [0.0] * 100, _replace(5, -0.0), False),
    'a string replaced by an equal string': (
        lambda: ['w%d' % i for i in range(100)], _replace(5, 'w' + '5'),
        True),
    'a list replaced by an equal list': (
        lambda: [[1.0] for _ in range(100)], _replace(5, [1.0]), False),
    'a list inside appended to': (
        lambda: [[1.0] for _ in range(100)],
        lambda c: c[5].append(2.0), False),
    'a list in a tuple appended to': (
        lambda: tuple([1.0] for _ in range(100)),
        lambda c: c[5].append(2.0), False),
    'a full deque appended to': (
        lambda: collections.deque([_z() for _ in range(100)], maxlen=100),
        lambda c: c.append(c[0]), False),
    'a set member swapped': (
        lambda: set(range(100)), lambda c: (c.discard(5), c.add(500)),
        False),
    'a dict key swapped': (
        lambda: {i: 0.0 for i in range(100)},
        lambda c: (c.pop(5), c.__setitem__(500, 0.0)), False),
    'a dict value replaced': (
        lambda: {'k%d' % i: _z() for i in range(100)},
        _replace('k5', _z()), False),
    'a bytearray changed': (
        lambda: bytearray(1000), _replace(5, 1), False),
}


@pytest.mark.parametrize('case', sorted(CHANGES))
def test_what_the_contents_of_a_big_container_tell(case):
    """places.Contents, the watched value of a container too big to
    compare by value: the replay's check (``==`` with identity where an
    equal object could differ) and the check after a recording call
    (identity only) tell a change alike."""
    from static_graph import places
    make, change, holds = CHANGES[case]
    c = make()
    watched = places.Contents(c)
    assert watched.get() is watched
    change(c)
    assert (watched.get() is watched) == holds
    assert (watched.get(None, None, True) is watched) == holds


def test_arrays_the_loop_replaces_in_a_big_list_are_let_go():
    """A bank of 100 arrays on the chain that the loop replaces before
    every call (the method does not read it): the key goes stale and runs
    define-by-run, and the arrays it held are let go (review33: the stale
    entry's watch kept each key's last bank alive)."""
    import gc
    import weakref

    def forward(self, x):
        return F.sum(self.layers[0](x) ** 2)

    cls = type('Static', (_net(lambda: [_z(8) for _ in range(100)],
                                forward),), {})
    cls.forward = static(cls.forward)
    m = cls()
    refs = []
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        for _ in range(6):
            refs += [weakref.ref(a) for a in m.c]
            m.c[:] = [_z(8) for _ in range(100)]
            m.cleargrads()
            F.sum(m(numpy.ones((2, 6), numpy.float32))).backward()
    gc.collect()
    cache = caches_of(m)['forward']
    assert cache.replays == 0 and cache.fallback_calls > 0
    assert sum(r() is not None for r in refs) == 0


_KINDS = {
    'OrderedDict': lambda items: collections.OrderedDict(items),
    'defaultdict': lambda items: collections.defaultdict(float, items),
    'deque': lambda items: collections.deque(v for _, v in items),
    'values view': lambda items: dict(items).values(),
    'list of lists': lambda items: [[v] for _, v in items],
}


def _first(c):
    if isinstance(c, dict):
        return c[0]
    if isinstance(c, collections.deque):
        return c[0]
    if type(c) is list:
        return c[0][0]
    return next(iter(c))


@pytest.mark.parametrize('n', [10, 100])
@pytest.mark.parametrize('kind', sorted(_KINDS))
def test_an_array_read_as_a_number_in_other_containers(kind, n):
    """The same annealed temperature in an OrderedDict, a defaultdict, a
    deque, a dict's values view or a list of lists: handed to the call
    traced too (review34: they replayed the recorded one, silently)."""
    def forward(self, x):
        return F.sum(self.layers[0](x) ** 2) / float(_first(self.c))

    cls = _net(lambda: _KINDS[kind]([(i, numpy.array(1.0, numpy.float32))
                                     for i in range(n)]), forward)

    def anneal(step, a, b):
        for m in (a, b):
            _first(m.c)[...] = 1.0 + 0.5 * step

    cache = _trained(cls, 5, anneal)
    assert cache.replays == 0 and cache.fallback_calls == 4


def test_a_big_items_view_nobody_changes_replays():
    """A dict's items() view of 100 weights: its tuples are new at every
    look, the dict's keys and values are not (review34: it fell back for
    good, 'changes attribute ... contents at every call')."""
    def forward(self, x):
        return F.sum(self.layers[0](x) ** 2) * sum(w for _, w in self.c)

    cls = _net(lambda: dict((i, 0.01) for i in range(100)).items(), forward)
    cache = _trained(cls, 5, None)
    assert cache.recordings == 1 and cache.replays == 4


def test_a_write_into_an_array_of_a_big_list_falls_back():
    """The method adds into an array a 100-item list holds (traced without
    a copy to compare: the write is seen through the view)."""
    def forward(self, x):
        self.c[0] += 1.0
        return F.sum(self.layers[0](x) ** 2)

    cls = _net(lambda: [_z() for _ in range(100)], forward)
    bufs = [numpy.zeros((4, 6), numpy.float32) for _ in range(2)]
    losses, a, b = _twin_steps(cls, bufs, steps=4)
    assert all(numpy.array_equal(u, v) for u, v in losses)
    _same_contents(a.c, b.c)
    assert a.c[0][0] == 4.0 and caches_of(b)['forward'].replays == 0


@pytest.mark.parametrize('kind', ['list', 'deque', 'values view'])
@pytest.mark.parametrize('how', ['put', 'setfield'])
def test_a_write_in_c_into_an_array_of_a_container(kind, how):
    """``a.put(i, a + 1)`` or ``a.setfield(a + 1, ...)`` into an array a
    watched container holds, read in the loss: a write replay would not
    repeat (review35: with no copy taken, the list's replayed silently)."""
    def forward(self, x):
        a = _first(self.c) if kind != 'list' else self.c[0]
        if how == 'put':
            a.put([0, 1, 2], a + 1)
        else:
            a.setfield(a + 1, numpy.float32)
        return F.sum(self.layers[0](x)[:, :3] * a)

    make = {'list': lambda: [_z() for _ in range(100)],
            'deque': lambda: collections.deque(_z() for _ in range(100)),
            'values view': lambda: dict((i, _z()) for i in range(100)).values()}
    cls = _net(make[kind], forward)
    bufs = [numpy.zeros((4, 6), numpy.float32) for _ in range(2)]
    losses, a, b = _twin_steps(cls, bufs, steps=4)
    assert all(numpy.array_equal(u, v) for u, v in losses)
    assert caches_of(b)['forward'].replays == 0
