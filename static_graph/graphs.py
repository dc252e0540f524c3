"""Which of an entry's schedules replay as CUDA graphs, and how they fit
the entry's bookkeeping (``schedules/cuda_graph.py`` does the capture).

On CuPy, each compiled schedule of an entry (the forward, the backward and
its variants) is wrapped in a ``GraphTier``:

* the forward's saved activations stay the graph's memory: the backward
  graph reads them in place, and they join the entry's static storages, so
  a second call before the first one's backward puts them aside and back as
  it does static buffers (``ReplayNode``); the forward captures only when no
  earlier call still waits for its backward;
* its results and reported values are copied out of the graph after each
  launch (the next launch overwrites the graph's memory); the gradients the
  backward hands to Chainer are lent, handed out as the graph's own arrays
  while nothing holds those of the launch before (``cuda_graph.HELD``).

``BACKEND`` is None where there is no GPU; tests replace it.
"""
import threading
import weakref

import numpy

from schedules import cuda_graph
from schedules import ir
from static_graph import diagnostics

_lock = threading.Lock()
_backend = []
# Compiled runs of a schedule before it is captured (the run that compiles
# it also checks cheaper kernels; the next one captures).
CAPTURE_AFTER = 1


def backend():
    """The CUDA graph backend (CuPy), made on first use; None where CuPy
    cannot capture (not installed, no device)."""
    with _lock:
        if not _backend:
            try:
                _backend.append(cuda_graph.CupyBackend())
            except Exception as e:   # no CuPy, no CUDA
                diagnostics.logger.debug('no CUDA graphs: %s', e)
                _backend.append(None)
        return _backend[0]


def set_backend(b):
    """Use ``b`` for the graphs of entries built from now on (tests)."""
    with _lock:
        _backend[:] = [b]


def wants_graphs(entry, copyto):
    """Do this entry's schedules run on a device where they can be
    captured (CuPy), with the option on?"""
    if not entry.cuda_graph:
        return None
    if not _backend and copyto is numpy.copyto:
        return None    # (CuPy is not even imported for a NumPy entry)
    b = backend()
    if b is None or copyto is not b.serves:
        return None
    return b


def written_in_place(entry, schedule):
    """The arrays a schedule's ops may update in place rather than return:
    the chain's persistent arrays (running statistics, which
    BatchNormalization's node holds and updates), persistent and static
    buffers; not parameters, constants or views of other buffers.
    (cuda_graph.capture takes each array once.)"""
    return list(entry.persistent_arrays) + [
        buf.storage for buf in schedule.buffers.values()
        if buf.storage is not None and buf.view_of is None and
        buf.role not in (ir.PARAM, ir.CONST) and
        (buf.role == ir.PERSIST or buf.static)]


def _host_draw(tier):
    """Never capture a schedule that draws from a generator on the host
    (numpy_calls: ``numpy.random.randn``, ``self.rng.randn``): a graph
    would repeat the first draw, and the generator would not advance. (The
    capture's own check sees only the global generators.)"""
    for op in tier.schedule.ops:
        if op.kind == 'NumpyCall' and op.attrs.get('draws'):
            tier.reason = ('it draws random numbers on the host (%s at %s): '
                           'a graph would repeat the first draw'
                           % (op.attrs.get('call'), op.source))
            break
    return tier


def forward_tier(entry, tiered, b):
    """The forward as a graph: saved activations (the results after the
    outputs) stay static; captured only while no earlier call waits for
    its backward (``entry.quiet``, set by ``ReplayNode.forward``)."""
    n = len(entry.forward.outputs)
    saved = range(n, n + len(entry.saved))
    # The chain's memory handed out (``self.l.W.array[0]``) is not copied
    # out either: replay hands it out as define-by-run does. It is the
    # chain's, not the graph's: no static storage of the entry.
    exposed = n + len(entry.saved)
    shown = [i for i, b in enumerate(entry.forward.outputs)
             if b in entry.aliases] + [exposed + j for j, b in
                                       enumerate(entry.expose)
                                       if b in entry.aliases]
    # The entry holds the tier: the tier's callbacks hold the entry weakly.
    ref = weakref.ref(entry)

    def on_capture(g):
        e = ref()
        with e.lock:
            old = set(id(a) for a in e.graph_static)
            chain = set(id(g.outputs[i]) for i in shown)
            e.graph_static = [a for a in g.static_arrays()
                              if id(a) not in chain]
            e.static_storages = [s for s in e.static_storages
                                 if id(s) not in old] + e.graph_static
            e.graph_owned = set(id(a) for a in e.graph_static)

    return _host_draw(cuda_graph.GraphTier(
        tiered, b, after=CAPTURE_AFTER,
        static_results=tuple(saved) + tuple(shown),
        state=lambda: written_in_place(ref(), ref().forward),
        allowed=lambda: ref().quiet, on_capture=on_capture,
        owned=lambda a: id(a) in ref().graph_owned))


def backward_tier(entry, tiered, b):
    """A backward schedule (or a variant) as a graph: the forward graph's
    saved activations are read in place; the gradients are lent."""
    ref = weakref.ref(entry)
    return cuda_graph.GraphTier(
        tiered, b, after=CAPTURE_AFTER,
        state=lambda: written_in_place(ref(), tiered.schedule),
        owned=lambda a: id(a) in ref().graph_owned, lend=True)


def tiers(entry):
    """(name, GraphTier) of the entry's schedules that have one."""
    out = []
    for name, run in (('forward', getattr(entry, 'run_forward', None)),
                      ('backward', getattr(entry, 'run_backward', None))):
        if isinstance(run, cuda_graph.GraphTier):
            out.append((name, run))
    return out


def describe(entry):
    """One line on the entry's CUDA graphs, or None where it has none."""
    parts = []
    for name, t in tiers(entry):
        if t.graph is not None:
            lent = t.graph.lent_results
            parts.append('%s replays as one launch (%d launches, %d '
                         'captures%s%s)' % (
                             name, t.launches, t.captures,
                             '; %d results lent, not copied' % lent
                             if lent else '',
                             '; %d calls launch by launch, a lent result '
                             'still held' % t.held if t.held else ''))
        elif t.reason is not None:
            parts.append('%s replays launch by launch: %s' % (name,
                                                              t.reason))
        else:
            parts.append('%s not captured yet' % name)
    return 'CUDA graph: ' + '; '.join(parts) if parts else None
