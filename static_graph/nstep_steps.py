"""One direction of one layer of an NStep RNN, step by step: what
``n_step_rnn._one_directional_loop`` computes with Chainer's nodes, and
its backward, on arrays (``NStepLoop``'s steps, nstep_loop.py). Each
operation is the node's own (Chainer's LSTM and LSTMGrad arithmetic, as
lstm_kernels computes it; its Tanh and ReLU code; the Linear's BLAS calls
on the same operands), in the same order."""
import numpy

from chainer.functions.activation import relu as relu_module
from chainer.functions.activation import tanh as tanh_module

from static_graph import lstm_kernels
from static_graph import nstep_ranks

GATE_ORDER = (2, 0, 1, 3)     # n_step_lstm._lstm's stacking of the gates


def stacked(ws):
    """``_stack_weight``'s array: stack on axis 1, merge the first two
    axes (a copy, then a view)."""
    w = numpy.stack(ws, axis=1)
    return w.reshape((w.shape[0] * w.shape[1],) + w.shape[2:])


def _linear(x, w, b):
    """LinearFunction's forward on these operands (its own calls)."""
    if not (x.flags.c_contiguous or x.flags.f_contiguous) and 1 in x.shape:
        x = numpy.ascontiguousarray(x)
    y = numpy.empty((x.shape[0], w.shape[0]), dtype=x.dtype)
    numpy.dot(x, w.T, out=y)
    y += b
    return y


def add(a, b):
    """Chainer's sum of two gradients (``F.add``) where both exist."""
    if a is None:
        return b
    if b is None:
        return a
    return a + b


class Loop(object):
    """One direction of one layer: its weights as the steps use them and,
    per step, what its backward reads. ``cell``: 'lstm' (the gate weights
    stacked as ``_stack_weight`` stacks them, which Chainer does again at
    every step: Stack rank 1, Reshape rank 2) or 'tanh'/'relu' (an
    ``n_step_rnn``: the weights themselves, rank 0)."""

    def __init__(self, cell, w, b):
        self.cell = cell
        self.w_rank = nstep_ranks.weight_rank(cell)
        if cell == 'lstm':
            self.xw = stacked([w[i] for i in GATE_ORDER])
            self.hw = stacked([w[4 + i] for i in GATE_ORDER])
            self.xb = stacked([b[i] for i in GATE_ORDER])
            self.hb = stacked([b[4 + i] for i in GATE_ORDER])
        else:
            self.xw, self.hw = w
            self.xb, self.hb = b
        self.steps = []

    def run(self, xs, h, c, x_ranks, h_rank, c_rank):
        """``_one_directional_loop``'s forward: the h of every step, the
        final h and c, and the ranks the unrolled graph's nodes would have
        (``FunctionNode.rank``: one more than its inputs' highest) for the
        h of every step."""
        out, out_ranks = [], []
        self.x_path_ranks = []
        lstm = self.cell == 'lstm'
        if not lstm:
            act = (tanh_module.Tanh() if self.cell == 'tanh' else
                   relu_module.ReLU())
        w_rank = self.w_rank
        for x, x_rank in zip(xs, x_ranks):
            batch = len(x)
            rest = len(h) - batch
            if rest > 0:
                h, h_rest = h[:batch], h[batch:]
                h_rank += 1
                if lstm:
                    c, c_rest = c[:batch], c[batch:]
                    c_rank += 1
            gates = _linear(x, self.xw, self.xb) + \
                _linear(h, self.hw, self.hb)
            x_path = max(x_rank, w_rank) + 1
            self.x_path_ranks.append(x_path)
            summed = max(x_path, max(h_rank, w_rank) + 1) + 1
            if lstm:
                c_new, h_new = lstm_kernels.forward(c, gates)
                step_rank = max(c_rank, summed) + 1
            else:
                h_new, = act.forward((gates,))
                c_new = None
                step_rank = summed + 1
            self.steps.append((x, h, c, gates, c_new, h_new, rest))
            out.append(h_new)
            out_ranks.append(step_rank)
            if rest > 0:
                h = numpy.concatenate([h_new, h_rest], axis=0)
                h_rank = max(step_rank, h_rank) + 1
                if lstm:
                    c = numpy.concatenate([c_new, c_rest], axis=0)
                    c_rank = max(step_rank, c_rank) + 1
            else:
                h, c = h_new, c_new
                h_rank = c_rank = step_rank
        self.final_ranks = (h_rank, c_rank)
        return out, h, c, out_ranks

    def x_path_order(self, contributions):
        """The steps' contributions to the input-side weights in the order
        Chainer's backward reaches the steps' input Linears: highest rank
        first, equal ranks latest step first (the order their Adds, whose
        ranks rise with the steps, put them on its heap). ``contributions``
        come latest step first."""
        ranks = self.x_path_ranks
        return sorted(contributions, key=lambda c: (-ranks[c[0]], -c[0]))

    def backward(self, g_out, gh, gc, want_x, want_h0):
        """Gradients of the loop's inputs from those of its outputs
        (``g_out[k]``: of step k's h, None where none came; ``gh``, ``gc``:
        of the final h and c, or None). Returns the gradients of the
        steps' x (None where not wanted or none came), of the initial h
        and c, and per step that got a gradient, latest first, (step,
        input weight, recurrent weight, input bias, recurrent bias)
        gradients."""
        n = len(self.steps)
        gxs = [None] * n
        contributions = []
        lstm = self.cell == 'lstm'
        for k in range(n - 1, -1, -1):
            x, h, c, gates, c_new, h_new, rest = self.steps[k]
            batch = len(x)
            if rest > 0:
                # the step's Concat: its gradient split (views), if any
                gh_rest = None if gh is None else gh[batch:]
                gh = None if gh is None else gh[:batch]
                if lstm:
                    gc_rest = None if gc is None else gc[batch:]
                    gc = None if gc is None else gc[:batch]
            g_h_new = add(g_out[k], gh)
            gh_in = gc_in = None
            if g_h_new is not None or (lstm and gc is not None):
                if lstm:
                    gc_in, g_gates = lstm_kernels.grad(
                        c, gates, c_new, gc, g_h_new)
                elif self.cell == 'tanh':
                    g_gates, = tanh_module.TanhGrad(None).forward(
                        (h_new, g_h_new))
                else:
                    g_gates, = relu_module.ReLUGrad2(h_new).forward(
                        (g_h_new,))
                if want_x:
                    gxs[k] = g_gates.dot(self.xw).astype(
                        g_gates.dtype, copy=False)
                if k > 0 or want_h0:
                    gh_in = g_gates.dot(self.hw).astype(
                        g_gates.dtype, copy=False)
                # (each Linear sums its own bias gradient: two arrays of
                # the same bits)
                gb = numpy.asarray(g_gates.sum(axis=0))
                contributions.append((
                    k, g_gates.T.dot(x), g_gates.T.dot(h), gb, gb.copy()))
            if rest > 0:
                # the step's SplitAxis: zeros for a part with no gradient
                gh = _joined(gh_in, gh_rest, h.shape, rest)
                if lstm:
                    gc = _joined(gc_in, gc_rest, h.shape, rest)
            else:
                gh = gh_in
                gc = gc_in if lstm else None
        return gxs, gh, gc, contributions


def _joined(g_head, g_rest, head_shape, rest):
    if g_head is None and g_rest is None:
        return None
    if g_head is None:
        g_head = numpy.zeros(head_shape, dtype=g_rest.dtype)
    if g_rest is None:
        g_rest = numpy.zeros((rest,) + head_shape[1:], dtype=g_head.dtype)
    return numpy.concatenate([g_head, g_rest], axis=0)


def gate_views(a):
    """Stack's backward of ``_stack_weight``: the (4N, ...) gradient seen
    as (N, 4, ...), one view per gate."""
    v = a.reshape((a.shape[0] // 4, 4) + a.shape[1:])
    return [v[:, g] for g in range(4)]
