"""Elementwise math that is fast on MLX's CPU backend: exp, sigmoid, SiLU, GELU (tanh), softmax, the
SwiGLU product, RMSNorm, LayerNorm, rotary embedding.

MLX's Linux CPU wheel evaluates `mx.exp` and `mx.sigmoid` an order of magnitude slower than a multiply:
its kernels are scalar Cephes polynomials whose `fma` calls go through libm, the wheel being built for
baseline x86-64. On float32 CPU arrays the functions here use mlxrl's native kernels (`mlxrl.cpu.native`,
compiled on this machine: vectorised, one thread per core, MLX primitives with VJPs, so they
differentiate and compile like MLX's ops); `python scripts/bench_cpu_ops.py` prints both side by side
(figures in docs/platforms.md, "Runtime").

Where the native module is not available (no compiler, not Linux, MLXRL_NATIVE=0), or on a GPU
(Metal, CUDA), or for other dtypes, MLX's own ops are used, except `exp_shift` / `logsumexp` (the
sampler's, not differentiated): there the fallback is the same exp algorithm written as MLX ops in
two compiled kernels (round-to-nearest by adding 1.5 * 2^23, the degree-6 Cephes polynomial for 2^f
on [-0.5, 0.5] in plain multiplies and adds, 2^n by an integer shift and a bit view): faster than
`mx.exp`, not differentiable, saturating at exp(88) above (the sampler's z - max is <= 0). Every exp here is
~4e-6 relative from a float64 reference, as `mx.exp` is (the same polynomial); inputs below -88.03
give exactly 0, above 88.72 +inf, NaN stays NaN.
"""

from __future__ import annotations

import functools

import mlx.core as mx
import mlx.nn as nn

from . import native

LOG2E = 1.4426950408889634
MAGIC = 12582912.0  # 1.5 * 2**23: t + MAGIC rounds t (|t| < 2**22) to an integer in the low mantissa bits
MAGIC_BITS = 0x4B400000  # the int32 bits of MAGIC
LOW, HIGH = -127.0 / LOG2E, 88.0  # 2^-127 has exponent bits 0: exactly 0.0
# Cephes' 2^f on [-0.5, 0.5] (MLX's own exp uses the same coefficients), highest degree first
COEFFS = (1.535336188319500e-4, 1.339887440266574e-3, 9.618437357674640e-3, 5.550332471162809e-2,
          2.402264791363012e-1, 6.931472028550421e-1, 1.0)


def _poly(x):
    t = mx.clip(x, LOW, HIGH) * LOG2E
    r = t + MAGIC
    f = t - (r - MAGIC)
    p = COEFFS[0]
    for c in COEFFS[1:]:
        p = p * f + c
    return r, p


_reduce_shift = mx.compile(lambda z, m: _poly(z.astype(mx.float32) - m))  # z - m inside the kernel


@mx.compile
def _scale(r, p):
    bits = (mx.view(r, mx.int32) - (MAGIC_BITS - 127)) << 23  # (n + 127) << 23: the float 2^n
    return p * mx.view(bits, mx.float32)


def on_cpu() -> bool:
    return mx.default_device().type == mx.DeviceType.cpu


def kernels_for(x: mx.array):
    """The native kernel module when `x` is a float32 array on the CPU and the module is built, else None."""
    if x.dtype != mx.float32 or not on_cpu():
        return None
    return native.load()


def uses_native(x: mx.array) -> bool:
    """Whether the functions here run `x` through the native kernels."""
    return kernels_for(x) is not None


def exp(x: mx.array) -> mx.array:
    """exp(x), differentiable (see the module docstring)."""
    k = kernels_for(x)
    return k.exp(x) if k is not None else mx.exp(x)


def sigmoid(x: mx.array) -> mx.array:
    k = kernels_for(x)
    return k.sigmoid(x) if k is not None else mx.sigmoid(x)


def silu(x: mx.array) -> mx.array:
    """x * sigmoid(x), as `mlx.nn.silu`."""
    return x * sigmoid(x)


def gelu_approx(x: mx.array) -> mx.array:
    """GELU's tanh approximation (`mlx.nn.gelu_approx`, torch's gelu(approximate="tanh")); native: the same
    function as x sigmoid(2 sqrt(2/pi) (x + 0.044715 x^3)) in one pass forward and one backward (MLX's CPU
    tanh is a scalar loop, and its composed ops a pass each on one core, over a vision MLP's [6272, 4096]);
    elsewhere MLX's own."""
    k = kernels_for(x)
    return k.gelu_tanh(x) if k is not None else nn.gelu_approx(x)


def _all_native(*arrays: mx.array):
    """The native kernels when every array is float32 on the CPU, else None."""
    k = kernels_for(arrays[0])
    return k if k is not None and all(a.dtype == mx.float32 for a in arrays[1:]) else None


def silu_mul(g: mx.array, u: mx.array) -> mx.array:
    """silu(g) * u, the SwiGLU product; native: one pass forward, one for both gradients. Elsewhere
    `graph_silu_mul` (same shapes) or the composed product (broadcasting)."""
    k = _all_native(g, u) if g.shape == u.shape else None
    if k is not None:
        return k.silu_mul(g, u)
    return graph_silu_mul(g, u) if g.shape == u.shape else silu(g) * u


@mx.custom_function
def graph_silu_mul(g: mx.array, u: mx.array) -> mx.array:
    """silu(g) * u in MLX ops whose VJP keeps only g and u: with s = sigmoid(g) recomputed, dg = c u s (1 + g
    (1 - s)), du = c g s, each one elementwise expression (fused under `mx.compile`). Autograd of the composed
    product keeps sigmoid(g), silu(g) and their products from the forward to the backward: arrays of the MLP's
    width that a checkpointed layer holds from its recompute to its backward."""
    return g * mx.sigmoid(g) * u


@graph_silu_mul.vjp
def _graph_silu_mul_vjp(primals, cotangent, output):
    g, u = primals
    s = mx.sigmoid(g)
    return cotangent * u * s * (1 + g * (1 - s)), cotangent * g * s


def rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    """`mx.fast.rms_norm` (over the last axis); native: one pass per row forward and backward, the
    weight's gradient summed over rows per core (MLX's CPU backend composes it from single-core ops).
    Elsewhere on the CPU (other dtypes, MLXRL_NATIVE=0) `graph_rms_norm`; on a GPU MLX's fused kernel."""
    k = _all_native(x, weight)
    if k is not None:
        return k.rms_norm(x, weight, eps)
    return graph_rms_norm(eps)(x, weight) if on_cpu() else mx.fast.rms_norm(x, weight, eps)


@functools.cache
def graph_rms_norm(eps: float):
    """`mx.fast.rms_norm` with the VJP of MLX's GPU kernel, in MLX ops: it keeps x and the weight and
    recomputes the rows' 1 / rms in the backward, dx = r (g w - x^ mean(g w x^)), dw = sum over rows of g x^
    (x^ = x r, float32). On the CPU `mx.fast.rms_norm` is its composed fallback, whose autograd would keep
    the float32 x^ and products of the size of x through the layer's backward (a q-norm's is a query's size)."""

    @mx.custom_function
    def norm(x, w):
        return mx.fast.rms_norm(x, w, eps)

    @norm.vjp
    def norm_vjp(primals, cotangent, output):
        x, w = primals
        x32, g32, w32 = x.astype(mx.float32), cotangent.astype(mx.float32), w.astype(mx.float32)
        r = mx.rsqrt(mx.mean(mx.square(x32), axis=-1, keepdims=True) + eps)
        # r (gw - x^ mean(gw x^)) = r gw - x r^3 mean(gw x): one elementwise expression of x, g and the rows'
        # scalars (no float32 x^ or gw of x's size between the reductions)
        c = r * r * r * mx.mean(g32 * w32 * x32, axis=-1, keepdims=True)
        dx = r * g32 * w32 - x32 * c
        dw = (g32 * x32 * r).reshape(-1, x.shape[-1]).sum(0)
        return dx.astype(x.dtype), dw.astype(w.dtype)

    return norm


def layer_norm(x: mx.array, weight: mx.array, bias: mx.array, eps: float) -> mx.array:
    """`mx.fast.layer_norm` with a weight and a bias (the vision towers' norms); native: one pass per row
    forward (its two sums, then the output) and one backward, the weight's and bias's gradients summed
    over rows per core."""
    k = _all_native(x, weight, bias)
    return k.layer_norm(x, weight, bias, eps) if k is not None else mx.fast.layer_norm(x, weight, bias, eps)


def rotary(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """x cos + rotate_half(x) sin for x [B, H, L, D] (rotate_half(x) = [-x2, x1], the halves of the
    last axis), cos / sin broadcastable to x, in x's dtype. Native: one pass that reads x through
    its strides (the heads' transposed view needs no copy) and whose VJP is the reverse rotation."""
    k = _all_native(x, cos, sin) if x.ndim == 4 else None
    if k is not None:
        return k.rotary(x, cos, sin)
    half = x.shape[-1] // 2
    rotated = mx.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return (x * cos + rotated * sin).astype(x.dtype)


def softmax(x: mx.array, axis: int = -1) -> mx.array:
    """Softmax along `axis` in float32 (`mx.softmax(..., precise=True)` off the native path)."""
    k = kernels_for(x)
    if k is None:
        return mx.softmax(x, axis=axis, precise=True)
    if axis in (-1, x.ndim - 1):
        return k.softmax(x)
    return mx.swapaxes(k.softmax(mx.swapaxes(x, axis, -1)), axis, -1)


def sum_squares(x: mx.array) -> mx.array:
    """sum(x^2) in float32 (the gradient norm's square); native: one multi-threaded pass, accumulated
    in double (MLX's `square(x).sum()` reduces on one core)."""
    k = kernels_for(x)
    return k.sum_squares(x) if k is not None else mx.square(x.astype(mx.float32)).sum()


def exp_shift(z: mx.array, m: mx.array) -> mx.array:
    """exp(z - m) in float32 (m broadcast, typically the row max), for sampling: not differentiable
    off the native path."""
    z = z.astype(mx.float32)
    k = kernels_for(z)
    if k is not None:
        return k.exp(z - m)
    if not on_cpu():
        return mx.exp(z - m)
    r, p = _reduce_shift(z, m)
    return _scale(r, p)


def logsumexp(x: mx.array, axis: int = -1, keepdims: bool = False) -> mx.array:
    """log(sum(exp(x))) along `axis` with the max shifted out; rows of all -inf give -inf."""
    m = mx.stop_gradient(x.max(axis=axis, keepdims=True))
    m = mx.where(mx.isfinite(m), m, 0.0)
    out = m + mx.log(exp_shift(x, m).sum(axis=axis, keepdims=True))
    return out if keepdims else out.squeeze(axis)


class KeptAttention:
    """The FlashAttention outputs of one checkpointed call, kept from its forward for the recomputation
    of that call in the backward (`models.dropout.keyed(..., keep_attention=True)`).

    Gradient checkpointing recomputes a layer in the backward to rebuild what its gradient needs. For the
    attention that is the output o and the rows' log-sum-exp (the kernel's backward recomputes the scores
    per block from q, k, v and lse): a third of a layer's forward at 4k tokens, more at longer rows
    (`scripts/bench_layer.py`), for L x Hq x (D + 1) floats.
    The forward trace (`replay` False) runs the kernel and keeps (o, lse) in call order; the recomputation
    (`replay` True) gets o back as a function of its new q, k, v whose VJP is the kernel's backward from
    the kept o and lse, so the attention's forward runs once per step. q, k and v are recomputed as
    before (their projections' gradients need the layer's input anyway)."""

    def __init__(self):
        self.kept: list = []
        self.replay = False

    def attend(self, kernels, q, k, v, causal: bool, bounds=None) -> tuple[mx.array, mx.array]:
        """The kernel's (out, lse) for q [B, G, rep, L, D] (scaled), k / v [B, G, S, D]: computed and kept in
        the forward, the kept ones (differentiable in q, k, v) in the recomputation."""
        if not self.replay:
            out, lse = kernels.flash_attention(q, k, v, causal, bounds=bounds, return_lse=True)
            self.kept.append((mx.stop_gradient(out), mx.stop_gradient(lse)))
            return out, lse
        o, lse = self.kept.pop(0)  # in call order; the replayed graph holds them from here on
        if o.shape != q.shape:
            raise RuntimeError(f"KeptAttention: the recomputation's attention {q.shape} is not the forward's {o.shape}")

        @mx.custom_function
        def replayed(q, k, v):
            return o, lse

        @replayed.vjp
        def replayed_vjp(primals, cotangents, outputs):
            d_out, d_lse = cotangents
            return tuple(kernels.flash_attention_grad(*primals, o, lse, d_out, d_lse, causal, bounds=bounds))

        return replayed(q, k, v)


KEEPERS: list[KeptAttention] = []  # the checkpointed calls in progress that keep their attention (innermost last)


def _kernel_attention(kernels, q, k, v, causal: bool, bounds=None) -> tuple[mx.array, mx.array]:
    """The kernel's (out, lse) for scaled q [B, G, rep, L, D], k / v [B, G, S, D]: through the innermost
    checkpointed call's KeptAttention when there is one."""
    if KEEPERS:
        return KEEPERS[-1].attend(kernels, q, k, v, causal, bounds)
    return kernels.flash_attention(q, k, v, causal, bounds=bounds, return_lse=True)


FLASH_MIN_QUERIES = 16  # below (decoding, short prefills) the scores path: one pass over the keys either way


def flash_attention(q, k, v, *, scale: float, causal: bool = False, bounds: mx.array | None = None):
    """The native FlashAttention kernel's softmax(q k^T scale) v and its rows' log-sum-exp, both
    differentiable: (out [B, Hq, L, D], lse [B, Hq, L]), q [B, Hq, L, D], k / v [B, Hkv, S, D]
    (grouped heads). causal: query i sees keys j <= i + S - L. bounds int [B, 2]: batch row b sees
    keys [start, end) only (a padded row's real keys); a query that sees none gets 0 and lse -inf.
    None where the kernel does not run (not float32 on the CPU, no native build). The log-sum-exp lets
    a caller merge attentions over disjoint key sets (`shared_prompt`): out = sum_i out_i exp(lse_i - lse)."""
    k_ = kernels_for(q)
    if k_ is None or k.dtype != mx.float32 or v.dtype != mx.float32:
        return None
    B, Hq, L, D = q.shape
    Hkv = k.shape[1]
    out, lse = _kernel_attention(k_, (q * scale).reshape(B, Hkv, Hq // Hkv, L, D), k, v, causal, bounds)
    return out.reshape(B, Hq, L, D), lse.reshape(B, Hq, L)


def masked_scores(scores: mx.array, mask) -> mx.array:
    """Attention scores [..., L, S] under mask: None; "causal" (query i of the last L sees keys
    j <= i + S - L); boolean (False: the dtype's min); or additive, broadcastable to the scores."""
    if mask is None:
        return scores
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"mask must be None, 'causal' or an array, got {mask!r}")
        L, S = scores.shape[-2:]
        mask = mx.arange(S - L, S)[:, None] >= mx.arange(S)[None]
    if mask.dtype == mx.bool_:
        return mx.where(mask, scores, mx.finfo(scores.dtype).min)
    return scores + mask.astype(scores.dtype)


def scaled_dot_product_attention(q, k, v, *, scale: float, mask=None) -> mx.array:
    """`mx.fast.scaled_dot_product_attention` (q [B, Hq, L, D], k / v [B, Hkv, S, D], grouped-query
    heads, mask None, "causal", boolean or additive, broadcastable to [B, Hq, L, S]).

    On float32 CPU arrays with the native kernels: without a mask or with "causal" (L <= S), at least
    FLASH_MIN_QUERIES queries, the native FlashAttention kernel (`flash_attention` in
    `native/attention.cpp`): per block of queries of a kv-head group, the scores stay in a per-core
    buffer, the softmax runs over them in place and only the output and each row's log-sum-exp are
    kept; its VJP recomputes each block's probabilities. No [L, S] array exists, forward or backward,
    and the matmuls run in a register-tiled micro-kernel (`python scripts/bench_attention.py`: time and
    peak against the materialised scores and MLX's own, figures in docs/benchmarks.md). With an array mask (padded
    or packed rows) or for decoding: scores, mask, the native softmax, values (MLX's CPU path has no
    fused kernel either). Elsewhere MLX's own (the decoders reach this through `models.attention.attention`,
    whose graph path tiles long rows)."""
    if not uses_native(q):
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    B, Hq, L, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    rep = Hq // Hkv
    q = q * scale
    causal = isinstance(mask, str) and mask == "causal"
    flash = (mask is None or (causal and L <= S)) and S > 0 and L >= FLASH_MIN_QUERIES
    if flash and k.dtype == mx.float32 and v.dtype == mx.float32:
        out, _ = _kernel_attention(kernels_for(q), q.reshape(B, Hkv, rep, L, D), k, v, causal)
        return out.reshape(B, Hq, L, D)
    if rep > 1:  # [B, Hkv, rep, L, D] against [B, Hkv, 1, S, D]: no copies of k and v
        q = q.reshape(B, Hkv, rep, L, D)
        k, v = k[:, :, None], v[:, :, None]
    scores = q @ k.swapaxes(-1, -2)
    if rep > 1 and not isinstance(mask, str) and mask is not None and mask.ndim == 4:
        # [B, Hq | 1, L, S] -> [B, Hkv | 1, rep | 1, L, S]
        mask = mask.reshape(mask.shape[0], Hkv, rep, L, S) if mask.shape[1] == Hq else mask[:, :, None]
    out = softmax(masked_scores(scores, mask)) @ v
    return out.reshape(B, Hq, L, D) if rep > 1 else out
