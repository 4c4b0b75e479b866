"""Attention's one door (`attention`), its structured mask (`AttentionMask`) and the graph path's tiled
attention (`tiled_attention`): softmax(q k^T scale) v without a [L, S] score array, forward or backward.

The mask a decoder builds (`language.attention_mask_for`) is a description, not an array: causal (query i of
the last L sees keys j <= i + S - L), the keys each row may see (`key_valid` [B, S], padding) and the
documents (`segments` [B, S], packing: a query sees its own document's keys), and every query sees itself (a
left-padding query that sees nothing else would give NaN). `dense()` is the boolean [B, 1, L, S] array the
paths that need one take; `block(q0, q1, k1)` the same rule for a block of queries against keys [0, k1),
from indices, so the tiled attention never builds the whole array either.

Paths (`_path`, the one dispatch point):

- "native": float32 CPU arrays with the native kernels (`cpu.fastmath.scaled_dot_product_attention`: its
  FlashAttention kernel for causal masks, the scores path with an array mask);
- "tiled": the graph path (Metal, CUDA, bf16, MLXRL_NATIVE=0) when the whole score array would pass
  `TILE_BYTES`: `tiled_attention`;
- "fused": the graph path's short shapes (decoding, small prefills): `mx.fast.scaled_dot_product_attention`
  with the dense mask.

The tiled attention (FlashAttention's algorithm in MLX ops). The queries are cut into blocks of `rows` (the
score block [B, Hq, rows, S] under `TILE_BYTES`); a causal block [q0, q1) needs only keys [0, q1 + S - L).
Each block's scores are computed in the inputs' dtype and softmaxed in float32 (m = max, p = exp(s - m),
l = sum p), o = (p v) / l, and the rows' log-sum-exp lse = m + log l (float32) is kept with the output. The
VJP recomputes each block's probabilities from lse (p = exp(s - lse)), with D = rowsum(dO o): dS = p (dO v^T
- D + dlse), dq = dS k scale, dk += dS^T q scale, dv += p^T dO (float32 accumulators, summed over the query
heads of a key head). Blocks are chained with `mx.depends` (each waits for the one before), so only one
block's scores and probabilities are alive whatever the length: memory is linear in L. Grouped-query heads
are a reshape ([B, Hkv, rep, L, D] against [B, Hkv, 1, S, D]), never a copy of k and v. No Python branch
looks at an array's values: it compiles.

    pytest tests/test_attention.py
"""

from __future__ import annotations

import functools

import mlx.core as mx

from ..cpu import fastmath

TILE_BYTES = 32 * 2**20  # one block's float32 scores on the tiled path (and the size past which it is taken)
MIN_ROWS = 16  # the smallest query block
BLOCK_COPIES = 5  # a block's [rows, S] float32 arrays alive together in the backward (see tiled_working_bytes)


class AttentionMask:
    """A decoder's attention mask as structure (module docstring): L queries (the last L of the S keys),
    causal, key_valid [B, S] bool or None, segments [B, S] int or None; every query also sees itself."""

    def __init__(self, L: int, S: int, key_valid: mx.array | None = None, segments: mx.array | None = None):
        self.L, self.S, self.key_valid, self.segments = L, S, key_valid, segments

    def block(self, q0: int, q1: int, k1: int) -> mx.array:
        """Boolean mask of queries [q0, q1) against keys [0, k1): [B | 1, 1, q1 - q0, k1]."""
        qi = mx.arange(q0, q1)[:, None] + (self.S - self.L)  # the queries' own key positions
        kj = mx.arange(k1)[None]
        allowed = (kj <= qi)[None, None]
        if self.key_valid is not None:
            allowed = allowed & self.key_valid[:, None, None, :k1].astype(mx.bool_)
        if self.segments is not None:
            off = self.S - self.L
            seg = self.segments
            allowed = allowed & (seg[:, None, off + q0:off + q1, None] == seg[:, None, None, :k1])
        return allowed | (kj == qi)[None, None]

    def dense(self) -> mx.array:
        """The boolean [B, 1, L, S] array (what `language.attention_mask_for` returned before)."""
        return self.block(0, self.L, self.S)


def dense(mask):
    """`mask` as the array (or None / "causal") the fused and the scores paths take."""
    return mask.dense() if isinstance(mask, AttentionMask) else mask


# ---------------------------------------------------------------------------------------------- tiled


def _blocks(L: int, S: int, rows: int, causal: bool) -> list[tuple[int, int, int]]:
    """(q0, q1, k1) of each query block: the keys [0, k1) it may see."""
    return [(q0, min(q0 + rows, L), min(S, min(q0 + rows, L) + S - L) if causal else S) for q0 in range(0, L, rows)]


def rows_for(B: int, Hq: int, S: int) -> int:
    """The query block of the tiled path: its [B, Hq, rows, S] float32 scores within TILE_BYTES."""
    return max(MIN_ROWS, TILE_BYTES // max(1, B * Hq * S * 4) // MIN_ROWS * MIN_ROWS)


@functools.cache
def _make_tiled(scale: float, causal: bool, rows: int, rep: int, has_valid: bool, has_segments: bool):
    def block_mask(valid, segments, L, S, q0, q1, k1):
        if not causal:
            return None
        m = AttentionMask(L, S, valid if has_valid else None, segments if has_segments else None)
        return m.block(q0, q1, k1)[:, :, None]  # [B | 1, 1, 1, bq, k1] against [B, Hkv, rep, bq, k1]

    def grouped(x, q0, q1):
        """Rows [q0, q1) of x [B, Hq, L, D] as [B, Hkv, rep * bq, D]: the query heads of a key head stacked."""
        B, Hq, _, D = x.shape
        return x[:, :, q0:q1].reshape(B, Hq // rep, rep * (q1 - q0), D)

    def ungrouped(x, bq):
        """[B, Hkv, rep * bq, D] back to [B, bq, Hq, D] (a view): the layout the buffers are concatenated in."""
        B, Hkv, _, D = x.shape
        return mx.swapaxes(x.reshape(B, Hkv * rep, bq, D), 1, 2)

    def scores(qb, kb, allowed):
        s = (qb @ mx.swapaxes(kb, -1, -2)).astype(mx.float32)  # [B, Hkv, rep * bq, k1]
        if allowed is None:
            return s
        B, Hkv, n, k1 = s.shape
        return mx.where(allowed, s.reshape(B, Hkv, rep, n // rep, k1), -mx.inf).reshape(B, Hkv, n, k1)

    def scaled(x):
        return x * mx.array(scale, x.dtype)

    @mx.custom_function
    def op(q, k, v, valid, segments):  # q [B, Hq, L, D] (unscaled), k / v [B, Hkv, S, D]
        B, Hq, L, D = q.shape
        S = k.shape[-2]
        outs, lses = [], []
        for q0, q1, k1 in _blocks(L, S, rows, causal):
            ins = [q[:, :, q0:q1], k[:, :, :k1], v[:, :, :k1]]
            qb, kb, vb = mx.depends(ins, [outs[-1], lses[-1]]) if outs else ins
            s = scores(scaled(grouped(qb, 0, q1 - q0)), kb, block_mask(valid, segments, L, S, q0, q1, k1))
            m = s.max(-1, keepdims=True)
            p = mx.exp(s - m)
            den = p.sum(-1, keepdims=True)
            o = ((p.astype(v.dtype) @ vb).astype(mx.float32) / den).astype(q.dtype)
            outs.append(ungrouped(o, q1 - q0))
            lses.append((m + mx.log(den)).reshape(B, Hq, q1 - q0))
        out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=1)  # [B, L, Hq, D]
        lse = lses[0] if len(lses) == 1 else mx.concatenate(lses, axis=-1)
        # out as the view [B, Hq, L, D] of a [B, L, Hq, D] buffer: the layer's transpose back is free
        return mx.swapaxes(out, 1, 2), lse

    @op.vjp
    def op_vjp(primals, cotangents, outputs):
        q, k, v, valid, segments = primals
        d_out, d_lse = cotangents
        out, lse = outputs
        B, Hq, L, D = q.shape
        S = k.shape[-2]
        f32 = mx.float32
        dk = mx.zeros(k.shape, f32)
        dv = mx.zeros(v.shape, f32)
        dqs = []
        for q0, q1, k1 in _blocks(L, S, rows, causal):
            bq = q1 - q0
            ins = [q[:, :, q0:q1], k[:, :, :k1], v[:, :, :k1], d_out[:, :, q0:q1], out[:, :, q0:q1],
                   lse[:, :, q0:q1], d_lse[:, :, q0:q1]]
            qb, kb, vb, dob, ob, lb, dlb = mx.depends(ins, [dqs[-1], dk, dv]) if dqs else ins
            qb, dob, ob = scaled(grouped(qb, 0, bq)), grouped(dob, 0, bq), grouped(ob, 0, bq)
            lb, dlb = (x.reshape(B, Hq // rep, rep * bq, 1).astype(f32) for x in (lb, dlb))
            p = mx.exp(scores(qb, kb, block_mask(valid, segments, L, S, q0, q1, k1)) - lb)
            dp = (dob @ mx.swapaxes(vb, -1, -2)).astype(f32)
            delta = (dob.astype(f32) * ob.astype(f32)).sum(-1, keepdims=True)
            ds = p * (dp - delta + dlb)  # [B, Hkv, rep * bq, k1]
            dqs.append(ungrouped(scaled((ds.astype(k.dtype) @ kb).astype(f32)).astype(q.dtype), bq))
            # one product per key head sums its query heads' dk / dv (no [rep, k1, D] partials)
            dk_b = (mx.swapaxes(ds, -1, -2).astype(q.dtype) @ qb).astype(f32)
            dv_b = (mx.swapaxes(p, -1, -2).astype(d_out.dtype) @ dob).astype(f32)
            dk = dk.at[:, :, :k1].add(dk_b) if k1 < S else dk + dk_b
            dv = dv.at[:, :, :k1].add(dv_b) if k1 < S else dv + dv_b
        dq = dqs[0] if len(dqs) == 1 else mx.concatenate(dqs, axis=1)
        return (mx.swapaxes(dq, 1, 2), dk.astype(k.dtype), dv.astype(v.dtype), mx.zeros_like(valid),
                mx.zeros_like(segments))

    return op


def tiled_attention(q: mx.array, k: mx.array, v: mx.array, *, scale: float, mask=None,
                    rows: int | None = None) -> tuple[mx.array, mx.array]:
    """softmax(q k^T scale) v by query blocks with its own VJP (module docstring): (out [B, Hq, L, D] in q's
    dtype, lse [B, Hq, L] float32), both differentiable. q [B, Hq, L, D], k / v [B, Hkv, S, D] (Hq a multiple of
    Hkv); mask None, "causal" or an `AttentionMask`; rows: the query block (default `rows_for`)."""
    B, Hq, L, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    if isinstance(mask, str) and mask != "causal":
        raise ValueError(f"mask must be None, 'causal' or an AttentionMask, got {mask!r}")
    structured = isinstance(mask, AttentionMask)
    if mask is not None and not structured and not isinstance(mask, str):
        raise ValueError("tiled_attention takes a structured mask (AttentionMask), not an array")
    causal = mask is not None
    if causal and L > S:
        raise ValueError(f"tiled_attention: a causal mask needs at most as many queries as keys, got {L} > {S}")
    rows = int(rows or rows_for(B, Hq, S))
    valid = mask.key_valid if structured and mask.key_valid is not None else None
    segments = mask.segments if structured and mask.segments is not None else None
    op = _make_tiled(float(scale), causal, rows, Hq // Hkv, valid is not None, segments is not None)
    return op(q, k, v, mx.zeros((1,), mx.bool_) if valid is None else valid,
              mx.zeros((1,), mx.int32) if segments is None else segments)


# ---------------------------------------------------------------------------------------------- the door


def tiles(score_elements: int, queries: int) -> bool:
    """Whether the graph path tiles an attention of `queries` rows per sequence whose whole scores (B Hq L S
    elements) would pass TILE_BYTES in float32 (`plan` asks the same of a run's shape)."""
    return queries >= MIN_ROWS and score_elements * 4 > TILE_BYTES


def tiled_working_bytes() -> int:
    """The memory model of the tiled attention's backward beyond its inputs, outputs and gradients: one block's
    scores, probabilities, their gradient and the casts between them (BLOCK_COPIES arrays of up to TILE_BYTES),
    whatever the length (`plan` adds it to an attention layer's recomputation)."""
    return BLOCK_COPIES * TILE_BYTES


def _path(q: mx.array, k: mx.array, mask) -> str:
    """Which path runs these inputs (module docstring): "native", "tiled" or "fused"."""
    if fastmath.uses_native(q):
        return "native"
    B, Hq, L, _ = q.shape
    return "tiled" if tiles(B * Hq * L * k.shape[2], L) else "fused"


def attention(q: mx.array, k: mx.array, v: mx.array, *, scale: float, mask=None) -> mx.array:
    """softmax(q k^T scale + mask) v for q [B, Hq, L, D], k / v [B, Hkv, S, D] (grouped-query heads), mask None,
    "causal", an `AttentionMask`, or a boolean / additive array (the fused and native paths only)."""
    path = _path(q, k, mask)
    if path == "tiled" and (mask is None or isinstance(mask, (str, AttentionMask))):
        return tiled_attention(q, k, v, scale=scale, mask=mask)[0]
    if path == "fused":
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=dense(mask))
    return fastmath.scaled_dot_product_attention(q, k, v, scale=scale, mask=dense(mask))


def naive_attention(q, k, v, *, scale: float, mask=None) -> tuple[mx.array, mx.array]:
    """The reference (tests): the whole [B, Hq, L, S] scores in float32, masked, softmaxed: (out in q's dtype,
    the rows' log-sum-exp [B, Hq, L] float32), as `tiled_attention` returns them."""
    L, S = q.shape[2], k.shape[2]
    rep = q.shape[1] // k.shape[1]
    kk, vv = mx.repeat(k, rep, axis=1), mx.repeat(v, rep, axis=1)
    s = (q.astype(mx.float32) * scale) @ mx.swapaxes(kk.astype(mx.float32), -1, -2)
    m = AttentionMask(L, S).dense() if isinstance(mask, str) else dense(mask)
    if m is not None:
        s = mx.where(m, s, -mx.inf)
    return (mx.softmax(s, axis=-1) @ vv.astype(mx.float32)).astype(q.dtype), mx.logsumexp(s, axis=-1)


