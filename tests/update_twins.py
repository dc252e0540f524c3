"""Twin training for the captured optimizer update: one optimizer runs
Chainer's own update, its twin ``static_graph.capture_update``; both see
the same parameters and batches, and after every step every parameter,
gradient, state array and counter must be the same bits."""
import numpy

import chainer
import chainer.functions as F
import chainer.links as L
from chainer import optimizer_hooks as H
from chainer import optimizers as Opt

import static_graph


# Each optimizer the captured update covers, and a hyperparameter to change
# mid-run.
RULES = {
    'SGD': (lambda: Opt.SGD(lr=0.05), 'lr'),
    'MomentumSGD': (lambda: Opt.MomentumSGD(lr=0.05), 'lr'),
    'NesterovAG': (lambda: Opt.NesterovAG(lr=0.05), 'lr'),
    'CorrectedMomentumSGD': (lambda: Opt.CorrectedMomentumSGD(lr=0.05), 'lr'),
    'Adam': (lambda: Opt.Adam(), 'alpha'),
    'AdamW': (lambda: Opt.AdamW(weight_decay_rate=0.05), 'alpha'),
    'Adam-eta': (lambda: Opt.Adam(eta=0.3), 'eta'),
    'AdamW-eta': (lambda: Opt.Adam(weight_decay_rate=0.01, eta=0.3), 'eta'),
    'AMSGrad': (lambda: Opt.AMSGrad(alpha=0.01), 'alpha'),
    'AdaBound': (lambda: Opt.AdaBound(alpha=0.01), 'alpha'),
    'AMSBound': (lambda: Opt.Adam(alpha=0.01, amsgrad=True, adabound=True,
                                  weight_decay_rate=0.1), 'alpha'),
    'RMSprop': (lambda: Opt.RMSprop(), 'lr'),
    'RMSprop-inside': (lambda: Opt.RMSprop(eps_inside_sqrt=True), 'lr'),
    'RMSpropGraves': (lambda: Opt.RMSpropGraves(lr=1e-3), 'lr'),
    'AdaGrad': (lambda: Opt.AdaGrad(lr=0.05), 'lr'),
    'AdaDelta': (lambda: Opt.AdaDelta(), 'rho'),
    'SMORMS3': (lambda: Opt.SMORMS3(lr=0.01), 'lr'),
}


HOOKS = {
    'WeightDecay': lambda: H.WeightDecay(0.01),
    'Lasso': lambda: H.Lasso(0.01),
    'GradientClipping': lambda: H.GradientClipping(0.5),
    'GradientClipping-inactive': lambda: H.GradientClipping(1e9),
    'GradientHardClipping': lambda: H.GradientHardClipping(-0.05, 0.05),
    'GradientLARS': lambda: H.GradientLARS(threshold=1e-3,
                                           weight_decay=0.01),
}


class Net(chainer.Chain):
    """259 + 37 + 185 + 5 parameters: with ``min_split=64`` both weights
    split across threads (at element 128 for two), the biases do not."""

    def __init__(self, dtype=None):
        super(Net, self).__init__()
        with self.init_scope():
            self.l1 = L.Linear(7, 37)
            self.l2 = L.Linear(37, 5)
        if dtype is not None:
            for p in self.params():
                p.array = p.array.astype(dtype)

    def forward(self, x):
        return self.l2(F.tanh(self.l1(x)))


def loss_of(model, x):
    y = model(x)
    return F.sum(y * y) * 0.5 + F.sum(y)


class Twins(object):
    """``a``/``oa``: Chainer's update; ``b``/``ob``: captured (options as
    ``capture``). ``make_opt()`` builds each optimizer (before setup)."""

    def __init__(self, make_opt, seed=0, dtype=None, hooks=(),
                 capture=None, net=Net, device=None):
        numpy.random.seed(seed)
        self.a = net(dtype)
        self.b = net(dtype)
        self.b.copyparams(self.a)
        self.xp = numpy
        if device is not None:       # '@cupy:0': both twins on the GPU
            for m in (self.a, self.b):
                m.to_device(device)
            self.xp = chainer.get_device(device).xp
        self.oa = make_opt().setup(self.a)
        self.ob = make_opt().setup(self.b)
        for make_hook in hooks:
            self.oa.add_hook(make_hook())
            self.ob.add_hook(make_hook())
        opts = dict(threads=2, min_split=64)
        opts.update(capture or {})
        static_graph.capture_update(self.ob, **opts)
        self.rs = numpy.random.RandomState(seed + 100)
        self.dtype = dtype or numpy.float32

    def batch(self, n=6):
        return self.xp.asarray(
            self.rs.standard_normal((n, 7)).astype(self.dtype))

    def backward(self, x=None, loss_scale=None, clear=True):
        x = self.batch() if x is None else x
        for m in (self.a, self.b):
            if clear:
                m.cleargrads()
            loss_of(m, x).backward(loss_scale=loss_scale)

    def update(self):
        self.oa.update()
        self.ob.update()
        self.check()

    def step(self, n=1, **kw):
        for _ in range(n):
            self.backward(**kw)
            self.update()

    def check(self):
        assert_same(self.a, self.b, self.oa, self.ob)

    def for_both(self, fn):
        fn(self.a, self.oa)
        fn(self.b, self.ob)


def _host(x):
    # A CuPy array's values, on the host (for the comparison only).
    if x is None or isinstance(x, numpy.ndarray):
        return x
    return x.get()


def assert_same(a, b, oa, ob):
    pa, pb = {}, {}
    for d, m in ((pa, a), (pb, b)):
        for name, p in m.namedparams():
            d[name] = _HostParam(p)
    assert sorted(pa) == sorted(pb)
    for name in sorted(pa):
        p, q = pa[name], pb[name]
        assert (p.array is None) == (q.array is None)
        if p.array is not None:
            assert p.array.dtype == q.array.dtype, name
            assert numpy.array_equal(p.array, q.array, equal_nan=True), \
                'param %s differs by %s' % (name, _diff(p.array, q.array))
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            assert numpy.array_equal(p.grad, q.grad, equal_nan=True), \
                'grad of %s' % name
        ra, rb = p.update_rule, q.update_rule
        assert (ra is None) == (rb is None)
        if ra is None:
            continue
        assert ra.t == rb.t, 't of %s: %d, %d' % (name, ra.t, rb.t)
        assert ra.enabled == rb.enabled
        assert (p.state is None) == (q.state is None), name
        if p.state is not None:
            assert sorted(p.state) == sorted(q.state)
            for k in p.state:
                sa, sb = p.state[k], q.state[k]
                assert sa.dtype == sb.dtype
                assert numpy.array_equal(sa, sb, equal_nan=True), \
                    'state %s of %s differs by %s' % (k, name, _diff(sa, sb))
        fa, fb = p.fp32, q.fp32
        assert (fa is None) == (fb is None)
        if fa is not None:
            assert numpy.array_equal(fa[0], fb[0], equal_nan=True)
            assert fa[1] is None and fb[1] is None
    assert oa.t == ob.t and oa.epoch == ob.epoch
    assert oa._loss_scale == ob._loss_scale


class _HostParam(object):
    """A parameter's arrays on the host (CuPy ones copied)."""

    def __init__(self, p):
        self.array = _host(p.array)
        self.grad = _host(p.grad)
        self.update_rule = p.update_rule
        rule = p.update_rule
        if rule is not None and rule.state is not None:
            self.state = dict((k, _host(v)) for k, v in rule.state.items())
        else:
            self.state = None
        self.fp32 = None if rule is None or rule._fp32_param is None else \
            (_host(rule._fp32_param.array), rule._fp32_param.grad)


def _diff(x, y):
    with numpy.errstate(all='ignore'):
        return numpy.nanmax(numpy.abs(x.astype('d') - y.astype('d')))


def captured(opt):
    return static_graph.update._capture_of(opt)
