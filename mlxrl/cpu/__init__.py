"""The Linux-CPU backend, behind one door: the BLAS MLX loads (`blas`), mlxrl's native C++ kernels
(`native`) and the dispatch that sends float32 CPU arrays to them (`fastmath`; anything else, a GPU
included, takes MLX's own ops).

The rest of mlxrl calls `fastmath` (elementwise math, attention, the optimizer's and the head's
kernel choice) and `native_kernels()`; nothing outside this package imports `native`. Importing this
package loads the BLAS first (before ``mlx.core``): ``mlxrl/__init__`` imports it before anything else.
"""

from . import blas

blas.setup_blas()

from . import fastmath, native  # noqa: E402  (after the BLAS)


def native_kernels() -> bool:
    """Whether the native CPU kernels are built and loadable here (float32 CPU math then runs on them)."""
    return native.load() is not None


__all__ = ["blas", "fastmath", "native_kernels"]
