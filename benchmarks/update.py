"""The optimizer update alone: Chainer's ``optimizer.update()`` against the
captured update (``static_graph.capture_update``), side by side.

    .venv/bin/python benchmarks/update.py                  # MLP, Adam & SGD
    .venv/bin/python benchmarks/update.py --rounds 15 --steps 20

Model: MLP 784-1000-1000-10 (1.8M parameters), gradients filled once with
random numbers. Variants, all in one process, interleaved round by round,
each timed over ``--steps`` updates per round; the table gives the median
time per update over rounds and Chainer's time divided by the variant's:

* ``chainer``: Chainer 7.8.1's own update;
* ``captured``: ``capture_update(optimizer)`` (threads: the cores this
  process may use);
* ``captured-1``: ``capture_update(optimizer, threads=1)``;
* ``numpy``: a hand-written in-place NumPy update (one ufunc call per
  operation on whole arrays, preallocated temporaries): what the element-wise
  work costs with no framework and one thread, for reference;
* ``numpy-2t`` (where more than one core is available): the same, its
  large arrays cut in halves run by two threads: what two threads give on
  this machine at this moment (these machines are shared).

Before timing, each captured variant is checked against Chainer's update
over a few steps from the same start (parameters and state, bit for bit).
``--tiny`` adds a 10-10-10-10 MLP, where the per-step Python work is all
there is.
"""
import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import static_graph  # NOQA  (before chainer: Python 3.12+/NumPy 2)
import numpy  # NOQA

import chainer  # NOQA
import chainer.links as L  # NOQA

from schedules import parallel  # NOQA


class MLP(chainer.ChainList):
    def __init__(self, sizes):
        super(MLP, self).__init__(*[L.Linear(a, b) for a, b in
                                    zip(sizes[:-1], sizes[1:])])


def make(sizes, seed=0):
    numpy.random.seed(seed)
    m = MLP(sizes)
    rs = numpy.random.RandomState(seed + 1)
    for p in m.params():
        p.grad = rs.standard_normal(p.shape).astype(numpy.float32)
    return m


class NumpyAdam(object):
    """In-place Adam on whole arrays (Chainer's defaults); with ``threads``
    > 1, each parameter of 32768 elements or more is cut in ``threads``
    flat halves (thirds...) run by a plain pool: what threads give with no
    framework at all, on this machine at this moment."""

    def __init__(self, params, alpha=0.001, beta1=0.9, beta2=0.999,
                 eps=1e-8, threads=1):
        self.params = params
        self.h = (alpha, beta1, beta2, eps)
        self.m = [numpy.zeros_like(p.array) for p in params]
        self.v = [numpy.zeros_like(p.array) for p in params]
        self.t0 = [numpy.empty_like(p.array) for p in params]
        self.t = 0
        self.threads = threads

    def update(self):
        alpha, beta1, beta2, eps = self.h
        self.t += 1
        alpha_t = alpha * (1 - beta2 ** self.t) ** 0.5 / (1 - beta1 ** self.t)
        if self.threads == 1:
            for p, m, v, t0 in zip(self.params, self.m, self.v, self.t0):
                self._one(p.grad, p.array, m, v, t0, alpha_t)
            return
        _split(self.threads, self._one, [
            (p.size, [a.reshape(-1) for a in (p.grad, p.array, m, v, t0)],
             (alpha_t,))
            for p, m, v, t0 in zip(self.params, self.m, self.v, self.t0)])

    def _one(self, g, x, m, v, t0, alpha_t):
        alpha, beta1, beta2, eps = self.h
        numpy.subtract(g, m, out=t0)
        numpy.multiply(1 - beta1, t0, out=t0)
        numpy.add(m, t0, out=m)
        numpy.multiply(g, g, out=t0)
        numpy.subtract(t0, v, out=t0)
        numpy.multiply(1 - beta2, t0, out=t0)
        numpy.add(v, t0, out=v)
        numpy.sqrt(v, out=t0)
        numpy.add(t0, eps, out=t0)
        numpy.true_divide(alpha_t, t0, out=t0)
        numpy.multiply(t0, m, out=t0)
        numpy.multiply(-1.0, t0, out=t0)
        numpy.add(x, t0, out=x)


class NumpySGD(object):
    def __init__(self, params, lr=0.01, threads=1):
        self.params = params
        self.lr = lr
        self.t0 = [numpy.empty_like(p.array) for p in params]
        self.threads = threads

    def update(self):
        if self.threads == 1:
            for p, t0 in zip(self.params, self.t0):
                self._one(p.grad, p.array, t0)
            return
        _split(self.threads, self._one, [
            (p.size, [a.reshape(-1) for a in (p.grad, p.array, t0)], ())
            for p, t0 in zip(self.params, self.t0)])

    def _one(self, g, x, t0):
        numpy.multiply(self.lr, g, out=t0)
        numpy.subtract(x, t0, out=x)


def _split(threads, fn, work):
    """Run ``fn(*arrays, *extra)`` for each (size, arrays, extra), arrays
    of 32768 elements or more cut in ``threads`` chunks, on a pool."""
    parts = [[] for _ in range(threads)]
    for size, arrays, extra in work:
        if size < 32768:
            parts[0].append((fn, tuple(arrays) + extra))
            continue
        for w, (lo, hi) in enumerate(parallel.chunks(size, threads)):
            parts[w].append((fn, tuple(a[lo:hi] for a in arrays) + extra))
    parallel.pool(threads).run(parts)


OPTIMIZERS = {
    'adam': (lambda: chainer.optimizers.Adam(), NumpyAdam),
    'sgd': (lambda: chainer.optimizers.SGD(lr=0.01), NumpySGD),
}


def check(sizes, make_opt, threads, steps=3):
    """The captured update against Chainer's, bit for bit."""
    a, b = make(sizes), make(sizes)
    oa, ob = make_opt().setup(a), make_opt().setup(b)
    static_graph.capture_update(ob, threads=threads)
    for _ in range(steps):
        oa.update()
        ob.update()
    for p, q in zip(a.params(), b.params()):
        if not numpy.array_equal(p.array, q.array):
            return False
        for k, s in p.update_rule.state.items():
            if not numpy.array_equal(s, q.update_rule.state[k]):
                return False
    return oa.t == ob.t and not static_graph.update.fallback_reasons(ob)


def bench(name, sizes, opt_name, rounds, steps):
    make_opt, make_numpy = OPTIMIZERS[opt_name]
    threads = parallel.default_threads()
    variants = {}
    m = make(sizes)
    variants['chainer'] = make_opt().setup(m).update
    m = make(sizes)
    variants['captured'] = static_graph.capture_update(
        make_opt().setup(m)).update
    m = make(sizes)
    variants['captured-1'] = static_graph.capture_update(
        make_opt().setup(m), threads=1).update
    m = make(sizes)
    variants['numpy'] = make_numpy(list(m.params())).update
    if threads > 1:
        m = make(sizes)
        variants['numpy-%dt' % threads] = make_numpy(
            list(m.params()), threads=threads).update
    same = {'captured': check(sizes, make_opt, threads),
            'captured-1': check(sizes, make_opt, 1)}
    for fn in variants.values():       # warm up (states, plans, pools)
        fn()
    times = {k: [] for k in variants}
    for r in range(rounds):
        for k, fn in variants.items():
            t = time.perf_counter()
            for _ in range(steps):
                fn()
            times[k].append((time.perf_counter() - t) / steps)
    med = {k: float(numpy.median(v)) for k, v in times.items()}
    print('\n%s, %s (%d parameters), %d rounds x %d updates, threads=%d' % (
        name, opt_name, sum(int(numpy.prod(p.shape)) for p in m.params()),
        rounds, steps, threads))
    print('  %-11s %10s %9s  %s' % ('variant', 'ms/update', 'chainer/x',
                                    'bit for bit'))
    for k in variants:
        print('  %-11s %10.3f %9.2f  %s' % (
            k, med[k] * 1e3, med['chainer'] / med[k],
            {True: 'yes', False: 'NO'}.get(same.get(k), '-')))
    return med


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument('--rounds', type=int, default=9)
    parser.add_argument('--steps', type=int, default=10)
    parser.add_argument('--optimizers', nargs='+', default=['adam', 'sgd'])
    parser.add_argument('--tiny', action='store_true')
    args = parser.parse_args()
    print('numpy %s, chainer %s, cores available %d, load average %s' % (
        numpy.__version__, chainer.__version__, parallel.default_threads(),
        ' '.join('%.2f' % x for x in os.getloadavg())))
    for opt in args.optimizers:
        bench('MLP 784-1000-1000-10', (784, 1000, 1000, 10), opt,
              args.rounds, args.steps)
        if args.tiny:
            bench('MLP 10-10-10-10', (10, 10, 10, 10), opt, args.rounds,
                  args.steps * 20)


if __name__ == '__main__':
    main()
