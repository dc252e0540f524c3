"""Random generators of the user's own that a recorded call draws from.

Replay does not run the method's Python code, so a number drawn from a
generator object between Chainer functions (``lam = self.rng.beta(a, a)``
for mixup, ``self.rng.uniform(0.8, 1.2)`` for a random scale) would be
frozen at its recorded value. Draws from NumPy's and Python's global
generators are caught where they are made (recorder.py patches the module
functions); a generator object's methods cannot be patched, so its state is
compared instead: before and after the recording call, for the generators
the method can reach directly. Those are the attributes of the chain's
links (the chain itself included) and the module globals named by its code
and by the user functions it reaches by name (a helper function or method,
a child link's forward). A generator held elsewhere (in another object, a
closure) is not seen.
"""
import random

import numpy

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


def snapshot(chain, global_names):
    """[(name, generator, state)] for the generators the method can reach
    directly on ``chain``'s links, or as one of the module globals
    ``global_names`` (link_values.Watch.named_globals: those named by the
    method and the functions it reaches)."""
    found = []
    seen = set(id(g) for g in _GLOBAL)
    for path, link in chain.namedlinks():
        for k, v in link.__dict__.items():
            if isinstance(v, _TYPES) and id(v) not in seen:
                seen.add(id(v))
                found.append(('self%s.%s' % (path.rstrip('/').replace(
                    '/', '.'), k), v))
    for glob, n in global_names:
        v = glob[n]
        if isinstance(v, _TYPES) and id(v) not in seen:
            seen.add(id(v))
            found.append(('global %s' % n, v))
    out = []
    for name, gen in found:
        try:
            out.append((name, gen, _state(gen)))
        except Exception:   # a subclass whose state cannot be read
            pass
    return out


def drawn(states):
    """The names of the generators of a ``snapshot`` whose state changed
    since: the method drew from them (or, where the states cannot be
    compared, may have)."""
    out = []
    for name, gen, before in states:
        try:
            same = _same(before, _state(gen))
        except Exception:
            same = False
        if not same:
            out.append(name)
    return out
