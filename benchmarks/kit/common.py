"""What every case of the kit shares: the twins (a chain and the same chain
with a method decorated, as a user would decorate it) and the record of one
case: how to build a model, its optimizers, its data and one training step
the way the Chainer example does it."""
import numpy

import chainer

from static_graph import static_graph


def decorated(cls, method='forward', **options):
    """``cls`` with ``method`` wrapped by ``static_graph`` (what a user gets
    by writing ``@static_graph`` over it), as ``tests/twins.py`` does."""
    deco = static_graph(**options) if options else static_graph
    return type('Static' + cls.__name__, (cls,),
                {method: deco(getattr(cls, method))})


def pick(cls, static, method='forward'):
    """``cls`` itself for the define-by-run twin, decorated for the other."""
    return decorated(cls, method) if static else cls


def optimizer_with(opt, model, *hooks):
    opt.setup(model)
    for h in hooks:
        opt.add_hook(h)
    return opt


class Case(object):
    """One row of the kit.

    model(static): builds the root chain (everything whose parameters are
        compared); with ``static`` its decorated twin. Called under the same
        NumPy seed for both twins.
    optimizers(root): a list of optimizers, set up on root or its children.
    batches(rs, n): ``n`` batches drawn from ``rs`` (a RandomState), the
        same objects handed (copied) to both twins.
    step(root, optimizers, batch): one training iteration as the example
        does it; returns the loss (an array or a number).
    extra_links(root): decorated chains outside ``root.links()`` whose
        counters count too (the DQN's target networks).
    """

    def __init__(self, name, example, decorated, note, model, optimizers,
                 batches, step, steps=12, warmup=3, targets=(),
                 extra_links=None, shapes='fixed'):
        self.name = name
        self.example = example
        self.decorated = decorated
        self.note = note
        self.model = model
        self.optimizers = optimizers
        self.batches = batches
        self.step = step
        self.steps = steps
        self.warmup = warmup
        self.targets = tuple(targets)
        self.extra_links = extra_links or (lambda root: [])
        self.shapes = shapes


def lengths(rs, n, low, high):
    """``n`` sequence lengths in [low, high]."""
    return [int(k) for k in rs.randint(low, high + 1, n)]


def sequences(rs, lens, n_vocab, low=0):
    return [rs.randint(low, n_vocab, k).astype(numpy.int32) for k in lens]


def copy_batch(batch):
    """A deep copy of a batch (arrays, lists, tuples, dicts), so neither twin
    sees what the other one did to its arguments."""
    if isinstance(batch, numpy.ndarray):
        return batch.copy()
    if isinstance(batch, (list, tuple)):
        return type(batch)(copy_batch(b) for b in batch)
    if isinstance(batch, dict):
        return dict((k, copy_batch(v)) for k, v in batch.items())
    return batch


def loss_array(loss):
    if isinstance(loss, chainer.Variable):
        loss = loss.array
    return numpy.array(loss, copy=True)


def update_step(model, opts, batch):
    """One ``optimizer.update(lossfun, *batch)`` as the StandardUpdater
    makes it (the loss computed inside update); returns the loss array."""
    opt, = opts
    kept = []

    def lossfun(*args):
        loss = model(*args)
        kept.append(loss)
        return loss
    opt.update(lossfun, *batch)
    return kept[0].array
