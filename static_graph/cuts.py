"""Cuts of the graph (``h.unchain()``, ``x.unchain_backward()``) that reach
a call the library runs as one node (a replayed call, a recording call).

Define-by-run cuts the functions that lie before the cut Variable; a call
that is one node has outputs computed from one another inside it (an RNN
step's ``h`` and ``y = out(h)``), and replay cannot stop a gradient inside
the call. So:

* ``unchain_backward`` reaching such a call before any backward ran
  through it (inside a BPTT window, an evaluation call with backprop
  enabled) while more than one of its outputs lives is an error
  (``unchain``): cutting the node as Chainer cuts one would cut all its
  outputs (a later backward through ``y`` lost its gradient, silently),
  and cutting fewer would let one flow on past ``h``. After a backward
  ran through it (the truncated BPTT loop's cut) the node is cut as
  Chainer cuts one. Define-by-run's walk cuts only the functions before
  the Variables it enters the call through (``entered``, which the walk,
  ``_unchain_backward``, notes); an output of the call that none of them
  was computed from keeps its functions there, and a later backward
  through it carries a gradient on past the cut (``h.unchain_backward()``
  after a first loss, then a second loss of ``y = out(h)``). Such an
  output gets a ``Severed`` creator: a backward that reaches it is an
  error (before 2026-11-28 it got nothing through the call, silently),
  unless the functions define-by-run keeps lead only to inputs of the
  call whose own functions its walk cut (``L.StatefulZoneoutLSTM``'s
  ``c``, a mix of the previous ``c`` and this call's, while the walk
  came in through ``h``): there define-by-run's gradient stops at those
  Variables, now leaves, and the creator drops it, as silently
  (``walked``: the Variables whose functions the walk cut).
* ``h.unchain()`` cuts ``h``'s edge alone, as in define-by-run; a backward
  that comes into the call afterwards raises where ``h`` is one of the
  outputs other ops of the call read (``check``). ``Variable.unchain`` is
  wrapped to note the cut on the node (``node.cut``), so it is seen also
  after ``h`` is dropped.
"""
import weakref

import numpy

import chainer
from chainer import function_node

from schedules import liveness

from static_graph import signature
from static_graph import traced

_orig_unchain = chainer.Variable.unchain
_orig_unchain_backward = chainer.Variable.unchain_backward


def _unchain(self):
    creator = self.creator_node
    cut = getattr(creator, 'cut', None)
    if cut is not None:
        for i, ref in enumerate(creator.outputs or ()):
            if ref() is self.node:
                cut.add(i)
    return _orig_unchain(self)


def _unchain_backward(self):
    """Chainer's ``unchain_backward`` (the same walk), except that a call
    run as one node is cut last, once the walk has found every output it
    enters the call through (``entered``), and that the walk goes on only
    into the inputs of the call that define-by-run's, entering there,
    reaches (``_inputs_entered``; again where it enters through more)."""
    if self._has_chainerx_array:
        return _orig_unchain_backward(self)
    cand_funcs = []
    seen_set = set()
    entered = {}
    went_into = {}    # a call of ours -> the input positions walked into
    walked = weakref.WeakSet()    # (not kept alive: see unchain's count)

    def add_cand(cand, via):
        if cand is not None:
            walked.add(via)
            if 'cut' in cand.__dict__:       # a call of ours
                at = entered.setdefault(cand, set())
                new = _positions(cand, via) - at
                at |= new
                if new and cand in seen_set:
                    cand_funcs.append(cand)     # (walked into further)
            if cand not in seen_set:
                cand_funcs.append(cand)
                seen_set.add(cand)

    add_cand(self.creator_node, self.node)
    rec = traced.active_recording()
    arguments = rec.argument_paths if rec is not None and \
        not rec.depth else None
    while cand_funcs:
        func = cand_funcs.pop()
        inputs = func.inputs
        if func in entered:
            done = went_into.setdefault(func, set())
            more = [j for j in _inputs_entered(func, entered[func])
                    if j not in done]
            done.update(more)
            inputs = [inputs[j] for j in more]
        for var in inputs:
            if arguments and var.creator_node is None:
                _reaches_argument(rec, var)
            add_cand(var.creator_node, var)
        if func not in entered:
            func.unchain()
    for func, positions in entered.items():
        func.entered = positions
        func.walked = walked
        try:
            func.unchain()
        finally:
            func.__dict__.pop('entered', None)
            func.__dict__.pop('walked', None)


def _reaches_argument(rec, vn):
    """A cut inside a recording call that walks back to an argument's copy:
    define-by-run's walk goes on into the caller's graph behind it (the
    earlier calls of an RNN) and cuts it; the copy has none. A reason."""
    v = vn.get_variable_or_none()
    if v is not None and id(v) in rec.argument_paths:
        rec.add_reason(
            'a cut inside the call (unchain_backward) reaches argument %s, '
            'whose graph (the caller\'s) define-by-run would cut too; the '
            'recording runs on a copy of it'
            % signature.path_text(rec.argument_paths[id(v)][0]))
        # (The recording call cuts the caller's Variable too, as
        # define-by-run's walk goes on into it.)
        caller = rec.argument_paths[id(v)][1]
        if rec.phase == 'forward' and caller.creator_node is not None:
            caller.unchain_backward()


def _positions(node, vn):
    return set(i for i, ref in enumerate(node.outputs or ()) if ref() is vn)


def reach_of(outs, inputs):
    """For each of a recording's output Variables ``outs``, the positions
    of ``inputs`` (the Variables the call's node takes, as the recording
    saw them) that define-by-run's walk back from it reaches along the
    graph's edges: not through an op made under ``no_backprop_mode()``, or
    a ``chainer.Variable(m.array)``, which read an input's array without
    one."""
    at = {}
    for j, v in enumerate(inputs):
        if isinstance(v, chainer.Variable):
            at.setdefault(id(v.node), []).append(j)
    out = []
    for v in outs:
        hit, seen, todo = set(), set(), [v.node]
        while todo:
            vn = todo.pop()
            hit.update(at.get(id(vn), ()))
            f = vn.creator_node
            if f is None or id(f) in seen:
                continue
            seen.add(id(f))
            todo.extend(f.inputs or ())
        out.append(frozenset(hit))
    return tuple(out)


def _inputs_entered(node, positions):
    """The positions of ``node.inputs`` (a call of ours) that
    define-by-run's walk, entering the call at its outputs ``positions``,
    goes on into: those its recording's graph reaches from there
    (``reach_of``; else those read by the ops of the schedule it reaches,
    or all where the call's schedule is not known)."""
    reach = call_reach(node)
    if reach is not None and len(reach) == len(node.outputs or ()):
        return sorted(set().union(*(reach[i] for i in positions
                                    if i < len(reach))))
    schedule = call_schedule(node)[2]
    if schedule is None or len(schedule[2]) != len(node.inputs):
        return range(len(node.inputs))
    ops, outputs, inputs = schedule
    seen = _walk(ops, outputs, positions)[2]
    return [j for j, b in enumerate(inputs) if b in seen]


def _walk(ops, outputs, positions):
    """Define-by-run's walk back from ``outputs`` at ``positions`` through
    ``ops``: (op index by buffer made, the ops reached, every buffer
    reached)."""
    return liveness.ancestors(
        ops, [outputs[i] for i in positions if i < len(outputs)])


chainer.Variable.unchain = _unchain
chainer.Variable.unchain_backward = _unchain_backward

MESSAGE = (
    'an output of a call of %s that another of its outputs was computed '
    'from was cut from the graph (h.unchain(), h.unchain_backward()) while '
    'a backward may still come through the call: define-by-run stops the '
    'gradient there; the call, run as one node, cannot. Cut after the '
    'backward (loss.unchain_backward()), or run this with '
    'chainer.config.use_static_graph = False')


SEVERED = (
    'a backward came into an output of a call of %s after a cut '
    '(unchain_backward) reached the call through other outputs that this '
    'one was not computed from: define-by-run keeps the functions between '
    'them and carries the gradient through; the call, run as one node, '
    'was cut whole. Backpropagate every loss before the cut, or run this '
    'with chainer.config.use_static_graph = False')


def call_schedule(node):
    """Of a call of ours (a ReplayNode, a RecordNode): whether a backward
    may still come through it, the method's name, and the call's forward
    ops with its output and input buffer ids (None where not known)."""
    entry = node.entry
    schedule = None
    if entry is not None:
        # (Once a backward ran through it, the outputs define-by-run
        # would not cut get a creator that refuses a later backward.)
        may = not (node.done or node.__dict__.get('backward_ran'))
        name = entry.method_name
        f = entry.forward
        schedule = f.ops, f.outputs, f.inputs
    else:      # (the recording call, until its backward)
        capture = getattr(node, 'capture', None)
        may = capture is not None
        name = capture.name if may else ''
        again = node.__dict__.get('again')
        if again is not None:   # (its key fell back at the build)
            name = again.name
            schedule = again.rec.forward_ops, again.out_bids, list(
                again.leaf_bids) + [b for b, _, _ in again.params]
    return may, name, schedule


def call_reach(node):
    """Of a call of ours: per output, the input positions define-by-run's
    walk from it reaches (``reach_of``), or None."""
    d = node.__dict__
    for e in (node.entry, d.get('built'),
              getattr(d.get('again'), 'entry', None),
              getattr(d.get('capture'), 'entry', None)):
        if e is not None:
            return e.cut_reach
    return None


def unchain_call(node, default):
    """``unchain`` of a call of ours (a ReplayNode, a RecordNode)."""
    may, name, schedule = call_schedule(node)
    unchain(node, may, name, default, schedule)


def unchain(node, may_backward, method_name, default, schedule=None):
    """``FunctionNode.unchain`` for a call run as one node: an error while
    a backward may still come through it (``may_backward``) and more than
    one of its outputs lives; ``default(node)`` (Chainer's) otherwise,
    then a ``Severed`` creator for each live output that define-by-run's
    walk, entering the call where ``unchain_backward`` did, would not have
    cut (``schedule``: the call's forward ops and output buffer ids)."""
    if may_backward and node.outputs and sum(
            ref() is not None for ref in node.outputs) > 1:
        raise RuntimeError(MESSAGE % method_name)
    entered = node.__dict__.get('entered')
    severs, passes = [], []   # (output node, raises), (output, input node)
    if entered is not None and schedule is not None and node.outputs and \
            node.inputs is not None and len(schedule[2]) == len(node.inputs):
        ops, outputs, inputs = schedule

        def live(i):
            return node.outputs[i]() if i < len(node.outputs) else None

        needs = set(b for b, vn in zip(inputs, node.inputs)
                    if vn.requires_grad)
        walked = node.__dict__.get('walked', ())
        cut = set(b for b, vn in zip(inputs, node.inputs) if vn in walked)
        severed, dropped = uncut_outputs(ops, outputs, entered, needs, cut)
        severs = [(live(i), i in severed) for i in severed + dropped]
        # An argument the call returns as it is: define-by-run's output is
        # the argument's Variable, whose graph the walk did not enter
        # there.
        made = set(b for op in ops for b in op.outputs)
        position = {}
        for j, b in enumerate(inputs):
            position.setdefault(b, j)
        passes = [(live(i), node.inputs[position[b]])
                  for i, b in enumerate(outputs)
                  if i not in entered and b not in made and b in position]
    default(node)
    for vn, raises in severs:
        if vn is not None:
            _sever(vn, method_name, raises)
    for vn, source in passes:
        if vn is not None:
            _pass_on(vn, source)


def uncut_outputs(ops, outputs, entered, needs, cut=()):
    """The positions of ``outputs`` (buffer ids) made by an op that no
    output at the positions ``entered`` was computed from (the outputs
    whose functions define-by-run's walk, entering there, leaves in place)
    and computed, through such ops, from an input that takes a gradient
    (``needs``: a parameter, an argument that needs one), in two lists:
    where a later backward through define-by-run's functions would carry
    that gradient on, and where it would stop at inputs whose functions
    the walk cut (``cut``: inputs whose creator the walk cut), which then
    are leaves. (A leaf's gradient is kept on its Variable, where one
    lives: ``h.grad``; not told apart.)"""
    made_by, reached, _ = _walk(ops, outputs, entered)
    stops = set(cut)
    severed, dropped = [], []
    for i, b in enumerate(outputs):
        k = made_by.get(b)
        if i in entered or k is None or k in reached:
            continue
        todo, seen_ops, gets = [k], set(), None
        while todo:
            k = todo.pop()
            if k in seen_ops:
                continue
            seen_ops.add(k)
            read = [x for x in ops[k].inputs if x in needs]
            if any(x not in stops for x in read):
                gets = severed
                break
            if read:
                gets = dropped
            todo.extend(made_by[x] for x in ops[k].inputs
                        if x in made_by and made_by[x] not in reached)
        if gets is not None:
            gets.append(i)
    return severed, dropped


class Severed(function_node.FunctionNode):
    """The creator of an output left uncut by define-by-run's walk (see
    the module docstring): a backward that brings it a gradient raises
    (``raises``) or goes no further, as define-by-run's stops at the
    Variables its walk cut."""

    def __init__(self, method_name, raises=True):
        self.method_name = method_name
        self.raises = raises

    def backward(self, indexes, grad_outputs):
        if self.raises and any(g is not None for g in grad_outputs):
            raise RuntimeError(SEVERED % self.method_name)
        return (None,) * len(indexes)


def _sever(vn, method_name, raises=True):
    node = Severed(method_name, raises)
    # (An input that takes a gradient: Chainer skips a node without one.)
    node.anchor = chainer.Variable(numpy.zeros((), numpy.float32))
    node.inputs = (node.anchor.node,)
    node.outputs = (weakref.ref(vn),)
    node.rank = max(vn.rank - 1, 0)
    vn.creator_node = node


class PassedOn(function_node.FunctionNode):
    """The creator of an output that is an argument returned as it is,
    once a cut took the call's node away: its gradient goes on to the
    argument's node as it is, as define-by-run's (the argument's Variable
    itself) would."""

    def backward(self, indexes, grad_outputs):
        return grad_outputs


def _pass_on(vn, source):
    node = PassedOn()
    node.inputs = (source,)
    node.outputs = (weakref.ref(vn),)
    # (After the argument's other users, before its own creator.)
    node.rank = source.rank
    vn.creator_node = node


def check(node, inside, method_name):
    """Raise where an output other ops of the call read (``inside``: their
    positions) was cut from the call (``node.cut``, or one found without
    its creator)."""
    outputs = node.outputs or ()
    for i in inside:
        vn = outputs[i]() if i < len(outputs) else None
        if i in node.cut or vn is not None and vn.creator_node is None:
            raise RuntimeError(MESSAGE % method_name)
