"""Array arguments of NumPy's subclasses: a masked array computes otherwise
than a plain one (numpy.ma fills masked entries), so it is another key; a
numpy.matrix argument is no constant."""
import collections
import warnings

import numpy
import pytest

import chainer
import chainer.functions as F
import chainer.links as L

import static_graph
from static_graph import static_graph as static


class Net(chainer.Chain):
    def __init__(self):
        super(Net, self).__init__()
        with self.init_scope():
            self.l1 = L.Linear(4, 5)

    def forward(self, x):
        # (NumPy scalars: numpy.ma on NumPy 2 makes x / 3.0 float64)
        return F.sum(self.l1(x / numpy.float32(3) + numpy.float32(1)) ** 2)


class StaticNet(Net):
    forward = static(Net.forward)


def _masked(x):
    mask = numpy.zeros(x.shape, bool)
    mask[0, 0] = True
    return numpy.ma.MaskedArray(x, mask=mask)


@pytest.mark.parametrize('make', [_masked, numpy.asmatrix],
                         ids=['MaskedArray', 'matrix'])
@pytest.mark.filterwarnings('ignore::static_graph.StaticGraphWarning')
def test_a_subclass_after_plain_arrays_computes_as_define_by_run(make):
    rs = numpy.random.RandomState(0)
    dbr, ours = Net(), StaticNet()
    ours.copyparams(dbr)
    for step in range(6):
        x = rs.randn(6, 4).astype('f')
        if step >= 3:
            x = make(x)
        got = []
        for m in (dbr, ours):
            m.cleargrads()
            loss = m(x.copy())
            loss.backward()
            got.append((loss.array, m.l1.W.grad.copy()))
        assert numpy.array_equal(got[0][0], got[1][0]), step
        assert numpy.array_equal(got[0][1], got[1][1]), step
    name = make(numpy.zeros((1, 1), 'f')).__class__.__name__
    assert '(%s f32[6,4])' % name in static_graph.explain(ours)


def test_a_nan_argument_made_at_each_call_replays():
    """A NaN compares equal to nothing and hashes by identity: a float NaN
    argument made anew at each call gave a new key at every call, which
    never replayed (the numbers were right, at define-by-run's speed)."""
    from static_graph.decorator import caches_of

    class Net(chainer.Chain):
        def __init__(self):
            super(Net, self).__init__()
            with self.init_scope():
                self.l = L.Linear(3, 2)

        def forward(self, x, fill):
            h = self.l(x)
            return F.sum(F.where(h.array > 0, h, h * 0 + fill)
                         if fill == fill else h)

    S = type('S', (Net,), {'forward': static(Net.forward)})
    m = S()
    for _ in range(4):
        m(numpy.ones((2, 3), 'f'), float('nan')).backward()
    assert caches_of(m)['forward'].replays == 3
    # Another NaN's bits (a negative one) is another key.
    m(numpy.ones((2, 3), 'f'), -float('nan')).backward()
    assert caches_of(m)['forward'].recordings == 2


def test_a_nan_fill_value_replays():
    """An array of one NaN made in the method is a uniform constant, as
    one of any other value (``flat == flat[0]`` is False for NaN: the call
    fell back)."""
    from static_graph.decorator import caches_of

    class Net(chainer.Chain):
        def __init__(self):
            super(Net, self).__init__()
            with self.init_scope():
                self.l = L.Linear(3, 3)

        def forward(self, x, fill):
            h = self.l(x)
            mask = numpy.array([[True, False, True]] * h.shape[0])
            return F.where(mask, h, numpy.full(h.shape, fill, 'f'))

    S = type('S', (Net,), {'forward': static(Net.forward)})
    a, b = Net(), S()
    b.copyparams(a)
    for _ in range(4):
        x = numpy.ones((2, 3), 'f')
        ya, yb = a(x, float('nan')), b(x, float('nan'))
        assert numpy.array_equal(ya.array, yb.array, equal_nan=True)
        F.sum(ya * 0).backward()
        F.sum(yb * 0).backward()
    assert caches_of(b)['forward'].replays == 3


class Batch(dict):
    """A batch dict that carries a setting as an attribute."""


class Seq(list):
    pass


class ScaledNet(chainer.Chain):
    def __init__(self):
        super(ScaledNet, self).__init__()
        with self.init_scope():
            self.l1 = L.Linear(4, 5)

    def forward(self, batch):
        x = batch['x'] if isinstance(batch, dict) else batch[0]
        return F.sum(self.l1(x) * batch.scale)


@pytest.mark.parametrize('kind', [Batch, Seq])
def test_a_container_with_attributes_of_its_own_runs_define_by_run(kind):
    """A dict subclass with ``b.scale`` the method reads: the key held
    only its items, and the copy the method got carried the recording
    call's attribute (loss 11.0 for 14.7); a list subclass lost it
    (AttributeError at every call)."""
    a = ScaledNet()
    b = type('S', (ScaledNet,), {'forward': static(ScaledNet.forward)})()
    b.copyparams(a)
    rs = numpy.random.RandomState(0)
    x = rs.randn(3, 4).astype('f')
    with pytest.warns(static_graph.StaticGraphWarning,
                      match='attributes of its own'):
        for scale in (1.0, 2.0, 3.0):
            losses = []
            for m in (a, b):
                arg = kind({'x': x}) if kind is Batch else kind([x])
                arg.scale = scale
                losses.append(float(m(arg).array))
            assert losses[0] == losses[1], scale


class Refusing(list):
    """A lazy view's list that will not tell its length."""

    def __len__(self):
        raise TypeError('length unknown')


class Doubling(list):
    """A list whose items, by index, are twice what it holds."""

    def __getitem__(self, i):
        return list.__getitem__(self, i) * 2


class Items(chainer.Chain):
    def __init__(self):
        super(Items, self).__init__()
        with self.init_scope():
            self.l1 = L.Linear(4, 5)

    def forward(self, x, extra):
        n = sum(1 for _ in extra) + extra[0]
        return F.sum(self.l1(x)) * float(n)


class MyOrderedDict(collections.OrderedDict):
    pass


@pytest.mark.parametrize('kind', [Refusing, Doubling, collections.OrderedDict,
                                  MyOrderedDict,
                                  collections.namedtuple('Pair', 'a b')])
def test_a_container_subclass_with_its_own_protocol_runs_define_by_run(kind):
    """A list subclass that defines ``__len__`` or ``__getitem__`` itself:
    the key's walk does not go through them (the first raised from the
    walk, where define-by-run's method runs). It runs define-by-run,
    warned; the collections module's own (an OrderedDict, a namedtuple)
    are walked as their bases, and so are subclasses of those that define
    none of it (one of OrderedDict ran define-by-run)."""
    a = Items()
    b = type('S', (Items,), {'forward': static(Items.forward)})()
    b.copyparams(a)
    x = numpy.random.RandomState(0).randn(3, 4).astype('f')
    if issubclass(kind, collections.OrderedDict):
        make = lambda v: kind([(0, v), (1, 2.0)])    # NOQA
    elif kind in (Refusing, Doubling):
        make = lambda v: kind([v, 2.0])    # NOQA
    else:
        make = lambda v: kind(v, 2.0)    # NOQA
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        for v in (1.0, 3.0, 1.0):
            assert float(a(x, make(v)).array) == float(b(x, make(v)).array)
    said = [str(m.message) for m in w
            if issubclass(m.category, static_graph.StaticGraphWarning)]
    if kind in (Refusing, Doubling):
        assert len(said) == 1 and 'defines __' in said[0], said
    else:
        assert not said, said


class Branches(chainer.Chain):
    def __init__(self):
        super(Branches, self).__init__()
        with self.init_scope():
            self.l1 = L.Linear(4, 5)

    def forward(self, x):
        h = self.l1(x)
        return F.sum(F.relu(h) if x.max() > 0.5 else F.tanh(h) * 3)


@pytest.mark.parametrize('kind', ['memmap', 'MaskedArray'])
@pytest.mark.filterwarnings('ignore::static_graph.StaticGraphWarning')
def test_a_subclass_arguments_values_read_by_the_method(kind, tmp_path):
    """A branch on the values of a memmap argument (a dataset loaded with
    ``mmap_mode='r'`` and sliced) or of a masked array: such arguments were
    handed to the method untraced, and replay kept the recorded branch
    (loss 4.0 for 1.6), silently. A memmap is traced as the plain array
    it computes as (the read is seen); other subclasses are a reason."""
    S = type('S', (Branches,), {'forward': static(Branches.forward)})
    dbr, ours = Branches(), S()
    ours.copyparams(dbr)
    rs = numpy.random.RandomState(0)
    for step in range(4):
        x = rs.rand(6, 4).astype('f') * (0.4 if step % 2 else 1.0)
        if kind == 'memmap':
            path = str(tmp_path / ('x%d.npy' % step))
            numpy.save(path, x)
            x = numpy.load(path, mmap_mode='r')
        else:
            x = _masked(x)
        got = []
        for m in (dbr, ours):
            m.cleargrads()
            loss = m(x)
            loss.backward()
            got.append((loss.array, m.l1.W.grad.copy()))
        assert numpy.array_equal(got[0][0], got[1][0]), step
        assert numpy.array_equal(got[0][1], got[1][1]), step
    assert 'fallback' in static_graph.explain(ours)


def test_a_read_only_argument_written_by_the_method_raises():
    """``x[:, 0] = 0`` on a read-only argument (``numpy.broadcast_to``, a
    memmap opened read-only): define-by-run raises; the recording call
    wrote into its own writable copy and returned a loss."""
    class Writes(Net):
        def forward(self, x):
            x[:, 0] = 0
            return F.sum(self.l1(x))

    S = type('S', (Writes,), {'forward': static(Writes.forward)})
    x = numpy.ones((3, 4), 'f')
    x.flags.writeable = False
    for m in (Writes(), S()):
        with pytest.raises(ValueError, match='read-only'):
            m(x)


def test_a_variable_argument_of_a_memmap():
    """A Variable wrapping a memmap (``mode='r+'``): its copy stayed an
    untraced memmap, so a branch on its values was frozen (46.4 for 23.2)
    and a write not seen. (A Variable wrapping a read-only array written
    by the method: the recording call writes into its copy, which replay
    may refresh in place, so it cannot be read-only; the key falls back,
    the write a reason, where define-by-run raises at every call.)"""
    class Reads(Net):
        def forward(self, x):
            h = self.l1(x)
            return F.sum(h * 2 if float(x.array.sum()) > 0 else h)

    import tempfile
    rs = numpy.random.RandomState(0)
    S = type('S', (Reads,), {'forward': static(Reads.forward)})
    dbr, ours = Reads(), S()
    ours.copyparams(dbr)
    with tempfile.TemporaryDirectory() as d:
        for step in range(4):
            path = '%s/x%d.npy' % (d, step)
            numpy.save(path, rs.randn(3, 4).astype('f') + (
                2 if step % 2 else -2))
            x = numpy.load(path, mmap_mode='r+')
            got = [m(chainer.Variable(x)).array for m in (dbr, ours)]
            assert numpy.array_equal(got[0], got[1]), step
            del x


def test_a_view_of_a_memmap_arguments_array_replays(tmp_path):
    """``Variable(x.array[:1])`` of a memmap argument: its recorded plain
    copy was a view of the memmap copy, which no buffer is, so the view
    fell back ("computed with NumPy from input values")."""
    class Views(Net):
        def forward(self, x):
            return F.sum(self.l1(chainer.Variable(x.array[:1])))

    S = type('S', (Views,), {'forward': static(Views.forward)})
    dbr, ours = Views(), S()
    ours.copyparams(dbr)
    rs = numpy.random.RandomState(0)
    for step in range(4):
        path = str(tmp_path / ('x%d.npy' % step))
        numpy.save(path, rs.randn(3, 4).astype('f'))
        x = numpy.load(path, mmap_mode='r')
        got = []
        for m in (dbr, ours):
            m.cleargrads()
            y = m(chainer.Variable(x))
            y.backward()
            got.append((y.array, m.l1.W.grad))
        assert numpy.array_equal(got[0][0], got[1][0]), step
        assert numpy.array_equal(got[0][1], got[1][1]), step
    from static_graph.decorator import caches_of
    assert caches_of(ours)['forward'].replays == 3
