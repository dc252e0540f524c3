"""Host time of the captured update's CuPy path, without a GPU.

    .venv/bin/python benchmarks/update_host.py [--rounds 9] [--steps 1000]

Runs ``static_graph.capture_update`` on the fake CuPy of the tests
(``tests/fake_cupy.py``: NumPy arrays named ``cupy.ndarray``) with the
device work switched off, so that what is timed is the step's host part
alone: Chainer's ``update`` call, reading the step (in full, or only the
rules' scalars where it is like the step before:
``update_cupy_steady.py``), staging the scalars. The MLP of
``benchmarks/gpu.py`` (784-1000-1000-10, six parameters) with Adam; gradients given as the same arrays at every step, as a CUDA graph
lends them. Rounds alternate between the steady path and the full read;
medians in microseconds a step.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))

import static_graph  # NOQA  (before chainer: Python 3.12+/NumPy 2)
import numpy  # NOQA
import chainer  # NOQA

from benchmarks import cases  # NOQA
from static_graph import update_cupy  # NOQA
from tests import fake_cupy  # NOQA


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--rounds', type=int, default=9)
    p.add_argument('--steps', type=int, default=1000)
    a = p.parse_args(argv)
    update_cupy.cupy_module = lambda: fake_cupy
    update_cupy._launch = lambda st, ring: None     # the device work off
    m = cases.MLP()
    for prm in m.params():
        prm.array = fake_cupy.asarray(prm.array.copy())
    opt = chainer.optimizers.Adam().setup(m)
    static_graph.capture_update(opt, threads=1, cuda_graph=False)
    grads = [fake_cupy.asarray(numpy.ones(prm.shape, prm.dtype))
             for prm in m.params()]

    def step():
        for prm, g in zip(m.params(), grads):
            prm.grad = g
        opt.update()
    for _ in range(20):
        step()
    res = {True: [], False: []}
    for _ in range(a.rounds):
        for steady in (True, False):
            update_cupy.STEADY = steady
            step()
            t0 = time.perf_counter()
            for _ in range(a.steps):
                step()
            res[steady].append((time.perf_counter() - t0) / a.steps * 1e6)
    s, f = numpy.median(res[True]), numpy.median(res[False])
    print('update host part: %.1f us a step read as the step before, '
          '%.1f us read in full (%.2fx)' % (s, f, f / s))


if __name__ == '__main__':
    main()
