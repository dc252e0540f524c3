"""Run under ``mpiexec -n 2`` by tests/test_chainermn.py: model parallelism
with ChainerMN's send/recv inside the decorated forward (rank 0: a layer
and send; rank 1: recv, a layer and the loss), trained with SGD. Each rank
writes ``OUT/rank<N>.json``: the loss and the parameters after every step
(as hex floats, to compare bit for bit) and the static chain's counts.

    mpiexec.gforker -n 2 python tests/mpi/p2p.py static|dbr OUT
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
import chainermn  # NOQA
from static_graph.decorator import caches_of  # NOQA

comm = chainermn.create_communicator('naive')
static = sys.argv[1] == 'static'
deco = static_graph.static_graph if static else (lambda f: f)


class First(chainer.Chain):
    def __init__(self):
        super(First, self).__init__()
        with self.init_scope():
            self.l1 = L.Linear(3, 4)

    @deco
    def forward(self, x):
        h = F.relu(self.l1(x))
        return chainermn.functions.send(h, comm, rank=1)


class Second(chainer.Chain):
    def __init__(self):
        super(Second, self).__init__()
        with self.init_scope():
            self.l2 = L.Linear(4, 2)

    @deco
    def forward(self, t):
        h = chainermn.functions.recv(comm, rank=0)
        return F.softmax_cross_entropy(self.l2(h), t)


def hexes(a):
    return [float(v).hex() for v in numpy.asarray(a).ravel()]


numpy.random.seed(0)
model = First() if comm.rank == 0 else Second()
opt = chainer.optimizers.SGD(lr=0.5)
opt.setup(model)
rs = numpy.random.RandomState(1)
steps = []
for i in range(6):
    x = rs.standard_normal((5, 3)).astype('f')
    t = rs.randint(0, 2, 5).astype('i')
    model.cleargrads()
    y = model(x) if comm.rank == 0 else model(t)
    y.backward()   # rank 0: the delegate variable, as ChainerMN's examples
    opt.update()
    steps.append({'loss': hexes(y.array),
                  'params': dict((n, hexes(p.array))
                                 for n, p in sorted(model.namedparams()))})
counts = None
if static:
    (cache,) = caches_of(model).values()
    counts = {'recordings': cache.recordings, 'replays': cache.replays,
              'fallback_calls': cache.fallback_calls}
with open(os.path.join(sys.argv[2], 'rank%d.json' % comm.rank), 'w') as f:
    json.dump({'rank': comm.rank, 'steps': steps, 'counts': counts}, f)
