"""The Linux-CPU backend, behind one door: the BLAS MLX loads (`blas`), mlxrl's native C++ kernels
(`native`) and the dispatch that sends float32 CPU arrays to them (`fastmath`; anything else, a GPU
included, takes MLX's own ops).

The rest of mlxrl calls `fastmath` (elementwise math, attention, the optimizer's and the head's
kernel choice) and `native_kernels()`; nothing outside this package imports `native`. Importing this
package loads the BLAS first (before ``mlx.core``): ``mlxrl/__init__`` imports it before anything else,
then asks MLX for depth-first evaluation on the CPU (`depth_first_eval`, before MLX's first evaluation)
and glibc's malloc for one arena (`one_malloc_arena`, before other threads allocate).

Environment:
  MLX_BFS_MAX_WIDTH=20                                      (MLX's own order; default here: 1 on the CPU)
  MALLOC_ARENA_MAX=N                                        (glibc's own; default here: 1 on the CPU)
  MLXRL_DRAIN_BYTES=0                                       (native kernels never drain MLX's queue; see drain_bytes)
"""

import os
import sys

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
    Measured in docs/platforms.md ("Runtime")."""
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

M_ARENA_MAX = -8  # glibc's mallopt parameter (malloc.h)


def one_malloc_arena() -> bool:
    """On the CPU under glibc, have every thread allocate from malloc's main heap (mallopt M_ARENA_MAX 1)
    unless MALLOC_ARENA_MAX or the glibc.malloc.arena_max tunable is set. True when set.

    glibc gives threads other than the main one arenas of their own, up to 8 per core: separate heaps,
    each reusing only its own freed memory. Loading a checkpoint and its tokenizer runs worker threads,
    and a training step's worker threads then allocate in their arenas, each keeping its own high-water
    mark beside the main heap's; with one arena a range freed by any thread serves the next block of any
    thread. The limit binds only arenas made after it, so it is set at import, before the first worker
    thread allocates. Measured in docs/platforms.md ("Runtime")."""
    import mlx.core as mx

    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if not sys.platform.startswith("linux") or mx.default_device() != mx.cpu \
            or "MALLOC_ARENA_MAX" in os.environ or "glibc.malloc.arena_max" in tunables:
        return False
    import ctypes

    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(M_ARENA_MAX, 1))
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False


one_malloc_arena()


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
