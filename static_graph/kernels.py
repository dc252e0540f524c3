"""The callables an entry's ops run at replay: a recorded node's own
forward with its state put back and handed out (``make_kernel``), and a
backward step that runs its node's ``backward()`` again (``rerun_op``)."""
import functools

import chainer

from schedules import ir
from static_graph import arrayutil
from static_graph import lower_pass
from static_graph import node_attrs
from static_graph import recorder
from static_graph import user_nodes


def make_kernel(rop, static_attrs, shapes=None):
    """The callable an op runs at replay: the node's own forward, with its
    pre-forward attributes restored first, the arrays it was built with
    rebound and its hidden state returned. ``shapes``: its results'
    recorded shapes, checked where the node is defined outside Chainer."""
    kernel = _state_kernel(rop, static_attrs)
    if shapes is not None and recorder.user_defined(rop.node):
        kernel = user_nodes.shape_checking_kernel(kernel, rop.kind,
                                                 tuple(shapes))
    if rop.nones:
        kernel = none_filling_kernel(kernel, rop.nones,
                                      len(rop.inputs) + len(rop.nones))
    if rop.rebind:
        kernel = _rebinding_kernel(kernel, node_attrs.attrs(rop.node),
                                   len(rop.inputs),
                                   tuple(k for k, _ in rop.rebind))
    return kernel


def _state_kernel(rop, static_attrs):
    forward = rop.node.forward
    if not rop.restore and not rop.state:
        return forward
    restore = tuple(rop.restore)
    state_keys = tuple([k for k, _ in rop.state])
    d = node_attrs.attrs(rop.node)
    missing = arrayutil.MISSING

    def kernel(inputs):
        for k, v in restore:
            if v is missing:
                d.pop(k, None)
            else:
                d[k] = v
        out = forward(inputs)
        if state_keys:
            out = tuple(out) + tuple(d[k] for k in state_keys)
            for k, storage in static_attrs:
                d[k] = storage   # live readers see the refreshed storage
        return out

    return kernel


def none_filling_kernel(inner, nones, n):
    """The node had None among its n inputs, at positions ``nones``: it
    gets them again between the arrays."""
    arrays = tuple(i for i in range(n) if i not in nones)

    def kernel(inputs):
        full = [None] * n
        for i, a in zip(arrays, inputs):
            full[i] = a
        return inner(tuple(full))

    return kernel


def _rebinding_kernel(inner, d, n, keys):
    """Backward nodes built with arrays (analysis.mark_captured): the
    current arrays come after the node's n inputs; the node holds them only
    while it runs, so nothing of one call outlives it."""
    def kernel(inputs):
        for k, a in zip(keys, inputs[n:]):
            d[k] = a
        try:
            return inner(inputs[:n])
        finally:
            for k in keys:
                d[k] = None

    return kernel


def _rerun_kernel(step, fop):
    """Replay a backward step by calling the forward node's backward()
    again (define-by-run for that one step): it is handed the output
    gradients, then the arrays it retained and its state, as inputs, and
    returns the gradients it made. The node holds them only while it
    runs."""
    node, target = step.node, step.target
    gy_mask = tuple(b is not None for b in step.gy)
    in_index = tuple(i for i, _ in step.retained_in)
    n_out = len(step.retained_out)
    state_keys = tuple(k for k, _ in fop.state)
    want = tuple(b is not None for b in step.gx)
    d = node_attrs.attrs(node)
    n_inputs = len(node.inputs)
    Variable = chainer.Variable

    def kernel(a):
        it = iter(a)
        gys = tuple(Variable(next(it), requires_grad=False) if present
                    else None for present in gy_mask)
        nodes, swapped = [], []

        def bind(vn, x):
            var = vn.get_variable_or_none()
            if var is None:
                vn._data = x
                nodes.append(vn)
            elif var.raw_array is not x:
                # A variable of the recording kept alive (the method stored
                # its input, say): backward() reads its array, so it holds
                # this call's while backward() runs. (A parameter's is the
                # current array already.)
                swapped.append((var, var.raw_array))
                var.array = x

        saved = [(k, d.get(k)) for k in state_keys]
        try:
            for i in in_index:
                bind(node.inputs[i], next(it))
            ys = node._retained_output_data = tuple(
                next(it) for _ in range(n_out))
            for i, y in zip(node._output_indexes_to_retain or (), ys):
                # An output node another node still holds is read, not the
                # retained data.
                vn = node.outputs[i]()
                if vn is not None:
                    bind(vn, y)
            for k in state_keys:
                d[k] = next(it)
            with chainer.using_config('enable_backprop', False):
                gxs = node.backward(target, gys)
        finally:
            for vn in nodes:
                vn._data = None
            for var, old in swapped:
                var.array = old
            node._retained_output_data = None
            d.update(saved)
        if len(gxs) == n_inputs and n_inputs != len(target):
            gxs = tuple(gxs[i] for i in target)
        out = []
        for g, w in zip(gxs, want):
            got = g is not None and g.raw_array is not None
            if got != w:
                raise RuntimeError(
                    'static_graph: the backward of %s returned %s gradient '
                    'where the recording got %s' % (
                        step.label or type(node).__name__,
                        'a' if got else 'no', 'one' if w else 'none'))
            if got:
                out.append(g.raw_array)
        return tuple(out)

    kernel.__name__ = 'rerun_backward'
    return kernel


def rerun_op(step, fop):
    inputs = tuple(b for b in step.gy if b is not None) + \
        tuple(b for _, b in step.retained_in) + tuple(step.retained_out) + \
        tuple(b for _, b in fop.state)
    outputs = tuple(b for b in step.gx if b is not None)
    return ir.Op('%s.backward' % fop.kind, inputs, outputs,
                 functools.partial(lower_pass.attrs_with_kernel, fop.node,
                                   'rerun_backward'),
                 step.label, _rerun_kernel(step, fop),
                 tuple(range(len(outputs))))
