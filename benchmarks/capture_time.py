"""What capturing a schedule as a CUDA graph costs, and where it goes.

    python benchmarks/capture_time.py [--case resnet50-b32-224] [--twins 3]

Trains fresh graph twins of a ``benchmarks/gpu.py`` case (one after the
other, each let go before the next) until their schedules are captured,
and times, over each twin's captures: the whole of ``cuda_graph.capture``
(the schedule run launch by launch for reference, the stream capture, the
graph's first launch and the bit-for-bit checks), the stream capture alone
(``CupyBackend.capture``: the schedule's Python launching into a private
memory pool, ending the capture, uploading the graph), the checks'
comparisons (``CupyBackend.same_many``) and copies
(``CupyBackend.copy``). The first twin pays what a process pays once
(CuPy's kernels compiled or loaded), the next ones show a warm process.
"""
import gc
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import gpu  # NOQA  (imports static_graph first)

from schedules import cuda_graph  # NOQA

TIMED = (('capture', cuda_graph, 'capture'),
         ('stream capture', cuda_graph.CupyBackend, 'capture'),
         ('comparisons', cuda_graph.CupyBackend, 'same_many'),
         ('copies', cuda_graph.CupyBackend, 'copy'))


def _timers(acc, sync):
    for label, owner, name in TIMED:
        f = owner.__dict__[name]
        inner = f.__func__ if isinstance(f, staticmethod) else f

        def timed(*a, _f=inner, _label=label, **k):
            sync()
            t0 = time.perf_counter()
            try:
                return _f(*a, **k)
            finally:
                sync()
                acc[_label] = acc.get(_label, 0.0) + time.perf_counter() - t0
        setattr(owner, name, staticmethod(timed)
                if isinstance(f, staticmethod) else timed)


def main(argv=None):
    p = gpu.case_parser(__doc__, '@cupy:0', 'resnet50-b32-224')
    p.add_argument('--twins', type=int, default=3)
    p.add_argument('--steps', type=int, default=6)
    a = p.parse_args(argv)
    make, _, opt, _, _ = gpu.CASES[a.case]
    dev, sync, batch = gpu.on_device(a.case, a.device)
    acc = {}
    _timers(acc, sync)
    for twin in range(a.twins):
        acc.clear()
        m, o = gpu._twins(make, dev, opt)['graph']
        times = []
        for _ in range(a.steps):
            sync()
            t0 = time.perf_counter()
            gpu._step(m, o, batch)
            sync()
            times.append((time.perf_counter() - t0) * 1e3)
        print('twin %d: steps %s ms; %s' % (
            twin, ' '.join('%.1f' % t for t in times),
            ', '.join('%s %.1f ms' % (k, v * 1e3) for k, v in acc.items())))
        sys.stdout.flush()
        del m, o
        gc.collect()


if __name__ == '__main__':
    main()
