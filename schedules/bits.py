"""Equality bit for bit, of NumPy or CuPy arrays."""


def same_bits(a, b, array_equal):
    """Whether ``a`` and ``b`` (one shape and dtype) hold the same bits:
    a -0.0 is not 0.0, a NaN equals the same NaN (``array_equal`` of the
    values says otherwise of both). ``array_equal``: NumPy's or CuPy's."""
    kind = a.dtype.kind
    if kind == 'c':
        return same_bits(a.real, b.real, array_equal) and \
            same_bits(a.imag, b.imag, array_equal)
    if kind == 'f' and a.dtype.itemsize in (2, 4, 8):
        view = 'u%d' % a.dtype.itemsize
        return bool(array_equal(a.view(view), b.view(view)))
    if kind == 'f':
        return a.tobytes() == b.tobytes()
    return bool(array_equal(a, b))
