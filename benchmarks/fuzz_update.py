"""Differential fuzzing of the captured optimizer update against Chainer's.

    .venv/bin/python benchmarks/fuzz_update.py --cases 2000 --seed 0
    .venv/bin/python benchmarks/fuzz_update.py --minutes 5
    .venv/bin/python benchmarks/fuzz_update.py --seed 3 --case 117   # one
    python3 benchmarks/fuzz_update.py --device @cupy:0 --minutes 1  # GPU
    .venv/bin/python benchmarks/fuzz_update.py --steady --cases 5000

Each case (tests/update_fuzz.py) is a random optimizer set-up and run of
steps, twin-trained from the same parameters: Chainer's own update against
``static_graph.capture_update``, compared bit for bit after every step.
A divergence prints the case (how to run it again, what it was) and what
differed. At the end: cases, steps, steps captured and run by Chainer's
update (the fallbacks, by reason), cases where both twins raised alike.

``--steady``: the captured update's steady path against reading every step
in full, both on fake CuPy (tests/update_steady_fuzz.py), without a GPU.

Exit status: 0 if no divergence, 1 otherwise.
"""
import argparse
import collections
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))

import static_graph  # NOQA  (before chainer: Python 3.12+/NumPy 2)

from tests import update_fuzz  # NOQA
from tests import update_steady_fuzz  # NOQA


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--cases', type=int, default=500,
                   help='cases to run (default 500)')
    p.add_argument('--seed', type=int, default=0)
    p.add_argument('--case', type=int, default=None,
                   help='run only this case of --seed')
    p.add_argument('--minutes', type=float, default=None,
                   help='stop after this long (whichever comes first)')
    p.add_argument('--device', default=None,
                   help='@cupy:0: both twins on the GPU (Chainer\'s own '
                        'CuPy update against the captured one)')
    p.add_argument('--steady', action='store_true',
                   help='the steady path of the captured update on fake '
                        'CuPy against the full read')
    p.add_argument('--quiet', action='store_true',
                   help='print divergences and the summary only')
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    indexes = [args.case] if args.case is not None else range(args.cases)
    deadline = None if args.minutes is None else \
        time.time() + 60 * args.minutes
    n = steps = captured = fallback = raised = steady = 0
    fuzz = update_steady_fuzz if args.steady else update_fuzz
    reasons = collections.Counter()
    diverged = []
    for i in indexes:
        if deadline is not None and time.time() > deadline:
            break
        case = update_steady_fuzz.make_case(args.seed, i) if args.steady \
            else update_fuzz.make_case(args.seed, i, args.device)
        n += 1
        try:
            res = fuzz.run_case(case)
        except AssertionError as e:
            diverged.append(i)
            print('DIVERGED: --seed %d --case %d\n  %s\n  %s' % (
                args.seed, i, fuzz.describe(case),
                str(e).splitlines()[0] if str(e) else
                traceback.format_exc().splitlines()[-1]))
            sys.stdout.flush()
            continue
        steps += res.steps
        captured += res.captured
        fallback += res.fallback
        reasons.update(res.reasons)
        raised += res.raised is not None
        steady += getattr(res, 'steady', 0)
        if not args.quiet or args.case is not None:
            print('case %d: %d steps, %d captured%s: %s' % (
                i, res.steps, res.captured,
                ' (both raised: %s)' % res.raised if res.raised else '',
                fuzz.describe(case)))
    print('%d cases, %d steps: %d captured, %d run by Chainer\'s update; '
          '%d cases where both raised alike; %d diverged%s' % (
              n, steps, captured, fallback, raised, len(diverged),
              (' (cases %s)' % ' '.join(map(str, diverged)))
              if diverged else ''))
    if args.steady:
        print('  %d steps read as the step before (the steady path)'
              % steady)
    for reason, count in reasons.most_common():
        print('  fallback reason (%d cases): %s' % (count, reason))
    return 1 if diverged else 0


if __name__ == '__main__':
    sys.exit(main())
