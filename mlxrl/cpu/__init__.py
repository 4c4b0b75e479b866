"""The Linux-CPU backend, behind one door: the BLAS MLX loads (`blas`), mlxrl's native C++ kernels
(`native`) and the dispatch that sends float32 CPU arrays to them (`fastmath`; anything else, a GPU
included, takes MLX's own ops).

The rest of mlxrl calls `fastmath` (elementwise math, attention, the optimizer's and the head's
kernel choice) and `native_kernels()`; nothing outside this package imports `native`. Importing this
package loads the BLAS first (before ``mlx.core``): ``mlxrl/__init__`` imports it before anything else,
then asks MLX for depth-first evaluation on the CPU (`depth_first_eval`, before MLX's first evaluation).

Environment:
  MLX_BFS_MAX_WIDTH=20                                      (MLX's own order; default here: 1 on the CPU)
  MLXRL_DRAIN_BYTES=0                                       (native kernels never drain MLX's queue; see drain_bytes)
"""

import os

from . import blas

blas.setup_blas()

from . import fastmath, native  # noqa: E402  (after the BLAS)

DEPTH_FIRST = "1"  # MLX_BFS_MAX_WIDTH on the CPU


def depth_first_eval() -> bool:
    """On the CPU, have MLX evaluate a graph depth-first (MLX_BFS_MAX_WIDTH=1) unless the variable is set
    (or the default device is a GPU). True when the CPU runs depth-first.

    `mx.eval` orders a graph's arrays breadth-first from its outputs up to MLX_BFS_MAX_WIDTH (20) arrays
    wide before it goes down a level, and runs them in the reverse of that order: up to 20 independent
    branches (a checkpointed layer's recomputed projections, their gradients, the LoRA pieces) are begun
    before the first is consumed, and each begun array holds its buffer. The CPU runs one stream, one
    operation after another in that order either way, so depth-first changes which intermediates are alive
    together, not the work (the results are bit-identical). On a GPU the breadth lets independent kernels
    overlap, so its default stays. MLX reads the variable once, at its first evaluation: this runs at
    import, before it (a program that evaluated an array before importing mlxrl keeps MLX's order).
    Measured in docs/platforms.md ("Runtime"): the GRPO step at #2669's shape, MLX's peak 3.67 -> 3.45 GB."""
    import mlx.core as mx

    if "MLX_BFS_MAX_WIDTH" not in os.environ and mx.default_device() == mx.cpu:
        os.environ["MLX_BFS_MAX_WIDTH"] = DEPTH_FIRST
    return evaluates_depth_first()


def evaluates_depth_first() -> bool:
    """Whether MLX evaluates depth-first here (the CPU under `depth_first_eval`'s setting): the memory
    planner's coefficients for a checkpointed layer's backward depend on it."""
    import mlx.core as mx

    return os.environ.get("MLX_BFS_MAX_WIDTH") == DEPTH_FIRST and mx.default_device() == mx.cpu


depth_first_eval()


def native_kernels() -> bool:
    """Whether the native CPU kernels are built and loadable here (float32 CPU math then runs on them)."""
    return native.load() is not None


def drain_bytes() -> int:
    """Output size from which the native kernels finish MLX's queued CPU work before allocating the output
    (`MLXRL_DRAIN_BYTES`, default 1 MB; 0 where they never do or are not built): MLX encodes up to ~100
    operations ahead of its CPU worker, allocating each output when it is queued."""
    kernels = native.load()
    return int(kernels.drain_bytes()) if kernels is not None else 0


__all__ = ["blas", "depth_first_eval", "drain_bytes", "evaluates_depth_first", "fastmath", "native_kernels"]
