"""The streamed student / teacher divergence (`losses.distill.generalized_jsd`): peak memory of value_and_grad over
the tokens (a trained [V, D] head) against one [tokens, V] float32 logit array, at Qwen's vocabularies.

    python scripts/bench_distill.py            # V = 151936 and 248320, 128 / 512 / 2048 tokens, D = 32
"""

from __future__ import annotations

import argparse
import time

# isort: off
import mlxrl  # noqa: F401  (the fast BLAS before mlx.core)
import mlx.core as mx
# isort: on

from mlxrl.losses.distill import generalized_jsd


def peak(n: int, vocab: int, d: int) -> tuple[int, float]:
    key = mx.random.key(n)
    hs, ht = mx.random.normal((n, d), key=key), mx.random.normal((n, d), key=key)
    ws, wt = 0.05 * mx.random.normal((vocab, d), key=key), 0.05 * mx.random.normal((vocab, d), key=key)
    mx.eval(hs, ht, ws, wt)
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    t0 = time.perf_counter()
    out = mx.value_and_grad(lambda a, b: generalized_jsd(a, b, ht, wt, beta=0.5)[0].sum(), argnums=(0, 1))(hs, ws)
    mx.eval(out)
    return mx.get_peak_memory() - base, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, nargs="+", default=[151936, 248320])
    ap.add_argument("--tokens", type=int, nargs="+", default=[128, 512, 2048])
    ap.add_argument("--width", type=int, default=32)
    a = ap.parse_args()
    print(f"{'V':>8} {'tokens':>7} {'peak MB':>9} {'[tokens, V] fp32 MB':>20} {'ratio':>7} {'seconds':>8}")
    for v in a.vocab:
        for n in a.tokens:
            p, s = peak(n, v, a.width)
            logits = 4 * n * v
            print(f"{v:>8} {n:>7} {p / 1e6:>9.1f} {logits / 1e6:>20.1f} {p / logits:>7.3f} {s:>8.2f}", flush=True)


if __name__ == "__main__":
    main()
