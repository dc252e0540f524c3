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


def cupy_module():
    """CuPy, where Chainer found it importable; else None."""
    cuda = getattr(chainer.backends, 'cuda', None)
    if cuda is None or not getattr(cuda, 'available', False):
        return None
    return cuda.cupy


def _dir_of(module):
    return os.path.dirname(module.__file__) + os.sep


OWN_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
# Library code user code calls (its frames are looked through to find the
# user's line): Chainer, NumPy, and CuPy where it is there.
LIBRARY_DIRS = tuple(_dir_of(m) for m in (chainer, numpy, cupy_module())
                     if m is not None)
INTERNAL_DIRS = LIBRARY_DIRS + (OWN_DIR,)

# The active recording of this thread is published here by patches.begin.
_active = None   # the threading.local of patches.py (set_active)
# numpy_calls.compute: a NumPy call on traced arrays as an op of the
# recording (set by numpy_calls, which imports this module).
calls = None


def set_active(local):
    """Where the thread's recording is found: ``local.recording``."""
    global _active
    _active = local


def active_recording():
    return getattr(_active, 'recording', None) if _active is not None \
        else None


_internal_files = {}   # file name -> is it in INTERNAL_DIRS?


def internal_file(name):
    """Is file ``name`` in INTERNAL_DIRS? (Remembered per name.)"""
    inside = _internal_files.get(name)
    if inside is None:
        if len(_internal_files) > 4096:     # (files made on the fly)
            _internal_files.clear()
        inside = _internal_files[name] = name.startswith(INTERNAL_DIRS)
    return inside


def user_frame(depth=2):
    """The innermost frame outside Chainer, NumPy, CuPy and this package."""
    f = sys._getframe(depth)
    internal = _internal_files
    while f is not None:
        name = f.f_code.co_filename
        inside = internal.get(name)
        if inside is None:
            inside = internal_file(name)
        if not inside:
            break
        f = f.f_back
    return f


def user_location(depth=2):
    f = user_frame(depth + 1)
    if f is None:
        return None
    return '%s:%d' % (f.f_code.co_filename, f.f_lineno)


def flag(what):
    rec = active_recording()
    if rec is not None:
        rec.add_reason('user code reads array values (%s) at %s; replay '
                       'would freeze them' % (what, user_location(2)))


def _flag_write(array, what):
    rec = active_recording()
    if rec is not None and rec.is_recorded(array):
        flag_write(rec, what)


def flag_write(rec, what):
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

    def __getitem__(self, key):
        if _has_traced_mask(key):
            flag('indexing with a boolean mask (the result\'s shape '
                  'depends on the values)')
        out = numpy.ndarray.__getitem__(self, key)
        if not isinstance(out, numpy.ndarray):
            flag('reading an element, x[i, j]')
        return out

    # Methods whose result's shape depends on the values.
    def nonzero(self):
        flag('.nonzero()')
        return numpy.ndarray.nonzero(self)

    def compress(self, *args, **kwargs):
        flag('.compress()')
        return numpy.ndarray.compress(self, *args, **kwargs)

    for _name, _symbol in (
            ('__iadd__', '+='), ('__isub__', '-='), ('__imul__', '*='),
            ('__itruediv__', '/='), ('__ifloordiv__', '//='),
            ('__imod__', '%='), ('__ipow__', '**='), ('__imatmul__', '@='),
            ('__iand__', '&='), ('__ior__', '|='), ('__ixor__', '^='),
            ('__ilshift__', '<<='), ('__irshift__', '>>=')):
        locals()[_name] = _in_place(_name, _symbol)
    del _name, _symbol

    def __array_wrap__(self, obj, context=None, return_scalar=False):
        if not isinstance(obj, numpy.ndarray):
            obj = numpy.asarray(obj)
        if obj.ndim == 0 and self.ndim > 0:
            # A reduction to one number (x.sum(), numpy.sum(t >= 0)): a
            # value read. Handed back as the NumPy scalar define-by-run
            # gets, so this call computes what it would (Chainer takes
            # ``v / n`` by a scalar another way than by an array).
            flag('a reduction to one value, x.sum()')
            return obj[()]
        return obj.view(TracedArray)

    def __bool__(self):
        flag('bool()')
        return bool(self.view(numpy.ndarray))

    def __float__(self):
        flag('float()')
        return float(self.view(numpy.ndarray))

    def __int__(self):
        flag('int()')
        return int(self.view(numpy.ndarray))

    def __index__(self):
        flag('index')
        return self.view(numpy.ndarray).__index__()

    def __complex__(self):
        flag('complex()')
        return complex(self.view(numpy.ndarray))

    def item(self, *args):
        flag('.item()')
        return self.view(numpy.ndarray).item(*args)

    def tolist(self):
        flag('.tolist()')
        return self.view(numpy.ndarray).tolist()

    def __iter__(self):
        if self.ndim == 1:
            flag('iteration')
        return super(TracedArray, self).__iter__()

    def tobytes(self, *args, **kwargs):
        flag('.tobytes()')
        return numpy.ndarray.tobytes(self, *args, **kwargs)

    def view(self, *args, **kwargs):
        out = numpy.ndarray.view(self, *args, **kwargs)
        if type(out) is numpy.ndarray and not sys._getframe(
                1).f_code.co_filename.startswith(INTERNAL_DIRS):
            # A plain view handed to user code: what it does with the
            # values can no longer be seen.
            flag('.view(numpy.ndarray)')
        return out

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        # A ufunc making new arrays from traced ones, while a forward
        # records: an op of the recording (numpy_calls), its results
        # traced. Otherwise as ndarray's (results traced by
        # __array_wrap__; in-place forms flagged by the operators).
        rec = active_recording()
        if rec is None or calls is None or method == 'at' or \
                'out' in kwargs:
            return _ufunc_as_before(ufunc, method, inputs, kwargs)
        fn = ufunc if method == '__call__' else getattr(ufunc, method)
        result = fn(*[untraced(x) for x in inputs], **kwargs)
        made = calls(rec, fn, '%s%s' % (
            ufunc.__name__, '' if method == '__call__' else '.' + method),
            inputs, kwargs, result)
        if made is not None:
            return made
        return _wrap(_first_traced(inputs), result)

    def astype(self, dtype, order='K', casting='unsafe', subok=True,
               copy=True):
        rec = active_recording()
        if rec is not None and calls is not None:
            result = numpy.ndarray.astype(plain(self), dtype, order, casting,
                                          subok, copy)
            made = calls(rec, _astype, 'astype', (self, dtype),
                         {'order': order, 'casting': casting}, result)
            if made is not None:
                return made
        return numpy.ndarray.astype(self, dtype, order, casting, subok, copy)

    def copy(self, order='C'):
        rec = active_recording()
        if rec is not None and calls is not None:
            result = numpy.ndarray.copy(plain(self), order)
            made = calls(rec, numpy.ndarray.copy, 'copy', (self, order), {},
                         result)
            if made is not None:
                return made
        return numpy.ndarray.copy(self, order)

    def __array_function__(self, func, types, args, kwargs):
        # NumPy functions on traced arrays give traced results (a copy
        # made by numpy.copy stays traced); a plain number or bool computed
        # from them (numpy.array_equal, numpy.allclose) is a value read.
        # While a forward records, a result in new memory is an op of the
        # recording (numpy_calls).
        by_values = _shape_from_values(func.__name__, args, kwargs)
        if by_values:
            flag('numpy.%s() (its result\'s shape depends on the values)'
                  % func.__name__)
        result = numpy.ndarray.__array_function__(self, func, types, args,
                                                  kwargs)
        if isinstance(result, (bool, int, float, complex, numpy.generic)):
            flag('numpy.%s()' % func.__name__)
            return result
        rec = active_recording()
        if rec is not None and calls is not None and not by_values:
            made = calls(rec, func, func.__name__, args, kwargs,
                         _plain_result(result))
            if made is not None:
                return made
        return retrace(result)


def _ufunc_as_before(ufunc, method, inputs, kwargs):
    """A ufunc on traced arrays as NumPy's default for a subclass runs
    it: on the plain arrays, results handed to ``__array_wrap__`` of the
    first traced input (traced; a reduction to one value flagged), an
    ``out=`` given back as passed."""
    wrapper = _first_traced(inputs + tuple(kwargs.get('out') or ()))
    out = kwargs.get('out')
    if out is not None:
        kwargs = dict(kwargs)
        kwargs['out'] = tuple(untraced(o) for o in out)
    result = getattr(ufunc, method)(*[untraced(x) for x in inputs],
                                    **kwargs)
    if method == 'at':
        return result
    if out is not None:
        return out[0] if len(out) == 1 else tuple(out)
    return _wrap(wrapper, result)


def _first_traced(arrays):
    return next(x for x in arrays if isinstance(x, TracedArray))


def _wrap(wrapper, result):
    """A ufunc's result(s) through ``wrapper.__array_wrap__``."""
    if type(result) is tuple:
        return tuple(wrapper.__array_wrap__(numpy.asarray(r))
                     for r in result)
    return wrapper.__array_wrap__(numpy.asarray(result))


def _astype(a, dtype, order='K', casting='unsafe'):
    """``a.astype(dtype)`` as a copy (numpy_calls records it only where
    NumPy made one)."""
    return a.astype(dtype, order=order, casting=casting)


def _plain_result(result):
    if isinstance(result, TracedArray):
        return plain(result)
    if type(result) in (tuple, list):
        return tuple(_plain_result(r) for r in result)
    return result


# NumPy functions whose result's shape depends on the values of some of
# their arguments: name -> (positions, keywords) of those arguments.
_VALUE_SHAPED = {
    'nonzero': ((0,), ('a',)), 'argwhere': ((0,), ('a',)),
    'flatnonzero': ((0,), ('a',)), 'unique': ((0,), ('ar',)),
    'extract': ((0,), ('condition',)), 'compress': ((0,), ('condition',)),
    'bincount': ((0, 1), ('x', 'weights', 'minlength')),
    'trim_zeros': ((0,), ('filt',)),
    'setdiff1d': ((0, 1), ('ar1', 'ar2')),
    'intersect1d': ((0, 1), ('ar1', 'ar2')),
    'union1d': ((0, 1), ('ar1', 'ar2')),
    'setxor1d': ((0, 1), ('ar1', 'ar2')),
    'delete': ((1,), ('obj',)), 'insert': ((1,), ('obj',)),
    'repeat': ((1,), ('repeats',)),
}


def _shape_from_values(name, args, kwargs):
    if name == 'where':   # numpy.where(condition): numpy.nonzero
        return len(args) + len(kwargs) == 1
    spec = _VALUE_SHAPED.get(name)
    if spec is None:
        return False
    positions, keywords = spec
    return any(isinstance(args[i], TracedArray) for i in positions
               if i < len(args)) or any(
        isinstance(kwargs.get(k), TracedArray) for k in keywords)


def _has_traced_mask(key):
    keys = key if type(key) is tuple else (key,)
    return any(isinstance(k, TracedArray) and k.dtype == numpy.bool_
               for k in keys)


def retrace(result):
    """Plain ndarrays in a result, as TracedArrays (NumPy scalars are
    values read, flagged by the caller)."""
    if type(result) is numpy.ndarray:
        return result.view(TracedArray)
    if type(result) in (tuple, list):
        return type(result)(retrace(r) for r in result)
    return result


def plain(array):
    """The plain ndarray view of a TracedArray."""
    return array.view(numpy.ndarray)


def untraced(array):
    """``array`` itself, or its plain view if it is a TracedArray."""
    return plain(array) if isinstance(array, TracedArray) else array
