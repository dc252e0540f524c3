"""A backward recorded from a stand-in gradient, for keys whose calls get
no backward (evaluation outside ``no_backprop_mode``, as Chainer's
custom-loop examples evaluate).

Such calls cannot replay: an entry is built from a recorded backward. Once
two recordings of a key in a row were let go without one
(``Cache.recording_died``), its next recording is a stand-in one
(``Capture(stand_in=True)``): let go without a backward too, its capture is
kept, and the next call of the method (``decorator.wrapper``, before it
dispatches) records its backward with a stand-in gradient and builds the
entry (``record``); the key's calls replay from then on. A backward that
does come through a replayed call runs the recorded backward schedule, as
for any call.

It runs on a call whose outputs nobody holds any more: what a backward
changes on its nodes (``F.hinge`` flips part of its ``bottom_diff`` in
place) is seen by nobody, and at the start of a call, not where the
outputs died (that can be in the middle of another recording).
"""
import numpy

import chainer
from chainer import backend

from static_graph import build
from static_graph import diagnostics
from static_graph import entry as entry_module
from static_graph import numpy_calls
from static_graph import patches
from static_graph import recorder


def record(capture):
    """Record the backward of ``capture``, a stand-in recording let go
    without one, and build its key's entry; where that cannot be done, the
    key's calls run define-by-run (``Cache.no_stand_in``)."""
    e, cache = capture.entry, capture.cache
    if e.state != entry_module.RECORDING:
        return
    why = None
    if cache.covering(capture.key, e, (False,) * len(capture.inner_outs),
                      capture.chain) is None:
        why = why_not(capture)
        if why is None:
            try:
                _backward(capture)
            except Exception as err:   # never in the user's way
                why = 'its backward failed (%s: %s)' % (
                    type(err).__name__, err)
    if e.state == entry_module.RECORDING:
        e.move(entry_module.DISCARDED)
        cache.discard(capture.key, e)
    if why is not None:
        cache.no_stand_in(capture.key, why)
    if e.state != entry_module.COMPLETE:   # (a build let go already)
        build.release_arrays(capture.rec)


def why_not(capture):
    """Why the backward of ``capture`` cannot be recorded from a stand-in
    gradient, or None."""
    if len(capture.inner_outs) != 1:
        return 'it returns %d Variables (or keeps some on its links)' \
            % len(capture.inner_outs)
    if capture.inner_outs[0].raw_array.dtype.kind != 'f':
        return 'its output is not of a float dtype'
    if capture.entry.recurrent:
        return 'it reads recurrent state'
    if chainer.get_function_hooks():
        return 'function hooks are registered, which would see it'
    for op in capture.rec.forward_ops:
        # (This package's NumpyCall, a NumPy call of the method recorded as
        # an op, is pure and carries no gradient: nlp30 hunt, an
        # evaluation with numpy.eye(k)[t] targets ran define-by-run.)
        if recorder.user_defined(op.node) and \
                type(op.node) is not numpy_calls.NumpyCall:
            return ('%s is defined outside Chainer: its backward could '
                    'have effects' % op.kind)
    return None


def _backward(capture):
    y = capture.inner_outs[0].raw_array
    # Values of both signs and many magnitudes, as a real gradient has:
    # kernels the build checks on the recorded arrays (ReLU's gradient
    # gives -0.0 where a negative gradient meets the mask) are checked as
    # with a real one. (A generator of its own: the user's stays.)
    host = numpy.random.RandomState(0).standard_normal(y.shape)
    g = backend.get_array_module(y).asarray(host.astype(y.dtype))
    capture.patched = patches.Hold()   # (let go with the node)
    with chainer.using_config('enable_backprop', False):
        capture.backward((chainer.Variable(g),))
    if capture.entry.state == entry_module.COMPLETE:
        capture.cache.replaced_between(capture.key, again=False)
        diagnostics.logger.info(
            '%s.%s: calls of a key got no backward; its backward was '
            'recorded from a stand-in gradient',
            type(capture.chain).__name__, capture.name)
