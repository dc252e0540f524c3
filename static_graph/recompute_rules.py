"""Which saved activations the backward computes again, and how (the Chainer
side of ``schedules/recompute.py``).

Rules, by the kind of op that made the buffer, each the forward's own
arithmetic on the CPU:

* ``BatchNormalization`` (train mode, Chainer's generic path): its output
  from its input, gamma, beta and the batch mean and inverse std the
  forward kept on its node. Its own backward reads the input, mean and
  inverse std, so they are saved anyway. Chainer's ``_apply_bn_fwd``, as
  ``lowering.bn_normalize`` makes it.
* ``ReLU``: ``numpy.maximum(x, 0)`` of its input, where that input is held
  or itself has a rule (BatchNormalization then ReLU, as in every ResNet
  block).

A saved buffer gets a recipe only where everything it reads is held anyway
(saved and not recomputed, or a parameter), where neither it nor what it
reads shares memory with the caller's arrays, parameters, constants or
anything handed out (user code could change those in place before the
backward), and where, on the recorded arrays, it gives the recorded values
in the recorded memory layout.
"""
import numpy

from schedules import ir
from schedules import recompute
from static_graph import arrayutil
from static_graph import elementwise_kernels
from static_graph import kernel_checks
from static_graph import kernel_memory
from static_graph import lower_pass
from static_graph import lowering

_MAX_DEPTH = 3


def _batch_normalization(rop, bufs):
    from chainer.functions.normalization import batch_normalization as bn
    node = rop.node
    state = dict(rop.state)
    if len(rop.inputs) != 3 or rop.rebind or \
            type(getattr(node, '_impl', None)) is not \
            bn.GeneralBatchNormalizationImpl or \
            'mean' not in state or 'inv_std' not in state:
        return None
    ins = [bufs[b].storage for b in rop.inputs]
    if not lowering.generic_bn_cpu(node, ins):
        return None
    e = node.expander

    def fn(a, owned, out=None):
        x, gamma, beta, mean, inv_std = a
        return lowering.bn_normalize(
            x, mean[e], inv_std[e], gamma[e], beta[e],
            x if owned[0] else elementwise_kernels.out_like(out, x))

    return rop.inputs + (state['mean'], state['inv_std']), fn


def _relu(rop, bufs):
    from chainer.backends import intel64
    if len(rop.inputs) != 1 or rop.rebind or rop.state:
        return None
    x = bufs[rop.inputs[0]].storage
    if type(x) is not numpy.ndarray or x.ndim == 0 or x.dtype.kind != 'f' \
            or intel64.is_ideep_available():
        return None
    maximum = numpy.maximum

    def fn(a, owned, out=None):
        x = a[0]
        return maximum(x, 0, dtype=x.dtype, out=x if owned[0] else
                       elementwise_kernels.out_like(out, x))

    return rop.inputs, fn


RULES = {
    'BatchNormalization': _batch_normalization,
    'ReLU': _relu,
}


def _main_outputs(rec):
    """buffer id -> the RecordedOp whose first result it is."""
    out = {}
    for rop in rec.forward_ops:
        if rop.outputs and rop.select and rop.select[0] == 0:
            out[rop.outputs[0]] = rop
    return out


def _compose(b, producer, bufs, held, depth=0):
    """A tree computing buffer ``b`` from held buffers, or None: ``(fn,
    [subtrees])`` where a subtree is a held buffer id or another tree."""
    rop = producer.get(b)
    rule = RULES.get(rop.kind) if rop is not None else None
    spec = rule(rop, bufs) if rule is not None else None
    if spec is None:
        return None
    inputs, fn = spec
    kids = []
    for x in inputs:
        if x in held:
            kids.append(x)
            continue
        if depth + 1 >= _MAX_DEPTH:
            return None
        sub = _compose(x, producer, bufs, held, depth + 1)
        if sub is None:
            return None
        kids.append(sub)
    return fn, kids


def _flatten(tree, leaves):
    fn, kids = tree
    out = []
    for k in kids:
        if isinstance(k, tuple):
            out.append(_flatten(k, leaves))
        else:
            if k not in leaves:
                leaves.append(k)
            out.append(leaves.index(k))
    return fn, out


def _run_tree(node, a, out=None):
    # A module function: a recursive closure would refer to itself through
    # its cell, a reference cycle that only the garbage collector frees.
    # ``out``: memory for the result, to whoever allocates it (a rule
    # computes in place in what its first kid computed).
    fn, kids = node
    owned = [type(k) is not int for k in kids]
    args = [a[k] if not own else _run_tree(k, a, out if i == 0 else None)
            for i, (k, own) in enumerate(zip(kids, owned))]
    if owned[0]:
        return fn(args, owned)
    return fn(args, owned, out)


def _kernel(flat):
    def kernel(a):
        return (_run_tree(flat, a),)

    def into(a, outs):
        return (_run_tree(flat, a, outs[0]),)
    kernel.into = into
    # (BatchNormalization's and ReLU's rules allocate their result at most)
    kernel.workspace = kernel_memory.SLACK
    return kernel


def recipes(rec, saved, available, exclude, backward_ops, groups=None):
    """{saved buffer id: recompute.Recipe} for the saved buffers of a
    recording that the backward schedule may compute again.

    available: buffer ids the backward schedule has besides ``saved``
    (parameters); exclude: buffers that must stay as they are (outputs,
    what is handed out); backward_ops: the backward schedule's ops (a
    buffer read by an op that runs nothing, a view made once, is kept);
    groups: lower_pass.memory_groups of the recording's buffers, if
    known."""
    bufs = rec.buffers
    producer = _main_outputs(rec)
    candidates = [b for b in saved if b in producer and
                  producer[b].kind in RULES]
    if not candidates:
        return {}
    cand = set(candidates)
    if groups is None:
        groups = lower_pass.memory_groups(bufs)

    def private(x):
        """Is x's memory written by replay alone? Not if it is (or is a
        view of, or the very array of) the caller's input, a parameter, a
        constant, or something handed out: user code may change that in
        place before the backward, and define-by-run's saved output (or
        the value recomputed from it) would not see the change."""
        storage = bufs[x].storage
        if storage is None:
            return False
        return all(bufs[o].role in (ir.TEMP, ir.STATE) and o not in exclude
                   for o in groups[id(arrayutil.root_of(storage))])

    # What a recipe may read: such private arrays, and parameters
    # themselves (the forward keeps a copy of those it reads).
    held = set(b for b in saved if b not in cand and private(b)) | \
        set(available)
    no_op_reads = set(b for op in backward_ops if op.fn is None
                      for b in op.inputs)
    out = {}
    for b in candidates:
        buf = bufs[b]
        if b in no_op_reads or buf.role != ir.TEMP or buf.static or \
                buf.view_of is not None or \
                type(buf.storage) is not numpy.ndarray or not private(b):
            continue
        tree = _compose(b, producer, bufs, held)
        if tree is None:
            continue
        leaves = []
        flat = _flatten(tree, leaves)
        kernel = _kernel(flat)
        ins = [bufs[x].storage for x in leaves]
        if any(a is None for a in ins) or not kernel_checks.same_results(
                kernel, ins, [buf.storage]):
            continue
        kinds = []
        rop = producer[b]
        while rop is not None and rop.kind in RULES:
            kinds.append(rop.kind)
            x = rop.inputs[0]
            rop = producer.get(x) if x not in held else None
        kernel.__name__ = 'recompute'
        out[b] = recompute.Recipe(
            'Recompute[%s]' % '+'.join(reversed(kinds)), leaves, kernel,
            {'of': '%%%d' % b}, producer[b].source)
    return out
