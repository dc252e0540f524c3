#!/usr/bin/env python
"""Train ResNet50 / GoogLeNet / VGG16 / MobileNetV2 with ``@static_graph``.

With ``--train``/``--val`` list files (Chainer ``LabeledImageDataset``
format: one ``relative/path.jpg label`` per line, paths relative to
``--root``), real images are used; otherwise a fixed-seed synthetic data set
(``--n-class`` classes, learnable class templates plus noise) is generated on
the fly, so the script runs anywhere:

    python examples/imagenet/train_imagenet.py --arch resnet50 --insize 32 \\
        --batchsize 8 --iterations 20
"""
import argparse
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
import chainer.links as L  # NOQA
from chainer import training  # NOQA
from chainer.training import extensions  # NOQA

import _compat  # NOQA
from _timing import TimedUpdater, mean_step_time  # NOQA
import models  # NOQA

# Per-channel RGB mean of ImageNet, in 0..255.
IMAGENET_MEAN = numpy.array([123.68, 116.78, 103.94], numpy.float32)


class SyntheticImageDataset(chainer.dataset.DatasetMixin):
    """Deterministic random images: a per-class smooth template plus noise.

    Examples are generated on demand (nothing large is held in memory) and
    example ``i`` is always the same image; labels cycle through classes.
    """

    def __init__(self, n, n_class, insize, seed=0, noise=0.5):
        self.n = n
        self.n_class = n_class
        self.insize = insize
        self.seed = seed
        self.noise = noise
        rng = numpy.random.RandomState(1234)  # same templates for train/val
        coarse = rng.standard_normal((n_class, 3, 8, 8)).astype(numpy.float32)
        idx = numpy.arange(insize) * 8 // insize
        self.templates = coarse[:, :, idx][:, :, :, idx]

    def __len__(self):
        return self.n

    def get_example(self, i):
        label = i % self.n_class
        rng = numpy.random.RandomState((self.seed * 1000003 + i) % (2 ** 32))
        noise = rng.standard_normal(self.templates.shape[1:])
        image = self.templates[label] + self.noise * noise.astype(
            numpy.float32)
        return image.astype(numpy.float32), numpy.int32(label)


class PreprocessedDataset(chainer.dataset.DatasetMixin):
    """``LabeledImageDataset`` resized, cropped to ``insize``, mean-subtracted.

    The shorter side is resized to ``insize * 256 / 224``; training crops at
    random and flips horizontally at random, validation takes the centre.
    """

    def __init__(self, path, root, insize, mean, random=True):
        self.base = chainer.datasets.LabeledImageDataset(path, root)
        self.insize = insize
        self.mean = mean.reshape(3, 1, 1).astype(numpy.float32)
        self.random = random

    def __len__(self):
        return len(self.base)

    def get_example(self, i):
        from PIL import Image
        image, label = self.base[i]            # CHW float32, 0..255
        if image.shape[0] == 1:
            image = numpy.repeat(image, 3, axis=0)
        image = image[:3]
        _, h, w = image.shape
        short = int(round(self.insize * 256 / 224.))
        scale = float(short) / min(h, w)
        nh = max(self.insize, int(round(h * scale)))
        nw = max(self.insize, int(round(w * scale)))
        pil = Image.fromarray(
            image.transpose(1, 2, 0).clip(0, 255).astype(numpy.uint8))
        image = numpy.asarray(pil.resize((nw, nh), Image.BILINEAR),
                              numpy.float32).transpose(2, 0, 1)
        if self.random:
            top = numpy.random.randint(0, nh - self.insize + 1)
            left = numpy.random.randint(0, nw - self.insize + 1)
        else:
            top = (nh - self.insize) // 2
            left = (nw - self.insize) // 2
        image = image[:, top:top + self.insize, left:left + self.insize]
        if self.random and numpy.random.randint(2):
            image = image[:, :, ::-1]
        image = (image - self.mean) / 255.
        return numpy.ascontiguousarray(image, numpy.float32), label


def get_datasets(args):
    if args.train:
        if args.mean:
            mean = numpy.load(args.mean).astype(numpy.float32)
            if mean.ndim == 3:                 # a mean image: channel means
                mean = mean.mean(axis=(1, 2))
        else:
            mean = IMAGENET_MEAN
        train = PreprocessedDataset(args.train, args.root, args.insize, mean)
        val = PreprocessedDataset(args.val or args.train, args.root,
                                  args.insize, mean, random=False)
        return train, val, 'image list %s' % args.train
    train = SyntheticImageDataset(args.n_train, args.n_class, args.insize,
                                  seed=args.seed)
    val = SyntheticImageDataset(args.n_val, args.n_class, args.insize,
                                seed=args.seed + 1)
    return train, val, 'synthetic (%d classes)' % args.n_class


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--arch', '-a', choices=sorted(models.ARCHS),
                        default='resnet50',
                        help='all build on Chainer 4.5 to 7; mobilenetv2 '
                             'is about 15x slower on CPU under Chainer 4 '
                             '(its grouped convolution)')
    parser.add_argument('--train', default=None,
                        help='LabeledImageDataset list file for training '
                             '(default: synthetic data)')
    parser.add_argument('--val', default=None,
                        help='LabeledImageDataset list file for validation')
    parser.add_argument('--root', '-R', default='.',
                        help='root directory of the images in the lists')
    parser.add_argument('--mean', '-m', default=None,
                        help='mean file (.npy, 3xHxW or 3); default: the '
                             'ImageNet per-channel mean')
    parser.add_argument('--insize', type=int, default=224,
                        help='input image size (use 32 on CPU)')
    parser.add_argument('--n-class', type=int, default=None,
                        help='number of classes (default: 10 for synthetic '
                             'data, 1000 with image lists)')
    parser.add_argument('--n-train', type=int, default=320,
                        help='synthetic training set size')
    parser.add_argument('--n-val', type=int, default=64,
                        help='synthetic validation set size')
    parser.add_argument('--static', dest='static', action='store_true',
                        default=True,
                        help='use @static_graph (default; define-by-run '
                             'where this Chainer cannot record: older '
                             'than 7)')
    parser.add_argument('--no-static', dest='static', action='store_false',
                        help='plain define-by-run '
                             '(chainer.config.use_static_graph = False)')
    _compat.add_capture_update_arguments(parser)
    parser.add_argument('--device', '-d', default='@numpy',
                        help='Chainer device specifier, e.g. @numpy, '
                             '@cupy:0 (Chainer < 6: only these two forms)')
    parser.add_argument('--batchsize', '-B', type=int, default=32)
    parser.add_argument('--val-batchsize', '-b', type=int, default=None)
    parser.add_argument('--epoch', '-E', type=int, default=10)
    parser.add_argument('--iterations', type=int, default=None,
                        help='stop after this many iterations '
                             '(overrides --epoch)')
    parser.add_argument('--lr', type=float, default=0.01)
    parser.add_argument('--loaderjob', '-j', type=int, default=0,
                        help='worker processes for data loading '
                             '(0: load in the main process)')
    parser.add_argument('--out', '-o', default='result')
    parser.add_argument('--seed', type=int, default=0)
    args = parser.parse_args(argv)
    try:
        _compat.get_device(args.device)
    except (ValueError, RuntimeError) as e:   # an unknown specifier
        parser.error(str(e))
    if args.n_class is None:
        args.n_class = 1000 if args.train else 10
    return args


def main(argv=None):
    args = parse_args(argv)
    device = _compat.get_device(args.device)
    device.use()
    numpy.random.seed(args.seed)
    if device.xp is not numpy:
        device.xp.random.seed(args.seed)

    label = _compat.mode_label(args.static)
    train_data, val_data, name = get_datasets(args)
    print('arch: %s, insize: %d, data: %s (%d train / %d val), device: %s, '
          '%s' % (args.arch, args.insize, name, len(train_data),
                  len(val_data), args.device, label))

    model = L.Classifier(models.ARCHS[args.arch](args.n_class, args.insize))
    device.send_link(model)
    optimizer = chainer.optimizers.MomentumSGD(lr=args.lr, momentum=0.9)
    optimizer.setup(model)
    _compat.capture_update(optimizer, args, args.static)

    val_batchsize = args.val_batchsize or args.batchsize
    if args.loaderjob:
        train_iter = chainer.iterators.MultiprocessIterator(
            train_data, args.batchsize, n_processes=args.loaderjob)
        val_iter = chainer.iterators.MultiprocessIterator(
            val_data, val_batchsize, repeat=False, shuffle=False,
            n_processes=args.loaderjob)
    else:
        train_iter = chainer.iterators.SerialIterator(
            train_data, args.batchsize)
        val_iter = chainer.iterators.SerialIterator(
            val_data, val_batchsize, repeat=False, shuffle=False)

    updater = TimedUpdater(train_iter, optimizer, device=device)
    if args.iterations:
        stop_trigger = (args.iterations, 'iteration')
        report_trigger = stop_trigger
    else:
        stop_trigger = (args.epoch, 'epoch')
        report_trigger = (1, 'epoch')
    trainer = training.Trainer(updater, stop_trigger, out=args.out)
    evaluator = extensions.Evaluator(val_iter, model, device=device.arg)
    trainer.extend(evaluator, trigger=report_trigger)
    trainer.extend(extensions.LogReport(trigger=report_trigger))
    trainer.extend(extensions.PrintReport(
        ['epoch', 'main/loss', 'validation/main/loss',
         'main/accuracy', 'validation/main/accuracy', 'elapsed_time']))
    trainer.extend(extensions.ProgressBar(update_interval=10))

    with chainer.using_config('use_static_graph', args.static):
        trainer.run()
        log = trainer.get_extension('LogReport').log
        if log and 'validation/main/accuracy' in log[-1] \
                and log[-1]['iteration'] == updater.iteration:
            val = log[-1]
        else:
            val = evaluator.evaluate()
    if args.loaderjob:
        train_iter.finalize()
        val_iter.finalize()

    result = {
        'static': args.static,
        'label': label,
        'iterations': updater.iteration,
        'main/loss': updater.losses[-1] if updater.losses else float('nan'),
        'validation/main/loss': float(val['validation/main/loss']),
        'validation/main/accuracy': float(val['validation/main/accuracy']),
        'time_per_iteration': mean_step_time(updater.step_times),
        'first_iteration_time': (updater.step_times[0]
                                 if updater.step_times else float('nan')),
    }
    print('[%s] final validation accuracy: %.4f (loss %.4f) after %d '
          'iterations' % (label, result['validation/main/accuracy'],
                          result['validation/main/loss'],
                          result['iterations']))
    print('[%s] time per training iteration: %.2f ms (mean over iterations '
          '2..%d; iteration 1, %.2f ms, is excluded: under the static graph '
          'it is the recording run)'
          % (label, result['time_per_iteration'] * 1e3, result['iterations'],
             result['first_iteration_time'] * 1e3))
    return result


if __name__ == '__main__':
    main()
