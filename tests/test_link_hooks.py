"""Link hooks of a decorated chain's child links run inside the call:
their state is watched as a helper object's (set between calls: the key
records again; changed by the call: replay would not repeat it, the key
falls back); a hook without state replays."""
import warnings

import numpy
import pytest

import chainer
import chainer.functions as F
import chainer.links as L
from chainer import link_hooks

from static_graph import static_graph
from static_graph.decorator import caches_of


class Scale(chainer.LinkHook):
    """Scales the link's weight by ``scale`` for the call."""
    name = 'Scale'

    def __init__(self, anneal=1.0):
        self.scale, self.anneal = 1.0, anneal

    def forward_preprocess(self, args):
        self.orig = args.link.W
        args.link.W = args.link.W * self.scale
        self.scale *= self.anneal

    def forward_postprocess(self, args):
        args.link.W = self.orig


class Keep(chainer.LinkHook):
    """Keeps the link's output (feature extraction, Grad-CAM)."""
    name = 'Keep'

    def forward_postprocess(self, args):
        self.out = args.out


class Net(chainer.Chain):
    def __init__(self, hook=None, on_root=None):
        super(Net, self).__init__()
        with self.init_scope():
            self.l1 = L.Linear(5, 3)
            self.l2 = L.Linear(3, 2)
        if hook is not None:
            self.l1.add_hook(hook)
        if on_root is not None:
            self.add_hook(on_root)

    def forward(self, x):
        return F.sum(self.l2(F.tanh(self.l1(x))))


class StaticNet(Net):
    forward = static_graph(Net.forward)


HOOKS = {
    'scale set between calls': lambda: Scale(),
    'scale annealed by the hook': lambda: Scale(anneal=0.5),
    'output kept': lambda: Keep(),
    "Chainer's TimerHook": lambda: link_hooks.TimerHook(),
    "Chainer's WeightStandardization": lambda: link_hooks.
    WeightStandardization(),
}


@pytest.mark.parametrize('what', sorted(HOOKS))
def test_child_link_hooks_train_as_define_by_run(what):
    a, b = Net(HOOKS[what]()), StaticNet(HOOKS[what]())
    b.copyparams(a)
    oa, ob = chainer.optimizers.SGD(0.1), chainer.optimizers.SGD(0.1)
    oa.setup(a)
    ob.setup(b)
    rs = numpy.random.RandomState(0)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        for i in range(6):
            x = rs.randn(4, 5).astype('f')
            for m, o in ((a, oa), (b, ob)):
                if what == 'scale set between calls' and i == 3:
                    m.l1.local_link_hooks['Scale'].scale = 3.0
                m.cleargrads()
                loss = m(x)
                loss.backward()
                o.update()
            assert numpy.array_equal(a.l1.W.array, b.l1.W.array), i
            ha, hb = (m.l1.local_link_hooks for m in (a, b))
            if what == 'output kept':
                assert numpy.array_equal(ha['Keep'].out.array,
                                         hb['Keep'].out.array), i
            if what == "Chainer's TimerHook":
                assert len(ha['TimerHook'].call_history) == \
                    len(hb['TimerHook'].call_history) == i + 1
    cache = caches_of(b)['forward']
    if what in ('scale set between calls',
                "Chainer's WeightStandardization"):
        assert cache.replays >= 3
    else:
        assert cache.replays == 0


def test_a_hook_of_the_decorated_chain_itself_keeps_the_replay():
    """The decorated chain's own hooks run around the call, not inside."""
    class Count(chainer.LinkHook):
        name = 'Count'
        n = 0

        def forward_preprocess(self, args):
            self.n += 1

    hook = Count()
    m = StaticNet(on_root=hook)
    for _ in range(4):
        m(numpy.ones((2, 5), 'f')).backward()
    assert hook.n == 4 and caches_of(m)['forward'].replays == 3


def test_the_chains_own_hooks_are_watched_when_the_method_calls_it():
    """A decorated ``loss`` that calls ``self(x)`` runs the chain's own
    hooks inside the call: a counting hook read 1 for 5."""
    class Count(chainer.LinkHook):
        name = 'Count'
        n = 0

        def forward_preprocess(self, args):
            self.n += 1

    class WithLoss(Net):
        def forward(self, x):
            return self.l2(F.tanh(self.l1(x)))

        @static_graph
        def loss(self, x):
            return F.sum(self(x))

    hook = Count()
    m = WithLoss(on_root=hook)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        for _ in range(5):
            m.loss(numpy.ones((2, 5), 'f')).backward()
    assert hook.n == 5
