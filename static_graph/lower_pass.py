"""Choose each op's replay kernel, once a schedule and what it keeps are
known.

An op that ``lowering.py`` has a cheaper kernel for gets it only where that
kernel gives the node's own results bit for bit, in the same memory layout:

* ops whose kernel is the node's own expression (Linear and its
  gradients, ``lowering.same_code_kind``) get it when the schedule is
  built, whatever their size: there is nothing to compare (their ``into``
  is checked at its first use);
* other small ops get their kernel proposed and checked when their
  schedule compiles (its third run), on their recorded arrays (held until
  then, parameters copied: an optimizer updates them in place meanwhile);
* larger ones (a convolution) on the first replay's own arrays: no large
  recorded array outlives the recording, and the recording iteration does
  not pay for the check;
* ops with state (BatchNormalization) on the first replay too, where the
  arrays they update in place (running statistics) can be copied before the
  node's own kernel runs, and compared after.

An input that dies at an op may be *donated*: the kernel writes its result
into that input's memory instead of allocating (ReLU, BatchNormalization's
backward...). Donated are only temporaries that nothing else can see: not
static, not kept for the other schedule or handed out (outputs, gradients,
reported values), not read by a later op, and sharing memory with no
buffer that is.
"""
import functools
import weakref

import numpy

from schedules import ir
from schedules import liveness
from schedules import placement
from static_graph import arrayutil
from static_graph import describe
from static_graph import kernel_checks
from static_graph import lowering
from static_graph import node_attrs

_DEFER_LOWERING_BYTES = 1 << 16
# Roles whose memory belongs to someone else (the caller, the chain,
# Chainer's backward): never written.
_FOREIGN_ROLES = (ir.INPUT, ir.PARAM, ir.PERSIST, ir.CONST, ir.STATE,
                  ir.GRAD_OUT)
# Roles whose arrays an optimizer may update in place.
_UPDATED_ROLES = (ir.PARAM, ir.PERSIST)


def attrs_with_kernel(node, name):
    return dict(describe.describe(node), kernel=name)


def memory_groups(bufs):
    """id(root array) -> buffer ids whose arrays share that memory."""
    groups = {}
    for b, buf in bufs.items():
        if buf.storage is not None:
            groups.setdefault(id(arrayutil.root_of(buf.storage)), []).append(b)
    return groups


def array_roots(bufs):
    """The memory of buffers whose recorded arrays are still held:
    ({id(root array): [root, buffer ids over it, None]}, ids of the
    buffers with no array), for memory_facts (which fills the third item:
    is the root one dense block?)."""
    roots, no_array = {}, []
    ndarray, is_array, root_of = numpy.ndarray, arrayutil.is_array, \
        arrayutil.root_of
    for b, buf in bufs.items():
        a = buf.storage
        if type(a) is ndarray and a.base is None:
            r = a         # (most: an array that owns its memory)
        elif is_array(a):
            r = root_of(a)
        else:
            no_array.append(b)
            continue
        k = id(r)
        if k in roots:
            roots[k][1].append(b)
        else:
            roots[k] = [r, [b], None]
    return roots, no_array


def _dense(r):
    """Is root array ``r`` writable memory laid out as one block?"""
    # (CuPy's flags say nothing of writeable: its arrays are)
    flags = r.flags
    return bool(getattr(flags, 'writeable', True) and (
        # C order over one block (of at least one element) is one block;
        # any other order is asked.
        (type(r) is numpy.ndarray and flags.c_contiguous and r.size > 0) or
        placement.one_block(r.shape, r.strides, r.itemsize)))


def memory_facts(bufs, keep, used=None, returned=(), roots=None):
    """``placement.Facts`` of buffers whose recorded arrays are still
    held: which share memory, how large and C-contiguous that memory is;
    ``keep``: buffers something outside the schedule may see; ``used``:
    the schedule's buffers (default: all), the others matter only where
    they share memory with one of them; ``returned``: what the schedule
    returns (its executor keeps those anyway); ``roots``: array_roots of
    ``bufs``, if known (the schedules of one recording share them)."""
    roots, no_array = array_roots(bufs) if roots is None else roots
    unknown = no_array if used is None else \
        [b for b in no_array if b in used]
    groups = []
    seen = set(bufs) if used is None else set(used)
    for root in roots.values():
        r, ids, dense = root
        if used is not None:
            if len(ids) == 1:
                if ids[0] not in used:
                    continue
            elif not used.intersection(ids):
                continue
        seen.update(ids)
        if dense is None:
            dense = root[2] = _dense(r)
        if len(ids) > 1 or not dense:
            groups.append((ids, r.nbytes, dense))
            continue
        buf = bufs[ids[0]]
        # (its own array, as recorded: the same size)
        if (buf.shape != r.shape or buf.dtype != r.dtype) and \
                r.nbytes != buf.nbytes:
            groups.append((ids, r.nbytes, dense))
    keep = seen.intersection(keep).difference(returned)
    return placement.Facts(groups, keep, unknown)


def _writable(a):
    """May a kernel write into ``a``? Not where the op that made it hands
    out a read-only view (a slice of ``broadcast_to``'s result: the
    gradient Stack's backward splits from a sum's) or one whose elements
    share memory (a zero stride: ``broadcast_arrays``' results, whose
    ``writeable`` NumPy warns of reading)."""
    strides = getattr(a, 'strides', ())
    if a.size > 1 and 0 in strides:
        return False
    flags = getattr(a, 'flags', None)
    # (The bit, not ``flags.writeable``: NumPy warns of a read of that on
    # broadcast_arrays' results. CuPy's arrays have no such flag.)
    num = getattr(flags, 'num', None)
    return num is None or bool(num & _WRITEABLE)


_WRITEABLE = 0x0400     # NPY_ARRAY_WRITEABLE


def donations(schedule, keep, groups=None):
    """For each op index, a tuple of bools over its inputs: may the kernel
    overwrite that input? ``keep``: buffers that must survive the schedule
    (its outputs, what the other schedule reads, what is handed out);
    ``groups``: memory_groups of its buffers, if known."""
    bufs = schedule.buffers
    last = liveness.of(schedule).last_read
    if groups is None:
        groups = memory_groups(bufs)

    def untouchable(b, i):
        buf = bufs[b]
        return b in keep or buf.static or buf.view_of is not None or \
            buf.role in _FOREIGN_ROLES or last.get(b, -1) > i

    out = []
    temp, root_of = ir.TEMP, arrayutil.root_of
    for i, op in enumerate(schedule.ops):
        flags = []
        for b in op.inputs:
            buf = bufs[b]
            # (untouchable(b, i), where b is a temporary last read here)
            ok = buf.role == temp and last.get(b) == i and \
                op.inputs.count(b) == 1 and buf.storage is not None and \
                b not in keep and not buf.static and buf.view_of is None \
                and _writable(buf.storage)
            if ok:
                a = buf.storage
                for o in groups[id(a if getattr(a, 'base', None) is None
                                   else root_of(a))]:
                    # Memory another buffer shows: it must be dead too, and
                    # not read by this very op.
                    if o != b and (untouchable(o, i) or o in op.inputs):
                        ok = False
                        break
            flags.append(ok)
        out.append(tuple(flags))
    return out


def lower(schedule, keep, donate=True, groups=None, roots=None,
          threads=None):
    """Give the ops marked by ``_ir_ops`` (``op.lower_from`` holds their
    RecordedOp) a cheaper kernel where one is proposed: checked at compile
    for small ops (``lower_ops``), on the first replay for large ones.
    donate: may kernels write into inputs that die with them? groups:
    memory_groups of the schedule's buffers, if known; roots: their
    array_roots, if known; threads: how many threads a large in-place
    element-wise kernel may be split across (split_kernels.py)."""
    bufs = schedule.buffers
    if donate:
        # (Placing results into dead memory is memory reuse too.) Only
        # what the schedule reads or writes, and does not return anyway.
        used = set(schedule.inputs)
        for op in schedule.ops:
            used.update(op.inputs)
            used.update(op.outputs)
        schedule.memory = memory_facts(bufs, keep, used, set(
            schedule.outputs) | set(schedule.keep), roots)
    donated = None
    ndarray = numpy.ndarray
    for i, op in enumerate(schedule.ops):
        rop = op.lower_from
        if rop is None:
            continue
        op.lower_from = None
        if donated is None:
            donated = donations(schedule, keep, groups) if donate else \
                [(False,) * len(o.inputs) for o in schedule.ops]
        ins = [bufs[b].storage for b in op.inputs]
        outs = [bufs[b].storage for b in op.outputs]
        if rop.state:
            # Its state is checked on the first replay, where the arrays it
            # updates in place can be copied before the node's own kernel
            # runs; static state is refreshed through the node: keep it.
            if not any(bufs[b].static for _, b in rop.state):
                fast = lowering.propose(rop, ins, donated[i])
                if fast is not None:
                    _probe(op, rop, fast, donated[i],
                           lowering.fallback(rop, ins, donated[i]))
            continue
        nbytes = 0
        for a in ins + outs:
            nbytes += a.nbytes if type(a) is ndarray else \
                getattr(a, 'nbytes', 0)
        small = nbytes <= _DEFER_LOWERING_BYTES
        fast = None
        if not small or lowering.same_code_kind(rop.kind):
            fast = lowering.propose(rop, ins, donated[i], threads)
        if fast is not None and getattr(fast, 'same_code', False):
            # (The node's own expression: nothing to compare, not on the
            # first replay, which ran each such large op twice, nor at
            # compile. Its ``into`` is checked at its first use.)
            kernel_checks.defer_check_into(fast, outs)
            _choose(op, rop, fast)
        elif small:
            # Proposed and checked at compile, not while recording; copies
            # now (in the same layout) of what may change before then: the
            # optimizer updates parameters in place.
            ins = kernel_checks.layout_copies(ins, [
                bufs[b].role in _UPDATED_ROLES or bufs[b].static
                for b in op.inputs])
            if ins is not None:
                op.lower_from = (rop, ins, outs, donated[i])
        elif fast is not None:
            _probe(op, rop, fast, _writes(fast, donated[i]),
                   lowering.fallback(rop, ins, donated[i]))


def _writes(kernel, donated):
    """The inputs ``kernel`` may write into: those donated to it where it
    is a kernel that writes into inputs (lowering.DONATING's say which
    results are inputs, ``aliases``), none for the others. A check copies
    those first, which it cannot for a broadcast view (EmbedIDGrad's gy,
    from a Sum's backward): the kernel would be refused for nothing."""
    return donated if getattr(kernel, 'aliases', None) is not None else ()


def _choose(op, rop, kernel):
    op.fn = kernel
    op._attrs = functools.partial(attrs_with_kernel, rop.node,
                                  kernel.__name__)


def _probe(op, rop, fast, donated, fallback=None):
    # The op only through a weak reference: op.fn -> probe -> decided -> op
    # would be a reference cycle, freed only by the garbage collector.
    op_ref = weakref.ref(op)

    def decided(kernel):
        op = op_ref()
        if op is None:
            return
        if kernel is fast or kernel is fallback:
            _choose(op, rop, kernel)
            # The state the node's own kernel left on it (statistics of the
            # probed call): nothing reads it, the new kernel never sets it.
            d = node_attrs.attrs(rop.node)
            for k, _ in rop.state:
                d[k] = None
        else:
            op.fn = kernel      # what the compiled schedule will call

    op.fn = kernel_checks.probing(op.fn, fast, decided, donated,
                                  rop.node.__dict__, fallback)


def lower_ops(schedule):
    """At compile: check the small ops ``lower`` deferred on their recorded
    arrays. Recorded arrays of non-static buffers are never written by
    replay; a static one may hold a later call's values, and then the check
    fails and the op keeps its node's kernel."""
    for op in schedule.ops:
        if op.lower_from is not None:
            rop, ins, outs, donated = op.lower_from
            op.lower_from = None
            fast = lowering.propose(rop, ins, donated)
            if fast is None:
                continue
            # A donating kernel writes into its inputs: check on copies.
            check = kernel_checks.same_results
            mine = kernel_checks.layout_copies(ins, _writes(fast, donated))
            if mine is not None and check(fast, mine, outs):
                _choose(op, rop, fast)
                continue
            # Else one that allocates its result, if there is one.
            fast = lowering.fallback(rop, ins, donated)
            if fast is not None and check(fast, ins, outs):
                _choose(op, rop, fast)
