"""What replay does for nodes defined outside Chainer (a user's
FunctionNode or Function), beyond what it does for Chainer's own: their
forward may leave numbers from the data on the node for its backward
(``analysis.mark_captured`` runs such a backward again at every replay),
and the shapes of their results may follow the values (``make_kernel``
checks them)."""
import numpy

from static_graph import recorder


def rerun_scalar_steps(rec, reruns_ok):
    """A node defined outside Chainer whose forward sets a number on itself
    (``self.n = float(norm)``, ``self.k = int((x > 0).sum())``, a bool it
    branches on): its backward may compute with it in Python (``gy /
    self.n`` builds a MulConstant of a new float), which the recorded ops
    would freeze. Its backward step runs again at every replay, with the
    forward's fresh values; where it cannot, the recording falls back."""
    ops = dict((id(op.node), op) for op in rec.forward_ops)
    for step in rec.steps:
        op = ops.get(id(step.node))
        if step.rerun or op is None or not recorder.user_defined(step.node):
            continue
        d = recorder.attrs(op.node)
        if not any(_python_number(d.get(k)) for k, _ in op.restore or ()):
            continue
        if reruns_ok(step):
            step.rerun = True
        else:
            rec.add_reason(
                'the forward of %s (defined outside Chainer) sets a number '
                'on its node that its backward may compute with, and that '
                'backward cannot be run again by replay' % op.kind)


def _python_number(v):
    if type(v) in (tuple, list):
        # (a float among them: ``(float(x.std()), x.shape)``; the ints of
        # a shape are the key's)
        return any(type(x) is float or isinstance(x, numpy.floating)
                   for x in v)
    return type(v) in (int, float, bool) or isinstance(v, numpy.generic)


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
