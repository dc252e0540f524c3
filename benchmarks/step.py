"""The whole training step, side by side: define-by-run, the replayed
step with Chainer's optimizer update, and with the captured update
(``static_graph.capture_update``, default threads and ``threads=1``);
for the MLP also a hand-written in-place NumPy step with the same
optimizer.

    .venv/bin/python benchmarks/step.py
    .venv/bin/python benchmarks/step.py --cases mlp-adam-b1 --rounds 30

Every variant trains a model with the same initial parameters on the same
batch, one step of each variant per round, rounds interleaved (these
machines are noisy); the median step time is reported with the ratio
define-by-run / variant. After the rounds, the parameters of every Chainer
variant are compared with define-by-run's: they must be equal bit for bit
(column "equal").

Targets (issue 32, 2-core CPU, default threads): MLP 784-1000-1000-10
with Adam at batch 1 >= 1.8x, at batch 100 >= 1.3x; with SGD at batch 1
>= 1.5x; ResNet50 8x3x64x64 with MomentumSGD + WeightDecay >= 1.3x; with
threads=1 within 1.15x (batch 1) and 1.03x (batch 100) of the hand-written
NumPy step.
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

import chainer  # NOQA

import cases  # NOQA
import numpy_mlp  # NOQA
import update as update_bench  # NOQA

VARIANTS = ('dbr', 'static', 'captured', 'captured-1t', 'numpy')


def _optimizer(name):
    if name == 'adam':
        return chainer.optimizers.Adam()
    if name == 'sgd':
        return chainer.optimizers.SGD(lr=0.01)
    if name == 'msgd-wd':
        opt = chainer.optimizers.MomentumSGD(lr=0.01)
        return opt
    raise ValueError(name)


def _case(name, model, batch, opt, rounds):
    return dict(name=name, model=model, batch=batch, opt=opt, rounds=rounds)


CASES = dict((c['name'], c) for c in (
    _case('mlp-adam-b1', cases.MLP, lambda rs: cases.mnist_batch(1, rs),
          'adam', 40),
    _case('mlp-adam-b100', cases.MLP, lambda rs: cases.mnist_batch(100, rs),
          'adam', 25),
    _case('mlp-sgd-b1', cases.MLP, lambda rs: cases.mnist_batch(1, rs),
          'sgd', 40),
    _case('resnet50-msgd-wd-b8', lambda: cases.Classify(
        cases.imagenet_arch('resnet50'), 64),
        lambda rs: (rs.rand(8, 3, 64, 64).astype(numpy.float32),
                    rs.randint(0, 10, 8).astype(numpy.int32)),
        'msgd-wd', 9),
))


class _NumpyParam(object):
    """What update.py's NumPy optimizers read: ``array`` and ``grad``."""

    def __init__(self, array, grad):
        self.array, self.grad = array, grad
        self.size = array.size


class NumpyStep(object):
    """numpy_mlp's hand-written forward and backward, then the same
    optimizer written in place (update.py's), on one thread."""

    def __init__(self, chain, batch, opt):
        self.net = numpy_mlp.NumpyMLP.from_chain(chain, batch, 0.01)
        n = self.net
        params = [_NumpyParam(p, g) for p, g in zip(
            n._params(), (n.gW[0], n.gb[0], n.gW[1], n.gb[1], n.gW[2],
                          n.gb[2]))]
        self.opt = update_bench.NumpyAdam(params) if opt == 'adam' else \
            update_bench.NumpySGD(params, lr=0.01)

    def step(self, x, t):
        self.net.forward_backward(x, t)
        self.opt.update()


def build(case):
    """{variant: step function}, every model from the same parameters."""
    rs = numpy.random.RandomState(1)
    batch = case['batch'](rs)
    numpy.random.seed(0)
    proto = case['model']()
    with chainer.using_config('use_static_graph', False):
        proto(*batch)           # lazy parameters
    classes = cases.variants(type(proto))
    steps, models = {}, {}
    for v in VARIANTS:
        if v == 'numpy':
            if case['name'].startswith('mlp'):
                ns = NumpyStep(proto, batch[0].shape[0], case['opt'])
                steps[v] = lambda ns=ns: ns.step(*batch)
            continue
        numpy.random.seed(0)
        m = case['model']()
        m.__class__ = classes['dbr' if v == 'dbr' else 'ours']
        with chainer.using_config('use_static_graph', False):
            m(*batch)
        m.copyparams(proto)
        opt = _optimizer(case['opt'])
        opt.setup(m)
        if case['opt'] == 'msgd-wd':
            opt.add_hook(chainer.optimizer_hooks.WeightDecay(1e-4))
        if v == 'captured':
            static_graph.capture_update(opt)
        elif v == 'captured-1t':
            static_graph.capture_update(opt, threads=1)

        def step(m=m, opt=opt):
            m.cleargrads()
            loss = m(*batch)
            loss.backward()
            opt.update()
        steps[v], models[v] = step, m
    return steps, models


def measure(case, rounds=None):
    steps, models = build(case)
    rounds = rounds or case['rounds']
    times = dict((v, []) for v in steps)
    for r in range(rounds + 3):
        for v, step in steps.items():
            t0 = time.perf_counter()
            step()
            if r >= 3:          # the first steps record and warm up
                times[v].append(time.perf_counter() - t0)
    ref = dict(models['dbr'].namedparams())
    equal = {}
    for v, m in models.items():
        equal[v] = all(numpy.array_equal(p.array, ref[k].array)
                       for k, p in m.namedparams())
    med = dict((v, float(numpy.median(ts))) for v, ts in times.items())
    return med, equal


def fmt(s):
    return '%.2f ms' % (s * 1e3) if s >= 1e-3 else '%.0f us' % (s * 1e6)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--cases', nargs='*', default=list(CASES))
    parser.add_argument('--rounds', type=int, default=None)
    args = parser.parse_args()
    print('| case | define-by-run | static, Chainer update | captured '
          '(default threads) | captured, threads=1 | hand-written NumPy | '
          'dbr / captured | dbr / captured 1t | captured 1t / numpy | '
          'equal |')
    print('|---|---|---|---|---|---|---|---|---|---|')
    for name in args.cases:
        med, equal = measure(CASES[name], args.rounds)
        d = med['dbr']
        num = med.get('numpy')
        print('| %s | %s | %s (%.2fx) | %s | %s | %s | %.2fx | %.2fx | %s | '
              '%s |' % (
                  name, fmt(d), fmt(med['static']), d / med['static'],
                  fmt(med['captured']), fmt(med['captured-1t']),
                  fmt(num) if num else 'n/a', d / med['captured'],
                  d / med['captured-1t'],
                  '%.2fx' % (med['captured-1t'] / num) if num else 'n/a',
                  'yes' if all(equal.values()) else
                  'NO: ' + ', '.join(v for v, e in equal.items() if not e)))
        sys.stdout.flush()
    import platform
    print('\nMachine: %s, %d cores, Python %s, chainer %s, numpy %s.' % (
        platform.platform(), len(os.sched_getaffinity(0)),
        platform.python_version(), chainer.__version__, numpy.__version__))


if __name__ == '__main__':
    main()
