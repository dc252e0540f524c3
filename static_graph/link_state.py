"""What a recording call does to the chain around it, and puts back.

Before the method runs: the links' recurrent Variables are swapped for
detached leaves (``detach_link_variables``), their array attributes handed
over traced (``trace_held_arrays``) and their ``__dict__`` snapshotted.
After: the attributes the method assigned become the entry's attribute
writes (``attr_changes``), the leaves and arrays are put back, and what
the method wrote into its argument arrays reaches the caller's.
"""
import sys
import weakref

import numpy

import chainer

from schedules import bits
from schedules import ir
from static_graph import arrayutil
from static_graph import analysis
from static_graph import entry as entry_module
from static_graph import frozen_values
from static_graph import kept_memory
from static_graph import link_values
from static_graph import node_attrs
from static_graph import traced


def snapshot_links(chain):
    """[(link __dict__, a copy of it, the link's path)]."""
    return [(link.__dict__, dict(link.__dict__), path)
            for path, link in chain.namedlinks()]


def held_links(chain):
    """[(path, link)] for the links that the chain's links hold other than
    as children, with the links under them: a back-reference to an owner
    (also through a ``weakref.proxy`` or a ``weakref.ref``), a link kept
    outside ``init_scope``, one in a list, tuple, dict or namespace
    attribute (a proxy stands for its link). The method may read them as
    its own, by any way (``getattr``, Chainer's own code when it calls
    one): they are watched whole, as the chain's links are (link_values.
    Watch's ``held``, entry.link_structure). So an owner that changes its
    own state at every call (a counter, its last activations) makes every
    call of the method record again, and a large one costs each replay
    its check (docs/fallbacks.md)."""
    seen = set(id(link.__dict__) for link in chain.links())
    out = []
    todo = list(chain.namedlinks())
    while todo:
        path, link = todo.pop()
        for k, v in list(link.__dict__.items()):
            if k in link_values.MANAGED or arrayutil.dead_proxy(v) or \
                    isinstance(v, frozen_values.SCALARS):
                continue
            for where, found in _links_in(v):
                if id(found.__dict__) in seen:
                    continue
                for sub_path, sub in found.namedlinks():
                    if id(sub.__dict__) in seen:
                        continue
                    seen.add(id(sub.__dict__))
                    p = '%s/%s%s%s' % (path.rstrip('/'), k, where,
                                       '' if sub_path == '/' else sub_path)
                    out.append((p, sub))
                    todo.append((p, sub))
    return out


def hook_scopes(chain, name, method, held):
    """(whether the chain's own link hooks run inside this call, the ids
    of the ``__dict__``s of the ``held`` links that hold the chain) for
    link_values.Watch. The chain's own hooks run around the method its
    ``Link.__call__`` runs (``forward``, or the function the class's
    forward is), inside a call of any other (a decorated ``loss`` that
    calls ``self(x)``, called from ``forward`` or not); an owner's run
    around its forward, outside the call of the child it holds."""
    forward = getattr(type(chain), 'forward', None)
    outside = _in_call_of(chain) and (
        name == 'forward' or
        getattr(forward, '__wrapped__', None) is method)
    owners = set(id(link.__dict__) for _, link in held
                 if any(sub is chain for sub in link.links()))
    return not outside, owners


def _in_call_of(chain):
    """Is this call inside ``chain``'s ``Link.__call__``?"""
    f = sys._getframe(2)
    for _ in range(64):
        if f is None:
            return False
        if f.f_code is _LINK_CALL and f.f_locals.get('self') is chain:
            return True
        f = f.f_back
    return False


_LINK_CALL = chainer.Link.__call__.__code__


def _links_in(v, depth=1):
    """[(where, link)]: the links ``v`` is or refers to (a proxy, a
    ``weakref.ref``), or that a list, tuple, dict or namespace ``v``
    holds, one level down (``where``: ``[1]``, ``['k']``, ``.k``)."""
    if type(v) is weakref.ref:
        v = v()
    if arrayutil.dead_proxy(v):
        return []
    if arrayutil.is_link(v) or type(v) in arrayutil.PROXIES and \
            isinstance(v, chainer.Link):
        return [('', v)]
    if not depth:
        return []
    if type(v) is dict:
        items = [('[%r]' % (k,), x) for k, x in v.items()]
    elif type(v) in link_values.NAMESPACES:
        items = [('.%s' % k, x) for k, x in v.__dict__.items()]
    elif type(v) in (list, tuple):
        items = [('[%d]' % i, x) for i, x in enumerate(v)]
    else:
        return []
    if len(items) > frozen_values.MAX_ITEMS:
        return []
    return [(where + more, x) for where, item in items
            if not arrayutil.dead_proxy(item)
            for more, x in _links_in(item, depth - 1)]


def dead_proxy_attribute(chain):
    """The path of a link attribute that is a ``weakref.proxy`` whose
    object is gone (a back-reference to an owner), which the recording's
    looks at the links would raise on; else None."""
    for path, link in chain.namedlinks():
        for k, v in link.__dict__.items():
            if arrayutil.dead_proxy(v):
                return '%s/%s' % (path.rstrip('/'), k)
    return None


def added_or_deleted(snapshot):
    """The link attributes the call added or deleted (``self.carry =
    ...`` where there was none, ``del self.tmp``): what the method did
    hangs on their absence or presence (``getattr(self, 'carry', None)``),
    so the next call records again to see (capture.py's recheck)."""
    out = []
    for d, before, path in snapshot:
        prefix = path.rstrip('/') + '/'
        out.extend('attribute %s%s, added' % (prefix, k)
                   for k in d if k not in before)
        out.extend('attribute %s%s, deleted' % (prefix, k)
                   for k in before if k not in d)
    return out


def _read_by(rec, old, node_held):
    """Did an op of the recording read ``old`` (an array or a Variable's
    array), whole or through a view, or a node hold it (``node_held()``,
    _held_by_nodes')?"""
    a = old.raw_array if isinstance(old, chainer.Variable) else old
    if not arrayutil.is_array(a):
        return False
    return id(a) in rec.by_id or any(
        arrayutil.root_of(buf.storage) is a for buf in rec.buffers.values()
        if arrayutil.is_array(buf.storage)) or id(a) in node_held()


def _held_by_nodes(rec):
    """A function giving the ids of the arrays recorded nodes hold in
    attributes, also as they were built (``restore``), and of their roots:
    a read that replay keeps the recorded array for
    (``Scale(self.prev).apply(...)``; review38). Computed at its first
    call, once for all the attributes asked about."""
    memo = []

    def held():
        if not memo:
            out = set()
            for op in rec.forward_ops:
                found = []
                values = [v for _, v in
                          analysis.own_attrs(node_attrs.attrs(op.node))]
                values += [v for _, v in op.restore or ()]
                analysis.scan(values, analysis.SCAN_DEPTH, found, [])
                out.update(id(f) for f in found)
                out.update(id(arrayutil.root_of(f)) for f in found)
            memo.append(out)
        return memo[0]
    return held


def attr_changes(rec, snapshot, detached=(), helpers=()):
    """The link attributes the method assigned, as (dict, name, buffer id,
    'V' or 'A'; or None, 'N' where it set None); one it read before
    assigning it is state carried from call to call (``self.h =
    h.array``), which the recording's reason list gets (``detached``: ids
    of recurrent Variables, handled by reattach). ``helpers``: helper
    objects' attributes, as ``snapshot``; of those only the arrays and
    Variables assigned (the watch sees the rest: changed_by_call)."""
    changed = [(d, k, v, before.get(k, arrayutil.MISSING))
               for d, before, _ in snapshot for k, v in list(d.items())
               if before.get(k, arrayutil.MISSING) is not v]
    for d, before, name in helpers:
        for k, v in list(d.items()):
            old = before.get(k, arrayutil.MISSING)
            if old is not v and (isinstance(v, chainer.Variable) or
                                 arrayutil.is_array(v)):
                changed.append((d, k, v, old))
    # Before the writes below add buffers (``self.a, self.b = self.b,
    # self.a`` reads neither).
    node_held = _held_by_nodes(rec)
    for d, k, v, old in changed:
        if old is not arrayutil.MISSING and id(old) not in detached and \
                _read_by(rec, old, node_held):
            rec.carries_state = True
            rec.add_reason(
                'it reads attribute %r and then assigns it a new value: '
                'state carried from one call to the next, which replay '
                'would freeze at the recorded value' % k)
    writes = []
    for d, k, v, old in changed:
        if isinstance(v, chainer.Variable):
            if v.raw_array is None:
                continue
            writes.append((d, k, rec.buffer_of(v.raw_array,
                                               'attribute ' + k), 'V'))
        elif arrayutil.is_array(v):
            a = rec.untrace(v, 'attribute ' + k)
            writes.append((d, k, rec.buffer_of(a, 'attribute ' + k), 'A'))
        elif frozen_values.same_value(v, old):
            continue     # (a Variable or array before: not ==)
        elif v is None:
            # (L.Classifier's ``self.accuracy = None`` once compute_accuracy
            # is off, where a call left a Variable): repeated as it is.
            writes.append((d, k, None, 'N'))
        else:
            rec.add_reason('the method sets attribute %r (%s), which '
                           'replay would not repeat'
                           % (k, type(v).__name__))
            if isinstance(v, (list, tuple, dict)):
                rec.container_writes.append((d, k))
    return writes


def left_in_containers(rec, watch, snapshot):
    """A reason where a container the watch holds (a link's, a helper
    object's, a global, a closure variable, a class or module attribute),
    or one a link or helper object holds after the call (a cache it
    filled), holds a Variable the call made that takes a gradient:
    define-by-run keeps the call's graph behind it, for a later call or
    the loop to backpropagate through (a list of earlier states the next
    call attends to; Chainer's cached properties, a distribution kept on
    the chain: ``self.prior.scale``); a replay builds no such graph.
    ``snapshot``: snapshot_links'."""
    found = watch.containers()
    for d, _, _ in snapshot + watch.helper_snapshot:
        found.extend((watch.name_of(d, k), v) for k, v in list(d.items())
                     if frozen_values.is_container(v))
    seen = set()
    for where, v in found:
        if id(v) in seen:
            continue
        seen.add(id(v))
        if _holds_made(rec, v, 3):
            rec.add_reason(
                'it leaves a Variable it made, which takes a gradient, in a '
                "%s at %s; define-by-run keeps this call's graph behind it, "
                'which a later call (or the loop) can backpropagate through '
                'again, and a replay builds no such graph'
                % (type(v).__name__, where))
            return


def _holds_made(rec, v, depth):
    """Does container ``v`` hold (``depth`` levels deep, 256 items at
    most) a Variable this recording made that takes a gradient?"""
    for n, x in enumerate(frozen_values.members(v)):
        if n >= 256:
            return False
        if type(x) in arrayutil.PROXIES:
            continue
        if isinstance(x, chainer.Variable):
            if x.requires_grad and x.creator_node is not None and \
                    _made(rec, x.raw_array):
                return True
        elif depth > 1 and frozen_values.is_container(x) and \
                _holds_made(rec, x, depth - 1):
            return True
    return False


def _made(rec, a):
    """Is ``a`` an array an op of the recording made (not a view of the
    chain's own arrays: ``self.tied = [self.l1.W.T]``, made before)?"""
    b = rec.by_id.get(id(a))
    return b is not None and rec.buffers[b].role in (ir.TEMP, ir.STATE)


def detach_link_variables(chain, rec, slots=()):
    """Variables that the chain's links hold and that belong to a graph
    (recurrent state: L.LSTM's ``h`` and ``c``, left by the previous call)
    or need a gradient (``self.prompt = chainer.Variable(...)``, learned
    but no Parameter: an input of the call, which gets its gradient, as a
    constant it got none), or that sit where earlier calls left state
    (``slots``: (link
    ``__dict__``, name) pairs; after ``unchain_backward()`` the state has
    no graph), are swapped for detached leaves of the recording, so that
    its backward does not run into an earlier call's graph. Returns
    [(dict, name, the link's Variable, the leaf, path)]; ``reattach`` puts
    them back."""
    out = []
    slot_ids = set((id(d), k) for d, k in slots)
    for path, link in chain.namedlinks():
        d = link.__dict__
        for k, v in list(d.items()):
            if type(v) is chainer.Variable and v.raw_array is not None and (
                    v.creator_node is not None or v.requires_grad or
                    (id(d), k) in slot_ids):
                leaf = chainer.Variable(arrayutil.copy_exact(v.raw_array),
                                        requires_grad=v.requires_grad)
                rec.arrays.append(leaf.raw_array)   # ids stay unique
                # (Its rank, for arguments._caller_rank: not the Variable,
                # which holds the earlier call's node and recording.)
                rec.detached_from[id(leaf)] = v.node._rank
                rec.detached_arrays[id(leaf)] = leaf.raw_array
                d[k] = leaf
                out.append((d, k, v, leaf, '%s/%s' % (path.rstrip('/'), k)))
    return out


def reattach(rec, detached):
    """After the method ran: the link Variables it did not replace are put
    back; those it read (an op took the leaf's array) are returned as
    [(dict, name, link Variable, leaf, path, buffer id)]: the call takes
    them as inputs (the recording and every replay of its key), so
    gradients reach the earlier call once, as in define-by-run."""
    put_back(detached)
    read = []
    node_held = _held_by_nodes(rec)
    for d, k, v, leaf, path in detached:
        if leaf.raw_array is not rec.detached_arrays[id(leaf)]:
            # ``self.prev.array = h.array``: define-by-run's Variable
            # holds the new array after the call (review41).
            v.array = leaf.raw_array
            rec.add_reason(
                'it gives the Variable of attribute %r another array '
                '(.array = ...): state carried from call to call, which '
                'replay would freeze at the recorded value' % k)
        if id(leaf.raw_array) in node_held():
            # (``Scale(self.prev.array)``: the node keeps the recorded
            # array, where an input would be fed; review40.)
            rec.add_reason(
                'a node is built with the array of %r, state carried from '
                'an earlier call; replay would keep the recorded one' % k)
        bid = rec.by_id.get(id(leaf.raw_array))
        if bid is not None:
            buf = rec.buffers[bid]
            buf.role, buf.name = ir.INPUT, path
            rec.unknown = [u for u in rec.unknown if u[0] != bid]
            read.append((d, k, v, leaf, path, bid))
    return read


def write_back_inputs(rec, leaves, inner, leaf_bids):
    """The recording ran on copies of the array arguments: a method that
    wrote into one (its fallback reason is recorded) leaves the caller's
    array changed, and one that gave an argument Variable another array
    (``x.array = ...``) does so to the caller's, as define-by-run would.
    Which copies differ is settled before any is written back (a caller's
    array written back must not be compared again as another argument's
    memory: ``model(x, x[1:])``)."""
    back = []
    for leaf, mine, bid in zip(leaves, inner, leaf_bids):
        if isinstance(leaf, chainer.Variable):
            if mine.raw_array is not rec.buffers[bid].storage:
                rec.add_reason('the method assigns a new array to its '
                               'argument Variable (x.array = ...), which '
                               'replay would not repeat')
                leaf.array = traced.untraced(mine.raw_array)
                continue
            leaf, mine = leaf.raw_array, mine.raw_array
        if mine is None or not (arrayutil.plain_array(leaf) or
                                isinstance(leaf, numpy.memmap)):
            continue    # (not an array; a NumPy subclass, left as it is)
        mine = traced.untraced(mine)
        if leaf.shape != mine.shape or leaf.dtype != mine.dtype:
            continue
        if isinstance(leaf, numpy.ndarray):
            if leaf.flags.writeable and arrayutil.changed(leaf, mine):
                back.append((leaf, mine))
        elif not bits.same_bits(leaf, mine, chainer.backend.get_array_module(
                leaf).array_equal):
            # CuPy: only its operators and item assignment are seen as
            # they write (device_reads); a CuPy function's ``out=``,
            # ``copyto`` or ``fill`` into the copy shows here.
            rec.add_reason(
                'user code changed the values of the CuPy argument %s in '
                'place; replay would not repeat the write'
                % rec.buffers[bid].name)
            back.append((leaf, mine))
    for leaf, mine in back:
        chainer.backend.get_array_module(leaf).copyto(leaf, mine)


# id(view) -> id(array) of the traced views trace_held_arrays put on links,
# while they are there: the backward of a recording of another thread that
# ends meanwhile (capture._finish) takes them for their arrays, not for
# arrays the user replaced.
HELD_VIEWS = {}


def trace_held_arrays(chain, rec):
    """Hand the method the links' NumPy array attributes as traced views,
    as its inputs are: writing into one or reading its values is caught,
    and one feeding a Chainer function is an array of the chain
    (analysis.chain_arrays), read live. Persistents too (``self.bn.avg_mean
    * 0.5``: NumPy on them is an op, not a constant that was uniform at
    the recording call; a write into one, ``self.ema += ...``, is caught),
    without the check of their values after the call: BatchNormalization's
    own node updates them in place. Returns [(dict, name, array, view)]
    for _untrace_held."""
    held = []
    for link in chain.links():
        d = link.__dict__
        for k, v in analysis.held_arrays(link):
            rec.chain_held.add(id(v))
            d[k] = rec.trace(v)
            held.append((d, k, v, d[k]))
        for k in getattr(link, '_persistent', ()):
            v = d.get(k)
            if type(v) is numpy.ndarray:
                rec.chain_held.add(id(v))
                d[k] = rec.trace(v, check=False)
                held.append((d, k, v, d[k]))
    for _, _, v, view in held:
        HELD_VIEWS[id(view)] = id(v)
    return held


def untrace_held(chain, held):
    """Put the arrays back, also where the method stored a view it was
    handed under another name."""
    if not held:
        return
    views = dict((id(view), a) for _, _, a, view in held)
    for i in views:
        HELD_VIEWS.pop(i, None)
    for link in chain.links():
        d = link.__dict__
        for k, v in list(d.items()):
            if id(v) in views and isinstance(v, numpy.ndarray):
                d[k] = views[id(v)]


def put_back(detached):
    for d, k, v, leaf, _ in detached:
        if d.get(k) is leaf:
            d[k] = v


def keep_attrs(attr_writes, by_inner, rec, aliases, fell_back):
    """What the recording call leaves in the attributes it set: the call's
    output when one was kept; the chain's memory (``aliases``: a
    parameter's array, a persistent, an array a link holds, or a view of
    one) as define-by-run leaves it (outputs.chain_aliases); else a
    detached copy, of the kept type: a constant the call made
    (``self.mask = numpy.tri(5)``; define-by-run makes a new one at every
    call) or a view of an output (``self.feat = h.array[0]``) is memory
    the replays read or write again. A recording that ``fell_back`` (no
    replay reads its memory) leaves an array no op of the call made as
    the method set it (``self.kept = self.cfg.table``). An array
    argument kept, or a view of one, is the caller's memory
    (``kept_memory.argument_memory``)."""
    bufs = rec.buffers
    if rec.container_writes:
        kept_memory.untrace_set_containers(rec)
    for d, k, b, kind in attr_writes:
        cur = d.get(k)
        if isinstance(cur, chainer.Parameter):
            continue     # (registered by the call: the chain's own now)
        if kind == 'A' and rec.argument_copies and arrayutil.is_array(cur):
            mine = kept_memory.argument_memory(rec, cur)
            if mine is not None:
                d[k] = mine
                continue
        if kind == 'A' and isinstance(cur, traced.TracedArray) and \
                id(cur.base) in by_inner and \
                arrayutil.same_view(cur.base, cur):
            cur = cur.base      # (``h.array`` read while recording)
        if id(cur) in by_inner:
            d[k] = by_inner[id(cur)]
        elif kind == 'A' and b in aliases:
            d[k] = arrayutil.hand_out(bufs[b].storage, aliases[b])
        elif kind == 'A' and fell_back and \
                bufs[b].role in entry_module.STABLE_ROLES:
            d[k] = bufs[b].storage
        else:
            d[k] = arrayutil.detached_copy(cur)


def foreign_parameters(rec, chain_map):
    """{id(array): chain_arrays' entry} for the Parameters the recorded
    forward reads that are not the chain's (not in ``chain_map``): a link
    kept outside ``init_scope``, shared with another model. Parameters of
    the call like the chain's own, they get their gradients."""
    out = {}
    for rop in rec.forward_ops:
        for vn in rop.node.inputs or ():
            if vn.creator_node is not None or not vn.requires_grad:
                continue
            v = vn.get_variable_or_none()
            if isinstance(v, chainer.Parameter) and \
                    v.raw_array is not None and \
                    id(v.raw_array) not in chain_map:
                out[id(v.raw_array)] = (
                    ir.PARAM, 'a Parameter of no link of the chain', v, None)
    return out


def inner_leaves(rec, targets):
    """Variables made inside the recorded call that need a gradient and
    no function made (``chainer.Variable(xp.zeros(...))``, the dummy input
    of ChainerMN's recv), other than ``targets``."""
    seen = set(id(v.node) for v in targets)
    out = []
    for rop in rec.forward_ops:
        for vn in rop.node.inputs or ():
            if vn.creator_node is None and vn.requires_grad and \
                    id(vn) not in seen:
                seen.add(id(vn))
                out.append(vn.get_variable())   # (made again if dropped)
    return out
