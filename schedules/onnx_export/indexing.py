"""The converter of ``GetItem`` (basic and advanced indexing).

It registers itself in ``common.CONVERTERS`` (see there) when imported.
"""
import numpy

from schedules.onnx_export.common import INT64_MAX, INT64_MIN, converter


# -- indexing -----------------------------------------------------------------

def _expand_index(ctx, items, nd):
    """Replace the ellipsis (or pad at the end) with full slices."""
    consumed = 0
    for it in items:
        if it[0] in ('newaxis', 'ellipsis'):
            continue
        if it[0] == 'array' and numpy.asarray(it[1]).dtype == bool:
            consumed += max(numpy.asarray(it[1]).ndim, 1)
        else:
            consumed += 1
    fill = [('slice', None, None, None)] * max(nd - consumed, 0)
    out = []
    done = False
    for it in items:
        if it[0] == 'ellipsis':
            if not done:
                out.extend(fill)
                done = True
            continue
        out.append(tuple(it))
    if not done:
        out.extend(fill)
    return out


@converter('GetItem')
def _cv_getitem(ctx, xs, ys):
    in_shape = ctx.in_shape(0)
    nd = len(in_shape)
    items = _expand_index(ctx, ctx.constant_attr('slices'), nd)
    info = ctx.in_batch(0)
    slices = []     # (axis, start, stop, step)
    gathers = []    # (axis, index array or int)
    newaxes = []    # output positions
    out_batch = None
    in_axis = out_axis = 0
    n_arrays = 0
    adv_positions = []
    adv_items = []      # positions in ``items`` of the ints and arrays
    newaxis_items = []
    for pos, it in enumerate(items):
        tag = it[0]
        if tag in ('index', 'array'):
            adv_items.append(pos)
        if tag == 'newaxis':
            newaxis_items.append(pos)
            newaxes.append(out_axis)
            out_axis += 1
        elif tag == 'slice':
            start, stop, step = it[1], it[2], it[3]
            full = (start in (None, 0) and stop is None
                    and step in (None, 1))
            if not full:
                step = 1 if step is None else int(step)
                if step == 0:
                    raise ctx.unsupported('slice step 0')
                if info is None or info[0] != in_axis:
                    # A fixed axis: Python's bounds (ONNX clamps a start
                    # before the axis to its first element: x[-10::-1]).
                    start, stop, step = slice(start, stop, step).indices(
                        int(in_shape[in_axis]))
                    if not len(range(start, stop, step)):
                        start, stop, step = 0, 0, 1
                    elif stop < 0:
                        stop = INT64_MIN
                elif start is None:
                    start = 0 if step > 0 else -1
                elif step < 0 and start < -1:
                    # (NumPy takes no row where start + batch < 0; ONNX
                    # clamps it to the first row.)
                    raise ctx.unsupported(
                        'a slice of the batch axis backwards from a '
                        'negative start (%d), whose rows NumPy and ONNX '
                        'take otherwise where the batch is smaller than '
                        '%d; export with dynamic_batch=False'
                        % (start, -start))
                if stop is None:
                    stop = INT64_MAX if step > 0 else INT64_MIN
                slices.append((in_axis, int(start), int(stop), step))
            if info is not None and info[0] == in_axis and full:
                out_batch = (out_axis, info[1])
            in_axis += 1
            out_axis += 1
        elif tag == 'index':
            gathers.append((in_axis, int(it[1])))
            adv_positions.append(in_axis)
            in_axis += 1
        elif tag == 'array':
            arr = numpy.asarray(it[1])
            if arr.dtype == bool:
                if arr.ndim != 1:
                    raise ctx.unsupported(
                        'boolean index arrays of %d dimensions' % arr.ndim)
                arr = numpy.nonzero(arr)[0]
            if arr.dtype.kind not in 'iu':
                raise ctx.unsupported('index array of dtype %s' % arr.dtype)
            n_arrays += 1
            gathers.append((in_axis, arr.astype(numpy.int64)))
            adv_positions.append(in_axis)
            in_axis += 1
            out_axis += arr.ndim
        else:
            raise ctx.unsupported('index item %r' % (tag,))
    if in_axis > nd:
        raise ctx.unsupported('too many indices for %d-d input' % nd)
    if n_arrays > 1:
        raise ctx.unsupported('more than one index array')
    if n_arrays == 1 and (adv_positions != list(
            range(adv_positions[0], adv_positions[0] + len(adv_positions)))
            or any(adv_items[0] < p < adv_items[-1]
                   for p in newaxis_items)):
        # (A None between them makes them non-adjacent too: NumPy puts
        # the index dimensions first, x[:, [1, 0], None, 0].)
        raise ctx.unsupported(
            'an index array combined with non-adjacent integer indices')

    x = xs[0]
    if slices:
        x = ctx.emit1('Slice', [
            x, ctx.i64([s[1] for s in slices], 'starts'),
            ctx.i64([s[2] for s in slices], 'ends'),
            ctx.i64([s[0] for s in slices], 'axes'),
            ctx.i64([s[3] for s in slices], 'steps')])
    for axis, idx in sorted(gathers, key=lambda g: -g[0]):
        if isinstance(idx, int):
            ind = ctx.const(numpy.asarray(idx, dtype=numpy.int64), 'index')
        else:
            ind = ctx.const(idx, 'indices')
        x = ctx.emit1('Gather', [x, ind], axis=axis)
    if newaxes:
        x = ctx.unsqueeze(x, newaxes)
    if x == xs[0]:
        ctx.emit('Identity', [x], ys)
    else:
        # Rename the last node's output to the op's output.
        last = ctx.nodes[-1]
        last.output[0] = ys[0]
    if out_batch is None:
        ctx.set_batch(0, None)
    else:
        ctx.set_batch(0, *out_batch)
