"""Robustness: cache guards, bad input, exceptions and threads.

The promise is the same numbers as define-by-run, or an honest fallback /
a clear error; every test here checks the static chain against its
define-by-run twin.
"""
import gc
import sys
import threading
from unittest import mock
import warnings

import numpy
import pytest

import chainer
import chainer.functions as F
import chainer.links as L

import static_graph
from static_graph import StaticGraphWarning
from static_graph.decorator import caches_of
from tests.twins import assert_close, compare_chains, static_twins

rs = numpy.random.RandomState(11)


def data(*shape, dtype=numpy.float32):
    return rs.standard_normal(shape).astype(dtype)


class Base(chainer.Chain):
    def __init__(self):
        super(Base, self).__init__()
        with self.init_scope():
            self.l1 = L.Linear(3, 4)
            self.l2 = L.Linear(4, 2)


def make_twins(body, **options):
    plain = type('Plain', (Base,), {'forward': body})
    deco = static_graph.static_graph(**options) if options else \
        static_graph.static_graph
    static = type('Static', (Base,), {'forward': deco(body)})
    numpy.random.seed(0)
    a = plain()
    b = static()
    b.copyparams(a)
    return a, b


def mlp(self, x, t=None):
    h = F.relu(self.l1(x))
    y = self.l2(h)
    if t is None:
        return F.sum(y * y)
    return F.softmax_cross_entropy(y, t)


def cache(chain):
    caches = caches_of(chain)
    assert len(caches) == 1, caches
    return list(caches.values())[0]


def step(m, *args, **kwargs):
    m.cleargrads()
    loss = m(*args, **kwargs)
    loss.backward()
    return loss


# -- cache guards -------------------------------------------------------------
@pytest.mark.parametrize('every', [1, 3])
def test_a_key_that_records_again_at_every_call_runs_define_by_run(every):
    """A link attribute the method reads, set anew by the caller before
    every call: each recording is stale at the next call. After 3 such
    recordings in a row that never replayed, the key runs define-by-run,
    warned once (each recording cost about two iterations). Changed every
    third call (replays in between) it keeps recording and replaying. Bit
    for bit either way."""
    def body(self, x):
        return F.sum(self.l2(self.l1(x)) * self.scale)

    a, b = make_twins(body)
    x = data(4, 3)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        for i in range(9):
            for m in (a, b):
                m.scale = 1.0 + i // every
            la, lb = step(a, x), step(b, x)
            assert la.array == lb.array
            compare_chains(a, b, rtol=0, atol=0)
    said = [str(m.message) for m in w
            if issubclass(m.category, StaticGraphWarning) and
            'records again at every call' in str(m.message)]
    c = cache(b)
    if every == 1:
        assert len(said) == 1 and 'scale' in said[0], said
        assert (c.recordings, c.replays, c.fallback_calls) == (3, 0, 6)
        assert 'runs define-by-run for 3 more calls (of 8)' in \
            static_graph.explain(b)
    else:
        assert not said
        assert (c.recordings, c.replays) == (3, 6)


@pytest.mark.parametrize('per_step', [1, 2])
def test_a_key_whose_recordings_went_stale_records_again_later(per_step):
    """A warm-up schedule: a link attribute the method reads changes at
    each of the first 6 steps, then stays. After 3 stale recordings the key
    runs define-by-run for 8 calls, then records once more and, the value
    settled, replays from then on. Also where each step's loss sums two
    calls of the key (the count goes on across the calls waiting for one
    backward). Bit for bit throughout."""
    def body(self, x):
        return F.sum(self.l2(self.l1(x)) * self.beta)

    a, b = make_twins(body)
    x = data(4, 3)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', StaticGraphWarning)
        for i in range(24):
            for m in (a, b):
                m.beta = 0.1 * min(i, 6)
                m.cleargrads()
                loss = sum(m(x) for _ in range(per_step))
                loss.backward()
            compare_chains(a, b, rtol=0, atol=0)
    c = cache(b)
    assert c.replays >= 8 * per_step
    assert c.recordings <= 5 * per_step


def _fgsm(self, x):
    if x.grad is not None:
        x = x + 0.1 * x.grad
    return F.sum(self.l2(self.l1(x)) ** 2)


def _fgsm_var(self, x):
    if x.grad_var is not None:
        x = x + 0.1 * x.grad_var
    return F.sum(self.l2(self.l1(x)) ** 2)


def _clears(self, x):
    x.cleargrad()
    return F.sum(self.l2(self.l1(x)) ** 2)


def _sets(self, x):
    x.grad = numpy.ones_like(x.array)
    return F.sum(self.l2(self.l1(x)) ** 2)


def _zeroes_then_writes(self, x):
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', DeprecationWarning)
        x.zerograd()
    x.grad[...] = 1
    return F.sum(self.l2(self.l1(x)) ** 2)


def _inner_backward(self, x):
    F.sum(x * x).backward()
    return F.sum(self.l2(self.l1(x)) ** 2)


def _inner_grad(self, x):
    chainer.grad([F.sum(x * x)], [x], None, None, True)   # set_grad
    return F.sum(self.l2(self.l1(x)) ** 2)


def _inner_grad_retained(self, x):
    chainer.grad([F.sum(x * x)], [x], retain_grad=True)
    return F.sum(self.l2(self.l1(x)) ** 2)


def test_a_penalty_computed_inside_the_method_replays():
    """chainer.grad inside the method without set_grad (a gradient
    penalty's) only computes: it replays, bit for bit."""
    def body(self, x):
        h = self.l1(x)
        g, = chainer.grad([F.sum(h * h)], [h], enable_double_backprop=True)
        return F.sum(self.l2(h) ** 2) + F.sum(g * g)

    a, b = make_twins(body)
    with warnings.catch_warnings():
        warnings.simplefilter('error', StaticGraphWarning)
        for i in range(5):
            x = data(4, 3)
            la, lb = step(a, x), step(b, x)
            assert la.array == lb.array
            compare_chains(a, b, rtol=0, atol=0)
    assert (cache(b).recordings, cache(b).replays) == (1, 4)


@pytest.mark.parametrize('body,what', [
    (_fgsm, 'gradient of argument x (.grad)'),
    (_fgsm_var, 'gradient of argument x (.grad_var)'),
    (_clears, 'gradient of argument x (.cleargrad()'),
    (_sets, 'gradient of argument x (.grad ='),
    (_zeroes_then_writes, 'gradient of argument x (.zerograd()'),
    (_inner_backward, 'runs a backward inside the method (y.backward())'),
    (_inner_grad, 'runs a backward inside the method (chainer.grad(..., '
     'set_grad=True))'),
    (_inner_grad_retained, 'runs a backward inside the method '
     '(chainer.grad(..., retain_grad=True))')],
    ids=['grad', 'grad_var', 'cleargrad', 'set', 'zerograd', 'backward',
         'chainer.grad', 'chainer.grad retained'])
def test_the_method_using_an_argument_variables_gradient_falls_back(
        body, what):
    """A Variable argument's gradient used by the method (an FGSM step
    reads ``x.grad``; clears, sets or zeroes and writes it; a backward
    inside the method sets it): the recording call sees and sets the
    caller's gradient, as define-by-run does, and the key falls back,
    naming the use; bit for bit at every call (the caller's x.grad too),
    whether the first call's x had a gradient."""
    for first_has_grad in (True, False):
        a, b = make_twins(body)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter('always')
            for i in range(5):
                x, g = data(4, 3), data(4, 3)
                xa, xb = chainer.Variable(x), chainer.Variable(x.copy())
                if first_has_grad or i % 2:
                    xa.grad, xb.grad = g, g.copy()
                la, lb = step(a, xa), step(b, xb)
                assert la.array == lb.array
                assert numpy.array_equal(xa.grad, xb.grad)
                compare_chains(a, b, rtol=0, atol=0)
        said = [str(m.message) for m in w
                if issubclass(m.category, StaticGraphWarning)]
        assert len(said) == 1 and what in said[0], said
        assert cache(b).recordings == 1


def test_gradients_a_penalty_inside_the_method_retains_are_kept():
    """``chainer.grad(..., retain_grad=True)`` inside the method sets the
    gradient of every Variable on its way (``h`` the method keeps and
    returns), which replay would not: the key falls back, and those
    gradients are define-by-run's at every call."""
    def body(self, x):
        h = self.l1(x)
        y = self.l2(F.leaky_relu(h))
        gx, = chainer.grad([F.sum(y)], [x], retain_grad=True,
                           enable_double_backprop=True)
        self.h = h
        return F.sum(gx * gx) + F.sum(y), h

    a, b = make_twins(body)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        for i in range(4):
            x = data(6, 3)
            outs = []
            for m in (a, b):
                loss, h = m(chainer.Variable(x.copy()))
                outs.append((h.grad, m.h.grad))
                m.cleargrads()
                loss.backward()
            for ga, gb in zip(*outs):
                assert ga is not None and numpy.array_equal(ga, gb)
            compare_chains(a, b, rtol=0, atol=0)
    said = [str(m.message) for m in w
            if issubclass(m.category, StaticGraphWarning)]
    assert len(said) == 1 and 'retain_grad=True' in said[0], said


def test_a_variable_arguments_name_is_part_of_the_key():
    """A method may branch on an argument Variable's name: calls with
    another name are another key, bit for bit with define-by-run."""
    def body(self, x):
        h = self.l2(self.l1(x))
        if x.name == 'double':
            h = h * 2
        return F.sum(h * h)

    a, b = make_twins(body)
    x = data(4, 3)
    with warnings.catch_warnings():
        warnings.simplefilter('error', StaticGraphWarning)
        for i in range(6):
            name = 'double' if i % 2 else None
            la = step(a, chainer.Variable(x, name=name))
            lb = step(b, chainer.Variable(x, name=name))
            assert la.array == lb.array
            compare_chains(a, b, rtol=0, atol=0)
    assert cache(b).recordings == 2


def test_cache_size_keeps_the_most_recently_used_keys():
    a, b = make_twins(mlp, cache_size=2)
    with warnings.catch_warnings():
        warnings.simplefilter('error', StaticGraphWarning)
        for n in (2, 3, 4):
            step(b, data(n, 3))
    keys = [s.key for s in static_graph.cached(b)]
    assert len(keys) == 2, keys
    assert not any('[2,3]' in k for k in keys), keys
    assert any('[3,3]' in k for k in keys) and any('[4,3]' in k for k in keys)
    # batch 3 becomes the most recent; a new key evicts batch 4
    step(b, data(3, 3))
    step(b, data(5, 3))
    keys = [s.key for s in static_graph.cached(b)]
    assert any('[3,3]' in k for k in keys) and any('[5,3]' in k for k in keys)
    assert not any('[4,3]' in k for k in keys), keys
    c = cache(b)
    assert c.recordings == 4 and c.replays == 1
    # an evicted key records again and is still correct
    for n in (2, 4, 2):
        x = data(n, 3)
        la, lb = step(a, x), step(b, x)
        assert_close(la.array, lb.array, 'loss, batch %d' % n)
        compare_chains(a, b)
    assert len(static_graph.cached(b)) == 2


def test_eviction_while_a_backward_is_pending():
    a, b = make_twins(mlp, cache_size=1)
    for m in (a, b):
        step(m, data(2, 3))
        step(m, data(2, 3))
    x2, x3 = data(2, 3), data(3, 3)
    for m in (a, b):
        m.cleargrads()
        l2 = m(x2)          # replay of batch 2
        l3 = m(x3)          # records batch 3 and evicts batch 2
        (l2 + l3).backward()
    compare_chains(a, b)
    assert len(static_graph.cached(b)) == 1


def test_warn_retrace_names_what_changed():
    a, b = make_twins(mlp, warn_retrace=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        for n in (2, 3):
            step(b, data(n, 3))
        assert not [w for w in caught
                    if issubclass(w.category, StaticGraphWarning)]
        step(b, data(4, 3))
    ours = [str(w.message) for w in caught
            if issubclass(w.category, StaticGraphWarning)]
    assert len(ours) == 1, ours
    msg = ours[0]
    assert 'recorded 3 times' in msg
    assert '[3,3]' in msg and '[4,3]' in msg, msg   # the shape that changed


def test_warn_retrace_repeats_at_doubling_counts():
    """A chain that keeps recording warns at warn_retrace x 1, 2, 4, 8...
    recordings, not at every multiple: a long run does not fill the log."""
    a, b = make_twins(mlp, warn_retrace=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        for n in range(1, 21):
            for _ in range(4):       # a new batch size records, then
                step(b, data(n, 3))  # replays (keys that do repeat)
    ours = [str(w.message) for w in caught
            if issubclass(w.category, StaticGraphWarning)]
    counts = [int(m.split('recorded ')[1].split(' ')[0])
              for m in ours if 'has recorded' in m]
    assert counts == [2, 4, 8, 16], counts
    assert not any('keys do not repeat' in m for m in ours)


def test_calls_of_one_key_before_one_backward_build_once():
    """A loss summed over calls of one key (PTB's truncated BPTT): each
    call records (the first has no entry before the backward), one builds,
    the others are served by its entry, none of it is a retrace to warn
    about, and the numbers are define-by-run's."""
    from static_graph import build as build_module
    a, b = make_twins(mlp, warn_retrace=2)
    with warnings.catch_warnings(record=True) as caught, \
            mock.patch.object(build_module, 'build',
                              wraps=build_module.build) as built:
        warnings.simplefilter('always')
        for k in range(3):
            xs = [data(2, 3) for _ in range(5)]
            for m in (a, b):
                m.cleargrads()
                loss = sum(m(x) for x in xs)
                loss.backward()
            compare_chains(a, b)
            if k == 0:
                assert built.call_count == 1
    assert built.call_count == 1
    c = cache(b)
    assert (c.recordings, c.replays) == (5, 10)
    assert not [w for w in caught
                if issubclass(w.category, StaticGraphWarning)], \
        [str(w.message) for w in caught]


@pytest.mark.parametrize('again', [0, 1])
def test_second_backward_through_a_call_another_call_built_for(again):
    """Two calls of one key before one backward, then a second backward
    through one of them: where that call's entry was not built (the other
    call's serves the key), it tells the entry that serves its key, so
    that replayed calls keep what a second backward reads."""
    a, b = make_twins(mlp)
    for k in range(3):
        x1, x2 = data(2, 3), data(2, 3)
        for m in (a, b):
            m.cleargrads()
            losses = m(x1), m(x2)
            (losses[0] + 2 * losses[1]).backward()
            losses[again].backward()
        compare_chains(a, b)
    c = cache(b)
    assert (c.recordings, c.replays) == (2, 4)


def test_keys_that_do_not_repeat_stop_recording():
    """After 4 recordings of new keys with fewer than 3 replays each, a
    new key runs define-by-run (at its speed, with its numbers) until its
    third call, which records: warned once and shown by explain(). A
    method whose keys repeat keeps recording new keys at once."""
    from static_graph import cache as cache_module
    window = cache_module.RECORDING_WINDOW
    assert window == 4
    a, b = make_twins(mlp)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        for n in range(1, 31):
            x = data(n, 3)
            step(a, x)
            step(b, x)
            compare_chains(a, b, rtol=0, atol=0)
    c = cache(b)
    assert (c.recordings, c.replays, c.fallback_calls) == (window, 0,
                                                          30 - window)
    gave_up = [w for w in caught if 'keys do not repeat' in str(w.message)]
    assert len(gave_up) == 1
    assert 'keys do not repeat' in static_graph.explain(b)
    # A key that does repeat records at its third call, then replays.
    x = data(40, 3)
    for i in range(5):
        step(a, x)
        step(b, x)
        compare_chains(a, b, rtol=0, atol=0)
    assert (c.recordings, c.replays, c.fallback_calls) == \
        (window + 1, 2, 30 - window + 2)

    # 4 shapes, each used 4 times: 12 replays in the first window; then
    # new keys record at once.
    a, b = make_twins(mlp)
    for n in list(range(1, window + 1)) * 4 + list(
            range(window + 1, 2 * window + 1)):
        step(b, data(n, 3))
    c = cache(b)
    assert c.probation is None and (c.recordings, c.replays) == (
        2 * window, 3 * window)


def test_more_cycling_keys_than_the_cache_holds_stop_recording():
    """32 batch sizes in turn, the cache holding 16: each key's entry is let
    go before it comes back. Training recorded a key at every third
    sighting for ever, and evaluation with backprop enabled (no backward)
    recorded at every call (about 9x define-by-run's time): the sightings
    a new key needs now double while recordings are not followed by
    replays, and keys without a backward wait for them too."""
    for train in (True, False):
        a, b = make_twins(mlp)
        for i in range(32 * 12):
            x = data(2 + i % 32, 3)
            if train:
                step(b, x)
            else:
                b(x)
        c = cache(b)
        assert c.sightings >= 3 * 8, (train, c.sightings)
        assert c.recordings < 32 * 12 / 8, (train, c.recordings)


def test_per_key_tables_are_bounded():
    from static_graph import cache as cache_module
    t = dict((k, k) for k in range(cache_module.KEYS_REMEMBERED + 5))
    cache_module.bound(t)
    assert len(t) == cache_module.KEYS_REMEMBERED and 0 not in t and \
        cache_module.KEYS_REMEMBERED + 4 in t


def test_warnings_and_recordings_keep_no_class_alive():
    """A notebook cell run again defines its Chain and FunctionNode classes
    again: the warning-once table and the recorder's per-class facts kept
    every old class alive (and all its methods hold)."""
    import weakref

    def cell():
        class Twice(chainer.FunctionNode):
            def forward(self, xs):
                return xs[0] * 2,

            def backward(self, indexes, gys):
                return gys[0] * 2,

        class Net(chainer.Chain):
            def __init__(self):
                super(Net, self).__init__()
                with self.init_scope():
                    self.l = L.Linear(3, 2)

            @static_graph.static_graph
            def forward(self, x):
                h = Twice().apply((self.l(x),))[0]
                if float(F.sum(h).array) > 1e9:     # a read: falls back
                    h = h * 2
                return F.sum(h)

        m = Net()
        with warnings.catch_warnings():
            warnings.simplefilter('ignore')
            for _ in range(2):
                m(data(2, 3)).backward()
        return weakref.ref(Net), weakref.ref(Twice)

    refs = [cell() for _ in range(3)]
    gc.collect()
    assert all(r() is None for pair in refs for r in pair)


def test_warn_retrace_names_a_changed_config_flag():
    a, b = make_twins(mlp, warn_retrace=2)
    x = data(2, 3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        step(b, x)
        with chainer.using_config('train', False):
            step(b, x)
    ours = [str(w.message) for w in caught
            if issubclass(w.category, StaticGraphWarning)]
    assert len(ours) == 1 and 'train' in ours[0], ours


def test_warn_retrace_names_a_changed_link_value():
    """A value the method reads changes before every call (a dict entry on
    a child link): each call records again, and the warning says which."""
    def body(self, x):
        return F.sum(self.l2(self.l1(x))) * self.l1.hp['scale']

    a, b = make_twins(body, warn_retrace=2)
    b.l1.hp = {'scale': 1.0}
    x = data(2, 3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        for i in range(3):
            b.l1.hp['scale'] = 1.0 + i
            step(b, x)
    ours = [str(w.message) for w in caught
            if issubclass(w.category, StaticGraphWarning)]
    assert len(ours) == 1 and 'attribute self.l1.hp changed' in ours[0], ours


def test_explain_lists_keys_and_fallback_reasons():
    def body(self, x, branch=False):
        h = self.l1(x)
        if branch and float(F.sum(h).array) > 0:
            h = -h
        return F.sum(self.l2(h) ** 2)

    a, b = make_twins(body)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', StaticGraphWarning)
        step(b, data(2, 3))
        step(b, data(2, 3))
        step(b, data(2, 3), branch=True)
    text = static_graph.explain(b)
    assert '2 recordings' in text and '1 replays' in text
    assert 'complete' in text and 'fallback' in text
    assert 'reads array values' in text and 'float()' in text
    assert 'test_robustness.py' in text
    assert text.count('f32[2,3]') == 2, text
    states = sorted(s.state for s in static_graph.cached(b))
    assert states == ['complete', 'fallback']
    fb = [s for s in static_graph.cached(b) if s.state == 'fallback'][0]
    assert 'reads array values' in fb.reason


def test_explain_on_a_chain_never_called():
    a, b = make_twins(mlp)
    assert 'no static-graph cache' in static_graph.explain(b)
    assert static_graph.cached(b) == []


def test_explain_on_a_chain_whose_links_are_decorated():
    """``L.Classifier`` around a predictor whose forward is decorated (the
    README's pattern): explain() reports the predictor's cache, where it
    said there was none."""
    a, b = make_twins(mlp)
    model = L.Classifier(b, lossfun=lambda y, t: F.sum(y))
    model.compute_accuracy = False
    for i in range(3):
        model.cleargrads()
        model(data(2, 3), numpy.zeros(2, 'i')).backward()
    text = static_graph.explain(model)
    assert 'no static-graph cache of its own' in text, text
    assert '/predictor (' in text and '2 replays' in text, text


def test_bad_options_are_rejected():
    with pytest.raises(ValueError, match='cache_size'):
        static_graph.static_graph(cache_size=0)
    with pytest.raises(TypeError, match='unknown option'):
        static_graph.static_graph(cache_sise=3)
    # (Each of these was taken, then raised from inside a recording:
    # ZeroDivisionError, '<' not supported, or at the third call.)
    for bad in (0, -1, 'x', None, 2.5, True):
        with pytest.raises(ValueError, match='warn_retrace must be'):
            static_graph.static_graph(warn_retrace=bad)
    with pytest.raises(ValueError, match='cache_size must be'):
        static_graph.static_graph(cache_size=True)


class _Plain(object):
    def forward(self, x):
        return x * 2


@pytest.mark.parametrize('how', [
    'plain function', 'method of another class', 'staticmethod over it',
    'classmethod over it', 'over a staticmethod'])
def test_misuse_is_told_clearly(how):
    """Each of these failed at the first call with an error from deep
    inside (``'numpy.ndarray' object has no attribute '__dict__'``,
    ``'NotAChain' object has no attribute 'namedlinks'``), or not at all
    until a wrong argument count."""
    deco = static_graph.static_graph
    x = numpy.ones(3, 'f')
    with pytest.raises(TypeError, match='static_graph decorates a method '
                       'of a Chain'):
        if how == 'plain function':
            deco(lambda v: v * 2)(x)
        elif how == 'method of another class':
            type('P', (_Plain,), {'forward': deco(_Plain.forward)})(
            ).forward(x)
        elif how == 'staticmethod over it':
            type('C', (chainer.Chain,), {'f': staticmethod(deco(
                lambda v: v * 2))})().f(x)
        elif how == 'classmethod over it':
            type('C', (chainer.Chain,), {'f': classmethod(deco(
                lambda cls, v: v * 2))})().f(x)
        else:
            deco(staticmethod(lambda v: v * 2))


class _Base(chainer.Chain):
    def __init__(self):
        super(_Base, self).__init__()
        with self.init_scope():
            self.l = L.Linear(3, 2)

    @static_graph.static_graph
    def forward(self, x):
        return F.sum(self.l(x))


class _Sub(_Base):
    @static_graph.static_graph
    def forward(self, x):
        return F.sum(F.tanh(self.l(x)) * 3)


def _named_wrapper(fn):
    """A user's decorator without functools.wraps: every method it makes
    is named ``wrapper``."""
    def wrapper(self, *args):
        return fn(self, *args)
    return static_graph.static_graph(wrapper)


class _Coder(chainer.Chain):
    def __init__(self):
        super(_Coder, self).__init__()
        with self.init_scope():
            self.enc = L.Linear(3, 3)
            self.dec = L.Linear(3, 2)

    encode = _named_wrapper(lambda self, x: F.tanh(self.enc(x)))
    decode = _named_wrapper(lambda self, h: F.sum(self.dec(h) ** 2))


def test_decorated_functions_of_one_name_have_caches_of_their_own():
    """Caches were kept per chain under the method's name: a base class's
    decorated forward called on a subclass that decorates its own replayed
    the subclass's recording (1.94 for -0.02), two methods both named
    ``wrapper`` replayed each other's, and a method defined again on the
    class kept replaying the old one."""
    x = numpy.random.RandomState(0).randn(4, 3).astype('f')
    m = _Sub()
    for _ in range(3):
        sub, base = m(x), _Base.forward(m, x)
        (sub + base).backward()
        with chainer.using_config('use_static_graph', False):
            assert sub.array == m(x).array
            assert base.array == _Base.forward(m, x).array
    assert sub.array != base.array
    assert caches_of(m)['forward'].replays == 2
    c = _Coder()
    for _ in range(3):
        out = c.decode(c.encode(x))
        out.backward()
        with chainer.using_config('use_static_graph', False):
            assert out.array == c.decode(c.encode(x)).array
    assert sorted(k.rsplit('.', 1)[-1] for k in caches_of(c)) == [
        'wrapper', 'wrapper']

    class Again(_Base):
        pass

    a = Again()
    a(x)
    a(x)
    Again.forward = static_graph.static_graph(
        lambda self, x: F.sum(self.l(x) * 5))
    Again.forward.__name__ = 'forward'
    got = a(x).array
    with chainer.using_config('use_static_graph', False):
        assert got == a(x).array


# -- bad input ----------------------------------------------------------------
class Opaque(object):
    scale = 2.0


def scaled(self, x, opt=None):
    y = F.sum(self.l2(F.relu(self.l1(x))) ** 2)
    if opt is not None:
        y = y * len(opt) if hasattr(opt, '__len__') else y * opt.scale
    return y


@pytest.mark.parametrize('arg,typename', [
    (Opaque(), 'Opaque'),
    ({1, 2}, 'set'),
    (frozenset([3]), 'frozenset'),
    (range(3), 'range'),
    ([1, Opaque()], 'Opaque'),
])
def test_unsupported_argument_type_warns_and_runs_define_by_run(arg,
                                                                typename):
    a, b = make_twins(scaled)
    for i in range(2):
        x = data(2, 3)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter('always')
            la, lb = step(a, x, arg), step(b, x, arg)
        assert_close(la.array, lb.array, 'loss')
        compare_chains(a, b)
        ours = [str(w.message) for w in caught
                if issubclass(w.category, StaticGraphWarning)]
        if i == 0:
            assert len(ours) == 1, ours
            assert 'opt' in ours[0] and typename in ours[0], ours[0]
            assert 'define-by-run' in ours[0]
        else:
            assert not ours, 'warned twice: %r' % ours
    assert lb.creator is not None and 'StaticGraph' not in \
        type(lb.creator).__name__


def test_dict_with_unhashable_key_type_warns():
    def body(self, x, d):
        return F.sum(self.l1(x)) * len(d)

    a, b = make_twins(body)
    with pytest.warns(StaticGraphWarning, match=r"argument d has a dict key "
                      r"of type Opaque"):
        y = b(data(2, 3), {Opaque(): 1})
    assert y.shape == ()


def call_error(m, *args, **kwargs):
    try:
        m(*args, **kwargs)
    except Exception as e:
        return type(e), str(e)
    return None


@pytest.mark.parametrize('args,kwargs', [
    ((), {}),                                   # missing x
    ((1, 2, 3), {}),                            # too many
    (('x',), {'x': 1}),                         # x twice
    ((None,), {'u': 1}),                        # unknown keyword
])
def test_wrong_call_structure_raises_the_define_by_run_type_error(args,
                                                                  kwargs):
    a, b = make_twins(mlp)
    ea, eb = call_error(a, *args, **kwargs), call_error(b, *args, **kwargs)
    assert ea is not None and ea[0] is TypeError
    assert ea == eb
    assert all(not c.entries for c in caches_of(b).values())


@pytest.mark.parametrize('dtype', [numpy.float64, numpy.float16,
                                   numpy.int32])
def test_input_dtype_mismatch_with_parameters(dtype):
    """float64 input to float32 Linear: whatever define-by-run does, static
    does the same, with the same message, before and after a recording."""
    a, b = make_twins(mlp)
    x = data(2, 3).astype(dtype)
    ea, eb = call_error(a, x), call_error(b, x)
    assert ea == eb, (ea, eb)
    assert ea is not None and 'dtype' in ea[1]
    # after a good recording, the bad call still fails the same way and
    # leaves the cache usable
    for m in (a, b):
        step(m, data(2, 3))
    ea, eb = call_error(a, x), call_error(b, x)
    assert ea == eb
    x = data(2, 3)
    la, lb = step(a, x), step(b, x)
    assert_close(la.array, lb.array, 'loss after the bad call')
    c = cache(b)
    assert c.recordings == 1 and c.replays == 1
    assert [s.state for s in static_graph.cached(b)] == ['complete']


def test_labels_of_the_wrong_dtype():
    a, b = make_twins(mlp)
    x, t = data(2, 3), numpy.array([0.0, 1.0])
    ea, eb = call_error(a, x, t), call_error(b, x, t)
    assert ea == eb and ea is not None


def test_uninitialized_variable_argument():
    a, b = make_twins(mlp)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        ea, eb = call_error(a, chainer.Variable()), \
            call_error(b, chainer.Variable())
    assert ea == eb, (ea, eb)
    ours = [str(w.message) for w in caught
            if issubclass(w.category, StaticGraphWarning)]
    assert len(ours) == 1 and 'argument x' in ours[0] and \
        'uninitialized Variable' in ours[0], ours


def test_wrong_input_shape_gives_the_define_by_run_error():
    a, b = make_twins(mlp)
    for m in (a, b):
        step(m, data(2, 3))
    ea, eb = call_error(a, data(2, 5)), call_error(b, data(2, 5))
    assert ea == eb and ea is not None
    x = data(2, 3)
    assert_close(step(a, x).array, step(b, x).array, 'loss after')


def test_list_and_python_scalars_as_input():
    a, b = make_twins(mlp)
    for arg in ([[0.1, 0.2, 0.3]], 1.5, numpy.float32(2.0)):
        ea, eb = call_error(a, arg), call_error(b, arg)
        assert ea == eb and ea is not None


def test_nan_and_inf_inputs():
    a, b = make_twins(mlp)
    for m in (a, b):
        step(m, data(2, 3))
    for bad in (numpy.nan, numpy.inf):
        x = data(2, 3)
        x[0, 1] = bad
        for m in (a, b):
            m.cleargrads()
        with numpy.errstate(all='ignore'):
            la, lb = step(a, x), step(b, x)
        assert_close(la.array, lb.array, 'loss with %r' % bad)
        compare_chains(a, b)
    x = data(2, 3)
    assert_close(step(a, x).array, step(b, x).array, 'loss after NaN')
    compare_chains(a, b)


# -- exceptions ---------------------------------------------------------------
class Fail(Exception):
    pass


def test_exception_in_user_code_while_recording_leaves_no_entry():
    # the failing call and the good ones have the very same key
    state = {'fail': True}

    def body2(self, x):
        h = F.relu(self.l1(x))
        if state['fail']:
            state['fail'] = False
            raise Fail('boom')
        return F.sum(self.l2(h) ** 2)

    a, b = make_twins(body2)
    with pytest.raises(Fail):
        b(data(2, 3))
    assert not cache(b).entries
    assert static_graph.cached(b) == []
    for i in range(3):
        x = data(2, 3)
        la, lb = step(a, x), step(b, x)
        assert_close(la.array, lb.array, 'loss %d' % i)
        compare_chains(a, b)
    c = cache(b)
    assert c.recordings == 1 and c.replays == 2


class MaybeRaise(chainer.FunctionNode):
    """A pure user op whose forward or backward raises on demand."""

    arm = {'forward': 0, 'backward': 0}
    exc = KeyboardInterrupt

    def forward(self, inputs):
        if MaybeRaise.arm['forward']:
            MaybeRaise.arm['forward'] -= 1
            raise MaybeRaise.exc('interrupted in forward')
        x, = inputs
        return x * 2,

    def backward(self, indexes, grad_outputs):
        return MaybeRaiseGrad().apply(grad_outputs)


class MaybeRaiseGrad(chainer.FunctionNode):
    def forward(self, inputs):
        if MaybeRaise.arm['backward']:
            MaybeRaise.arm['backward'] -= 1
            raise MaybeRaise.exc('interrupted in backward')
        gy, = inputs
        return gy * 2,

    def backward(self, indexes, grad_outputs):
        return grad_outputs[0] * 2,


def raising(self, x):
    h = MaybeRaise().apply((F.relu(self.l1(x)),))[0]
    return F.sum(self.l2(h) ** 2)


def snapshot(chain):
    return {n: (p.array.copy(), None if p.grad is None else p.grad.copy())
            for n, p in chain.namedparams()}


def assert_unchanged(chain, snap):
    for n, p in chain.namedparams():
        numpy.testing.assert_array_equal(p.array, snap[n][0], n)
        if snap[n][1] is None:
            assert p.grad is None, n
        else:
            numpy.testing.assert_array_equal(p.grad, snap[n][1], n)


@pytest.fixture
def disarm():
    MaybeRaise.arm.update(forward=0, backward=0)
    yield
    MaybeRaise.arm.update(forward=0, backward=0)


@pytest.mark.parametrize('where', ['forward', 'backward'])
@pytest.mark.parametrize('when', ['recording', 'replay'])
def test_interrupt_leaves_params_and_grads_and_next_call_is_right(
        where, when, disarm):
    a, b = make_twins(raising)
    if when == 'replay':
        for i in range(2):
            x = data(2, 3)
            step(a, x)
            step(b, x)
    snap = snapshot(b)
    MaybeRaise.arm[where] = 1
    with pytest.raises(KeyboardInterrupt):
        loss = b(data(2, 3))
        loss.backward()
    assert MaybeRaise.arm[where] == 0
    assert_unchanged(b, snap)
    compare_chains(a, b)
    for i in range(3):
        x = data(2, 3)
        la, lb = step(a, x), step(b, x)
        assert_close(la.array, lb.array, 'loss %d after the interrupt' % i)
        compare_chains(a, b)
    assert [s.state for s in static_graph.cached(b)] == ['complete']


def test_interrupt_between_two_calls_of_one_iteration(disarm):
    """An interrupted call while another call's backward is pending must not
    spoil the pending call's saved values."""
    def body(self, x, fail=False):
        h = F.relu(self.l1(x))
        h = MaybeRaise().apply((h,))[0]
        return F.sum(self.l2(h) ** 2)

    a, b = make_twins(body)
    for i in range(2):
        x = data(2, 3)
        step(a, x)
        step(b, x)
    x1, x2 = data(2, 3), data(2, 3)
    for m in (a, b):
        m.cleargrads()
        l1 = m(x1)
        if m is b:
            MaybeRaise.arm['forward'] = 1
            with pytest.raises(KeyboardInterrupt):
                m(x2)
        l1.backward()
    compare_chains(a, b)


def test_kernel_raising_in_a_recorded_schedule(disarm):
    """Make one op of the recorded forward schedule raise once (patched in
    the schedule before its first replay)."""
    a, b = make_twins(mlp)
    x = data(2, 3)
    step(a, x)
    step(b, x)
    sched = static_graph.cached(b)[0].forward
    op = [o for o in sched.ops if o.kind == 'ReLU'][0]
    orig = op.fn
    calls = {'n': 0}

    def once(inputs):
        calls['n'] += 1
        if calls['n'] == 1:
            raise KeyboardInterrupt('kernel interrupted')
        return orig(inputs)

    op.fn = once
    snap = snapshot(b)
    with pytest.raises(KeyboardInterrupt):
        b(data(2, 3))
    assert_unchanged(b, snap)
    for i in range(4):   # interpreted, then compiled
        x = data(2, 3)
        la, lb = step(a, x), step(b, x)
        assert_close(la.array, lb.array, 'loss %d after the interrupt' % i)
        compare_chains(a, b)


def test_error_raised_in_recording_backward_records_again(disarm):
    a, b = make_twins(raising)
    MaybeRaise.exc = RuntimeError
    try:
        MaybeRaise.arm['backward'] = 1
        loss = b(data(2, 3))
        with pytest.raises(RuntimeError):
            loss.backward()
    finally:
        MaybeRaise.exc = KeyboardInterrupt
    for i in range(3):
        x = data(2, 3)
        la, lb = step(a, x), step(b, x)
        assert_close(la.array, lb.array, 'loss %d' % i)
        compare_chains(a, b)
    assert [s.state for s in static_graph.cached(b)] == ['complete']
    assert cache(b).replays >= 1


def _fail_then_retry(a, b):
    """Each twin: a call whose backward raises (MaybeRaise, armed), then
    the same loss's backward again, after cleargrads."""
    x = data(2, 3)
    for m in (a, b):
        loss = m(x)
        MaybeRaise.arm['backward'] = 1
        with pytest.raises(RuntimeError, match='interrupted'):
            loss.backward()
        m.cleargrads()
        loss.backward()


def test_backward_retried_after_the_recording_calls_backward_raised(disarm):
    """``loss.backward()`` raised in the recording call's backward (a
    node's backward, Ctrl-C); the loop retries it on the same loss: the
    gradients are define-by-run's, and later calls record and replay."""
    a, b = make_twins(raising)
    MaybeRaise.exc = RuntimeError
    try:
        _fail_then_retry(a, b)
    finally:
        MaybeRaise.exc = KeyboardInterrupt
    compare_chains(a, b, rtol=0, atol=0)
    for i in range(3):
        x = data(2, 3)
        la, lb = step(a, x), step(b, x)
        assert la.array == lb.array
        compare_chains(a, b, rtol=0, atol=0)
    assert cache(b).replays >= 1


def test_backward_retried_after_a_replayed_calls_backward_raised(disarm):
    """A replayed call's backward raised partway (its activations may be
    spent): a retry on the same loss raises a clear error instead of a
    TypeError; the key then keeps its activations, so the next such
    retry works, bit for bit."""
    a, b = make_twins(raising)
    # (Set before the calls: the watch sees a class attribute the code
    # names replaced, and the next call records again.)
    MaybeRaise.exc = RuntimeError
    try:
        for i in range(2):
            x = data(2, 3)
            step(a, x)
            step(b, x)
        loss = b(data(2, 3))
        MaybeRaise.arm['backward'] = 1
        with pytest.raises(RuntimeError, match='interrupted'):
            loss.backward()
        with pytest.raises(RuntimeError, match='raised partway'):
            loss.backward()
        a.cleargrads()
        b.cleargrads()
        _fail_then_retry(a, b)
    finally:
        MaybeRaise.exc = KeyboardInterrupt
    compare_chains(a, b, rtol=0, atol=0)
    assert cache(b).replays >= 3


class RaisesInBackward(chainer.FunctionNode):
    """Scales by a number computed from its input (so a replay runs its
    backward() again); its backward raises at the ``countdown``-th
    backward."""

    countdown = [0]

    def forward(self, inputs):
        x, = inputs
        self.n = float(abs(x).sum()) + 1.0
        return x / self.n,

    def backward(self, indexes, grad_outputs):
        if RaisesInBackward.countdown[0]:
            RaisesInBackward.countdown[0] -= 1
            if not RaisesInBackward.countdown[0]:
                raise FloatingPointError('bad gradient')
        return grad_outputs[0] / self.n,


@pytest.mark.parametrize('when', ['recording', 'replay'])
def test_a_failed_backward_over_two_calls_leaves_no_partial_gradients(when):
    """A backward of a loss summed over two calls raises in the second
    call it reaches (after cleargrads); the loop skips the micro-batch and
    goes on accumulating the next ones. Chainer's table of the failed
    backward, with the first call's contributions, is dropped: the
    parameters keep none of them, as under define-by-run."""
    def body(self, x):
        h = RaisesInBackward().apply((F.relu(self.l1(x)),))[0]
        return F.sum(self.l2(h) ** 2)

    a, b = make_twins(body)
    oa, ob = (chainer.optimizers.SGD(0.01).setup(m) for m in (a, b))
    try:
        for i in range(4):
            batches = [(data(5, 3), data(5, 3)) for _ in range(3)]
            for m, o in ((a, oa), (b, ob)):
                m.cleargrads()
                for k, (x1, x2) in enumerate(batches):
                    loss = m(x1) + m(x2)
                    if k == 0 and i == (0 if when == 'recording' else 2):
                        RaisesInBackward.countdown[0] = 2
                        with pytest.raises(FloatingPointError):
                            loss.backward()
                    else:
                        loss.backward()
                o.update()
            compare_chains(a, b, rtol=0, atol=0)
    finally:
        RaisesInBackward.countdown[0] = 0
    assert cache(b).replays >= 6


# -- threads ------------------------------------------------------------------
@pytest.fixture
def fast_switching():
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(old)


def run_threads(worker, n):
    errors = []

    def wrap(k):
        try:
            worker(k)
        except BaseException as e:   # reported in the main thread
            errors.append(e)

    threads = [threading.Thread(target=wrap, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def test_threads_forward_only(fast_switching):
    def body(self, x):
        h = F.relu(self.l1(x))
        return self.l2(F.dropout(h, 0.5)), h

    a, b = make_twins(body)
    inputs = [data(3, 3) for _ in range(8)]
    with chainer.using_config('train', False), chainer.no_backprop_mode():
        expected = [tuple(v.array for v in a(x)) for x in inputs]

    def worker(k):
        # chainer.config is thread-local: set the flags in the thread
        with chainer.using_config('train', False), \
                chainer.no_backprop_mode():
            for it in range(60):
                i = (k + it) % len(inputs)
                y, h = b(inputs[i])
                assert_close(y.array, expected[i][0], 'thread %d y' % k)
                assert_close(h.array, expected[i][1], 'thread %d h' % k)

    run_threads(worker, 4)
    # (Calls made while another thread records the chain run
    # define-by-run: decorator._record. Once it is recorded, all replay.)
    before = cache(b).replays
    run_threads(worker, 4)
    assert cache(b).replays - before == 240


def _grad_twins(body):
    a, b = make_twins(body)
    inputs = [data(3, 3) for _ in range(8)]
    expected = []
    for x in inputs:
        xv = chainer.Variable(x.copy())
        out = a(xv)
        outs = out if isinstance(out, tuple) else (out,)
        gx, = chainer.grad([outs[0]], [xv])
        expected.append((tuple(o.array for o in outs), gx.array))
    return a, b, inputs, expected


def _grad_worker(b, inputs, expected, iters):
    def worker(k):
        for it in range(iters):
            i = (k + it) % len(inputs)
            xv = chainer.Variable(inputs[i].copy())
            out = b(xv)
            outs = out if isinstance(out, tuple) else (out,)
            gx, = chainer.grad([outs[0]], [xv])
            for j, (o, e) in enumerate(zip(outs, expected[i][0])):
                assert_close(o.array, e, 'thread %d output %d' % (k, j))
            assert_close(gx.array, expected[i][1], 'thread %d grad' % k)
    return worker


def test_threads_forward_and_backward_on_one_chain(fast_switching):
    def body(self, x):
        return F.sum(self.l2(F.relu(self.l1(x))) ** 2)

    a, b, inputs, expected = _grad_twins(body)
    run_threads(_grad_worker(b, inputs, expected, 60), 4)
    # (Calls made while another thread records the chain run
    # define-by-run, as many as the timing allows: decorator._record.
    # Once it is recorded, all replay.)
    before = cache(b).replays
    run_threads(_grad_worker(b, inputs, expected, 60), 4)
    assert cache(b).replays - before == 240


def test_threads_forward_and_backward_returning_a_static_buffer(
        fast_switching):
    """The returned ``h`` lives in a buffer replay refreshes in place (ReLU's
    backward holds it); another thread's replay must not change it before
    it is copied out."""
    def body(self, x):
        h = F.relu(self.l1(x))
        return F.sum(self.l2(h) ** 2), h

    a, b, inputs, expected = _grad_twins(body)
    run_threads(_grad_worker(b, inputs, expected, 150), 4)


def test_threads_recording_the_same_key_at_once(fast_switching):
    for trial in range(3):
        a, b, inputs, expected = _grad_twins(mlp)
        start = threading.Barrier(4)
        worker = _grad_worker(b, inputs, expected, 10)

        def go(k):
            start.wait()
            worker(k)

        run_threads(go, 4)
        states = [s.state for s in static_graph.cached(b)]
        assert states == ['complete'], states


class WithBN(Base):
    def __init__(self):
        super(WithBN, self).__init__()
        with self.init_scope():
            self.bn = L.BatchNormalization(4)

    def forward(self, x):
        return self.l2(F.relu(self.bn(self.l1(x))))


def test_threads_recording_keys_of_one_chain_with_persistents(
        fast_switching):
    """Inference on one model with BatchNormalization from four threads,
    each of its own batch size: a recording holds traced views of the
    running statistics on the links while it runs, and another thread's
    recording took them for arrays computed with NumPy: keys fell back for
    good (in 6 runs of 6, most never replayed again). A call made while
    another thread records the chain now runs define-by-run."""
    S = type('S', (WithBN,), {
        'forward': static_graph.static_graph(WithBN.forward)})
    for trial in range(3):
        a, b = WithBN(), S()
        b.copyparams(a)
        start = threading.Barrier(4)

        def go(k):
            x = data(3 + k, 3)
            start.wait()
            with chainer.using_config('train', False), \
                    chainer.no_backprop_mode():
                for it in range(20):
                    y = b(x)
                    with chainer.using_config('train', False):
                        assert_close(y.array, a(x).array, 'thread %d' % k,
                                     rtol=0, atol=0)

        run_threads(go, 4)
        states = [s.state for s in static_graph.cached(b)]
        assert states and set(states) == {'complete'}, states
        # (How many calls ran define-by-run while another thread recorded
        # depends on the timing; once a key is recorded, it replays.)
        before = cache(b).replays
        with chainer.using_config('train', False), \
                chainer.no_backprop_mode():
            for k in range(4):
                x = data(3 + k, 3)
                b(x)
        assert cache(b).replays - before == len(states)


def _paused_in(module, name, cls=None):
    """Patch ``module.name`` (or ``cls.name``) to wait, in threads other
    than the main one, for ``go`` after setting ``paused``."""
    paused, go = threading.Event(), threading.Event()
    owner = cls if cls is not None else module
    orig = getattr(owner, name)

    def wait_then(*args, **kwargs):
        if threading.current_thread() is not threading.main_thread():
            paused.set()
            assert go.wait(20)
        return orig(*args, **kwargs)

    return mock.patch.object(owner, name, wait_then), paused, go


def test_a_replay_before_the_recording_call_is_bound(fast_switching):
    """The recording call's backward makes its key's entry replayable,
    then binds the call to it (``RecordNode.bind``). A replay of another
    thread in between took the static buffers; the bind took them back
    unseen: that replay's backward raised ("buffers were reused by a
    later call"; in 2 of 60 runs of four threads), and a second backward
    through the recording call would have read the replay's values. Both
    backward passes now get define-by-run's gradients."""
    class Conv(chainer.Chain):
        def __init__(self):
            super(Conv, self).__init__()
            with self.init_scope():
                self.c = L.Convolution2D(2, 4, 3, pad=1)
                self.l = L.Linear(4 * 3 * 3, 5)

        def forward(self, x):
            h = F.relu(self.c(x))     # (a static buffer: returned)
            return F.sum(self.l(F.max_pooling_2d(h, 2)) ** 2) + F.sum(h)

    S = type('S', (Conv,), {
        'forward': static_graph.static_graph(Conv.forward)})
    numpy.random.seed(0)
    a, b = Conv(), S()
    b.copyparams(a)
    x1, x2 = data(2, 2, 6, 6), data(2, 2, 6, 6)
    expected = {}
    for name, x in (('rec', x1), ('replay', x2)):
        xv = chainer.Variable(x.copy())
        loss = a(xv)
        expected[name] = chainer.grad([loss], [xv])[0].array
    patch, paused, go = _paused_in(None, 'bind', static_graph.nodes
                                   .RecordNode)
    grads = {}
    with patch:
        xv1 = chainer.Variable(x1.copy())
        loss1 = b(xv1)                        # records

        def backward_of_the_recording():
            grads['rec'] = chainer.grad([loss1], [xv1])[0].array
            # a second backward through the recording call
            grads['rec again'] = chainer.grad([loss1], [xv1])[0].array

        t = threading.Thread(target=backward_of_the_recording)
        t.start()
        try:
            assert paused.wait(20)
            e, = [c.entry for c in static_graph.cached(b)]
            assert e.state == 'complete' and e.static_storages
            xv2 = chainer.Variable(x2.copy())
            loss2 = b(xv2)                    # replays before the bind
            grads['replay'] = chainer.grad([loss2], [xv2])[0].array
        finally:
            go.set()
            t.join(20)
    assert cache(b).replays == 1
    for name in ('rec', 'replay'):
        assert numpy.array_equal(grads[name], expected[name]), name
    assert numpy.array_equal(grads['rec again'], expected['rec'])


def test_entries_no_recording_call_binds_keep_no_snapshot():
    """A replay puts the recording's values aside only while a recording
    call's backward is about to bind it: a first version did so at the
    first replay of every entry without a backward (no_backprop_mode) and
    kept them for good."""
    a, b = make_twins(mlp)
    x = data(5, 3)
    with chainer.no_backprop_mode():
        for _ in range(3):
            b(x)
    e, = [c.entry for c in static_graph.cached(b)]
    assert cache(b).replays == 2
    assert e.unbound_snapshot is None and not e.bind_pending


def _infer(m, x):
    with chainer.using_config('train', False), chainer.no_backprop_mode():
        m(x)


def test_another_threads_recording_replaces_no_array(fast_switching):
    """A recording holds traced views of the links' arrays on them while
    its call runs (BatchNormalization's statistics); the backward of
    another thread's recording call ending meanwhile took them for arrays
    the user replaced: its entry was let go, and at the second time the
    key fell back for good ("a parameter or persistent array is
    replaced")."""
    S = type('S', (WithBN,), {
        'forward': static_graph.static_graph(WithBN.forward)})
    from static_graph import link_state
    b = S()
    for trial in range(2):
        patch, paused, go = _paused_in(link_state, 'untrace_held')
        with patch, chainer.using_config('train', False):
            xv = chainer.Variable(data(3, 3))
            loss = F.sum(b(xv))               # records a key of batch 3
            t = threading.Thread(target=_infer, args=(b, data(4 + trial, 3)))
            t.start()                         # records another, paused
            try:
                assert paused.wait(20)
                chainer.grad([loss], [xv])
            finally:
                go.set()
                t.join(20)
    text = static_graph.explain(b)
    assert 'replaced' not in text, text
    assert [c.state for c in static_graph.cached(b)] == ['complete'] * 3


def test_threads_with_a_key_that_falls_back(fast_switching):
    """One thread's key falls back (a value read at batch 1) while seven
    others record and replay theirs: counting that key's define-by-run
    calls walked the cache's entries without its lock, and other threads'
    calls moved them ("OrderedDict mutated during iteration", in 21 of 30
    runs); ``explain()`` likewise."""
    def body(self, x):
        h = F.relu(self.l1(x))
        if len(x) == 1 and float(h.array.sum()) > -1e9:
            h = h * 1
        return self.l2(h)

    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        for trial in range(4):
            a, b = make_twins(body)
            start = threading.Barrier(8)

            def go(k):
                x = data(1 if k == 0 else 1 + k % 7, 3)
                with chainer.no_backprop_mode():
                    for it in range(150):
                        if it < 2:
                            start.wait(20)
                        b(x)
                        if k == 7:
                            static_graph.explain(b)

            run_threads(go, 8)


def test_calls_while_another_thread_records_a_child_are_no_new_keys(
        fast_switching):
    """Calls of a parent run define-by-run while another thread records
    its decorated child: each was counted as a new key recorded, and after
    four the parent warned that its keys do not repeat, and new keys ran
    define-by-run until called three times."""
    class Child(chainer.Chain):
        def __init__(self):
            super(Child, self).__init__()
            with self.init_scope():
                self.l = L.Linear(5, 8)

        @static_graph.static_graph
        def forward(self, x):
            return self.l(x)

    class Parent(chainer.Chain):
        def __init__(self, c):
            super(Parent, self).__init__()
            with self.init_scope():
                self.c = c
                self.o = L.Linear(8, 2)

        @static_graph.static_graph
        def forward(self, x):
            return F.sum(self.o(F.relu(self.c.l(x))))

    from static_graph import capture
    c = Child()
    p = Parent(c)
    xs = [data(n, 5) for n in range(1, 9)]
    patch, paused, go = _paused_in(capture.Capture, 'forward',
                                   capture.Capture)
    with patch, warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        t = threading.Thread(target=c, args=(xs[0],))
        t.start()
        try:
            assert paused.wait(20)
            for x in xs[1:6]:       # five new keys, while the child records
                p.cleargrads()
                p(x).backward()
        finally:
            go.set()
            t.join(20)
        for x in xs[6:8]:
            for _ in range(2):
                p.cleargrads()
                p(x).backward()
    assert not [x for x in w if 'do not repeat' in str(x.message)]
    assert ' 2 recordings, 2 replays' in static_graph.explain(p)


def test_thread_local_config_is_in_the_key(fast_switching):
    """A thread in eval mode and one in train mode share one chain."""
    def body(self, x):
        return self.l2(F.dropout(F.relu(self.l1(x)), 0.9))

    a, b = make_twins(body)
    x = data(4, 3)
    with chainer.using_config('train', False):
        expected = a(x).array

    def worker(k):
        if k % 2:
            with chainer.using_config('train', False):
                for _ in range(40):
                    assert_close(b(x).array, expected, 'eval thread')
        else:
            for _ in range(40):
                y = b(x)
                F.sum(y).backward()

    run_threads(worker, 4)


def test_config_key_follows_every_change():
    """config_key() remembers the keys of configurations it has seen; a
    change back and forth, a new flag, an unhashable value and another
    thread's flags each give the key of the configuration as it is."""
    from static_graph import signature

    def fresh():
        saved = dict(signature._config_keys)
        signature._config_keys.clear()
        try:
            return signature.config_key()
        finally:
            signature._config_keys.update(saved)

    seen = []
    for value in (True, False, True, [1, 2], 3, None):
        with chainer.using_config('sg_test_flag', value):
            key = signature.config_key()
            assert key == fresh()
            assert dict(key)['sg_test_flag'] == signature._hashable(value)
            seen.append(key)
    assert seen[0] == seen[2] and len(set(seen)) == 5
    # Equal values of other types are other keys (the method may branch on
    # the type: 1 columns kept, 1.0 a scale), remembered or not.
    equal = (1, 1.0, True, 0, False, 0.0, -0.0, (1, 2), (1.0, 2.0),
             (True, 2), (0.0, 1), (-0.0, 1), ((1,),), ((True,),),
             ((1.0,), 2), numpy.float32(1), numpy.float64(1))
    keys = []
    for _ in range(2):
        for value in equal:
            with chainer.using_config('sg_test_flag', value):
                key = signature.config_key()
                assert key == fresh(), value
                keys.append(key)
    assert len(set(keys)) == len(equal)
    other = []
    with chainer.using_config('sg_test_flag', 'main'):
        t = threading.Thread(target=lambda: other.append(
            signature.config_key()))
        t.start()
        t.join()
        assert 'sg_test_flag' not in dict(other[0])
        assert dict(signature.config_key())['sg_test_flag'] == \
            signature._hashable('main')


def test_a_fallback_for_every_size_is_remembered_for_the_family():
    """A method that falls back for a reason no size changes (it reads a
    value in Python) falls back at two batch sizes; further sizes run
    define-by-run without recording; keys of another family (another
    number of axes, another config) still record."""
    def body(self, x):
        h = self.l1(x)
        scale = 2.0 if float(h.array.sum()) > 0 else 3.0
        return F.sum(self.l2(h)) * scale

    a, b = make_twins(body)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', StaticGraphWarning)
        for n in range(1, 11):
            x = data(n, 3)
            step(a, x)
            step(b, x)
            compare_chains(a, b, rtol=0, atol=0)
        c = cache(b)
        assert (c.recordings, c.fallback_calls) == (2, 8)
        with chainer.using_config('train', False):
            step(b, data(4, 3))
        assert c.recordings == 3


@pytest.mark.parametrize('sizes', ['new at each call', 'one'])
def test_a_fallback_skips_the_key_after_enough_calls(sizes):
    """After SHORTCUT_AFTER calls in a row of one argument outline ran
    define-by-run for one fallback reason, their family's (a new size at
    each call: two sizes fell back for one reason) or their key's own (one
    size: the kit's CNN text classifier on sentences of one length, 64
    arrays to key at every call), calls of that outline and configuration
    run define-by-run without computing their key (the same numbers);
    another configuration computes it again; and explain() says so."""
    from static_graph import cache as cache_module
    from static_graph import signature

    def body(self, x):
        h = self.l1(x)
        scale = 2.0 if float(h.array.sum()) > 0 else 3.0
        return F.sum(self.l2(h)) * scale

    a, b = make_twins(body)
    walks = []
    flatten = signature.flatten

    def counting(*args):
        walks.append(1)
        return flatten(*args)
    recorded = 2 if sizes == 'new at each call' else 1
    with warnings.catch_warnings(), mock.patch.object(
            signature, 'flatten', counting):
        warnings.simplefilter('ignore', StaticGraphWarning)
        for n in range(1, recorded + cache_module.SHORTCUT_AFTER + 6):
            x = data(n if recorded == 2 else 4, 3)
            step(a, x)
            step(b, x)
            compare_chains(a, b, rtol=0, atol=0)
        c = cache(b)
        assert (c.recordings, c.replays) == (recorded, 0)
        assert c.shortcuts and \
            len(walks) == recorded + cache_module.SHORTCUT_AFTER
        assert 'without computing its key' in static_graph.explain(b)
        with chainer.using_config('train', False):
            step(b, data(4, 3))
        assert len(walks) == recorded + 1 + cache_module.SHORTCUT_AFTER


def test_a_fallback_at_one_size_only_is_not_the_familys():
    """Fallbacks for different reasons at two sizes (or at one size) do
    not make the family fall back."""
    def body(self, x):
        h = self.l1(x)
        if x.shape[0] == 2:
            h = h * float(h.array.sum() > 0)     # reads a value
        return F.sum(self.l2(h))

    a, b = make_twins(body)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', StaticGraphWarning)
        for n in (2, 3, 4, 3, 4):
            x = data(n, 3)
            step(a, x)
            step(b, x)
            compare_chains(a, b, rtol=0, atol=0)
    c = cache(b)
    assert (c.recordings, c.replays) == (3, 2) and not c.family_fallbacks


def test_calls_that_never_get_a_backward_replay_their_forward():
    """Evaluation with backprop enabled (no no_backprop_mode): each call's
    outputs are let go without a backward. After two recordings in a row
    like that, the next call records (its backward recorded from a
    stand-in gradient once it too is let go) and the key replays, with define-by-run's numbers, unwarned;
    other keys (training) keep replaying. A backward that does come later
    through a replayed call, even long after, gives define-by-run's
    gradients."""
    a, b = make_twins(mlp)
    x, xe = data(4, 3), data(5, 3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        for i in range(6):
            step(a, x)
            step(b, x)
            compare_chains(a, b, rtol=0, atol=0)
            with chainer.using_config('train', False):
                ya, yb = a(xe), b(xe)     # let go: no backward
            assert ya.array == yb.array
            if i == 4:
                kept = ya, yb             # a replayed call's
            del ya, yb
    c = cache(b)
    assert (c.recordings, c.replays, c.fallback_calls) == (4, 8, 0)
    assert not [w for w in caught
                if issubclass(w.category, StaticGraphWarning)], \
        [str(w.message) for w in caught]
    assert 'stand-in gradient' in static_graph.explain(b)
    with chainer.using_config('train', False):
        later = a(xe), b(xe)
    step(a, x)
    step(b, x)
    for ya, yb in (later, kept):
        a.cleargrads()
        b.cleargrads()
        ya.backward()
        yb.backward()
        compare_chains(a, b, rtol=0, atol=0)


def test_evaluation_that_keeps_the_last_output_replays():
    """Chainer's custom-loop example evaluates with ``loss = model(x, t)``
    in a loop, backprop enabled: each call's output lives until the next
    call returns, so each call finds the last one's recording waiting for
    a backward. Those calls stop recording too (they recorded at every
    call, twice define-by-run's time), with define-by-run's numbers: two
    recordings let go, one of them seen late, the stand-in recording and
    one more made while it waited."""
    a, b = make_twins(mlp)
    xs = [data(5, 3) for _ in range(8)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        with chainer.using_config('train', False):
            for x in xs:
                ya = a(x)
                yb = b(x)
                assert ya.array == yb.array
    c = cache(b)
    assert (c.recordings, c.replays, c.fallback_calls) == (5, 3, 0)
    assert not [w for w in caught
                if issubclass(w.category, StaticGraphWarning)], \
        [str(w.message) for w in caught]
    for m, y in ((a, ya), (b, yb)):
        m.cleargrads()
        y.backward()
    compare_chains(a, b, rtol=0, atol=0)


def test_calls_that_never_get_a_backward_of_two_outputs_run_define_by_run():
    """Where a backward cannot be recorded from a stand-in gradient (two
    outputs: which would a later backward come through?), such calls run
    define-by-run after two recordings let go, warned once, shown by
    explain()."""
    def two(self, x):
        y = self.l2(F.relu(self.l1(x)))
        return F.sum(y * y), y

    a, b = make_twins(two)
    xe = data(5, 3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        for i in range(5):
            ra, rb = a(xe), b(xe)
            assert ra[0].array == rb[0].array
            del ra, rb
    c = cache(b)
    assert (c.recordings, c.replays, c.fallback_calls) == (3, 0, 2)
    ours = [str(w.message) for w in caught
            if issubclass(w.category, StaticGraphWarning)]
    assert len(ours) == 1 and 'get no backward' in ours[0] and \
        'returns 2 Variables' in ours[0], ours
    assert 'get no backward' in static_graph.explain(b)


def test_a_call_let_go_once_records_again_and_replays():
    """A first call whose output is dropped (a shape check before
    training) does not stop the key from replaying."""
    a, b = make_twins(mlp)
    x = data(4, 3)
    b(x)
    for _ in range(3):
        step(a, x)
        step(b, x)
        compare_chains(a, b, rtol=0, atol=0)
    c = cache(b)
    assert (c.recordings, c.replays, c.fallback_calls) == (2, 2, 0)


def test_recording_and_define_by_run_calls_in_one_backward(monkeypatch):
    """Found by the differential fuzzer (benchmarks/fuzz.py --exact, seed
    11, with new keys put on probation after 4 recordings): a method that
    reads a value (so each recording falls back), called twice per
    backward ``(l1 + 2 * l2).backward()`` over two micro-batches. Under
    probation the third call of the new key records while the fourth runs
    define-by-run; W's gradient was (old + g4) + g3 where define-by-run
    makes (old + g3) + g4 while the recording call, one node, had its
    inputs' rank: Chainer reached it after the other call's Linear. It
    now has the rank of the method's last node (nodes.deepen)."""
    from static_graph import cache as cache_module
    from tests import fuzz_grammar as G
    monkeypatch.setattr(cache_module, 'RECORDING_WINDOW', 4)
    monkeypatch.setattr(G, 'EXACT', True)
    prog = G.Program(
        'float32', (2,), 'ce', 2, ['self.out1 = L.Linear(2, 2)'],
        ['h = chainer.as_variable(h)', 'if float(F.sum(h).array) > 0:',
         '    h = F.relu(h)', 'else:', '    h = h * -0.5',
         'y = self.out1(h)', 'loss = F.softmax_cross_entropy(y, t)'],
        'loss,', ['linear'], 6)
    S = G.Step
    seq = [S('forward_only', 2, 1, False, None, None, 'array', False),
           S('train', 2, 1, True, None, None, 'array', True),
           S('eval', 2, 1, False, None, None, 'array', False),
           S('train', 2, 1, False, 'sum', None, 'var', True),
           S('train', 2, 2, False, 'sum', None, 'var_nograd', True)]
    G.check_example(prog, seq, 0)


def test_a_stand_in_backward_changes_nothing_a_real_backward_reads(
        monkeypatch):
    """Found by the differential fuzzer (benchmarks/fuzz.py --exact, seed
    441) in a first version that recorded the stand-in backward at once,
    through the very call whose outputs the user held: F.hinge's backward
    flips the sign of part of its node's ``bottom_diff`` in place, and
    the training call's real backward, served from that call's saved
    arrays, flipped it back (an input gradient 1.06 off). The stand-in
    backward now runs only on a call whose outputs were let go."""
    from tests import fuzz_grammar as G
    monkeypatch.setattr(G, 'EXACT', True)
    prog = G.Program(
        'float32', (2,), 'ce', 2, ['self.out1 = L.Linear(2, 2)'],
        ['h = chainer.as_variable(h)', 'h = F.relu(h)', 'y = self.out1(h)',
         'loss = F.hinge(y, t)'], 'loss,', ['linear'], 6)
    S = G.Step
    seq = [S('forward_only', 3, 1, True, 'sum', None, 'var', False),
           S('train', 3, 1, True, None, None, 'var', True),
           S('forward_only', 3, 2, True, 'sum', None, 'var', False),
           S('train', 3, 2, True, 'separate', None, 'var', True)]
    G.check_example(prog, seq, 0)


def test_changed_compares_values_nans_equal():
    """arrayutil.changed (did user code write into an array it was
    handed?): values compared, NaNs equal to NaNs, -0.0 to 0.0; any other
    difference, of value, NaN position or shape, is a change."""
    from static_graph.arrayutil import changed
    a = numpy.array([1.0, numpy.nan, 0.0, 3.0], 'f')
    b = a.copy()
    assert not changed(a, b)
    b[2] = -0.0
    assert not changed(a, b)
    b[3] = 4.0
    assert changed(a, b)
    b = a.copy()
    b[1] = 2.0
    assert changed(a, b) and changed(b, a)
    c = a.astype(numpy.complex64)
    d = c.copy()
    assert not changed(c, d)
    d[0] = 1j
    assert changed(c, d)
    i = numpy.arange(4)
    j = i.copy()
    assert not changed(i, j)
    j[0] = 7
    assert changed(i, j)
    assert changed(i, i.reshape(2, 2))


def test_recorder_wrappers_are_let_go_whatever_the_recording_call_does(
        monkeypatch):
    """The recorder's wrappers stay installed from a recording's forward
    to the end of its recorded backward (patches.Hold), and are let go
    after: a backward, a forward that raises, a fallback, a forward-only
    call, outputs dropped without a backward."""
    from chainer import variable as variable_module
    from static_graph import cache as cache_module
    from static_graph import patches
    # (Each call a new key that records: no bound on keys that do not
    # repeat here.)
    monkeypatch.setattr(cache_module, 'RECORDING_WINDOW', 100)
    orig = patches._orig_get_array

    def let_go():
        # (FunctionNode.apply's wrapper stays, passing calls through.)
        return patches._install_count == 0 and \
            variable_module.Variable._get_array is orig

    class Net(chainer.Chain):
        def __init__(self):
            super(Net, self).__init__()
            with self.init_scope():
                self.l = L.Linear(3, 2)

        @static_graph.static_graph
        def forward(self, x, fail=False, read=False):
            h = self.l(x)
            if fail:
                raise ValueError('in the method')
            if read:
                float(h.array[0, 0])    # a value read: falls back
            return F.sum(h)

    x = numpy.ones((2, 3), 'f')
    net = Net()
    y = net(x)
    assert not let_go()            # held for the recorded backward
    y.backward()
    assert let_go()
    with pytest.raises(ValueError):
        net(x[:1], fail=True)
    assert let_go()
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', StaticGraphWarning)
        net(x, read=True).backward()
    assert let_go()
    with chainer.no_backprop_mode():
        net(numpy.ones((3, 3), 'f'))
    assert let_go()
    y = net(numpy.ones((4, 3), 'f'))
    assert not let_go()
    del y                          # no backward comes
    assert let_go()
    # Two recordings waiting for their backward: one hold (the last).
    y1 = net(numpy.ones((5, 3), 'f'))
    y2 = net(numpy.ones((6, 3), 'f'))
    assert patches._install_count == 1
    y1.backward()
    assert not let_go()
    y2.backward()
    assert let_go()

    class Recurrent(chainer.Chain):
        def __init__(self):
            super(Recurrent, self).__init__()
            with self.init_scope():
                self.rnn = L.LSTM(3, 2)

        @static_graph.static_graph
        def forward(self, x):
            return F.sum(self.rnn(x))

    # State the links keep (L.LSTM's h and c, the chain alive): no hold
    # past the forward.
    r = Recurrent()
    r(x)
    assert let_go()
    r(x).backward()
    assert let_go()


class _Branching(chainer.Chain):
    """A branch on a value (each recording falls back) before F.hinge,
    whose old-style backward divides the gradient it is handed in place."""

    def __init__(self):
        super(_Branching, self).__init__()
        with self.init_scope():
            self.out1 = L.Linear(10, 2)

    def forward(self, x, t):
        h = x
        if float(F.sum(h).array) > 0:
            h = F.relu(h)
        else:
            h = h * -0.5
        h = F.relu(F.relu(F.relu(h)))
        return F.hinge(self.out1(h), t)


def test_an_in_place_gradient_write_reaches_other_calls_as_in_define_by_run():
    """Found by the differential fuzzer (fuzz.py --exact --seed 121): two
    calls taking different branches (graphs of different depth), then
    ``(l0 + 2 * l1).backward()``. Chainer's Hinge divides the gradient
    Add hands both losses in place, and reaches the first call's Hinge
    before ``2 * l1`` (their ranks tie), which then doubles the divided
    gradient. The recording calls give the same gradients: each call's
    node has the rank of its last node, and a call that fell back hands
    its inner graph the gradient Chainer handed it, not a copy."""
    rs = numpy.random.RandomState(162)
    x0 = numpy.abs(rs.standard_normal((3, 1, 2, 5))).astype('f')
    x1 = -numpy.abs(rs.standard_normal((3, 1, 2, 5))).astype('f')
    t0, t1 = rs.randint(0, 2, 3).astype('i'), rs.randint(0, 2, 3).astype('i')
    a, b = static_twins(_Branching)
    grads = []
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        for m in (a, b):
            with chainer.using_config('train', True):
                m.cleargrads()
                l0 = m(x0.copy(), t0)
                l1 = m(x1.copy(), t1)
                (l0 + 2 * l1).backward()
            grads.append(m.out1.W.grad.copy())
    numpy.testing.assert_array_equal(grads[0], grads[1])


class _TwoDepths(chainer.Chain):
    """A graph whose depth an argument chooses (a key each), ending in
    F.hinge, which divides the gradient it is handed in place."""

    def __init__(self):
        super(_TwoDepths, self).__init__()
        with self.init_scope():
            self.out1 = L.Linear(10, 2)

    def forward(self, x, t, deep):
        h = F.relu(F.relu(F.relu(x))) if deep else x
        return F.hinge(self.out1(h), t)


def test_a_recording_call_writes_back_what_its_backward_wrote_into_a_grad():
    """Two calls of new keys (both record) before one backward: the deep
    one's Hinge is reached first (its rank is higher) and divides the
    gradient Add hands both losses; ``2 * l1`` then doubles the divided
    one. The recording's backward works on a copy of that gradient: what
    it wrote there is written into the gradient Chainer handed it, so the
    recording iteration gives define-by-run's gradients (it differed by
    up to 1.0), as the replays do."""
    rs = numpy.random.RandomState(0)
    x0, x1 = (rs.standard_normal((3, 10)).astype('f') for _ in range(2))
    t0, t1 = (rs.randint(0, 2, 3).astype('i') for _ in range(2))
    a, b = static_twins(_TwoDepths)
    for _ in range(3):
        grads = []
        for m in (a, b):
            m.cleargrads()
            (m(x0, t0, True) + 2 * m(x1, t1, False)).backward()
            grads.append(m.out1.W.grad.copy())
        numpy.testing.assert_array_equal(grads[0], grads[1])


def test_apply_wrapper_passes_calls_through_without_a_recording():
    """FunctionNode.apply's wrapper stays installed after the first
    recording (writing to FunctionNode's class each time costs the
    recording its subclasses' cached lookups); without a recording current
    in the thread it is Chainer's apply: the same graph, the same bits, in
    this thread and another."""
    from chainer import function_node
    from static_graph import patches

    def net():
        return make_twins(lambda self, x: F.sum(F.relu(self.l1(x))))[1]

    x = numpy.arange(6, dtype='f').reshape(2, 3)
    step(net(), x)           # a recording: the wrapper is in place
    assert function_node.FunctionNode.apply is patches._patched_apply
    assert patches._install_count == 0

    def plain():
        numpy.random.seed(3)
        link = L.Linear(3, 2)
        link.cleargrads()
        h = F.relu(link(chainer.Variable(x)))
        y = F.sum(h * h)
        y.backward()
        return (y.array, link.W.grad, type(h.creator).__name__,
                h.creator.rank, y.rank)

    got = plain()
    monkey = function_node.FunctionNode.apply
    function_node.FunctionNode.apply = patches.orig_apply
    try:
        want = plain()
    finally:
        function_node.FunctionNode.apply = monkey
    assert got[2:] == want[2:]
    assert numpy.array_equal(got[0], want[0])
    assert numpy.array_equal(got[1], want[1])
    out = []
    t = threading.Thread(target=lambda: out.append(plain()))
    t.start()
    t.join()
    assert numpy.array_equal(out[0][1], want[1])
    # Code that puts Chainer's own back (a mock.patch's exit): the next
    # recording installs the wrapper again, and its key replays.
    function_node.FunctionNode.apply = patches.orig_apply
    b = net()
    for _ in range(3):
        step(b, x)
    assert function_node.FunctionNode.apply is patches._patched_apply
    assert (cache(b).recordings, cache(b).replays) == (1, 2)


def test_a_dead_proxy_on_a_link_runs_define_by_run():
    """A link attribute that is a weakref.proxy whose object is gone (a
    back-reference to an owner): every recording raised ReferenceError
    where define-by-run runs. Such calls run define-by-run, warned once;
    with a live object behind it the key records and replays."""
    import weakref

    class Owner(object):
        pass

    def body(self, x):
        return F.sum(self.l2(self.l1(x)))

    a, b = make_twins(body)
    owner = Owner()
    b.owner = weakref.proxy(owner)
    del owner
    x = data(4, 3)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        for i in range(3):
            la, lb = step(a, x), step(b, x)
            assert la.array == lb.array
            compare_chains(a, b, rtol=0, atol=0)
    said = [str(m.message) for m in w
            if issubclass(m.category, StaticGraphWarning)]
    assert len(said) == 1 and '/owner is a weakref.proxy' in said[0], said
    assert cache(b).recordings == 0
    owner = Owner()
    b.owner = weakref.proxy(owner)
    for i in range(3):
        la, lb = step(a, x), step(b, x)
        assert la.array == lb.array
    assert (cache(b).recordings, cache(b).replays) == (1, 2)


class _Defaulted(chainer.Chain):
    def __init__(self):
        super(_Defaulted, self).__init__()
        with self.init_scope():
            self.l = L.Linear(3, 2)

    def forward(self, x, cfg={'scale': 1.0}, *, mode='a'):
        return F.sum(self.l(x)) * cfg['scale'] * (2 if mode == 'a' else 3)


def test_default_arguments_changed_between_calls_record_again():
    """A keyword-only default set by the caller (``__kwdefaults__``) was
    frozen: 120 for define-by-run's 180."""
    S = type('S', (_Defaulted,), {
        'forward': static_graph.static_graph(_Defaulted.forward)})
    fn = _Defaulted.forward
    x = numpy.ones((2, 3), 'f')
    got = {}
    try:
        for M in (_Defaulted, S):
            m = M()
            m.l.W.array[...] = 1
            got[M] = []
            for i in range(6):
                if i == 2:
                    fn.__defaults__[0]['scale'] = 5.0
                if i == 4:
                    fn.__kwdefaults__['mode'] = 'b'
                y = m(x)
                y.backward()
                got[M].append(float(y.array))
            fn.__defaults__[0]['scale'] = 1.0
            fn.__kwdefaults__['mode'] = 'a'
    finally:
        fn.__defaults__[0]['scale'] = 1.0
        fn.__kwdefaults__['mode'] = 'a'
    assert got[_Defaulted] == got[S]
    assert got[S][4] != got[S][3]


def test_the_schedules_code_is_not_user_code():
    """schedules/bits.py compares a recording call's CuPy argument copies
    with the caller's (a bool() of a device array) while the call records:
    counted as a user read, every CuPy recording with an array argument
    fell back (seen on an H200)."""
    from schedules import bits
    from static_graph import device_reads, traced
    assert traced.internal_file(bits.__file__)
    assert bits.__file__.startswith(traced.OWN_DIR)
    assert device_reads._user_call.__code__.co_filename.startswith(
        traced.OWN_DIR)


def test_export_and_cached_find_a_methods_own_cache():
    """Two decorated methods both named ``wrapper`` (a user's decorator
    without functools.wraps): the export of ``predict`` read
    ``forward``'s schedule, and ``cached(m, 'predict')`` found nothing."""
    from static_graph import export, inspect as sg_inspect
    m = _Coder()
    x = numpy.ones((2, 3), 'f')
    e = export.inference_schedule(m, (F.tanh(m.enc(x)).array,),
                                  method='decode')
    ops = [op.kind for op in e.forward.ops]
    assert 'Tanh' not in ops and any('Pow' in k for k in ops), ops
    assert export.cache_of(m, _Coder.decode.__wrapped__).entries
    assert sg_inspect.cached(m, 'decode')
    assert all(c.entry is not None for c in sg_inspect.cached(m, 'decode'))


def test_a_function_node_class_that_refuses_attributes_records():
    class Frozen(type):
        def __setattr__(cls, k, v):
            raise AttributeError('frozen class')

    class Twice(chainer.FunctionNode, metaclass=Frozen):
        def forward(self, xs):
            return xs[0] * 2,

        def backward(self, indexes, gys):
            return gys[0] * 2,

    a, b = make_twins(lambda self, x: F.sum(
        Twice().apply((self.l1(x),))[0]))
    for _ in range(3):
        x = data(2, 3)
        la, lb = step(a, x), step(b, x)
        assert la.array == lb.array
    assert cache(b).replays == 2
