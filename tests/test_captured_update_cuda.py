"""The captured update on CuPy, its host side (no GPU needed): each rule's
kernel is Chainer 7.8.1's ``update_core_gpu`` kernel with its host scalars
read from a device array, and the scalars computed each step are the ones
Chainer passes; CuPy's scalar conversion; the ring of pinned buffers (with
a stand-in stream); the fallback decisions."""
import types

import numpy
import pytest

import chainer
from chainer.backends import cuda
from chainer import optimizers as Opt

from schedules import update_cuda as C
from static_graph import update_cupy
from static_graph import update_gpu_readers as G
from static_graph.update_readers import Unsupported
from tests.update_twins import RULES

# Hyperparameter settings beyond update_twins.RULES: the variants.
SETTINGS = dict((name, make) for name, (make, _) in RULES.items())
SETTINGS.update({
    'Adam-decay-bound': lambda: Opt.Adam(alpha=0.02, adabound=True,
                                         weight_decay_rate=0.1, eta=0.5),
    'RMSprop-tiny-eps': lambda: Opt.RMSprop(eps=1e-30),
    'MomentumSGD-int-lr': lambda: Opt.MomentumSGD(lr=1, momentum=0),
})


class _Recorder(object):
    """Stands in for ``cuda.elementwise``: the kernel Chainer makes, and
    the arguments of its call."""

    def __init__(self):
        self.made = []
        self.calls = []

    def elementwise(self, in_params, out_params, operation, name, **kw):
        self.made.append((in_params, out_params, operation, kw))
        rec = self

        def kernel(*args):
            rec.calls.append((in_params, out_params, operation, args))
        return kernel


def _chainer_gpu_call(monkeypatch, rule, param):
    rec = _Recorder()
    monkeypatch.setattr(cuda, 'elementwise', rec.elementwise)
    monkeypatch.setattr(cuda, 'cupy', types.SimpleNamespace(
        empty=numpy.empty), raising=False)
    for attr in ('_kernel', '_amsgrad_kernel', '_adabound_kernel',
                 '_amsbound_kernel'):
        for cls in type(rule).__mro__:
            if attr in cls.__dict__:
                monkeypatch.setattr(cls, attr, None)
    monkeypatch.setattr(rule, '_dummy', None, raising=False)
    rule.update_core_gpu(param)
    assert len(rec.calls) == 1
    return rec.calls[0]


def _same_value(a, b):
    assert type(a) is type(b), (a, b)
    assert a == b or (a != a and b != b), (a, b)


def _rule_and_param(make, dtype, t):
    model = chainer.links.Linear(3, 4)
    for p in model.params():
        p.array = p.array.astype(dtype)
        p.grad = numpy.full_like(p.array, 0.25)
    make().setup(model)
    p = model.W
    rule = p.update_rule
    rule._init_states(p)
    rule.t = t
    return rule, p


@pytest.mark.parametrize('t', [1, 7])
@pytest.mark.parametrize('dtype', ['e', 'f', 'd'])
@pytest.mark.parametrize('name', sorted(SETTINGS))
def test_kernel_and_scalars_are_chainers(monkeypatch, name, dtype, t):
    """The kernel text (parameters and C body) is the one Chainer's
    update_core_gpu makes, minus the scalars, which the reader gives with
    Chainer's values (same type and value, so CuPy casts them alike)."""
    rule, p = _rule_and_param(SETTINGS[name], numpy.dtype(dtype), t)
    try:
        kernel, values, keys, sdt = G.RULES[type(rule)](rule, p.array.dtype)
    except Unsupported as e:
        with pytest.raises((ValueError, RuntimeError)):
            _chainer_gpu_call(monkeypatch, rule, p)
        assert 'Chainer raises' in str(e)
        return
    ins, outs, body, args = _chainer_gpu_call(monkeypatch, rule, p)
    assert (kernel.in_params, kernel.out_params, kernel.body) == \
        (ins, outs, body)
    names = [s.split()[-1] for s in ins.split(',')]
    got = dict(zip(names, args))
    assert tuple(kernel.scalars) == tuple(
        n for n in names if n not in ('grad', 'dummy'))
    for n, v in zip(kernel.scalars, values):
        _same_value(got[n], v)
    assert got['grad'] is p.grad
    out_args = args[len(names):]
    assert out_args[0] is p.array
    assert list(out_args[1:]) == [rule.state[k] for k in keys]
    if 'dummy' in got:
        assert got['dummy'].dtype == sdt
    else:
        assert sdt == p.array.dtype
    # What the kernel made here reads: Chainer's scalars, by name.
    mine_ins, mine_outs, mine_body = kernel.source()
    assert mine_outs == outs and mine_body.endswith(body)
    for i, n in enumerate(kernel.scalars):
        assert 'const %s %s = _s[%d];' % (kernel.ctype, n, i) in mine_body
    assert mine_ins.split(', ')[-1] == 'raw %s _s' % kernel.ctype


def test_every_kernel_is_checked():
    seen = set()
    for make in SETTINGS.values():
        model = chainer.links.Linear(2, 2)
        make().setup(model)
        rule = model.W.update_rule
        rule.t = 1
        seen.add(G.RULES[type(rule)](rule, numpy.dtype('f'))[0])
    hooks = {C.WEIGHT_DECAY, C.LASSO}
    assert seen | hooks == set(C.KERNELS)


def test_hook_kernels_are_chainers():
    """WeightDecay's and Lasso's kernels, as their __call__ writes them."""
    import inspect
    from chainer.optimizer_hooks import lasso, weight_decay
    for k, mod in ((C.WEIGHT_DECAY, weight_decay), (C.LASSO, lasso)):
        src = inspect.getsource(mod)
        text = "cuda.elementwise(\n                    '%s', '%s', '%s'," % (
            k.in_params, k.out_params, k.body)
        assert text in src, k.name


# -- CuPy's conversion of a host scalar --------------------------------------

def test_device_values_round_like_cupy():
    # Above the midpoint of 1 and the next float16 by 2**-30: float32
    # loses the 2**-30, and the tie then rounds to even (1.0).
    x = 1 + 2.0 ** -11 + 2.0 ** -30
    assert C.device_values([x], 'e', legacy=True)[0] == 1.0
    assert C.device_values([x], 'e', legacy=False)[0] == 1 + 2.0 ** -10
    assert C.device_values([x], 'e', legacy=False)[0] == numpy.float16(x)
    for legacy in (True, False):
        for dt in ('f', 'd'):
            vals = [0.1, 1e-8, 3, numpy.float64(0.7) ** 3, numpy.float32(.3)]
            got = C.device_values(vals, dt, legacy)
            want = numpy.array([numpy.dtype(dt).type(v) for v in vals])
            assert got.dtype == numpy.dtype(dt)
            assert got.tobytes() == want.astype(dt).tobytes()


def test_legacy_detection_follows_the_installed_cupy():
    cupy = pytest.importorskip('cupy')
    major = int(cupy.__version__.split('.')[0])
    if major <= 13:
        assert C.legacy_scalars(cupy)


# -- the ring of pinned buffers -----------------------------------------------

class FakeStaging(object):
    """A stream whose copies run when the test says: a copy reads its
    host buffer when it runs, as a DMA engine would."""

    def __init__(self):
        self.pending = []            # (dst, src, nbytes, event)
        self.waited = []

    def pinned(self, n):
        return numpy.zeros(n, numpy.uint8)

    def device(self, n):
        return numpy.zeros(n, numpy.uint8)

    def copy(self, dst, src, n):
        self.pending.append([dst, src, n, None])

    def event(self):
        return {'done': False}

    def record(self, ev):
        ev['done'] = False
        self.pending[-1][3] = ev

    def done(self, ev):
        return ev['done']

    def wait(self, ev):
        self.waited.append(ev)
        while not ev['done']:
            self.run(1)

    def run(self, n=None):
        n = len(self.pending) if n is None else n
        for dst, src, size, ev in self.pending[:n]:
            dst[:size] = src[:size]
            ev['done'] = True
        del self.pending[:n]


LAYOUT = [('f', 3), ('e', 2), ('d', 1), ('f', 1)]


def _values(k):
    return [[0.1 * k, 1e-8, k], [0.5 + k, -2.0], [k / 3.0], [7.0 * k]]


def _device_segments(ring):
    return [s.copy() for s in ring.slices]


def _want(k, legacy=False):
    return [C.device_values(v, d, legacy) for (d, _), v in
            zip(LAYOUT, _values(k))]


def test_layout_places_every_segment():
    lay = C.Layout(LAYOUT)
    buf = numpy.zeros(lay.nbytes, numpy.uint8)
    lay.pack(lay.views(buf), _values(2), False)
    for s, w in zip(lay.slices(lay.views(buf)), _want(2)):
        assert s.dtype == w.dtype and s.tobytes() == w.tobytes()
    starts = sorted(lay.starts.values())
    assert all(s % 8 == 0 for s in starts)
    with pytest.raises(ValueError):
        lay.pack(lay.views(buf), [[1.0]] + _values(2)[1:], False)


def test_ring_never_overwrites_a_buffer_in_flight():
    fake = FakeStaging()
    ring = C.ScalarRing(C.Layout(LAYOUT), fake, legacy=False, size=2)
    for k in range(1, 6):            # five steps, the device far behind
        ring.stage(_values(k))
    assert len(ring.slots) == 5 and ring.waits == 0 and not fake.waited
    # The copies run in order; each one reads its own step's values.
    for k in range(1, 6):
        fake.run(1)
        for s, w in zip(_device_segments(ring), _want(k)):
            assert s.tobytes() == w.tobytes()
    # The device caught up: the ring reuses its buffers, grows no more.
    for k in range(6, 20):
        ring.stage(_values(k))
        fake.run()
    assert len(ring.slots) == 5 and ring.copies == 19


def test_ring_reuses_buffers_whose_copy_is_done():
    fake = FakeStaging()
    ring = C.ScalarRing(C.Layout(LAYOUT), fake, legacy=True, size=2)
    used = []
    for k in range(10):
        used.append(ring.stage(_values(k)))
        fake.run()
        for s, w in zip(_device_segments(ring), _want(k, legacy=True)):
            assert s.tobytes() == w.tobytes()
    assert len(ring.slots) == 2 and used == [0, 1] * 5


def test_ring_waits_only_at_its_limit():
    fake = FakeStaging()
    ring = C.ScalarRing(C.Layout(LAYOUT), fake, legacy=False, size=1,
                        limit=3)
    for k in range(3):
        ring.stage(_values(k))
    assert ring.waits == 0 and len(ring.slots) == 3
    ring.stage(_values(3))           # all three in flight: wait, oldest
    assert ring.waits == 1 and len(fake.waited) == 1
    fake.run()
    for s, w in zip(_device_segments(ring), _want(3)):
        assert s.tobytes() == w.tobytes()


# -- fallback decisions on the host --------------------------------------------

def test_ufunc_scalars():
    f, h = numpy.dtype('f'), numpy.dtype('e')
    assert G.ufunc_scalar(0.5, f, 'x') == 0.5
    assert G.ufunc_scalar(2, h, 'x') == 2
    assert G.ufunc_scalar(numpy.float32(2), f, 'x') == 2
    with pytest.raises(Unsupported, match='float64'):
        G.ufunc_scalar(numpy.float64(0.5), f, 'x')
    with pytest.raises(Unsupported, match='range'):
        G.ufunc_scalar(1e5, h, 'x')
    assert G.ufunc_scalar(1e5, f, 'x') == 1e5


def test_numpy_parameters_stay_on_the_numpy_path():
    model = chainer.links.Linear(3, 2)
    assert not update_cupy.on_cupy(list(model.params()))
    assert not update_cupy.on_cupy([chainer.Parameter()])


def test_structure_refuses_what_it_does_not_know():
    class MyRule(Opt.sgd.SGDRule):
        pass

    model = chainer.links.Linear(3, 2)
    opt = Opt.SGD().setup(model)
    st = update_cupy.GpuStructure(opt, list(model.params()))
    assert st.matches(opt, list(model.params()))
    model.W.update_rule = MyRule(opt.hyperparam)
    assert not st.matches(opt, list(model.params()))
    with pytest.raises(Unsupported, match='MyRule'):
        update_cupy.GpuStructure(opt, list(model.params()))


def test_adam_reader_follows_t_and_hyperparameters():
    """alpha_t and the bounds are recomputed from t and the hyperparameters
    at every read (a learning-rate extension changes alpha)."""
    model = chainer.links.Linear(3, 2)
    Opt.Adam(alpha=0.01, adabound=True).setup(model)
    rule = model.W.update_rule
    seen = []
    for t, alpha in ((1, 0.01), (2, 0.01), (3, 0.005)):
        rule.t = t
        rule.hyperparam.alpha = alpha
        k, vals, _, _ = G.RULES[type(rule)](rule, numpy.dtype('f'))
        assert vals[0] == rule.alpha_t and vals[3:5] == rule.bounds
        seen.append(vals)
    assert len(set(seen)) == 3
