"""A stand-in for CUDA graphs on NumPy, for tests on machines without a GPU.

``FakeBackend`` gives ``schedules.cuda_graph`` what CuPy gives it, with the
property of a graph that matters to the code around it: a launch writes its
results into the arrays the capture returned (the graph's memory), and
reads its arguments from the arrays it was captured with. A launch re-runs
the compiled schedule and copies each result into the captured one, so
anything that kept a captured result sees the next launch's values, as with
a real graph.

Like the real capture, the fake refuses a schedule that draws random
numbers (here from NumPy's global generator), and ``refuse`` makes it
refuse anything, to test the fallback. What it cannot show is a real
graph's freezing of host-side work: it runs the Python again at every
launch.
"""
import warnings

import numpy

from schedules import bits
from schedules import cuda_graph


class FakeGraph(object):
    def __init__(self, run, inputs, outputs):
        self.run = run
        self.inputs = inputs
        self.outputs = outputs
        self.launches = 0

    def launch(self):
        self.launches += 1
        for o, r in zip(self.outputs, self.run(self.inputs)):
            if not isinstance(o, numpy.ndarray):
                # A host value, which a graph hands out as captured: the
                # capture's premise is that it is the same at every call.
                # (On NumPy one can follow from the data without a
                # synchronization to refuse it, say softmax_cross_entropy's
                # normalizer with ignored labels: an error here, not a
                # wrong result; on CuPy it is a device array.)
                assert o == r, 'a host value changed: %r, then %r' % (o, r)
            elif r is not o:
                numpy.copyto(o, r)


def _copyto(dst, src):
    if not isinstance(dst, numpy.ndarray):
        return     # a scalar is a value: nothing to write into
    numpy.copyto(dst, src)


class FakeBackend(object):
    copyto = staticmethod(_copyto)
    serves = staticmethod(numpy.copyto)    # entries on NumPy

    def __init__(self, refuse=None):
        self.refuse = refuse      # a reason: every capture raises it
        self.graphs = []

    @staticmethod
    def is_array(a):
        # NumPy scalars too: on NumPy, state such as SoftmaxCrossEntropy's
        # normalizer is one, where CuPy has a 0-d device array.
        return isinstance(a, (numpy.ndarray, numpy.generic))

    @staticmethod
    def empty_like(a):
        return numpy.empty_like(a)

    @staticmethod
    def copy(a):
        return a if isinstance(a, numpy.generic) else a.copy(order='K')

    @staticmethod
    def same(a, b):
        return a.shape == b.shape and a.dtype == b.dtype and \
            bits.same_bits(numpy.asarray(a), numpy.asarray(b),
                           numpy.array_equal)

    def same_many(self, pairs):
        return [self.same(a, b) for a, b in pairs]

    def capture(self, run, inputs):
        if self.refuse:
            raise cuda_graph.NotCapturable(self.refuse)
        rng = numpy.random.get_state()
        outputs = run(inputs)
        drew = any(not numpy.array_equal(a, b) if isinstance(a, numpy.ndarray)
                   else a != b for a, b in zip(rng, numpy.random.get_state()))
        if drew:
            numpy.random.set_state(rng)
            raise cuda_graph.NotCapturable(
                'it draws random numbers from NumPy (the fake capture)')
        # A number among the results (SoftmaxCrossEntropy's normalizer: a
        # NumPy scalar, or a float where every label is ignored; on CuPy a
        # 0-d device array) becomes a 0-d array: memory a launch can write.
        outputs = tuple(numpy.array(o) if isinstance(
            o, (numpy.generic, float)) else o for o in outputs)
        with warnings.catch_warnings():
            # (NumPy warns of reading broadcast_arrays' results' flag.)
            warnings.simplefilter('ignore', FutureWarning)
            read_only = any(isinstance(o, numpy.ndarray) and
                            not o.flags.writeable for o in outputs)
        if read_only:
            # (A NumPy broadcast view: a launch could not write it in place
            # as a graph writes its memory. CuPy has no read-only arrays.)
            raise cuda_graph.NotCapturable('a read-only result (the fake)')
        g = FakeGraph(run, inputs, outputs)
        self.graphs.append(g)
        return g, outputs, None

    @staticmethod
    def launch(graph):
        graph.launch()
