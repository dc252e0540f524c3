"""Array kernels that replace a framework's own implementation where they
are provably the same computation but cheaper. Pure NumPy/CuPy; each kernel
takes a tuple of input arrays and returns a tuple of outputs."""


def outer_grad_weight(inputs):
    """gW = gy.T @ x for a batch of one row: an outer product.

    With one row the matrix product has no sums, so a broadcast multiply
    gives bit-identical results without a GEMM call.
    """
    x, gy = inputs
    return (gy.reshape(-1, 1) * x,)
