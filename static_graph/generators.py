"""Random generators of the user's own that a recorded call draws from.

Replay does not run the method's Python code, so a number drawn from a
generator object between Chainer functions (``lam = self.rng.beta(a, a)``
for mixup, ``self.rng.uniform(0.8, 1.2)`` for a random scale) would be
frozen at its recorded value. Draws from NumPy's and Python's global
generators are caught where they are made (recorder.py patches the module
functions); a generator object's methods cannot be patched, so its state is
compared instead: before and after the recording call, for the generators
the method can reach directly. Those are the attributes of the chain's
links (the chain itself included), and the module globals named by its
code and by the user functions it reaches by name (a helper function or
method, a child link's forward) and their closure variables. A generator
held elsewhere (in another object) is not seen.

While the method runs, each NumPy generator found so is replaced where it
is held by a stand-in (``stand_ins``) whose array draws are ops of the
recording (``numpy_calls.draw``: ``self.rng.randn(*h.shape)``, drawn again
from the same generator by every replay, in define-by-run's order). After
the call the generator is put back and its state checked: it must be the
state those draws, made again from the state before the call, reach
(``unseen``). Otherwise something else drew from it (a reference kept
elsewhere, an initializer, a number drawn and used in Python) and the call
falls back, as before.
"""
import random
import sys

import numpy

from static_graph import numpy_calls
from static_graph import places
from static_graph import traced

_TYPES = (numpy.random.RandomState, numpy.random.Generator, random.Random)
# The global generators: their draws are caught by recorder.py (and Chainer
# functions, F.dropout, draw from them inside, which replay repeats).
_GLOBAL = (numpy.random.mtrand._rand, random._inst)


def _state(gen):
    if isinstance(gen, numpy.random.Generator):
        return gen.bit_generator.state
    if isinstance(gen, numpy.random.RandomState):
        return gen.get_state(legacy=False)
    return gen.getstate()


def _same(a, b):
    if isinstance(a, numpy.ndarray) or isinstance(b, numpy.ndarray):
        return isinstance(a, numpy.ndarray) and \
            isinstance(b, numpy.ndarray) and numpy.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and \
            all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and \
            all(_same(x, y) for x, y in zip(a, b))
    return a == b


def snapshot(chain, global_names, closures=(), classes=()):
    """[(name, generator, state, (namespace, key) where it is held)] for
    the generators the method can reach
    directly on ``chain``'s links, as one of the module globals
    ``global_names`` (link_values.Watch.named_globals: those named by the
    method and the functions it reaches), one of their closure variables
    ``closures`` (Watch.named_closures: (closure, name)) or a class
    attribute of ``classes`` (Watch.classes_seen: the user classes)."""
    # (how a message names the place but its key, mapping, key): the
    # places looked at, in this order.
    held = []
    for path, link in chain.namedlinks():
        prefix = 'self%s.' % path.rstrip('/').replace('/', '.')
        held += [(prefix, link.__dict__, k) for k in link.__dict__]
    held += [('global ', glob, n) for glob, n in global_names]
    held += [('closure variable ', env, n) for env, n in closures]
    for cls in classes:
        space = places.ClassAttributes(cls)
        held += [('class attribute %s.' % cls.__name__, space, n)
                 for n in list(cls.__dict__)]
    found = []
    seen = set(id(g) for g in _GLOBAL)
    for prefix, d, k in held:
        v = d.get(k)
        if isinstance(v, _TYPES) and id(v) not in seen:
            seen.add(id(v))
            found.append((prefix + k, v, (d, k)))
    out = []
    for name, gen, where in found:
        try:
            out.append((name, gen, _state(gen), where))
        except Exception:   # a subclass whose state cannot be read
            pass
    return out


# Methods of a NumPy generator that are no draws (they set or read its
# state, or write into their argument).
_NOT_DRAWS = frozenset(('seed', 'set_state', 'get_state', 'shuffle',
                        'permuted', 'spawn', 'bit_generator'))


class _StandIn(object):
    """A NumPy generator's stand-in during a recording call (module
    docstring): attributes are the generator's, its draws from user code
    ops of the thread's recording; ``isinstance`` sees the generator's
    class."""

    __slots__ = ('_gen', '_label', '_calls')

    def __init__(self, gen, label, calls):
        object.__setattr__(self, '_gen', gen)
        object.__setattr__(self, '_label', label)
        object.__setattr__(self, '_calls', calls)

    @property
    def __class__(self):
        return type(self._gen)

    def __getattr__(self, name):
        v = getattr(self._gen, name)
        if name in _NOT_DRAWS or name.startswith('_') or \
                getattr(v, '__self__', None) is not self._gen:
            return v
        return _drawing(v, self._label, name, self._calls)

    def __setattr__(self, name, value):
        setattr(self._gen, name, value)

    def __repr__(self):
        return repr(self._gen)


def _drawing(bound, label, name, calls):
    def draw(*args, **kwargs):
        rec = traced.active_recording()
        if numpy_calls.recordable(rec) and not traced.internal_file(
                sys._getframe(1).f_code.co_filename):
            made = numpy_calls.draw(rec, bound, label, name, args, kwargs)
            if made is not None:
                calls.append((name, args, kwargs))
                return made
        return bound(*args, **kwargs)

    draw.__name__ = name
    return draw


def stand_ins(states):
    """Put a stand-in where each NumPy generator of a ``snapshot`` is held
    (a link's attribute, a module global); returns the puts to undo
    (``put_back``) and {id(generator): [(method, args, kwargs)]}, the
    draws made as ops."""
    calls, puts = {}, []
    for name, gen, _, where in states:
        if not isinstance(gen, (numpy.random.RandomState,
                                numpy.random.Generator)):
            continue
        d, k = where
        if d.get(k) is not gen:
            continue
        s = _StandIn(gen, name, calls.setdefault(id(gen), []))
        d[k] = s
        puts.append((d, k, gen, s))
    return puts, calls


def put_back(puts):
    """Undo ``stand_ins`` (where the method did not put something else
    there)."""
    for d, k, gen, s in puts:
        if type(d) is list:
            # (The call may have taken items out of a list it holds.)
            if k < len(d) and d[k] is s:
                d[k] = gen
        elif d.get(k) is s:
            d[k] = gen


def reason(name):
    """Why a call that drew from generator ``name`` other than as
    ``stand_ins`` saw falls back."""
    return ('user code draws random numbers from the generator %s other '
            'than arrays drawn through it by the method (a draw through a '
            'reference held elsewhere, a parameter initialized from it on '
            'first use); replay would freeze them (draw arrays through it, '
            'use Chainer functions such as F.dropout, or pass them in as '
            'arguments)' % name)


def _twin(gen, state):
    if isinstance(gen, numpy.random.Generator):
        t = numpy.random.Generator(type(gen.bit_generator)())
        t.bit_generator.state = state
    else:
        t = numpy.random.RandomState()
        t.set_state(state)
    return t


def unseen(states, calls):
    """The names of the generators of a ``snapshot`` drawn from other than
    by the draws in ``calls`` (``stand_ins``'): their state is not the one
    those draws reach from the state before the call (or, where the states
    cannot be compared, may not be)."""
    out = []
    for name, gen, before, _ in states:
        try:
            after = _state(gen)
            if _same(before, after):
                continue
            made = calls.get(id(gen))
            if made:
                t = _twin(gen, before)
                for method, args, kwargs in made:
                    getattr(t, method)(
                        *[traced.untraced(a) for a in args],
                        **dict((k, traced.untraced(v))
                               for k, v in kwargs.items()))
                if _same(_state(t), after):
                    continue
        except Exception:
            pass
        out.append(name)
    return out
