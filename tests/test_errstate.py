"""NumPy's error state: the threads that run a replay's split kernels get
the caller's, whatever it was when the library was imported; a method
that changes it around its own Chainer calls (``numpy.errstate``) falls
back, since replay runs every op under the caller's. Each twin pair
raises (or not) at the same call. (Found by a hunt: a replay returned
inf where define-by-run raised, and raised where it did not.)"""
import os
import subprocess
import sys
import textwrap
import warnings

import numpy

import chainer
import chainer.functions as F
import chainer.links as L

import static_graph

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_SPLIT_BEFORE_IMPORT = textwrap.dedent('''
    import numpy
    numpy.seterr(all='raise')          # before the library's import
    from static_graph import static_graph   # (before chainer: NumPy 2)
    import chainer, chainer.functions as F, chainer.links as L
    from schedules import parallel
    # (As on a machine where splitting measures faster.)
    parallel.SplitChoice.use_pool = lambda self: (self.threads > 1, False)

    class M(chainer.Chain):
        def __init__(self):
            super().__init__()
            with self.init_scope():
                self.l = L.Linear(8, 8)

        def forward(self, x, y):
            s = x * 2.0 + y * 2.0       # a large Add, split in two
            return F.sum(F.relu(s)) + F.sum(self.l(x[:4, :8]))

    D = type('D', (M,), {'forward': static_graph(M.forward)})
    numpy.random.seed(0)
    a, b = M(), D()
    b.copyparams(a)
    for i in range(6):
        x = numpy.random.RandomState(i).rand(1024, 1024).astype('f')
        if i in (3, 5):
            x[-1] = 3e38                 # the last rows: the worker's half
        seen = []
        for m in (a, b):
            try:
                m.cleargrads()
                m(chainer.Variable(x.copy()), chainer.Variable(x.copy()))
                seen.append('ok')
            except FloatingPointError:
                seen.append('raised')
        print(i, *seen)
''')


def test_split_kernels_raise_as_define_by_run_after_seterr_before_import():
    """``numpy.seterr(all='raise')`` as a script's first line: the split
    Add's worker ran under NumPy's defaults and returned inf (with a
    warning) where define-by-run raised."""
    out = subprocess.run(
        [sys.executable, '-c', _SPLIT_BEFORE_IMPORT], cwd=_ROOT,
        capture_output=True, text=True, timeout=240,
        env=dict(os.environ, OPENBLAS_NUM_THREADS='1', PYTHONPATH=_ROOT))
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [ln.split() for ln in out.stdout.splitlines()]
    assert [r[1:] for r in rows] == [
        ['raised', 'raised'] if int(r[0]) in (3, 5) else ['ok', 'ok']
        for r in rows], out.stdout


class _Exp(chainer.Chain):
    def __init__(self, inner):
        super(_Exp, self).__init__()
        with self.init_scope():
            self.l1 = L.Linear(4, 3)
        self.inner = inner

    def forward(self, x):
        h = self.l1(x)
        with numpy.errstate(**self.inner):
            e = F.exp(h * 50.0)
        return F.sum(e * 1e-30)


def _twins_under(inner, outer):
    models = []
    for cls in (_Exp, type('S', (_Exp,), {
            'forward': static_graph.static_graph(_Exp.forward)})):
        numpy.random.seed(0)
        models.append(cls(inner))
    seen = []
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        for i in range(5):
            x = numpy.random.RandomState(i).randn(5, 4).astype('f') * 0.1
            if i == 3:
                x[1] = 10.0           # exp overflows at this call
            row = []
            for m in models:
                old = numpy.seterr(**outer)
                try:
                    m.cleargrads()
                    y = m(x.copy())
                    y.backward()
                    row.append(float(y.array))
                except FloatingPointError:
                    row.append('raised')
                finally:
                    numpy.seterr(**old)
            seen.append(row)
    return seen, [str(x.message) for x in w
                  if issubclass(x.category, static_graph.StaticGraphWarning)]


def test_an_errstate_inside_the_method_falls_back():
    """``with numpy.errstate(over='ignore'): F.exp(...)`` in the method,
    the loop under ``seterr(all='raise')``: replay raised where
    define-by-run did not; and the other way round, replay returned inf
    where define-by-run raised."""
    for inner, outer in (({'over': 'ignore'}, {'all': 'raise'}),
                         ({'over': 'raise'}, {})):
        seen, w = _twins_under(inner, outer)
        for a, b in seen:
            assert a == b or (a != a and b != b), seen
        assert any('another NumPy error state' in x for x in w), w
