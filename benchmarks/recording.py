"""What the first iterations cost: recording, the first replays, break-even.

    .venv/bin/python benchmarks/recording.py
    .venv/bin/python benchmarks/recording.py --cases mlp-b1 --trials 9

Per case, fresh models of both kinds (define-by-run and decorated) are
trained side by side in one process, trial after trial, from the same
parameters on the same batch (SGD, as in run.py). Reported, as medians over
the trials:

* recording / dbr: the first iteration of a fresh decorated model (it
  records) over a steady define-by-run iteration (the median of iterations
  4 to 13 of a define-by-run model);
* recording / dbr first: the same over define-by-run's own first
  iteration, which pays first use too (gradient arrays, the optimizer's
  state, cold memory): what recording adds;
* 1+2 / dbr 1+2: the first two iterations of a fresh decorated model over
  the first two of a fresh define-by-run model (both pay first use:
  gradient arrays, cold memory);
* break-even: the first iteration n at which the decorated model's
  cumulative time (iterations 1..n) is at or below define-by-run's, or
  '>N' if not within the N iterations timed.

Targets (issue 27): recording / dbr at most 1.5 for mlp-b8, mlp-b100 and
cnn-b32, at most 2.0 for mlp-b1 and tiny; 1+2 at most 1.5 for mlp-b100;
break-even within 10 iterations for mlp-b1. ``--captured-update`` gives
the decorated model's optimizer ``static_graph.capture_update`` (the
library's whole offering against plain Chainer).
"""
import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import static_graph  # NOQA  (before chainer: Python 3.12+/NumPy 2)
import numpy  # NOQA

import run  # NOQA

DEFAULT_CASES = ('tiny', 'mlp-b1', 'mlp-b8', 'mlp-b100', 'cnn-b32')


def _times(model, opt, batch, variant, n):
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        run.step(model, opt, batch, variant)
        out.append(time.perf_counter() - t0)
    return out


def measure(case, trials, iterations, captured=False):
    batch = case['batch'](numpy.random.RandomState(5))
    first = {'dbr': [], 'ours': []}
    for _ in range(trials):
        built = run.build(case, skip=('chainer',))
        if captured:
            static_graph.capture_update(built['ours'][1])
        # Interleaved: each trial times a fresh model of each kind.
        for v in ('ours', 'dbr'):
            m, o = built[v]
            first[v].append(_times(m, o, batch, v, iterations))
    steady = [t for ts in first['dbr'] for t in ts[3:13]]
    dbr_steady = float(numpy.median(steady))
    rec = [ts[0] for ts in first['ours']]
    one_two = [sum(o[:2]) / sum(d[:2])
               for o, d in zip(first['ours'], first['dbr'])]
    even = []
    for o, d in zip(first['ours'], first['dbr']):
        co, cd = numpy.cumsum(o), numpy.cumsum(d)
        hit = [i + 1 for i in range(iterations) if co[i] <= cd[i]]
        even.append(hit[0] if hit else iterations + 1)
    return {'dbr_steady': dbr_steady,
            'dbr_first': float(numpy.median([ts[0] for ts in first['dbr']])),
            'recording': float(numpy.median(rec)),
            'recording_ratio': float(numpy.median(rec)) / dbr_steady,
            'one_two_ratio': float(numpy.median(one_two)),
            'break_even': int(numpy.median(even)),
            'iterations': iterations}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--cases', nargs='*', default=list(DEFAULT_CASES))
    parser.add_argument('--trials', type=int, default=7)
    parser.add_argument('--iterations', type=int, default=20)
    parser.add_argument('--captured-update', action='store_true',
                        help='the decorated model\'s optimizer with '
                             'static_graph.capture_update (define-by-run '
                             'keeps Chainer\'s)')
    args = parser.parse_args()
    by_name = dict((c['name'], c) for c in run.all_cases())
    print('| case | dbr iteration | dbr first iteration | recording | '
          'recording / dbr | recording / dbr first | 1+2 / dbr 1+2 | '
          'break-even iteration |')
    print('|---|---|---|---|---|---|---|---|')
    for name in args.cases:
        r = measure(by_name[name], args.trials, args.iterations,
                    args.captured_update)
        even = r['break_even']
        print('| %s | %s | %s | %s | %.2fx | %.2fx | %.2fx | %s |' % (
            name, run.fmt_time(r['dbr_steady']), run.fmt_time(r['dbr_first']),
            run.fmt_time(r['recording']), r['recording_ratio'],
            r['recording'] / r['dbr_first'], r['one_two_ratio'],
            even if even <= r['iterations'] else '>%d' % r['iterations']))
        sys.stdout.flush()


if __name__ == '__main__':
    main()
