"""Placement: the memory a compiled replay writes each result into.

A kernel that can write a result into memory it is given (``fn.into``, see
below) gets, for each result that nothing outside its schedule sees, a place
in the memory of a buffer that died before it: a *host*. The replay then
allocates nothing for that result; the host's memory, which the schedule
would have let go, is written again instead. A result nobody may see being
overwritten (an output, a value saved for the backward, handed out or
reported, static), a kernel that always allocates (a Chainer FunctionNode's
own forward), or a result with no dead memory of its size at hand is
allocated as before; ``Placement.reasons`` says which and why, and the
schedule printout lists them.

Why dead memory and not one arena held between calls: what a training
iteration holds at its peak includes arrays that escape the schedules
(gradients, the optimizer's temporaries), so an arena held across calls adds
its size to that peak (the MLP's peak is in the optimizer's update, where
every backward temporary is dead). Memory that the iteration frees anyway
costs nothing, as long as it is not held where it would have been let go
and something else peaks: a host is taken only where, op by op, the
schedule's memory (its results, modelled from liveness) plus what the
kernel running then allocates for itself stays at or below the peak of its
results alone. ``rule``: 'workspace' (the default) counts a kernel's
``fn.workspace`` (an upper bound) and, for a kernel that declares none,
allows no more memory than without placement; 'strict' allows no more
memory at any op; 'peak' ignores workspaces (for comparison: on ResNet50
it places 77 backward results instead of 71 and raises the measured peak
by 0.7%, a convolution's im2col matrix landing on a held host).

Kernel protocol (all optional attributes of an op's ``fn``):

* ``fn.into(inputs, outs)``: like ``fn(inputs)``, but writes result ``k``
  into ``outs[k]`` (a C-contiguous array of that result's shape and dtype)
  where ``outs[k]`` is not None, returning it or a view of its memory in the
  layout ``fn`` would give; same values, bit for bit.
* ``fn.aliases``: per result, the index of an input whose memory it may be
  (a kernel writing into a dying input), or None. Without it, results share
  memory with inputs only as they did when the schedule was recorded
  (``Facts.groups``).
* ``fn.workspace``: bytes the kernel allocates for its own use while it
  runs, at most (None or absent: unknown).

Pure planning over the IR plus ``take``, the one NumPy-level helper the
compiled code calls; nothing here knows Chainer.
"""
import numpy

from schedules import ir
from schedules import liveness
from schedules import planner

ALIGNMENT = 64
# Roles whose memory belongs to someone else, or outlives the run.
FOREIGN_ROLES = (ir.INPUT, ir.PARAM, ir.PERSIST, ir.CONST, ir.STATE,
                 ir.GRAD_OUT)
# Roles of memory that lasts through a run: the schedule's memory over its
# ops is the rest.
_LASTING = (ir.INPUT, ir.PARAM, ir.PERSIST, ir.CONST, ir.GRAD_OUT)
# Switch for comparisons (benchmarks, tests): False places nothing.
ENABLED = True

# Results smaller than this are allocated: NumPy hands out small arrays
# from the C heap in well under a microsecond, less than placing one costs
# in the compiled code (200 element-wise ops on 2x3 arrays: 1.05 ms a step
# placed, 0.68 ms not), and they weigh nothing on the peak.
MIN_BYTES = 1 << 16
# How much a placement may hold (see ``plan``).
RULE = 'workspace'
RULES = ('strict', 'workspace', 'peak')


class Facts(object):
    """What a front end knew when it built a schedule. ``groups``: tuples
    ``(buffer ids, nbytes, dense)`` of buffers whose arrays shared one
    memory block of ``nbytes`` bytes (``dense``: a writable array over one
    block, ``one_block``), for memory that is not simply one buffer's own;
    a buffer in no group and not ``unknown`` (no array was seen for it) had
    memory of its own, one dense block of its size. ``keep``: buffers
    something outside the schedule may see (outputs, saved and handed-out
    values, arrays nodes hold). Kept with the schedule, so kept small."""

    __slots__ = ('groups', 'unknown', 'keep')

    def __init__(self, groups, keep=(), unknown=()):
        self.groups = tuple((tuple(ids), n, bool(dense))
                            for ids, n, dense in groups)
        self.unknown = frozenset(unknown)
        self.keep = frozenset(keep)


class Placement(object):
    """Where a compiled schedule's results go.

    ``places``: buffer id -> (host id, byte offset) for each result written
    into a host's memory; ``holder``: host id -> the buffer whose array
    holds that memory when the host dies; ``held``: host id -> the last op
    whose result is placed in it (the compiled code keeps the memory until
    then); ``hosts``: every buffer whose memory some result is placed in;
    ``keep`` and ``rule``: what it was planned with. Planned with
    ``explain``: ``reasons``, buffer id -> why a result an op computes is
    allocated instead, and ``check``, (sizes, lifetimes, offsets) on one
    address line, which ``planner.check_plan`` accepted."""

    def __init__(self, keep=(), rule=None):
        self.places = {}
        self.holder = {}
        self.reasons = {}
        self.held = {}
        self.hosts = set()       # every buffer of a host's memory
        self.check = ({}, {}, {})
        self.placed_bytes = 0
        self.keep = tuple(keep)
        self.rule = rule

    def summary(self):
        n = len(self.places)
        return 'place: %d result%s (%s) in dead memory, %d allocated' % (
            n, '' if n == 1 else 's', planner.format_bytes(self.placed_bytes),
            len(self.reasons))

    def allocating_kernels(self, schedule):
        """{kernel name: how many of ``schedule``'s results it allocates
        because it cannot write into given memory}."""
        out = {}
        for op in schedule.ops:
            for b in op.outputs:
                why = self.reasons.get(b, '')
                if why.startswith('no out= ('):
                    k = why[len('no out= ('):-1]
                    out[k] = out.get(k, 0) + 1
        return out

    def __repr__(self):
        return '<Placement %s>' % self.summary()


class _Object(object):
    """Buffers of one schedule that are one piece of memory."""

    __slots__ = ('members', 'birth', 'death', 'nbytes', 'dense', 'why_not',
                 'bound', 'lasting')

    def __init__(self):
        self.members = []
        self.birth = self.death = None
        self.nbytes = 0
        self.dense = False
        self.why_not = None     # why it can be neither host nor placed
        self.bound = False      # memory from before the schedule
        self.lasting = False    # memory that outlives the run (or the
        #                         caller's): not the schedule's to count


def _objects(schedule, live, facts, keep):
    bufs = schedule.buffers
    parent = {}

    def find(b):
        while parent.get(b, b) != b:
            parent[b] = parent.get(parent[b], parent[b])
            b = parent[b]
        return b

    def union(a, b):
        a, b = find(a), find(b)
        if a != b:
            parent[b] = a

    used = set(schedule.inputs)
    for op in schedule.ops:
        used.update(op.inputs)
        used.update(op.outputs)
    group_of = {}
    outside = {}      # root -> why members outside the schedule forbid it
    for b in facts.unknown:
        group_of[b] = (bufs[b].nbytes if b in bufs else 0, False)
    for ids, n, dense in facts.groups:
        inside = [b for b in ids if b in used]
        if not inside:
            continue
        for b in inside:
            group_of[b] = (n, dense)
            union(inside[0], b)
        for b in ids:
            if b not in used and b in bufs and _untouchable(bufs[b], b, keep):
                outside[inside[0]] = 'shares memory with %%%d' % b
    for op in schedule.ops:
        aliases = getattr(op.fn, 'aliases', None) if op.fn else None
        if not aliases:
            continue
        for b, pos in zip(op.outputs, op.select):
            k = aliases[pos] if pos < len(aliases) else None
            if k is not None and k < len(op.inputs):
                union(op.inputs[k], b)
    objects = {}
    for b in used:
        objects.setdefault(find(b), _Object()).members.append(b)
    bound = set(schedule.inputs)
    end = len(schedule.ops) - 1
    why_outside = dict((find(r), why) for r, why in outside.items())
    for r, obj in objects.items():
        obj.members.sort()
        births, deaths = [], []
        for b in obj.members:
            w, rd = live.first_write.get(b), live.first_read.get(b)
            if b in bound or rd is not None and (w is None or rd <= w):
                obj.bound = True
                births.append(0)
            elif w is not None:
                births.append(w)
            deaths.append(max(live.last_read.get(b, -1),
                              live.last_write.get(b, -1),
                              0 if b in bound else -1))
            buf = bufs[b]
            if buf.static or buf.role in _LASTING:
                obj.lasting = True
            why = _untouchable(buf, b, keep)
            if why and obj.why_not is None:
                obj.why_not = '%s%s' % (
                    why, '' if b == obj.members[0] or len(obj.members) == 1
                    else ' (%%%d, same memory)' % b)
        obj.birth = min(births) if births else 0
        obj.death = max(deaths) if deaths else obj.birth
        if obj.why_not is None and r in why_outside:
            obj.why_not = why_outside[r]
        if any(b in keep for b in obj.members):
            obj.death = end
        known = [group_of.get(b, (bufs[b].nbytes, True))
                 for b in obj.members]
        obj.nbytes = max(n for n, _ in known)
        obj.dense = all(d for _, d in known)
    return objects


def _untouchable(buf, b, keep):
    """Why the memory of buffer ``b`` may not be written by anyone else,
    or None."""
    if b in keep:
        return 'escapes'
    if buf.static:
        return 'static'
    if buf.view_of is not None:
        return 'a view of %%%d' % buf.view_of
    if buf.role in FOREIGN_ROLES:
        return buf.role
    return None


def _may_place(schedule):
    """Could ``plan`` place any result: is one written fresh (not static)
    by a kernel that offers ``into``, of ``MIN_BYTES`` or more? Its
    cheapest conditions, checked before the pieces of memory are found:
    where none passes (an MLP at batch 8 or less), the plan is empty."""
    bufs = schedule.buffers
    for op in schedule.ops:
        if op.fn is None or getattr(op.fn, 'into', None) is None:
            continue
        for b in op.outputs:
            buf = bufs[b]
            if not buf.static and buf.nbytes >= MIN_BYTES:
                return True
    return False


def plan(schedule, facts, keep=(), rule=None, alignment=ALIGNMENT,
         explain=False):
    """The ``Placement`` of ``schedule``'s results (see the module
    docstring). ``keep``: buffers beyond ``facts.keep`` that must not be
    written (what the executor returns). explain: fill in ``reasons`` and
    ``check`` (the printout's; a compiled run keeps neither)."""
    rule = rule or RULE
    if rule not in RULES:
        raise ValueError('rule must be one of %s, not %r' % (RULES, rule))
    result = Placement(keep, rule)
    if not ENABLED or facts is None or not schedule.ops or \
            not explain and not _may_place(schedule):
        return result
    bufs = schedule.buffers
    keep = set(keep) | set(facts.keep) | set(schedule.outputs) | set(
        schedule.keep)
    live = liveness.of(schedule)
    objects = _objects(schedule, live, facts, keep)
    obj_of = dict((b, o) for o in objects.values() for b in o.members)
    n = len(schedule.ops)
    # Memory during each op without placement: every piece of memory the
    # schedule makes or is handed (not the caller's, not lasting).
    before = [0] * n
    for obj in objects.values():
        if obj.lasting:
            continue
        for t in range(obj.birth, obj.death + 1):
            before[t] += obj.nbytes
    now = list(before)
    # What each op's kernel allocates for its own use while it runs
    # (``fn.workspace``, bytes; None: unknown).
    work = [getattr(op.fn, 'workspace', None) if op.fn is not None else 0
            for op in schedule.ops]
    # The peak to stay under: what is sure to be reached (results alone,
    # workspaces being upper bounds), checked against results plus those
    # bounds.
    limit = max(before)

    # Results an op writes fresh, and whether they can be placed.
    candidates = []
    for i, op in enumerate(schedule.ops):
        if op.fn is None:
            continue
        into = getattr(op.fn, 'into', None)
        aliases = getattr(op.fn, 'aliases', None) or ()
        for b, pos in zip(op.outputs, op.select):
            obj = obj_of[b]
            if obj.birth != i or obj.bound:
                continue
            if bufs[b].static:
                continue     # copied into its storage
            why = obj.why_not
            if why is None and (pos < len(aliases) and
                                aliases[pos] is not None):
                why = 'written into its input'
            if why is None and into is None:
                why = 'no out= (%s)' % _kernel_name(op)
            if why is None and sum(
                    1 for m in obj.members
                    if live.first_write.get(m) == i) > 1:
                why = 'one memory for several results'
            if why is None and obj.nbytes != bufs[b].nbytes:
                why = 'recorded in a larger array'
            if why is None and bufs[b].nbytes == 0:
                why = 'empty'
            if why is None and bufs[b].nbytes < MIN_BYTES:
                why = 'small (allocating is cheaper)'
            if why is not None:
                if explain:
                    result.reasons[b] = why
                continue
            candidates.append((i, b, obj))

    # Hosts: memory that dies in the schedule and nobody else sees, held
    # by a member still bound when the last one dies.
    hosts = []
    for r, obj in objects.items():
        if obj.why_not is not None or not obj.dense or obj.nbytes == 0:
            continue
        holders = [b for b in obj.members
                   if live.last_use(b) == obj.death and
                   bufs[b].nbytes == obj.nbytes and b not in keep]
        if obj.death >= n - 1 or not holders:
            continue
        hosts.append(obj)
    host_of = {}          # object placed -> its host object
    blocks = {}           # host object -> [until, [(off, size, b, d)]]

    for i, b, obj in candidates:
        size = bufs[b].nbytes
        best = None
        for h in hosts:
            if h.death >= i or h in host_of:
                continue
            until, spots = blocks.get(h, (h.death, []))
            occupied = [(o, o + s) for o, s, sb, sd in spots
                        if sb <= obj.death and obj.birth <= sd]
            off = planner._best_fit(occupied, size, alignment)
            if off + size > h.nbytes:
                continue
            new_until = max(until, obj.death)
            ok = True
            # (the block is held from where it is now, through the gap
            # before this result, to where this result dies)
            for t in range(min(obj.birth, until + 1), new_until + 1):
                v = now[t] - (size if obj.birth <= t <= obj.death else 0) + \
                    (h.nbytes if t > until else 0)
                if rule == 'peak':
                    bound_t = limit
                elif rule == 'strict' or work[t] is None:
                    bound_t = before[t]
                else:
                    bound_t = limit - work[t]
                if v > bound_t and v > now[t]:
                    ok = False
                    break
            if not ok:
                continue
            cost = (h.nbytes - size, new_until - until)
            if best is None or cost < best[0]:
                best = (cost, h, off, until, new_until)
        if best is None:
            if explain:
                result.reasons[b] = 'no dead memory to take'
            continue
        _, h, off, until, new_until = best
        for t in range(min(obj.birth, until + 1), new_until + 1):
            now[t] += -(size if obj.birth <= t <= obj.death else 0) + \
                (h.nbytes if t > until else 0)
        spots = blocks.setdefault(h, [until, []])
        spots[0] = new_until
        spots[1].append((off, size, obj.birth, obj.death))
        host_of[obj] = h
        hid = min(h.members)
        result.places[b] = (hid, off)
        result.holder[hid] = [m for m in h.members
                              if live.last_use(m) == h.death and
                              bufs[m].nbytes == h.nbytes][0]
        result.held[hid] = max(result.held.get(hid, i), i)
        result.hosts.update(h.members)
        result.placed_bytes += size
    check = _check_input(result, blocks, host_of, bufs)
    planner.check_plan(*check)
    if explain:
        result.check = check
    return result


def explain(schedule):
    """``schedule.placement`` planned again with its reasons (what the
    printout shows), or None before the schedule compiled."""
    p = schedule.placement
    if p is None or schedule.memory is None:
        return p
    return plan(schedule, schedule.memory, p.keep, p.rule, explain=True)


def _check_input(result, blocks, host_of, bufs):
    """Sizes, lifetimes and offsets on one address line: each host's block
    at its own base, its own life at offset 0, what it holds after."""
    sizes, lifetimes, offsets = {}, {}, {}
    base = 0
    for h, (until, spots) in blocks.items():
        key = ('host', min(h.members))
        sizes[key] = h.nbytes
        lifetimes[key] = (h.birth, h.death)
        offsets[key] = base
        base += -(-h.nbytes // ALIGNMENT) * ALIGNMENT
    for obj, h in host_of.items():
        b = [m for m in obj.members if m in result.places][0]
        hid, off = result.places[b]
        key = ('placed', b)
        sizes[key] = bufs[b].nbytes
        lifetimes[key] = (obj.birth, obj.death)
        offsets[key] = offsets[('host', hid)] + off
    return sizes, lifetimes, offsets


def _kernel_name(op):
    """What runs ``op``, for a reason: the kernel's name, or for a front
    end's generic kernel (a Chainer FunctionNode's own forward, say) the
    op's kind with it."""
    fn = op.fn
    name = getattr(fn, '__name__', None) or type(fn).__name__
    if name in ('forward', 'kernel', '<lambda>'):
        return '%s.forward' % op.kind
    if name.startswith('probe_'):
        return '%s, not chosen yet' % name
    if name == 'rerun_backward':
        return '%s: %s' % (op.kind, name)
    return name


def one_block(shape, strides, itemsize):
    """Do these strides lay the array over exactly one block of memory (the
    axes of a C-contiguous array in some order: C or Fortran order, a
    convolution's NHWC memory seen as NCHW)?"""
    acc = itemsize
    for i in sorted(range(len(shape)), key=lambda i: strides[i]):
        if shape[i] != 1:
            if strides[i] != acc:
                return False
            acc *= shape[i]
    return True


def take(host, offset, shape, dtype, nbytes):
    """A C-contiguous ``shape``/``dtype`` array over ``host``'s memory at
    ``offset``, or None where that memory is not what the plan assumed
    (``host`` not a NumPy array spanning all of its writable base, that
    base not one block of memory, or too small): the kernel then
    allocates."""
    if host.__class__ is not numpy.ndarray:
        return None
    root = host
    base = root.base
    while base is not None:
        if base.__class__ is not numpy.ndarray:
            return None
        root = base
        base = root.base
    if root.nbytes != host.nbytes or offset + nbytes > root.nbytes or \
            not root.flags.writeable:
        return None
    if not root.flags.c_contiguous:
        if not one_block(root.shape, root.strides, root.itemsize):
            return None
        # its memory in order: a view (one block), as a C-contiguous array
        root = root.ravel('K')
        if root.base is None:
            return None
    return numpy.ndarray(shape, dtype, root, offset)
