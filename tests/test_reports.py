"""What a decorated method reports (``chainer.report``) is what
define-by-run reports, at every call: the same values, read when the
training loop reads them (LogReport, after the update), of the same types
(a Variable, an array, a NumPy scalar), also inside tuples, also where the
recording call ran with no reporter current (static_graph/reports.py)."""
import warnings

import numpy
import pytest

import chainer
import chainer.functions as F
import chainer.links as L

import static_graph
from static_graph import StaticGraphWarning
from static_graph.decorator import caches_of


class Net(chainer.Chain):
    def __init__(self):
        super(Net, self).__init__()
        with self.init_scope():
            self.l1 = L.Linear(6, 5)
            self.l2 = L.Linear(5, 4)
            self.temp = chainer.Parameter(numpy.ones((), 'f'))
            self.bn = L.BatchNormalization(5)


def _seen(v):
    """What a reader of the observation sees: the type and the bytes."""
    if type(v) in (tuple, list):
        return type(v).__name__, [_seen(x) for x in v]
    if type(v) is dict:
        return 'dict', sorted((k, _seen(x)) for k, x in v.items())
    a = v.array if isinstance(v, chainer.Variable) else v
    return (type(v).__name__, numpy.asarray(a).dtype.str,
            numpy.asarray(a).tobytes())


def run_twins(body, steps=5, reporter_from=0, between=None):
    """Train an undecorated and a decorated twin; return the decorated one
    and its warnings, after checking, at every step, that the losses, the
    parameters and the observations (read after the update, as LogReport
    reads them) agree bit for bit, types included. Before step
    ``reporter_from`` no reporter is current; ``between(model, step)`` runs
    before each twin's step."""
    models = []
    for decorate in (False, True):
        cls = type('Net', (Net,), {'forward': static_graph.static_graph(
            body) if decorate else body})
        numpy.random.seed(0)
        m = cls()
        opt = chainer.optimizers.MomentumSGD(0.3)
        opt.setup(m)
        reporter = chainer.Reporter()
        reporter.add_observer('main', m)
        models.append((m, opt, reporter))
    rs = numpy.random.RandomState(1)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        for i in range(steps):
            x = rs.standard_normal((4, 6)).astype('f')
            t = rs.randint(0, 4, 4).astype('i')
            seen = []
            for m, opt, reporter in models:
                if between is not None:
                    between(m, i)
                observed = {}
                if i >= reporter_from:
                    with reporter.scope(observed):
                        opt.update(m, x, t)
                else:
                    opt.update(m, x, t)
                seen.append((sorted((k, _seen(v)) for k, v in
                                    observed.items()),
                             [p.array.tobytes() for p in m.params()] +
                             [getattr(link, k).tobytes()
                              for link in m.links()
                              for k in sorted(link._persistent)
                              if isinstance(getattr(link, k),
                                            numpy.ndarray)]))
            assert seen[0] == seen[1], (body.__name__, i)
            if i >= reporter_from:
                assert seen[0][0], 'nothing was reported'
    return models[1][0], [x for x in w
                          if issubclass(x.category, StaticGraphWarning)]


def only_cache(chain):
    (c,) = caches_of(chain).values()
    return c


def loss_of(self, x, t):
    return F.softmax_cross_entropy(self.l2(F.tanh(self.l1(x))) * self.temp,
                                   t)


def perplexity(self, x, t):
    """examples/seq2seq: a NumPy scalar from ufuncs of the 0-d loss."""
    loss = loss_of(self, x, t)
    chainer.report({'loss': loss, 'perp': numpy.exp(
        loss.array * len(x) / 7.)}, self)
    return loss


def loss_array(self, x, t):
    """The 0-d array itself, and numpy.asarray of it feeding the loss."""
    loss = loss_of(self, x, t)
    s = numpy.asarray(loss.array)
    chainer.report({'loss': loss.array, 's': s}, self)
    return loss * F.exp(s)


def weighted(self, x, t):
    """(value, weight) pairs, which Chainer's summaries take."""
    y = self.l2(F.tanh(self.l1(x)))
    loss = F.softmax_cross_entropy(y, t)
    chainer.report({'loss': (loss, len(x)),
                    'acc': [F.accuracy(y, t), 4]}, self)
    return loss


def parameters(self, x, t):
    """A parameter, its array and a view of a bias: define-by-run's
    reporter keeps them, so they are read after the update."""
    chainer.report({'temp': self.temp, 'temp_array': self.temp.array,
                    'b0': self.l1.b.array[0, ...]}, self)
    return loss_of(self, x, t)


def nested_dict(self, x, t):
    """A dict holding a Variable, reported as one value."""
    loss = loss_of(self, x, t)
    chainer.report({'parts': {'loss': loss, 'n': len(x)}}, self)
    return loss


def running_mean(self, x, t):
    """BatchNormalization's running mean read in the forward: all zeros
    at the recording call, which looked like a constant."""
    h = self.bn(self.l1(x))
    loss = F.softmax_cross_entropy(self.l2(F.tanh(h)), t)
    chainer.report({'loss': loss}, self)
    return loss + F.sum(h * (self.bn.avg_mean * 0.5))


@pytest.mark.parametrize('body', [perplexity, loss_array, weighted,
                                  parameters, nested_dict, running_mean],
                         ids=lambda b: b.__name__)
def test_reports_replay_bit_for_bit(body):
    m, w = run_twins(body)
    assert not w
    c = only_cache(m)
    assert c.recordings == 1 and c.replays == 4


def test_a_reported_view_follows_a_replaced_parameter():
    """A view of a parameter's array reported (``self.l1.b.array[0,
    ...]``), the parameter given a new array between steps (``b.array =
    ...``): the call records again instead of reporting the old array's
    view."""
    def halve(m, i):
        if i == 2:
            m.l1.b.array = m.l1.b.array * 0.5

    m, w = run_twins(parameters, between=halve)
    assert not w
    assert only_cache(m).recordings == 2


def test_reports_of_a_call_recorded_without_a_reporter_replay():
    """The recording call ran before any reporter was current (a warm-up
    step): its replays report where one is by then."""
    m, w = run_twins(perplexity, reporter_from=1)
    assert not w
    assert only_cache(m).replays == 4


def gradient_norm(self, x, t):
    """The previous step's gradient read in the forward: all NaN (a
    fresh parameter's) at the recording call, which looked uniform, a
    constant."""
    g = self.l1.W.grad
    chainer.report({'gnorm': numpy.sqrt((g * g).sum(axis=(0, 1),
                                                     keepdims=True))}, self)
    return loss_of(self, x, t)


def numpy_number(self, x, t):
    loss = loss_of(self, x, t)
    chainer.report({'loss': numpy.float32(loss.array)}, self)
    return loss


@pytest.mark.parametrize('body,reason', [
    (gradient_norm, 'reads the gradient of /l1/W'),
    (numpy_number, 'reports a NumPy number (loss)'),
], ids=['gradient', 'numpy number'])
def test_what_replay_could_not_report_falls_back(body, reason):
    m, w = run_twins(body)
    assert only_cache(m).replays == 0
    assert any(reason in str(x.message) for x in w)


def _observed(m, step, keep_graph):
    """What ``step()`` reports of observer ``m`` (as 'main'), run with
    keep_graph_on_report as ``keep_graph`` (warnings silenced)."""
    rep = chainer.Reporter()
    rep.add_observer('main', m)
    obs = {}
    with rep.scope(obs), warnings.catch_warnings(), \
            chainer.using_config('keep_graph_on_report', keep_graph):
        warnings.simplefilter('ignore')
        step()
    return obs


def test_arrays_reported_by_a_recording_that_keeps_the_graph_are_plain():
    """Under ``keep_graph_on_report`` (the trainer's dump_graph at the first
    iteration) the recording reports as the method did and falls back:
    an array user code got traced (``y.array``) reached the reporter as a
    TracedArray (extensions hunt), where define-by-run reports an ndarray."""
    class Net(chainer.Chain):
        def __init__(self):
            super(Net, self).__init__()
            with self.init_scope():
                self.l = L.Linear(4, 3)

        def forward(self, x, t):
            y = self.l(x)
            loss = F.softmax_cross_entropy(y, t)
            acc = F.accuracy(y, t)
            chainer.report({'loss': loss, 'correct': (acc * len(t)).array,
                            'y': y.array}, self)
            return loss

    Static = type("Static", (Net,),
                  {"forward": static_graph.static_graph(Net.forward)})
    x = numpy.random.RandomState(0).randn(5, 4).astype(numpy.float32)
    t = numpy.array([0, 1, 2, 0, 1], numpy.int32)
    a, b = Net(), Static()
    b.copyparams(a)
    for step in range(3):
        got = [_observed(m, lambda: m(x, t).backward(), step == 0)
               for m in (a, b)]
        assert sorted(got[0]) == sorted(got[1])
        for k in got[0]:
            assert type(got[0][k]) is type(got[1][k]), (step, k)
            assert numpy.array_equal(getattr(got[0][k], 'array', got[0][k]),
                                     getattr(got[1][k], 'array', got[1][k]))


def test_a_view_reported_under_keep_graph_keeps_its_values():
    """``h.array[0]`` reported under ``keep_graph_on_report``: the
    recording handed a view of its own buffer, which later calls
    rewrote, so the observation of that step changed (review27); it is a
    copy, as what define-by-run reports is that call's own."""
    class Net(chainer.Chain):
        def __init__(self):
            super(Net, self).__init__()
            with self.init_scope():
                self.l = L.Linear(4, 3)

        def forward(self, x):
            h = self.l(x)
            chainer.report({'h0': h.array[0], 'x0': x[0]}, self)
            return F.sum(h * h)

    Static = type("Static", (Net,),
                  {"forward": static_graph.static_graph(Net.forward)})
    a, b = Net(), Static()
    b.copyparams(a)
    kept = {}
    for m in (a, b):
        seen = []
        for step in range(4):
            x = numpy.random.RandomState(step).randn(2, 4).astype('f')
            seen.append(_observed(m, lambda: m(x).backward(), step == 0))
        kept[id(m)] = [(o['main/h0'].copy(), o['main/x0'].copy(), o)
                       for o in seen]
    for (h1, x1, o1), (h2, x2, o2) in zip(kept[id(a)], kept[id(b)]):
        assert numpy.array_equal(o1['main/h0'], o2['main/h0'])
        assert numpy.array_equal(o2['main/h0'], h2)
        assert numpy.array_equal(o1['main/x0'], o2['main/x0'])
