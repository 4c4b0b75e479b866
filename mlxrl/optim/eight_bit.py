"""Block-wise 8-bit optimizer state (`--optim adamw_8bit` / `adamw_bnb_8bit`: `optim.AdamW8bit`).

Dettmers et al., "8-bit Optimizers via Block-wise Quantization" (2022), as bitsandbytes' `AdamW8bit` runs
it: each moment of a trained array of at least 4096 elements (`MIN_8BIT_SIZE`) is kept as one uint8 code
per element, an index into a sorted map of 256 values (the dynamic tree map: a decade exponent and a linear
fraction; signed for m, non-negative for v), times the absolute maximum of its block of 256 consecutive
elements (`BLOCK`, one float32 per block). A step dequantizes both moments, updates them and the weight in
float32 exactly as AdamW (the weight from the new float32 moments, not their rounded codes), then stores
each new moment as the code nearest to it over its block's new maximum. Smaller arrays keep float32 moments.

So a trained parameter costs 2 x (1 + 4 / 256) bytes of optimizer state instead of 8: full fine-tuning of a
0.6B model holds ~1.2 GB of moments instead of 4.8. On float32 CPU arrays the step is one native kernel per
moment and one for the weight (`mlxrl.native`: each block updated, measured and re-coded in registers);
elsewhere (the graph path, bf16 parameters' float32 master copies on a GPU) it is MLX ops in chunks, the
nearest code found by 8 halvings of the map's midpoints (the kernel starts from a table indexed by the
value's upper 16 bits instead): both give the count of midpoints below the value.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

BLOCK = 256
MIN_8BIT_SIZE = 4096
NAMES = ("adamw_8bit", "adamw_bnb_8bit")
# the graph path updates an array in chunks of this many elements (a multiple of BLOCK), one after another:
# its coding holds ~35 float32-sized temporaries an element, and MLX allocates an operation's output when it
# queues it, up to ~100 operations ahead, so whole arrays would hold ~35x their size at once
CHUNK = 1 << 21


def update_bytes(largest32: int, native: bool) -> float:
    """Memory model (the planner's): what the update holds above the gradients. The native kernels: the
    array in flight's new codes next to its old ones (2 bytes an element of the largest array, whose float32
    size is largest32). The graph path: its new weights and codes until its chunks are joined (6 bytes), and
    the temporaries of up to two chunks in flight (~36 float32 values an element; measured: 1.04 chunks on
    a one-chunk array, 1.7 on the 0.6B shape's embedding)."""
    if native:
        return 0.5 * largest32
    elements = largest32 // 4
    return 1.5 * largest32 + 36 * 4 * min(CHUNK, elements) * min(2, -(-elements // CHUNK))


def dynamic_map(signed: bool) -> np.ndarray:
    """The 256 sorted values of the 8-bit dynamic tree map: 0, 1 and, for each decade 10^-6 .. 10^-1 .. 1 (7
    decades), the midpoints of an even split of [0.1, 1] scaled to it: 2^i parts in decade i when signed (and
    their negatives), 2^(i+1) when not (the sign bit spent on resolution)."""
    values = [0.0, 1.0]
    for i in range(7):
        parts = 2 ** i if signed else 2 ** (i + 1)
        edges = np.linspace(0.1, 1.0, parts + 1, dtype=np.float32)
        mids = (edges[:-1] + edges[1:]) / np.float32(2) * np.float32(10.0 ** (i - 6))
        values += list(mids) + ([-x for x in mids] if signed else [])
    assert len(values) == 256
    return np.sort(np.asarray(values, np.float32))


def midpoints(code: np.ndarray) -> np.ndarray:
    """The 255 midpoints between consecutive codes, then +inf: the nearest code to x is the count of
    midpoints below x (ties go to the lower code)."""
    return np.append((code[:-1] + code[1:]) / 2, np.float32(np.inf)).astype(np.float32)


def start_table(mid: np.ndarray) -> np.ndarray:
    """For the native kernel: for each upper 16 bits of a float32 (its bfloat16 truncation), the count of
    midpoints below the lowest float with those bits, where its search for the nearest code starts (NaN
    patterns: 0)."""
    hi = np.arange(1 << 16, dtype=np.uint32) << 16
    low = np.where(hi >> 31 == 1, hi | 0xFFFF, hi).view(np.float32)  # a negative's lowest value has all low bits
    start = np.searchsorted(mid[:-1], np.nan_to_num(low, nan=-np.inf), side="left")
    return np.minimum(start, 255).astype(np.uint8)


CODE_M, CODE_V = dynamic_map(True), dynamic_map(False)
MID_M, MID_V = midpoints(CODE_M), midpoints(CODE_V)
MAPS = np.concatenate([CODE_M, CODE_V, MID_M, MID_V])  # the native kernel's layout
LUTS = np.concatenate([start_table(MID_M), start_table(MID_V)])


def blocks(n: int) -> int:
    return -(-n // BLOCK)


def nearest_codes(x: mx.array, mid: mx.array, starts: mx.array | None = None) -> mx.array:
    """uint8 index of the nearest code to each element of x (normalised to the map's range): the count of
    midpoints below it. With `starts` (the map's `start_table`): the count below x's bfloat16 bucket, plus the
    one midpoint a bucket can hold (each map's midpoints are further apart than a bucket is wide); without, a
    binary search (8 gathers)."""
    if starts is not None:
        idx = mx.take(starts, (x.view(mx.uint32) >> 16).astype(mx.int32)).astype(mx.int32)
        return (idx + (x > mx.take(mid, idx))).astype(mx.uint8)
    idx = mx.zeros(x.shape, mx.int32)
    for step in (128, 64, 32, 16, 8, 4, 2, 1):
        up = idx + step
        idx = mx.where(x > mx.take(mid, up - 1), up, idx)
    return idx.astype(mx.uint8)


def dequantize(codes: mx.array, maxima: mx.array, code: mx.array) -> mx.array:
    """The float32 values of 8-bit state: code value times its block's maximum, in codes' shape."""
    n = codes.size
    per = mx.repeat(maxima, BLOCK)[:n].reshape(codes.shape)
    return mx.take(code, codes.astype(mx.int32)) * per


def quantize(x: mx.array, mid: mx.array, starts: mx.array | None = None) -> tuple[mx.array, mx.array]:
    """(uint8 codes in x's shape, float32 block maxima) of float32 x (`starts`: see `nearest_codes`)."""
    n = x.size
    flat = x.reshape(-1)
    pad = blocks(n) * BLOCK - n
    tiles = mx.pad(flat, (0, pad)).reshape(-1, BLOCK) if pad else flat.reshape(-1, BLOCK)
    top = mx.max(mx.abs(tiles), axis=1)
    inv = mx.where(top > 0, 1.0 / mx.where(top > 0, top, 1.0), 0.0)
    codes = nearest_codes(tiles * inv[:, None], mid, starts).reshape(-1)
    return (codes[:n] if pad else codes).reshape(x.shape), top


def chunked(step, arrays: list, after: list | None) -> list:
    """step(w, g, m codes, m maxima, v codes, v maxima) -> the same five, new, applied to CHUNK elements at a
    time (and their blocks' maxima), each chunk's inputs waiting for the previous chunk's outputs (`after`:
    the previous array's); the outputs joined in the arrays' shapes."""
    w, g, mq, ma, vq, va = arrays
    flat = [x.reshape(-1) for x in (w, g, mq, vq)]
    parts = []
    for lo in range(0, w.size, CHUNK):
        hi = min(w.size, lo + CHUNK)
        blk = slice(lo // BLOCK, blocks(hi))
        ins = [flat[0][lo:hi], flat[1][lo:hi], flat[2][lo:hi], ma[blk], flat[3][lo:hi], va[blk]]
        parts.append(step(*(ins if after is None else mx.depends(ins, after))))
        after = list(parts[-1])
    joined = [p[0] if len(parts) == 1 else mx.concatenate(p) for p in zip(*parts, strict=True)]
    return [x.reshape(w.shape) if i in (0, 1, 3) else x for i, x in enumerate(joined)]


def state_bytes(trainable_params: int) -> int:
    """Memory model (the planner's): 8-bit m and v with a float32 maximum per block (arrays under
    MIN_8BIT_SIZE, float32 moments, are counted as 8-bit: a few kB)."""
    return int(2 * trainable_params * (1 + 4 / BLOCK))
