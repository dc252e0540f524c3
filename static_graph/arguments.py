"""The recording's own copies of a call's array arguments (capture.py):
input buffers of the recording, laid out as the caller's, one object where
the caller gave one object twice."""
import numpy

import chainer

from schedules import ir
from static_graph import arrayutil


def inner_arguments(rec, leaves, paths):
    """The recording runs on copies of the array arguments (traced
    where they are NumPy arrays), input buffers of the recording."""
    inner, leaf_bids = [], []
    first = {}    # id(leaf) -> its first position (model(x, x))
    shared = _copies_sharing(leaves)
    for i, (leaf, path) in enumerate(zip(leaves, paths)):
        j = first.setdefault(id(leaf), i)
        if j != i:
            # One object again, as the method gets it under
            # define-by-run (signature._same): one input buffer.
            inner.append(inner[j])
            leaf_bids.append(leaf_bids[j])
            continue
        variable = isinstance(leaf, chainer.Variable)
        a = shared.get(i)
        if a is None:
            a = arrayutil.copy_exact(leaf.raw_array if variable else leaf)
        leaf_bids.append(rec.new_buffer(a, ir.INPUT, name=path))
        if variable:
            v = chainer.Variable(a, requires_grad=leaf.requires_grad,
                                 name=leaf.name)
            if leaf.grad_var is not None:
                # The caller's gradient, as define-by-run's method sees it
                # (a use of it makes the call fall back: patches).
                v.grad_var = leaf.grad_var
            rec.argument_paths[id(v)] = (path, leaf)
            inner.append(v)
        else:
            inner.append(rec.trace(a) if type(a) is numpy.ndarray else a)
    return inner, leaf_bids


def sync_gradients(inner, leaves):
    """A gradient the method set on an argument's copy (``x.cleargrad()``,
    ``x.grad = g``, ``chainer.grad(..., set_grad=True)``, a backward
    inside the method): the caller's Variable gets it, where define-by-run
    sets it (such a call falls back: patches, which name the use)."""
    for v, a in zip(inner, leaves):
        if v is not a and isinstance(a, chainer.Variable) and \
                isinstance(v, chainer.Variable) and (
                    v._grad_var is not a._grad_var or v._grad is not a._grad):
            a._set_grad_var_without_check(v.grad_var)


def _copies_sharing(leaves):
    """{position: copy} for array arguments (or Variables' arrays) of one
    memory (``model(x, x.T)``, ``model(x, x[1:])``, two Variables of one
    array): copies that share one memory as they do
    (arrayutil.copies_sharing). Replays run on the caller's arrays."""
    by_root, seen = {}, set()
    for i, leaf in enumerate(leaves):
        if id(leaf) in seen:
            continue      # the same object again: one copy (first)
        seen.add(id(leaf))
        a = leaf.raw_array if isinstance(leaf, chainer.Variable) else leaf
        if (type(a) is numpy.ndarray or arrayutil.is_array(a) and
                not isinstance(a, numpy.ndarray)) and a.size:
            by_root.setdefault(id(arrayutil.root_of(a)), []).append((i, a))
    out = {}
    for group in by_root.values():
        if len(group) < 2:
            continue      # (most: each argument its own memory)
        for ks in arrayutil.overlapping([a for _, a in group]):
            if len(ks) > 1:   # (rows far apart in a dataset: apart)
                out.update(zip([group[k][0] for k in ks],
                               arrayutil.copies_sharing(
                                   [group[k][1] for k in ks])))
    return out
