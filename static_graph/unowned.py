"""Arrays that are views of memory no recorded buffer owns: NumPy's own
temporaries, which some of its functions hand out only as a view
(``numpy.tile``'s result is a reshape of the array its ``repeat`` made;
``numpy.random.choice(n, k, replace=False)`` is a slice of a permutation;
a fancy index along a later axis is a transposed view). A buffer whose
recorded array is such a view is found by identity, not by its root; an
array that shows the same memory is the buffer's very view, a view within
its array (made static, the buffer shows every call's values there), or
part of it that replay would freeze. Used by the recording
(recorder.untrace) and its analysis (classify_unknown, mark_captured).
"""
from schedules import ir
from static_graph import arrayutil
from static_graph import traced

# Roles of the buffers whose arrays are new at every call (not the
# chain's, not constants): a reference to one is refreshed (made static)
# or rebound.
PER_CALL_ROLES = (ir.TEMP, ir.STATE, ir.INPUT, ir.GRAD_OUT)


def per_call_views(rec):
    """id(root memory) -> ids of the recorded per-call buffers whose
    arrays are views of memory no buffer owns."""
    out = {}
    for b, buf in rec.buffers.items():
        a = buf.storage
        if buf.role in PER_CALL_ROLES and arrayutil.is_array(a):
            root = arrayutil.root_of(a)
            if root is not a and id(root) not in rec.by_id:
                out.setdefault(id(root), []).append(b)
    return out


def lazy_views(rec):
    """A function giving per_call_views(rec), computed at its first call
    (most recordings never ask)."""
    memo = []

    def views():
        if not memo:
            memo.append(per_call_views(rec))
        return memo[0]
    return views


def shown_by(rec, siblings, a, root, before=None):
    """(the buffer among ``siblings`` (per_call_views') that is the very
    view ``a`` is of memory no buffer owns, or whose array, one block of
    memory, holds all of ``a``'s elements (a reshape of numpy.tile's
    result), or None; the buffers showing part of that memory), of those
    made before buffer ``before``."""
    shown = [b for b in siblings.get(id(root), ())
             if before is None or b < before]
    plain = traced.untraced(a)
    same = [b for b in shown
            if arrayutil.same_view(rec.buffers[b].storage, plain)] or [
        b for b in shown if arrayutil.within(plain, rec.buffers[b].storage)]
    return (same[0] if same else None), shown


def held_buffer(rec, a, siblings):
    """The recorded buffer a node attribute's array ``a`` is (or views),
    or None: by identity; as a traced view of it (the node was built with
    what user code held); by its root; or as shown_by finds it
    (``siblings()`` gives per_call_views). Returns (buffer id, the buffers
    that show part of its memory without holding it)."""
    a = rec.traced_views.get(id(a), a)
    bid = rec.by_id.get(id(a))
    if bid is not None:
        return bid, ()
    root = arrayutil.root_of(a)
    bid = rec.by_id.get(id(root))
    if bid is not None or root is a:
        return bid, ()
    return shown_by(rec, siblings(), a, root)


def within_a_buffer(rec, a, root):
    """Does a per-call buffer's array, a view of ``root`` (memory no
    buffer owns), hold all of ``a``'s elements?"""
    return any(arrayutil.within(a, rec.buffers[b].storage)
               for b in per_call_views(rec).get(id(root), ()))
