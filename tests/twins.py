"""Train a define-by-run chain and its static twin side by side.

Both twins get the same parameters, the same inputs and the same random seed
before every call; after every step the outputs, every gradient and (after
the optimizer step) every parameter and persistent value must agree.
"""
import warnings

import numpy

import chainer
import chainer.functions as F

from static_graph.decorator import caches_of
from static_graph.decorator import static_graph
from static_graph.diagnostics import StaticGraphWarning


def assert_close(a, b, what, rtol=1e-5, atol=1e-6):
    a = chainer.backend.CpuDevice().send(a)
    b = chainer.backend.CpuDevice().send(b)
    numpy.testing.assert_allclose(a, b, rtol=rtol, atol=atol,
                                  err_msg='%s differs' % what)


def _arrays(out):
    if isinstance(out, chainer.Variable):
        return [out.array]
    if isinstance(out, (tuple, list)):
        return [a for o in out for a in _arrays(o)]
    if isinstance(out, dict):
        return [a for k in sorted(out) for a in _arrays(out[k])]
    if hasattr(out, 'shape'):
        return [out]
    return []


def compare_chains(a, b, rtol=1e-5, atol=1e-6, grads=True):
    pa = dict(a.namedparams())
    pb = dict(b.namedparams())
    assert sorted(pa) == sorted(pb)
    for name in pa:
        assert_close(pa[name].array, pb[name].array, 'param ' + name,
                     rtol, atol)
        if grads:
            ga, gb = pa[name].grad, pb[name].grad
            assert (ga is None) == (gb is None), 'grad of %s' % name
            if ga is not None:
                assert_close(ga, gb, 'grad of ' + name, rtol, atol)
    for (na, la), (nb, lb) in zip(sorted(a.namedlinks()),
                                  sorted(b.namedlinks())):
        for p in getattr(la, '_persistent', ()):
            va, vb = getattr(la, p), getattr(lb, p)
            if hasattr(va, 'shape'):
                assert_close(va, vb, 'persistent %s/%s' % (na, p), rtol, atol)
            else:
                assert va == vb, 'persistent %s/%s' % (na, p)


def loss_of(out):
    """The scalar to backprop from a method's result."""
    if isinstance(out, (tuple, list)):
        out = out[0]
    if isinstance(out, dict):
        out = out['loss']
    if out.size != 1:
        out = chainer.functions.mean(out * out)
    return out


def train_twins(make, steps, optimizer=None, seed=0, rtol=1e-5, atol=1e-6,
                backward=True):
    """``make()`` builds a fresh chain (same init under the same seed).

    ``steps``: list of callables ``step(model) -> result`` (closing over fresh
    inputs). Returns (dbr_chain, static_chain).
    """
    numpy.random.seed(seed)
    a = make(False)
    numpy.random.seed(seed)
    b = make(True)
    b.copyparams(a)
    if optimizer is not None:
        oa, ob = optimizer(), optimizer()
        oa.setup(a)
        ob.setup(b)
    for i, step in enumerate(steps):
        results = []
        for model in (a, b):
            numpy.random.seed(1000 + i)
            out = step(model)
            if backward:
                model.cleargrads()
                loss_of(out).backward()
            results.append(out)
        for x, y in zip(_arrays(results[0]), _arrays(results[1])):
            assert_close(x, y, 'output of step %d' % i, rtol, atol)
        compare_chains(a, b, rtol, atol, grads=backward)
        if optimizer is not None and backward:
            oa.update()
            ob.update()
            compare_chains(a, b, rtol, atol, grads=False)
    return a, b


def stats(chain, method='forward'):
    cache = caches_of(chain).get(method)
    if cache is None:
        return None
    return cache


def twin_optimizers(models, make):
    """One optimizer per model, ``make()`` each, set up on it."""
    opts = []
    for m in models:
        o = make()
        o.setup(m)
        opts.append(o)
    return opts


def static_twins(cls, *args, **options):
    """(define-by-run chain, static chain): ``cls(*args)`` and the same
    class with ``forward`` decorated (with ``options``), same parameters."""
    deco = static_graph(**options) if options else static_graph
    static = type('Static' + cls.__name__, (cls,),
                  {'forward': deco(cls.forward)})
    a, b = cls(*args), static(*args)
    b.copyparams(a)
    return a, b


def method_twins(base, body, optimizer=lambda: chainer.optimizers.SGD(0.01)):
    """[(chain, optimizer)] of an undecorated and a decorated chain of
    class ``base`` with ``body`` as their forward, built under one seed."""
    models = []
    for decorate in (False, True):
        cls = type('Net', (base,), {'forward': static_graph(
            body) if decorate else body})
        numpy.random.seed(0)
        m = cls()
        opt = optimizer()
        opt.setup(m)
        models.append((m, opt))
    return models


def bptt_window(model, opt, xs):
    """One window of truncated backpropagation (examples/ptb): the loss
    of the calls over consecutive words ``xs`` summed, backward, the graph
    cut, the update."""
    loss = 0
    for x, t in zip(xs[:-1], xs[1:]):
        loss += F.softmax_cross_entropy(model(x), t)
    model.cleargrads()
    loss.backward()
    loss.unchain_backward()
    opt.update()


def train_alike(models, before=None, after=None, steps=6, label=None):
    """Train twin chains of forward ``(x, t)`` (x 4x5, t of 3 classes,
    ``l1`` their first link) on the same batches, ``before(m, i)`` ahead
    of each one's step ``i`` and ``after(m)`` after its backward; their
    losses and ``l1.W``'s gradients agree bit for bit at every step.
    Returns the library's warnings (their texts)."""
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        for i in range(steps):
            r = numpy.random.RandomState(i)
            x = r.randn(4, 5).astype('f')
            t = r.randint(0, 3, 4).astype('i')
            seen = []
            for m in models:
                if before is not None:
                    before(m, i)
                m.cleargrads()
                loss = m(x.copy(), t)
                loss.backward()
                if after is not None:
                    after(m)
                seen.append((loss.array, m.l1.W.grad.copy()))
            for a, b in zip(*seen):
                assert numpy.array_equal(a, b), (label, i)
    return [str(x.message) for x in w
            if issubclass(x.category, StaticGraphWarning)]
