"""Dataset loading for the MNIST example, with no network access required.

Order of preference:

1. ``--data PATH``: an ``.npz`` holding ``x_train, y_train, x_test, y_test``,
   or Chainer's own cached MNIST files (``PATH`` is either the directory
   holding ``train.npz``/``test.npz`` or one of those two files).
2. Chainer's MNIST, but only if it is already in Chainer's dataset cache
   (``chainer.datasets.get_mnist`` would otherwise try to download it).
3. An embedded stand-in: scikit-learn's 8x8 ``digits`` (1797 images)
   upsampled to 28x28, split deterministically (a fixed-seed shuffle, then
   the last 297 are the test set).
"""
import os

import numpy

import chainer

N_TEST_DIGITS = 297


def _reshape(x, ndim):
    x = numpy.asarray(x)
    if x.dtype == numpy.uint8 or (x.size and x.max() > 1.0):
        x = x.astype(numpy.float32) / 255.
    x = x.astype(numpy.float32).reshape(len(x), -1)
    if x.shape[1] != 784:
        raise ValueError('expected 28x28 images, got %d values per sample'
                         % x.shape[1])
    if ndim == 1:
        return x
    if ndim == 2:
        return x.reshape(-1, 28, 28)
    if ndim == 3:
        return x.reshape(-1, 1, 28, 28)
    raise ValueError('ndim must be 1, 2 or 3')


def _tuple(x, y, ndim):
    y = numpy.asarray(y).astype(numpy.int32).reshape(-1)
    return chainer.datasets.TupleDataset(_reshape(x, ndim), y)


def _chainer_cache_dir():
    return chainer.dataset.get_dataset_directory(
        'pfnet/chainer/mnist', create_directory=False)


def mnist_is_cached():
    d = _chainer_cache_dir()
    return all(os.path.isfile(os.path.join(d, f))
               for f in ('train.npz', 'test.npz'))


def load_npz(path, ndim):
    """Load a user-given MNIST file (see module docstring)."""
    if os.path.isdir(path):
        train_path = os.path.join(path, 'train.npz')
        test_path = os.path.join(path, 'test.npz')
    else:
        with numpy.load(path) as f:
            if 'x_train' in f.files:
                return (_tuple(f['x_train'], f['y_train'], ndim),
                        _tuple(f['x_test'], f['y_test'], ndim))
        d = os.path.dirname(os.path.abspath(path))
        train_path = os.path.join(d, 'train.npz')
        test_path = os.path.join(d, 'test.npz')
    out = []
    for p in (train_path, test_path):
        with numpy.load(p) as f:
            out.append(_tuple(f['x'], f['y'], ndim))
    return tuple(out)


def load_digits(ndim):
    """scikit-learn's 8x8 digits, upsampled to MNIST's 28x28 in [0, 1]."""
    from sklearn.datasets import load_digits as _load
    digits = _load()
    x = digits.images.astype(numpy.float32) / 16.        # (N, 8, 8), [0, 1]
    x = numpy.kron(x, numpy.ones((1, 3, 3), numpy.float32))  # (N, 24, 24)
    x = numpy.pad(x, ((0, 0), (2, 2), (2, 2)))               # (N, 28, 28)
    y = digits.target
    # sklearn orders the samples by writer; a fixed-seed shuffle makes the
    # held-out set representative (and the split reproducible).
    order = numpy.random.RandomState(0).permutation(len(x))
    x, y = x[order], y[order]
    n = len(x) - N_TEST_DIGITS
    return _tuple(x[:n], y[:n], ndim), _tuple(x[n:], y[n:], ndim)


def get_dataset(ndim=1, path=None):
    """Return ``(train, test, name)``."""
    if path:
        train, test = load_npz(path, ndim)
        return train, test, 'MNIST from %s' % path
    if mnist_is_cached():
        train, test = chainer.datasets.get_mnist(ndim=ndim)
        return train, test, 'MNIST (Chainer cache)'
    print('MNIST is not available offline (no --data and nothing in %s); '
          'using the embedded default: scikit-learn digits upsampled to '
          '28x28 (1500 train / 297 test).' % _chainer_cache_dir())
    train, test = load_digits(ndim)
    return train, test, 'sklearn digits 28x28'
