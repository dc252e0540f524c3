"""Whether these tests can use a CUDA device (tests skip cleanly
without one: CI has none)."""


def reason():
    """None where CuPy imports and sees a device; else why not."""
    try:
        import cupy
    except Exception as e:   # not installed, or no CUDA libraries
        return 'cupy is not available (%s: %s)' % (type(e).__name__, e)
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return 'no CUDA device'
    except Exception as e:
        return 'no CUDA device (%s)' % e
    return None
