"""Containers the caller passes in (a dict of counters, a list to collect
results in, a cache dict): the method gets the caller's own where they hold
no array, and what it changes in any of them reaches the caller, as under
define-by-run; such a call falls back, since replay would not change them."""
import collections
import types
import warnings

import numpy
import pytest

import chainer
import chainer.functions as F
import chainer.links as L

from static_graph import StaticGraphWarning
from static_graph import static_graph
from static_graph.decorator import caches_of


class Net(chainer.Chain):
    def __init__(self, body):
        super(Net, self).__init__()
        self.body = body
        with self.init_scope():
            self.l = L.Linear(3, 3)

    def forward(self, x, box):
        return self.body(self, x, box)


def _twins(body):
    a = Net(body)
    b = type('S', (Net,), {'forward': static_graph(Net.forward)})(body)
    b.copyparams(a)
    return a, b


def _counts(m, x, box):
    h = F.tanh(m.l(x))
    box['total'] += x.shape[0]           # the sentiment example's counters
    return F.sum(h)


def _collects(m, x, box):
    h = F.tanh(m.l(x))
    box.append(h)                        # intermediate Variables handed back
    return F.sum(h * h)


def _cache(m, x, box):
    h = F.tanh(m.l(box.pop('prev')) + m.l(x))
    box['prev'] = h                      # a cache dict holding a Variable
    return F.sum(h)


@pytest.mark.parametrize('body, box', [
    (_counts, lambda rs: {'total': 0}),
    (_collects, lambda rs: []),
    (_cache, lambda rs: {'prev': chainer.Variable(
        rs.randn(2, 3).astype('f'))}),
])
def test_what_the_method_changes_in_an_argument_reaches_the_caller(
        body, box):
    a, b = _twins(body)
    got = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        for m in (a, b):
            rs = numpy.random.RandomState(0)
            got[m] = []
            for _ in range(3):
                x = rs.randn(2, 3).astype('f')
                bx = box(rs)
                given = dict(bx) if isinstance(bx, dict) else list(bx)
                m.cleargrads()
                loss = m(x, bx)
                extra = 0
                if body is _collects:
                    extra = F.sum(bx[0] * 3)
                elif body is _cache:
                    extra = F.sum(bx['prev'] * 3)
                    assert 'prev' in bx and bx['prev'] is not given['prev']
                (loss + extra).backward()
                got[m].append((loss.array, m.l.W.grad.copy(),
                               bx['total'] if body is _counts else len(bx)))
    for (la, ga, na), (lb, gb, nb) in zip(got[a], got[b]):
        assert la == lb and numpy.array_equal(ga, gb) and na == nb
    assert caches_of(b)['forward'].replays == 0
    assert any(issubclass(w.category, StaticGraphWarning) and
               'changes its argument box' in str(w.message) for w in caught)


def test_a_cache_argument_gets_the_callers_variable_back():
    """The caller's Variables, not the recording's copies of them, are what
    the method leaves in a dict it rebuilt."""
    m = type('S', (Net,), {'forward': static_graph(Net.forward)})(
        lambda m, x, box: F.sum(m.l(box['keep']) + m.l(x)))
    v = chainer.Variable(numpy.ones((2, 3), 'f'))

    def body(m, x, box):
        box['again'] = box['keep']
        return F.sum(m.l(box['keep']) + m.l(x))

    m.body = body
    box = {'keep': v}
    with pytest.warns(StaticGraphWarning, match='changes its argument'):
        m(numpy.ones((2, 3), 'f'), box)
    assert box['keep'] is v and box['again'] is v


def test_containers_read_only_still_replay():
    a, b = _twins(lambda m, x, box: F.sum(m.l(x) * box['scale'])
                  + F.sum(m.l(box['xs'][0])))
    rs = numpy.random.RandomState(1)
    for _ in range(4):
        x = rs.randn(2, 3).astype('f')
        xs = [rs.randn(2, 3).astype('f')]
        for m in (a, b):
            box = {'scale': 0.5, 'xs': list(xs)}
            m.cleargrads()
            m(x, box).backward()
            assert box['xs'][0] is xs[0] and box['scale'] == 0.5
        assert numpy.array_equal(a.l.W.grad, b.l.W.grad)
    assert caches_of(b)['forward'].replays == 3


def test_a_returned_container_argument_is_no_stale_object():
    """A method returning its container argument: replays hand out a new
    one with the recorded contents, never the recording call's own object
    (which the caller may have changed since)."""
    S = type('S', (Net,), {'forward': static_graph(Net.forward)})
    m = S(lambda m, x, box: (F.sum(m.l(x) * box['scale']), box))
    seen = []
    for step in range(4):
        loss, got = m(numpy.ones((2, 3), 'f'), {'scale': 2.0})
        loss.backward()
        assert got == {'scale': 2.0}, step
        got['step'] = step
        seen.append(got)
    assert caches_of(m)['forward'].replays == 3


def test_an_argument_appended_to_a_list_argument_is_the_callers():
    """The caller's Variable, not the recording's copy of it, lands in the
    caller's list (its gradient was 3.0 off at the recording call)."""
    S = type('S', (Net,), {'forward': static_graph(Net.forward)})

    def body(m, x, box):
        box.append(x)
        return F.sum(m.l(x))

    m = S(body)
    for _ in range(2):
        x = chainer.Variable(numpy.ones((2, 3), 'f'))
        box = []
        with warnings.catch_warnings():
            warnings.simplefilter('ignore')
            loss = m(x, box)
        assert box[0] is x
        (loss + F.sum(box[0] * 3)).backward()
        want = m.l.W.array.sum(axis=0) + 3
        assert numpy.allclose(x.grad, numpy.broadcast_to(want, (2, 3)))


def test_a_method_that_raises_leaves_the_callers_container_changed():
    S = type('S', (Net,), {'forward': static_graph(Net.forward)})

    def body(m, x, box):
        box['n'] = 1
        raise ValueError('stop')

    m = S(body)
    box = {'n': None, 'x': numpy.ones((2, 3), 'f')}
    with pytest.raises(ValueError, match='stop'):
        m(numpy.ones((2, 3), 'f'), box)
    assert box['n'] == 1


def test_one_container_given_twice_is_one_container_to_the_method():
    """``m(x, lst, lst)``: the method appends to one and reads the other,
    as one list (two copies gave 0.0 for 2.2, and the caller's list was
    left empty)."""
    class Two(chainer.Chain):
        def __init__(self):
            super(Two, self).__init__()
            with self.init_scope():
                self.l = L.Linear(3, 2)

        def forward(self, x, a, b):
            a.append(1)
            return F.sum(self.l(x)) * len(b)

    S = type('S', (Two,), {'forward': static_graph(Two.forward)})
    a, b = Two(), S()
    b.copyparams(a)
    x = numpy.ones((2, 3), 'f')
    for _ in range(2):
        got = []
        for m in (a, b):
            lst = []
            with warnings.catch_warnings():
                warnings.simplefilter('ignore')
                got.append((float(m(x, lst, lst).array), lst))
        assert got[0] == got[1] and got[0][1] == [1]


def test_a_container_argument_kept_on_the_chain_is_the_callers():
    S = type('S', (Net,), {'forward': static_graph(Net.forward)})

    def body(m, x, box):
        m.cfg = box
        return F.sum(m.l(x)) * box['s']

    m = S(body)
    for _ in range(2):
        box = {'s': 2.0}
        with warnings.catch_warnings():
            warnings.simplefilter('ignore')
            m(numpy.ones((2, 3), 'f'), box).backward()
        assert m.cfg is box


def test_containers_of_more_values_than_a_key_holds_run_define_by_run():
    """A 5,000-word vocabulary passed at each call: its key cost 7.6 ms a
    call (30x the call), and what the method added to it was lost without
    a warning (the check of changes stopped at 4,096 elements). Such a
    call runs define-by-run, warned once; the next ones skip the walk."""
    from static_graph import signature
    S = type('S', (Net,), {'forward': static_graph(Net.forward)})

    def body(m, x, vocab):
        vocab.setdefault('new', len(vocab))
        return F.sum(m.l(x)) * len(vocab)

    m = S(body)
    n = signature.MAX_KEY_VALUES + 10
    vocab = dict(('w%d' % i, i) for i in range(n))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        for i in range(3):
            loss = m(numpy.ones((2, 3), 'f'), vocab)
            loss.backward()
            assert len(vocab) == n + 1
    said = [str(w.message) for w in caught
            if issubclass(w.category, StaticGraphWarning)]
    assert len(said) == 1 and 'values' in said[0], said
    c = caches_of(m)['forward']
    assert (c.recordings, c.fallback_calls) == (0, 3) and c.too_many
    import static_graph as sg
    assert 'held more than %d values' % signature.MAX_KEY_VALUES in \
        sg.explain(m)


def test_a_container_argument_kept_inside_a_link_attribute_is_the_callers():
    """``self.kept = {'cfg': cfg}``: the recording's copy stayed there, so a
    later call reading ``self.kept`` missed what the caller changed."""
    S = type('S', (Net,), {'forward': static_graph(Net.forward)})

    def body(m, x, box):
        m.kept = ({'cfg': box}, [box])
        return F.sum(m.l(x)) * box['s']

    m = S(body)
    box = {'s': 2.0}
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        m(numpy.ones((2, 3), 'f'), box).backward()
    assert m.kept[0]['cfg'] is box and m.kept[1][0] is box


def test_a_call_of_too_many_values_among_calls_waiting_records():
    """A loss summed over calls, one of them with a container past the
    key's limit: it ran define-by-run among calls that are one node each,
    and the parameters' gradients came out in another order (2.4e-7)."""
    from static_graph import signature
    a, b = Net(_bigsum), type('S', (Net,), {
        'forward': static_graph(Net.forward)})(_bigsum)
    b.copyparams(a)
    big = [1.0] * (signature.MAX_KEY_VALUES + 1)
    rs = numpy.random.RandomState(3)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        for step in range(3):
            xs = [rs.randn(2, 3).astype('f') for _ in range(4)]
            for m in (a, b):
                m.cleargrads()
                loss = m(xs[0], [1.0]) + m(xs[1], [1.0])
                if step == 2:
                    loss = loss + m(xs[2], big)
                (loss + m(xs[3], [1.0])).backward()
            assert numpy.array_equal(a.l.W.grad, b.l.W.grad), step


def _bigsum(m, x, box):
    h = m.l(x)
    return F.sum(h * h) * len(box)


def test_calls_of_too_many_values_are_walked_again_after_a_while(
        monkeypatch):
    from static_graph import cache as cache_module
    from static_graph import signature
    monkeypatch.setattr(cache_module, 'TOO_MANY_SKIPS', 2)
    m = type('S', (Net,), {'forward': static_graph(Net.forward)})(_bigsum)
    x = numpy.ones((2, 3), 'f')
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        m(x, [1.0] * (signature.MAX_KEY_VALUES + 1)).backward()
        for _ in range(6):
            m(x, [1.0]).backward()
    c = caches_of(m)['forward']
    # 1 big + 2 skipped, then the small list is walked: it records, replays
    assert (c.fallback_calls, c.recordings, c.replays) == (3, 1, 3)
    assert not c.too_many


class _Frozen(dict):
    def __setitem__(self, k, v):
        raise TypeError('frozen')


def test_putting_kept_containers_back_leaves_other_attributes_alone():
    """A link attribute that is a dict refusing writes (the put-back wrote
    even unchanged values: TypeError), and a tuple held by two attributes
    (rebuilt once each: no longer one object)."""
    S = type('S', (Net,), {'forward': static_graph(Net.forward)})

    def body(m, x, box):
        t = (box,)
        m.kept, m.kept_too = t, t
        return F.sum(m.l(x)) * box['s']

    m = S(body)
    m.table = _Frozen({'a': [1, 2]})
    box = {'s': 2.0}
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        m(numpy.ones((2, 3), 'f'), box).backward()
    assert m.kept is m.kept_too and m.kept[0] is box
    assert m.table == {'a': [1, 2]}


def test_a_large_container_changed_among_waiting_calls_reaches_the_caller():
    """Past the key's value limit among calls that wait for their backward,
    a call records; what it changes in its container was not compared (the
    check stopped at 4096 elements): lost, and replayed without it."""
    from static_graph import signature
    S = type('S', (Net,), {'forward': static_graph(Net.forward)})

    def body(m, x, d):
        if len(d) > 100:
            d['out'] = 'seen'
        return F.sum(m.l(x))

    m = S(body)
    x = numpy.ones((2, 3), 'f')
    for _ in range(3):
        big = dict((i, i) for i in range(signature.MAX_KEY_VALUES + 10))
        with warnings.catch_warnings():
            warnings.simplefilter('ignore')
            (m(x, {'small': 1}) + m(x, big)).backward()
        assert big['out'] == 'seen'


@pytest.mark.parametrize('make', [
    lambda: [1.0, 2.0],
    lambda: {'scale': 1.0},
], ids=['list', 'dict'])
def test_a_container_that_holds_itself_runs_define_by_run(make):
    """A list or dict that holds itself walked into a RecursionError while
    its key was built; such a call runs define-by-run, warned once, with
    the same numbers."""
    def body(m, x, box):
        return F.sum(m.l(x)) * len(box)
    a, b = _twins(body)
    box = make()
    if isinstance(box, list):
        box.append(box)
    else:
        box['self'] = box
    rs = numpy.random.RandomState(0)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        for _ in range(3):
            x = rs.randn(2, 3).astype('f')
            for m in (a, b):
                m.cleargrads()
                m(x, box).backward()
            assert numpy.array_equal(a.l.W.grad, b.l.W.grad)
    said = [str(x.message) for x in w
            if issubclass(x.category, StaticGraphWarning)]
    assert len(said) == 1 and 'holds itself' in said[0], said


def _normalizes(m, x, cfg):
    cfg['k'] = int(cfg['k'])             # 2.0 -> 2
    cfg['z'] = cfg['z'] * -1.0           # 0.0 -> -0.0
    return F.sum(m.l(x)) * cfg['k']


def test_a_change_of_kind_in_a_container_argument_reaches_the_caller():
    """2.0 -> 2 and 0.0 -> -0.0 compare equal: the caller's dict kept 2.0
    and 0.0, and the key replayed."""
    a, b = _twins(_normalizes)
    ca, cb = {'k': 2.0, 'z': 0.0}, {'k': 2.0, 'z': 0.0}
    x = numpy.ones((2, 3), 'f')
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        for step in range(3):
            a(x, ca), b(x, cb)
            assert repr(ca) == repr(cb), step


def test_an_argument_nested_past_the_limit_runs_define_by_run():
    """A dict nested 700 deep passed the key's walk and then crashed the
    recording's copy of it (RecursionError)."""
    from static_graph import signature

    def body(m, x, box):
        return F.sum(m.l(x))
    a, b = _twins(body)
    box = {}
    inner = box
    for _ in range(700):
        inner['d'] = {}
        inner = inner['d']
    x = numpy.ones((2, 3), 'f')
    with pytest.warns(StaticGraphWarning, match='more than %d deep'
                      % signature.MAX_NESTING):
        assert b(x, box).array == a(x, box).array


def test_a_name_given_to_an_argument_reaches_the_caller():
    """x.name = 'input' in the method (for a graph dump) stayed on the
    recording's copy, and the key replayed without it."""
    def body(m, x, box):
        x.name = 'input'
        box[0].name = 'first'
        return F.sum(m.l(x)) + F.sum(m.l(box[0]))
    a, b = _twins(body)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        for step in range(3):
            vs = [[chainer.Variable(numpy.ones((2, 3), 'f'))
                   for _ in range(2)] for _ in range(2)]
            for m, v in zip((a, b), vs):
                m(v[0], [v[1]]).backward()
            assert [v.name for v in vs[0]] == [v.name for v in vs[1]] == \
                ['input', 'first'], step


_KEPT = {}


def _memo(where):
    def body(m, x, box):
        if where == 'helper':
            if m.helper.cfg is None:
                m.helper.cfg = box               # a helper object's memo
            s = m.helper.cfg['s']
        elif where == 'global':
            _KEPT.setdefault(id(m), box)         # a module global's memo
            s = _KEPT[id(m)]['s']
        elif where == 'ordered dict':            # (a regression of bb9881e)
            if getattr(m, 'kept', None) is None:
                m.kept = collections.OrderedDict(cfg=box)
            s = m.kept['cfg']['s']
        else:                                    # deep in a link attribute
            if getattr(m, 'kept', None) is None:
                m.kept = {'a': {'b': {'c': {'d': box}}}}
            s = m.kept['a']['b']['c']['d']['s']
        return F.sum(m.l(x)) * s
    return body


@pytest.mark.parametrize('where', ['helper', 'global', 'ordered dict',
                                   'deep'])
def test_a_config_argument_kept_anywhere_is_the_callers(where):
    """The method keeps the caller's config (no arrays in it) where the
    put-back of kept copies did not look: it stayed the recording's copy,
    and the caller's later change never reached it (16.1 for 24.1)."""
    a, b = _twins(_memo(where))
    for m in (a, b):
        m.helper = types.SimpleNamespace(cfg=None)
    boxes = [{'s': 2.0}, {'s': 2.0}]
    x = numpy.ones((2, 3), 'f')
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        for step in range(4):
            if step == 2:
                for box in boxes:
                    box['s'] = 3.0
            ys = []
            for m, box in zip((a, b), boxes):
                m.cleargrads()
                ys.append(m(x, box))
                ys[-1].backward()
            assert ys[0].array == ys[1].array, step
            assert numpy.array_equal(a.l.W.grad, b.l.W.grad), step
    if where == 'ordered dict':
        assert b.kept['cfg'] is boxes[1]


def test_a_config_argument_the_method_reaches_another_way_is_one_object():
    """``model(x, model.cfg)``: the method doubled it through the argument
    and read it through the attribute, which saw the old value."""
    def body(m, x, box):
        box['s'] = box['s'] * 2.0
        return F.sum(m.l(x)) * m.cfg['s']
    a, b = _twins(body)
    a.cfg, b.cfg = {'s': 1.0}, {'s': 1.0}
    x = numpy.ones((2, 3), 'f')
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        for step in range(3):
            assert a(x, a.cfg).array == b(x, b.cfg).array, step


def test_new_containers_the_method_puts_into_an_argument_hold_the_callers():
    """``box['hist'] = box['hist'] + [h]``, ``box['pair'] = (box['a'], x)``:
    the caller's dict got the recording's copies one level down (a traced
    array, a Variable whose gradient never reached the caller's)."""
    def body(m, x, box):
        h = F.tanh(m.l(x))
        box['hist'] = box['hist'] + [h]
        box['pair'] = (box['a'], x)
        return F.sum(h)
    a, b = _twins(body)
    numpy.random.seed(1)
    encs = [L.Linear(3, 3), L.Linear(3, 3)]
    encs[1].copyparams(encs[0])
    rs = numpy.random.RandomState(0)
    z, x, arr = [rs.randn(2, 3).astype('f') for _ in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        for m, enc in zip((a, b), encs):
            enc.cleargrads()
            v0 = enc(z)
            box = {'hist': [v0], 'a': arr}
            loss = m(x, box) + F.sum(box['hist'][0] * box['hist'][0])
            loss.backward()
            assert box['hist'][0] is v0
            assert box['pair'][0] is arr
    assert numpy.array_equal(encs[0].W.grad, encs[1].W.grad)


def test_a_key_that_costs_more_than_its_replay_saves_runs_define_by_run():
    """A dict of 1,000 entries given at each call to a model of 7 ops: the
    key cost 4x the call it saved. Past VALUES_PER_OP entries an op, its
    calls run define-by-run (warned once); a small dict still replays."""
    from static_graph import signature

    def body(m, x, vocab):
        return F.sum(m.l(x)) * 1.0
    x = numpy.ones((2, 3), 'f')
    for n, replays in ((20, True), (2000, False)):
        a, b = _twins(body)
        vocab = dict(('w%d' % i, i) for i in range(n))
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter('always')
            for _ in range(6):
                for m in (a, b):
                    m.cleargrads()
                    m(x, vocab).backward()
                assert numpy.array_equal(a.l.W.grad, b.l.W.grad)
        cache, = caches_of(b).values()
        assert (cache.replays > 0) == replays, n
        said = [str(x.message) for x in w if 'costs more' in str(x.message)]
        assert len(said) == (0 if replays else 1), said
        if not replays:
            assert '%d values' % n in said[0]
    assert 20 < signature.VALUES_PER_OP * 7 < 2000


def test_arrays_inside_tuples_count_towards_a_keys_cost():
    """1,000 (array, array) pairs at each call to a model of a few ops:
    counted as no values, they replayed at 2.5x define-by-run's time. A
    list of arrays alone (an NStep RNN's sequences) still replays."""
    class Pairs(chainer.Chain):
        def __init__(self):
            super(Pairs, self).__init__()
            with self.init_scope():
                self.l = L.Linear(8, 4)

        @static_graph
        def forward(self, pairs):
            return F.sum(self.l(F.stack([
                p[0] if isinstance(p, tuple) else p for p in pairs])))

    rs = numpy.random.RandomState(0)
    arrs = [rs.randn(8).astype('f') for _ in range(1000)]
    for given, replays in (([(a, a[:2].copy()) for a in arrs], False),
                           (arrs[:64], True)):
        m = Pairs()
        with warnings.catch_warnings():
            warnings.simplefilter('ignore')
            for _ in range(4):
                m.cleargrads()
                m(given).backward()
        cache, = caches_of(m).values()
        assert (cache.replays > 0) == replays
