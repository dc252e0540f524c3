"""Code and state the method reaches in ways other than its own names: a
decorated child link's forward (or a decorated parent's, through
``super()``), a method replaced on the class, a descriptor's state, a
global generator's method bound to a name before the library's patches
went in, and an array argument's ``.flags`` and ``.base``. Each changes
between calls (or draws at every call); each twin pair trains alike, bit
for bit. (Found by a hunt: each replayed what the recording saw,
silently.)"""
import functools
import random
import warnings

import numpy
import pytest
from numpy.random import uniform as _np_uniform

import chainer
import chainer.functions as F
import chainer.links as L

import static_graph
from static_graph import static_graph as static
import tests.reached_pkg.inner
from tests import reached_settings as settings
from tests.twins import train_alike

GAIN = [1.0]     # what the loop changes


def _py_random():
    return random.random()


# Bound before the patches: the global generators' own methods.
_py_draw = random.random


def _identity(f):
    return f


def _family(deco):
    """A parent whose forward calls a child link; both forwards decorated
    with ``deco`` (as a user writes ``@static_graph`` over each)."""
    class Child(chainer.Chain):
        def __init__(self):
            super(Child, self).__init__()
            with self.init_scope():
                self.l = L.Linear(6, 3)

        @deco
        def forward(self, h):
            return self.l(h) * GAIN[0]

    class Parent(chainer.Chain):
        def __init__(self):
            super(Parent, self).__init__()
            with self.init_scope():
                self.l1 = L.Linear(5, 6)
                self.child = Child()

        @deco
        def forward(self, x, t):
            return F.softmax_cross_entropy(
                self.child(F.relu(self.l1(x))), t)
    return Parent


def _with_super(deco):
    class Base(chainer.Chain):
        def __init__(self):
            super(Base, self).__init__()
            with self.init_scope():
                self.l1 = L.Linear(5, 3)

        @deco
        def forward(self, x, t):
            return F.softmax_cross_entropy(self.l1(x) * GAIN[0], t)

    class Derived(Base):
        @deco
        def forward(self, x, t):
            return super(Derived, self).forward(x, t) * 2
    return Derived


class _Gain(object):
    """A descriptor on the class whose value is its own state."""

    def __init__(self):
        self.value = 1.0

    def __get__(self, obj, cls):
        return self.value


def _plain(deco, body, **attrs):
    def forward(self, x, t):
        return F.softmax_cross_entropy(self.l1(x) * body(self), t)

    def init(self):
        chainer.Chain.__init__(self)
        with self.init_scope():
            self.l1 = L.Linear(5, 3)

    attrs.update(__init__=init, forward=deco(forward))
    return type('Net', (chainer.Chain,), attrs)


def _method_on_class(deco):
    return _plain(deco, lambda self: self.gain(),
                  gain=lambda self: 1.0)


def _descriptor(deco):
    return _plain(deco, lambda self: self.g, g=_Gain())


def _getattr(deco):
    def __getattr__(self, name):
        if name == 'gain':
            return GAIN[0]
        return chainer.Chain.__getattr__(self, name)
    return _plain(deco, lambda self: self.gain, __getattr__=__getattr__)


def _halved(self, by):
    return GAIN[0] / by


def _partialmethod(deco):
    return _plain(deco, lambda self: self.half(),
                  half=functools.partialmethod(_halved, 2.0))


def _swish(h):
    return h * GAIN[0]


ACTS = {'swish': _swish}


def _registry(deco):
    return _plain(deco, lambda self: ACTS['swish'](1.0))


class _Meta(type(chainer.Chain)):
    gain = 1.0


def _metaclass(deco):
    base = _plain(deco, lambda self: type(self).gain)
    return _Meta('Net', (base,), {})


def _module_attribute(deco):
    return _plain(deco, lambda self: settings.scale)


def _module_function(deco):
    return _plain(deco, lambda self: settings.get())


def _set_scale(m):
    settings.scale = 2.0


def _package_attribute(deco):
    return _plain(deco, lambda self: tests.reached_pkg.inner.scale)


def _set_inner(m):
    tests.reached_pkg.inner.scale = 2.0


def _child_replaced(deco):
    """A child link whose forward the loop replaces on its class."""
    class Child(chainer.Chain):
        def forward(self, h):
            return h * 1.0

    Net = _plain(deco, lambda self: 1.0)
    base_forward = Net.forward

    def forward(self, x, t):
        return base_forward(self, self.child(x), t)

    def init(self):
        Net.__init__(self)
        with self.init_scope():
            self.child = Child()
    return type('Net', (Net,), {'__init__': init,
                                'forward': deco(forward)})


class _Shadowed(chainer.Chain):
    gain = 1.0


def _shadowing(deco):
    base = _plain(deco, lambda self: self.gain)
    return type('Net', (base, _Shadowed), {})


class _Scaled(object):
    def __init__(self):
        self.by = 1.0

    def __call__(self, h):
        return h * self.by * GAIN[0]


REGISTRY = {'nested': {'act': functools.partial(_halved, by=0.5)},
            'object': _Scaled()}


def _partial_registry(deco):
    return _plain(deco, lambda self: REGISTRY['nested']['act'](None))


def _object_registry(deco):
    return _plain(deco, lambda self: REGISTRY['object'](1.0))


def _twins(family):
    models = []
    for deco in (_identity, static):
        numpy.random.seed(0)
        models.append(family(deco)())
    return models


def _set_gain(m):
    GAIN[0] = 2.0


CHANGES = {
    'a decorated child link reads a global': (_family, _set_gain),
    'a decorated parent through super()': (_with_super, _set_gain),
    'a method replaced on the class': (
        _method_on_class,
        lambda m: setattr(type(m), 'gain', lambda self: 2.0)),
    "a descriptor's state": (
        _descriptor,
        lambda m: setattr(type(m).__dict__['g'], 'value', 2.0)),
    "the chain's __getattr__": (_getattr, _set_gain),
    'a partialmethod': (_partialmethod, _set_gain),
    'a function in a registry dict': (_registry, _set_gain),
    "a metaclass's attribute": (
        _metaclass, lambda m: setattr(_Meta, 'gain', 2.0)),
    "a project module's attribute": (_module_attribute, _set_scale),
    "a project module's function": (_module_function, _set_scale),
    "a project package's submodule": (_package_attribute, _set_inner),
    "a child link's forward replaced on its class": (
        _child_replaced, lambda m: setattr(
            type(m.child), 'forward', lambda self, h: h * 2.0)),
    "a base class's attribute shadowed on the class": (
        _shadowing, lambda m: setattr(type(m), 'gain', 2.0)),
    'a partial in a nested registry': (_partial_registry, _set_gain),
    'a callable object in a registry': (_object_registry, _set_gain),
}


@pytest.mark.parametrize('case', sorted(CHANGES))
def test_a_change_the_replay_sees(case):
    family, change = CHANGES[case]
    models = _twins(family)

    def before(m, i):
        if i == 3:
            change(m)
    try:
        train_alike(models, before)
    finally:
        GAIN[0] = settings.scale = _Meta.gain = 1.0
        tests.reached_pkg.inner.scale = 1.0
    text = static_graph.explain(models[1])
    assert ' 0 replays' not in text, text    # (replays before the change)


_CLOSED = random.Random(0)


def _closure_draws():
    rng, draw = _CLOSED, random.random
    return {
        'a random.Random in a closure': lambda self: rng.random() + 0.5,
        'random.random in a closure': lambda self: draw() + 0.5}


DRAWS = {
    'numpy.random.uniform, imported by name': lambda self: float(
        _np_uniform(0.5, 1.5)),
    'random.random, imported by name': lambda self: _py_draw() + 0.5,
    'random.random held by a link': lambda self: self.draw() + 0.5,
    'random.random through the module (as before)': lambda self:
        _py_random() + 0.5,
}
DRAWS.update(_closure_draws())
DRAWS.update({
    'random.random as a class attribute': lambda self: self.cdraw() + 0.5,
    'random.random as a default argument': lambda self: _by_default(),
    'random.random in a list on the chain': lambda self:
        self.draws[0]() + 0.5,
    "numpy.random.uniform as a project module's attribute": lambda self:
        float(settings.uniform(0.5, 1.5)),
})


def _by_default(draw=random.random):
    return draw() + 0.5


@pytest.mark.parametrize('case', sorted(DRAWS))
def test_a_draw_through_a_name_bound_before(case):
    """``from numpy.random import uniform`` binds the global generator's
    method before the library's patches replace the module's: its draws
    went unseen, and every replay used the recording's number."""
    models = []
    for deco in (_identity, static):
        numpy.random.seed(0)
        m = _plain(deco, DRAWS[case], cdraw=random.random)()
        m.draw = random.random
        m.draws = [random.random]
        models.append(m)

    def seeded(m, i):
        numpy.random.seed(10 + i)
        random.seed(10 + i)
        _CLOSED.seed(10 + i)
    w = train_alike(models, seeded, steps=4)
    assert any('draws random numbers' in x for x in w)


def _flags_or_base(read):
    class Net(chainer.Chain):
        def __init__(self):
            super(Net, self).__init__()
            with self.init_scope():
                self.l1 = L.Linear(5, 3)

        def forward(self, x, t):
            s = 0.5 if read(x) else 1.0
            return F.softmax_cross_entropy(self.l1(x) * s, t)
    return Net


def test_a_static_method_holding_a_draw_is_put_back_as_it_was():
    """A class attribute ``staticmethod(random.random)``: the stand-in
    the recording puts there was put back as the bare function, and the
    class (undecorated twins too) broke: the original comes back now."""
    Net = _plain(static, lambda self: self.sdraw() + 0.5,
                 sdraw=staticmethod(random.random))
    held = Net.__dict__['sdraw']
    m = Net()
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        for i in range(3):
            m(numpy.ones((4, 5), 'f'), numpy.zeros(4, 'i'))
    assert Net.__dict__['sdraw'] is held


def test_a_draw_the_call_takes_out_of_a_list():
    """``self.noises.pop()`` of a list holding numpy.random.randn: putting
    the original back after the call raised IndexError."""
    Net = _plain(static, lambda self: float(self.noises.pop()(1)[0]) * 0)
    m = Net()
    for i in range(3):
        m.noises = [numpy.random.randn]
        m(numpy.ones((4, 5), 'f'), numpy.zeros(4, 'i'))
    assert m.noises == []


def test_a_layout_flag_read_replays():
    """``if not x.flags.c_contiguous`` reads the layout, which the key
    holds: the calls replay (only the other flags are value reads)."""
    base = _flags_or_base(lambda x: not x.flags.c_contiguous)
    m = type('S', (base,), {'forward': static(base.forward)})()
    for i in range(4):
        m.cleargrads()
        m(numpy.ones((4, 5), 'f'), numpy.zeros(4, 'i')).backward()
    assert ' 3 replays' in static_graph.explain(m)


@pytest.mark.parametrize('read', ['flags.owndata', 'base is None'])
def test_what_an_array_argument_says_of_its_memory(read):
    """The recording runs on a traced view of a copy: its ``owndata`` was
    False and its ``base`` the copy, so a branch on them took the other
    path at the recording and (for ``.flags``, unseen) at every replay.
    Now user code gets the caller's array's answer, and the call falls
    back."""
    how = (lambda x: x.flags.owndata) if read == 'flags.owndata' else \
        (lambda x: x.base is None)
    base = _flags_or_base(how)
    models = []
    for cls in (base, type('S', (base,), {'forward': static(base.forward)})):
        numpy.random.seed(0)
        models.append(cls())
    w = train_alike(models, steps=4)
    assert any('.flags' in x or '.base' in x for x in w)


class _Refusing(type):
    def __getattr__(cls, name):
        raise RuntimeError('refused: %s' % name)


class _Odd(metaclass=_Refusing):
    pass


ODD = _Odd()


def test_a_global_whose_metaclass_refuses_attributes():
    """A global the method reads whose class has a metaclass
    ``__getattr__`` that raises (not AttributeError): looking for a
    descriptor's ``__get__`` on it raised out of the recording call
    (sweep22: fine before the session's widening)."""
    Net = _plain(static, lambda self: 1.0 if ODD else 0.0)
    m = Net()
    for i in range(3):
        m.cleargrads()
        m(numpy.ones((4, 5), 'f'), numpy.zeros(4, 'i')).backward()
    assert ' 2 replays' in static_graph.explain(m)


def test_a_cython_fused_function_on_the_chain():
    """A chain holding one of sklearn's Cython 3 fused functions (whose
    type's ``__module__`` is a descriptor, not a string): the recording
    raised AttributeError while it looked for the classes the method
    reaches, where define-by-run ran (libs31 hunt; also from
    ``label_binarize`` or ``compute_class_weight`` called in the
    method)."""
    fast = pytest.importorskip('sklearn.utils.sparsefuncs_fast')
    Net = _plain(static, lambda self: 1.0)
    m = Net()
    m.norms = fast._sqeuclidean_row_norms_sparse
    for i in range(3):
        m.cleargrads()
        m(numpy.ones((4, 5), 'f'), numpy.zeros(4, 'i')).backward()
    assert ' 2 replays' in static_graph.explain(m)
