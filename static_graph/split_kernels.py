"""Large element-wise kernels that write in place, split across threads.

A kernel of lowering.DONATING that computes each element of its result
from the same element of its operands (ReLU, ReLUGrad2, Add of two arrays
of one shape) and writes it into one of them gives the same bits run on
slices: each thread takes a contiguous range along one axis of every
operand (views, whatever their memory layout), NumPy's loops release the
GIL, and the result is the input it wrote into, as unsplit. Whether a
kernel splits is measured per kernel (``schedules.parallel.SplitChoice``:
split and whole alternate over its first calls, the faster is kept and
measured again every few hundred calls), because another process may hold
the other core, or BLAS threads spin on it (``blas_idle``).

Used by ``lowering.propose`` for ops of at least MIN_ELEMENTS elements
where ``@static_graph(threads=...)`` allows more than one thread.
"""
import numpy

from schedules import parallel
from schedules import stream
from static_graph import blas_idle

MIN_ELEMENTS = 1 << 17
SPLITTABLE = frozenset(('ReLU', 'ReLUGrad2', 'Add'))


def threads_of(threads):
    """The threads a schedule may use: the option, or the cores."""
    return parallel.default_threads() if threads is None else int(threads)


def split(kernel, kind, in_arrays, threads):
    """``kernel`` (an in-place element-wise kernel of ``kind`` over
    ``in_arrays`` as recorded), run across ``threads`` threads where that
    is possible and may pay; else ``kernel`` itself."""
    if kernel is None or kind not in SPLITTABLE:
        return kernel
    threads = threads_of(threads)
    if threads < 2:
        return kernel
    shape = in_arrays[kernel.aliases[0]].shape
    if any(type(a) is not numpy.ndarray or a.shape != shape
           for a in in_arrays) or numpy.prod(shape) < MIN_ELEMENTS:
        return kernel
    axis = next((i for i, n in enumerate(shape) if n >= threads), None)
    if axis is None:
        return kernel
    return _Split(kernel, kernel.aliases[0], axis, shape[axis], threads)


class _Split(object):
    """The kernel, split along ``axis`` into ``threads`` contiguous
    ranges where its measured choice says so (``parallel.Ranges``)."""

    def __init__(self, kernel, alias, axis, n, threads):
        self.kernel = kernel
        self.aliases = kernel.aliases
        self.workspace = getattr(kernel, 'workspace', None)
        self.__name__ = getattr(kernel, '__name__', 'kernel') + \
            '_split%d' % threads
        self.alias = alias
        self.lead = (slice(None),) * axis
        self.ranges = parallel.Ranges(threads, n)

    @property
    def choice(self):
        return self.ranges.choice

    def __call__(self, a):
        kernel, lead = self.kernel, self.lead

        def part(lo, hi):
            s = lead + (slice(lo, hi),)
            kernel([x[s] for x in a])
        self.ranges(part)
        return (a[self.alias],)


# Kernels whose time is almost all in one BLAS call (the GIL let go), run
# two at a time where neighbours in a schedule are independent (a Linear's
# input and weight gradients; LSTM's input and recurrent products).
PAIRABLE = frozenset((
    'LinearFunction', 'LinearGradData', 'LinearGradWeight',
    'Convolution2DFunction', 'Convolution2DGradW',
    'Deconvolution2DFunction'))


def _products_side_by_side(threads):
    """May products run two at a time? With two threads allowed, and only
    where NumPy's BLAS runs a product on one thread
    (``OPENBLAS_NUM_THREADS=1``): a BLAS that takes every core for each
    product leaves nothing to a second one, two such products at once
    oversubscribe the cores (the measured choice would keep them apart,
    but its probes cost the first iterations), and OpenBLAS's results
    depend on its thread count."""
    return threads_of(threads) >= 2 and blas_idle.numpy_blas_threads() == 1


def pairing(threads):
    """The executor's ``pair`` for a schedule of ``threads`` (None: none
    run at the same time; ``_products_side_by_side``)."""
    if not _products_side_by_side(threads):
        return None

    native = not isinstance(stream.available(), str)

    def pair(a, b):
        if a.kind in PAIRABLE and b.kind in PAIRABLE and all(
                getattr(op.fn, '__name__', '').startswith('numpy_')
                for op in (a, b)):
            if native and getattr(a.fn, 'stream_task', None) is not None:
                # the first on the C worker: no GIL to hand back and forth
                return stream.Pair(threads_of(threads))
            return parallel.Pair(threads_of(threads))
        return None
    return pair


# Ops that may start work on the stream (schedules/stream.py): products
# whose result only the schedule's outputs need (a weight's gradient; the
# gradient of recurrent state an earlier call gets), and the sums that
# follow them (a gradient held from earlier calls added).
STREAM_HEADS = frozenset(('LinearGradWeight', 'LinearGradData'))
STREAM_FOLLOWS = frozenset(('Add',))


def streaming(threads):
    """The executor's ``stream`` for a schedule of ``threads`` (None: no
    op leaves the calling thread; ``_products_side_by_side``, and only
    where the C worker runs)."""
    if not _products_side_by_side(threads) or \
            isinstance(stream.available(), str):
        return None

    def role(op):
        if getattr(op.fn, 'stream_task', None) is None:
            return None
        if op.kind in STREAM_HEADS:
            return 'head'
        if op.kind in STREAM_FOLLOWS:
            return 'follow'
        return None
    role.threads = threads_of(threads)
    return role
