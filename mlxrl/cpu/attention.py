"""Causal attention on the native CPU path in blocks of queries, with a backward that recomputes each
block's probabilities instead of keeping them (the memory shape of FlashAttention, with BLAS matmuls).

MLX has no fused attention kernel on the CPU: differentiated as plain ops, `softmax(q k^T) v` keeps the
probabilities of the whole [H, L, L] square for the backward, and the backward builds two more squares
(their cotangent and the scores' one). At L = 4096 with 16 heads that is ~1 GB each, per layer, at
once: the step's peak grows with L^2. Here the forward goes through the queries in blocks of `block`
rows (each block scores only the keys it can see, so a causal square costs ~(1 + 1/n) / 2 of the full
one over n blocks) and keeps nothing but its inputs and output; the VJP goes through the same blocks
again, one after the other (`mx.depends` orders them, so one block's [rows, keys] temporaries are
freed before the next one's are made), and per block recomputes the scores and probabilities
(one extra matmul of the block), then

    dV += P^T dO,   dP = dO V^T,   dS = P (dP - sum(dP P)),   dQ = dS K,   dK += dS^T Q.

The grouped-query heads that share a key/value head are stacked as rows of one matmul ([rep * rows,
D] against [keys, D]): no copies of k and v, and larger matmuls. The softmax and its VJP are the native
kernels with the causal mask inside (masked keys are never exp'd and their gradient is 0), so no mask
array exists. Peak above the inputs: ~4 [Hq, block, L] float32 blocks (the scores / probabilities and
their cotangents) plus dK / dV, flat in the number of blocks.
"""

from __future__ import annotations

import mlx.core as mx

_CACHE: dict = {}


def blocks(L: int, S: int, block: int) -> list[tuple[int, int, int]]:
    """(first row, end row, keys seen) per block of queries; the queries are the last L of S positions."""
    return [(r0, min(L, r0 + block), min(L, r0 + block) + S - L) for r0 in range(0, L, block)]


def _make(L: int, S: int, block: int, kernels):
    spans = blocks(L, S, block)

    def scores(qb, k, seen):
        """q block [B, Hkv, rep, n, D] against the first `seen` keys: probabilities [B, Hkv, rep * n, seen]
        and the block's stacked queries [B, Hkv, rep * n, D]."""
        B, Hkv, rep, n, D = qb.shape
        rows = qb.reshape(B, Hkv, rep * n, D)
        s = rows @ k[..., :seen, :].swapaxes(-1, -2)
        p = kernels.softmax(s.reshape(B, Hkv, rep, n, seen), causal=True)
        return p.reshape(B, Hkv, rep * n, seen), rows

    @mx.custom_function
    def attend(q, k, v):
        B, Hkv, rep, _, D = q.shape
        outs = []
        for r0, r1, seen in spans:
            qb = q[..., r0:r1, :] if not outs else mx.depends(q[..., r0:r1, :], outs[-1:])
            p, _ = scores(qb, k, seen)
            outs.append((p @ v[..., :seen, :]).reshape(B, Hkv, rep, r1 - r0, D))
        return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=-2)

    @attend.vjp
    def attend_vjp(primals, cotangent, _output):
        q, k, v = primals
        cotangent = cotangent[0] if isinstance(cotangent, (list, tuple)) else cotangent
        B, Hkv, rep, _, D = q.shape
        dqs, dk, dv = [], None, None
        for r0, r1, seen in reversed(spans):  # the widest block first: dk / dv start at their full size
            n = r1 - r0
            qb = q[..., r0:r1, :] if dk is None else mx.depends(q[..., r0:r1, :], [dk, dv, dqs[-1]])
            p, rows = scores(qb, k, seen)
            do = cotangent[..., r0:r1, :].reshape(B, Hkv, rep * n, D)
            dp = do @ v[..., :seen, :].swapaxes(-1, -2)
            ds = kernels.softmax_grad(p.reshape(B, Hkv, rep, n, seen), dp.reshape(B, Hkv, rep, n, seen),
                                      causal=True).reshape(B, Hkv, rep * n, seen)
            dv_b, dk_b = p.swapaxes(-1, -2) @ do, ds.swapaxes(-1, -2) @ rows
            dqs.append((ds @ k[..., :seen, :]).reshape(B, Hkv, rep, n, D))
            if dk is None:
                dk, dv = dk_b, dv_b
            else:
                pad = [(0, 0), (0, 0), (0, S - seen), (0, 0)]
                dk, dv = dk + mx.pad(dk_b, pad), dv + mx.pad(dv_b, pad)
        dq = dqs[0] if len(dqs) == 1 else mx.concatenate(dqs[::-1], axis=-2)
        return dq, dk.astype(k.dtype), dv.astype(v.dtype)

    return attend


def causal_attention(q: mx.array, k: mx.array, v: mx.array, kernels, block: int) -> mx.array:
    """softmax(q k^T, causal) v for scaled q [B, Hkv, rep, L, D] and k / v [B, Hkv, S, D] (L <= S;
    query i sees keys j <= i + S - L), float32 on the CPU with the native kernels `kernels`."""
    L, S = q.shape[-2], k.shape[-2]
    key = (L, S, block, id(kernels))
    if key not in _CACHE:
        _CACHE[key] = _make(L, S, block, kernels)
    return _CACHE[key](q, k, v)
