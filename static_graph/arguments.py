"""The recording's own copies of a call's array arguments (capture.py):
input buffers of the recording, laid out as the caller's, one object where
the caller gave one object twice."""
import numpy

import chainer

from schedules import ir
from static_graph import arrayutil
from static_graph import cuts  # NOQA  (its Variable wrappers: graph_accessors)
from static_graph import frozen_values
from static_graph import outputs
from static_graph import signature
from static_graph import traced


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
        raw = leaf.raw_array if variable else leaf
        a = shared.get(i)
        if a is None:
            a = arrayutil.copy_exact(raw)
            if isinstance(raw, numpy.ndarray) and \
                    type(raw) is not numpy.ndarray:
                a = _plain_subclass(rec, a, path)
            rec.callers[id(a)] = raw
        rec.argument_copies.append((a, raw))
        leaf_bids.append(rec.new_buffer(a, ir.INPUT, name=path))
        if variable:
            v = chainer.Variable(a, requires_grad=leaf.requires_grad,
                                 name=leaf.name)
            if leaf.grad_var is not None:
                # The caller's gradient, as define-by-run's method sees it
                # (a use of it makes the call fall back: patches).
                v.grad_var = leaf.grad_var
            own = outputs.own_attributes(leaf)
            if own:
                # (``x.tag = 'a'`` before the call: the method may read
                # it, which replay would freeze.)
                for k in own:
                    setattr(v, k, getattr(leaf, k))
                rec.add_reason(
                    'argument %s (a Variable) carries attribute %s of its '
                    "own, which the method may read and replay would not"
                    % (signature.path_text(path), ', '.join(own)))
            rec.argument_paths[id(v)] = (path, leaf, v)
            inner.append(v)
        else:
            if type(a) is numpy.ndarray:
                a = rec.trace(a)
                if not leaf.flags.writeable:
                    # (The method's write raises as define-by-run's does;
                    # the copy itself stays writable: ``x.setflags(
                    # write=True)`` works as on an array that owns its
                    # memory.)
                    a.flags.writeable = False
            inner.append(a)
    return inner, leaf_bids


_NONE = object()


def attributes_set(rec):
    """Attributes the method set on an argument Variable (``x.memo = h``:
    on the recording's copy of it): set on the caller's too, as
    define-by-run's method sets them; a reason, since replay sets none."""
    for path, caller, copy in rec.argument_paths.values():
        own = [k for k in outputs.own_attributes(copy)
               if getattr(caller, k, _NONE) is not getattr(copy, k)]
        for k in own:
            setattr(caller, k, getattr(copy, k))
        if own:
            rec.add_reason(
                'it sets attribute %s on argument %s (a Variable), which '
                'replay would not' % (', '.join(own),
                                      signature.path_text(path)))


def _plain_subclass(rec, a, path):
    """The recording's copy of an argument of a NumPy subclass: a memmap's
    as a plain array (the same values and arithmetic: traced, so what the
    method reads of it is seen); any other (a masked array, numpy.matrix,
    one of your own) cannot be traced as it computes: a reason."""
    if isinstance(a, numpy.memmap):
        # (Memory of its own: a view's base would be the memmap copy,
        # which no buffer is.)
        return arrayutil.copy_exact(a.view(numpy.ndarray))
    rec.add_reason(
        'argument %s is a %s.%s, whose values the recording cannot watch '
        'as it computes (a branch on them, a write into it would be '
        'frozen)' % (path, type(a).__module__, type(a).__name__))
    return a


def sync_gradients(rec, inner, leaves, paths):
    """A gradient the method set on an argument's copy (``x.cleargrad()``,
    ``x.grad = g``, ``chainer.grad(..., set_grad=True)``, a backward
    inside the method): the caller's Variable gets it, where define-by-run
    sets it (such a call falls back: patches, which name the use). So does
    a name the method gave it (``x.name = 'input'``), which replay would
    not give: a reason (``rec`` None: the method raised)."""
    for i, (v, a) in enumerate(zip(inner, leaves)):
        if v is a or not isinstance(a, chainer.Variable) or \
                not isinstance(v, chainer.Variable):
            continue
        _carry_gradient(v, a)
        if v.name != a.name:
            a.name = v.name
            if rec is not None:
                rec.add_reason('the method names its argument %s (.name '
                               '= %r); replay would not' % (paths[i],
                                                            v.name))


def _carry_gradient(src, dst):
    """``dst`` gets the gradient ``src`` holds, where they differ."""
    if src._grad_var is not dst._grad_var or src._grad is not dst._grad:
        dst._set_grad_var_without_check(src.grad_var)


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
        if arrayutil.plain_array(a) and a.size:
            by_root.setdefault(id(arrayutil.root_of(a)), []).append((i, a))
    out = {}
    for group in by_root.values():
        if len(group) < 2:
            continue      # (most: each argument its own memory)
        for ks in arrayutil.overlapping([a for _, a in group]):
            arrays = [group[k][1] for k in ks]
            if len(ks) > 1 and not _sparse_on_device(arrays):
                out.update(zip([group[k][0] for k in ks],
                               arrayutil.copies_sharing(arrays)))
    return out


def _sparse_on_device(arrays):
    """CuPy arrays spread thinly over their memory (columns of a large
    matrix): copies sharing one block would take all of it, where each
    gets a dense copy of its own (NumPy's keep their strides, and so the
    whole span, anyway). Such copies do not see each other's writes: a
    method writing into one argument in place and reading another over
    the same memory is unlike define-by-run in the recording call (it
    falls back)."""
    if isinstance(arrays[0], numpy.ndarray):
        return False
    lo, hi = arrayutil.span(arrays)
    return hi - lo > 2 * sum(a.nbytes for a in arrays)


# Elements in all of a container argument that the check below compares:
# all of them (a call past signature.MAX_KEY_VALUES records only among
# calls that wait for their backward, where it is walked whole anyway).
ARGUMENT_ITEMS = float('inf')
_CONTAINERS = (list, dict, tuple)


def containers(args, kwargs):
    """[(position or keyword, container, its values frozen)] for the
    method's container arguments (lists, dicts, tuples holding them), as
    the method gets them (new ones, signature.rebuild): what it changes in
    them (``stats['n'] += 1``, ``hidden.append(h)``) replay would not
    change."""
    return [(at, v, frozen_values.freeze(v, ARGUMENT_ITEMS))
            for at, v in list(enumerate(args)) + list(kwargs.items())
            if isinstance(v, _CONTAINERS)]


def check_containers(rec, before, made, inner, leaves, method, chain):
    """A container argument the method changed: a reason (``rec`` None:
    the method raised), and the caller's lists and dicts (``made``: (the
    method's, the caller's) pairs) get what the method left in its own,
    with the caller's arrays and Variables for the copies, as under
    define-by-run. One the method kept on a link (``self.cfg = cfg``) is
    the caller's there too."""
    mine = dict((id(new), old) for new, old in made)
    if made:
        tuples = {}

        def caller_container(x):
            return mine.get(id(x), x)
        for link in chain.links():
            d = link.__dict__
            for k, v in list(d.items()):
                if isinstance(v, _CONTAINERS):
                    back = _to_callers(caller_container(v), caller_container,
                                       3, tuples)
                    if back is not v:
                        d[k] = back
    changed = [at for at, v, frozen in before if frozen is not None and
               not frozen_values.holds(v, frozen, ARGUMENT_ITEMS)]
    if not changed:
        return
    if rec is not None:
        at = changed[0]
        if not isinstance(at, str):
            names = signature.arg_names_of(method)
            at = names[at] if at < len(names) else 'args[%d]' % at
        rec.add_reason('the method changes its argument %s in place (an '
                       'item set, added or removed); replay would not '
                       'repeat that' % at)
    back = dict((id(v), a) for v, a in zip(inner, leaves))
    back.update(mine)

    def caller(x):
        x = back.get(id(x), x)
        return traced.untraced(x) if isinstance(x, numpy.ndarray) else x

    for new, old in made:
        if isinstance(new, list):
            old[:] = [caller(x) for x in new]
        else:
            items = [(k, caller(x)) for k, x in new.items()]
            old.clear()
            old.update(items)
    # What the method put into them, further down (``box['hist'] =
    # box['hist'] + [h]``), and into the caller's own containers (one that
    # held no array: ``hidden.append(x)``): the caller's for the copies.
    own = set(id(new) for new, _ in made)
    for at, v, frozen in before:
        if at in changed and id(v) not in own:
            _to_callers(v, caller, 3)
    for _, old in made:
        _to_callers(old, caller, 3)


def _to_callers(v, caller, depth, tuples=None):
    """``v`` with the recording's copies in it (``caller``: the caller's
    object for one) replaced by the caller's, ``depth`` levels of lists,
    dicts (their subclasses too: an OrderedDict) and plain tuples down
    (``self.kept = {'cfg': cfg}``, ``box['pair'] = (box['a'], x)``): lists
    and dicts changed in place, only where an item changes; a tuple made
    anew (once: ``tuples``, id -> the new one, for a tuple held twice)."""
    if isinstance(v, (list, dict)):
        if not depth:
            return v
        for k, x in list(enumerate(v) if isinstance(v, list) else
                         v.items()):
            y = caller(x)
            if isinstance(y, _CONTAINERS):
                y = _to_callers(y, caller, depth - 1, tuples)
            if y is not x:
                v[k] = y
        return v
    if type(v) is tuple and depth:
        if tuples is not None and id(v) in tuples:
            return tuples[id(v)]
        items = [_to_callers(caller(x), caller, depth - 1, tuples)
                 for x in v]
        if any(a is not b for a, b in zip(items, v)):
            new = tuple(items)
            if tuples is not None:
                tuples[id(v)] = new
            return new
    return v


_GRADIENT_USED = ('it uses the gradient of argument %s (%s) at %s:%d; '
                  'replay would not repeat that')
_GRAPH_USED = ('it uses the graph of argument %s (%s) at %s:%d, which the '
               'recording runs on a copy of')


def gradient_used(rec, variable, what, frame, message=_GRADIENT_USED):
    """The method used the gradient of an argument's copy (``what``:
    ``.grad``, ``.cleargrad()``...) at ``frame``: a reason, as replay
    would neither see the caller's gradient nor set it (``message``: or
    its graph, graph_read)."""
    if rec.phase == 'forward':
        rec.add_reason(message % (
            signature.path_text(rec.argument_paths[id(variable)][0]),
            what, frame.f_code.co_filename, frame.f_lineno))


def _on_argument(orig, what, user_caller, message, on_caller=None):
    """``orig`` (a Variable's or VariableNode's accessor or method)
    wrapped: where user code (``user_caller()``, patches.py: its frame, or
    None) calls it on an argument's copy while a call records, a reason
    (``gradient_used`` with ``message``); with ``on_caller``, what
    ``on_caller(orig, copy, caller's, args, kwargs)`` returns (the caller's
    Variable, or its node for a node's)."""
    def wrapper(self, *args, **kwargs):
        rec = traced.active_recording()
        if rec is not None and not rec.depth:
            node = type(self) is _VariableNode      # (``h.node.creator``)
            v = self.get_variable_or_none() if node else self
            if id(v) in rec.argument_paths:
                f = user_caller()
                if f is not None:
                    gradient_used(rec, v, what, f, message)
                    if on_caller is not None and rec.phase == 'forward':
                        caller = rec.argument_paths[id(v)][1]
                        return on_caller(orig, self, caller.node if node
                                         else caller, args, kwargs)
        return orig(self, *args, **kwargs)

    wrapper.__name__ = getattr(orig, '__name__', what)
    return wrapper


def gradient_accessor(orig, what, user_caller):
    """A Variable method or accessor of the gradient, wrapped: used by
    the method on an argument's copy (``x.grad_var``, ``x.cleargrad()``,
    ``x.grad = g``), a reason (``gradient_used``). What the method set
    there goes to the caller's Variable after the call
    (``sync_gradients``)."""
    return _on_argument(orig, what, user_caller, _GRADIENT_USED)


def graph_read(orig, what, user_caller, cut=False):
    """A Variable accessor of the graph wrapped (``x.creator``,
    ``x.creator_node``, ``x.rank``; ``cut``: ``x.unchain()``,
    ``x.unchain_backward()``): used by the method on an argument's copy, a
    reason, as replay would take the way the recording took. The copy has
    no creator (the recording runs on copies): the method is answered with
    the caller's graph (``if h.creator is None`` takes define-by-run's
    way), and a cut cuts the caller's Variable too (``h.unchain_backward()``
    on the state handed in cuts the earlier calls, as define-by-run's
    does; before 2026-11-28 the recording call did neither, silently)."""
    return _on_argument(orig, what, user_caller, _GRAPH_USED,
                        _cut_both if cut else _callers_answer)


def _callers_answer(orig, copy, caller, args, kwargs):
    return orig(caller, *args, **kwargs)


def _cut_both(orig, copy, caller, args, kwargs):
    orig(caller, *args, **kwargs)
    return orig(copy, *args, **kwargs)


def onto_caller(outputs):
    """Before a backward inside the method (``y.backward()``,
    ``chainer.backward``, ``chainer.grad(..., retain_grad=True)``) while a
    call records, from ``outputs``: define-by-run's goes on into the
    caller's graph behind a Variable argument that has one (the caller's
    layers, an earlier call), where it accumulates the caller's gradients;
    the recording's copy of it has none. The recording so far moves onto
    the caller's Variables (``splice.into_caller``: the call falls back,
    as such a backward is a reason), so that this backward is
    define-by-run's. Returns the copies' callers ({id(copy): caller's})
    once moved, else None."""
    rec = traced.active_recording()
    if rec is None or rec.depth or rec.phase != 'forward' or \
            not rec.argument_paths:
        return None
    if not rec.arguments_spliced:
        if all(e[1].creator_node is None
               for e in rec.argument_paths.values()):
            return None
        from static_graph import splice
        pairs = [(e[2], e[1]) for e in rec.argument_paths.values()]
        roots = [v for v in outputs if isinstance(v, chainer.Variable)]
        if not splice.into_caller([op.node for op in rec.forward_ops],
                                  pairs, roots):
            return None
        rec.arguments_spliced = True
    for _, caller, copy in rec.argument_paths.values():
        # What the method did to a copy's gradient before (``x.cleargrad()``,
        # ``x.grad = g``): the caller's, where this backward accumulates.
        _carry_gradient(copy, caller)
    return _callers(rec)


def _callers(rec):
    """{id(an argument's copy): the caller's Variable}."""
    return dict((vid, e[1]) for vid, e in rec.argument_paths.items())


def gradients_to_copies(rec):
    """After a backward inside the method that ran on the caller's
    Variables (``onto_caller``): the gradients it left on them, on the
    copies the method holds too (``x.grad`` read after it)."""
    for _, caller, copy in rec.argument_paths.values():
        _carry_gradient(caller, copy)


_VariableNode = chainer.variable.VariableNode


def _rank_read(orig, user_caller):
    """``rank`` wrapped: read by user code while a call records, of any
    Variable (an argument's, or one made from it: ``(h * 2).rank``), it
    depends on the caller's graph (how deep the arguments sit in it),
    which the key does not hold: a reason. The method is answered with
    define-by-run's rank (``_caller_rank``)."""
    def getter(self):
        rec = traced.active_recording()
        if rec is None or rec.depth or rec.phase != 'forward':
            return orig(self)
        f = user_caller()
        if f is None:
            return orig(self)
        rec.add_reason('it reads the rank of a Variable (.rank) at %s:%d, '
                       "which follows the caller's graph; replay would "
                       'take the way the recording took'
                       % (f.f_code.co_filename, f.f_lineno))
        node = self if type(self) is _VariableNode else self.node
        return _caller_rank(rec, node)
    return getter


def _caller_rank(rec, vn):
    """The rank of VariableNode ``vn`` under define-by-run: an argument
    copy's is its caller's, a detached leaf's its link Variable's
    (link_state.detach_link_variables), and a node's is the largest of its
    inputs' (FunctionNode.apply)."""
    memo = {}    # id(function node) -> its rank
    # (A node the recording did not make has define-by-run's rank already:
    # a decorated call's, the caller's.)
    made = set(id(op.node) for op in rec.forward_ops)

    def known(x):
        v = x.get_variable_or_none()
        entry = rec.argument_paths.get(id(v)) if v is not None else None
        if entry is not None:
            return entry[1].node._rank
        held = rec.detached_from.get(id(v)) if v is not None else None
        if held is not None:       # (a link's state from an earlier call)
            return held
        node = x.creator_node
        if node is None or id(node) not in made:
            return x._rank
        got = memo.get(id(node))
        return None if got is None else got + 1

    top = known(vn)
    if top is not None:
        return top
    stack = [vn.creator_node]
    while stack:      # (no recursion: a graph of thousands of ops)
        node = stack[-1]
        ranks = [known(x) for x in node.inputs]
        if None in ranks:
            stack.extend(x.creator_node for x, r in zip(node.inputs, ranks)
                         if r is None)
            continue
        memo[id(node)] = max(ranks or [0])
        stack.pop()
    return known(vn)


def graph_accessors(cls, user_caller):
    """({name: wrapped}, {name: original}) of the graph accessors of
    ``cls`` (Variable, or VariableNode: ``h.node.creator``), for
    patches.py to install while a call records."""
    wrapped, orig = {}, {}
    for name in ('creator', 'creator_node', 'rank'):
        p = cls.__dict__[name]
        orig[name] = p
        read = _rank_read(p.fget, user_caller) if name == 'rank' else \
            graph_read(p.fget, '.' + name, user_caller)
        wrapped[name] = property(read, p.fset, doc=p.__doc__)
    for name in ('unchain', 'unchain_backward'):
        if name in cls.__dict__:
            orig[name] = cls.__dict__[name]
            wrapped[name] = graph_read(orig[name], '.%s()' % name,
                                       user_caller, cut=True)
    return wrapped, orig


def _mapped(callers, vs):
    return [callers.get(id(v), v) for v in vs]


def _variable_backward(orig):
    def backward(self, *args, **kwargs):
        callers = onto_caller((self,))
        if callers is None:
            return orig(self, *args, **kwargs)
        try:
            return orig(callers.get(id(self), self), *args, **kwargs)
        finally:
            gradients_to_copies(traced.active_recording())
    backward.__doc__ = orig.__doc__
    return backward


def _backward(orig):
    def backward(outputs, *args, **kwargs):
        callers = onto_caller(outputs)
        if callers is None:
            return orig(outputs, *args, **kwargs)
        try:
            return orig(_mapped(callers, outputs), *args, **kwargs)
        finally:
            gradients_to_copies(traced.active_recording())
    backward.__doc__ = orig.__doc__
    return backward


def _grad(orig):
    names = orig.__code__.co_varnames[:orig.__code__.co_argcount]

    def grad(*args, **kwargs):
        rec = traced.active_recording()
        if rec is None or rec.depth or rec.phase != 'forward':
            return orig(*args, **kwargs)
        bound = dict(zip(names, args))
        bound.update(kwargs)
        if bound.get('retain_grad'):
            callers = onto_caller(bound.get('outputs', ()))
        elif rec.arguments_spliced:
            # (A penalty's after such a backward: its graph reads the
            # caller's Variables now.)
            callers = _callers(rec)
        else:
            callers = None
        if callers is None:
            return orig(*args, **kwargs)
        for name in ('outputs', 'inputs'):
            if bound.get(name) is not None:
                bound[name] = _mapped(callers, bound[name])
        try:
            return orig(**bound)
        finally:
            gradients_to_copies(rec)
    grad.__doc__ = orig.__doc__
    return grad


def backward_wrappers(variable_cls, backprop_module, function_node_module):
    """({name: wrapped}, {name: original}) of ``Variable.backward``, and
    [(namespace, {name: wrapped}, {name: original})] of ``chainer.backward``
    and ``chainer.grad`` where they are defined and in ``chainer``, for
    patches.py to install while a call records (onto_caller)."""
    vb = variable_cls.__dict__['backward']
    b = backprop_module.backward
    g = function_node_module.grad
    spaces = [(backprop_module.__dict__, {'backward': _backward(b)},
               {'backward': b}),
              (function_node_module.__dict__, {'grad': _grad(g)},
               {'grad': g})]
    wrapped = {}
    for _, d, _ in spaces:
        wrapped.update(d)
    spaces.append((chainer.__dict__, wrapped,
                   {'backward': b, 'grad': g}))
    return {'backward': _variable_backward(vb)}, {'backward': vb}, spaces
