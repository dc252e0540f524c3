"""Converters of the shape ops: reshape, transposes, squeeze and expand,
concatenation and splits, broadcasts, tile, flips, pad, depth/space.

Each registers itself in ``common.CONVERTERS`` (see there) when imported.
"""
import warnings

import numpy

from schedules.onnx_export.common import (
    INT64_MIN, _norm_axis, _prod, converter)


# -- shapes -------------------------------------------------------------------

def _reshape_target(in_shape, info, out_shape, batch):
    """Reshape target that keeps working for other batch sizes.

    Returns ``(target, out_axis, out_factor)``; ``target`` has -1 at the
    output axis that carries the batch, ``out_axis`` is None when the batch
    could not be followed.
    """
    out_shape = [int(d) for d in out_shape]
    if info is None or not batch:
        return out_shape, None, 1
    a, f = info
    prefix = _prod(in_shape[:a])
    candidates = []
    for j in range(len(out_shape)):
        if _prod(out_shape[:j]) != prefix:
            continue
        if out_shape[j] % batch == 0 and out_shape[j] >= batch:
            candidates.append(j)
    if not candidates:
        return out_shape, None, 1
    # Prefer the axis that keeps the batch's size unchanged.
    exact = [j for j in candidates if out_shape[j] == in_shape[a]]
    j = (exact or candidates)[0]
    target = list(out_shape)
    target[j] = -1
    return target, j, out_shape[j] // batch


@converter('Reshape')
def _cv_reshape(ctx, xs, ys):
    in_shape, out_shape = ctx.in_shape(0), ctx.out_shape(0)
    info = ctx.in_batch(0) if ctx.dynamic_batch else None
    target, j, f = _reshape_target(in_shape, info, out_shape,
                                   ctx.batch_size)
    if info is not None and j is None:
        warnings.warn(
            'ONNX export: the reshape from %s to %s at %s mixes the batch '
            'dimension with others; it is exported with the recorded shape '
            'and the model will only work for batch size %s'
            % (tuple(in_shape), tuple(out_shape), ctx.op.source,
               ctx.batch_size))
    ctx.reshape(xs[0], target, ys[0])
    ctx.set_batch(0, j, f)


def _permute(ctx, xs, ys, perm):
    perm = [int(p) for p in perm]
    ctx.transpose(xs[0], perm, ys[0])
    info = ctx.in_batch(0)
    if info is None:
        ctx.set_batch(0, None)
    else:
        ctx.set_batch(0, perm.index(info[0]), info[1])


@converter('Transpose')
def _cv_transpose(ctx, xs, ys):
    nd = len(ctx.in_shape(0))
    axes = ctx.attr('axes')
    if axes is None:
        perm = list(reversed(range(nd)))
    else:
        perm = [_norm_axis(a, nd) for a in axes]
    _permute(ctx, xs, ys, perm)


@converter('Swapaxes')
def _cv_swapaxes(ctx, xs, ys):
    nd = len(ctx.in_shape(0))
    perm = list(range(nd))
    a = _norm_axis(ctx.require('axis1'), nd)
    b = _norm_axis(ctx.require('axis2'), nd)
    perm[a], perm[b] = perm[b], perm[a]
    _permute(ctx, xs, ys, perm)


@converter('Rollaxis')
def _cv_rollaxis(ctx, xs, ys):
    nd = len(ctx.in_shape(0))
    axis = _norm_axis(ctx.require('axis'), nd)
    start = int(ctx.attr('start', 0))
    if start < 0:
        start += nd
    if axis < start:
        start -= 1
    perm = list(range(nd))
    perm.remove(axis)
    perm.insert(start, axis)
    _permute(ctx, xs, ys, perm)


@converter('Moveaxis')
def _cv_moveaxis(ctx, xs, ys):
    nd = len(ctx.in_shape(0))
    src = ctx.require('source')
    dst = ctx.require('destination')
    if isinstance(src, int):
        src = (src,)
    if isinstance(dst, int):
        dst = (dst,)
    src = [_norm_axis(a, nd) for a in src]
    dst = [_norm_axis(a, nd) for a in dst]
    perm = [i for i in range(nd) if i not in src]
    for d, s in sorted(zip(dst, src)):
        perm.insert(d, s)
    _permute(ctx, xs, ys, perm)


@converter('Squeeze')
def _cv_squeeze(ctx, xs, ys):
    in_shape = ctx.in_shape(0)
    nd = len(in_shape)
    axis = ctx.attr('axis')
    if axis is None:
        axes = [i for i, d in enumerate(in_shape) if d == 1]
    else:
        if isinstance(axis, int):
            axis = (axis,)
        axes = sorted(_norm_axis(a, nd) for a in axis)
    if not axes:
        ctx.emit('Identity', [xs[0]], ys)
    else:
        ctx.squeeze(xs[0], axes, ys[0])
    info = ctx.in_batch(0)
    if info is None or info[0] in axes:
        ctx.set_batch(0, None)
    else:
        ctx.set_batch(0, info[0] - sum(1 for a in axes if a < info[0]),
                      info[1])


@converter('ExpandDims')
def _cv_expand_dims(ctx, xs, ys):
    out_nd = len(ctx.out_shape(0))
    axis = _norm_axis(ctx.require('axis'), out_nd)
    ctx.unsqueeze(xs[0], [axis], ys[0])
    info = ctx.in_batch(0)
    if info is None:
        ctx.set_batch(0, None)
    else:
        a = info[0] + (1 if axis <= info[0] else 0)
        ctx.set_batch(0, a, info[1])


@converter('Concat')
def _cv_concat(ctx, xs, ys):
    axis = _norm_axis(ctx.attr('axis', 1), len(ctx.out_shape(0)))
    ctx.emit('Concat', xs, ys, axis=axis)
    infos = [ctx.in_batch(i) for i in range(len(xs))]
    if all(info is not None and info[0] == axis for info in infos):
        # Concatenation along the batch axis: the factors add up.
        ctx.set_batch(0, axis, sum(info[1] for info in infos))


@converter('Stack')
def _cv_stack(ctx, xs, ys):
    out_nd = len(ctx.out_shape(0))
    axis = _norm_axis(ctx.attr('axis', 0), out_nd)
    parts = [ctx.unsqueeze(x, [axis]) for x in xs]
    ctx.emit('Concat', parts, ys, axis=axis)
    info = ctx.in_batch(0)
    if info is None:
        ctx.set_batch(0, None)
    else:
        a = info[0] + (1 if axis <= info[0] else 0)
        ctx.set_batch(0, a, info[1])


@converter('Hstack')
def _cv_hstack(ctx, xs, ys):
    nd = len(ctx.in_shape(0))
    if nd == 0:
        parts = [ctx.unsqueeze(x, [0]) for x in xs]
        ctx.emit('Concat', parts, ys, axis=0)
    else:
        ctx.emit('Concat', xs, ys, axis=0 if nd == 1 else 1)


@converter('Vstack')
def _cv_vstack(ctx, xs, ys):
    parts = []
    for i, x in enumerate(xs):
        nd = len(ctx.in_shape(i))
        if nd == 0:
            x = ctx.reshape(x, [1, 1])
        elif nd == 1:
            x = ctx.unsqueeze(x, [0])
        parts.append(x)
    ctx.emit('Concat', parts, ys, axis=0)


def _split_bounds(dim, indices):
    """(start, stop) of each piece of ``numpy.split(x, indices)``."""
    bounds = [0] + [min(max(int(i) if i >= 0 else int(i) + dim, 0), dim)
                    for i in indices] + [dim]
    return list(zip(bounds[:-1], bounds[1:]))


def _split_sizes(ctx, axis):
    """Chunk sizes of SplitAxis along ``axis``, from its attrs."""
    dim = int(ctx.in_shape(0)[axis])
    indices = ctx.attr('indices')
    sections = ctx.attr('sections')
    if indices is not None:
        return [max(b - a, 0) for a, b in _split_bounds(dim, indices)]
    if sections is not None:
        return [dim // int(sections)] * int(sections)
    return [int(ctx.out_shape(j)[axis]) for j in range(len(ctx.results))]


@converter('SplitAxis')
def _cv_split_axis(ctx, xs, ys):
    nd = len(ctx.in_shape(0))
    axis = _norm_axis(ctx.attr('axis', 0), nd)
    sizes = _split_sizes(ctx, axis)
    ys = ctx.result_names(ys, len(sizes))
    if len(ys) == 1:
        ctx.emit('Identity', [xs[0]], ys)
        return
    indices = ctx.attr('indices')
    if indices is not None and sum(sizes) != ctx.in_shape(0)[axis]:
        # Indices out of order ([4, 2]): the pieces overlap, as NumPy's
        # do; one Slice each.
        for (a, b), y in zip(_split_bounds(ctx.in_shape(0)[axis], indices),
                             ys):
            ctx.emit('Slice', [xs[0], ctx.i64([a], 'starts'),
                               ctx.i64([max(a, b)], 'ends'),
                               ctx.i64([axis], 'axes')], [y])
        return
    ctx.emit('Split', [xs[0], ctx.i64(sizes, 'split')], ys, axis=axis)


@converter('Separate')
def _cv_separate(ctx, xs, ys):
    nd = len(ctx.in_shape(0))
    axis = _norm_axis(ctx.attr('axis', 0), nd)
    n = int(ctx.in_shape(0)[axis])
    ys = ctx.result_names(ys, n)
    if n == 1:
        parts = [xs[0]]
    else:
        parts = ctx.emit('Split', [xs[0], ctx.i64([1] * n, 'split')],
                         n_out=n, axis=axis)
    for p, y in zip(parts, ys):
        ctx.squeeze(p, [axis], y)
    info = ctx.in_batch(0)
    for j in range(n):
        if info is None or info[0] == axis:
            ctx.set_batch(j, None)
        else:
            ctx.set_batch(j, info[0] - (1 if axis < info[0] else 0), info[1])


def _expand_target(ctx, in_shape, in_info, out_shape, out_info):
    """Shape tensor for Expand from ``in_shape`` to ``out_shape``."""
    nd = len(out_shape)
    off = nd - len(in_shape)
    dims = []
    for i in range(nd):
        d_in = in_shape[i - off] if i >= off else 1
        dims.append(1 if d_in == out_shape[i] else int(out_shape[i]))
    if out_info is not None:
        a, f = out_info
        if in_info is not None and in_info[0] + off == a:
            dims[a] = 1     # Expand keeps the input's (dynamic) batch
            return ctx.i64(dims)
        return ctx.shape_tensor(dims, a, f)
    return ctx.i64(dims)


def _broadcast_out_info(ctx, i, out_shape):
    info = ctx.in_batch(i)
    if info is None:
        return None
    return (info[0] + len(out_shape) - len(ctx.in_shape(i)), info[1])


@converter('BroadcastTo')
def _cv_broadcast_to(ctx, xs, ys):
    in_shape, out_shape = ctx.in_shape(0), ctx.out_shape(0)
    out_info = _broadcast_out_info(ctx, 0, out_shape)
    if (out_info is None and ctx.dynamic_batch
            and ctx._batch_source is not None and len(out_shape) >= 1
            and ctx.batch_size is not None and ctx.batch_size > 1
            and out_shape[0] == ctx.batch_size
            and (len(in_shape) < len(out_shape) or in_shape[0] == 1)):
        # Broadcasting a batch-free value to ``x.shape``: the leading
        # dimension is the batch size, taken from the input at run time.
        out_info = (0, 1)
    ctx.emit('Expand', [xs[0], _expand_target(ctx, in_shape, ctx.in_batch(0),
                                              out_shape, out_info)], ys)
    ctx.set_batch(0, *(out_info or (None,)))


@converter('Broadcast')
def _cv_broadcast(ctx, xs, ys):
    out_shape = ctx.any_out_shape()
    ys = ctx.result_names(ys, len(xs))
    out_info = None
    for i in range(len(xs)):
        out_info = _broadcast_out_info(ctx, i, out_shape)
        if out_info is not None:
            break
    for i, (x, y) in enumerate(zip(xs, ys)):
        ctx.emit('Expand', [x, _expand_target(
            ctx, ctx.in_shape(i), ctx.in_batch(i), out_shape, out_info)], [y])
        ctx.set_batch(i, *(out_info or (None,)))


@converter('Tile')
def _cv_tile(ctx, xs, ys):
    reps = ctx.require('reps')
    if isinstance(reps, int):
        reps = (reps,)
    reps = [int(r) for r in reps]
    x = xs[0]
    nd = len(ctx.in_shape(0))
    info = ctx.in_batch(0)
    shift = 0
    if len(reps) > nd:
        shift = len(reps) - nd
        x = ctx.unsqueeze(x, list(range(shift)))
    elif len(reps) < nd:
        reps = [1] * (nd - len(reps)) + reps
    ctx.emit('Tile', [x, ctx.i64(reps, 'repeats')], ys)
    if info is None or reps[info[0] + shift] != 1:
        ctx.set_batch(0, None)
    else:
        ctx.set_batch(0, info[0] + shift, info[1])


def _flip(ctx, xs, ys, axis):
    axis = _norm_axis(axis, len(ctx.in_shape(0)))
    ctx.emit('Slice', [xs[0], ctx.i64([-1], 'starts'),
                       ctx.i64([INT64_MIN], 'ends'), ctx.i64([axis], 'axes'),
                       ctx.i64([-1], 'steps')], ys)


@converter('Flip')
def _cv_flip(ctx, xs, ys):
    _flip(ctx, xs, ys, ctx.require('axis'))


@converter('FlipLR')
def _cv_fliplr(ctx, xs, ys):
    _flip(ctx, xs, ys, 1)


@converter('FlipUD')
def _cv_flipud(ctx, xs, ys):
    _flip(ctx, xs, ys, 0)


@converter('Pad')
def _cv_pad(ctx, xs, ys):
    nd = len(ctx.in_shape(0))
    mode = ctx.attr('mode', 'constant')
    onnx_mode = {'constant': 'constant', 'reflect': 'reflect',
                 'edge': 'edge'}.get(mode)
    if onnx_mode is None:
        raise ctx.unsupported('pad mode %r' % (mode,))
    width = numpy.broadcast_to(
        numpy.asarray(ctx.require('pad_width'), dtype=numpy.int64), (nd, 2))
    pads = ctx.i64(list(width[:, 0]) + list(width[:, 1]), 'pads')
    ins = [xs[0], pads]
    if onnx_mode == 'constant':
        cv = ctx.attr('constant_values', 0)
        if numpy.ndim(cv) != 0:
            cv = numpy.asarray(cv)
            if numpy.all(cv == cv.flat[0]):
                cv = cv.flat[0]
            else:
                raise ctx.unsupported('per-axis constant_values')
        ins.append(ctx.scalar(cv, ctx.in_dtype(0), 'pad_value'))
    ctx.emit('Pad', ins, ys, mode=onnx_mode)


@converter('Depth2Space')
def _cv_depth2space(ctx, xs, ys):
    ctx.emit('DepthToSpace', [xs[0]], ys, blocksize=int(ctx.require('r')),
             mode='DCR')


@converter('Space2Depth')
def _cv_space2depth(ctx, xs, ys):
    ctx.emit('SpaceToDepth', [xs[0]], ys, blocksize=int(ctx.require('r')))
