"""Record a benchmark model and draw its memory plan as a PNG.

    .venv/bin/python benchmarks/plot_plan.py --case mlp-b8 --out plan.png
"""
import argparse
import os
import sys
import warnings

import numpy

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import run  # NOQA
import static_graph  # NOQA
from schedules import plot  # NOQA


def main(argv=None):
    names = [c['name'] for c in run.all_cases()]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--case', default='cnn-b32', choices=names)
    parser.add_argument('--out', default='plan.png')
    args = parser.parse_args(argv)
    warnings.simplefilter('ignore')
    case = [c for c in run.all_cases() if c['name'] == args.case][0]
    model, opt = run.build(case)['ours']
    batch = case['batch'](numpy.random.RandomState(0))
    run.step(model, opt, batch, 'ours')     # records forward and backward
    entry = [s for s in static_graph.cached(model)
             if s.state == 'complete'][0]
    plan = entry.memory_plan()
    scheds = [entry.forward] + ([entry.backward] if entry.backward else [])
    plot.plot_plan(scheds, plan, args.out,
                   title='%s (%s)' % (args.case, case['note']))
    print('%s: %s' % (args.out, plan.summary()))
    return plan


if __name__ == '__main__':
    main()
