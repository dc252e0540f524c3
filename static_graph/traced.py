"""Catch user code that reads array values while a call is recorded.

Replay does not run the user's Python, so anything the method computes from
array *values* outside Chainer functions (``if x.sum() > 0``, ``float(...)``,
``x / 255`` in NumPy) would be frozen at its recorded value. While recording,
raw input arrays and arrays read through ``Variable.array``/``.data`` from
user code are handed out as ``TracedArray`` views: reading their values
(``bool``, ``float``, ``int``, ``item``, ``tolist``, ...) records a fallback
reason, and NumPy results computed from them stay traced so the recorder can
tell them from true constants when they reach a Chainer function. Writing
into one in place (``h.array[:, 0] = 0``, ``x *= 2``) records a reason too:
replay would not repeat the write (the recorder also compares what it
handed out with a snapshot, for writes these hooks cannot see).
"""
import os
import sys

import numpy

import chainer

_CHAINER_DIR = os.path.dirname(chainer.__file__) + os.sep
_OWN_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_NUMPY_DIR = os.path.dirname(numpy.__file__) + os.sep
INTERNAL_DIRS = (_CHAINER_DIR, _OWN_DIR, _NUMPY_DIR)

# The active recording of this thread is published here by the recorder.
_active = None   # set to a threading.local by recorder


def user_frame(depth=2):
    """The innermost frame outside Chainer, NumPy and this package."""
    f = sys._getframe(depth)
    while f is not None and f.f_code.co_filename.startswith(INTERNAL_DIRS):
        f = f.f_back
    return f


def user_location(depth=2):
    f = user_frame(depth + 1)
    if f is None:
        return None
    return '%s:%d' % (f.f_code.co_filename, f.f_lineno)


def _flag(what):
    rec = getattr(_active, 'recording', None) if _active is not None else None
    if rec is not None:
        rec.add_reason('user code reads array values (%s) at %s; replay '
                       'would freeze them' % (what, user_location(2)))


def _flag_write(array, what):
    rec = getattr(_active, 'recording', None) if _active is not None else None
    if rec is not None and rec.is_recorded(array):
        rec.add_reason('user code writes into an array in place (%s) at %s; '
                       'replay would not repeat the write'
                       % (what, user_location(2)))


def _in_place(name, symbol):
    op = getattr(numpy.ndarray, name)

    def method(self, other):
        _flag_write(self, symbol)
        return op(self, other)

    method.__name__ = name
    return method


class TracedArray(numpy.ndarray):
    """An ndarray view whose value reads are reported to the recording."""

    def __setitem__(self, key, value):
        _flag_write(self, '[...] =')
        numpy.ndarray.__setitem__(self, key, value)

    for _name, _symbol in (
            ('__iadd__', '+='), ('__isub__', '-='), ('__imul__', '*='),
            ('__itruediv__', '/='), ('__ifloordiv__', '//='),
            ('__imod__', '%='), ('__ipow__', '**='), ('__imatmul__', '@='),
            ('__iand__', '&='), ('__ior__', '|='), ('__ixor__', '^='),
            ('__ilshift__', '<<='), ('__irshift__', '>>=')):
        locals()[_name] = _in_place(_name, _symbol)
    del _name, _symbol

    def __array_wrap__(self, obj, context=None, return_scalar=False):
        # Keep 0-d results as traced arrays so `x.sum() > 0` stays traced.
        if not isinstance(obj, numpy.ndarray):
            obj = numpy.asarray(obj)
        return obj.view(TracedArray)

    def __bool__(self):
        _flag('bool()')
        return bool(self.view(numpy.ndarray))

    def __float__(self):
        _flag('float()')
        return float(self.view(numpy.ndarray))

    def __int__(self):
        _flag('int()')
        return int(self.view(numpy.ndarray))

    def __index__(self):
        _flag('index')
        return self.view(numpy.ndarray).__index__()

    def __complex__(self):
        _flag('complex()')
        return complex(self.view(numpy.ndarray))

    def item(self, *args):
        _flag('.item()')
        return self.view(numpy.ndarray).item(*args)

    def tolist(self):
        _flag('.tolist()')
        return self.view(numpy.ndarray).tolist()

    def __iter__(self):
        if self.ndim == 1:
            _flag('iteration')
        return super(TracedArray, self).__iter__()

    def tobytes(self, *args, **kwargs):
        _flag('.tobytes()')
        return numpy.ndarray.tobytes(self, *args, **kwargs)

    def view(self, *args, **kwargs):
        out = numpy.ndarray.view(self, *args, **kwargs)
        if type(out) is numpy.ndarray and not sys._getframe(
                1).f_code.co_filename.startswith(INTERNAL_DIRS):
            # A plain view handed to user code: what it does with the
            # values can no longer be seen.
            _flag('.view(numpy.ndarray)')
        return out

    def __array_function__(self, func, types, args, kwargs):
        # NumPy functions on traced arrays give traced results (a copy
        # made by numpy.copy stays traced); a plain number or bool computed
        # from them (numpy.array_equal, numpy.allclose) is a value read.
        result = numpy.ndarray.__array_function__(self, func, types, args,
                                                  kwargs)
        if isinstance(result, (bool, int, float, complex)):
            _flag('numpy.%s()' % func.__name__)
            return result
        return retrace(result)


def retrace(result):
    """Plain ndarrays (and NumPy scalars) in a result, as TracedArrays."""
    if type(result) is numpy.ndarray:
        return result.view(TracedArray)
    if isinstance(result, numpy.generic):
        return numpy.asarray(result).view(TracedArray)
    if type(result) in (tuple, list):
        return type(result)(retrace(r) for r in result)
    return result


def plain(array):
    """The plain ndarray view of a TracedArray."""
    return array.view(numpy.ndarray)


def untraced(array):
    """``array`` itself, or its plain view if it is a TracedArray."""
    return plain(array) if isinstance(array, TracedArray) else array
