"""A kit of real models: Chainer's examples (``examples/ptb``, ``seq2seq``,
``text_classification``, ``pos``, ``memnn``, ``word2vec``, ``vae``,
``dcgan``, ``reinforcement_learning``, ``cifar``, and ``mnist``'s custom
loop) rebuilt at CPU sizes on
synthetic data, each decorated as a user would decorate it, to be trained
next to its undecorated twin by ``benchmarks/kit_run.py``.

``CASES``: (row name, module, keyword arguments of its ``make_case``,
whether ``--quick`` runs it, steps under ``--quick``)."""
import importlib

CASES = [
    ('ptb-h64-b8', 'ptb', dict(n_units=64, batch=8, steps=24), True, 5),
    ('ptb-h200-b20', 'ptb', dict(n_units=200, batch=20, steps=14), False, 0),
    ('ptb-h650-b20', 'ptb', dict(n_units=650, batch=20, steps=7), False, 0),
    ('seq2seq-var', 'seq2seq', dict(variable=True, steps=16), True, 5),
    ('seq2seq-fixed', 'seq2seq', dict(variable=False, steps=24), True, 6),
    ('textclass-rnn-var', 'text_classification',
     dict(encoder='rnn', variable=True, steps=40), True, 8),
    ('textclass-rnn-fixed', 'text_classification',
     dict(encoder='rnn', variable=False, steps=40), True, 8),
    ('textclass-cnn-var', 'text_classification',
     dict(encoder='cnn', variable=True, steps=40), True, 8),
    ('textclass-cnn-fixed', 'text_classification',
     dict(encoder='cnn', variable=False, steps=40), True, 8),
    ('textclass-bow-var', 'text_classification',
     dict(encoder='bow', variable=True, steps=40), True, 8),
    ('pos-crf-var', 'pos', dict(bilstm=False, steps=30), True, 8),
    ('pos-bilstm-crf-var', 'pos', dict(bilstm=True, steps=20), True, 6),
    ('memnn', 'memnn', dict(steps=24), True, 6),
    ('word2vec-skipgram-hsm', 'word2vec',
     dict(model_type='skipgram', out_type='hsm', steps=40), True, 10),
    ('word2vec-cbow-ns', 'word2vec',
     dict(model_type='cbow', out_type='ns', steps=40), True, 10),
    ('vae', 'vae', dict(whole_loss=False, steps=60), True, 10),
    ('vae-loss', 'vae', dict(whole_loss=True, steps=60), True, 10),
    ('dcgan', 'dcgan', dict(steps=30), True, 5),
    ('dqn', 'dqn', dict(target_type='dqn', steps=200), True, 40),
    ('double-dqn', 'dqn', dict(target_type='double_dqn', steps=200), True,
     40),
    ('cifar-vgg', 'cifar', dict(steps=24), True, 6),
    ('mnist-custom-loop', 'mnist', dict(steps=24), True, 6),
]

NAMES = [c[0] for c in CASES]


def make(name):
    """The ``Case`` of the row ``name``."""
    for row, module, kwargs, _, _ in CASES:
        if row == name:
            mod = importlib.import_module('benchmarks.kit.' + module)
            case = mod.make_case(**kwargs)
            assert case.name == row, (case.name, row)
            return case
    raise KeyError(name)


def quick_steps(name):
    for row, _, _, quick, steps in CASES:
        if row == name:
            return steps if quick else 0
    raise KeyError(name)
