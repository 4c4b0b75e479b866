"""The gated delta rule (Gated DeltaNet, Qwen3.5's linear-attention layers) as one MLX op whose VJP keeps
the inputs and one state per chunk, not an autograd tape.

The recurrence, per batch row and value head, with a float32 state S [dk, dv], for t = 1..T:

    a_t = exp(g_t)                                    (g <= 0: the log decay)
    S_t = a_t S_{t-1} + k_t (beta_t (v_t - a_t S_{t-1}^T k_t))^T
    o_t = S_t^T q_t

exactly transformers' `torch_recurrent_gated_delta_rule` (Qwen3.5's decode path) and
`torch_chunk_gated_delta_rule` (its training path): q is multiplied by `scale` (1/sqrt(dk) by default, as
transformers always does) inside the op, after the optional L2 normalisation of q and k
(`use_qk_l2norm_in_kernel`, eps 1e-6, in float32, as transformers' flag); when v has more heads than q and k,
value head h reads key head h // (Hv / Hk) (transformers' `repeat_interleave`).

The chunked form (training; chunks of C = 64 tokens). Within a chunk, with the chunk-start state S0, the
log decay from j to i D_ij = sum_{j < m <= i} g_m, L_ij = exp(D_ij) for j <= i, b_i = exp(sum_{m <= i} g_m)
(from the chunk start), the recurrence unrolls to

    u_i = beta_i (v_i - a_i S_{i-1}^T k_i)         the delta written at i: U = U0 - W S0, where
    (I + A) U0 = diag(beta) V,  (I + A) W = diag(beta b) K,  A_ij = beta_i L_ij k_i.k_j (j < i)
    O   = diag(b) Q S0 + (L * Q K^T) U                            (L * .: elementwise, lower triangle)
    S_C = b_C S0 + (diag(L_C.) K)^T U

(the WY / UT-transform form of DeltaNet and flash-linear-attention): everything but the [dk, dv] state is a
product of [C, C], [C, dk] and [C, dv] matrices, and one C-by-C unit lower-triangular inverse per chunk.

Precision: no decay and no decay gradient is a difference of large sums. Each log decay is summed from its
own g's: D row by row, as a reverse cumulative sum of the row holding g_m for m <= i (natively, row i is row
i - 1 plus g_i), b as a cumulative sum from the chunk start, last_j = L_Cj from D's last row. All g <= 0, so
such a sum is exact to a few rounding steps of itself. The usual form, the cumulative sum gamma and L_ij =
exp(gamma_i - gamma_j) (transformers'), rounds at the scale of |gamma|, which strong decays take to the
hundreds or thousands within a chunk: a weak decay after them loses most of its digits. The decay's
gradient likewise: g_m enters L_ij for j < m <= i, b_i for i >= m and last_j for j < m, so with G = dL * L
(dL the cotangent of L),

    dg_m = sum_{i >= m, j < m} G_ij + sum_{i >= m} db_i b_i + sum_{j < m} dlast_j

the first from the rows' exclusive prefix sums of G (sum_{j < m} G_ij) added up over the rows i >= m, the
others a suffix and a prefix sum. Every term carries the decay across m, so a strongly decayed token's dg
is as small as it really is, to its own precision. The chain rule through gamma (a reverse cumulative sum
of rowsum(G) - colsum(G) + ...) reaches the same value as the difference of two sums over the rest of the
chunk, rounded at the scale of the weak decays' large terms; A_log's gradient, sum_t dg_t g_t, weighs those
strongly decayed tokens by their large |g|, and dt_bias' and in_proj_a's follow it.

Documents (`doc_starts`, packing / padding-free): the state restarts at zero at a document's first token.
That cuts L (to j, i in one document), b (to the first document) and last (to the last one) with masks
built from a segment id (the count of document starts so far in the chunk), and a start's own g is 0 (it
decays a state that is dropped). D_ij then sums only decays of i's document, so no document's decays ever
enter another's and no large negative number stands in for a reset; and since L, b and last are 0 across a
start, each sum of dg's above stops there by itself. A start at position 0 means the initial state is not
continued. The final state is then the last document's.

Lengths that are not a multiple of C: the last chunk is simply shorter. The formulas hold for any chunk
length, so nothing is padded and no padded token is computed (transformers pads with zeros, which leaves
the state unchanged: the same result); only the block-recursive inverse pads its matrix to a power of two
with the identity.

Memory. The forward runs the chunks in order and returns, next to the output and the final state, the
state at the start of every chunk ([T/C, B, H, dk, dv] float32); that and the inputs are all the VJP keeps
(a forward that is never differentiated builds that stack too, and drops it when the call's results are
evaluated). The backward walks the chunks in reverse: for each, it recomputes the chunk's decays, A, its
inverse, U0, W and U from the inputs and the saved state, turns the output's cotangent and the state
cotangent dS coming from the next chunk into the chunk's input gradients, and passes dS back to the chunk
before. Inputs are cast to float32 a group at a time (below); the state and all accumulation are float32;
the output comes back in v's dtype (transformers returns q's; Qwen3.5 gives both the same dtype) and each
gradient in its input's dtype.

The graph path runs GROUP chunks side by side: everything that does not need the state passed from chunk to
chunk (decays, A and its inverse, U0, W, Q K^T, and in the backward every gradient once the state's cotangent
at each chunk end is known) is one batched product over the group, and only the state's passage (three small
products per chunk) is a loop. On a GPU every MLX op is a kernel launch, and one chunk's products are too
small to fill it: batching cuts the launches by about the group's size. Each group's inputs are tied with
`mx.depends` to the previous group's results, so MLX (which schedules depth-first from the outputs) runs
the groups one after another and only one group's intermediates are alive: the working set is a group's,
whatever the length.

Paths: `_path` is the one dispatch point, choosing an entry of `_PATHS` as every native kernel is chosen
(`mlxrl.cpu.fastmath`): "native" when q, k, v, g, beta and the state are float32 arrays on the CPU and
mlxrl's native module loads (not with MLXRL_NATIVE=0), else "graph". "native" is one C++ primitive for the
whole sequence forward and one backward (`mlxrl/cpu/native/gated_delta.cpp`): the same chunks and formulas
with the same memory (the inputs and one [dk, dv] state per chunk and head, one chunk's intermediates per
core), one worker per batch row and value head (per key head in the backward, where a key head's value heads
add into its dq / dk), the small products in a register-tiled micro-kernel and the triangular inverse by
forward substitution. "graph" is the MLX graph below (Metal, CUDA, bf16 inputs), where the inverse is
`models.triangular`'s (LAPACK's on the CPU, a log-depth block recursion of matmuls elsewhere).
Compile-friendly: no Python branch looks at an array's values.

    pytest tests/test_gated_delta.py
    python scripts/bench_gated_delta.py
"""

from __future__ import annotations

import functools

import mlx.core as mx

from ..cpu import fastmath, native
from .triangular import unit_lower_inverse

CHUNK = 64
GROUP = 8  # the graph path's chunks side by side: its batched products (memory: one group's intermediates)
L2_EPS = 1e-6  # transformers' (and flash-linear-attention's) l2norm eps

# ---------------------------------------------------------------------------------------------------------
# one chunk


def _strict(c: int) -> mx.array:
    i = mx.arange(c)
    return i[:, None] > i[None, :]


def _lower(c: int) -> mx.array:
    i = mx.arange(c)
    return i[:, None] >= i[None, :]


def _decays(g: mx.array, starts: mx.array | None):
    """The decay structure of chunks from g [B, H, ..., c] (float32) and, with documents, starts [B, ..., c]
    (bool); `...` is an optional axis of chunks side by side.

    Returns L [B, H, ..., c, c] (exp(D_ij) where j <= i in the same segment, else 0, with D_ij = the sum of
    g over (j, i]), b [B, H, ..., c] (decay from the chunk start to i; 0 after a document start) and last
    [B, H, ..., c] (decay from j to the chunk end, exp(D_cj); 0 before the last document's start). Each log
    decay is a sum of its own g's (module docstring, "Precision"), never a difference of cumulative sums."""
    lower = link = _lower(g.shape[-1])
    if starts is not None:
        # a start's own decay multiplies a state that is dropped anyway: 0 keeps it out of every sum
        g = mx.where(starts[:, None], 0.0, g)
        seg = mx.cumsum(starts.astype(mx.int32), axis=-1)  # [B, ..., c]
        link = (lower & (seg[..., :, None] == seg[..., None, :]))[:, None]  # [B, 1, ..., c, c]
    # D_ij = sum_{j < m <= i} g_m: row i holds g_m for m <= i, summed from the right, exclusive of column j
    D = mx.cumsum(mx.where(lower, g[..., None, :], 0.0), axis=-1, reverse=True, inclusive=False)
    L = mx.where(link, mx.exp(D), 0.0)
    b = mx.exp(mx.cumsum(g, axis=-1))  # the first segment's own sums (g is 0 at every start)
    last = mx.exp(D[..., -1, :])
    if starts is not None:
        b = mx.where((seg == 0)[:, None], b, 0.0)
        last = mx.where((seg == seg[..., -1:])[:, None], last, 0.0)
    return L, b, last


def _wy(K, V, beta, L, b):
    """A (strictly lower), its inverse T, U0 = T diag(beta) V and W = T diag(beta b) K."""
    KK = K @ mx.swapaxes(K, -1, -2)
    A = mx.where(_strict(K.shape[-2]), beta[..., None] * L * KK, 0.0)
    T = unit_lower_inverse(A)
    dv = V.shape[-1]
    UW = T @ mx.concatenate([beta[..., None] * V, (beta * b)[..., None] * K], axis=-1)
    return KK, T, UW[..., :dv], UW[..., dv:]


def _group_forward(Q, K, V, beta, L, b, last, S):
    """n chunks side by side (Q, K [B, H, n, c, dk], V [B, H, n, c, dv], the decays of `_decays`) from the
    state S [B, H, dk, dv] at the first one's start: (O [B, H, n, c, dv], the state at each chunk's start
    [B, H, n, dk, dv], the state at the last one's end). Only the state's passage from chunk to chunk is a
    loop; everything else is one batched product over the n chunks."""
    _, _, U0, W = _wy(K, V, beta, L, b)
    KlT = mx.swapaxes(last[..., None] * K, -1, -2)
    b_end = b[..., -1:, None]  # [B, H, n, 1, 1]
    S0, Us = [], []
    for j in range(Q.shape[2]):
        S0.append(S)
        U = U0[:, :, j] - W[:, :, j] @ S
        Us.append(U)
        S = b_end[:, :, j] * S + KlT[:, :, j] @ U
    S0, U = mx.stack(S0, axis=2), mx.stack(Us, axis=2)
    out = (b[..., None] * Q) @ S0 + (L * (Q @ mx.swapaxes(K, -1, -2))) @ U
    return out, S0, S


def _group_backward(Q, K, V, g, beta, starts, S, dO, dS_end):
    """n chunks' gradients, recomputed from their inputs (as in `_group_forward`, starts [B, n, c] or None)
    and the state at each one's start S [B, H, n, dk, dv], with dS_end the cotangent of the last one's end
    state: (dQ, dK, dV, dg, dbeta, dS at the first one's start), dQ and dK per value head, float32. The chain
    rule of `_group_forward` and `_decays`, written out: a loop passes the state's cotangent from chunk to
    chunk, the rest is batched over the chunks."""
    L, b, last = _decays(g, starts)
    KK, T, U0, W = _wy(K, V, beta, L, b)
    U = U0 - W @ S
    tr = functools.partial(mx.swapaxes, axis1=-1, axis2=-2)
    QK = Q @ tr(K)
    P = L * QK
    Qb, Kl = b[..., None] * Q, last[..., None] * K

    # the state's cotangent, last chunk first: dU = P^T dO + Kl dS_end, dS = Qb^T dO + b_c dS_end - W^T dU
    PdO, QbdO, WT, b_end = tr(P) @ dO, tr(Qb) @ dO, tr(W), b[..., -1:, None]
    ends, dUs = [], []
    dS = dS_end.astype(mx.float32)
    for j in reversed(range(Q.shape[2])):
        ends.append(dS)
        dU = PdO[:, :, j] + Kl[:, :, j] @ dS
        dUs.append(dU)
        dS = QbdO[:, :, j] + b_end[:, :, j] * dS - WT[:, :, j] @ dU
    dS_end, dU = mx.stack(ends[::-1], axis=2), mx.stack(dUs[::-1], axis=2)  # per chunk

    dP = dO @ tr(U)
    dKl = U @ tr(dS_end)
    dQb = dO @ tr(S)
    db_end = (S * dS_end).sum(axis=(-2, -1))  # [B, H, n]
    # U0 = T X1, W = T X2 with T = (I + A)^-1: dX = T^T dY, dA = -T^T dY Y_in^T T^T = -dX (T X)^T
    dv = V.shape[-1]
    dX = tr(T) @ mx.concatenate([dU, -(dU @ tr(S))], axis=-1)
    dX1, dX2 = dX[..., :dv], dX[..., dv:]
    dA = mx.where(_strict(K.shape[-2]), -(dX1 @ tr(U0) + dX2 @ tr(W)), 0.0)

    # A = beta_i L_ij KK_ij;  P = L QK;  X1 = beta V;  X2 = beta b K;  Qb = b Q;  Kl = last K
    dAL = dA * L
    x2k = (dX2 * K).sum(-1)
    dbeta = (dAL * KK).sum(-1) + (dX1 * V).sum(-1) + b * x2k
    dKK = beta[..., None] * dAL
    dQK = dP * L
    dK = (dKK + tr(dKK)) @ K + tr(dQK) @ Q + (beta * b)[..., None] * dX2 + last[..., None] * dKl
    dQ = dQK @ K + b[..., None] * dQb
    dV = beta[..., None] * dX1
    c = g.shape[-1]
    at_end = mx.arange(c) == c - 1
    db = beta * x2k + (dQb * Q).sum(-1) + mx.where(at_end, db_end[..., None], 0.0)
    dlast = (dKl * K).sum(-1) * last

    # through the decays: g_m enters L_ij for j < m <= i, b_i for i >= m and last_j for j < m. Each sum below
    # runs over those terms only (each carries g_m's decay), so nothing cancels: H_m = sum_{i >= m, j < m} G_ij
    # from the rows' exclusive prefix sums. Across a document start L, b and last are 0: dg is 0 at a start.
    G = (beta[..., None] * dA * KK + dP * QK) * L
    H = mx.where(_lower(c), mx.cumsum(G, axis=-1, inclusive=False), 0.0).sum(-2)
    dg = H + mx.cumsum(db * b, axis=-1, reverse=True) + mx.cumsum(dlast, axis=-1, inclusive=False)
    return dQ, dK, dV, dg, dbeta, dS


# ---------------------------------------------------------------------------------------------------------
# the whole sequence (the graph path)


class _Config:
    """What the op's graph depends on besides the arrays' shapes (hashable: one custom function each)."""

    def __init__(self, chunk, scale, l2norm, groups, documents):
        self.chunk, self.scale, self.l2norm, self.groups, self.documents = chunk, scale, l2norm, groups, documents

    def key(self):
        return (self.chunk, self.scale, self.l2norm, self.groups, self.documents)


def _groups(T: int, chunk: int) -> list[tuple[int, int, int]]:
    """(start, end, chunks) of the groups the graph path runs side by side: up to GROUP full chunks each,
    then the short last chunk (T not a multiple of the chunk) alone."""
    full = T // chunk
    groups = [(s * chunk, min(s + GROUP, full) * chunk, min(GROUP, full - s)) for s in range(0, full, GROUP)]
    return groups + ([(full * chunk, T, 1)] if T % chunk else [])


def _heads(x: mx.array, n: int) -> mx.array:
    """A group's slice [B, n c, H(, d)] -> float32 [B, H, n, c(, d)]."""
    x = mx.swapaxes(x.astype(mx.float32), 1, 2)
    return x.reshape(*x.shape[:2], n, x.shape[2] // n, *x.shape[3:])


def _tokens(x: mx.array, like: mx.array) -> mx.array:
    """float32 [B, H, n, c(, d)] -> [B, n c, H(, d)] in `like`'s dtype (a group's piece of a result)."""
    x = x.reshape(*x.shape[:2], x.shape[2] * x.shape[3], *x.shape[4:])
    return mx.swapaxes(x, 1, 2).astype(like.dtype)


def _l2(x):
    return x * mx.rsqrt((x * x).sum(-1, keepdims=True) + L2_EPS)


def _l2_backward(x, y, dy):
    """y = x / sqrt(|x|^2 + eps): dx = (dy - y (y . dy)) / sqrt(|x|^2 + eps)."""
    return (dy - y * (y * dy).sum(-1, keepdims=True)) * mx.rsqrt((x * x).sum(-1, keepdims=True) + L2_EPS)


def _qk(q, k, cfg):
    """A group's q and k [B, Hk, n, c, dk] (float32) as the recurrence reads them: normalised (the flag),
    q scaled, repeated to the value heads."""
    qn, kn = (_l2(q), _l2(k)) if cfg.l2norm else (q, k)
    Q, K = qn * cfg.scale, kn
    if cfg.groups > 1:
        Q, K = mx.repeat(Q, cfg.groups, axis=1), mx.repeat(K, cfg.groups, axis=1)
    return qn, kn, Q, K


def _doc_starts(starts, s, e, n, cfg):
    return starts[:, s:e].reshape(starts.shape[0], n, (e - s) // n) if cfg.documents else None


def _graph_forward(q, k, v, g, beta, state, starts, cfg, save_states=True):
    """The chunked forward, groups of chunks in order: (out [B, T, Hv, dv] in v's dtype, final state float32
    [B, Hv, dk, dv], the states at the chunk starts [N, B, Hv, dk, dv] or None)."""
    S = state.astype(mx.float32)
    outs, saved = [], []
    for s, e, n in _groups(q.shape[1], cfg.chunk):
        ins = [q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e]]
        # after the group before (its state), so that a breadth-first scheduler (a GPU's) does not prepare
        # every group's batched products at once
        qc, kc, vc, gc, bc = (_heads(x, n) for x in (mx.depends(ins, [S]) if outs else ins))
        _, _, Q, K = _qk(qc, kc, cfg)
        L, b, last = _decays(gc, _doc_starts(starts, s, e, n, cfg))
        out, S0, S = _group_forward(Q, K, vc, bc, L, b, last, S)
        saved.append(mx.moveaxis(S0, 2, 0))
        outs.append(_tokens(out, v))
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=1)
    return out, S, (mx.concatenate(saved) if save_states else None)


def _graph_backward(primals, d_out, d_final, saved, cfg):
    """The groups in reverse, each recomputed from its chunks' saved start states; gradients of every
    primal."""
    q, k, v, g, beta, state, starts = primals
    dS = d_final.astype(mx.float32)
    pieces = []  # per group, last first: (dq, dk, dv, dg, dbeta)
    for s, e, n in reversed(_groups(q.shape[1], cfg.chunk)):
        first = s // cfg.chunk  # every chunk before a group is a full one
        # this group waits for everything the next one produced, so only one group's intermediates live
        after = [dS, *pieces[-1]] if pieces else [dS]
        ins = [q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e], d_out[:, s:e], saved[first:first + n]]
        if cfg.documents:
            ins.append(starts)
        ins = mx.depends(ins, after) if pieces else ins
        qc, kc, vc, gc, bc, dO = (_heads(x, n) for x in ins[:6])
        S = mx.moveaxis(ins[6], 0, 2)  # [B, H, n, dk, dv]
        st = _doc_starts(ins[7], s, e, n, cfg) if cfg.documents else None
        qn, kn, Q, K = _qk(qc, kc, cfg)
        dQ, dK, dV, dg, dbeta, dS = _group_backward(Q, K, vc, gc, bc, st, S, dO, dS)
        if cfg.groups > 1:  # the value heads that read one key head add their gradients
            dQ = dQ.reshape(dQ.shape[0], -1, cfg.groups, *dQ.shape[2:]).sum(2)
            dK = dK.reshape(dK.shape[0], -1, cfg.groups, *dK.shape[2:]).sum(2)
        dQ = dQ * cfg.scale
        if cfg.l2norm:
            dQ, dK = _l2_backward(qc, qn, dQ), _l2_backward(kc, kn, dK)
        pieces.append((_tokens(dQ, q), _tokens(dK, k), _tokens(dV, v), _tokens(dg, g), _tokens(dbeta, beta)))
    grads = [p[0] if len(pieces) == 1 else mx.concatenate(p[::-1], axis=1) for p in zip(*pieces, strict=True)]
    return (*grads, dS.astype(state.dtype), mx.zeros_like(starts))


# ---------------------------------------------------------------------------------------------------------
# the native CPU kernel (float32 CPU arrays): the whole sequence in one primitive each way


def _native_forward(q, k, v, g, beta, state, starts, cfg):
    """(out [B, T, Hv, dv], final state [B, Hv, dk, dv], the states at the chunk starts [N, B, Hv, dk, dv]),
    all float32, from `mlxrl.native`'s gated_delta."""
    out, final, saved = native.load().gated_delta(q, k, v, g, beta, state, starts, cfg.chunk, cfg.scale, cfg.l2norm)
    return out, final, saved


def _native_backward(primals, d_out, d_final, saved, cfg):
    """The kernel's backward: each chunk recomputed from its saved start state, last chunk first."""
    q, k, v, g, beta, state, starts = primals
    grads = native.load().gated_delta_grad(q, k, v, g, beta, starts, saved, d_out, d_final, cfg.chunk, cfg.scale,
                                           cfg.l2norm)
    return (*grads, mx.zeros_like(starts))


_PATHS = {"graph": (_graph_forward, _graph_backward), "native": (_native_forward, _native_backward)}


def _path(q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, state: mx.array) -> str:
    """Which implementation of `_PATHS` runs these inputs: "native" for float32 arrays on the CPU with the
    native module built (`fastmath.kernels_for`: MLXRL_NATIVE=0, no compiler or a GPU default device give
    None), else "graph"."""
    if all(x.dtype == mx.float32 for x in (q, k, v, g, beta, state)) and fastmath.kernels_for(q) is not None:
        return "native"
    return "graph"


@functools.cache
def _make_op(path: str, key: tuple):
    cfg = _Config(*key)
    forward, backward = _PATHS[path]

    @mx.custom_function
    def op(q, k, v, g, beta, state, starts):
        return forward(q, k, v, g, beta, state, starts, cfg)

    @op.vjp
    def op_vjp(primals, cotangents, outputs):
        d_out, d_final = cotangents[0], cotangents[1]  # the saved states are internal: their cotangent is 0
        return backward(primals, d_out, d_final, outputs[2], cfg)

    return op


def gated_delta_rule(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    initial_state: mx.array | None = None,
    doc_starts: mx.array | None = None,
    chunk: int = CHUNK,
    *,
    scale: float | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    custom_vjp: bool = True,
) -> tuple[mx.array, mx.array]:
    """The gated delta rule over a sequence, chunked, with the memory-bounded VJP (module docstring).

    q, k [B, T, Hk, dk]; v [B, T, Hv, dv] (Hv a multiple of Hk); g (log decay, <= 0) and beta [B, T, Hv];
    initial_state [B, Hv, dk, dv] or None (zeros); doc_starts [B, T] bool or None: True at each document's
    first token, where the state restarts at zero. q is scaled by `scale` (default dk ** -0.5) inside, after
    the L2 normalisation of q and k when `use_qk_l2norm_in_kernel` (transformers' convention for both).
    custom_vjp=False: the same chunked forward left to MLX's autograd (the comparison in tests and the
    benchmark: it keeps every chunk's intermediates).
    Returns (out [B, T, Hv, dv] in v's dtype, final_state [B, Hv, dk, dv] float32).
    """
    B, T, Hk, dk = q.shape
    Hv, dv = v.shape[-2:]
    if k.shape != q.shape or v.shape[:2] != (B, T) or Hv % Hk:
        raise ValueError(f"gated_delta_rule: q {q.shape}, k {k.shape}, v {v.shape}: q and k [B, T, Hk, dk], "
                         "v [B, T, Hv, dv] with Hv a multiple of Hk")
    if g.shape != (B, T, Hv) or beta.shape != (B, T, Hv):
        raise ValueError(f"gated_delta_rule: g {g.shape} and beta {beta.shape} must be [B, T, Hv] = {(B, T, Hv)}")
    if initial_state is not None and initial_state.shape != (B, Hv, dk, dv):
        raise ValueError(f"gated_delta_rule: initial_state {initial_state.shape}, expected {(B, Hv, dk, dv)}")
    if doc_starts is not None and doc_starts.shape != (B, T):
        raise ValueError(f"gated_delta_rule: doc_starts {doc_starts.shape}, expected {(B, T)}")
    state = mx.zeros((B, Hv, dk, dv), mx.float32) if initial_state is None else initial_state
    starts = mx.zeros((B, T), mx.bool_) if doc_starts is None else doc_starts.astype(mx.bool_)
    key = (int(chunk), float(dk ** -0.5 if scale is None else scale), bool(use_qk_l2norm_in_kernel), Hv // Hk,
           doc_starts is not None)
    if not custom_vjp:
        out, final, _ = _graph_forward(q, k, v, g, beta, state, starts, _Config(*key), save_states=False)
        return out, final
    out, final, _ = _make_op(_path(q, k, v, g, beta, state), key)(q, k, v, g, beta, state, starts)
    return out, final


def gated_delta_step(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array,
    *,
    scale: float | None = None,
    use_qk_l2norm_in_kernel: bool = False,
) -> tuple[mx.array, mx.array]:
    """One token of the recurrence (decoding with the recurrent cache): q, k [B, Hk, dk] or [B, 1, Hk, dk],
    v [B, Hv, dv] or [B, 1, Hv, dv], g and beta [B, Hv] or [B, 1, Hv], state [B, Hv, dk, dv].
    Returns (out like v, in v's dtype; the new state, float32). Same conventions as `gated_delta_rule`."""
    seq = q.ndim == 4
    if seq:
        q, k, v, g, beta = q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0]
    Hk, dk = q.shape[-2:]
    Hv = v.shape[-2]
    f32 = mx.float32
    q, k = q.astype(f32), k.astype(f32)
    if use_qk_l2norm_in_kernel:
        q, k = _l2(q), _l2(k)
    q = q * (dk ** -0.5 if scale is None else scale)
    if Hv != Hk:
        q, k = mx.repeat(q, Hv // Hk, axis=1), mx.repeat(k, Hv // Hk, axis=1)
    S = mx.exp(g.astype(f32))[..., None, None] * state.astype(f32)  # [B, Hv, dk, dv]
    delta = beta.astype(f32)[..., None] * (v.astype(f32) - (k[..., None, :] @ S)[..., 0, :])  # [B, Hv, dv]
    S = S + k[..., :, None] * delta[..., None, :]
    out = (q[..., None, :] @ S)[..., 0, :].astype(v.dtype)
    return (out[:, None] if seq else out), S
