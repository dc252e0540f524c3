"""Side-by-side benchmark: define-by-run, chainer.static_graph, this library.

    .venv/bin/python benchmarks/run.py                 # every case
    .venv/bin/python benchmarks/run.py --cases tiny mlp-b1 --rounds 9

All variants of a case run in one process, interleaved round by round (these
machines are noisy), from the same initial parameters on the same batches.
Reported per variant: median time per training iteration (cleargrads,
forward, backward, optimizer update), the ratio define-by-run / variant,
whether its losses and parameters matched define-by-run over the first
iterations, FunctionNodes applied per iteration, the recording iteration's
time against a define-by-run iteration, and the peak memory of an iteration
above what the model held before its first call (tracemalloc; this includes
what a variant keeps between iterations). Writes results.md and results.json next to this file (or to
--out).
"""
import argparse
import gc
import json
import os
import platform
import sys
import time
import tracemalloc
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import static_graph  # NOQA  (before chainer: Python 3.12+/NumPy 2)
import numpy  # NOQA

import chainer  # NOQA

import cases  # NOQA
import numpy_mlp  # NOQA
from static_graph import decorator as static_decorator  # NOQA


def _case(name, model, batch, n_iter, note=''):
    return dict(name=name, model=model, batch=batch, n_iter=n_iter,
                note=note)


def all_cases():
    rs = numpy.random.RandomState(0)
    tiny_x = rs.randn(2, 3).astype(numpy.float32)
    out = [_case('tiny', lambda: cases.Tiny(), lambda rs: (tiny_x,), 20,
                 '200 element-wise ops on (2,3), forward+backward')]
    for b in (1, 8, 100):
        out.append(_case('mlp-b%d' % b, lambda: cases.MLP(),
                         lambda rs, b=b: cases.mnist_batch(b, rs), 10,
                         '784-1000-1000-10, batch %d' % b))
    out.append(_case('masked-mlp-b32', lambda: cases.MaskedMLP(),
                     lambda rs: cases.mnist_batch(32, rs), 10,
                     'maxout and clip MLP, batch 32 (masks built in '
                     'Python in backward)'))
    out.append(_case('cnn-b32', lambda: cases.CNN(),
                     lambda rs: cases.mnist_batch(32, rs, image=True), 5,
                     'MNIST CNN, batch 32'))
    out.append(_case('resnet-small-b32-32',
                     lambda: cases.Classify(cases.small_resnet(), 32),
                     lambda rs: (rs.rand(32, 3, 32, 32).astype(numpy.float32),
                                 rs.randint(0, 10, 32).astype(numpy.int32)),
                     3, 'small ResNet (BN, 4 bottlenecks), 32x3x32x32'))
    for arch, b, size, n in (('resnet50', 8, 64, 2), ('googlenet', 8, 64, 2),
                             ('mobilenetv2', 8, 64, 2)):
        out.append(_case(
            '%s-b%d-%d' % (arch, b, size),
            lambda arch=arch, size=size: cases.Classify(
                cases.imagenet_arch(arch), size),
            lambda rs, b=b, size=size: (
                rs.rand(b, 3, size, size).astype(numpy.float32),
                rs.randint(0, 10, b).astype(numpy.int32)),
            n, '%s, %dx3x%dx%d' % (arch, b, size, size)))
    return out


class Counter(chainer.FunctionHook):
    name = 'benchmark_counter'

    def __init__(self):
        self.n = 0

    def forward_preprocess(self, function, in_data):
        self.n += 1


def build(case, seed=0, skip=()):
    """{variant: (model, optimizer)} with identical parameters."""
    numpy.random.seed(seed)
    proto = case['model']()
    rs = numpy.random.RandomState(1)
    with chainer.using_config('use_static_graph', False):
        proto(*case['batch'](rs))      # initialize lazy parameters
    built = {}
    for name in cases.VARIANTS:
        cls = cases.variants(type(proto)).get(name)
        if cls is None or name in skip:
            continue
        numpy.random.seed(seed)
        m = case['model']()
        m.__class__ = cls
        with chainer.using_config('use_static_graph', False):
            m(*case['batch'](numpy.random.RandomState(1)))
        m.copyparams(proto)
        opt = chainer.optimizers.SGD(lr=0.01)
        opt.setup(m)
        built[name] = (m, opt)
    return built


def step(model, opt, batch, variant):
    model.cleargrads()
    if variant == 'chainer':
        with cases.quiet():
            loss = model(*batch)
            loss.backward()
    else:
        loss = model(*batch)
        loss.backward()
    opt.update()
    return loss


def check_match(case, n=3):
    """Train every variant n iterations; compare to define-by-run. A
    variant that raises is reported as 'crash' (and not timed)."""
    built = build(case)
    rs = numpy.random.RandomState(2)
    batches = [case['batch'](rs) for _ in range(n)]
    losses = {v: [] for v in built}
    result = {}
    for b in batches:
        for v, (m, o) in list(built.items()):
            numpy.random.seed(3)
            try:
                losses[v].append(float(step(m, o, b, v).array))
            except Exception as e:
                result[v] = 'crash (%s)' % type(e).__name__
                del built[v]
    ref_m = built['dbr'][0]
    for v, (m, o) in built.items():
        ok = numpy.allclose(losses[v], losses['dbr'], rtol=1e-4, atol=1e-6)
        for (name, p), (_, q) in zip(sorted(m.namedparams()),
                                     sorted(ref_m.namedparams())):
            ok = ok and numpy.allclose(p.array, q.array, rtol=1e-3,
                                       atol=1e-5)
        result[v] = bool(ok)
    return result


def time_case(case, rounds, skip=()):
    built = build(case, skip=skip)
    rs = numpy.random.RandomState(4)
    batch = case['batch'](rs)
    for v, (m, o) in built.items():
        for _ in range(3):
            step(m, o, batch, v)
    times = {v: [] for v in built}
    n = case['n_iter']
    for _ in range(rounds):
        for v, (m, o) in built.items():
            t0 = time.perf_counter()
            for _ in range(n):
                step(m, o, batch, v)
            times[v].append((time.perf_counter() - t0) / n)
    stats = {}
    for v, (m, o) in built.items():
        counter = Counter()
        with counter:
            step(m, o, batch, v)
        stats[v] = dict(time=float(numpy.median(times[v])),
                        function_nodes=counter.n)
    del built
    for v, peak in memory_case(case, batch, skip=skip).items():
        stats[v]['peak_bytes'] = peak
    return stats


def memory_case(case, batch, warmup=3, skip=()):
    """Peak memory of a training iteration, per variant: tracemalloc's
    peak during one iteration after ``warmup`` iterations, above what was
    allocated before the variant's first call. So it counts activations
    and gradients, and also what a variant keeps between iterations (our
    static buffers and recorded nodes, chainer.static_graph's preallocated
    arrays), not only what one iteration allocates afresh."""
    gc.collect()
    tracemalloc.start()
    try:
        built = build(case, skip=skip)
        out = {}
        for v, (m, o) in built.items():
            gc.collect()
            base = tracemalloc.get_traced_memory()[0]
            for _ in range(warmup):
                step(m, o, batch, v)
            gc.collect()
            tracemalloc.reset_peak()
            step(m, o, batch, v)
            out[v] = int(tracemalloc.get_traced_memory()[1] - base)
        return out
    finally:
        tracemalloc.stop()


class _BuildTimer(object):
    """Time spent turning a finished recording into schedules (the
    analysis of captured arrays, build.build, Entry.verify) while active."""

    def __init__(self):
        from static_graph import analysis, build, entry
        self.targets = [(analysis, 'mark_captured'),
                        (build, 'build'), (entry.Entry, 'verify')]
        self.seconds = 0.0

    def _timed(self, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
        return timed

    def __enter__(self):
        self.saved = [(o, n, o.__dict__[n]) for o, n in self.targets]
        for o, n, fn in self.saved:
            setattr(o, n, self._timed(fn))
        return self

    def __exit__(self, *exc):
        for o, n, fn in self.saved:
            setattr(o, n, fn)


def recording_cost(case, trials=5, steady_steps=10, warm_repeats=3):
    """First iteration of a fresh static model vs define-by-run iterations
    (a steady one, and the first of a fresh model, which also pays for
    first use: gradient arrays, optimizer state, cold memory); for ours
    also the part of it spent building the schedules, and an iteration
    that records again on a warm model (its cache emptied, as a new
    argument shape would find it), which pays for recording only. A
    steady define-by-run iteration is the median of ``steady_steps``
    per trial: the denominator of every ratio, so not one sample; the
    warm recording is the median of ``warm_repeats`` per trial, each
    after two replays."""
    rs = numpy.random.RandomState(5)
    batch = case['batch'](rs)
    first = {v: [] for v in cases.VARIANTS}
    building = []
    steady = []
    warm = []
    for _ in range(trials):
        built = build(case)
        for v, (m, o) in built.items():
            t0 = time.perf_counter()
            if v == 'ours':
                with _BuildTimer() as timer:
                    step(m, o, batch, v)
                building.append(timer.seconds)
            else:
                step(m, o, batch, v)
            first[v].append(time.perf_counter() - t0)
        m, o = built['dbr']
        for _ in range(2):
            step(m, o, batch, 'dbr')
        for _ in range(steady_steps):
            t0 = time.perf_counter()
            step(m, o, batch, 'dbr')
            steady.append(time.perf_counter() - t0)
        m, o = built['ours']
        for _ in range(warm_repeats):
            for _ in range(2):     # replays: the model is warm again
                step(m, o, batch, 'ours')
            for cache in static_decorator.caches_of(m).values():
                cache.entries.clear()
            t0 = time.perf_counter()
            step(m, o, batch, 'ours')
            warm.append(time.perf_counter() - t0)
    out = {'dbr_steady': float(numpy.median(steady)),
           'ours_building': float(numpy.median(building)),
           'ours_warm_recording': float(numpy.median(warm))}
    for v, ts in first.items():
        if ts:
            out[v + '_first'] = float(numpy.median(ts))
    return out


def mlp_numpy_reference(batch_sizes, rounds):
    """Hand-written NumPy MLP step with preallocated buffers vs ours.

    Both steps are timed in two parts: forward and backward, then the SGD
    update (ours: Chainer's optimizer, which the library leaves to Chainer).
    ``floor`` is the lowest ours / numpy any replay could reach while
    Chainer's optimizer updates: NumPy's own forward and backward plus
    Chainer's update, over the NumPy step."""
    pc = time.perf_counter
    out = {}
    for b in batch_sizes:
        case = [c for c in all_cases() if c['name'] == 'mlp-b%d' % b][0]
        built = build(case)
        ref = numpy_mlp.NumpyMLP.from_chain(built['dbr'][0], b, lr=0.01)
        rs = numpy.random.RandomState(6)
        x, t = case['batch'](rs)
        # The reference must compute what Chainer computes.
        m, o = built['ours']
        ref.load(m)
        loss_ref = ref.step(x, t)
        loss = float(step(m, o, (x, t), 'ours').array)
        agree = bool(numpy.isclose(loss_ref, loss, rtol=1e-5) and all(
            numpy.allclose(a, p.array, rtol=1e-4, atol=1e-6)
            for a, p in ref.params_against(m)))
        for _ in range(3):
            ref.step(x, t)
            step(m, o, (x, t), 'ours')

        def numpy_step():
            t0 = pc()
            ref.forward_backward(x, t)
            t1 = pc()
            ref.update()
            return t1 - t0, pc() - t1

        def ours_step():
            t0 = pc()
            m.cleargrads()
            m(x, t).backward()
            t1 = pc()
            o.update()
            return t1 - t0, pc() - t1

        times = {'numpy': [], 'ours': []}
        n = case['n_iter']
        for _ in range(rounds):
            for name, fn in (('numpy', numpy_step), ('ours', ours_step)):
                parts = numpy.array([fn() for _ in range(n)]).mean(axis=0)
                times[name].append(parts)
        med = dict((k, numpy.median(v, axis=0)) for k, v in times.items())
        out['mlp-b%d' % b] = dict(
            numpy=float(med['numpy'].sum()),
            ours=float(med['ours'].sum()),
            numpy_update=float(med['numpy'][1]),
            chainer_update=float(med['ours'][1]),
            floor=float((med['numpy'][0] + med['ours'][1]) /
                        med['numpy'].sum()),
            matches=agree)
    return out


def fmt_time(s):
    return '%.2f ms' % (s * 1e3) if s >= 1e-3 else '%.0f us' % (s * 1e6)


def fmt_mb(n):
    return '%.1f MB' % (n / 2.0 ** 20)


def markdown(results):
    lines = ['| case | define-by-run | chainer.static_graph | ours | '
             'chainer speed-up | our speed-up | matches dbr (chainer / ours) '
             '| FunctionNodes/iter (dbr / ours) | peak memory (dbr / chainer '
             '/ ours) | ours/dbr memory |',
             '|---|---|---|---|---|---|---|---|---|---|']
    for name, r in results['cases'].items():
        s = r['stats']
        dbr = s['dbr']['time']
        ch = s.get('chainer')
        ours = s['ours']
        lines.append('| %s | %s | %s | %s | %s | %.2fx | %s / %s | %d / %d '
                     '| %s / %s / %s | %.2fx |' % (
                         name, fmt_time(dbr),
                         fmt_time(ch['time']) if ch else 'n/a',
                         fmt_time(ours['time']),
                         '%.2fx' % (dbr / ch['time']) if ch else 'n/a',
                         dbr / ours['time'],
                         r['matches'].get('chainer', 'n/a'),
                         r['matches']['ours'],
                         s['dbr']['function_nodes'],
                         ours['function_nodes'],
                         fmt_mb(s['dbr']['peak_bytes']),
                         fmt_mb(ch['peak_bytes']) if ch else 'n/a',
                         fmt_mb(ours['peak_bytes']),
                         ours['peak_bytes'] / max(1, s['dbr']['peak_bytes'])))
    rc = results.get('recording')
    if rc:
        lines += ['', '| case | dbr iteration | dbr first iteration | '
                  'chainer recording | our recording | of it building '
                  'schedules | ours / dbr iteration | ours / dbr first '
                  'iteration | recording again, warm model / dbr '
                  'iteration |',
                  '|---|---|---|---|---|---|---|---|---|']
        for name, r in rc.items():
            lines.append('| %s | %s | %s | %s | %s | %s | %.2fx | %.2fx | '
                         '%s (%.2fx) |' % (
                             name, fmt_time(r['dbr_steady']),
                             fmt_time(r['dbr_first']),
                             fmt_time(r['chainer_first'])
                             if 'chainer_first' in r else 'n/a',
                             fmt_time(r['ours_first']),
                             fmt_time(r['ours_building']),
                             r['ours_first'] / r['dbr_steady'],
                             r['ours_first'] / r['dbr_first'],
                             fmt_time(r['ours_warm_recording']),
                             r['ours_warm_recording'] / r['dbr_steady']))
    ref = results.get('numpy_reference')
    if ref:
        lines += ['', '| case | hand-written NumPy | ours | ours / numpy | '
                  'update: NumPy / Chainer | floor with Chainer\'s update | '
                  'reference matches Chainer |',
                  '|---|---|---|---|---|---|---|']
        for name, r in ref.items():
            lines.append('| %s | %s | %s | %.2fx | %s / %s | %.2fx | %s |' % (
                name, fmt_time(r['numpy']), fmt_time(r['ours']),
                r['ours'] / r['numpy'], fmt_time(r['numpy_update']),
                fmt_time(r['chainer_update']), r['floor'], r['matches']))
    lines += ['', 'Machine: %s, %s, %d cores, Python %s, chainer %s, '
              'numpy %s.' % (platform.platform(), platform.processor() or
                             platform.machine(), os.cpu_count(),
                             platform.python_version(), chainer.__version__,
                             numpy.__version__)]
    return '\n'.join(lines) + '\n'


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    names = [c['name'] for c in all_cases()]
    parser.add_argument('--cases', nargs='*', default=names,
                        help='cases to run (default: all): %s'
                        % ' '.join(names))
    parser.add_argument('--rounds', type=int, default=7)
    parser.add_argument('--out', default=HERE)
    parser.add_argument('--no-recording', action='store_true')
    parser.add_argument('--no-numpy', action='store_true')
    args = parser.parse_args(argv)
    unknown = set(args.cases) - set(names)
    if unknown:
        parser.error('unknown case(s): %s' % ' '.join(sorted(unknown)))
    warnings.simplefilter('ignore')
    results = {'cases': {}, 'recording': {}}
    for case in all_cases():
        if case['name'] not in args.cases:
            continue
        sys.stderr.write('%s ...\n' % case['name'])
        matches = check_match(case)
        crashed = [v for v, ok in matches.items() if ok not in (True, False)]
        results['cases'][case['name']] = dict(
            note=case['note'], matches=matches,
            stats=time_case(case, args.rounds, skip=crashed))
        if not args.no_recording and case['name'] in ('tiny', 'mlp-b1',
                                                      'mlp-b8', 'mlp-b100',
                                                      'cnn-b32'):
            results['recording'][case['name']] = recording_cost(case)
    mlp = [int(n.split('-b')[1]) for n in args.cases
           if n.startswith('mlp-b')]
    if mlp and not args.no_numpy:
        results['numpy_reference'] = mlp_numpy_reference(mlp, args.rounds)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, 'results.json'), 'w') as f:
        json.dump(results, f, indent=1)
    table = markdown(results)
    with open(os.path.join(args.out, 'results.md'), 'w') as f:
        f.write(table)
    sys.stdout.write(table)
    return results


if __name__ == '__main__':
    main()
