"""Arrays user code makes from Python numbers while a call records, handed
to it as ``KeyConstant`` so that what it computes from them with the data
is seen.

``numpy.eye(n)``, ``numpy.arange(n)``, ``numpy.zeros(shape)`` and the like,
made from numbers alone, are constants of the key (``rec.shape_made``): the
same at every call. But indexing a plain array with a traced one runs in
NumPy's C code, which never asks the index: ``numpy.eye(k, dtype=bool)[t]``
(a one-hot mask of the labels, CosFace's target mask), ``numpy.arange(k)
[::-1][t]`` would give an array that looks like one more constant, and a
node built with it (``F.where``'s condition, ``F.get_item``'s index) would
keep the recording's labels at every replay. So while a call records,
those makers hand user code a ``KeyConstant``, a ``TracedArray`` whose
values are no secret (reading them is no reason to fall back: they are the
key's) and on which:

* indexing with a traced array is an op of the recording (numpy_calls), its
  result traced: a node built with it reads every call's labels;
* NumPy's ufuncs and functions with a traced operand are the traced
  array's (an op; the constant its input); with constants and numbers
  alone, their result is a new constant; with a plain array of unknown
  origin, a plain array (as before: it falls back where it meets a
  Chainer function, unless uniform);
* a write into it of traced values, or at traced positions, is a reason:
  replay would not repeat it; one of a plain array's values makes it an
  array of unknown origin (``demote``), as does handing out its memory
  (``.flat``, ``.view(numpy.ndarray)``, ``.data``, ``__array__()``...),
  through which it could be written unseen;
* a change of its values after an op took it (a buffer refilled with
  other constants between two uses) is a reason (``check_taken``):
  replay would give each op its last values.

What enters a Chainer function is its plain array (recorder.untrace).
Outside a recording it is a plain array.
"""
import sys

import numpy

from static_graph import arrayutil
from static_graph import numpy_rules
from static_graph import traced

TracedArray = traced.TracedArray
_ndarray = numpy.ndarray


def _flat(x):
    if type(x) in (tuple, list):
        for v in x:
            yield from _flat(v)
    elif type(x) is dict:
        for v in x.values():
            yield from _flat(v)
    else:
        yield x


def _kind(x, rec):
    """'traced' where ``x`` (arrays in tuples, lists, a dict's values) holds
    a traced array that is no constant of ``rec``, else 'plain' where it
    holds an array of unknown origin (not a 0-d one: a number), else
    'const'."""
    kind = 'const'
    for v in _flat(x):
        if isinstance(v, TracedArray):
            if type(v) is not KeyConstant or not live(rec, v):
                return 'traced'
        elif isinstance(v, _ndarray) and v.ndim:
            kind = 'plain'
    return kind


def live(rec, c):
    """Is KeyConstant ``c`` a constant of ``rec`` (its memory one
    ``rec.shape_made`` holds, not demoted)?"""
    return rec is not None and id(arrayutil.root_of(c)) in rec.shape_made


def constant(rec, out):
    """``out`` (a result computed from constants alone) as a KeyConstant of
    ``rec``; NumPy scalars and other results as they are."""
    if type(out) is _ndarray:
        # (alive: its id stays its own; its root too, new memory NumPy may
        # hand out as a view of it: numpy.tile's reshape)
        rec.shape_made[id(out)] = out
        root = arrayutil.root_of(out)
        rec.shape_made[id(root)] = root
        if id(root) not in rec.made_values:
            rec.made_values[id(root)] = (root, root.copy())
        return rec.trace(out, check=False, kind=KeyConstant)
    if type(out) in (tuple, list):
        return type(out)(constant(rec, o) for o in out)
    return out


def _view(rec, out):
    """A view of a constant: a constant (its root is one)."""
    if isinstance(out, _ndarray):
        return rec.trace(traced.untraced(out), check=False, kind=KeyConstant)
    if type(out) in (tuple, list):
        return type(out)(_view(rec, o) for o in out)
    return out


def _active():
    rec = traced.active_recording()
    return rec if rec is not None and not rec.depth else None


def unseen(rec, *arrays):
    """Were the constants among ``arrays`` written where no hook sees
    (``rec.made_values``: their memory's values when made, while no seen
    write changed them)? C code filling one (scipy.ndimage's output, the
    ``numpy.zeros`` it allocates or one the method hands it as
    ``output=``; cv31 hunt: a blurred batch replayed frozen) leaves values
    of the data: such a constant is demoted (``demote``)."""
    for c in arrays:
        if type(c) is KeyConstant:
            root = arrayutil.root_of(c)
            made = rec.made_values.get(id(root))
            if made is not None and arrayutil.changed(made[1], made[0]):
                del rec.made_values[id(root)]
                demote(rec, c)


def _written(rec, c):
    """A write into constant ``c`` the hooks see: from then on its
    values are not checked against the ones made (unseen)."""
    unseen(rec, c)
    rec.made_values.pop(id(arrayutil.root_of(c)), None)


def entering(rec, a, plain, kind):
    """KeyConstant ``a`` (``plain``, its plain array) enters ``kind`` (a
    Chainer function, as an input or the node's attribute): its values as
    the op takes them, to tell whether they change later (check_taken); a
    demoted one of values not all equal is a reason (a node keeps an
    attribute as it is, unchecked)."""
    unseen(rec, a)
    if id(plain) not in rec.constants_taken:
        rec.constants_taken[id(plain)] = (plain, plain.copy())
    if not live(rec, a) and not arrayutil.uniform(plain):
        rec.add_reason(
            'an array the method made holds values of unknown origin '
            '(written through its memory, .flat or a plain view, by code '
            'no hook sees, or from an array not produced by a Chainer '
            'function) and enters %s at '
            '%s; replay would freeze them' % (kind, traced.user_location(4)))


def _writing(c, what, values):
    """``values`` written into constant ``c`` (or at positions they give):
    the data's are a reason, replay would not repeat the write; ones of
    unknown origin make ``c`` such an array (``demote``)."""
    rec = _active()
    if rec is not None:
        _written(rec, c)
        kind = _kind(values, rec)
        if kind == 'traced':
            traced.data_written(what)
        elif kind == 'plain':
            demote(rec, c)


def _handed_out(c):
    """``c``'s memory handed to the code that called the method calling
    this (a plain view, ``.data``, ``.base``): to user code, ``c`` is
    demoted, as it may be written through that unseen. Returns the
    recording where it was."""
    rec = _active()
    if rec is not None and traced.reads_as_user(
            sys._getframe(2).f_code.co_filename):
        demote(rec, c)
        return rec
    return None


def demote(rec, c):
    """``c``'s memory holds, or may come to hold through a way no hook
    sees, values of unknown origin: no constant of ``rec`` any more (an op
    that takes it is checked as any array of unknown origin)."""
    rec.shape_made.pop(id(arrayutil.root_of(c)), None)


def check_taken(rec, when='after an op of the call took it (a buffer '
                'written again between two uses)'):
    """Did a constant change after an op took it (``rec.constants_taken``:
    {id: (array, its values then)})? Replay would give each op that took
    it its last values. Checked after the forward, and again after the
    recorded backward (the caller wrote into one the method returned)."""
    for a, before in rec.constants_taken.values():
        if arrayutil.changed(before, a):
            rec.add_reason(
                'an array the method made changes %s; replay would give '
                'every op that took it its last values' % when)
            rec.constants_taken = {}
            return


def _read(name):
    """ndarray's ``name`` on the plain array: a read of the constant's own
    values, which are the key's (no reason; one demoted, a read of values
    of unknown origin)."""
    op = getattr(_ndarray, name)

    def method(self, *args, **kwargs):
        rec = _active()
        if rec is not None:
            unseen(rec, self)
            if not live(rec, self):
                traced.flag(name)
        return op(traced.plain(self), *args, **kwargs)

    method.__name__ = name
    return method


def _escape(name, prop=False):
    """ndarray's ``name``, which hands out the memory itself (``.data``,
    ``.flat``, a plain view): from user code, the constant is demoted, as
    it may be written through that unseen."""
    op = getattr(_ndarray, name)
    if prop:
        op = op.__get__

    def method(self, *args, **kwargs):
        _handed_out(self)
        return op(traced.plain(self), *args, **kwargs)

    method.__name__ = name
    return property(method) if prop else method


class KeyConstant(TracedArray):
    """An array made from numbers alone while a call records (module
    docstring)."""

    key_constant = True     # (traced.has_traced_mask: no data mask)

    def __getitem__(self, key):
        rec = _active()
        if rec is not None:
            unseen(rec, self, *_flat(key))
        kind = _kind((self, key), rec) if rec is not None else None
        plain = traced.plain(self)
        if kind == 'traced' and traced.has_traced_mask(key):
            traced.flag('indexing with a boolean mask (the result\'s shape '
                        'depends on the values)')
        out = _ndarray.__getitem__(plain, traced.plain_all(key))
        if kind is None or not isinstance(out, _ndarray):
            if kind == 'traced':
                traced.flag('reading an element at a position from the '
                            'data')
            return out
        if kind == 'const':
            return _view(rec, out) if numpy.may_share_memory(out, plain) \
                else constant(rec, out)
        if kind == 'plain':
            return out
        made = traced.calls(rec, traced.getitem, 'getitem', (self, key), {},
                            out)
        if made is None:
            traced.flag('indexing with an array from the data')
            return out.view(TracedArray)
        return made

    def __setitem__(self, key, value):
        _writing(self, '[...] =', (self, key, value))
        _ndarray.__setitem__(traced.plain(self), traced.plain_all(key),
                             traced.untraced(value))

    def __array_wrap__(self, obj, context=None, return_scalar=False):
        # (NumPy's C methods hand their result here: ``c.squeeze(0)``, a
        # view, is a constant too; new memory, of unknown origin.)
        if isinstance(obj, _ndarray) and obj.ndim == 0 and \
                (return_scalar or context is not None):
            return obj[()]
        if not isinstance(obj, _ndarray):
            return obj
        obj = obj.view(_ndarray)
        rec = _active()
        if rec is not None and numpy.may_share_memory(obj, self):
            return _view(rec, obj)
        return obj

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        rec = _active()
        out = kwargs.get('out') or ()
        into = out + (inputs[:1] if method == 'at' else ())
        if rec is not None:
            unseen(rec, *_flat(inputs + (kwargs.get('where'),)))
            for o in into:
                if type(o) is KeyConstant:
                    _written(rec, o)
        kind = _kind(inputs + (kwargs.get('where'),), rec) \
            if rec is not None else None
        if kind == 'traced':
            if any(type(o) is KeyConstant for o in into):
                traced.data_written('numpy.%s' % ufunc.__name__)
            first = next(x for x in _flat(inputs + (kwargs.get('where'),))
                         if isinstance(x, TracedArray) and
                         _kind(x, rec) == 'traced')
            return TracedArray.__array_ufunc__(first, ufunc, method,
                                               *inputs, **kwargs)
        if kind == 'plain':
            for o in into:
                if type(o) is KeyConstant:
                    demote(rec, o)
        result = getattr(ufunc, method)(
            *[traced.untraced(x) for x in inputs],
            **traced.plain_kwargs(kwargs))
        if method == 'at':
            return result
        if out:
            return out[0] if len(out) == 1 else tuple(out)
        return constant(rec, result) if kind == 'const' else result

    def __array_function__(self, func, types, args, kwargs):
        rec = _active()
        # (the constants it writes into: out=, an INTO function's target)
        into = [kwargs.get('out')]
        if func.__name__ in numpy_rules.INTO:
            into += list(args[:1]) + [
                kwargs.get(numpy_rules.INTO[func.__name__])]
        into = [o for o in _flat(into) if type(o) is KeyConstant]
        if rec is not None:
            unseen(rec, *_flat((args, kwargs)))
            for o in into:
                _written(rec, o)
        kind = _kind((args, kwargs), rec) if rec is not None else None
        if kind == 'traced':
            first = next(x for x in _flat((args, kwargs))
                         if isinstance(x, TracedArray) and
                         _kind(x, rec) == 'traced')
            # (which sees an ``out``, by name or by position, and the
            # functions that write into an argument: traced.py)
            return TracedArray.__array_function__(first, func, types, args,
                                                  kwargs)
        result = func(*traced.plain_all(args), **traced.plain_kwargs(kwargs))
        if kind is None:
            return traced.plain_all(result)
        if kind == 'plain':
            # (written into, or handed out as a plain view)
            for a in into + [a for a in _flat(args)
                             if type(a) is KeyConstant and _shares(result, a)]:
                demote(rec, a)
            return traced.plain_all(result)
        result = traced.plain_all(result)
        if any(_shares(result, traced.untraced(a)) for a in _flat(args)
               if isinstance(a, _ndarray)):
            return _view(rec, result)
        return constant(rec, result)

    def astype(self, dtype, order='K', casting='unsafe', subok=True,
               copy=True):
        rec = _active()
        if rec is not None:
            unseen(rec, self)
        if rec is not None and not live(rec, self):
            return TracedArray.astype(self, dtype, order, casting, subok,
                                      copy)
        plain = traced.plain(self)
        out = _ndarray.astype(plain, dtype, order, casting, subok, copy)
        if rec is None:
            return out
        return _view(rec, out) if numpy.may_share_memory(out, plain) else \
            constant(rec, out)

    def copy(self, order='C'):
        rec = _active()
        if rec is not None:
            unseen(rec, self)
        if rec is not None and not live(rec, self):
            return TracedArray.copy(self, order)
        out = _ndarray.copy(traced.plain(self), order)
        return constant(rec, out) if rec is not None else out

    def _writes(what):
        op = getattr(_ndarray, what)

        def method(self, *args, **kwargs):
            _writing(self, '.%s()' % what, (args, kwargs))
            return op(traced.plain(self), *traced.plain_all(args),
                      **traced.plain_kwargs(kwargs))

        method.__name__ = what
        return method

    # ndarray methods that write their arguments into it in C, seen by no
    # ufunc or NumPy function
    for _name in ('put', 'fill', 'itemset', 'setfield', 'resize'):
        if hasattr(_ndarray, _name):
            locals()[_name] = _writes(_name)
    # Reads of its values (TracedArray's are reasons)
    for _name in ('__bool__', '__float__', '__int__', '__index__',
                  '__complex__', 'item', 'tolist', 'tobytes',
                  '__str__', '__repr__', '__format__', 'dumps', 'dump',
                  'tofile', 'tostring'):
        if hasattr(_ndarray, _name):
            locals()[_name] = _read(_name)
    # Its memory handed out: writes through it would be unseen
    for _name in ('__array__', '__dlpack__', '__buffer__'):
        if hasattr(_ndarray, _name):
            locals()[_name] = _escape(_name)
    for _name in ('data', 'ctypes', '__array_interface__'):
        locals()[_name] = _escape(_name, prop=True)
    del _name, _writes

    def _set(name, view):
        """A property whose setting (``c.flat = 1.0``, ``c.real = x``)
        writes into it; its getter ``view``."""
        put = getattr(_ndarray, name).__set__

        def setter(self, value):
            _writing(self, '.%s =' % name, value)
            put(traced.plain(self), traced.untraced(value))

        return property(view, setter)

    flat = _set('flat', _escape('flat', prop=True).fget)
    real = _set('real', TracedArray.real.fget)
    imag = _set('imag', TracedArray.imag.fget)
    del _set

    @property
    def base(self):
        rec = _handed_out(self)
        dbr = rec.as_define_by_run(self) if rec is not None else None
        # (from user code: the base define-by-run's array has)
        return dbr.base if dbr is not None else _ndarray.base.__get__(self)

    def __iter__(self):
        rec = _active()
        if rec is not None:
            unseen(rec, self)
        if rec is None or self.ndim < 2 or not live(rec, self):
            return _read('__iter__')(self)
        return iter([_view(rec, row) for row in
                     _ndarray.__iter__(traced.plain(self))])

    def view(self, *args, **kwargs):
        out = _ndarray.view(self, *args, **kwargs)
        if type(out) is not KeyConstant:
            _handed_out(self)
        return out

    @property
    def flags(self):
        return _ndarray.flags.__get__(self)

    def __reduce__(self):
        return traced.plain(self).__reduce__()

    def __reduce_ex__(self, protocol):
        return traced.plain(self).__reduce_ex__(protocol)


def _shares(result, a):
    """Does ``result`` (arrays in tuples, lists) share memory with ``a``?"""
    if a is None:
        return False
    a = traced.untraced(a)
    return any(isinstance(o, _ndarray) and numpy.may_share_memory(
        traced.untraced(o), a) for o in _flat(result))


def _makes_constants(rec, frame):
    """Does code at ``frame`` (a maker's caller) get KeyConstants: code
    whose reads are the method's (``traced.reads_as_user``: the project's,
    an installed package's, chainer.distributions'), not while it runs to
    import a module inside the call (``import scipy.stats`` in the method:
    its module-level tables are no constants of the call, and would stay
    KeyConstants in the module; augment30 hunt)?"""
    if not traced.reads_as_user(frame.f_code.co_filename):
        return False
    stop = rec.call_frame     # (an id: a frame on the stack, alive)
    while frame is not None and id(frame) != stop:
        if frame.f_code.co_filename.startswith('<frozen importlib'):
            return False
        frame = frame.f_back
    return True


def maker(orig, numbers_only, depth=1):
    """NumPy's ``orig`` (``numpy.eye``, ``numpy.zeros``): its result, made
    by user code from Python numbers alone while a forward records (not
    at an import: _makes_constants), a KeyConstant (and a constant of the
    key, ``rec.shape_made``); a tuple of them (``numpy.triu_indices``)
    likewise. ``depth``: how many frames up from the returned function its
    caller is (2 where another wrapper calls it for user code)."""
    def make(*args, **kwargs):
        out = orig(*args, **kwargs)
        rec = traced.active_recording()
        if rec is None or rec.depth or not numbers_only(args, kwargs):
            return out
        return made(rec, out, sys._getframe(depth))

    make.__name__ = orig.__name__
    make.__doc__ = orig.__doc__
    return make


def made(rec, out, frame):
    """``out``, made from Python numbers alone by the code at ``frame``
    while ``rec`` records (outside any Chainer function): a KeyConstant
    (or a tuple or list of them) where that code gets them
    (_makes_constants), else as it is, noted a constant of the key."""
    if not (type(out) is _ndarray or type(out) in (tuple, list) and out and
            all(type(o) is _ndarray for o in out)):
        return out
    if rec.phase != 'forward' or not _makes_constants(rec, frame):
        for o in out if type(out) is not _ndarray else (out,):
            rec.shape_made[id(o)] = o
        return out
    return constant(rec, out)
