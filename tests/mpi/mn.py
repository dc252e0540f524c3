"""Run under ``mpiexec -n 2`` by tests/test_chainermn.py: ChainerMN
training with static chains, one scenario after another in one launch.

    mpiexec.gforker -n 2 python tests/mpi/mn.py static|dbr SCENARIO[,...] OUT

``static``: the chains' methods are decorated with ``@static_graph``;
``dbr``: the same program with ``chainer.config.use_static_graph = False``
(define-by-run). Each rank writes ``OUT/rank<N>.json``:
``{scenario: {'steps': [...], 'counts': {...}}}`` where a step holds the
loss (and whatever else the scenario observes) and every parameter and
persistent array after the step, as the hex of their bytes (compared bit
for bit), and ``counts`` the static chains' cache counters (method ->
recordings, replays, fallback_calls; ``None`` define-by-run).

Scenarios (all but ``p2p`` are data-parallel over the 'naive' communicator,
with ``scatter_dataset`` and ``create_multi_node_optimizer``):

* ``sgd``, ``adam``: an MLP trained with SGD / Adam;
* ``mnbn``: an MLP with ``chainermn.links.MultiNodeBatchNormalization``
  (allreduce inside the forward and the backward of the decorated
  method);
* ``allgather``: ``chainermn.functions.allgather`` inside the decorated
  method (the loss sees both ranks' features; the backward is an alltoall);
* ``evaluator``: ``Trainer`` + ``StandardUpdater`` +
  ``create_multi_node_evaluator`` over ``L.Classifier(static predictor)``:
  the observation of every iteration (training and validation, averaged
  over the ranks) is compared;
* ``p2p``: model parallelism with ``chainermn.functions.send``/``recv``
  inside the decorated methods (rank 0: a layer and send; rank 1: recv, a
  layer and the loss);
* ``bcast``: ``chainermn.functions.bcast`` inside the decorated method
  (rank 0's features classified on both ranks; its backward gathers the
  gradients at rank 0, and returns none on rank 1);
* ``sgd+update``, ``adam+update``: ``sgd``/``adam`` with the captured
  optimizer update, ``static_graph.capture_update(multi_node_optimizer)``,
  in static mode (needs a ``static_graph`` that has ``capture_update``).
"""
import json
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
warnings.simplefilter('ignore')

import static_graph  # NOQA  (first: Chainer on Python 3.12/NumPy 2)
import numpy  # NOQA
import chainer  # NOQA
import chainer.functions as F  # NOQA
import chainer.links as L  # NOQA
from chainer import training  # NOQA
import chainermn  # NOQA
from static_graph.decorator import caches_of  # NOQA

MODE, NAMES, OUT = sys.argv[1], sys.argv[2].split(','), sys.argv[3]
assert MODE in ('static', 'dbr'), MODE
STATIC = MODE == 'static'
chainer.global_config.use_static_graph = STATIC
comm = chainermn.create_communicator('naive')
STEPS = 6
BATCH = 8          # per rank


def hexes(a):
    return numpy.ascontiguousarray(a).tobytes().hex()


def state(model):
    """Every parameter and persistent array of ``model``, as hex."""
    out = dict(('param ' + n, hexes(p.array))
               for n, p in model.namedparams())
    for path, link in model.namedlinks():
        for n in sorted(link._persistent):
            v = getattr(link, n)
            if isinstance(v, numpy.ndarray):
                out['persistent %s/%s' % (path, n)] = hexes(v)
    return out


def counts(*chains):
    if not STATIC:
        return None
    out = {}
    for chain in chains:
        for name, cache in caches_of(chain).items():
            out['%s.%s' % (type(chain).__name__, name)] = {
                'recordings': cache.recordings, 'replays': cache.replays,
                'fallback_calls': cache.fallback_calls}
    return out


def dataset(n, n_in=10, n_out=3, seed=3):
    """The same ``n`` examples on every rank, scattered from rank 0."""
    data = None
    if comm.rank == 0:
        rs = numpy.random.RandomState(seed)
        x = rs.standard_normal((n, n_in)).astype('f')
        t = rs.randint(0, n_out, n).astype('i')
        data = chainer.datasets.TupleDataset(x, t)
    return chainermn.scatter_dataset(data, comm, shuffle=True, seed=seed)


def optimizer(inner, model, capture=False):
    opt = chainermn.create_multi_node_optimizer(inner, comm)
    opt.setup(model)
    if capture and STATIC:
        static_graph.capture_update(opt)
    return opt


def batches(data):
    it = chainer.iterators.SerialIterator(data, BATCH, shuffle=False)
    for _ in range(STEPS):
        yield chainer.dataset.concat_examples(it.next())


def train(model, opt, data):
    """``opt.update(model, x, t)`` STEPS times (the multi-node optimizer's
    first update broadcasts rank 0's parameters instead of updating)."""
    steps = []
    for x, t in batches(data):
        losses = []

        def lossfun(x, t):
            loss = model(x, t)
            losses.append(hexes(loss.array))
            return loss
        opt.update(lossfun, x, t)
        steps.append({'loss': losses, 'state': state(model)})
    return {'steps': steps, 'counts': counts(model)}


class MLP(chainer.Chain):
    def __init__(self, n_in=10, n_units=16, n_out=3):
        super(MLP, self).__init__()
        with self.init_scope():
            self.l1 = L.Linear(n_in, n_units)
            self.l2 = L.Linear(n_units, n_out)

    @static_graph.static_graph
    def forward(self, x, t):
        h = F.relu(self.l1(x))
        return F.softmax_cross_entropy(self.l2(h), t)


class BNMLP(chainer.Chain):
    def __init__(self, n_in=10, n_units=16, n_out=3):
        super(BNMLP, self).__init__()
        with self.init_scope():
            self.l1 = L.Linear(n_in, n_units)
            self.bn = chainermn.links.MultiNodeBatchNormalization(
                n_units, comm)
            self.l2 = L.Linear(n_units, n_out)

    @static_graph.static_graph
    def forward(self, x, t):
        h = F.relu(self.bn(self.l1(x)))
        return F.softmax_cross_entropy(self.l2(h), t)


class Gathered(chainer.Chain):
    """Every rank's features, gathered, side by side: example i of this
    rank is classified from its own features and those of example i of
    the other ranks (the gradient goes back by alltoall)."""

    def __init__(self, n_in=10, n_units=6, n_out=3):
        super(Gathered, self).__init__()
        with self.init_scope():
            self.l1 = L.Linear(n_in, n_units)
            self.l2 = L.Linear(n_units * comm.size, n_out)

    @static_graph.static_graph
    def forward(self, x, t):
        h = F.tanh(self.l1(x))
        hs = chainermn.functions.allgather(comm, h)
        return F.softmax_cross_entropy(self.l2(F.concat(hs, axis=1)), t)


class Normalized(MLP):
    """The loss summed over every rank's examples, divided by their count
    over all ranks: the method calls the communicator itself (it falls
    back: replay would not communicate, and would keep the first count)."""

    @static_graph.static_graph
    def forward(self, x, t):
        n = comm.allreduce((t >= 1).sum(keepdims=True).astype('f'))
        h = self.l2(F.relu(self.l1(x)))
        return F.sum(F.softmax_cross_entropy(h, t, reduce='no')) / n[0]


def data_parallel(model_cls, inner, capture=False):
    numpy.random.seed(comm.rank)   # different initial values: bcast
    model = model_cls()
    return train(model, optimizer(inner, model, capture), dataset(64))


def scenario_sgd():
    return data_parallel(MLP, chainer.optimizers.SGD(lr=0.3))


def scenario_adam():
    return data_parallel(MLP, chainer.optimizers.Adam(alpha=0.01))


def scenario_sgd_update():
    return data_parallel(MLP, chainer.optimizers.SGD(lr=0.3), capture=True)


def scenario_adam_update():
    return data_parallel(MLP, chainer.optimizers.Adam(alpha=0.01),
                         capture=True)


def scenario_mnbn():
    return data_parallel(BNMLP, chainer.optimizers.SGD(lr=0.3))


def scenario_normalized():
    return data_parallel(Normalized, chainer.optimizers.SGD(lr=0.3))


def scenario_allgather():
    return data_parallel(Gathered, chainer.optimizers.SGD(lr=0.3))


class Predictor(chainer.Chain):
    def __init__(self, n_in=10, n_units=16, n_out=3):
        super(Predictor, self).__init__()
        with self.init_scope():
            self.l1 = L.Linear(n_in, n_units)
            self.l2 = L.Linear(n_units, n_out)

    @static_graph.static_graph
    def forward(self, x):
        return self.l2(F.relu(self.l1(x)))


def scenario_evaluator():
    numpy.random.seed(comm.rank)
    model = L.Classifier(Predictor())
    opt = optimizer(chainer.optimizers.Adam(alpha=0.01), model)
    train_iter = chainer.iterators.SerialIterator(dataset(64), BATCH,
                                                  shuffle=False)
    # 16 test examples per rank, two full batches: one key for evaluation
    test_iter = chainer.iterators.SerialIterator(
        dataset(32, seed=4), BATCH, repeat=False, shuffle=False)
    updater = training.updaters.StandardUpdater(train_iter, opt)
    trainer = training.Trainer(updater, (STEPS, 'iteration'),
                               out=os.path.join(OUT, 'trainer%d'
                                                % comm.rank))
    evaluator = chainermn.create_multi_node_evaluator(
        training.extensions.Evaluator(test_iter, model), comm)
    trainer.extend(evaluator, trigger=(2, 'iteration'))
    steps = []

    @training.make_extension(trigger=(1, 'iteration'), priority=-1000)
    def observe(trainer):
        # after the evaluator (priority -1000 runs last): the training
        # loss and accuracy of this rank and, every second iteration,
        # the validation values averaged over the ranks
        obs = dict((k, hexes(numpy.asarray(chainer.as_array(v))))
                   for k, v in trainer.observation.items())
        steps.append({'observation': obs, 'state': state(model)})
    trainer.extend(observe)
    trainer.run()
    return {'steps': steps, 'counts': counts(model.predictor)}


class First(chainer.Chain):
    def __init__(self):
        super(First, self).__init__()
        with self.init_scope():
            self.l1 = L.Linear(3, 4)

    @static_graph.static_graph
    def forward(self, x):
        h = F.relu(self.l1(x))
        return chainermn.functions.send(h, comm, rank=1)


class Second(chainer.Chain):
    def __init__(self):
        super(Second, self).__init__()
        with self.init_scope():
            self.l2 = L.Linear(4, 2)

    @static_graph.static_graph
    def forward(self, t):
        h = chainermn.functions.recv(comm, rank=0)
        return F.softmax_cross_entropy(self.l2(h), t)


def scenario_p2p():
    """Rank 0's layer gets its gradient from rank 1; plain SGD."""
    numpy.random.seed(0)
    model = First() if comm.rank == 0 else Second()
    opt = chainer.optimizers.SGD(lr=0.5)
    opt.setup(model)
    rs = numpy.random.RandomState(1)
    steps = []
    for i in range(STEPS):
        x = rs.standard_normal((5, 3)).astype('f')
        t = rs.randint(0, 2, 5).astype('i')
        model.cleargrads()
        y = model(x) if comm.rank == 0 else model(t)
        y.backward()   # rank 0: the delegate variable, as ChainerMN's
        opt.update()
        steps.append({'loss': hexes(y.array), 'state': state(model)})
    return {'steps': steps, 'counts': counts(model)}


class Broadcast(chainer.Chain):
    """Rank 0's features, broadcast: each rank classifies them with its
    own layer; the gradients are gathered back at rank 0 (``bcast``'s
    backward: a rank that is not the root gets no gradient from it)."""

    def __init__(self):
        super(Broadcast, self).__init__()
        with self.init_scope():
            self.l1 = L.Linear(3, 4)
            self.l2 = L.Linear(4, 2)

    @static_graph.static_graph
    def forward(self, x, t):
        if comm.rank == 0:
            h = chainermn.functions.bcast(comm, F.tanh(self.l1(x)))
        else:
            h = chainermn.functions.bcast(comm, None)
        return F.softmax_cross_entropy(self.l2(h), t)


def scenario_bcast():
    """Rank 0's first layer gets the gradients of both ranks' losses;
    plain SGD on each rank."""
    numpy.random.seed(comm.rank)
    model = Broadcast()
    opt = chainer.optimizers.SGD(lr=0.5)
    opt.setup(model)
    rs = numpy.random.RandomState(1 + comm.rank)
    steps = []
    for i in range(STEPS):
        x = rs.standard_normal((5, 3)).astype('f')
        t = rs.randint(0, 2, 5).astype('i')
        model.cleargrads()
        loss = model(x, t)
        loss.backward()
        opt.update()
        steps.append({'loss': hexes(loss.array), 'state': state(model)})
    return {'steps': steps, 'counts': counts(model)}


SCENARIOS = {
    'sgd': scenario_sgd, 'adam': scenario_adam, 'mnbn': scenario_mnbn,
    'allgather': scenario_allgather, 'evaluator': scenario_evaluator,
    'normalized': scenario_normalized,
    'p2p': scenario_p2p, 'bcast': scenario_bcast,
    'sgd+update': scenario_sgd_update, 'adam+update': scenario_adam_update,
}

results = {}
for name in NAMES:
    results[name] = SCENARIOS[name]()
    comm.mpi_comm.Barrier()
with open(os.path.join(OUT, 'rank%d.json' % comm.rank), 'w') as f:
    json.dump(results, f)
