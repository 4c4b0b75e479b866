"""The native CPU path's attention, side by side in one process: the FlashAttention kernel
(`fastmath.scaled_dot_product_attention` with mask "causal" or none), the same computation with its
scores kept (a boolean mask, all true without a causal one: [B, Hq, L, L] scores, mask, native softmax,
values, what MLX's graph differentiates), and MLX's own `mx.fast.scaled_dot_product_attention` (its CPU
fallback composes the same ops with MLX's softmax). Forward and forward + backward, alternating sides,
median of `--repeats`; time, GFLOP/s (model FLOPs: q k^T and p v, the causal half when causal; the
backward counts 2.5 forwards) and MLX's peak above the inputs, with the ratios.

    python scripts/bench_attention.py                                       # Qwen3-0.6B's heads at 4096, causal
    python scripts/bench_attention.py --heads 16 16 --head_dim 64 --length 3136 --batch 2 --full
                                                                            # Qwen3-VL's tower: 2 images of 896 px
"""

import argparse  # noqa: I001  (mlxrl must come before mlx.core)
import statistics
import time

import mlxrl  # noqa: F401  (first: the fast BLAS before mlx.core)
import mlx.core as mx

from mlxrl.cpu import fastmath, native


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", type=int, nargs=2, default=[16, 8], metavar=("Q", "KV"))
    ap.add_argument("--head_dim", type=int, default=128)
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--full", action="store_true", help="no mask (a vision tower's attention within an image)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sides", nargs="+", choices=["flash", "scores", "mlx"], default=["flash", "scores", "mlx"])
    a = ap.parse_args()
    if native.load() is None:
        raise SystemExit("the native kernels are not available here (MLXRL_NATIVE=0, not Linux, or no compiler)")
    (Hq, Hkv), D, L, B = a.heads, a.head_dim, a.length, a.batch
    mx.random.seed(0)
    q = mx.random.normal((B, Hq, L, D))
    k, v = mx.random.normal((B, Hkv, L, D)), mx.random.normal((B, Hkv, L, D))
    w = mx.random.normal((B, Hq, L, D))
    mx.eval(q, k, v, w)
    scale = D**-0.5
    mask = None if a.full else "causal"
    # the scores path: a boolean mask (all true without one) makes fastmath materialise the scores
    square = mx.ones((L, L), dtype=mx.bool_) if a.full else mx.arange(L)[:, None] >= mx.arange(L)[None]
    sides = {"flash": lambda q, k, v: fastmath.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask),
             "scores": lambda q, k, v: fastmath.scaled_dot_product_attention(q, k, v, scale=scale, mask=square),
             "mlx": lambda q, k, v: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)}
    flops = 2 * 2 * B * Hq * D * L * (L if a.full else (L + 1) / 2)
    runs = {}
    for name in a.sides:
        fn = sides[name]
        runs[(name, "forward")] = mx.compile(fn), 1.0
        runs[(name, "forward + backward")] = (
            mx.compile(mx.grad(lambda q, k, v, fn=fn: (fn(q, k, v) * w).sum(), argnums=(0, 1, 2))), 3.5)
    times = {key: [] for key in runs}
    peaks = {}
    for key, (fn, _) in runs.items():  # warm-up (compile, first touch) and MLX's peak above the inputs
        mx.clear_cache()
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        mx.eval(fn(q, k, v))
        peaks[key] = (mx.get_peak_memory() - base) / 1e9
    for _ in range(a.repeats):
        for key, (fn, _) in runs.items():
            t = time.perf_counter()
            mx.eval(fn(q, k, v))
            times[key].append(time.perf_counter() - t)
    kind = "no mask" if a.full else "causal"
    print(f"attention, {B} x {Hq}/{Hkv} heads of {D}, L = {L}, {kind}, float32 CPU, {native.load().threads()} "
          f"threads (median of {a.repeats}, alternating; peak: MLX's, above the inputs):")
    med = {key: statistics.median(t) for key, t in times.items()}
    for (name, what), (_, mult) in runs.items():
        s = med[(name, what)]
        print(f"  {name:<7} {what:<19} {s * 1e3:8.0f} ms  {mult * flops / s / 1e9:6.1f} GFLOP/s  "
              f"peak {peaks[(name, what)]:6.2f} GB   ({', '.join(f'{t * 1e3:.0f}' for t in times[(name, what)])})")
    if "flash" in a.sides:
        for other in [s for s in a.sides if s != "flash"]:
            for what in ("forward", "forward + backward"):
                f, o = ("flash", what), (other, what)
                print(f"  flash vs {other}, {what}: {med[o] / med[f]:.2f}x the speed, "
                      f"{peaks[f] / max(peaks[o], 1e-9):.3f}x the peak")


if __name__ == "__main__":
    main()
