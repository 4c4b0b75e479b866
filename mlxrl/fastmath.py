"""exp for the sampler that is fast on MLX's CPU backend.

MLX's Linux CPU wheel evaluates `mx.exp` at ~0.05 G elements/s (measured in one run on 64M float32
elements: 1.35 s, torch's exp on 2 threads 0.07 s). Its kernel is a scalar Cephes polynomial whose
`fma` calls go through libm: the wheel is built for baseline x86-64. Sampling takes an exp per
vocabulary entry per row and step, so on CPU that exp was most of a decoding step's time.

`exp(x)` here is the same algorithm (2^t = 2^n * 2^f, n = round(t), the same degree-6 Cephes
polynomial for 2^f on [-0.5, 0.5], 2^n from the exponent bits) written as MLX ops in two
compiled kernels: round-to-nearest by adding 1.5 * 2^23 (no `floor` call), the polynomial in plain
multiplies and adds, the exponent by integer shift and a bit view. `python scripts/bench_cpu_ops.py`
(side by side, default 256 MB buffer cache): a [1024, 151936] tile 1.48 s vs 3.14 s for `mx.exp`;
128 sampling steps over [8, 151936], inverse CDF on this exp vs Gumbel-max on `mx.exp`, 1.31 s vs
5.38 s. Largest relative difference to `mx.exp` 1.2e-7 (both are ~4e-6 from a float64 reference: the
same polynomial). Inputs are clamped to [-88.03, 88]:
below, the result is exactly 0 (as `mx.exp` underflows; -inf gives 0), NaN stays NaN. On a GPU
(Metal, CUDA) `mx.exp` is used as is.

Not differentiable by MLX's autodiff on purpose. The streamed head keeps `mx.exp`: this exp's
two kernels hold two more tile-sized arrays. With it in the head, tests/test_plan.py measured the
default model's SFT / DPO peaks 77-152 MB above what they measure with `mx.exp` (the calibrated
predictions), while a separate run with an 8 GB cache timed the head's forward + backward over
1024 x 151936 logits at 4.5 s against 7.9 s; trading that is left for a fused kernel.
"""

from __future__ import annotations

import mlx.core as mx

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


_reduce = mx.compile(lambda x: _poly(x.astype(mx.float32)))
_reduce_shift = mx.compile(lambda z, m: _poly(z.astype(mx.float32) - m))  # z - m inside the kernel


@mx.compile
def _scale(r, p):
    bits = (mx.view(r, mx.int32) - (MAGIC_BITS - 127)) << 23  # (n + 127) << 23: the float 2^n
    return p * mx.view(bits, mx.float32)


def on_cpu() -> bool:
    return mx.default_device().type == mx.DeviceType.cpu


def exp(x: mx.array) -> mx.array:
    """exp(x) in float32 (see the module docstring); `mx.exp` off the CPU."""
    if not on_cpu():
        return mx.exp(x.astype(mx.float32))
    r, p = _reduce(x)
    return _scale(r, p)


def exp_shift(z: mx.array, m: mx.array) -> mx.array:
    """exp(z - m) (m broadcast, typically the row max), without a [.., V] temporary for z - m."""
    if not on_cpu():
        return mx.exp(z.astype(mx.float32) - m)
    r, p = _reduce_shift(z, m)
    return _scale(r, p)


def logsumexp(x: mx.array, axis: int = -1, keepdims: bool = False) -> mx.array:
    """log(sum(exp(x))) along `axis` with the max shifted out; rows of all -inf give -inf."""
    m = mx.stop_gradient(x.max(axis=axis, keepdims=True))
    m = mx.where(mx.isfinite(m), m, 0.0)
    out = m + mx.log(exp_shift(x, m).sum(axis=axis, keepdims=True))
    return out if keepdims else out.squeeze(axis)
