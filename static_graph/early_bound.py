"""Functions bound to a name before the recorder's patches went in.

patches.py replaces, while a call records, the global random generators'
module functions and a few of Chainer's functions that compute outside
any node (numpy_calls.ON_ARRAYS), where their modules hold them. A name
bound to one of those before (``from numpy.random import uniform``,
``from random import random``, ``self.draw = random.random``, ``fn =
F.sign`` in a closure, a class attribute, a default argument) still holds
the original, whose draws and results the recording would not see:
``stand_ins`` puts the patched function there for the call."""
from static_graph import patches
from static_graph import places


def stand_ins(chain, watch):
    """Put the patched function where something the call can reach by name
    holds a function the patches stand in for, bound before they went in
    (patches.patched_for): a link's attribute or an item of a list or dict
    it holds, one of the watch's module globals, closure variables and
    project modules' attributes, or a class attribute of the links' user
    classes; so that the call is seen as one through the module is.
    Returns the puts to undo (generators.put_back)."""
    dicts = [link.__dict__ for link in chain.links()]
    found = [(d, k) for d in dicts for k in list(d)]
    for d in dicts:
        for v in list(d.values()):
            if type(v) is list:
                found.extend((v, i) for i in range(min(len(v), 64)))
            elif type(v) is dict:
                found.extend((v, k) for k in list(v)[:64])
    found += list(watch.named_globals) + list(watch.named_closures)
    found += [(m.__dict__, k) for m in watch.modules
              for k in watch.code_names if k in m.__dict__]
    found += [(_ClassSpace(c), k) for c in watch.classes_seen
              for k in list(c.__dict__)]
    puts = []
    for d, k in found:
        v = _get(d, k)
        p = patches.patched_for(v)
        if p is not None:
            d[k] = p
            puts.append((d, k, v, p))
    return puts


def _get(d, k):
    if type(d) is list:
        return d[k] if k < len(d) else None
    return d.get(k)


class _ClassSpace(places.ClassAttributes):
    """A class's attributes as a mapping that ``stand_ins`` and
    ``generators.put_back`` write to: a function set there is a static
    method (the original, a bound method or one wrapped so, took no
    ``self``), and putting the original back puts back the attribute as it
    was."""

    def __init__(self, cls):
        self.cls = cls
        self.raw = {}

    def get(self, k, default=None):
        v = self.cls.__dict__.get(k, default)
        self.raw.setdefault(k, v)      # (as it was before the stand-in)
        return v.__func__ if type(v) is staticmethod else v

    def __setitem__(self, k, v):
        if patches.patched_for(v) is not None:       # (the original)
            v = self.raw.get(k, v)
        else:
            v = staticmethod(v)
        setattr(self.cls, k, v)
