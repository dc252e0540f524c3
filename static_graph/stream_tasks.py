"""Linear's kernels (lowering.py) as tasks of the stream's C worker
(``fn.stream_task``, schedules/stream.py): each the very NumPy call the
kernel makes (``schedules.blas_stream``), or None where NumPy would take
another path (the kernel then runs on the calling thread)."""
from schedules import blas_stream


def linear(a):
    """LinearFunction's kernel: ``dot(x, W.T, out=y)``, then ``y += b``."""
    t = blas_stream.dot_task(a[0], a[1].T)
    if t is None:
        return None
    tasks, y = [t[0]], t[1]
    if len(a) > 2:
        bias = blas_stream.bias_task(y, a[2])
        if bias is None:
            return None
        tasks.append(bias)
    return tasks, (y,)


def grad_data(a):
    """LinearGradData's kernel: ``gy.dot(W)``."""
    t = blas_stream.dot_task(a[1], a[0])
    return None if t is None else ([t[0]], (t[1],))


def grad_weight(a):
    """LinearGradWeight's kernel: ``gy.T.dot(x)``."""
    t = blas_stream.dot_task(a[1].T, a[0])
    return None if t is None else ([t[0]], (t[1],))
