"""The checks that let a lowered kernel replace its node's own (lowering.py):
the same results, bit for bit and in the same memory layout, on recorded
arrays (``same_results``) or on the first replay's (``probing``); for a
kernel that can write into given memory, the same from its ``into`` too
(``check_into``)."""
import weakref

import numpy

from schedules import bits


def same_results(kernel, in_arrays, out_arrays):
    """Does ``kernel`` give ``out_arrays`` from ``in_arrays`` bit for bit,
    in the same memory layout (a later reduction's summation order follows
    its input's strides)?"""
    if not _same(kernel(tuple(in_arrays)), out_arrays):
        return False
    if not getattr(kernel, 'effects', None):
        defer_check_into(kernel, out_arrays)
    return True


def defer_check_into(kernel, out_arrays):
    """``kernel.into`` checked at its first call, not now: placement uses
    it for few results (none of the MLP's forward), and running each large
    op once more on the first replay cost more than the rest of that replay
    (MLP at batch 100: 16 ms against 12 ms). Its first call runs ``kernel``
    too and compares: the same results, bit for bit and in their layout, in
    the memory it was given; where they differ, that call hands out
    ``kernel``'s results and ``into`` runs ``kernel`` from then on (the
    results then live outside the planned memory, which placement allows).
    Not for kernels with effects (they would apply twice): check_into."""
    into = getattr(kernel, 'into', None)
    if into is None or getattr(into, 'deferred', False):
        return
    if getattr(kernel, 'layout', None) is not None:
        kernel.layout[:] = [out_arrays[0].strides]
    chosen = []
    # (kernel.into -> first -> kernel would be a reference cycle, which
    # only the garbage collector frees.)
    ref = weakref.ref(kernel)

    def first(a, o):
        if chosen:
            return chosen[0](a, o)
        want = ref()(a)
        got = into(a, o)
        if _same(got, want) and all(
                not isinstance(m, numpy.ndarray) or
                numpy.shares_memory(g, m) for g, m in zip(got, o)):
            chosen.append(into)
            return got
        chosen.append(lambda a, o: ref()(a))
        return want

    first.deferred = True
    kernel.into = first


def check_into(kernel, in_arrays, out_arrays):
    """``kernel.into`` must give ``kernel``'s results (``out_arrays``, bit
    for bit, in their layout) in the memory it is given: placement.py counts
    on it. Where it does not, the kernel loses it."""
    if getattr(kernel, 'into', None) is None:
        return
    if getattr(kernel, 'layout', None) is not None:
        kernel.layout[:] = [out_arrays[0].strides]
    outs = tuple(numpy.empty(w.shape, w.dtype)
                 if isinstance(w, numpy.ndarray) else None
                 for w in out_arrays[:1])
    got = kernel.into(tuple(in_arrays), outs)
    if not _same(got, out_arrays) or not all(
            o is None or numpy.shares_memory(g, o)
            for g, o in zip(got, outs)):
        del kernel.into


def _same(got, out_arrays):
    if len(got) != len(out_arrays):
        return False
    for g, want in zip(got, out_arrays):
        if not hasattr(want, 'shape'):   # a Python number (SCE's _coeff)
            if type(g) is not type(want) or not _same_bits(
                    numpy.asarray(g), numpy.asarray(want)):
                return False
            continue
        if type(g) is not type(want) or g.shape != want.shape or \
                g.dtype != want.dtype or g.strides != want.strides or \
                not _same_bits(g, want):
            return False
    return True


def _same_bits(a, b):
    return bits.same_bits(a, b, numpy.array_equal)


def layout_copy(a):
    """A copy of ``a`` with its strides (a result's layout, and so its
    kernel's summation order, can follow its input's), or None where
    ``empty_like`` cannot give them (a view with gaps)."""
    c = numpy.empty_like(a)
    if c.strides != a.strides:
        return None
    numpy.copyto(c, a)
    return c


def layout_copies(arrays, which):
    """``arrays`` with those flagged in ``which`` (shorter: the rest
    unflagged) replaced by layout copies; None if one cannot be made."""
    if not any(which):
        for a in arrays:
            if a is None:
                return None
        return tuple(arrays)
    out = tuple(layout_copy(a) if w else a for a, w in zip(
        arrays, tuple(which) + (False,) * len(arrays)))
    return None if any(a is None for a in out) else out


def same_effects(fast, in_arrays, out_arrays, holder, before):
    """same_results, and do ``fast``'s in-place updates of ``holder``'s
    arrays turn the values ``before`` (copies, by attribute name) into what
    ``holder`` holds now? ``fast`` updates the copies: the real arrays
    are put back whatever happens."""
    after = dict((k, holder[k]) for k in before)
    again = dict((k, v.copy()) for k, v in before.items())
    holder.update(before)
    try:
        ok = same_results(fast, in_arrays, out_arrays) and all(
            before[k].strides == after[k].strides and
            before[k].dtype == after[k].dtype and
            _same_bits(before[k], after[k])
            for k in before)
        if ok:
            # its ``into`` from the same state (the same code updates it)
            holder.update(again)
            check_into(fast, in_arrays, out_arrays)
        return ok
    finally:
        holder.update(after)


def probing(kernel, fast, decided, donated=(), holder=None, fallback=None):
    """A kernel that runs ``kernel`` (the node's own) and, on its first
    call, checks ``fast`` against it on that call's arrays (copies of those
    ``fast`` may overwrite; ``holder``: the node's attributes, for the
    arrays ``fast.effects`` names), and where it differs ``fallback`` (a
    kernel that overwrites no input); from then on it runs whichever was
    chosen, and ``decided(chosen)`` is told once."""
    chosen = []
    effects = getattr(fast, 'effects', ())

    def probe(inputs):
        if chosen:
            return chosen[0](inputs)
        before = dict((k, holder[k].copy()) for k in effects)
        out = kernel(inputs)
        mine = layout_copies(inputs, donated)
        ok = mine is not None and (
            same_effects(fast, mine, out, holder, before) if effects
            else same_results(fast, mine, out))
        if ok:
            chosen.append(fast)
        elif fallback is not None and same_results(fallback, inputs, out):
            chosen.append(fallback)
        else:
            chosen.append(kernel)
        decided(chosen[0])
        return out

    probe.__name__ = 'probe_' + fast.__name__
    # Either kernel may run: the node's shares memory as recorded, the
    # fast one as it says.
    probe.aliases = getattr(fast, 'aliases', None)
    return probe
