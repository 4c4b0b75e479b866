"""The LM head and log-probs as one streamed op that never materialises [tokens, vocab] logits.

    logp_i = z_i[t_i] - logsumexp(z_i),   z_i = W h_i / T          (float32)
    H_i    = logsumexp(z_i) - sum_j p_ij z_ij                       (entropy, optional)

Backward, per row chunk, from cotangents g (of logp) and e (of H):
    dz = g (onehot(t) - p) - e p (log p + H)
    dh = dz W / T,   dW += dz^T h / T                               (float32 accumulation)

Two ways to drive it, both exact (no gradient filtering):

* `head_logprobs(...)` is differentiable (`mx.custom_function` with a streamed VJP) and works
  inside any `mx.grad` / `mx.value_and_grad`. The chunks of the forward and of the VJP are chained
  with `mx.depends` so MLX schedules them one after another: peak memory is the weight gradient
  plus a few [chunk, V] tiles, flat in N. Rows whose target is -100 are dropped before the head
  (they cost nothing) when `targets` is a concrete array.
* `streamed_logprobs` + `streamed_head_backward` are the eager halves of a two-phase step for the
  trainers: an `mx.eval` per chunk bounds memory to about two tiles plus the weight gradient, at
  the price of running the trunk forward twice (once to get `hidden`, once inside its `mx.vjp`).

Both tile the VOCABULARY, so the gradient needs each tile's logits again: 4 [N, D] x [D, V]
matmuls against the naive head's 3. A token-separable loss can take the fused head instead
(`fused_head`: row tiles, 3 matmuls). The tiles' shared pieces are in `tiles`.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..processing.tokens import IGNORE_INDEX
from .tiles import default_chunk_size, exp_shift, row_bounds, scored_rows, two_phase, weight_tile

COMPILED_TILES = 7.0  # live [rows, chunk] float32 tiles under a compiled step (measured, MLX 0.32; 16 eager)
DEPTH_FIRST_TILES = 2.0  # more with a bf16 weight under depth-first evaluation (the CPU's: cpu.depth_first_eval)
DRAINED_TILES = 5.5  # compiled, the native kernels draining MLX's CPU queue before each tile (cpu.drain_bytes)


def peak_bytes(rows: int, vocab: int, width: int, elem: int, weight_grad: bool, chunk: int | None = None,
               compiled: bool = True, drain_from: int = 0) -> float:
    """Memory model of `head_logprobs` (the planner's; measured on MLX 0.32): live [rows, chunk] float32 tiles
    (about 7 under a compiled step, 16 eager, never more than ~2x (5x eager) the bytes of all the tiles of
    one pass; with a bf16 weight, depth-first evaluation (the CPU's) begins the next vocab chunk's float32
    weight slice and 2 tiles before the last chunk's are consumed: measured on an SFT step); a trained head
    adds its [V, D] gradient's pieces and concatenation (2 [V, D] in the weight's dtype); a bf16 weight's
    float32 [chunk, D] slices (about 2.5 live). `drain_from`: the size from which the native kernels drain
    MLX's CPU queue (`cpu.drain_bytes`; 0: they do not run here): tiles that large are fewer at once."""
    from ..cpu import evaluates_depth_first

    chunk = min(chunk or default_chunk_size(rows, vocab, width=width), vocab)
    tile = 4 * rows * chunk
    every = 4 * rows * vocab
    casts = 2.5 * 4 * chunk * width if elem != 4 else 0
    if weight_grad:
        return 2 * vocab * width * elem + min((0.25 if compiled else 3.5) * tile, every) + casts
    # depth-first with a bf16 weight: the next vocab chunk's float32 weight slice and tiles begin early
    later = 4 * chunk * width + DEPTH_FIRST_TILES * tile if elem != 4 and evaluates_depth_first() else 0
    tiles = (DRAINED_TILES if 0 < drain_from <= tile else COMPILED_TILES) if compiled else 16
    return min(tiles * tile, (2 if compiled else 5) * every) + casts + later


def _tile(h, w32, inv_t):
    z = h.astype(mx.float32) @ w32.T
    return z * inv_t if inv_t != 1.0 else z


def _target_logit(h, weight, t, inv_t):
    """z[t] without the full row: a gather of W's target rows and a dot product ([N, D] work)."""
    zt = (h.astype(mx.float32) * weight[t].astype(mx.float32)).sum(-1)
    return zt * inv_t


def _online_stats(h, w32, s, inv_t, stats, with_entropy):
    """Fold vocab tile [s, e) into each row's running (max, sum exp, sum exp*z, argmax).

    Passes over the [N, C] tile (MLX's CPU elementwise ops run on one core): argmax (the max is
    gathered from it), one fused exp, and the row sums as BLAS gemvs."""
    z = _tile(h, w32, inv_t)  # [N, C]
    e = s + w32.shape[0]
    m_old, sum_old, zsum_old, arg_old = stats
    tile_arg = mx.argmax(z, -1).astype(mx.int32)
    tile_max = mx.take_along_axis(z, tile_arg[:, None], -1)[:, 0]
    m = mx.maximum(m_old, tile_max)
    scale = mx.exp(m_old - m)
    ez = exp_shift(z, m[:, None])
    total = sum_old * scale + ez @ mx.ones((e - s,), mx.float32)
    zsum = zsum_old * scale + (ez[:, None, :] @ z[:, :, None])[:, 0, 0] if with_entropy else zsum_old
    arg = mx.where(tile_max > m_old, tile_arg + s, arg_old)
    return m, total, zsum, arg


def _finish(stats, zt, with_entropy):
    m, total, zsum, _ = stats
    lse = m + mx.log(total)
    ent = lse - zsum / total if with_entropy else mx.zeros_like(lse)
    return zt - lse, ent, lse


@mx.compile
def _dz_core(z, lse, ent, g, ge, t, cols):
    """g (onehot - p) - ge p (log p + H) in one fused pass over the tile."""
    logp_all = z - lse[:, None]
    p = mx.exp(logp_all)
    onehot = (cols[None, :] == t[:, None]).astype(mx.float32)
    return g[:, None] * (onehot - p) - ge[:, None] * p * (logp_all + ent[:, None])


def _tile_dz(h, w32, s, t, lse, ent, g_logp, g_ent, inv_t):
    """Gradient of sum(g*logp + e*H) w.r.t. the logits of vocab tile [s, e) (float32 [N, C]),
    already scaled by 1/T (the chain rule through z = h W^T / T)."""
    z = _tile(h, w32, inv_t)
    e = s + w32.shape[0]
    g = g_logp * inv_t
    ge = mx.zeros_like(g) if g_ent is None else g_ent * inv_t
    return _dz_core(z, lse, ent, g, ge, t, mx.arange(s, e))


def _init_stats(n):
    return (mx.full((n,), -mx.inf, dtype=mx.float32), mx.zeros((n,), mx.float32), mx.zeros((n,), mx.float32),
            mx.zeros((n,), mx.int32))


def _make_streamed(chunk: int | None, inv_t: float, with_entropy: bool, weight_grad: bool = True):
    @mx.custom_function
    def fn(hidden, weight, targets):
        n, v = hidden.shape[0], weight.shape[0]
        stats = _init_stats(n)
        h32 = hidden.astype(mx.float32)
        for s, e in row_bounds(v, chunk or default_chunk_size(n, v, width=hidden.shape[1])):
            h = mx.depends(h32, list(stats))  # run tiles in order: each waits for the previous stats
            stats = _online_stats(h, weight_tile(weight, s, e, stats), s, inv_t, stats, with_entropy)
        logp, ent, lse = _finish(stats, _target_logit(hidden, weight, targets, inv_t), with_entropy)
        return logp, ent, lse, stats[3]

    @fn.vjp
    def fn_vjp(primals, cotangents, outputs):
        hidden, weight, targets = primals
        g_logp, g_ent = cotangents[:2]
        _, ent, lse, _ = outputs
        n, v = hidden.shape[0], weight.shape[0]
        h32 = hidden.astype(mx.float32)
        dh = mx.zeros(hidden.shape, mx.float32)
        dws = []
        for s, e in row_bounds(v, chunk or default_chunk_size(n, v, width=hidden.shape[1])):
            # the next tile waits for everything the previous one produced, so its [N, C] tiles die first
            after = [dh] + dws[-1:]
            h, w32 = mx.depends(h32, after), weight_tile(weight, s, e, after)
            dz = _tile_dz(h, w32, s, targets, lse, ent, g_logp, g_ent if with_entropy else None, inv_t)
            dh = dh + dz @ w32
            if weight_grad:
                dws.append((dz.T @ h32).astype(weight.dtype))
        dw = mx.concatenate(dws) if weight_grad else mx.zeros_like(weight)
        return dh.astype(hidden.dtype), dw, mx.zeros_like(targets)

    return fn


_CACHE: dict = {}


def head_logprobs(
    hidden: mx.array,
    weight: mx.array,
    targets: mx.array,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    return_entropy: bool = False,
    active_rows: mx.array | np.ndarray | None = None,
    skip_ignored: bool = True,
    return_argmax: bool = False,
    weight_grad: bool = True,
):
    """Per-token log p(target) (float32 [N]) of `hidden [N, D]` under the LM head `weight [V, D]`,
    streamed over row chunks; differentiable w.r.t. hidden and weight.

    targets [N]: token ids; -100 rows are not scored (their log-prob and entropy are 0).
    temperature: logits are divided by it (GRPO's sampling temperature).
    chunk_size: vocab columns per tile (default: a 16 MB float32 [rows, chunk] tile).
    return_entropy: also return the per-token entropy of the (tempered) distribution.
    active_rows: indices of the rows to score; computed from targets when omitted.
    skip_ignored=False: score every row without looking at the targets (needed under mx.compile,
    where targets are not concrete; select the rows beforehand); -100 rows then get garbage that
    the caller masks out.
    return_argmax: also return each row's argmax token (int32; -1 on unscored rows), for accuracy.
    weight_grad=False: the VJP skips the weight gradient (returns zeros) when the head is frozen.
    Returns logp, then entropy and argmax when asked for.
    """
    n = hidden.shape[0]
    if not skip_ignored:
        targets = mx.maximum(targets, 0)
    elif active_rows is None:
        active_rows = scored_rows(targets)
    if active_rows is not None:
        rows = mx.array(np.asarray(active_rows), dtype=mx.int32)
        h, t = hidden[rows], targets[rows]
    else:
        h, t = hidden, targets
    key = (chunk_size, 1.0 / temperature, return_entropy, weight_grad)
    if key not in _CACHE:
        _CACHE[key] = _make_streamed(*key)
    if h.shape[0] == 0:
        logp = ent = mx.zeros((0,), dtype=mx.float32)
        arg = mx.zeros((0,), dtype=mx.int32)
    else:
        logp, ent, _, arg = _CACHE[key](h, weight, t.astype(mx.int32))
    if active_rows is not None:
        logp = mx.zeros((n,), dtype=mx.float32).at[rows].add(logp)
        ent = mx.zeros((n,), dtype=mx.float32).at[rows].add(ent)
        arg = mx.full((n,), -1, dtype=mx.int32).at[rows].add(arg + 1)
    out = (logp,) + ((ent,) if return_entropy else ()) + ((arg,) if return_argmax else ())
    return out if len(out) > 1 else logp


# --------------------------------------------------------------------------------------------
# Two-phase streamed step (eager; an mx.eval per chunk)
# --------------------------------------------------------------------------------------------


def _rows(targets):
    t = np.asarray(targets)
    rows = np.flatnonzero(t != IGNORE_INDEX)
    return rows, mx.array(rows), mx.array(t[rows], dtype=mx.int32)


def streamed_logprobs(hidden, weight, targets, *, temperature=1.0, chunk_size=None, with_entropy=False):
    """Phase 1: per-token logp, entropy, logsumexp (float32 [N] each) and the argmax token (int32
    [N], for accuracy), one evaluated vocab tile at a time over the rows whose target is not -100
    (those rows get 0, and argmax -1). Keeps no graph: call it outside any gradient transformation."""
    n, v = hidden.shape[0], weight.shape[0]
    rows_np, rows, t = _rows(targets)
    inv_t = 1.0 / temperature
    h = hidden[rows].astype(mx.float32)
    stats = _init_stats(rows_np.size)
    for s, e in row_bounds(v, chunk_size or default_chunk_size(rows_np.size, v, width=hidden.shape[1])):
        stats = _online_stats(h, weight_tile(weight, s, e), s, inv_t, stats, with_entropy)
        mx.eval(stats)
    outs = _finish(stats, _target_logit(h, weight, t, inv_t), with_entropy)
    full = [mx.zeros((n,), mx.float32).at[rows].add(o) for o in outs]
    full.append(mx.full((n,), -1, mx.int32).at[rows].add(stats[3] + 1))
    mx.eval(full)
    return tuple(full)


def streamed_head_backward(hidden, weight, targets, lse, entropy, g_logp, g_entropy=None, *,
                           temperature=1.0, chunk_size=None):
    """Phase 2: d_hidden [N, D] and d_weight [V, D] for cotangents g_logp (and g_entropy) of the
    log-probs, one evaluated vocab tile at a time; d_weight is filled in place, tile by tile
    (float32 math, returned in the weight's dtype)."""
    v = weight.shape[0]
    rows_np, rows, t = _rows(targets)
    inv_t = 1.0 / temperature
    h32 = hidden[rows].astype(mx.float32)
    lse, ent, g = lse[rows], entropy[rows], g_logp[rows]
    ge = None if g_entropy is None else g_entropy[rows]
    dh = mx.zeros(h32.shape, mx.float32)
    dw = mx.zeros(weight.shape, weight.dtype)
    for s, e in row_bounds(v, chunk_size or default_chunk_size(rows_np.size, v, width=hidden.shape[1])):
        w32 = weight_tile(weight, s, e)
        dz = _tile_dz(h32, w32, s, t, lse, ent, g, ge, inv_t)
        dh = dh + dz @ w32
        dw[s:e] = (dz.T @ h32).astype(weight.dtype)
        mx.eval(dh, dw)
    d_hidden = mx.zeros(hidden.shape, mx.float32).at[rows].add(dh).astype(hidden.dtype)
    return d_hidden, dw


def streamed_value_and_grad(trunk, params, targets, loss_fn, *, head_weight, temperature=1.0, chunk_size=None,
                            with_entropy=False):
    """The two-phase step: loss and gradients of `loss_fn(logp, entropy)` w.r.t. `params` with the
    LM head streamed eagerly and the trunk differentiated by `mx.vjp`.

    trunk(params) -> hidden [N, D]; head_weight(params) -> [V, D] (the embedding when tied: its
    gradient then gets both the trunk's and the head's part); loss_fn(logp [N], entropy [N]) ->
    (loss, aux). The trunk runs twice (forward to get `hidden`, then again inside its VJP), which
    is the price of never holding a [N, V] tile together with the trunk's graph.
    Returns (loss, aux, grads, (logp, entropy, argmax)).
    """
    def head(hidden, weight):
        logp, ent, lse, argmax = streamed_logprobs(hidden, weight, targets, temperature=temperature,
                                                   chunk_size=chunk_size, with_entropy=with_entropy)
        (loss, aux), (g_logp, g_ent) = mx.value_and_grad(loss_fn, argnums=(0, 1))(logp, ent)
        mx.eval(loss, aux, g_logp, g_ent)
        d_hidden, d_weight = streamed_head_backward(hidden, weight, targets, lse, ent, g_logp,
                                                    g_ent if with_entropy else None,
                                                    temperature=temperature, chunk_size=chunk_size)
        return (loss, aux, (logp, ent, argmax)), d_hidden, d_weight

    (loss, aux, metrics), grads = two_phase(trunk, head_weight, params, head)
    return loss, aux, grads, metrics
