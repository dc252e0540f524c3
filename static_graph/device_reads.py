"""Catch user code that reads, writes or computes CuPy array values while
recording.

NumPy arrays handed to user code are traced (``traced.TracedArray``): their
value reads are seen, and what NumPy computes from them stays traced. CuPy
arrays are not, so on the GPU this module does two things while a recording
is active:

* ``cupy.ndarray``'s value reads (``bool``, ``float``, ``int``, ``item``,
  ``tolist``, ``get``: so ``cupy.asnumpy`` and ``to_cpu`` too) and in-place
  writes are patched: one made by user code in the forward pass, at the
  call's own level (not inside a Chainer function), records a fallback
  reason. Reads by Chainer's or this package's code are not user reads.
* A CuPy memory hook notes the memory user code allocates in the forward
  pass, outside Chainer functions (``allocation_hook``): an array there that
  reaches a Chainer function was computed with CuPy during the call
  (``x / 255``, ``x.sum()``, ``x > 0`` as ``F.where``'s condition), so
  replay would freeze it, whatever its values. Arrays ``cupy.zeros``,
  ``ones``, ``empty``, ``full`` (a number as fill value), their ``_like``
  forms, and ``cupy.array``/``asarray`` of host data make are constants,
  taken as on NumPy (a uniform one replays).

This is coarser than NumPy's tracing: any CuPy array user code reads counts,
not only those computed from the data, and an array user code computes from
constants (``xp.ones(n) * 0.5``) counts as computed (a false alarm costs a
fallback, never a wrong result).
"""
import numbers
import sys

import numpy

from static_graph import traced

_READS = (('__bool__', 'bool()'), ('__float__', 'float()'),
          ('__int__', 'int()'), ('__index__', 'index'),
          ('__complex__', 'complex()'), ('item', '.item()'),
          ('tolist', '.tolist()'),
          ('get', '.get(): cupy.asnumpy, to_cpu'))
_WRITES = (('__setitem__', '[...] ='), ('__iadd__', '+='),
           ('__isub__', '-='), ('__imul__', '*='), ('__itruediv__', '/='),
           ('__ifloordiv__', '//='), ('__imod__', '%='), ('__ipow__', '**='),
           ('__imatmul__', '@='), ('__iand__', '&='), ('__ior__', '|='),
           ('__ixor__', '^='), ('__ilshift__', '<<='),
           ('__irshift__', '>>='), ('fill', '.fill()'), ('put', '.put()'))


def _user_call(rec):
    """Is the running read a user read of the forward pass? Frames of CuPy,
    NumPy and Chainer are looked through (``cupy.asnumpy(x)``,
    ``cuda.to_cpu(x)`` called by user code); a read from this package's
    own code is not one."""
    if rec.depth or rec.phase != 'forward':
        return False
    f = sys._getframe(2)
    while f is not None and f.f_code.co_filename.startswith(
            traced.LIBRARY_DIRS):
        f = f.f_back
    return f is not None and not f.f_code.co_filename.startswith(
        traced.OWN_DIR)


def _read(orig, what):
    def method(self, *args, **kwargs):
        rec = traced.active_recording()
        if rec is not None and _user_call(rec):
            traced.flag(what)
        return orig(self, *args, **kwargs)

    method.__name__ = orig.__name__
    method.__doc__ = orig.__doc__
    return method


def _write(orig, what):
    def method(self, *args, **kwargs):
        rec = traced.active_recording()
        if rec is not None and _user_call(rec) and (
                rec.is_recorded(self) or not rec.computed_on_device(self)):
            # into a recorded array, or one that was there before the call
            # (an array a link holds, a global): not into a scratch array
            # the method made
            traced.flag_write(rec, what)
        return orig(self, *args, **kwargs)

    method.__name__ = orig.__name__
    method.__doc__ = orig.__doc__
    return method


def computed_reason(kind, where):
    return ('an array computed with CuPy outside Chainer functions enters %s '
            'at %s; replay would freeze it (use Chainer functions instead)'
            % (kind, where))


def patches(missing):
    """``(cupy.ndarray, {name: patched}, {name: original or missing})``
    for patches.install, or None without CuPy."""
    cupy = traced.cupy_module()
    if cupy is None:
        return None
    cls = cupy.ndarray
    patched, orig = {}, {}
    for names, wrap in ((_READS, _read), (_WRITES, _write)):
        for name, what in names:
            fn = getattr(cls, name, None)
            if fn is None:
                continue
            patched[name] = wrap(fn, what)
            orig[name] = vars(cls).get(name, missing)
    return cls, patched, orig


# Constructors whose result depends on shapes, numbers and host data only
# (host data computed from device values went through a flagged read):
# name -> does this call make a constant? (args, kwargs)
def _number_fill(args, kwargs):
    fill = kwargs.get('fill_value', args[1] if len(args) > 1 else None)
    return isinstance(fill, (numbers.Number, numpy.generic))


def _host_source(args, kwargs):
    return _host(args[0] if args else kwargs.get('obj', kwargs.get('a')))


def _host(v, depth=3):
    """Numbers, or NumPy arrays not computed from traced values, nested in
    lists and tuples up to ``depth`` levels."""
    if isinstance(v, (numbers.Number, numpy.generic)):
        return True
    if isinstance(v, numpy.ndarray):
        return not isinstance(v, traced.TracedArray)
    if isinstance(v, (list, tuple)) and depth:
        return all(_host(x, depth - 1) for x in v)
    return False


def numbers_only(args, kwargs):
    """Are a maker's arguments Python values alone (numbers, dtypes,
    strings, tuples of them), no arrays? Its result then follows from
    them: the same at every call of a key."""
    return all(_plain(v) for v in args) and \
        all(_plain(v) for v in kwargs.values())


def _plain(v, depth=2):
    if isinstance(v, (numbers.Number, numpy.generic, str, type(None),
                      numpy.dtype, type)):
        return True
    if isinstance(v, (list, tuple)) and depth:
        return all(_plain(x, depth - 1) for x in v)
    return False


# Makers whose result, from Python values alone, is a constant of the key
# even where its elements differ (``xp.arange(n)`` as a position index):
# noted in ``rec.shape_made`` (NumPy's too, recorder.py).
SHAPE_MAKERS = ('arange', 'linspace', 'logspace', 'eye', 'identity', 'tri',
                'indices')

_CONSTANT_MAKERS = dict({
    'zeros': None, 'ones': None, 'empty': None, 'zeros_like': None,
    'ones_like': None, 'empty_like': None, 'full': _number_fill,
    'full_like': _number_fill, 'array': _host_source,
    'asarray': _host_source}, **dict((n, numbers_only) for n in SHAPE_MAKERS))


def memory_of(a):
    """The pointer of the allocation ``a``'s memory lies in (0: none)."""
    mem = getattr(a.data, 'mem', None)
    return getattr(mem, 'ptr', 0) if mem is not None else 0


def _constant_maker(orig, makes_constant):
    def maker(*args, **kwargs):
        out = orig(*args, **kwargs)
        rec = traced.active_recording()
        if rec is not None and not rec.depth and (
                makes_constant is None or makes_constant(args, kwargs)):
            rec.user_made.discard(memory_of(out))
            if makes_constant is numbers_only:
                rec.shape_made[id(out)] = out
        return out

    maker.__name__ = orig.__name__
    maker.__doc__ = orig.__doc__
    return maker


def constant_patches():
    """``(cupy's namespace, {name: patched}, {name: original})``: the
    constructors above, whose results are constants; None without CuPy."""
    cupy = traced.cupy_module()
    if cupy is None:
        return None
    ns = vars(cupy)
    orig = dict((n, ns[n]) for n in _CONSTANT_MAKERS if n in ns)
    return ns, dict((n, _constant_maker(f, _CONSTANT_MAKERS[n]))
                    for n, f in orig.items()), orig


def allocation_hook(rec):
    """A CuPy memory hook that adds to ``rec.user_made`` the memory
    allocated by user code in the forward pass (outside Chainer functions),
    or None without CuPy. Enter it for the recording's duration."""
    cupy = traced.cupy_module()
    if cupy is None:
        return None
    global _Allocations
    if _Allocations is None:
        class _Allocations(cupy.cuda.MemoryHook):
            name = 'static_graph'

            def __init__(self, rec):
                self.rec = rec

            def malloc_postprocess(self, device_id, size, mem_size,
                                   mem_ptr, pmem_id):
                rec = self.rec
                if not rec.depth and rec.phase == 'forward':
                    rec.user_made.add(mem_ptr)
                else:   # memory a freed user array had, now Chainer's
                    rec.user_made.discard(mem_ptr)
    return _Allocations(rec)


_Allocations = None
