"""The CPU measurements behind mlxrl.runtime's buffer cache, mlxrl.fastmath and FusedAdamW, side by side
in one process (MLX CPU, float32).

    python scripts/bench_cpu_ops.py            # ~1 min on 2 cores

1. `y + 1` on a [256, 151936] tile (156 MB), repeated: MLX's 32 MB CPU buffer cache vs mlxrl's 256 MB
   default (a 622 MB [1024, V] tile does not fit either cache and is page-faulted in each time).
2. exp of that tile: `mx.exp` vs `mlxrl.fastmath.exp` (the native kernel, mlxrl.native), and the
   MLX-ops polynomial (`fastmath.exp_shift` without the native module) vs the native kernel; sigmoid
   of a [1024, 3072] MLP activation; softmax over [16, 1024, 1024] attention scores; attention forward
   + backward (q [1, 16, 1024, 128], k / v 8 heads, causal), `mx.fast.scaled_dot_product_attention`
   vs `fastmath.scaled_dot_product_attention`.
3. 128 sampling steps over [8, 151936] logits: Gumbel-max `mx.random.categorical` on `mx.exp`
   log-probs (what generation did) vs `mlxrl.generation.engine.sample_tokens` (inverse CDF on fastmath.exp).
4. Clip (max norm 1) + AdamW over 285M parameters shaped like the bench_sft "small" model:
   `optim.clip_grad_norm` + `optim.AdamW(bias_correction=True)` vs the trainer's norm + `FusedAdamW`.
Each figure is the best of a few repeats after one warm-up.
"""

import time  # noqa: I001  (mlxrl must come before mlx.core)

import mlxrl  # noqa: F401  (first: the fast BLAS before mlx.core)
import mlx.core as mx
import mlx.optimizers as optim
from mlx.utils import tree_flatten

from mlxrl.cpu import fastmath
from mlxrl.generation.engine import sample_tokens
from mlxrl.optim.optimizers import FusedAdamW


def best(fn, reps=3):
    fn()
    top = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        top = min(top, time.perf_counter() - t)
    return top


def row(name, a, b, unit="s"):
    print(f"{name:58} {a:8.3f} {b:8.3f} {unit}  ({a / b:.1f}x)", flush=True)


def main():
    V = 151936
    z = mx.random.normal((1024, V))
    y = z[:256] + 0.0
    mx.eval(z, y)
    print(f"{'':58} {'before':>8} {'mlxrl':>8}")
    times = []
    for limit in (32 << 20, 256 << 20):
        mx.set_cache_limit(limit)
        times.append(best(lambda: mx.eval(y + 1.0)))
    row("y + 1, [256, V]: cache 32 MB vs 256 MB", *times)
    row("exp, [1024, V]: mx.exp vs fastmath.exp", best(lambda: mx.eval(mx.exp(z))),
        best(lambda: mx.eval(fastmath.exp(z))))
    zero = mx.array(0.0)
    polynomial = best(lambda: mx.eval(fastmath._scale(*fastmath._reduce_shift(z, zero))))
    row("exp, [1024, V]: MLX-ops polynomial vs native", polynomial, best(lambda: mx.eval(fastmath.exp(z))))
    z = None  # free the tile
    a = mx.random.normal((1024, 3072))
    row("sigmoid, [1024, 3072]: mx.sigmoid vs fastmath", best(lambda: mx.eval(mx.sigmoid(a))),
        best(lambda: mx.eval(fastmath.sigmoid(a))))
    scores = mx.random.normal((16, 1024, 1024))
    row("softmax, [16, 1024, 1024]: mx.softmax vs fastmath",
        best(lambda: mx.eval(mx.softmax(scores, -1, precise=True))), best(lambda: mx.eval(fastmath.softmax(scores))))
    scores = None
    q = mx.random.normal((1, 16, 1024, 128))
    k, v = mx.random.normal((1, 8, 1024, 128)), mx.random.normal((1, 8, 1024, 128))

    def attention(fn):
        step = mx.grad(lambda q, k, v: fn(q, k, v, scale=128**-0.5, mask="causal").sum(), argnums=(0, 1, 2))
        return best(lambda: mx.eval(step(q, k, v)))

    row("attention fwd+bwd: mx.fast sdpa vs fastmath", attention(mx.fast.scaled_dot_product_attention),
        attention(fastmath.scaled_dot_product_attention))
    logits = mx.random.normal((8, V))
    keys = mx.random.split(mx.random.key(0), 128)

    def gumbel():
        for k in keys:
            lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            mx.eval(mx.random.categorical(lp, axis=-1, key=k), lp)

    def inverse_cdf():
        for k in keys:
            mx.eval(sample_tokens(logits, k))

    row("128 sampling steps, [8, V]: Gumbel-max vs inverse CDF", best(gumbel, 2), best(inverse_cdf, 2))
    shapes = [(V, 1024)] + [(3072, 1024), (1024, 3072), (3072, 1024)] * 8 + [(2048, 1024), (1024, 1024),
                                                                          (1024, 1024), (1024, 2048)] * 8
    params = {f"p{i}": mx.random.normal(s) * 0.02 for i, s in enumerate(shapes)}
    grads = {k: mx.random.normal(v.shape) * 1e-3 for k, v in params.items()}
    mx.eval(params, grads)
    n = sum(v.size for v in params.values())
    eager, fused = optim.AdamW(1e-5, bias_correction=True), FusedAdamW(1e-5)

    def eager_step():
        g, norm = optim.clip_grad_norm(grads, 1.0)
        new = eager.apply_gradients(g, params)
        mx.eval(new, eager.state, norm)

    def fused_step():
        norm = mx.sqrt(sum(mx.square(g).sum() for _, g in tree_flatten(grads)))
        fused.grad_scale = mx.minimum(1.0, 1.0 / (norm + 1e-6))
        new = fused.apply_gradients(grads, params)
        mx.eval(new, fused.state, norm)

    row(f"clip + AdamW, {n / 1e6:.0f}M params: eager vs FusedAdamW", best(eager_step, 2), best(fused_step, 2))


if __name__ == "__main__":
    main()
