"""Long differential fuzzing run: define-by-run vs ``@static_graph`` twins.

    .venv/bin/python benchmarks/fuzz.py --examples 5000 --seed 0
    .venv/bin/python benchmarks/fuzz.py --minutes 10 --exclude-known
    .venv/bin/python benchmarks/fuzz.py --examples 500 --device @cupy:0

Runs the property of tests/test_fuzz.py (grammar in tests/fuzz_grammar.py)
in chunks of ``--chunk`` examples, each chunk a Hypothesis run with its own
seed (``--seed`` + chunk number), so that one bug does not end the run.
A divergence is shrunk by Hypothesis and its minimal failing example (the
chain's source and the call pattern) is printed. At the end: examples run,
divergences (distinct by what differed and which functions the minimal
chain uses), fallbacks.

Exit status: 0 if no divergence, 1 otherwise.
"""
import argparse
import collections
import os
import re
import sys
import time
import traceback
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))

from hypothesis import HealthCheck, Phase, given, seed, settings  # NOQA

from tests import fuzz_grammar as grammar  # NOQA


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--examples', type=int, default=2000,
                   help='examples to generate (default 2000)')
    p.add_argument('--seed', type=int, default=0)
    p.add_argument('--chunk', type=int, default=250,
                   help='examples per Hypothesis run (default 250)')
    p.add_argument('--minutes', type=float, default=None,
                   help='start no new chunk after this many minutes')
    p.add_argument('--exclude', default='',
                   help='comma-separated op/activation names not to draw')
    p.add_argument('--exclude-known', action='store_true',
                   help='also exclude %s' % ', '.join(
                       grammar.KNOWN_BAD_OPS))
    p.add_argument('--dtypes', default=','.join(grammar.DTYPES))
    p.add_argument('--max-layers', type=int, default=6)
    p.add_argument('--max-steps', type=int, default=5)
    p.add_argument('--no-shrink', action='store_true',
                   help='report the first failing example as generated')
    p.add_argument('--exact', action='store_true',
                   help='a result within tolerance but not bit for bit '
                        'equal counts as a divergence')
    p.add_argument('--device', default=None,
                   help="Chainer device of both twins, e.g. '@cupy:0' "
                        '(default: NumPy)')
    p.add_argument('--capture-early', action='store_true',
                   help='capture CUDA graphs (or, on NumPy, the stand-in '
                        'of tests/fake_cuda_graph.py) at the first compiled '
                        'run, so that short call patterns reach them')
    p.add_argument('--split-all', action='store_true',
                   help='split every kernel that can be split across '
                        'threads (static_graph/split_kernels.py), however '
                        'small, on every call (not only where it measures '
                        'faster); small ops then get their kernels when '
                        'built, as large ones do')
    p.add_argument('--quiet', action='store_true',
                   help='print only the summary and the minimal examples')
    return p.parse_args(argv)


_CALL = re.compile(r'\b([FL]\.[A-Za-z_0-9]+)\(')
_NUM = re.compile(r'[-+]?\d[\d.e+-]*')


def signature(exc, text):
    """What tells two divergences apart: the kind of value that differed
    and the Chainer functions/links of the minimal chain."""
    msg = str(exc)
    what = 'error'
    m = re.search(r': (call \d+ output|call \d+ input grad|grad of|param|'
                  r'persistent|at the end)', msg)
    if isinstance(exc, grammar.Divergence):
        what = m.group(1) if m else 'divergence'
        what = re.sub(r'\d+', 'N', what)
    else:
        what = '%s: %s' % (type(exc).__name__,
                           _NUM.sub('N', msg.strip().splitlines()[0]
                                    if msg.strip() else ''))
    calls = sorted(set(_CALL.findall(text)))
    return what, tuple(calls)


def leaves(exc):
    if isinstance(exc, BaseExceptionGroup):
        out = []
        for e in exc.exceptions:
            out.extend(leaves(e))
        return out
    return [exc]


def main(argv=None):
    args = parse_args(argv)
    grammar.EXACT = args.exact
    grammar.DEVICE = args.device
    if args.capture_early:
        from static_graph import graphs
        graphs.CAPTURE_AFTER = 0
        if args.device is None:
            from tests import fake_cuda_graph
            graphs.set_backend(fake_cuda_graph.FakeBackend())
    if args.split_all:
        from schedules import parallel
        from static_graph import lower_pass
        from static_graph import split_kernels
        split_kernels.MIN_ELEMENTS = 0
        lower_pass._DEFER_LOWERING_BYTES = -1
        parallel.SplitChoice.use_pool = \
            lambda self: (self.threads > 1, False)
    if args.device is not None:
        import chainer
        chainer.get_device(args.device).use()
    exclude = [e for e in args.exclude.split(',') if e]
    if args.exclude_known:
        exclude += list(grammar.KNOWN_BAD_OPS)
    dtypes = tuple(d for d in args.dtypes.split(',') if d)
    stats = grammar.Stats()
    divergences = collections.OrderedDict()   # signature -> (count, text)
    phases = [Phase.explicit, Phase.generate]
    if not args.no_shrink:
        phases.append(Phase.shrink)
    strategy = grammar.examples(dtypes=dtypes, max_layers=args.max_layers,
                                max_steps=args.max_steps, exclude=exclude)
    start = time.time()
    generated = 0
    chunk = 0
    print('fuzzing: %d examples, seed %d, chunks of %d%s%s%s' % (
        args.examples, args.seed, args.chunk,
        ', on %s' % args.device if args.device else '',
        ', excluding %s' % ','.join(exclude) if exclude else '',
        ', at most %.1f min' % args.minutes if args.minutes else ''))
    while generated < args.examples:
        if args.minutes and time.time() - start > args.minutes * 60:
            print('time limit reached')
            break
        n = min(args.chunk, args.examples - generated)
        chunk_seed = args.seed + chunk
        counter = {'n': 0}

        @seed(chunk_seed)
        @settings(max_examples=n, deadline=None, database=None,
                  derandomize=False, phases=phases,
                  report_multiple_bugs=True, print_blob=True,
                  suppress_health_check=list(HealthCheck))
        @given(strategy)
        def prop(example):
            counter['n'] += 1
            prog, seq, s = example
            grammar.check_example(prog, seq, s, stats)

        t0 = time.time()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter('ignore')
                prop()
            failed = []
        except BaseException as e:   # Hypothesis' report of the failures
            if isinstance(e, KeyboardInterrupt):
                raise
            failed = leaves(e)
        generated += n
        chunk += 1
        for exc in failed:
            notes = '\n'.join(getattr(exc, '__notes__', ()))
            sig = signature(exc, notes)
            count, _ = divergences.get(sig, (0, None))
            first = count == 0
            text = '%s\n%s' % (''.join(traceback.format_exception_only(
                type(exc), exc)).strip(), notes)
            divergences[sig] = (count + 1, divergences.get(
                sig, (0, text))[1])
            if first or not args.quiet:
                print('\n=== divergence %s (chunk seed %d) ===\n%s\n'
                      % ('NEW' if first else 'again', chunk_seed, text))
        if not args.quiet:
            print('chunk %d (seed %d): %d examples checked in %.1fs, %d '
                  'failure(s); total %d checked, %d with a fallback' % (
                      chunk, chunk_seed, counter['n'], time.time() - t0,
                      len(failed), stats.examples,
                      stats.fallback_examples))
            sys.stdout.flush()
    elapsed = time.time() - start
    print('\n==== summary (%.0f s) ====' % elapsed)
    print('Hypothesis runs: %d of up to %d examples each (%d requested; a '
          'run that finds a divergence stops generating and shrinks)'
          % (chunk, args.chunk, generated))
    print('examples checked (each a full define-by-run vs static run; '
          'shrinking included): %d' % stats.examples)
    print(stats.summary())
    from schedules import cuda_graph
    if any(cuda_graph.counts.values()):
        print('CUDA graphs: %(captured)d schedules captured, %(refused)d '
              'refused, %(stale)d gone stale' % cuda_graph.counts)
    print('divergences: %d distinct, %d reports' % (
        len(divergences), sum(c for c, _ in divergences.values())))
    for (what, calls), (count, _) in divergences.items():
        print('  x%d  %s  [%s]' % (count, what, ', '.join(calls)))
    return 1 if divergences else 0


if __name__ == '__main__':
    sys.exit(main())
