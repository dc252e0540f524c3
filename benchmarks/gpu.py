"""GPU benchmark: define-by-run vs ``@static_graph`` on CuPy, side by side.

    python benchmarks/gpu.py --device @cupy:0 --batches 1 100

The 784-1000-1000-10 MLP training step (cleargrads, forward, backward, SGD
update), both twins from the same parameters on the same batch, timed in
interleaved rounds with the device synchronized around each round. Also
reported: the recording iteration (the static twin's first, after
define-by-run has warmed CuPy's kernels) against a define-by-run iteration,
the first replay, and whether both twins end with the same loss after the
same number of steps. Needs a GPU (exits with a message otherwise);
``--device @numpy`` runs the same measurement on the CPU.
"""
import argparse
import os
import statistics
import sys
import time

import numpy

import chainer

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import cases  # NOQA
from static_graph import static_graph  # NOQA


def _twins(device):
    numpy.random.seed(0)
    a = cases.MLP()
    static = type('StaticMLP', (cases.MLP,),
                  {'forward': static_graph(cases.MLP.forward)})
    b = static()
    b.copyparams(a)
    out = []
    for m in (a, b):
        m.to_device(device)
        opt = chainer.optimizers.SGD(lr=0.01)
        opt.setup(m)
        out.append((m, opt))
    return out


def _step(model, opt, x, t):
    model.cleargrads()
    loss = model(x, t)
    loss.backward()
    opt.update()
    return loss


def run(device, batch, n_iter, rounds, warm=5):
    dev = chainer.get_device(device)
    sync = getattr(getattr(dev, 'device', None), 'synchronize',
                   lambda: None)   # a CuPy device; on NumPy (a dry run) none
    (a, oa), (b, ob) = _twins(dev)
    x, t = cases.mnist_batch(batch, numpy.random.RandomState(1))
    x, t = dev.send(x), dev.send(t)

    def timed(m, o, n=1):
        sync()
        t0 = time.perf_counter()
        for _ in range(n):
            loss = _step(m, o, x, t)
        sync()
        return (time.perf_counter() - t0) / n, loss

    for _ in range(warm - 1):
        _step(a, oa, x, t)
    dbr_iter, _ = timed(a, oa)
    recording, _ = timed(b, ob)
    first_replay, _ = timed(b, ob)
    for _ in range(warm - 2):
        _step(b, ob, x, t)
    times = {'dbr': [], 'static': []}
    for _ in range(rounds):
        for name, m, o in (('dbr', a, oa), ('static', b, ob)):
            times[name].append(timed(m, o, n_iter)[0])
    la, lb = (float(_step(m, o, x, t).array) for m, o in ((a, oa), (b, ob)))
    d, s = statistics.median(times['dbr']), statistics.median(times['static'])
    print('MLP batch %d: define-by-run %.3f ms, static %.3f ms, speed-up '
          '%.2fx; recording iteration %.2f ms = %.2fx a define-by-run '
          'iteration (%.2f ms); first replay %.2f ms; same loss after %d '
          'steps: %s' % (batch, d * 1e3, s * 1e3, d / s, recording * 1e3,
                         recording / dbr_iter, dbr_iter * 1e3,
                         first_replay * 1e3, warm + rounds * n_iter + 1,
                         la == lb))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--device', default='@cupy:0')
    p.add_argument('--batches', type=int, nargs='*', default=[1, 100])
    p.add_argument('--iterations', type=int, default=200,
                   help='steps per timed round (default 200)')
    p.add_argument('--rounds', type=int, default=5)
    args = p.parse_args(argv)
    try:
        chainer.get_device(args.device).use()
    except Exception as e:
        print('no GPU for %s (%s: %s)' % (args.device, type(e).__name__, e))
        return 1
    for batch in args.batches:
        run(args.device, batch, args.iterations, args.rounds)
    return 0


if __name__ == '__main__':
    sys.exit(main())
