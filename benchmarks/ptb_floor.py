"""How fast can a replay of the kit's 2-layer LSTM LM (benchmarks/kit/ptb.py)
be? A floor analysis, per hidden size.

    .venv/bin/python benchmarks/ptb_floor.py              # h200 and h650
    OPENBLAS_NUM_THREADS=1 .venv/bin/python benchmarks/ptb_floor.py --units 200

One process trains the define-by-run twin and the decorated one on the same
batches (bit for bit equal, checked after every step) and times, per step
(BPTT window of 35 calls, median over the steps after warm-up):

* ``dbr``: the define-by-run step; ``replay``: the decorated one;
* ``outside``: the decorated step again with every schedule run replaced by
  its previous result (no kernel runs; the values are then wrong, and the
  step's parameters are put back): what is left is Chainer's own work
  outside the method (the Classifier's loss, ``loss +=``, its backprop,
  the optimizer) plus ours (dispatch, ReplayNode, handing gradients);
* ``kernels`` = replay - outside: the ops the schedules run, the very
  computations define-by-run runs (GEMMs, LSTM, dropout, gradient sums);
* ``ours``: our Python around the schedule runs (the decorated forward's
  call less its schedule run, ``backward_from`` less its schedule run);
* ``gemms``: the matrix products alone of one window (same shapes, into
  preallocated memory), and with the gradient sums of the parameters.

The best a replay can do is ``kernels + outside - ours``: ``bound`` =
dbr / that.
"""
import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import static_graph  # NOQA  (before chainer: Python 3.12+/NumPy 2)
import numpy  # NOQA
import chainer  # NOQA

from benchmarks.kit import common  # NOQA
from benchmarks.kit import ptb  # NOQA
from benchmarks.kit import runner  # NOQA
from schedules import executor  # NOQA
from static_graph import nodes  # NOQA

perf = time.perf_counter
_NULL = [False]
_SPENT = {'run': 0.0, 'forward call': 0.0, 'backward_from': 0.0}
_run = executor.TieredSchedule.__call__
_backward_from = nodes._Replayed.backward_from


def _timed_run(self, args):
    if _NULL[0] and getattr(self, '_last', None) is not None:
        if args.__class__ is list:
            args.clear()
        return self._last
    t = perf()
    r = self._last = _run(self, args)
    _SPENT['run'] += perf() - t
    return r


def _timed_backward_from(self, *a, **k):
    t = perf()
    r = _backward_from(self, *a, **k)
    _SPENT['backward_from'] += perf() - t
    return r


def gemm_window(n_units, batch=20, n_vocab=500, bptt=35, rounds=7):
    """(GEMMs, GEMMs + gradient sums) of one window, ms (median)."""
    r = numpy.random.RandomState(0)

    def f(*s):
        return r.uniform(-0.1, 0.1, s).astype(numpy.float32)
    H, B, V = n_units, batch, n_vocab
    Ws = [f(4 * H, H) for _ in range(4)] + [f(V, H)]
    x, gy4, gy3 = f(B, H), f(B, 4 * H), f(B, V)
    ys = [numpy.empty((B, w.shape[0]), numpy.float32) for w in Ws]
    gxs = [numpy.empty((B, H), numpy.float32) for w in Ws]
    gws = [numpy.empty_like(w) for w in Ws]
    acc = [numpy.zeros_like(w) for w in Ws]

    def window(sums):
        for _ in range(bptt):
            for w, y, gx, gw in zip(Ws, ys, gxs, gws):
                gy = gy3 if w.shape[0] == V else gy4
                numpy.dot(x, w.T, out=y)
                numpy.dot(gy, w, out=gx)
                numpy.dot(gy.T, x, out=gw)
            if sums:
                for a, g in zip(acc, gws):
                    numpy.add(a, g, out=a)
    out = []
    for sums in (False, True):
        ts = []
        for _ in range(rounds):
            t = perf()
            window(sums)
            ts.append(perf() - t)
        out.append(numpy.median(ts) * 1e3)
    return out


def step(case, model, opt, batch, times):
    """The kit's training step (case.step), timed."""
    t0 = perf()
    case.step(model, [opt], batch)
    times.append(perf() - t0)


def measure(n_units, steps, warmup=3):
    case = ptb.make_case(n_units=n_units, batch=20, steps=steps)
    twins = dict((s, runner.build(case, s, 0)) for s in (False, True))
    pred = twins[True][0].predictor
    fwd = pred.forward

    def timed_forward(*a, **k):
        t = perf()
        r = fwd(*a, **k)
        _SPENT['forward call'] += perf() - t
        return r
    pred.forward = timed_forward
    batches = case.batches(numpy.random.RandomState(1), steps)
    T = {'dbr': [], 'replay': [], 'outside': []}
    ours = []
    for i, batch in enumerate(batches):
        order = ('dbr', 'replay') if i % 2 == 0 else ('replay', 'dbr')
        for name in order:
            model, (opt,) = twins[name == 'replay']
            numpy.random.seed(1000 + i)
            for k in _SPENT:
                _SPENT[k] = 0.0
            step(case, model, opt, common.copy_batch(batch), T[name])
            if name == 'replay':
                run = _SPENT['run']
                ours.append(_SPENT['forward call'] +
                            _SPENT['backward_from'] - run)
        for (_, a), (_, b) in zip(runner.arrays_of(twins[False][0]),
                                  runner.arrays_of(twins[True][0])):
            assert runner.difference(a, b) == 0, 'not equal at step %d' % i
        if i >= warmup:
            # The decorated step with the schedules' previous results:
            # its parameters and state put back afterwards.
            model, (opt,) = twins[True]
            saved = [(p, p.array.copy()) for p in model.params()]
            state = [(l, l.c, l.h) for l in (model.predictor.l1,
                                             model.predictor.l2)]
            rng = numpy.random.get_state()
            _NULL[0] = True
            try:
                step(case, model, opt, common.copy_batch(batch), T['outside'])
            finally:
                _NULL[0] = False
            for p, a in saved:
                p.array[...] = a
            for l, c, h in state:
                l.c, l.h = c, h
            numpy.random.set_state(rng)
    med = dict((k, numpy.median(v[warmup:] if k != 'outside' else v) * 1e3)
               for k, v in T.items())
    med['ours'] = numpy.median(ours[warmup:]) * 1e3
    med['kernels'] = med['replay'] - med['outside']
    return med


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--units', type=int, nargs='*', default=[200, 650])
    p.add_argument('--steps', type=int, default=12)
    args = p.parse_args()
    import warnings
    warnings.simplefilter('ignore')
    executor.TieredSchedule.__call__ = _timed_run
    nodes._Replayed.backward_from = _timed_backward_from
    print('OPENBLAS_NUM_THREADS=%s; ms per step (35 calls)'
          % os.environ.get('OPENBLAS_NUM_THREADS', 'default'))
    for h in args.units:
        m = measure(h, args.steps)
        g, gs = gemm_window(h)
        best = m['kernels'] + m['outside'] - m['ours']
        print('h%d: dbr %.1f, replay %.1f (%.2fx); kernels %.1f (GEMMs alone '
              '%.1f, with the gradient sums %.1f), outside %.1f of which ours '
              '%.1f; bound dbr / (kernels + outside - ours) = %.2fx, '
              '1.6x needs %.1f' % (
                  h, m['dbr'], m['replay'], m['dbr'] / m['replay'],
                  m['kernels'], g, gs, m['outside'], m['ours'],
                  m['dbr'] / best, m['dbr'] / 1.6))


if __name__ == '__main__':
    main()
