"""Arrays the method makes from numbers (numpy.eye, arange, zeros, ...)
and what it computes from them with the labels (static_graph/
key_constants.py), and arrays indexed by the data (traced.py): a node
built with a one-hot mask of the labels reads every call's labels, bit
for bit with define-by-run; a write of the data into such an array falls
back; values the method reads from them are no reason; what it keeps or
returns is a plain array."""
import pickle
import warnings

import numpy
import pytest

import chainer
import chainer.functions as F
import chainer.links as L

import static_graph
from static_graph import StaticGraphWarning
from static_graph.decorator import caches_of
from tests.twins import method_twins

from numpy import eye as bound_eye

N, K = 8, 5


class Net(chainer.Chain):
    def __init__(self):
        super(Net, self).__init__()
        with self.init_scope():
            self.l = L.Linear(4, K)
        self.table = numpy.linspace(0.5, 2, K).astype(numpy.float32)
        self.memo = None
        self.kept = []


def where_eye(self, x, t):
    """CosFace's target mask."""
    h = self.l(x)
    return F.mean(F.where(numpy.eye(K, dtype=bool)[t], h - 0.3, h))


def arcface_like(self, x, t):
    h = F.normalize(self.l(x))
    m = numpy.eye(K, dtype=bool)[t]
    return F.softmax_cross_entropy(F.where(m, h - 0.35, h) * 30, t)


def one_hot_product(self, x, t):
    return -F.mean(F.log_softmax(self.l(x)) *
                   numpy.eye(K, dtype=numpy.float32)[t])


def label_smoothing(self, x, t):
    soft = numpy.eye(K, dtype=numpy.float32)[t] * 0.9 + 0.1 / K
    return -F.mean(F.log_softmax(self.l(x)) * soft)


def take_rows(self, x, t):
    h = self.l(x)
    return F.mean(F.where(numpy.eye(K, dtype=bool).take(t, axis=0), h, -h))


def reversed_index(self, x, t):
    return F.mean(self.l(x)[numpy.arange(N), numpy.arange(K)[::-1][t]])


def early_bound_eye(self, x, t):
    h = self.l(x)
    return F.mean(F.where(bound_eye(K, dtype=bool)[t], h - 0.3, h))


def concatenated_index(self, x, t):
    idx = numpy.concatenate([numpy.arange(4), t[:4]]) % K
    return F.mean(self.l(x)[numpy.arange(N), idx])


def memo_on_the_chain(self, x, t):
    if self.memo is None:
        self.memo = numpy.eye(K, dtype=bool)
    h = self.l(x)
    return F.mean(F.where(self.memo[t], h - 0.3, h))


def class_weights(self, x, t):
    """A link's table indexed by the labels (an op: the link's array)."""
    return F.mean(F.sum(self.l(x), axis=1) * self.table[t])


def gathered_rows(self, x, t):
    return F.mean(self.l(x[t % 4]) + self.l(x[[0, 2, 4, 6, 1, 3, 5, 7]]))


def causal_masks(self, x, t):
    """A Transformer's causal masks, computed from constants alone."""
    a = numpy.arange(K)
    mask = (numpy.tri(K).astype(bool) &
            (numpy.triu(numpy.ones((K, K), bool), 1) == 0) &
            (a[:, None] >= a[None]))
    add = numpy.zeros((K, K), numpy.float32)
    add[numpy.triu_indices(K, 1)] = -1e9
    h = F.broadcast_to(self.l(x)[:, None, :], (N, K, K))
    h = F.where(numpy.broadcast_to(mask, (N, K, K)), h + add, h * 0 - 1e4)
    return F.mean(F.softmax(h, axis=2) * h)


def values_read(self, x, t):
    """Reading a constant's values is no reason to fall back."""
    a = numpy.arange(K)
    rows = [r for r in numpy.eye(K, dtype=numpy.float32)]
    e = numpy.tile(numpy.eye(K, dtype=numpy.float32), (1, 2))[:, :K]
    if a.sum() > 2 and bool(a[1]) and a.tolist()[0] == 0 and \
            str(a[0]) == '0' and pickle.dumps(a):
        return F.mean(self.l(x) * rows[2] * e[1] * float(a.mean()))
    return F.mean(self.l(x))


def squeezed_mask(self, x, t):
    """A view NumPy's C method makes (``squeeze``) is a constant too."""
    h = self.l(x)
    m = numpy.eye(K, dtype=bool)[None].squeeze(0)[t]
    return F.mean(F.where(m, h - 0.3, h))


def set_through_properties(self, x, t):
    m = numpy.zeros((N, K), numpy.float32)
    m.flat = 1.0
    c = numpy.zeros(K, numpy.complex64)
    c.real = 2.0
    return F.mean(self.l(x) * m * c.real.astype(numpy.float32))


def grid_cells(self, x, t):
    """A YOLO-style cell index through ``numpy.mgrid`` (and ``ogrid``,
    ``r_``, ``fromfunction``), indexed by the labels: plain arrays
    before, which replay froze at the recording's labels (vision31
    hunt, 2.71 for 1.27)."""
    h = self.l(x)
    gy, gx = numpy.mgrid[0:K, 0:1]
    cells = (gy * 1 + gx)[:, 0]
    rows = numpy.ogrid[0:N]
    by_r = numpy.r_[0:K][::-1]
    made = numpy.fromfunction(lambda i: (i * 2) % K, (K,), dtype=int)
    return F.mean(F.get_item(h, (rows, cells[t]))) + \
        F.mean(F.where(by_r[t][:, None] == made, h, h * 0.5))


def windows_and_spaces(self, x, t):
    """``numpy.hanning`` and its kin, ``geomspace``, ``fromiter`` of a
    range: masks from the labels."""
    h = self.l(x)
    w = numpy.hanning(K + 2)[1:-1] + numpy.kaiser(K, 2.0)
    g = numpy.geomspace(1, 16, K).astype(int) % K
    f = numpy.fromiter(range(K), dtype=int)[::-1]
    return F.mean(F.where((g[t] == f[t])[:, None], h, h * 2)) + \
        F.mean(h * w[t][:, None].astype(numpy.float32))


REPLAYED = [squeezed_mask, set_through_properties, where_eye, arcface_like, one_hot_product, label_smoothing,
            take_rows, reversed_index, early_bound_eye, concatenated_index,
            memo_on_the_chain, class_weights, gathered_rows, causal_masks,
            values_read, grid_cells, windows_and_spaces]


def scattered_one_hot(self, x, t):
    oh = numpy.zeros((N, K), numpy.float32)
    oh[numpy.arange(N), t] = 1
    return -F.mean(F.log_softmax(self.l(x)) * oh)


def added_in_place(self, x, t):
    m = numpy.zeros(N, numpy.int64)
    m += t
    return F.mean(self.l(x)[numpy.arange(N), m])


def put_mask(self, x, t):
    m = numpy.zeros((N, K), bool)
    m.put(numpy.arange(N) * K + t, True)
    h = self.l(x)
    return F.mean(F.where(m, h, h * 0))


def copied_labels(self, x, t):
    m = numpy.zeros(N, numpy.int32)
    numpy.copyto(m, t)
    return F.mean(self.l(x)[numpy.arange(N), m])


def branch_on_data(self, x, t):
    h = self.l(x)
    if numpy.dot(numpy.eye(4), x.T).sum() > 0:
        h = h * 2
    return F.mean(h)


def through_flat(self, x, t):
    oh = numpy.zeros((N, K), numpy.float32)
    oh.flat[numpy.arange(N) * K + t] = 1
    return -F.mean(F.log_softmax(self.l(x)) * oh)


def through_a_plain_view(self, x, t):
    oh = numpy.zeros((N, K), numpy.float32)
    oh.view(numpy.ndarray)[numpy.arange(N), t] = 1
    return -F.mean(F.log_softmax(self.l(x)) * oh)


def element_at_a_label(self, x, t):
    w = numpy.linspace(0.5, 2, K).astype(numpy.float32)[t[0:1].reshape(())]
    return F.mean(self.l(x)) * w


def indexed_by_a_raw_array(self, x, t):
    """``Variable.raw_array`` is no traced read: a plain index."""
    h = self.l(x)
    m = numpy.eye(K, dtype=numpy.float32)[h.raw_array.argmax(1)]
    return -F.mean(F.log_softmax(h) * m)


def positional_out(self, x, t):
    c = numpy.zeros((N, N), numpy.float32)
    tf = t.astype(numpy.float32)
    numpy.dot(tf[:, None], tf[None], c)
    d = numpy.zeros(N, numpy.int32)
    numpy.clip(t, 0, 2, d)
    return F.mean(F.matmul(c, self.l(x))[numpy.arange(N), d])


def buffer_refilled(self, x, t):
    """One mask rewritten with constants between the ops that take it."""
    h = self.l(x)
    m = numpy.zeros((N, K), bool)
    outs = []
    for k in range(K):
        m[:] = False
        m[:, k] = True
        outs.append(F.sum(F.where(m, h, h * 0)) * (k + 1))
    a = numpy.arange(K)
    y = h * a
    a += 1
    return (sum(outs) + F.sum(y * h * a)) / 100.


def written_through_a_squeezed_view(self, x, t):
    oh = numpy.zeros((1, N, K), numpy.float32)
    v = oh.squeeze(0)
    v[numpy.arange(N), t] = 1
    return -F.mean(F.log_softmax(self.l(x)) * oh[0])


def labels_set_through_flat(self, x, t):
    m = numpy.zeros(N, numpy.int64)
    m.flat = t
    return F.mean(self.l(x)[numpy.arange(N), m])


def mask_from_the_labels(self, x, t):
    return F.mean(self.l(x)[numpy.arange(N)[t > 2]])


_PICKLED = pickle.dumps(numpy.arange(N * K, dtype=numpy.float32).reshape(
    N, K))


def copied_from_unknown(self, x, t):
    """An array of unknown origin (made in C, by pickle) copied into one
    the method made: ``numpy.copyto`` skipped its target (the first
    argument) when it looked for constants written with such values, and
    the constant replayed as one."""
    m = numpy.zeros((N, K), numpy.float32)
    numpy.copyto(m, pickle.loads(_PICKLED))
    return F.mean(self.l(x) * m)


FELL_BACK = [(scattered_one_hot, 'writes values computed from the data'),
             (copied_from_unknown, 'values of unknown origin'),
             (through_flat, 'values of unknown origin'),
             (through_a_plain_view, 'values of unknown origin'),
             (element_at_a_label, 'reads array values'),
             (indexed_by_a_raw_array, 'not produced by a Chainer function'),
             (positional_out, 'writes values computed from the data'),
             (buffer_refilled, 'changes after an op of the call took it'),
             (mask_from_the_labels, 'boolean mask'),
             (written_through_a_squeezed_view, 'writes values computed from'),
             (labels_set_through_flat, 'writes values computed from the'),
             (added_in_place, 'writes values computed from the data'),
             (put_mask, 'writes values computed from the data'),
             (copied_labels, 'writes values computed from the data'),
             (branch_on_data, 'reads array values')]


def twins(body):
    """[(chain, optimizer)]: an undecorated and a decorated Net with
    ``body`` as forward, built under one seed."""
    return method_twins(Net, body, lambda: chainer.optimizers.SGD(0.1))


def train_twins(body, steps=6):
    """An undecorated and a decorated Net with ``body`` as forward, trained
    on the same batches of inputs and labels, NumPy's and Python's global
    generators seeded alike before each twin's step; checks the losses,
    the parameters and the generators' next draws bit for bit at every
    step; returns the decorated one, its StaticGraphWarnings and what each
    twin's calls returned."""
    import random
    models = twins(body)
    rs = numpy.random.RandomState(1)
    returned = ([], [])
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        for i in range(steps):
            x = rs.standard_normal((N, 4)).astype(numpy.float32)
            t = rs.randint(0, K, N).astype(numpy.int32)
            seen = []
            for (m, opt), out in zip(models, returned):
                numpy.random.seed(100 + i)
                random.seed(100 + i)
                m.cleargrads()
                r = m(x, t)
                loss = r[0] if isinstance(r, tuple) else r
                loss.backward()
                opt.update()
                out.append(r)
                seen.append([loss.array] + [p.array for p in m.params()] +
                            [numpy.random.rand(2), random.random()])
            for k, (a, b) in enumerate(zip(*seen)):
                assert numpy.asarray(a).tobytes() == \
                    numpy.asarray(b).tobytes(), (body.__name__, i, k)
    return models[1][0], [x for x in w if issubclass(
        x.category, StaticGraphWarning)], returned


def counts(chain):
    (c,) = caches_of(chain).values()
    return c.recordings, c.replays, c.fallback_calls


@pytest.mark.parametrize('body', REPLAYED, ids=lambda b: b.__name__)
def test_masks_and_indices_from_the_labels_replay_bit_for_bit(body):
    m, w, _ = train_twins(body)
    assert not w, [str(x.message) for x in w]
    rec, replays, dbr = counts(m)
    assert replays == 6 - rec and dbr == 0 and rec <= 2


@pytest.mark.parametrize('body,reason', FELL_BACK,
                         ids=[b.__name__ for b, _ in FELL_BACK])
def test_the_data_written_into_a_constant_falls_back(body, reason):
    m, w, _ = train_twins(body)
    assert counts(m) == (1, 0, 5)
    assert any(reason in str(x.message) for x in w), \
        [str(x.message) for x in w]


def returns_constants(self, x, t):
    self.kept = [numpy.ones(2)]
    self.mask = numpy.tri(3)
    return F.mean(self.l(x)), numpy.arange(3), numpy.eye(2)[t[:2] % 2]


def test_what_the_method_keeps_or_returns_is_a_plain_array():
    m, _, (plain, mine) = train_twins(returns_constants, steps=3)
    for a, b in zip(plain, mine):
        for u, v in zip(a[1:], b[1:]):
            assert type(v) is numpy.ndarray and type(u) is numpy.ndarray
            assert u.tobytes() == v.tobytes()
    assert type(m.mask) is numpy.ndarray
    assert [type(v) for v in m.kept] == [numpy.ndarray]


def reductions(self, x, t):
    a = numpy.arange(5)
    e = numpy.eye(3)
    self.kept = [type(v) for v in (a.sum(), e.max(), a.mean(), numpy.sum(a),
                                   a[2], a.std(), e[0, 1], len(e))]
    return F.mean(self.l(x))


def test_numbers_from_constants_have_define_by_runs_types():
    m, _, _ = train_twins(reductions, steps=1)
    plain = Net()
    reductions(plain, numpy.zeros((N, 4), numpy.float32),
               numpy.zeros(N, numpy.int32))
    assert m.kept == plain.kept


def returns_weights(self, x, t):
    w = numpy.linspace(1, 2, K, dtype=numpy.float32)
    return F.mean(self.l(x) * w), w


def test_a_returned_constant_the_caller_writes_before_backward():
    """The caller normalizes the weights the method returned, in place,
    before the backward (the node that took them sees it, as in
    define-by-run): the recording's constant changed, so the key runs
    define-by-run from its next call (replay would compute with the
    normalized weights; review32)."""
    models = twins(returns_weights)
    rs = numpy.random.RandomState(1)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        for i in range(4):
            x = rs.standard_normal((N, 4)).astype(numpy.float32)
            seen = []
            for m, opt in models:
                m.cleargrads()
                loss, weights = m(x, None)
                weights /= weights.sum()
                loss.backward()
                opt.update()
                seen.append((loss.array.tobytes(), weights.tobytes(),
                             m.l.W.array.tobytes()))
            assert seen[0] == seen[1], i
    assert counts(models[1][0]) == (1, 0, 3)
    assert any('between the forward and the backward' in str(x.message)
               for x in w)


def reseeded(self, x, t):
    numpy.random.seed(1234)
    return F.mean(self.l(x + numpy.random.randn(N, 4).astype(numpy.float32)))


def erased_by_sample(self, x, t):
    keep = numpy.random.sample(x.shape) > 0.3
    return F.mean(self.l(x * keep.astype(numpy.float32)))


def flipped_by_getrandbits(self, x, t):
    import random
    if random.getrandbits(1):
        x = x[:, ::-1]
    return F.mean(self.l(x))


@pytest.mark.parametrize('body,replays', [
    (reseeded, False), (erased_by_sample, True),
    (flipped_by_getrandbits, False)], ids=lambda v: getattr(v, '__name__',
                                                            str(v)))
def test_draws_and_reseeds_of_numpys_and_pythons_own_functions(body,
                                                               replays):
    """numpy.random.seed and sample (functions of their own in NumPy 1,
    not methods of the global generator) and random.getrandbits: a reseed
    and a scalar draw fall back, an array drawn is an op (augment30 hunt:
    all three replayed frozen)."""
    if body is erased_by_sample and not hasattr(numpy.random, 'sample'):
        pytest.skip('no numpy.random.sample in this NumPy')
    m, w, _ = train_twins(body)
    rec, rep, dbr = counts(m)
    assert (rep, dbr) == ((5, 0) if replays else (0, 5))


def _installed(tmp_path, monkeypatch, name, source):
    """Package ``name`` with ``source`` as its code, in a site-packages
    directory on the path (an installed package, not yet imported)."""
    import sys
    site = tmp_path / 'site-packages' / name
    site.mkdir(parents=True)
    (site / '__init__.py').write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path / 'site-packages'))
    monkeypatch.delitem(sys.modules, name, raising=False)


def test_an_installed_packages_arrays_made_inside_the_method(tmp_path,
                                                             monkeypatch):
    """A package imported inside the method (an optional dependency,
    imported at the first call, which records): its module-level arrays are
    no constants of the call, and its own work on them no reads of the
    method's (augment30 hunt: the key fell back for good)."""
    import sys
    _installed(tmp_path, monkeypatch, 'lazy_tables',
               'import numpy\n'
               'TABLE = numpy.arange(5)\n'
               'PLAIN = TABLE.view(numpy.ndarray)\n'
               'SECOND = int(TABLE[2])\n')

    def lazy(self, x, t):
        import lazy_tables
        return F.mean(self.l(x)) * lazy_tables.SECOND

    m = type('Net', (Net,), {'forward': static_graph.static_graph(lazy)})()
    x = numpy.ones((N, 4), numpy.float32)
    t = numpy.zeros(N, numpy.int32)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        for _ in range(4):      # (the first call records, and imports)
            m.cleargrads()
            m(x, t).backward()
    assert not [x for x in w if issubclass(x.category, StaticGraphWarning)]
    assert counts(m) == (1, 3, 0)
    assert type(sys.modules['lazy_tables'].TABLE) is numpy.ndarray


def test_evaluation_with_backprop_on_of_a_smoothed_target_replays():
    """Chainer's custom loops evaluate under train=False with backprop on
    and never backpropagate: the backward is recorded from a stand-in
    gradient, which the NumpyCall of ``numpy.eye(k)[t]`` does not stop
    (nlp30 hunt: it ran define-by-run for good)."""
    models = twins(label_smoothing)
    rs = numpy.random.RandomState(3)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        for _ in range(8):
            x = rs.standard_normal((N, 4)).astype(numpy.float32)
            t = rs.randint(0, K, N).astype(numpy.int32)
            with chainer.using_config('train', False):
                a, b = (m(x, t).array for m, _ in models)
            assert a.tobytes() == b.tobytes()
    rec, replays, dbr = counts(models[1][0])
    assert replays >= 4 and dbr == 0


def one_hot_sampled(self, x, t):
    """REINFORCE with chainer.distributions.OneHotCategorical: its
    sample is ``xp.eye(k)[drawn]``, made in chainer.distributions' code,
    whose reads count as the method's (review34: a regression of the
    commit before made it fall back)."""
    import chainer.distributions as D
    logits = self.l(x)
    d = D.OneHotCategorical(F.softmax(logits))
    a = d.sample()
    reward = F.sum(a * numpy.arange(K, dtype=numpy.float32), axis=1)
    return -F.mean(d.log_prob(a) * reward.array) + \
        F.softmax_cross_entropy(logits, t)


def test_a_one_hot_categorical_sample_replays():
    m, w, _ = train_twins(one_hot_sampled)
    assert not w and counts(m) == (1, 5, 0)


def test_a_mask_an_installed_packages_loss_makes_replays(tmp_path,
                                                         monkeypatch):
    """A CosFace loss from an installed package (its code under
    site-packages) called by the method: its ``numpy.eye(k)[t]`` mask is
    made at the call, not at an import, so it is an op (review34: an
    earlier version of the last commit kept it plain, and replay froze
    the labels, 7.53 for 4.20)."""
    _installed(tmp_path, monkeypatch, 'margin_losses',
               'import numpy\n'
               'import chainer.functions as F\n'
               'def cosface(cos, t, m=0.35, s=30.0):\n'
               '    mask = numpy.eye(cos.shape[1], dtype=bool)[t]\n'
               '    return F.softmax_cross_entropy(F.where(mask, cos - m, '
               'cos) * s, t)\n')
    import margin_losses

    def body(self, x, t):
        return margin_losses.cosface(F.normalize(self.l(x)), t)

    m, w, _ = train_twins(body)
    assert not w and counts(m) == (1, 5, 0)


@pytest.mark.parametrize('where', ['allocated', 'given'])
def test_an_array_c_code_fills_unseen_falls_back(where):
    """A blur augmentation with scipy.ndimage inside the method: its C code
    fills the numpy.zeros it allocates (or one the method hands it as
    ``output=``), a constant of the key as made, which no hook sees
    written: replay trained on the recording's blurred batch at every
    step (cv31 hunt: 1.0619 against 1.1248 from the first replay). Its
    values no longer the ones it was made with, it falls back."""
    ndimage = pytest.importorskip('scipy.ndimage')

    def blurred(self, x, t):
        if where == 'allocated':
            b = ndimage.gaussian_filter(x, sigma=(0, 1))
        else:
            b = numpy.zeros(x.shape, numpy.float32)
            ndimage.gaussian_filter(x, 1.0, output=b)
        return F.softmax_cross_entropy(self.l(b), t)

    m, w, _ = train_twins(blurred)
    rec, replays, dbr = counts(m)
    assert replays == 0 and dbr == 5
    assert any('values of unknown origin' in str(x.message) for x in w)
