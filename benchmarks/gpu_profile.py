"""Where a replayed training step's host time goes, phase by phase.

    python benchmarks/gpu_profile.py --device @cupy:0 [--case mlp-b8-adam-capture]

Builds the twins of ``benchmarks/gpu.py``'s case, warms them up, then for
define-by-run and the graph twin times each phase of the step (cleargrads,
forward, backward, update) on the host over many steps, the device
synchronized only around the whole run (so a phase's time is the host's:
its Python and launches), and profiles the graph twin's steps with
cProfile (the top functions by own time). On CuPy the device's work runs
asynchronously beside this; the step's device time is ``gpu.py``'s.
"""
import cProfile
import os
import pstats
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import gpu  # NOQA  (imports static_graph first)

PHASES = ('cleargrads', 'forward', 'backward', 'update')


def phases(model, opt, batch, n, sync):
    acc = dict.fromkeys(PHASES, 0.0)
    clock = time.perf_counter
    sync()
    t_all = clock()
    for _ in range(n):
        t0 = clock()
        model.cleargrads()
        t1 = clock()
        loss = model(*batch)
        t2 = clock()
        loss.backward()
        t3 = clock()
        opt.update()
        t4 = clock()
        acc['cleargrads'] += t1 - t0
        acc['forward'] += t2 - t1
        acc['backward'] += t3 - t2
        acc['update'] += t4 - t3
    sync()
    total = clock() - t_all
    return dict((k, v / n * 1e6) for k, v in acc.items()), total / n * 1e6


def main(argv=None):
    p = gpu.case_parser(__doc__, '@numpy', 'mlp-b8-adam-capture')
    p.add_argument('--steps', type=int, default=500)
    p.add_argument('--top', type=int, default=35)
    a = p.parse_args(argv)
    make, _, opt, _, _ = gpu.CASES[a.case]
    dev, sync, batch = gpu.on_device(a.case, a.device)
    twins = gpu._twins(make, dev, opt, a.case.endswith('-capture'))
    for v in ('dbr', 'graph'):
        for _ in range(30):
            gpu._step(twins[v][0], twins[v][1], batch)
    for rnd in range(2):
        for v in ('dbr', 'graph'):
            ph, total = phases(twins[v][0], twins[v][1], batch, a.steps,
                               sync)
            print('%-5s round %d: step %7.1f us (host+sync); %s' % (
                v, rnd, total, ', '.join(
                    '%s %.1f' % (k, ph[k]) for k in PHASES)))
    m, o = twins['graph']
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(a.steps):
        gpu._step(m, o, batch)
    prof.disable()
    sync()
    st = pstats.Stats(prof)
    st.sort_stats('tottime').print_stats(a.top)
    st.sort_stats('cumulative').print_stats(a.top)
    import static_graph
    print(static_graph.explain(m))
    if a.case.endswith('-capture'):
        print(static_graph.explain_update(o))


if __name__ == '__main__':
    main()
