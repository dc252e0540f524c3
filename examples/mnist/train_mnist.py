#!/usr/bin/env python
"""Train an MLP or a small CNN on MNIST with ``@static_graph``.

    python examples/mnist/train_mnist.py                 # static graph
    python examples/mnist/train_mnist.py --no-static     # define-by-run
    python examples/mnist/train_mnist.py --compare       # both, with timings
    python examples/mnist/train_mnist.py --no-capture-update  # Chainer's update
    python examples/mnist/train_mnist.py --static-loss   # loss in the graph too
    mpiexec -n 2 python examples/mnist/train_mnist.py --communicator naive

Without network access and without ``--data``/a cached MNIST, the embedded
scikit-learn digits (upsampled to 28x28) are used instead; see ``data.py``.

Runs unchanged on Chainer 4.5 to 7.  Where ``@static_graph`` cannot record
(Chainer older than 7) it is a pass-through: the run is define-by-run and the
result lines say so.
"""
import argparse
import math
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_EXAMPLES = os.path.dirname(_HERE)
_ROOT = os.path.dirname(_EXAMPLES)
for _p in (_ROOT, _EXAMPLES, _HERE):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import static_graph  # NOQA  (before chainer: Python 3.12+/NumPy 2)
import numpy  # NOQA

import chainer  # NOQA
import chainer.functions as F  # NOQA
import chainer.links as L  # NOQA
from chainer import training  # NOQA
from chainer.training import extensions  # NOQA

from static_graph import static_graph  # NOQA

import _compat  # NOQA
from _timing import TimedUpdater, mean_step_time  # NOQA
import data  # NOQA
import multinode  # NOQA  (ChainerMN, only with --communicator)


class MLP(chainer.Chain):
    """784-1000-1000-10 multi-layer perceptron."""

    ndim = 1

    def __init__(self, n_units=1000, n_out=10):
        super(MLP, self).__init__()
        with self.init_scope():
            self.l1 = L.Linear(784, n_units)
            self.l2 = L.Linear(n_units, n_units)
            self.l3 = L.Linear(n_units, n_out)

    @static_graph
    def forward(self, x):
        h = F.relu(self.l1(x))
        h = F.relu(self.l2(h))
        return self.l3(h)


class CNN(chainer.Chain):
    """Two 5x5 convolutions with max pooling, then two linear layers."""

    ndim = 3

    def __init__(self, n_out=10):
        super(CNN, self).__init__()
        with self.init_scope():
            self.conv1 = L.Convolution2D(1, 20, 5)     # 28 -> 24, pool -> 12
            self.conv2 = L.Convolution2D(20, 50, 5)    # 12 -> 8, pool -> 4
            self.fc3 = L.Linear(50 * 4 * 4, 500)
            self.fc4 = L.Linear(500, n_out)

    @static_graph
    def forward(self, x):
        h = F.max_pooling_2d(F.relu(self.conv1(x)), 2)
        h = F.max_pooling_2d(F.relu(self.conv2(h)), 2)
        h = F.relu(self.fc3(h))
        return self.fc4(h)


MODELS = {'mlp': MLP, 'cnn': CNN}


if 'forward' in L.Classifier.__dict__:      # Chainer 5 and later
    class Classifier(L.Classifier):
        """``L.Classifier`` whose forward, the loss, the accuracy and their
        reports included, is one static graph (``--static-loss``); the
        decorated predictor is recorded inside it."""

        forward = static_graph(L.Classifier.forward)
else:
    Classifier = L.Classifier


def train(args, train_data, test_data, static, out):
    """Run one training; return a dict of results."""
    device = _compat.get_device(args.device)
    device.use()
    numpy.random.seed(args.seed)
    if device.xp is not numpy:
        device.xp.random.seed(args.seed)

    classifier = Classifier if args.static_loss else L.Classifier
    model = classifier(MODELS[args.model]())
    device.send_link(model)
    optimizer = chainer.optimizers.Adam()
    optimizer.setup(model)
    _compat.capture_update(optimizer, args, static, multinode.is_root())
    optimizer = multinode.optimizer(optimizer)

    train_iter = chainer.iterators.SerialIterator(train_data, args.batchsize)
    test_iter = chainer.iterators.SerialIterator(
        test_data, args.batchsize, repeat=False, shuffle=False)

    updater = TimedUpdater(train_iter, optimizer, device=device)
    if args.iterations:
        stop_trigger = (args.iterations, 'iteration')
        report_trigger = stop_trigger
    else:
        stop_trigger = (args.epoch, 'epoch')
        report_trigger = (1, 'epoch')
    trainer = training.Trainer(updater, stop_trigger,
                               out=multinode.out_dir(out))
    evaluator = multinode.evaluator(
        extensions.Evaluator(test_iter, model, device=device.arg))
    trainer.extend(evaluator, trigger=report_trigger)
    trainer.extend(extensions.LogReport(trigger=report_trigger))
    if multinode.is_root():
        trainer.extend(extensions.PrintReport(
            ['epoch', 'main/loss', 'validation/main/loss',
             'main/accuracy', 'validation/main/accuracy', 'elapsed_time']))
        trainer.extend(extensions.ProgressBar(update_interval=10))

    with chainer.using_config('use_static_graph', static):
        trainer.run()
        log = trainer.get_extension('LogReport').log
        if log and 'validation/main/accuracy' in log[-1] \
                and log[-1]['iteration'] == updater.iteration:
            val = log[-1]
        else:
            val = evaluator.evaluate()
    return {
        'static': static,
        'label': multinode.label(_compat.mode_label(static)),
        'iterations': updater.iteration,
        'main/loss': updater.losses[-1] if updater.losses else float('nan'),
        'validation/main/loss': float(val['validation/main/loss']),
        'validation/main/accuracy': float(val['validation/main/accuracy']),
        'time_per_iteration': mean_step_time(updater.step_times),
        'first_iteration_time': (updater.step_times[0]
                                 if updater.step_times else float('nan')),
        'model': model,
    }


def warmup(args, train_data, n_iter=10):
    """A few untimed define-by-run updates of a throwaway model."""
    device = _compat.get_device(args.device)
    device.use()
    model = L.Classifier(MODELS[args.model]())
    device.send_link(model)
    optimizer = chainer.optimizers.Adam()
    optimizer.setup(model)
    batch = train_data[:args.batchsize]
    x, t = chainer.dataset.concat_examples(batch, device.arg)
    with chainer.using_config('use_static_graph', False):
        for _ in range(n_iter):
            optimizer.update(model, x, t)
    device.synchronize()


def _print_result(result):
    label = result['label']
    print('[%s] final validation accuracy: %.4f (loss %.4f) after %d '
          'iterations' % (label, result['validation/main/accuracy'],
                          result['validation/main/loss'],
                          result['iterations']))
    print('[%s] time per training iteration: %.2f ms (mean over iterations '
          '2..%d; iteration 1, %.2f ms, is excluded: under the static graph '
          'it is the recording run)'
          % (label, result['time_per_iteration'] * 1e3,
             result['iterations'], result['first_iteration_time'] * 1e3))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--model', choices=sorted(MODELS), default='mlp')
    parser.add_argument('--static', dest='static', action='store_true',
                        default=True,
                        help='use @static_graph (default; define-by-run '
                             'where this Chainer cannot record: older '
                             'than 7)')
    parser.add_argument('--no-static', dest='static', action='store_false',
                        help='plain define-by-run '
                             '(chainer.config.use_static_graph = False)')
    _compat.add_capture_update_arguments(parser)
    parser.add_argument('--static-loss', action='store_true',
                        help='with the static graph, also record '
                             'L.Classifier\'s loss and accuracy (and their '
                             'reports): its forward is decorated too')
    parser.add_argument('--compare', action='store_true',
                        help='train twice, with and without the static '
                             'graph, and compare time per iteration')
    parser.add_argument('--device', '-d', default='@numpy',
                        help='Chainer device specifier, e.g. @numpy, '
                             '@cupy:0 (Chainer < 6: only these two forms)')
    parser.add_argument('--epoch', '-e', type=int, default=5)
    parser.add_argument('--batchsize', '-b', type=int, default=100)
    parser.add_argument('--iterations', type=int, default=None,
                        help='stop after this many iterations '
                             '(overrides --epoch)')
    parser.add_argument('--data', default=None,
                        help='MNIST .npz (x_train, y_train, x_test, y_test) '
                             'or Chainer\'s cached train.npz/test.npz')
    parser.add_argument('--out', '-o', default='result')
    parser.add_argument('--seed', type=int, default=0)
    multinode.add_argument(parser)
    args = parser.parse_args(argv)
    try:
        _compat.get_device(args.device)
    except (ValueError, RuntimeError) as e:   # an unknown specifier
        parser.error(str(e))
    return args


def main(argv=None):
    args = parse_args(argv)
    ndim = MODELS[args.model].ndim
    train_data, test_data, name = data.get_dataset(ndim, args.data)
    if multinode.setup(args) is not None:
        train_data, test_data = multinode.scatter(train_data, test_data,
                                                  args.seed)
    if multinode.is_root():
        print('model: %s, data: %s (%d train / %d test), device: %s'
              % (args.model, name, len(train_data), len(test_data),
                 args.device))

    if not args.compare:
        result = train(args, train_data, test_data, args.static, args.out)
        _print_result(result)
        return result

    # The first training in a process is slower throughout (the allocator
    # and BLAS warm up), which would favour whichever mode runs second; a
    # short untimed warm-up run removes that bias.
    warmup(args, train_data)
    results = {}
    for static, sub in ((True, 'static'), (False, 'define_by_run')):
        print('--- %s ---' % _compat.mode_label(static))
        results[sub] = train(args, train_data, test_data, static,
                             os.path.join(args.out, sub))
    for sub in ('static', 'define_by_run'):
        _print_result(results[sub])
    t_static = results['static']['time_per_iteration']
    t_dbr = results['define_by_run']['time_per_iteration']
    ratio = t_dbr / t_static if t_static > 0 else float('nan')
    if not math.isfinite(ratio):
        ratio = float('nan')
    print('time per iteration: static %.2f ms, define-by-run %.2f ms, '
          'ratio define-by-run / static = %.2fx (>1 means static is faster)%s'
          % (t_static * 1e3, t_dbr * 1e3, ratio,
             '' if _compat.static_active() else
             ' [both define-by-run: static_graph unavailable on chainer %s]'
             % chainer.__version__))
    results['ratio'] = ratio
    return results


if __name__ == '__main__':
    main()
