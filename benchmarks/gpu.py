"""GPU benchmark: define-by-run, stream replay and CUDA-graph replay on CuPy.

    python benchmarks/gpu.py --device @cupy:0                # every case
    python benchmarks/gpu.py --cases mlp-b8-adam tiny --json out.json

Per case, three twins from the same parameters train on the same batch:
define-by-run (``dbr``), ``@static_graph(cuda_graph=False)`` (``stream``:
the schedules launched op by op from Python) and ``@static_graph``
(``graph``: each schedule one CUDA graph launch once captured). A training
step is cleargrads, forward, backward, optimizer update. Reported, side by
side in one process with the device synchronized around each timed round
and the variants interleaved:

* the median step time of each variant and the speed-ups over dbr;
* the first iterations of fresh twins (recording, the interpreted and
  compiled runs, the capture), each synchronized;
* the device time of the step's graph launches alone (CUDA events around
  launches of the captured forward and backward graphs, back to back), and
  the step's time over it plus the optimizer update's;
* whether the graph twin's loss and parameters equal define-by-run's bit
  for bit after all steps, and what ``explain`` says of its graphs.

A case named ``...-capture`` runs the stream and graph twins' optimizer
update captured (``static_graph.capture_update``: Chainer's GPU kernels
with their scalars in a device array, one copy a step) and define-by-run's
as Chainer's own, so "bit for bit" there also compares the two updates;
``update_ms`` is then the captured update's time.

Needs a GPU (exits with a message otherwise); ``--device @numpy`` runs the
timing loop on the CPU (no graphs there).
"""
import argparse
import copy
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import static_graph  # NOQA  (first: Chainer on Python 3.12/NumPy 2)
import numpy  # NOQA
import chainer  # NOQA

import cases  # NOQA
from static_graph import graphs  # NOQA
from static_graph.decorator import caches_of  # NOQA


def _resnet50():
    return cases.Classify(cases.imagenet_arch('resnet50'), 224)


CASES = {
    # name: (model factory, batch maker(rs), optimizer factory, rounds, n)
    'mlp-b1-sgd': (cases.MLP, lambda rs: cases.mnist_batch(1, rs),
                   lambda: chainer.optimizers.SGD(lr=0.01), 5, 200),
    'mlp-b8-adam': (cases.MLP, lambda rs: cases.mnist_batch(8, rs),
                    chainer.optimizers.Adam, 5, 200),
    'mlp-b8-adam-capture': (cases.MLP, lambda rs: cases.mnist_batch(8, rs),
                            chainer.optimizers.Adam, 5, 200),
    'mlp-b100-sgd': (cases.MLP, lambda rs: cases.mnist_batch(100, rs),
                     lambda: chainer.optimizers.SGD(lr=0.01), 5, 200),
    'tiny': (cases.Tiny,
             lambda rs: (rs.rand(2, 3).astype(numpy.float32),),
             lambda: chainer.optimizers.SGD(lr=1e-4), 5, 50),
    'resnet50-b32-224': (
        _resnet50,
        lambda rs: (rs.rand(32, 3, 224, 224).astype(numpy.float32),
                    rs.randint(0, 1000, 32).astype(numpy.int32)),
        lambda: chainer.optimizers.MomentumSGD(lr=0.01), 3, 5),
}
VARIANTS = ('dbr', 'stream', 'graph')


def _classes(base):
    fwd = base.forward
    return {
        'dbr': base,
        'stream': type(base.__name__, (base,), {
            'forward': static_graph.static_graph(cuda_graph=False)(fwd)}),
        'graph': type(base.__name__, (base,), {
            'forward': static_graph.static_graph(fwd)}),
    }


def _twins(make, dev, opt, capture=False):
    """{variant: (model, optimizer)}: copies of one model, on ``dev``;
    ``capture``: the stream and graph twins' updates captured."""
    numpy.random.seed(0)
    base = make()
    classes = _classes(type(base))
    out = {}
    for name in VARIANTS:
        m = copy.deepcopy(base)
        m.__class__ = classes[name]   # the same chain, its forward decorated
        m.to_device(dev)
        o = opt()
        o.setup(m)
        if capture and name != 'dbr':
            static_graph.capture_update(o)
        out[name] = (m, o)
    return out


def _step(model, opt, batch):
    model.cleargrads()
    loss = model(*batch)
    loss.backward()
    opt.update()
    return loss


def _tiers(model):
    out = {}
    for cache in caches_of(model).values():
        for e in cache.entries.values():
            out.update(graphs.tiers(e))
    return out


def _graph_device_time(model, sync, n=20):
    """Milliseconds of device time per step of the captured forward and
    backward graphs, launched back to back (no Python between them)."""
    import cupy
    t = _tiers(model)
    gs = [t[k].graph for k in ('forward', 'backward')
          if k in t and t[k].graph is not None]
    if len(gs) != 2:
        return None
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    sync()
    start.record()
    for _ in range(n):
        for g in gs:
            g.backend.launch(g.graph)
    stop.record()
    stop.synchronize()
    return cupy.cuda.get_elapsed_time(start, stop) / n


def case_parser(doc, device, case):
    """An argument parser with ``--device`` and ``--case`` (one of CASES)
    for a script that looks into one case."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument('--device', default=device)
    p.add_argument('--case', default=case, choices=sorted(CASES))
    return p


def on_device(name, device):
    """The device (Chainer's), a function that waits for it and case
    ``name``'s batch sent there."""
    dev = chainer.get_device(device)
    sync = getattr(getattr(dev, 'device', None), 'synchronize',
                   lambda: None)
    make_batch = CASES[name][1]
    return dev, sync, tuple(
        dev.send(a) for a in make_batch(numpy.random.RandomState(1)))


def run(name, device, rounds=None, n_iter=None, first=6):
    make, _, opt, r0, n0 = CASES[name]
    rounds = rounds or r0
    n_iter = n_iter or n0
    dev, sync, batch = on_device(name, device)
    capture = name.endswith('-capture')
    twins = _twins(make, dev, opt, capture)

    def timed(v, n=1):
        m, o = twins[v]
        sync()
        t0 = time.perf_counter()
        for _ in range(n):
            loss = _step(m, o, batch)
        sync()
        return (time.perf_counter() - t0) / n, loss

    firsts = dict((v, [timed(v)[0] for _ in range(first)]) for v in VARIANTS)
    times = dict((v, []) for v in VARIANTS)
    for _ in range(rounds):
        for v in VARIANTS:
            times[v].append(timed(v, n_iter)[0])
    med = dict((v, statistics.median(ts)) for v, ts in times.items())
    losses = dict((v, _step(twins[v][0], twins[v][1], batch))
                  for v in VARIANTS)
    steps = first + rounds * n_iter + 1
    to_cpu = chainer.backend.CpuDevice().send
    same = bool(numpy.array_equal(to_cpu(losses['dbr'].array),
                                  to_cpu(losses['graph'].array)))
    for (k, p), (_, q) in zip(sorted(twins['dbr'][0].namedparams()),
                              sorted(twins['graph'][0].namedparams())):
        same = same and bool(numpy.array_equal(to_cpu(p.array),
                                                to_cpu(q.array)))
    # The update's own time, and the graphs' device time.
    # (After the comparison: the updates below change the graph twin.)
    m, o = twins['graph']
    sync()
    t0 = time.perf_counter()
    for _ in range(n_iter):
        o.update()
    sync()
    update = (time.perf_counter() - t0) / n_iter
    device_ms = _graph_device_time(m, sync) if dev.xp is not numpy else None
    explain = static_graph.explain(twins['graph'][0])
    res = {
        'case': name, 'device': device, 'steps': steps,
        'ms': dict((v, med[v] * 1e3) for v in VARIANTS),
        'speedup_stream': med['dbr'] / med['stream'],
        'speedup_graph': med['dbr'] / med['graph'],
        'first_ms': dict((v, [x * 1e3 for x in firsts[v]])
                         for v in VARIANTS),
        'update_ms': update * 1e3,
        'graph_device_ms': device_ms,
        'step_over_graph_and_update': (
            med['graph'] * 1e3 / (device_ms + update * 1e3)
            if device_ms else None),
        'bit_for_bit': same,
        'graphs': [ln.strip() for ln in explain.splitlines()
                   if 'CUDA graph' in ln],
    }
    if capture:
        res['captured_update'] = static_graph.explain_update(
            twins['graph'][1]).splitlines()
    return res


def report(res):
    ms = res['ms']
    lines = ['%s: dbr %.3f ms, stream %.3f ms (%.2fx), graph %.3f ms (%.2fx)'
             % (res['case'], ms['dbr'], ms['stream'], res['speedup_stream'],
                ms['graph'], res['speedup_graph'])]
    for v in VARIANTS:
        lines.append('  first iterations %-6s %s ms' % (v, ' '.join(
            '%.2f' % x for x in res['first_ms'][v])))
    if res['graph_device_ms'] is not None:
        lines.append('  graphs\' device time %.3f ms + update %.3f ms; '
                     'step / (graphs + update) %.2fx' % (
                         res['graph_device_ms'], res['update_ms'],
                         res['step_over_graph_and_update']))
    lines.append('  graph twin equals define-by-run bit for bit after %d '
                 'steps: %s' % (res['steps'], res['bit_for_bit']))
    for g in res['graphs']:
        lines.append('  ' + g)
    for ln in res.get('captured_update', ())[:4]:
        lines.append('  ' + ln.strip())
    return '\n'.join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--device', default='@cupy:0')
    p.add_argument('--cases', nargs='*', default=list(CASES),
                   choices=list(CASES))
    p.add_argument('--rounds', type=int, default=None)
    p.add_argument('--iterations', type=int, default=None,
                   help='steps per timed round (default: per case)')
    p.add_argument('--json', help='also write the results here')
    args = p.parse_args(argv)
    try:
        chainer.get_device(args.device).use()
    except Exception as e:
        print('no GPU for %s (%s: %s)' % (args.device, type(e).__name__, e))
        return 1
    out = []
    for name in args.cases:
        res = run(name, args.device, args.rounds, args.iterations)
        print(report(res), flush=True)
        out.append(res)
        if args.json:
            with open(args.json, 'w') as f:
                json.dump(out, f, indent=1)
    return 0


if __name__ == '__main__':
    sys.exit(main())
