"""Identity matrices user code makes while a call records, indexed by the
labels: a one-hot mask ``xp.eye(n, dtype=bool)[t]`` (CosFace's target
mask), ``xp.identity(n)[t]``.

``numpy.eye(n)`` made from numbers alone is a constant of the key
(patches.py: ``rec.shape_made``), but indexing a plain array with a traced
one runs in NumPy's C code, which never asks the traced array: the mask
would look like one more constant, and a node built with it (``F.where``'s
condition) would keep the recording's labels at every replay, silently.
So while a call records, ``eye`` and ``identity`` hand user code a
``KeyConstant``: an ndarray whose indexing by a traced array gives a traced
result, noted in ``rec.derived`` (computed from the data, not a constant:
analysis.mark_captured makes a node holding one a reason to fall back, as
an input made so already is). Everything else it does is a plain array's
(its other results are plain ndarrays).
"""
import numpy

from static_graph import traced

MAKERS = ('eye', 'identity')


class KeyConstant(numpy.ndarray):
    """A constant of the key whose indexing by traced values is seen."""

    def __getitem__(self, key):
        plain = self.view(numpy.ndarray)
        rec = traced.active_recording()
        if rec is None or not traced.holds_traced(
                key if type(key) in (tuple, list) else (key,)):
            return numpy.ndarray.__getitem__(plain, key)
        out = numpy.ndarray.__getitem__(plain, traced._plain_all(key))
        if not isinstance(out, numpy.ndarray):
            traced.flag('reading an element, x[i, j]')
            return out
        rec.derived[id(out)] = out
        return rec.trace(out, check=False)

    def __array_wrap__(self, obj, context=None, return_scalar=False):
        if isinstance(obj, numpy.ndarray) and obj.ndim == 0 and \
                return_scalar:
            return obj[()]
        return obj.view(numpy.ndarray) if isinstance(obj, KeyConstant) \
            else obj

    def __reduce__(self):
        return self.view(numpy.ndarray).__reduce__()


def made(rec, out):
    """The maker's result ``out`` (a constant of the key) as user code
    gets it: a KeyConstant, noted in ``rec.shape_made``."""
    kc = out.view(KeyConstant)
    rec.shape_made[id(kc)] = kc
    return kc
