"""Arrays a node defined outside Chainer left on itself, as its backward
sees them while that backward records (user_nodes.py)."""
import numpy

from static_graph import traced


class HeldArray(traced.TracedArray):
    """An array a node defined outside Chainer left on itself
    (``self.mask = x > 0``), as its backward sees it while that records:
    any use of it in Python there (a value read, or an array computed from
    it, whose values may be read next: ``(self.x > 4).any()``) makes that
    backward run again at every replay (``flag``, ``_used``); what is
    computed from it is a plain array, as from the array itself."""

    held_by_node = True     # (traced.flag: a read of it is the node's)

    def _used(self):
        rec = traced.active_recording()
        if rec is not None and rec.reading_held is not None:
            rec.held_reads.add(id(rec.reading_held))

    def __getitem__(self, key):
        self._used()
        return numpy.ndarray.__getitem__(traced.plain(self), key)

    def __array_wrap__(self, obj, context=None, return_scalar=False):
        self._used()
        return numpy.asarray(obj)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        self._used()
        return getattr(ufunc, method)(*[traced.untraced(x) for x in inputs],
                                      **traced.plain_kwargs(kwargs))

    def __array_function__(self, func, types, args, kwargs):
        self._used()
        return func(*traced.plain_all(args), **traced.plain_kwargs(kwargs))

    def astype(self, *args, **kwargs):
        self._used()
        return numpy.ndarray.astype(traced.plain(self), *args, **kwargs)

    def copy(self, order='C'):
        self._used()
        return numpy.ndarray.copy(traced.plain(self), order)
