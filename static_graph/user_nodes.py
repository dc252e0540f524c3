"""What replay does for nodes defined outside Chainer (a user's
FunctionNode or Function), beyond what it does for Chainer's own: their
forward may leave values from the data on the node for its backward
(``analysis.mark_captured`` runs such a backward again at every replay),
and the shapes of their results may follow the values (``make_kernel``
checks them)."""
import types

import numpy

from static_graph import arrayutil
from static_graph import held_views
from static_graph import node_attrs
from static_graph import patches
from static_graph import recorder


def rerun_scalar_steps(rec, reruns_ok):
    """A node defined outside Chainer whose forward sets a value on itself
    (``self.n = float(norm)``, ``self.k = int((x > 0).sum())``, a bool or a
    string it branches on): its backward may compute with it in Python (``gy /
    self.n`` builds a MulConstant of a new float), which the recorded ops
    would freeze. Its backward step runs again at every replay, with the
    forward's fresh values; where it cannot, the recording falls back."""
    ops = dict((id(op.node), op) for op in rec.forward_ops)
    for step in rec.steps:
        op = ops.get(id(step.node))
        if step.rerun or op is None or not recorder.user_defined(step.node):
            continue
        d = node_attrs.attrs(op.node)
        shapes = set(rec.buffers[b].shape for b in op.inputs + op.outputs)
        varying = [d.get(k) for k, _ in op.restore or ()
                   if _may_follow_values(d.get(k), shapes)]
        if not varying and id(step.node) not in rec.held_reads:
            continue
        if reruns_ok(step):
            step.rerun = True
            # An int, a string...: not handed from call to call as a float
            # is (analysis.scalar_state); the node holds the last forward's,
            # which another call's backward would read. Each call keeps its
            # own (nodes.py: node_values) and puts them back for its
            # backward.
            rec.node_values.extend(
                (d, k) for k, _ in op.restore
                if _may_follow_values(d.get(k), shapes) and
                not arrayutil.is_scalar_value(d.get(k)))
        else:
            rec.add_reason(
                'the forward of %s (defined outside Chainer) sets a value '
                'on its node that its backward may compute with, and that '
                'backward cannot be run again by replay' % op.kind)


def rerun_communicating_steps(rec, reruns_ok):
    """A ChainerMN node's backward communicates (``bcast``'s gathers the
    gradients at the root; a rank that is not the root returns none, so
    no recorded op reads what it did): its step runs again at every
    replay, whatever it returns; where it cannot, the recording falls
    back (a rank that skipped it would leave the others waiting)."""
    for step in rec.steps:
        if step.rerun or not communicates(step.node):
            continue
        if reruns_ok(step):
            step.rerun = True
        else:
            rec.add_reason('the backward of %s communicates (ChainerMN), '
                           'and replay cannot run it again'
                           % patches.op_kind(step.node))


def communicates(node):
    """Is ``node`` ChainerMN's (an old-style Function's by its
    function)?"""
    fn = getattr(node, '_function', None)
    return type(fn if fn is not None else node).__module__.startswith(
        'chainermn')


# What a forward may set on its node that is the same at every call of a
# key: modules (``self.xp``), functions and classes.
_CONSTANT_TYPES = (types.ModuleType, types.FunctionType,
                   types.BuiltinFunctionType, type, numpy.dtype)


def _may_follow_values(v, shapes):
    """Could ``v``, which a node's forward set on the node, differ from
    call to call of one key? A number, a bool, a string, an enum member,
    None (an array at other calls), a container of them, any other object
    may: the backward may branch on it (``self.mode = 'pos'``, ``self.k =
    int(...)``). Arrays are the recording's state; a dtype, and a tuple of
    ints that is the shape of one of the node's inputs or results
    (``self.shape = x.shape``), or its start or end of two or more sizes,
    are the key's."""
    if arrayutil.is_array(v) or isinstance(v, _CONSTANT_TYPES):
        return False
    if type(v) in (tuple, list):
        if v and all(type(x) is int for x in v):
            # A shape, or the start or the end of one of two or more
            # sizes (x.shape[1:] of 3-d x; one number may be anything).
            v = tuple(v)
            n = len(v)
            return not any(v == s or n > 1 and (v == s[:n] or v == s[-n:])
                           for s in shapes)
        return any(_may_follow_values(x, shapes) for x in v)
    return True


def shape_checking_kernel(inner, kind, shapes):
    """A node of the user's whose result's shape follows the values
    (``x.ravel()[:k]``, k positives): the recorded ops after it have the
    recorded shapes, so replay stops with an error instead of computing
    with them."""
    def kernel(inputs):
        out = inner(inputs)
        for a, shape in zip(out, shapes):
            if getattr(a, 'shape', shape) != shape:
                raise RuntimeError(
                    '%s (defined outside Chainer) returned an array of '
                    'shape %s where the recording of this call signature '
                    'got %s: its results\' shapes follow the values, which '
                    'a replay cannot; run this method with '
                    'chainer.config.use_static_graph = False'
                    % (kind, a.shape, shape))
        return out

    return kernel


def held_arrays(rec, func):
    """A node defined outside Chainer reads the NumPy arrays its forward
    left on it (``self.mask = x > 0``) through views (held_views.HeldArray)
    for its backward: values read in Python there (``if self.mask.sum() >
    3``, ``gy * float(self.n)``) make that backward run again at every
    replay (user_nodes), where it would otherwise repeat the recording's
    branch. Returns (attributes, name, array) to put back."""
    if not recorder.user_defined(func):
        return ()
    attrs = node_attrs.attrs(func)
    held = [(attrs, k, a) for k, a in list(attrs.items())
            if type(a) is numpy.ndarray]
    for _, k, a in held:
        attrs[k] = rec.trace(a, check=False, kind=held_views.HeldArray)
    return held
