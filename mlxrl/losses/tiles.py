"""What the streamed head (`head`) and the fused head (`fused_head`) share: the tile sizes, a weight
tile cast to float32 in order, the shifted exp, row bounds, the rows worth scoring, and the two-phase
step (trunk forward, the head streamed eagerly, one VJP of trunk and head weight)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..cpu import fastmath
from ..processing.tokens import IGNORE_INDEX

TILE_BYTES = 16 << 20  # default budget for one float32 [rows, vocab_chunk] tile


def default_chunk_size(n_rows: int, vocab_size: int, tile_bytes: int = TILE_BYTES, width: int = 0) -> int:
    """Vocab columns per tile so that one float32 [n_rows, chunk] tile, and the float32 [chunk, width]
    slice of a bf16 weight cast for it, stay within `tile_bytes`."""
    cols = tile_bytes // (4 * max(n_rows, width, 1))
    return int(min(vocab_size, max(128, cols // 128 * 128)))


def weight_tile(weight, s, e, after=()):
    """weight[s:e] in float32, cast only once the arrays in `after` exist: a cast depends on the
    weight alone, so MLX would otherwise schedule every tile's cast first (the whole [V, D] in
    float32 at once when the weight is bf16).

    float32 operands: a bf16 matmul would round every logit to bf16 (steps of 0.03-0.06 at |z| 4-8)
    before the float32 statistics; the cast is [C, D] per tile against the [N, C, D] matmul."""
    w = weight[s:e]
    return (mx.depends(w, list(after)) if after else w).astype(mx.float32)

_compiled_exp_shift = mx.compile(lambda z, m: mx.exp(z - m))  # one pass, no [Nc, V] temporary for z - m


def exp_shift(z, m):
    # on the CPU the native exp (faster than mx.exp there) writes into z - m's buffer: the same two tiles
    return fastmath.exp(z - m) if fastmath.uses_native(z) else _compiled_exp_shift(z, m)

def row_bounds(n: int, chunk: int):
    return [(s, min(s + chunk, n)) for s in range(0, n, chunk)]

def scored_rows(targets: mx.array) -> np.ndarray | None:
    """Indices of rows to score, or None when every row counts (no gather needed)."""
    t = np.asarray(targets)
    keep = np.flatnonzero(t != IGNORE_INDEX)
    return None if keep.size == t.size else keep

def two_phase(trunk, head_weight, params, head):
    """Trunk forward to `hidden` (evaluated), `head(hidden, weight) -> (out, d_hidden, d_weight)`
    streamed eagerly, then one `mx.vjp` of trunk and head weight with those cotangents (the trunk
    runs again inside it). Returns (out, grads w.r.t. params)."""
    from mlx.utils import tree_flatten, tree_unflatten

    keys, leaves = zip(*tree_flatten(params), strict=True)

    def rebuild(xs):
        return tree_unflatten(list(zip(keys, xs, strict=True)))

    hidden = trunk(params)
    weight = head_weight(params)
    mx.eval(hidden, weight)
    out, d_hidden, d_weight = head(hidden, weight)
    del hidden

    def trunk_and_head(*xs):  # one VJP: the trunk gets d_hidden, the head weight d_weight
        p = rebuild(xs)
        return trunk(p), head_weight(p)

    _, grads = mx.vjp(trunk_and_head, list(leaves), [d_hidden, d_weight])
    return out, rebuild(grads)
