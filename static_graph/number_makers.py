"""NumPy's other makers of arrays from Python numbers, whose results user
code gets as ``KeyConstant``s while a call records (key_constants.py),
as it gets those of ``numpy.eye``, ``arange`` or ``zeros``.

Their results follow from numbers alone, so they are constants of the key;
indexed by the labels (``numpy.mgrid[0:h, 0:w][0][cy, cx]``), a plain
array would give a copy of the recording's labels that nothing sees,
which a node built with it (``F.get_item``'s index, ``F.where``'s
condition) would keep at every replay (vision31 hunt: YOLO-style cell
indices through ``numpy.mgrid``, ``ogrid``, ``r_``, ``fromfunction``).
Here:

* the windows (``numpy.hanning`` and its kin) and ``numpy.geomspace``, of
  numbers; ``numpy.fromiter`` of a range;
* ``numpy.fromfunction``: its function gets the index grids as
  KeyConstants (what it computes from them with the data is seen; from
  them alone, a constant; with other arrays, what NumPy gives);
* ``numpy.mgrid``, ``ogrid``, ``r_`` and ``c_`` indexed with numbers and
  slices of numbers.

Not ``numpy.array`` of a list of numbers (a literal table), nor
``fromiter`` of one: a list's numbers may come from where the recording
does not look (state deep in a helper object, a global read through a
helper's method, ``.tolist()`` of an array it does not trace, an
attribute a node of the user's set from the data), and such an array,
non-uniform, falls back where it enters a Chainer function; as a
constant of the key it would replay with the recording's values
(review36).

What patches.py installs: ``ORIGINAL`` and ``PATCHED``, by name in
NumPy's namespace.
"""
import sys

import numpy

from static_graph import device_reads
from static_graph import key_constants
from static_graph import traced

_NUMBER = (int, float, complex, numpy.generic)


def _of_a_range(args, kwargs):
    it = args[0] if args else kwargs.get('iter')
    rest = dict((k, v) for k, v in kwargs.items() if k != 'iter')
    return isinstance(it, range) and \
        device_reads.numbers_only(args[1:], rest)


def _fromfunction(orig):
    indices = key_constants.maker(numpy.indices, device_reads.numbers_only,
                                  depth=2)

    def fromfunction(function, shape, **kwargs):
        if kwargs.get('like') is not None or not callable(function):
            return orig(function, shape, **kwargs)
        dtype = kwargs.pop('dtype', float)
        # (numpy.fromfunction's own two lines, with the grids of user code)
        return function(*indices(shape, dtype=dtype), **kwargs)

    fromfunction.__name__ = orig.__name__
    fromfunction.__doc__ = orig.__doc__
    return fromfunction


def _number_key(key):
    """Is an index of numbers and slices of numbers (and ``r_``'s
    directives, strings)?"""
    if type(key) is tuple:
        return all(_number_key(k) for k in key)
    if type(key) is slice:
        return all(v is None or isinstance(v, _NUMBER) and
                   not isinstance(v, numpy.ndarray)
                   for v in (key.start, key.stop, key.step))
    return isinstance(key, (str,) + _NUMBER) and \
        not isinstance(key, numpy.ndarray)


class _Grid(object):
    """``numpy.mgrid`` (``ogrid``, ``r_``, ``c_``) while a call records: an
    index of numbers gives KeyConstants; anything else, what it gives."""

    def __init__(self, orig):
        self._orig = orig

    def __getitem__(self, key):
        out = self._orig[key]
        rec = traced.active_recording()
        if rec is None or rec.depth or not _number_key(key):
            return out
        return key_constants.made(rec, out, sys._getframe(1))

    def __len__(self):
        return len(self._orig)

    def __getattr__(self, name):
        if name == '_orig':
            raise AttributeError(name)
        return getattr(self._orig, name)


ORIGINAL = {}
PATCHED = {}
for _name in ('bartlett', 'blackman', 'hamming', 'hanning', 'kaiser',
              'geomspace', 'fromiter', 'fromfunction', 'mgrid', 'ogrid',
              'r_', 'c_'):
    _orig = ORIGINAL[_name] = getattr(numpy, _name)
    if _name == 'fromfunction':
        PATCHED[_name] = _fromfunction(_orig)
    elif _name.endswith(('grid', '_')):
        PATCHED[_name] = _Grid(_orig)
    else:
        PATCHED[_name] = key_constants.maker(
            _orig, _of_a_range if _name == 'fromiter' else
            device_reads.numbers_only)
del _name, _orig
