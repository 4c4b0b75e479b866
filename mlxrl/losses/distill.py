"""The generalized Jensen-Shannon divergence between a student's and a teacher's next-token distributions, from
their hidden states and LM heads, never holding [tokens, vocab] logits: the loss of TRL 1.16's
DistillationTrainer (`trl.kernels.chunked_divergence`), as one streamed MLX op.

With z_s = W_s h_s / T and z_t = W_t h_t / T (float32), p = softmax(z):

    beta = 0:      D = KL(p_t || p_s) = sum p_t (log p_t - log p_s)          (forward KL)
    beta = 1:      D = KL(p_s || p_t) = sum p_s (log p_s - log p_t)          (reverse KL)
    0 < beta < 1:  m = (1 - beta) p_s + beta p_t,
                   D = beta KL(p_t || m) + (1 - beta) KL(p_s || m)           (generalized JSD)
    H = -sum p_s log p_s                                                     (the student's entropy, no gradient)

and the gradient with respect to the student's logits (the teacher gets none):

    beta = 0:  dD/dz_s = p_s - p_t
    beta = 1:  dD/dz_s = p_s (log p_s - log p_t - D)
    else:      dD/dz_s = (1 - beta) p_s (log p_s - log m - KL(p_s || m))

`generalized_jsd` runs over chunks of rows, each chunk's two [rows, V] logit blocks computed, reduced and dropped
before the next (the chunks chained with `mx.depends`, so MLX runs them one after another), forward and backward;
the backward recomputes each chunk's logits. Peak memory (`peak_bytes`): 9 to 15 [rows, V] float32 blocks of
BLOCK_BYTES (a chunk's intermediates, and the next chunk's as MLX's queue runs ahead) and, with
a trained head, the [V, D] weight gradient (one running sum, accumulated with `addmm`); flat in the number of
tokens. A weight that is not float32 is cast once for the op.

Tests: pytest tests/test_distill_loss.py (against the naive computation and TRL's own ChunkedDivergenceFunction)
"""

from __future__ import annotations

import math

import mlx.core as mx

__all__ = ["generalized_jsd", "divergence_chunk_rows", "peak_bytes"]

BLOCK_BYTES = 4 << 20  # one float32 [rows, V] logit block


def divergence_chunk_rows(vocab_size: int, block_bytes: int | None = None) -> int:
    """Rows per chunk: one float32 [rows, vocab] block within `block_bytes` (default BLOCK_BYTES; at least 4 rows).
    A chunk holds about ten such blocks while it runs, and MLX's queue runs a chunk ahead (`peak_bytes`)."""
    return max(4, (block_bytes or BLOCK_BYTES) // (4 * max(vocab_size, 1)))


# [rows, V] float32 blocks alive at the op's peak, measured (V = 151936 / 248320, D = 64-1024, 6-1024 rows): one
# chunk 9; several 13 with the weight gradient's chain ordering them, up to 15 without it (MLX's queue runs ahead)
ONE_CHUNK_BLOCKS, LIVE_BLOCKS, LIVE_BLOCKS_NO_WEIGHT_GRAD = 9, 13, 15


def peak_bytes(rows: int, vocab: int, width: int, weight_grad: bool, elem: int = 4, teacher_width: int | None = None,
               teacher_elem: int | None = None, tied: bool = False) -> float:
    """What the op adds to a training step's peak over `rows` positions (the planner's model): the live logit
    blocks; a trained head's [V, D] float32 gradient is the op's output (one running sum, its `addmm` done in
    place), which the planner counts with the trainable state, and a head `tied` to the embedding adds two more
    [V, D] (that sum and the embedding's own gradient, added together); and a float32 copy of each head whose
    weights are not float32 (`elem`, `teacher_elem` bytes per weight). Measured in distillation steps: `mlxrl plan
    --trainer distill --measure` (tied), the whole runs of tests/test_distill_trainer.py (untied)."""
    chunk = divergence_chunk_rows(vocab)
    live = ONE_CHUNK_BLOCKS if rows <= chunk else (LIVE_BLOCKS if weight_grad else LIVE_BLOCKS_NO_WEIGHT_GRAD)
    out = live * min(rows, chunk) * vocab * 4
    if weight_grad and tied:
        out += 2 * vocab * width * 4
    if elem != 4:
        out += vocab * width * 4
    if (teacher_elem or elem) != 4:
        out += vocab * (teacher_width or width) * 4
    return float(out)


SUM_BLOCK = 128  # columns per partial reduction over the vocabulary (see `_blocked`)


def _blocked(reduce, combine, x):
    """reduce(x, axis=-1, keepdims=True) over a long last axis in levels: blocks of SUM_BLOCK columns, then the
    blocks' results in blocks again while there are more than 4 * SUM_BLOCK of them (and the remainder's). MLX's
    CPU reductions add a row's values one after another, so a float32 log-sum-exp over 151936 logits in one
    reduction is off by up to ~5e-6 (torch's, blocked: ~3e-7), which scales every probability alike and, in the
    forward KL's gradient p_s - p_t, is 10x float32's rounding (two levels: 1.3x torch's weight gradient)."""
    n, V = x.shape
    k = V // SUM_BLOCK * SUM_BLOCK
    if k < 4 * SUM_BLOCK:
        return reduce(x, axis=-1, keepdims=True)
    # the blocks' results are reduced the same way (a second level of blocks past 512 of them: 1187 at V = 151936)
    head = _blocked(reduce, combine, reduce(x[:, :k].reshape(n, k // SUM_BLOCK, SUM_BLOCK), axis=-1))
    return head if k == V else combine(head, reduce(x[:, k:], axis=-1, keepdims=True))


def _sum(x):
    return _blocked(mx.sum, mx.add, x)[:, 0]


def _log_softmax(z):
    return z - _blocked(mx.logsumexp, mx.logaddexp, z)


def _divergence(zs, zt, beta: float, grad: bool):
    """(D [n], H [n], dD/dz_s [n, V] or None) of one chunk's float32 logits (module docstring)."""
    log_ps, log_pt = _log_softmax(zs), _log_softmax(zt)
    ps = mx.exp(log_ps)
    entropy = -_sum(ps * log_ps)
    if beta == 0.0:
        pt = mx.exp(log_pt)
        d = _sum(pt * (log_pt - log_ps))
        dz = ps - pt if grad else None
    elif beta == 1.0:
        gap = log_ps - log_pt
        d = _sum(ps * gap)
        dz = ps * (gap - d[:, None]) if grad else None
    else:
        pt = mx.exp(log_pt)
        log_m = mx.logaddexp(log_ps + math.log(1.0 - beta), log_pt + math.log(beta))
        kl_s = _sum(ps * (log_ps - log_m))
        d = beta * _sum(pt * (log_pt - log_m)) + (1.0 - beta) * kl_s
        dz = (1.0 - beta) * ps * (log_ps - log_m - kl_s[:, None]) if grad else None
    return d, entropy, dz


def _logits(h, w32, inv_t):
    z = h.astype(mx.float32) @ w32.T
    return z * inv_t if inv_t != 1.0 else z


def _bounds(n: int, rows: int):
    return [(s, min(s + rows, n)) for s in range(0, n, rows)]


def _make(beta: float, inv_t: float, rows: int | None, weight_grad: bool):
    @mx.custom_function
    def fn(hs, ws, ht, wt):
        ws32, wt32 = ws.astype(mx.float32), wt.astype(mx.float32)
        step = rows or divergence_chunk_rows(ws.shape[0])
        ds, hs_ = [], []
        for s, e in _bounds(hs.shape[0], step):
            a, b = hs[s:e], ht[s:e]
            if ds:  # the next chunk waits for the previous one's results: one chunk's logits alive at a time
                a, b = mx.depends(a, [ds[-1], hs_[-1]]), mx.depends(b, [ds[-1], hs_[-1]])
            d, h, _ = _divergence(_logits(a, ws32, inv_t), _logits(b, wt32, inv_t), beta, grad=False)
            ds.append(d)
            hs_.append(h)
        return mx.concatenate(ds), mx.concatenate(hs_)

    @fn.vjp
    def fn_vjp(primals, cotangents, outputs):
        hs, ws, ht, wt = primals
        g = cotangents[0]
        ws32, wt32 = ws.astype(mx.float32), wt.astype(mx.float32)
        step = rows or divergence_chunk_rows(ws.shape[0])
        dhs, dw = [], None
        for s, e in _bounds(hs.shape[0], step):
            a, b = hs[s:e], ht[s:e]
            if dhs:  # the running weight gradient orders itself (each sum takes the last): a dependency on it
                # would keep every partial sum alive (measured: 4 [V, D] arrays instead of 1.5)
                a, b = mx.depends(a, [dhs[-1]]), mx.depends(b, [dhs[-1]])
            _, _, dz = _divergence(_logits(a, ws32, inv_t), _logits(b, wt32, inv_t), beta, grad=True)
            dz = dz * (g[s:e, None].astype(mx.float32) * inv_t)  # through z = W h / T
            dhs.append((dz @ ws32).astype(hs.dtype))
            if weight_grad:  # one fused multiply-add per chunk: no [V, D] product beside the running sum
                a32 = a.astype(mx.float32)
                dw = dz.T @ a32 if dw is None else mx.addmm(dw, dz.T, a32)
        d_ws = dw.astype(ws.dtype) if weight_grad else mx.zeros_like(ws)
        return mx.concatenate(dhs), d_ws, mx.zeros_like(ht), mx.zeros_like(wt)

    return fn


_CACHE: dict = {}


def generalized_jsd(student_hidden: mx.array, student_weight: mx.array, teacher_hidden: mx.array,
                    teacher_weight: mx.array, *, beta: float = 1.0, temperature: float = 1.0,
                    chunk_rows: int | None = None, weight_grad: bool = True) -> tuple[mx.array, mx.array]:
    """Per-row divergence D [N] and the student's entropy H [N] (module docstring) of student_hidden [N, D_s] under
    student_weight [V, D_s] against teacher_hidden [N, D_t] under teacher_weight [V, D_t]. Differentiable in the
    student's hidden states and (weight_grad) its head; the teacher's inputs get zero gradients, H none."""
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1] (0: forward KL, 1: reverse KL), got {beta}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if student_weight.shape[0] != teacher_weight.shape[0]:
        raise ValueError(f"the student's vocabulary ({student_weight.shape[0]}) and the teacher's "
                         f"({teacher_weight.shape[0]}) differ: distillation compares distributions over one vocabulary")
    key = (float(beta), 1.0 / float(temperature), chunk_rows, weight_grad)
    if key not in _CACHE:
        _CACHE[key] = _make(*key)
    d, h = _CACHE[key](student_hidden, student_weight, mx.stop_gradient(teacher_hidden),
                       mx.stop_gradient(teacher_weight))
    return d, mx.stop_gradient(h)
