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
state at the start of every chunk (one [B, H, dk, dv] float32 per chunk: the native kernel's one
[T/C, B, H, dk, dv] array, the graph path's one [B, H, n, dk, dv] per group of n chunks); that and the inputs
are all the VJP keeps (a forward that is never differentiated builds them too, and drops them when the
call's results are evaluated). The backward walks the chunks in reverse: for each, it recomputes the chunk's
decays, A, its inverse, U0, W and U from the inputs and the saved state, turns the output's cotangent and the
state cotangent dS coming from the next chunk into the chunk's input gradients, and passes dS back to the
chunk before. Inputs are cast to float32 a group at a time (below); the state and all accumulation are
float32; the output comes back in v's dtype (transformers returns q's; Qwen3.5 gives both the same dtype) and
each gradient in its input's dtype.

The graph path runs groups of chunks side by side. A chunk's end state is affine in its start state,

    S_C = M S0 + R,    M = b_C I - Kl^T W  [dk, dk],    R = Kl^T U0    (Kl = diag(last) K)

and neither M nor R depends on the state: they, like everything else that does not need the state passed
from chunk to chunk (decays, A and its inverse, U0, W, Q K^T), are batched products over the group. The
passage is then one multiply-add per chunk (`mx.addmm` on M's and R's pieces, split beforehand by MLX's
multi-output split), and U = U0 - W S0 and the outputs are batched again from the stacked start states. The
backward is its transpose: the cotangent at a chunk's start is dS0 = M^T dS_C + N with N = Qb^T dO -
W^T P^T dO (Qb = diag(b) Q, P = L * Q K^T), batched beforehand; one multiply-add per chunk, last chunk first,
gives dS at every chunk's end, and every gradient is batched from their stack. On a GPU every MLX op is a
kernel launch and one chunk's products are too small to fill it: a group costs a fixed set of launches, and
each chunk in it one multiply-add each way.

Groups are sized by memory (`group_chunks`): a group's float32 intermediates (CHUNK_WORK per chunk, in its
[c, c], [c, d] and [dk, dv] arrays) are held to GROUP_SHARE of what the op holds on any path (the inputs,
their gradients and the saved states, all proportional to the length), within GROUP_BYTES. Narrow or short
sequences run as a single group; long ones in groups that grow with the length up to the cap, so the
working set stays a bounded share of the op's own footprint and is bounded outright beyond the cap. Each
group's inputs are tied with `mx.depends` to the previous group's results (its state and its piece of the
output; in the backward the state's cotangent and its pieces of the gradients), so MLX, whatever order it
schedules independent work in, runs the groups one after another and only one group's intermediates are
alive. The results are written group by group into one buffer each (every update the only reader of the
one before, so MLX updates the buffer in place) rather than concatenated at the end, and the saved states
stay per group: nothing the size of the sequence is held twice.

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
import numpy as np

from ..cpu import fastmath, native
from .triangular import unit_lower_inverse

CHUNK = 64
L2_EPS = 1e-6  # transformers' (and flash-linear-attention's) l2norm eps
# The graph path's groups of chunks side by side (`group_chunks`): a group's float32 working set at most
# GROUP_SHARE of what the op holds on any path (its inputs, their gradients, the saved states), and within
# GROUP_BYTES (a floor, so that short or narrow sequences run as one group, and a cap)
GROUP_SHARE = 0.5
GROUP_BYTES = (16 << 20, 1 << 30)
# what one more chunk in a group adds to the graph path's peak (forward + backward), per batch row and value
# head, in float32 arrays of [c, c], [c, d] (d the mean of dk and dv) and [dk, dv]: fitted to that growth
CHUNK_WORK = {"CC": 11, "CD": 8, "DD": 8}

# ---------------------------------------------------------------------------------------------------------
# one chunk


@functools.cache
def _tri(c: int, strict: bool) -> mx.array:
    """The lower triangle of [c, c] (bool; strict: without the diagonal), a constant."""
    return mx.array(np.tri(c, k=-1 if strict else 0, dtype=bool))


def _strict(c: int) -> mx.array:
    return _tri(c, True)


def _lower(c: int) -> mx.array:
    return _tri(c, False)


@functools.cache
def _eye(d: int) -> mx.array:
    return mx.array(np.eye(d, dtype=np.float32))


@functools.cache
def _at_end(c: int) -> mx.array:
    return mx.array(np.arange(c) == c - 1)


def _dot(x: mx.array, y: mx.array) -> mx.array:
    """sum(x * y) over the last two axes, as a product (no [p, q] temporary)."""
    p = x.shape[-1] * x.shape[-2]
    return (x.reshape(*x.shape[:-2], 1, p) @ y.reshape(*y.shape[:-2], p, 1))[..., 0, 0]


def _tr(x: mx.array) -> mx.array:
    return mx.swapaxes(x, -1, -2)


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
    KK = K @ _tr(K)
    A = mx.where(_strict(K.shape[-2]), beta[..., None] * L * KK, 0.0)
    T = unit_lower_inverse(A)
    return KK, T, T @ (beta[..., None] * V), T @ ((beta * b)[..., None] * K)


def _passage(b, X, Y):
    """b_c I - X Y for every chunk (b [B, H, n, c]: the chunk-end decay b_c on the diagonal): the linear part
    of the state's passage through a chunk (X Y = Kl^T W) or its transpose (W^T Kl)."""
    return mx.addmm(_eye(X.shape[-2]) * b[..., -1:, None], X, Y, alpha=-1.0)


SPLIT = 10  # the most pieces MLX's split makes with its one multi-output primitive (beyond: a slice each)


def _pieces(x: mx.array, n: int) -> list[mx.array]:
    """x [B, H, n, ...] as its n pieces [B, H, 1, ...] along axis 2: MLX's split, a tree of them beyond SPLIT
    pieces (views, no copy: about one primitive per SPLIT - 1 pieces)."""
    if n <= SPLIT:
        return mx.split(x, n, axis=2) if n > 1 else [x]
    size = -(-n // SPLIT)
    parts = mx.split(x, list(range(size, n, size)), axis=2)
    return [piece for part in parts for piece in _pieces(part, part.shape[2])]


def _affine(M, R, S, reverse=False):
    """The state's passage through n chunks side by side: X_{j+1} = M_j X_j + R_j from X_0 = S [B, H, p, q],
    with M [B, H, n, p, p] and R [B, H, n, p, q] (reverse: from the last chunk to the first, X_j = M_j X_{j+1}
    + R_j from X_n = S). Returns (the value entering each chunk [B, H, n, p, q], the value leaving the last).
    The only loop over chunks: each operand split beforehand (`_pieces`), then one multiply-add per chunk."""
    n = M.shape[2]
    Ms, Rs = _pieces(M, n), _pieces(R, n)
    X, entering = S[:, :, None], []
    for j in (reversed(range(n)) if reverse else range(n)):
        entering.append(X)
        X = mx.addmm(Rs[j], Ms[j], X)
    entering = entering[::-1] if reverse else entering
    return (entering[0] if n == 1 else mx.concatenate(entering, axis=2)), X[:, :, 0]


def _group_forward(Q, K, V, beta, L, b, last, S):
    """n chunks side by side (Q, K [B, H, n, c, dk], V [B, H, n, c, dv], the decays of `_decays`) from the
    state S [B, H, dk, dv] at the first one's start: (O [B, H, n, c, dv], the state at each chunk's start
    [B, H, n, dk, dv], the state at the last one's end). A chunk's end state is affine in its start state,
    S_end = M S0 + R with M = b_c I - Kl^T W and R = Kl^T U0 (Kl = diag(last) K): M and R are batched over
    the chunks, the passage is one multiply-add per chunk (`_affine`), and U = U0 - W S0 and the outputs are
    batched again, from the stacked start states."""
    _, _, U0, W = _wy(K, V, beta, L, b)
    KlT = _tr(last[..., None] * K)
    S0, S = _affine(_passage(b, KlT, W), KlT @ U0, S)
    U = mx.addmm(U0, W, S0, alpha=-1.0)
    out = mx.addmm((b[..., None] * Q) @ S0, L * (Q @ _tr(K)), U)
    return out, S0, S


def _group_backward(Q, K, V, g, beta, starts, S, dO, dS_end):
    """n chunks' gradients, recomputed from their inputs (as in `_group_forward`, starts [B, n, c] or None)
    and the state at each one's start S [B, H, n, dk, dv], with dS_end the cotangent of the last one's end
    state: (dQ, dK, dV, dg, dbeta, dS at the first one's start), dQ and dK per value head, float32. The chain
    rule of `_group_forward` and `_decays`, written out: the state's cotangent passes from chunk to chunk by
    the transposed affine map (`_affine` in reverse), the rest is batched over the chunks."""
    L, b, last = _decays(g, starts)
    KK, T, U0, W = _wy(K, V, beta, L, b)
    U = mx.addmm(U0, W, S, alpha=-1.0)
    QK = Q @ _tr(K)
    P = L * QK
    Qb, Kl = b[..., None] * Q, last[..., None] * K

    # the state's cotangent, last chunk first: dU = P^T dO + Kl dS_end and dS0 = Qb^T dO + b_c dS_end - W^T dU,
    # i.e. dS0 = M^T dS_end + N with M^T = b_c I - W^T Kl and N = Qb^T dO - W^T P^T dO (both batched): the
    # reverse passage gives dS at every chunk's end, and dU is batched again from their stack
    PdO, WT = _tr(P) @ dO, _tr(W)
    ends, dS = _affine(_passage(b, WT, Kl), mx.addmm(_tr(Qb) @ dO, WT, PdO, alpha=-1.0),
                       dS_end.astype(mx.float32), reverse=True)
    dU = mx.addmm(PdO, Kl, ends)

    dP = dO @ _tr(U)
    dKl = U @ _tr(ends)
    dQb = dO @ _tr(S)
    db_end = _dot(S, ends)  # [B, H, n]
    # U0 = T X1, W = T X2 with T = (I + A)^-1: dX = T^T dY, dA = -T^T dY Y_in^T T^T = -dX (T X)^T; W's
    # cotangent is -dU S^T, so dX2 = -dX1 S^T: Y = dX1 S^T stands for -dX2
    dX1 = _tr(T) @ dU
    Y = dX1 @ _tr(S)
    dA = mx.where(_strict(K.shape[-2]), mx.addmm(dX1 @ _tr(U0), Y, WT, beta=-1.0), 0.0)

    # A = beta_i L_ij KK_ij;  P = L QK;  X1 = beta V;  X2 = beta b K;  Qb = b Q;  Kl = last K
    dAL = dA * L
    x2k = -(Y * K).sum(-1)
    dbeta = (dAL * KK).sum(-1) + (dX1 * V).sum(-1) + b * x2k
    dKK = beta[..., None] * dAL
    dQK = dP * L
    dK = mx.addmm(mx.addmm(last[..., None] * dKl - (beta * b)[..., None] * Y, dKK + _tr(dKK), K), _tr(dQK), Q)
    dQ = mx.addmm(b[..., None] * dQb, dQK, K)
    dV = beta[..., None] * dX1
    c = g.shape[-1]
    db = beta * x2k + (dQb * Q).sum(-1) + mx.where(_at_end(c), db_end[..., None], 0.0)
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


def group_chunks(B: int, T: int, Hk: int, Hv: int, dk: int, dv: int, chunk: int = CHUNK, itemsize: int = 4) -> int:
    """How many chunks the graph path runs side by side for q, k [B, T, Hk, dk] and v [B, T, Hv, dv] (inputs
    of `itemsize` bytes): as many as keep a group's working set (CHUNK_WORK per chunk) within GROUP_SHARE of
    what the op holds on any path (inputs and their gradients, one [dk, dv] float32 state per chunk and value
    head), clamped to GROUP_BYTES; at least one, at most all full chunks."""
    full = T // chunk
    inputs = B * T * (2 * Hk * dk + Hv * (dv + 2))
    held = 2 * inputs * itemsize + 4 * full * B * Hv * dk * dv
    lo, hi = GROUP_BYTES
    budget = min(max(GROUP_SHARE * held, lo), hi)
    w = CHUNK_WORK
    per_chunk = 4 * B * Hv * (w["CC"] * chunk * chunk + w["CD"] * chunk * (dk + dv) / 2 + w["DD"] * dk * dv)
    return max(1, min(full, int(budget // per_chunk)))


def _groups(T: int, chunk: int, n: int) -> list[tuple[int, int, int]]:
    """(start, end, chunks) of the groups the graph path runs side by side: n full chunks each (the last
    group the rest of them), then the short last chunk (T not a multiple of the chunk) alone."""
    full = T // chunk
    groups = [(s * chunk, min(s + n, full) * chunk, min(n, full - s)) for s in range(0, full, n)]
    return groups + ([(full * chunk, T, 1)] if T % chunk else [])


def _sequence_groups(q, v, cfg) -> list[tuple[int, int, int]]:
    """The groups of `_groups` for these inputs, `group_chunks` chunks each."""
    B, T, Hk, dk = q.shape
    n = group_chunks(B, T, Hk, v.shape[2], dk, v.shape[3], chunk=cfg.chunk, itemsize=q.dtype.size)
    return _groups(T, cfg.chunk, n)


def _heads(x: mx.array, n: int) -> mx.array:
    """A group's slice [B, n c, H(, d)] -> float32 [B, H, n, c(, d)]: a view of x where x is float32 (the
    elementwise ops that read it write contiguous arrays), else one converted copy."""
    x = x.reshape(x.shape[0], n, x.shape[1] // n, *x.shape[2:])
    return mx.moveaxis(x, 3, 1).astype(mx.float32)


def _tokens(x: mx.array, like: mx.array) -> mx.array:
    """float32 [B, H, n, c(, d)] -> [B, n c, H(, d)] in `like`'s dtype (a group's piece of a result)."""
    x = x.reshape(*x.shape[:2], x.shape[2] * x.shape[3], *x.shape[4:])
    return mx.swapaxes(x, 1, 2).astype(like.dtype)


def _rnorm(x):
    return mx.rsqrt((x * x).sum(-1, keepdims=True) + L2_EPS)


def _l2(x):
    return x * _rnorm(x)


def _l2_backward(x, dy):
    """y = x r with r = 1 / sqrt(|x|^2 + eps): dx = r (dy - y (y . dy)) = r dy - x (r^3 (x . dy)), from x alone."""
    r = _rnorm(x)
    return r * dy - x * (r * r * r * (x * dy).sum(-1, keepdims=True))


def _qk(q, k, cfg):
    """A group's q and k [B, Hk, n, c, dk] (float32) as the recurrence reads them: normalised (the flag),
    q scaled, repeated to the value heads; contiguous, as the products read them."""
    if cfg.l2norm:
        Q, K = q * (_rnorm(q) * cfg.scale), k * _rnorm(k)
    else:
        Q, K = q * cfg.scale, mx.contiguous(k)
    if cfg.groups > 1:
        Q, K = mx.repeat(Q, cfg.groups, axis=1), mx.repeat(K, cfg.groups, axis=1)
    return Q, K


def _doc_starts(starts, s, e, n, cfg):
    return starts[:, s:e].reshape(starts.shape[0], n, (e - s) // n) if cfg.documents else None


def _place(whole: mx.array | None, piece: mx.array, s: int, shape, single: bool) -> mx.array:
    """A result [B, T, ...] of `shape` with a group's piece [B, e - s, ...] at token s: the piece itself when
    there is one group, else written into `whole` (zeros at first) in place: each update is the previous
    one's only reader, so MLX hands it that buffer, and no concatenation holds every piece next to the
    result."""
    if single:
        return piece
    whole = mx.zeros(shape, piece.dtype) if whole is None else whole
    whole[:, s:s + piece.shape[1]] = piece
    return whole


def _graph_forward(q, k, v, g, beta, state, starts, cfg, save_states=True):
    """The chunked forward, groups of chunks in order: (out [B, T, Hv, dv] in v's dtype, final state float32
    [B, Hv, dk, dv], the states at the chunk starts, one [B, Hv, n, dk, dv] per group, or None)."""
    S = state.astype(mx.float32)
    groups = _sequence_groups(q, v, cfg)
    out, saved, piece = None, [], None
    for s, e, n in groups:
        ins = [q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e]]
        if piece is not None:  # after the group before (its state and its output), so that MLX's scheduler
            ins = mx.depends(ins, [S, piece])  # runs the groups in order and only one group's intermediates live
        qc, kc, vc, gc, bc = (_heads(x, n) for x in ins)
        Q, K = _qk(qc, kc, cfg)
        L, b, last = _decays(gc, _doc_starts(starts, s, e, n, cfg))
        o, S0, S = _group_forward(Q, K, vc, bc, L, b, last, S)
        saved.append(S0)
        piece = _tokens(o, v)
        out = _place(out, piece, s, v.shape, len(groups) == 1)
    return out, S, (tuple(saved) if save_states else None)


def _graph_backward(primals, d_out, d_final, saved, cfg):
    """The groups in reverse, each recomputed from its chunks' saved start states; gradients of every
    primal."""
    q, k, v, g, beta, state, starts = primals
    dS = d_final.astype(mx.float32)
    groups = _sequence_groups(q, v, cfg)
    grads, pieces = [None] * 5, ()
    for (s, e, n), S in reversed(list(zip(groups, saved, strict=True))):
        ins = [q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e], d_out[:, s:e], S]
        if cfg.documents:
            ins.append(starts)
        if pieces:  # after everything the next group produced (as in the forward)
            ins = mx.depends(ins, [dS, *pieces])
        qc, kc, vc, gc, bc, dO = (_heads(x, n) for x in ins[:6])
        st = _doc_starts(ins[7], s, e, n, cfg) if cfg.documents else None
        Q, K = _qk(qc, kc, cfg)
        dQ, dK, dV, dg, dbeta, dS = _group_backward(Q, K, vc, gc, bc, st, ins[6], mx.contiguous(dO), dS)
        if cfg.groups > 1:  # the value heads that read one key head add their gradients
            dQ = dQ.reshape(dQ.shape[0], -1, cfg.groups, *dQ.shape[2:]).sum(2)
            dK = dK.reshape(dK.shape[0], -1, cfg.groups, *dK.shape[2:]).sum(2)
        dQ = dQ * cfg.scale
        if cfg.l2norm:
            dQ, dK = _l2_backward(qc, dQ), _l2_backward(kc, dK)
        pieces = (_tokens(dQ, q), _tokens(dK, k), _tokens(dV, v), _tokens(dg, g), _tokens(dbeta, beta))
        grads = [_place(whole, piece, s, x.shape, len(groups) == 1)
                 for whole, piece, x in zip(grads, pieces, (q, k, v, g, beta), strict=True)]
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
