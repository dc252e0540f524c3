"""Smoke tests for the examples, and static-graph vs define-by-run equality.

The example scripts are not a package; they are loaded from their files and
their ``main(argv)`` is called in-process with a few iterations.
"""
import importlib.util
import math
import os
import re
import sys

import numpy
import pytest

import chainer
import chainer.links as L

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, 'examples')


def _load(name, relpath):
    if name in sys.modules:
        return sys.modules[name]
    path = os.path.join(EXAMPLES, relpath)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope='module')
def train_mnist():
    return _load('example_train_mnist',
                 os.path.join('mnist', 'train_mnist.py'))


@pytest.fixture(scope='module')
def train_imagenet():
    return _load('example_train_imagenet',
                 os.path.join('imagenet', 'train_imagenet.py'))


@pytest.fixture(scope='module')
def imagenet_models():
    return _load('example_imagenet_models',
                 os.path.join('imagenet', 'models.py'))


IMAGENET_ARCHS = ['resnet50', 'googlenet', 'vgg16', 'mobilenetv2']
MNIST_MODELS = ['mlp', 'cnn']
STATIC_FLAGS = [pytest.param('--static', id='static'),
                pytest.param('--no-static', id='define_by_run')]


def _check_result(result, static_flag, iterations):
    assert result['static'] == (static_flag == '--static')
    assert result['label'] == ('static graph' if static_flag == '--static'
                               else 'define-by-run')
    assert result['iterations'] == iterations
    assert math.isfinite(result['main/loss'])
    assert math.isfinite(result['validation/main/loss'])
    assert 0.0 <= result['validation/main/accuracy'] <= 1.0
    assert math.isfinite(result['time_per_iteration'])


# --------------------------------------------------------------------------
# Smoke tests: the scripts' main() runs a few iterations end to end.
# --------------------------------------------------------------------------

@pytest.mark.parametrize('static_flag', STATIC_FLAGS)
@pytest.mark.parametrize('model', MNIST_MODELS)
def test_train_mnist_smoke(train_mnist, tmp_path, model, static_flag):
    result = train_mnist.main([
        '--model', model, static_flag, '--iterations', '3',
        '--batchsize', '8', '--out', str(tmp_path)])
    _check_result(result, static_flag, 3)
    assert os.path.isfile(os.path.join(str(tmp_path), 'log'))


def test_train_mnist_compare(train_mnist, tmp_path):
    results = train_mnist.main([
        '--model', 'mlp', '--compare', '--iterations', '3',
        '--batchsize', '8', '--out', str(tmp_path)])
    _check_result(results['static'], '--static', 3)
    _check_result(results['define_by_run'], '--no-static', 3)
    assert results['ratio'] > 0


def test_train_mnist_capture_update(train_mnist, tmp_path):
    """--capture-update: the static run's Adam update is captured, and
    trains bit for bit like define-by-run with Chainer's update."""
    results = train_mnist.main([
        '--model', 'mlp', '--compare', '--capture-update', '--iterations',
        '4', '--batchsize', '8', '--out', str(tmp_path)])
    for key in ('main/loss', 'validation/main/loss',
                'validation/main/accuracy'):
        assert results['static'][key] == results['define_by_run'][key]


def test_train_mnist_static_loss(train_mnist, tmp_path):
    """--static-loss: L.Classifier's forward (loss, accuracy, reports) is
    recorded and replayed with the predictor inside it, and trains bit for
    bit like define-by-run; without the flag the classifier is Chainer's."""
    from static_graph.cache import caches_of
    results = train_mnist.main([
        '--model', 'mlp', '--compare', '--static-loss', '--iterations', '6',
        '--batchsize', '8', '--out', str(tmp_path)])
    for key in ('main/loss', 'validation/main/loss',
                'validation/main/accuracy'):
        assert results['static'][key] == results['define_by_run'][key]
    for a, b in zip(results['static']['model'].params(),
                    results['define_by_run']['model'].params()):
        assert numpy.array_equal(a.array, b.array)
    static = results['static']['model']
    assert isinstance(static, train_mnist.Classifier)
    assert caches_of(static)['forward'].replays >= 3
    plain = train_mnist.main([
        '--model', 'mlp', '--iterations', '2', '--batchsize', '8',
        '--out', str(tmp_path)])
    assert type(plain['model']) is L.Classifier


@pytest.mark.parametrize('static_flag, label', [
    ('--static', 'static graph'), ('--no-static', 'define-by-run')])
def test_train_mnist_label_is_truthful(train_mnist, tmp_path, capsys,
                                       static_flag, label):
    result = train_mnist.main([
        '--model', 'mlp', static_flag, '--iterations', '2',
        '--batchsize', '8', '--out', str(tmp_path)])
    out = capsys.readouterr().out
    assert result['label'] == label
    out = re.sub(r'\x1b\[[0-9;]*[A-Za-z]', '', out)  # progress bar codes
    finals = [line for line in out.splitlines() if 'final validation' in line]
    assert len(finals) == 1 and finals[0].startswith('[%s] ' % label), out
    other = 'define-by-run' if label == 'static graph' else 'static graph'
    assert '[%s]' % other not in out


def test_mode_label_without_static_graph_support(train_mnist, monkeypatch):
    """Where the library is a pass-through, --static says define-by-run."""
    import _compat    # on sys.path once an example script is loaded
    assert _compat.mode_label(True) == 'static graph'
    monkeypatch.setattr(_compat.compat, 'UNSUPPORTED', 'too old')
    assert _compat.mode_label(False) == 'define-by-run'
    assert _compat.mode_label(True) == (
        'define-by-run: static_graph unavailable on chainer %s'
        % chainer.__version__)


@pytest.mark.parametrize('static_flag', STATIC_FLAGS)
@pytest.mark.parametrize('arch', IMAGENET_ARCHS)
def test_train_imagenet_smoke(train_imagenet, tmp_path, arch, static_flag):
    result = train_imagenet.main([
        '--arch', arch, static_flag, '--insize', '32', '--batchsize', '4',
        '--iterations', '3', '--n-train', '12', '--n-val', '4',
        '--out', str(tmp_path)])
    _check_result(result, static_flag, 3)
    assert os.path.isfile(os.path.join(str(tmp_path), 'log'))


def test_train_imagenet_list_file(train_imagenet, tmp_path):
    """The LabeledImageDataset path: odd-sized RGB and grayscale images.
    (At the default learning rate MobileNetV2 on batches of 2 diverges to a
    NaN validation loss with one OpenBLAS thread, define-by-run too.)"""
    from PIL import Image
    rng = numpy.random.RandomState(0)
    lines = []
    for i, (size, mode) in enumerate([((40, 50), 'RGB'), ((37, 33), 'L'),
                                      ((64, 48), 'RGB'), ((32, 32), 'RGB')]):
        shape = size[::-1] + ((3,) if mode == 'RGB' else ())
        img = Image.fromarray(rng.randint(0, 256, shape).astype(numpy.uint8),
                              mode)
        img.save(str(tmp_path / ('img%d.png' % i)))
        lines.append('img%d.png %d' % (i, i % 2))
    (tmp_path / 'list.txt').write_text('\n'.join(lines) + '\n')
    result = train_imagenet.main([
        '--arch', 'mobilenetv2', '--train', str(tmp_path / 'list.txt'),
        '--val', str(tmp_path / 'list.txt'), '--root', str(tmp_path),
        '--n-class', '2', '--insize', '32', '--batchsize', '2',
        '--iterations', '3', '--lr', '0.001', '--out', str(tmp_path / 'out')])
    _check_result(result, '--static', 3)


# --------------------------------------------------------------------------
# The static graph must give the same numbers as define-by-run.
# --------------------------------------------------------------------------

def _persistents(link):
    out = {}
    for path, sub in link.namedlinks():
        for name in sorted(sub._persistent):
            value = sub.__dict__[name]
            out[path + '/' + name] = numpy.asarray(chainer.backend.CpuDevice()
                                                   .send(value))
    return out


def _params(link):
    return {name: numpy.asarray(chainer.backend.CpuDevice().send(p.array))
            for name, p in link.namedparams()}


def _assert_same_state(a, b, step):
    pa, pb = _params(a), _params(b)
    assert sorted(pa) == sorted(pb)
    for name in sorted(pa):
        numpy.testing.assert_allclose(
            pa[name], pb[name], rtol=1e-4, atol=1e-5,
            err_msg='parameter %s differs after step %d' % (name, step))
    sa, sb = _persistents(a), _persistents(b)
    assert sorted(sa) == sorted(sb)
    for name in sorted(sa):
        numpy.testing.assert_allclose(
            sa[name], sb[name], rtol=1e-4, atol=1e-5,
            err_msg='persistent %s differs after step %d' % (name, step))


def _build(arch, train_mnist, imagenet_models, seed):
    numpy.random.seed(seed)
    if arch in train_mnist.MODELS:
        cls = train_mnist.MODELS[arch]
        model = cls()
        shape = (4, 784) if cls.ndim == 1 else (4, 1, 28, 28)
    else:
        kwargs = {}
        if arch == 'resnet50':
            # With gamma = 0 the residual branches get no gradient in step 1.
            kwargs['zero_init_residual'] = False
        model = imagenet_models.ARCHS[arch](10, 32, **kwargs)
        shape = (4, 3, 32, 32)   # batch 2 makes BatchNorm at 1x1 unstable
    return model, shape


@pytest.mark.parametrize('arch', MNIST_MODELS + IMAGENET_ARCHS)
def test_static_matches_define_by_run(arch, train_mnist, imagenet_models):
    model_s, shape = _build(arch, train_mnist, imagenet_models, seed=0)
    model_d, _ = _build(arch, train_mnist, imagenet_models, seed=0)
    model_d.copyparams(model_s)
    clf_s, clf_d = L.Classifier(model_s), L.Classifier(model_d)
    opt_s = chainer.optimizers.MomentumSGD(lr=0.01, momentum=0.9)
    opt_s.setup(clf_s)
    opt_d = chainer.optimizers.MomentumSGD(lr=0.01, momentum=0.9)
    opt_d.setup(clf_d)
    _assert_same_state(model_s, model_d, 0)

    rng = numpy.random.RandomState(1)
    x = rng.uniform(-1, 1, shape).astype(numpy.float32)
    t = rng.randint(0, 10, shape[0]).astype(numpy.int32)

    for step in range(1, 4):
        losses = []
        for clf, opt, static in ((clf_s, opt_s, True),
                                 (clf_d, opt_d, False)):
            # Same global RNG state for both, so dropout masks agree.
            numpy.random.seed(100 + step)
            with chainer.using_config('use_static_graph', static), \
                    chainer.using_config('train', True):
                opt.update(clf, x, t)
            losses.append(float(clf.loss.array))
        assert math.isfinite(losses[0])
        numpy.testing.assert_allclose(
            losses[0], losses[1], rtol=1e-4, atol=1e-5,
            err_msg='loss differs at step %d' % step)
        _assert_same_state(model_s, model_d, step)
    # ... and the static model really replayed, not fell back.
    from static_graph.decorator import caches_of
    (cache,) = caches_of(model_s).values()
    assert [e.state for e in cache.entries.values()] == ['complete']
    assert cache.replays == 2 and cache.fallback_calls == 0
