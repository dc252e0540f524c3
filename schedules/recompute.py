"""Compute activations again in the backward schedule instead of saving them.

A training step's memory peaks where the backward pass begins: every
activation a backward formula reads is held from the forward op that made it
to its backward use. Where one is cheap to make again from arrays the
backward holds anyway, the backward can compute it right before its first
use, and the forward can let it go after its last forward use
(rematerialization, as in Chen et al.'s sublinear-memory training).

``rematerialize`` rewrites a backward schedule's ops for given recipes.
Which buffers have a recipe, and its kernel, is the front end's business;
a recipe must give the saved values bit for bit.
"""
from schedules import ir


class Recipe(object):
    """How to compute a saved buffer again: ``fn(inputs) -> (array,)`` over
    buffers the backward schedule has (saved, or its inputs)."""

    __slots__ = ('kind', 'inputs', 'fn', 'attrs', 'source')

    def __init__(self, kind, inputs, fn, attrs=None, source=None):
        self.kind = kind
        self.inputs = tuple(inputs)
        self.fn = fn
        self.attrs = attrs
        self.source = source


def _snapshot(a):
    return (a[0].copy(),)


def rematerialize(buffers, forward_ops, backward_ops, saved, recipes,
                  live=()):
    """``(forward_ops, backward_ops, saved)`` where each buffer ``b`` of
    ``recipes`` that the backward reads is computed into a new buffer by a
    new op right before the first backward op reading it, every reader
    reads the new buffer instead, and ``b`` is no longer saved.

    live: buffers whose values may change between a forward and its
    backward (parameters an optimizer updates in place): a recipe reads a
    copy the forward takes at its end, saved in their place, so that it
    computes what the forward computed. New buffers go into ``buffers``; a
    recipe input must not be a recipe's buffer itself (the front end
    composes chains into one recipe). Ops are changed in place."""
    for b, r in recipes.items():
        if any(x in recipes for x in r.inputs):
            raise ValueError('recipe of %%%d reads a recomputed buffer' % b)
    first = {}
    for i, op in enumerate(backward_ops):
        for b in op.inputs:
            if b in recipes and b not in first:
                first[b] = i
    live = set(live)
    copies = {}
    forward_ops = list(forward_ops)
    for b in sorted(first):
        for x in recipes[b].inputs:
            if x in live and x not in copies:
                copies[x] = ir.add_buffer(buffers, buffers[x], ir.TEMP,
                                          'snapshot %%%d' % x)
                forward_ops.append(ir.Op('Snapshot', (x,), (copies[x],),
                                         fn=_snapshot))
    rename = {}
    before = {}
    for b, i in sorted(first.items()):
        # The recorded array as storage: a later op's kernel is chosen by
        # checks on recorded arrays.
        rename[b] = nb = ir.add_buffer(buffers, buffers[b], ir.TEMP,
                                       'recomputed %%%d' % b,
                                       buffers[b].storage)
        r = recipes[b]
        before.setdefault(i, []).append(
            ir.Op(r.kind, [copies.get(x, x) for x in r.inputs], (nb,),
                  r.attrs, r.source, r.fn))
    out = []
    for i, op in enumerate(backward_ops):
        out.extend(before.get(i, ()))
        if any(b in rename for b in op.inputs):
            op.inputs = tuple(rename.get(b, b) for b in op.inputs)
        out.append(op)
    saved = tuple(b for b in saved if b not in rename) + tuple(
        copies[x] for x in sorted(copies))
    return forward_ops, out, saved
