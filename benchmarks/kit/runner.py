"""Run one case of the kit: both twins side by side, step by step."""
import time
import warnings

import numpy


from static_graph import StaticGraphWarning
from static_graph.decorator import caches_of

from benchmarks.kit import common


def build(case, static, seed=0):
    numpy.random.seed(seed)
    root = case.model(static)
    opts = case.optimizers(root)
    return root, opts


def arrays_of(root):
    """[(name, array)]: every parameter and persistent array of the root
    chain, by name."""
    out = [('param ' + n, p.array) for n, p in sorted(root.namedparams())]
    for name, link in sorted(root.namedlinks()):
        for p in sorted(getattr(link, '_persistent', ())):
            v = getattr(link, p)
            if isinstance(v, numpy.ndarray):
                out.append(('persistent %s/%s' % (name, p), v))
            elif isinstance(v, (int, float, numpy.number)):
                out.append(('persistent %s/%s' % (name, p),
                            numpy.asarray(v)))
    return out


def difference(a, b):
    """0.0 when bit for bit equal (NaNs where NaNs are), else the max abs
    difference (inf where shapes or NaNs differ)."""
    a = numpy.asarray(a)
    b = numpy.asarray(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        return float('inf')
    if a.tobytes() == b.tobytes():
        return 0.0
    if a.dtype.kind not in 'fc':
        return float(numpy.max(numpy.abs(a.astype(numpy.float64) -
                                         b.astype(numpy.float64))))
    nan_a, nan_b = numpy.isnan(a), numpy.isnan(b)
    if (nan_a != nan_b).any():
        return float('inf')
    d = numpy.abs(a[~nan_a].astype(numpy.float64) -
                  b[~nan_b].astype(numpy.float64))
    # Equal values with other bits (-0.0 and 0.0) count as the smallest
    # difference there is, so that "equal" means bit for bit.
    return float(d.max()) if d.size and d.max() > 0 else 5e-324


def decorated_links(case, root):
    links = list(root.links()) + list(case.extra_links(root))
    seen, out = set(), []
    for link in links:
        if id(link) not in seen:
            seen.add(id(link))
            out.append(link)
    return out


def counters(case, root):
    """Recordings, replays and fallback calls over every decorated chain,
    and the reasons the library gave."""
    rec = rep = fb = 0
    reasons = []
    methods = []
    for link in decorated_links(case, root):
        for name, cache in caches_of(link).items():
            methods.append(cache.owner_name)
            rec += cache.recordings
            rep += cache.replays
            fb += cache.fallback_calls
            if cache.define_by_run:
                reasons.append('%s: %s' % (cache.owner_name,
                                           cache.define_by_run))
            for e in cache.entries.values():
                if e.reason:
                    reasons.append('%s: %s' % (cache.owner_name, e.reason))
    uniq = []
    for r in reasons:
        if r not in uniq:
            uniq.append(r)
    return dict(recordings=rec, replays=rep, fallback_calls=fb,
                reasons=uniq, methods=sorted(set(methods)))


def run_case(case, steps=None, warmup=None, seed=0, data_seed=1):
    """Train both twins ``steps`` iterations, interleaved; returns a dict
    (see kit_run.py for the fields)."""
    steps = case.steps if steps is None else steps
    warmup = case.warmup if warmup is None else warmup
    twins = {}
    for static in (False, True):
        twins[static] = build(case, static, seed)
    batches = case.batches(numpy.random.RandomState(data_seed), steps)
    times = {False: [], True: []}
    first_mismatch = None
    max_diff = 0.0
    diffs = []
    losses = {False: [], True: []}
    caught = []
    error = None
    t_start = time.perf_counter()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('ignore')
        warnings.simplefilter('always', StaticGraphWarning)
        for i, batch in enumerate(batches):
            order = (False, True) if i % 2 == 0 else (True, False)
            out = {}
            for static in order:
                root, opts = twins[static]
                b = common.copy_batch(batch)
                numpy.random.seed(1000 + i)
                n_warn = len(w)
                t0 = time.perf_counter()
                try:
                    loss = case.step(root, opts, b)
                except Exception as e:     # a crash is a finding too
                    error = 'step %d, %s twin: %s: %s' % (
                        i, 'decorated' if static else 'define-by-run',
                        type(e).__name__, e)
                    break
                times[static].append(time.perf_counter() - t0)
                out[static] = common.loss_array(loss)
                for x in w[n_warn:]:
                    if issubclass(x.category, StaticGraphWarning):
                        caught.append(dict(step=i, message=str(x.message)))
            if error:
                break
            losses[False].append(float(numpy.sum(out[False])))
            losses[True].append(float(numpy.sum(out[True])))
            d_step = [('loss', difference(out[False], out[True]))]
            pa = arrays_of(twins[False][0])
            pb = arrays_of(twins[True][0])
            if [n for n, _ in pa] != [n for n, _ in pb]:
                d_step.append(('parameter names', float('inf')))
            else:
                d_step += [(n, difference(a, b))
                           for (n, a), (_, b) in zip(pa, pb)]
            worst = max(d_step, key=lambda x: x[1])
            diffs.append(worst[1])
            if worst[1] > 0 and first_mismatch is None:
                first_mismatch = dict(step=i, what=worst[0], diff=worst[1])
            max_diff = max(max_diff, worst[1])
    wall = time.perf_counter() - t_start
    c = counters(case, twins[True][0])
    steady = slice(warmup, None)
    dbr = numpy.array(times[False][steady])
    sg = numpy.array(times[True][steady])
    n = min(len(dbr), len(sg))
    result = dict(
        name=case.name, example=case.example, decorated=case.decorated,
        note=case.note, shapes=case.shapes, targets=list(case.targets),
        steps=len(times[True]), warmup=warmup,
        equal=(first_mismatch is None and error is None),
        first_mismatch=first_mismatch, max_diff=max_diff,
        diff_per_step=diffs, losses_dbr=losses[False],
        losses_static=losses[True],
        error=error, warnings=caught, wall_s=wall,
        times_dbr=times[False], times_static=times[True], **c)
    if n:
        result.update(
            dbr_ms=float(numpy.median(dbr[:n])) * 1e3,
            static_ms=float(numpy.median(sg[:n])) * 1e3,
            ratio_median=float(numpy.median(dbr[:n]) / numpy.median(sg[:n])),
            ratio_total=float(dbr[:n].sum() / sg[:n].sum()),
            first_dbr_ms=times[False][0] * 1e3,
            first_static_ms=times[True][0] * 1e3)
    return result
