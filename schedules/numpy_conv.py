"""2-D convolution kernels for NumPy that skip copies, not arithmetic.

The usual CPU convolution (Chainer's, for one) builds ``col`` as
``(N, C, kh, kw, oh, ow)`` after padding the image with ``numpy.pad``, and
``numpy.tensordot`` then copies it once more into the ``(N*oh*ow, C*kh*kw)``
matrix it hands to BLAS. These kernels build that matrix directly (one
strided copy per kernel offset straight from the unpadded image, zeros
written only where a tap falls on the padding; none beyond a transpose for
1x1 convolutions) and make the very same ``dot`` call, so the results are the
same bits in the same memory layout.

Grouped convolutions build ``(C, kh, kw, N, oh, ow)`` the same way and make
the same ``matmul`` call. No dilation, no ``cover_all``. Given a
``parallel.Ranges`` over the batch, the im2col taps and col2im's sums are
made for parts of the batch on several threads: copies, and each pixel's
terms added in the same order, so the same bits.
"""
import numpy
from numpy.lib.stride_tricks import as_strided

from schedules import parallel


def out_size(size, k, s, p):
    return (size + 2 * p - k) // s + 1


def _c_strides(shape, itemsize):
    strides, acc = [], itemsize
    for d in reversed(shape):
        strides.append(acc)
        acc *= d
    return tuple(reversed(strides))


def _c_contiguous(shape, strides, itemsize):
    # NumPy's flag: axes of length 1 do not count.
    if 0 in shape:
        return True
    acc = itemsize
    for d, s in zip(reversed(shape), reversed(strides)):
        if d != 1:
            if s != acc:
                return False
            acc *= d
    return True


def _nocopy_strides(shape, strides, newshape, itemsize):
    """NumPy's _attempt_nocopy_reshape (C order): the strides of the view
    ``reshape`` returns, or None where it must copy."""
    old = [(d, s) for d, s in zip(shape, strides) if d != 1]
    olddims = [d for d, _ in old]
    oldstrides = [s for _, s in old]
    newstrides = [0] * len(newshape)
    oi, oj, ni, nj = 0, 1, 0, 1
    while ni < len(newshape) and oi < len(olddims):
        np_, op = newshape[ni], olddims[oi]
        while np_ != op:
            if np_ < op:
                np_ *= newshape[nj]
                nj += 1
            else:
                op *= olddims[oj]
                oj += 1
        for ok in range(oi, oj - 1):
            if oldstrides[ok] != olddims[ok + 1] * oldstrides[ok + 1]:
                return None
        newstrides[nj - 1] = oldstrides[oj - 1]
        for nk in range(nj - 1, ni, -1):
            newstrides[nk - 1] = newstrides[nk] * newshape[nk]
        ni, oi = nj, oj
        nj, oj = nj + 1, oj + 1
    last = newstrides[ni - 1] if ni >= 1 else itemsize
    for nk in range(ni, len(newshape)):
        newstrides[nk] = last
    return tuple(newstrides)


def same_as_reshaped(shape, perm, newshape, itemsize=4):
    """Is ``a.transpose(perm).reshape(newshape)``, for a C-contiguous
    ``a`` of this shape, laid out as a C-contiguous array (what these
    kernels build)? NumPy returns a view where it can, and a view in
    another order would make BLAS sum in another order. Decided on shapes
    and strides alone, as NumPy 1.x's reshape decides."""
    strides = _c_strides(shape, itemsize)
    tshape = tuple(shape[i] for i in perm)
    tstrides = tuple(strides[i] for i in perm)
    if _c_contiguous(tshape, tstrides, itemsize):
        return True               # a view with C strides
    view = _nocopy_strides(tshape, tstrides, tuple(newshape), itemsize)
    return view is None or view == _c_strides(newshape, itemsize)


def matches_tensordot(n, c, kh, kw, oh, ow, groups=1):
    """Is the im2col matrix these kernels build laid out as the one
    Chainer's CPU path hands to BLAS?"""
    shape = (n, c, kh, kw, oh, ow)
    if groups == 1:
        return same_as_reshaped(shape, (0, 4, 5, 1, 2, 3),
                                (n * oh * ow, c * kh * kw))
    return same_as_reshaped(shape, (1, 2, 3, 0, 4, 5),
                            (groups, c // groups * kh * kw, n * oh * ow))


def _inside(size, k, s, p, out):
    """The output positions o (a range) whose tap k reads inside the image:
    0 <= o * s + k - p < size."""
    lo = max(0, -(-(p - k) // s))
    hi = min(out, (size - 1 + p - k) // s + 1)
    return lo, max(lo, hi)


def _fill_tap(dst, x, j, i, sy, sx, ph, pw):
    """dst, an ``(N, C, oh, ow)`` view into a col buffer, = tap (j, i) of
    the zero-padded image: x where the tap falls inside it, zero on the
    padding. No padded copy of x is made."""
    oh, ow = dst.shape[2:]
    y0, y1 = _inside(x.shape[2], j, sy, ph, oh)
    x0, x1 = _inside(x.shape[3], i, sx, pw, ow)
    if y0 == y1 or x0 == x1:
        dst[...] = 0
        return
    dst[:, :, :y0] = 0
    dst[:, :, y1:] = 0
    dst[:, :, y0:y1, :x0] = 0
    dst[:, :, y0:y1, x1:] = 0
    r, c = y0 * sy + j - ph, x0 * sx + i - pw
    dst[:, :, y0:y1, x0:x1] = x[:, :, r:r + sy * (y1 - y0 - 1) + 1:sy,
                                c:c + sx * (x1 - x0 - 1) + 1:sx]


def _padded(x, ph, pw):
    if not ph and not pw:
        return x
    n, c, h, w = x.shape
    img = numpy.zeros((n, c, h + 2 * ph, w + 2 * pw), dtype=x.dtype)
    img[:, :, ph:ph + h, pw:pw + w] = x
    return img


def col_rows(x, kh, kw, sy, sx, ph, pw, ranges=None):
    """The im2col matrix of x as ``tensordot`` lays it out: C-contiguous
    ``(N*oh*ow, C*kh*kw)``, row (n, y, x), column (c, ky, kx). ranges: a
    ``parallel.Ranges`` over N that may fill the taps of parts of the
    batch on several threads (copies: the same matrix)."""
    n, c, h, w = x.shape
    oh, ow = out_size(h, kh, sy, ph), out_size(w, kw, sx, pw)
    if kh == 1 and kw == 1 and not ph and not pw:
        # A (strided) transpose: reshape copies it into the right order.
        v = x[:, :, :sy * (oh - 1) + 1:sy, :sx * (ow - 1) + 1:sx]
        return numpy.ascontiguousarray(
            v.transpose(0, 2, 3, 1)).reshape(n * oh * ow, c)
    if c < 8:
        # Few channels (an RGB input layer): one 6-D strided copy.
        img = _padded(x, ph, pw)
        s = img.strides
        v = as_strided(img, (n, oh, ow, c, kh, kw),
                       (s[0], s[2] * sy, s[3] * sx, s[1], s[2], s[3]))
        return numpy.ascontiguousarray(v).reshape(n * oh * ow, c * kh * kw)
    buf = numpy.empty((n, oh, ow, c, kh, kw), dtype=x.dtype)

    def taps(lo, hi):
        for j in range(kh):
            for i in range(kw):
                _fill_tap(buf[lo:hi, :, :, :, j, i].transpose(0, 3, 1, 2),
                          x[lo:hi], j, i, sy, sx, ph, pw)
    parallel.run_ranges(ranges, taps, n)
    return buf.reshape(n * oh * ow, c * kh * kw)


def conv2d(x, W, b, sy, sx, ph, pw, out=None, ranges=None):
    """y = conv(x, W) + b as ``(N, oc, oh, ow)``, a view of a contiguous
    ``(N, oh, ow, oc)`` array (the layout Chainer's CPU path returns).
    out: a C-contiguous array of y's size and dtype whose memory that
    ``(N, oh, ow, oc)`` array takes (the same ``dot``, writing there)."""
    n, _, h, w = x.shape
    oc, c, kh, kw = W.shape
    oh, ow = out_size(h, kh, sy, ph), out_size(w, kw, sx, pw)
    at = col_rows(x, kh, kw, sy, sx, ph, pw, ranges)
    bt = W.transpose(1, 2, 3, 0).reshape(c * kh * kw, oc)
    if out is not None and out.dtype == at.dtype == bt.dtype and \
            out.flags.c_contiguous and out.size == n * oh * ow * oc:
        y = numpy.dot(at, bt, out=out.reshape(n * oh * ow, oc))
    else:
        y = numpy.dot(at, bt)
    y = y.reshape(n, oh, ow, oc).astype(x.dtype, copy=False)
    if b is not None:
        y += b
    return numpy.rollaxis(y, 3, 1)


def conv2d_grad_w(x, gy, kh, kw, sy, sx, ph, pw, w_dtype, ranges=None):
    """dL/dW of conv2d from its input x and output gradient gy."""
    oc = gy.shape[1]
    c = x.shape[1]
    if not (gy.flags.c_contiguous or gy.flags.f_contiguous) and \
            1 in gy.shape:
        gy = numpy.ascontiguousarray(gy)   # as Chainer does (numpy#2744)
    at = gy.transpose(1, 0, 2, 3).reshape(oc, -1)
    bt = col_rows(x, kh, kw, sy, sx, ph, pw, ranges)
    return numpy.dot(at, bt).reshape(oc, c, kh, kw).astype(w_dtype,
                                                           copy=False)


def deconv_fills(k, sy, sx, ph, pw):
    """Does deconv2d with a ``k`` = (kh, kw) kernel fill a fresh array of
    its result's shape (which ``out`` can be), rather than return a window
    of a zero-padded one?"""
    return tuple(k) == (1, 1) and (sy, sx, ph, pw) == (1, 1, 0, 0)


def _col2im(col, sy, sx, ph, pw, h, w, out=None, ranges=None):
    n, c, kh, kw, oh, ow = col.shape
    if (kh, kw, sy, sx, ph, pw) == (1, 1, 1, 1, 0, 0) and (oh, ow) == (h, w):
        # Every pixel gets exactly one term: 0 + v, without the zero fill.
        if out is not None and out.shape == (n, c, h, w) and \
                out.dtype == col.dtype and out.flags.c_contiguous:
            img = out
        else:
            img = numpy.empty((n, c, h, w), dtype=col.dtype)
        numpy.add(col[:, :, 0, 0], col.dtype.type(0), out=img)
        return img
    img = numpy.zeros((n, c, h + 2 * ph + sy - 1, w + 2 * pw + sx - 1),
                      dtype=col.dtype)

    def add_taps(lo, hi):
        # Each pixel's terms in the same order (tap after tap) whatever
        # part of the batch a thread takes.
        for j in range(kh):
            for i in range(kw):
                img[lo:hi, :, j:j + sy * oh:sy, i:i + sx * ow:sx] += \
                    col[lo:hi, :, j, i]
    parallel.run_ranges(ranges, add_taps, n)
    return img[:, :, ph:h + ph, pw:w + pw]


def deconv2d(x, W, sy, sx, ph, pw, outh, outw, out=None, ranges=None):
    """Transposed convolution (the input gradient of conv2d) without bias:
    the same tensordot and the same accumulation order as Chainer's CPU
    path; a 1x1, stride-1 one skips the zero fill (and writes into
    ``out`` where given, see ``deconv_fills``)."""
    gcol = numpy.tensordot(W, x, (0, 1)).astype(x.dtype, copy=False)
    return _col2im(numpy.rollaxis(gcol, 3), sy, sx, ph, pw, outh, outw, out,
                   ranges)


def col_groups(x, kh, kw, sy, sx, ph, pw):
    """The im2col array of x as a grouped convolution lays it out:
    C-contiguous ``(C, kh, kw, N, oh, ow)``."""
    n, c, h, w = x.shape
    oh, ow = out_size(h, kh, sy, ph), out_size(w, kw, sx, pw)
    buf = numpy.empty((c, kh, kw, n, oh, ow), dtype=x.dtype)
    for j in range(kh):
        for i in range(kw):
            _fill_tap(buf[:, j, i].transpose(1, 0, 2, 3), x, j, i,
                      sy, sx, ph, pw)
    return buf


def conv2d_grouped(x, W, b, groups, sy, sx, ph, pw):
    """conv2d with ``groups`` groups, laid out as Chainer's CPU path."""
    n, c, h, w = x.shape
    oc, cg, kh, kw = W.shape
    col = col_groups(x, kh, kw, sy, sx, ph, pw)
    oh, ow = col.shape[-2:]
    col = col.reshape(groups, cg * kh * kw, n * oh * ow)
    y = numpy.matmul(W.reshape(groups, oc // groups, cg * kh * kw),
                     col).astype(x.dtype, copy=False)
    y = y.reshape(oc, n, oh, ow).transpose(1, 0, 2, 3)
    if b is not None:
        y += b.reshape(1, b.size, 1, 1)
    return y


def conv2d_grouped_grad_w(x, gy, groups, kh, kw, sy, sx, ph, pw, w_dtype):
    """dL/dW of conv2d_grouped."""
    n, c, h, w = x.shape
    _, oc, oh, ow = gy.shape
    col = col_groups(x, kh, kw, sy, sx, ph, pw)
    col = col.reshape(groups, c // groups * kh * kw, n * oh * ow)
    gy = gy.transpose(1, 0, 2, 3).reshape(groups, oc // groups, n * oh * ow)
    gW = numpy.matmul(gy, col.transpose(0, 2, 1)).astype(w_dtype, copy=False)
    return gW.reshape(oc, c // groups, kh, kw)
