"""Catch user code that reads array values while a call is recorded.

Replay does not run the user's Python, so anything the method computes from
array *values* outside Chainer functions (``if x.sum() > 0``, ``float(...)``,
``x / 255`` in NumPy) would be frozen at its recorded value. While recording,
raw input arrays and arrays read through ``Variable.array``/``.data`` from
user code are handed out as ``TracedArray`` views: reading their values
(``bool``, ``float``, ``int``, ``item``, ``tolist``, a NumPy function or a
method such as ``argmax()`` that returns a number, ``.flat``, the memory
behind ``.data``, pickling, ...) records a fallback
reason, and NumPy results computed from them stay traced so the recorder can
tell them from true constants when they reach a Chainer function. Writing
into one in place (``h.array[:, 0] = 0``, ``x *= 2``) records a reason too:
replay would not repeat the write (the recorder also compares what it
handed out with a snapshot, for writes these hooks cannot see).
"""
import sys

import numpy

from static_graph import numpy_rules
from static_graph.user_code import (  # NOQA  (re-exported)
    CHAINER_DIR, INTERNAL_DIRS, LIBRARY_DIRS, OWN_DIR, USER_LIKE,
    cupy_module, internal_file, read_reason, reads_as_user, user_frame,
    user_location)


# The active recording of this thread is published here by patches.begin.
_active = None   # the threading.local of patches.py (set_active)
# numpy_calls.compute: a NumPy call on traced arrays as an op of the
# recording (set by numpy_calls, which imports this module).
calls = None
# numpy_calls.scalar_views: marks a view that stands for a NumPy scalar.
scalar_views = None


def set_active(local):
    """Where the thread's recording is found: ``local.recording``."""
    global _active
    _active = local


def active_recording():
    return getattr(_active, 'recording', None) if _active is not None \
        else None


def flag(what):
    rec = active_recording()
    if rec is not None:
        if rec.reading_held is not None and getattr(
                type(sys._getframe(1).f_locals.get('self')),
                'held_by_node', False):
            # A user node's backward reads an array its forward left on
            # it: that backward runs again at every replay (user_nodes).
            rec.held_reads.add(id(rec.reading_held))
            return
        rec.add_reason(read_reason(what, 3))


def _flag_write(array, what):
    rec = active_recording()
    if rec is not None and rec.is_recorded(array):
        flag_write(rec, what)


def flag_write(rec, what):
    rec.add_reason('user code writes into an array in place (%s) at %s; '
                   'replay would not repeat the write'
                   % (what, user_location(2)))


def data_written(what):
    """User code writes the data into an array it made from numbers
    (key_constants.py): a reason."""
    rec = active_recording()
    if rec is not None:
        rec.add_reason(
            'user code writes values computed from the data, or at '
            'positions taken from it, into an array it made (%s) at %s; '
            'replay would not repeat the write' % (what, user_location(2)))


def _in_place(name, symbol):
    op = getattr(numpy.ndarray, name)

    def method(self, *args, **kwargs):
        _flag_write(self, symbol)
        return op(self, *args, **kwargs)

    method.__name__ = name
    return method


def _read_of(name, what):
    """ndarray's method ``name``, a read of the values (``what``)."""
    op = getattr(numpy.ndarray, name)

    def method(self, *args, **kwargs):
        flag(what)
        return op(self.view(numpy.ndarray), *args, **kwargs)

    method.__name__ = name
    return method


def _scalar_view_method(name, attribute=False):
    """ndarray's method (or attribute) ``name``, whose result stands for a
    NumPy scalar where ``self`` does and the same on a NumPy scalar gives
    one (scalar_views)."""
    get = getattr(numpy.ndarray, name)
    if attribute:
        get = get.__get__

    def method(self, *args, **kwargs):
        out = get(self, *args, **kwargs)
        rec = active_recording()
        if rec is not None and rec.scalar_like and scalar_views is not None:
            scalar_views(rec, (lambda a: getattr(a, name)) if attribute
                         else (lambda a, *r, **k: getattr(a, name)(*r, **k)),
                         (self,) + args, kwargs, out)
        return out

    method.__name__ = name
    return method


def _as_function(name):
    """The ndarray method ``name`` as NumPy's function of that name."""
    fn = getattr(numpy, name)

    def method(self, *args, **kwargs):
        return fn(self, *args, **kwargs)

    method.__name__ = name
    return method


class TracedArray(numpy.ndarray):
    """An ndarray view whose value reads are reported to the recording."""

    def __setitem__(self, key, value):
        if not numpy_rules.onto_itself(self, key, value):
            _flag_write(self, '[...] =')
        numpy.ndarray.__setitem__(self, key, value)

    def __getitem__(self, key):
        if has_traced_mask(key):
            flag('indexing with a boolean mask (the result\'s shape '
                  'depends on the values)')
        out = numpy.ndarray.__getitem__(self, key)
        if not isinstance(out, numpy.ndarray):
            flag('reading an element, x[i, j]')
        elif calls is not None and not _may_share(out, self):
            # A copy (indexed by an array: ``self.table[t]``, a link's
            # array by the labels; ``x[[0, 2]]``): an op of the recording,
            # so a node built with it reads every call's.
            rec = active_recording()
            if rec is not None:
                made = calls(rec, getitem, 'getitem', (self, key), {},
                             plain(out))
                if made is not None:
                    return made
        return out

    for _name, _symbol in (
            ('__iadd__', '+='), ('__isub__', '-='), ('__imul__', '*='),
            ('__itruediv__', '/='), ('__ifloordiv__', '//='),
            ('__imod__', '%='), ('__ipow__', '**='), ('__imatmul__', '@='),
            ('__iand__', '&='), ('__ior__', '|='), ('__ixor__', '^='),
            ('__ilshift__', '<<='), ('__irshift__', '>>='),
            # (methods that write in C: the arrays of watched containers
            # are traced without a copy to compare, review35)
            ('put', '.put()'), ('fill', '.fill()'), ('itemset', '.itemset()'),
            ('setfield', '.setfield()'), ('sort', '.sort()'),
            ('partition', '.partition()'), ('resize', '.resize()')):
        if hasattr(numpy.ndarray, _name):
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
            ufunc = getattr(context[0], '__name__', None) \
                if context else None
            flag('a reduction to one value%s' % (
                ', of numpy.%s' % ufunc if ufunc else
                ': x.sum(), x.all(), x.max(), ...'))
            return obj[()]
        return obj.view(TracedArray)

    def __round__(self, ndigits=None):
        # (An ndarray has no round(); the NumPy scalar a 0-d array stands
        # for while recording has: round(s, 3) is numpy.round, an op;
        # round(s), a Python int, a value read.)
        rec = active_recording()
        if rec is None or id(self) not in rec.scalar_like:
            raise TypeError("type numpy.ndarray doesn't define __round__ "
                            'method')
        if ndigits is None:
            flag('round()')
            return round(plain(self)[()])
        return numpy.round(self, ndigits)

    # Reads of the values through ndarray's own methods (of the plain
    # view: NumPy's, with no hook of this class in between)
    for _name, _what in (
            ('__bool__', 'bool()'), ('__float__', 'float()'),
            ('__int__', 'int()'), ('__index__', 'index'),
            ('__complex__', 'complex()'), ('item', '.item()'),
            ('tolist', '.tolist()'), ('tobytes', '.tobytes()'),
            ('__dlpack__', '__dlpack__()'), ('dumps', '.dumps()'),
            ('dump', '.dump()'), ('tofile', '.tofile()'),
            ('tostring', '.tostring()'),        # (gone in NumPy 2)
            ('__reduce_ex__', 'pickling'), ('__reduce__', 'pickling')):
        if hasattr(numpy.ndarray, _name):
            locals()[_name] = _read_of(_name, _what)
    del _name, _what

    def __iter__(self):
        if self.ndim == 1:
            flag('iteration')
        return super(TracedArray, self).__iter__()


    def view(self, *args, **kwargs):
        out = numpy.ndarray.view(self, *args, **kwargs)
        if type(out) is not TracedArray and not sys._getframe(
                1).f_code.co_filename.startswith(INTERNAL_DIRS):
            # A plain view (or one of another subclass: numpy.matrix, a
            # record array) handed to user code: what it does with the
            # values can no longer be seen.
            flag('.view(%s)' % type(out).__name__)
        return out

    # Text of the values: str(), repr() and formats of a 0-d array go
    # through no NumPy function (float(str(loss.array))).
    def __str__(self):
        if _from_user(1):
            flag('str()')
        return numpy.ndarray.__str__(self.view(numpy.ndarray))

    def __repr__(self):
        if _from_user(1):
            flag('repr()')
        return numpy.ndarray.__repr__(self.view(numpy.ndarray))

    def __format__(self, spec):
        if _from_user(1):
            flag('format()')
        return numpy.ndarray.__format__(self.view(numpy.ndarray), spec)


    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        # A ufunc making new arrays from traced ones, while a forward
        # records: an op of the recording (numpy_calls), its results
        # traced. Otherwise as ndarray's (results traced by
        # __array_wrap__; in-place forms flagged by the operators).
        rec = active_recording()
        if rec is not None:
            _check_destinations(
                (kwargs.get('out') or ()) + (
                    inputs[:1] if method == 'at' else ()),
                '%s(out=...)' % ufunc.__name__)
        if rec is None or calls is None or method == 'at' or \
                'out' in kwargs:
            return _ufunc_as_before(ufunc, method, inputs, kwargs)
        fn = ufunc if method == '__call__' else getattr(ufunc, method)
        try:
            result = fn(*[untraced(x) for x in inputs],
                        **plain_kwargs(kwargs))
        except Exception as e:     # (numpy.errstate(over='raise'))
            flag('%s raised %s' % (ufunc.__name__, type(e).__name__))
            raise
        made = calls(rec, fn, '%s%s' % (
            ufunc.__name__, '' if method == '__call__' else '.' + method),
            inputs, kwargs, result)
        if made is not None:
            return made
        # (A traced operand, or only a traced where= mask: W.sum(where=m))
        return _wrap(_first_traced(tuple(inputs) + (kwargs.get('where'),)),
                     result)

    def astype(self, dtype, order='K', casting='unsafe', subok=True,
               copy=True):
        rec = active_recording()
        if rec is not None and calls is not None:
            p = plain(self)
            result = numpy.ndarray.astype(p, dtype, order, casting, subok,
                                          copy)
            if result is p and subok:
                # No copy (``copy=False``, its dtype already): itself, as
                # NumPy hands it back (Chainer's ``x + a`` casts ``a``).
                return self
            made = calls(rec, _astype, 'astype', (self, dtype),
                         {'order': order, 'casting': casting}, result)
            if made is not None:
                return made
        return numpy.ndarray.astype(self, dtype, order, casting, subok, copy)

    def copy(self, order='C'):
        rec = active_recording()
        if rec is not None and calls is not None:
            result = numpy.ndarray.copy(plain(self), order)
            made = calls(rec, _copy, 'copy', (self, order), {}, result)
            if made is not None:
                return made
        return numpy.ndarray.copy(self, order)

    def __array_function__(self, func, types, args, kwargs):
        # NumPy functions on traced arrays give traced results (a copy
        # made by numpy.copy stays traced); a plain number or bool computed
        # from them (numpy.array_equal, numpy.allclose) is a value read.
        # While a forward records, a result in new memory is an op of the
        # recording (numpy_calls). The function runs on the plain arrays:
        # NumPy's own code inside it (numpy.percentile's checks, the
        # in-place steps of numpy.sort or numpy.zeros_like) is neither
        # reads nor writes of the user's; the call is one op or one read.
        name = func.__name__
        by_values = numpy_rules.shape_from_values(name, args, kwargs,
                                                  TracedArray)
        if by_values:
            flag('numpy.%s() (its result\'s shape depends on the values)'
                 % name)
        into = kwargs.get('out') if name not in numpy_rules.INTO else (
            args[0] if args else kwargs.get(numpy_rules.INTO[name]))
        _check_destinations(into, 'numpy.%s()' % name)
        plain_args = plain_all(args)
        try:
            result = func(*plain_args, **plain_kwargs(kwargs))
        except Exception as e:
            # Whether it raises can depend on the values
            # (numpy.linalg.cholesky): a method that catches it would take
            # that branch at every replay.
            flag('numpy.%s() raised %s' % (name, type(e).__name__))
            raise
        if into is None and type(args) is tuple:
            # ``out`` given by position (numpy.clip(t, 0, 2, buf),
            # numpy.dot(a, b, buf)): the very array it returns
            outs = result if type(result) is tuple else (result,)
            _check_destinations(tuple(
                a for a, p in zip(args[1:], plain_args[1:])
                if isinstance(p, numpy.ndarray) and
                any(o is p for o in outs)), 'numpy.%s()' % name)
        if name not in numpy_rules.SHAPE_ONLY and \
                numpy_rules.holds_values(result) or \
                isinstance(result, numpy.dtype) and _zero_d_traced(args):
            # (a dtype of a 0-d array: value-based casting, NumPy 1)
            flag('numpy.%s()' % name)
            return result
        read = numpy_rules.by_values(name, func, args)
        if read is not None:
            flag(read)
            return result
        rec = active_recording()
        if rec is not None and calls is not None and not by_values:
            made = calls(rec, func, name, args, kwargs, result)
            if made is not None:
                return made
        out = retrace(result)
        if rec is not None and rec.scalar_like and scalar_views is not None:
            # (numpy.squeeze(s) of a NumPy scalar: a NumPy scalar)
            scalar_views(rec, func, args, kwargs, out)
        return out

    # ndarray methods that compute in C without a ufunc, whose result may
    # be one number (``h.array.argmax()``, ``a[0].dot(a[1])``): NumPy's
    # functions of the same name, which the method above sees (the same
    # C code, so the same bits; an array result an op where it may be one,
    # a number a value read). ``mean``, ``std`` and ``var`` divide their
    # sum in place, which would be a write into a traced array.
    # (``repeat``, ``nonzero`` and ``compress`` give a result whose shape
    # may follow the values: the functions' check, numpy_rules. ``ravel``
    # of a transposed array copies, in C.)
    for _name in ('argmax', 'argmin', 'argsort', 'round', 'searchsorted',
                  'take', 'dot', 'mean', 'std', 'var', 'repeat', 'nonzero',
                  'ravel'):
        locals()[_name] = _as_function(_name)
    del _name

    # Views that give a NumPy scalar of a NumPy scalar (``s.T``,
    # ``s.reshape(())``): of a 0-d array that stands for one while
    # recording (numpy_calls.compute), one that stands for one too.
    for _name in ('reshape', 'transpose', 'squeeze', 'conj', 'conjugate',
                  'swapaxes'):
        locals()[_name] = _scalar_view_method(_name)
    for _name in ('T', 'real', 'imag'):
        locals()[_name] = property(_scalar_view_method(_name, True))
    del _name

    def compress(self, condition, *args, **kwargs):
        # (NumPy's function takes the condition first)
        return numpy.compress(condition, self, *args, **kwargs)

    # Ways to the values that no NumPy function or ufunc sees: element
    # reads through ``.flat``, the memory behind ``.data`` and ``.ctypes``
    # (and, from Python 3.12, the buffer protocol: ``memoryview(a)``,
    # ``numpy.frombuffer(a)``), a plain array from ``__array__()``, the
    # bytes of ``tostring``, ``dumps`` and pickling.
    @property
    def flat(self):
        flag('.flat')
        return numpy.ndarray.flat.__get__(self)

    @flat.setter
    def flat(self, value):
        _flag_write(self, '.flat =')
        numpy.ndarray.flat.__set__(self, value)

    @property
    def data(self):
        if _from_user(1):
            flag('.data, its memory')
        return numpy.ndarray.data.__get__(self)

    @property
    def base(self):
        # (A traced array is a view: its base is the plain array behind it,
        # whose values no read of would be seen. User code gets the base
        # define-by-run's array has, where the recording knows it.)
        if _from_user(1):
            flag('.base, the array behind it')
            dbr = _define_by_run_array(self)
            if dbr is not None:
                return dbr.base
        return numpy.ndarray.base.__get__(self)

    @property
    def flags(self):
        # (``owndata`` differs from define-by-run's array's, and of the
        # flags only the layout is part of the key: a branch on the others
        # is a read.)
        if _from_user(1):
            dbr = _define_by_run_array(self)
            return numpy_rules.LayoutFlags(numpy.ndarray.flags.__get__(
                self if dbr is None else dbr), flag)
        return numpy.ndarray.flags.__get__(self)

    @property
    def ctypes(self):
        if _from_user(1):
            flag('.ctypes, its memory')
        return numpy.ndarray.ctypes.__get__(self)

    @property
    def __array_interface__(self):
        if _from_user(1):
            flag('__array_interface__, its memory')
        return numpy.ndarray.__array_interface__.__get__(self)

    def __array__(self, *args, **kwargs):
        if _from_user(1):
            flag('__array__()')
        return numpy.ndarray.__array__(self, *args, **kwargs)

    if sys.version_info >= (3, 12):
        def __buffer__(self, flags):
            flag('its memory, through the buffer protocol')
            return memoryview(self.view(numpy.ndarray))


def _check_destinations(into, what):
    """The arrays NumPy call ``what`` writes into (``into``: an ``out=``
    argument, a destination, a tuple of them): values of traced arrays
    written into one the recording does not trace (``out=`` a plain
    array, ``numpy.copyto(buf, h.array)``) are read unseen next; a write
    into a traced one (``numpy.clip(a, -1, 1, out=a)``,
    ``numpy.minimum.at(a, i, 0)``) is one replay would not repeat, which
    the recording's check of values misses where it changed nothing this
    call."""
    for o in into if type(into) in (tuple, list) else (into,):
        if getattr(o, 'key_constant', False):
            # (An array the method made from numbers: key_constants.py)
            data_written(what)
        elif isinstance(o, TracedArray):
            _flag_write(o, what)
        elif isinstance(o, numpy.ndarray):
            flag('%s, which writes them into an untraced array' % what)


def _zero_d_traced(args):
    return any(isinstance(a, TracedArray) and a.ndim == 0 for a in args)


def _define_by_run_array(view):
    rec = active_recording()
    return None if rec is None else rec.as_define_by_run(view)


def _from_user(depth):
    """Is the caller ``depth`` frames up user code (``reads_as_user``)?"""
    return reads_as_user(sys._getframe(depth + 1).f_code.co_filename)


def holds_traced(x):
    """Does ``x`` (a tuple or list, at any depth) hold a TracedArray?"""
    if isinstance(x, TracedArray):
        return True
    if type(x) in (tuple, list):
        return any(holds_traced(v) for v in x)
    return False


def plain_all(x):
    """``x`` with the TracedArrays in it, in tuples and lists at any depth,
    as their plain views."""
    if isinstance(x, TracedArray):
        return plain(x)
    if type(x) in (tuple, list):
        return type(x)(plain_all(v) for v in x)
    return x


def _ufunc_as_before(ufunc, method, inputs, kwargs):
    """A ufunc on traced arrays as NumPy's default for a subclass runs
    it: on the plain arrays, results handed to ``__array_wrap__`` of the
    first traced input (traced; a reduction to one value flagged), an
    ``out=`` given back as passed."""
    wrapper = _first_traced(inputs + tuple(kwargs.get('out') or ()) + (
        kwargs.get('where'),))
    out = kwargs.get('out')
    result = getattr(ufunc, method)(*[untraced(x) for x in inputs],
                                    **plain_kwargs(kwargs))
    if method == 'at':
        return result
    if out is not None:
        return out[0] if len(out) == 1 else tuple(out)
    return _wrap(wrapper, result)


def plain_kwargs(kwargs):
    """Keyword arguments with TracedArrays (an ``out=``, a mask given as
    ``where=``) as their plain views: else NumPy hands the call back to
    ``TracedArray``."""
    return dict((k, plain_all(v)) for k, v in kwargs.items())


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


def _copy(a, order='C'):
    """``a.copy(order)``: as ``_astype``, a call that NumPy's scalars take
    too (numpy_calls tells by it whether the copy of one is one)."""
    return a.copy(order)


def _may_share(a, b):
    return numpy.may_share_memory(a.view(numpy.ndarray),
                                  b.view(numpy.ndarray))


def getitem(a, key):
    """``a[key]``: indexing as a NumPy call of a recording (numpy_calls)."""
    return a[key]


def has_traced_mask(key):
    keys = key if type(key) is tuple else (key,)
    return any(isinstance(k, TracedArray) and k.dtype == numpy.bool_ and
               not getattr(k, 'key_constant', False) for k in keys)


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
