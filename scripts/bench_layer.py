"""Where a training step's time goes at real scale: one decoder layer of a Qwen3 shape (random weights,
LoRA r16 α32 dropout 0.05 on its seven projections, float32 CPU), at L tokens, in one process.

    python scripts/bench_layer.py                          # 0.6B shape, L = 4096, ~4 min on 2 cores
    python scripts/bench_layer.py --length 8192 --shape qwen3-1.7b

1. The layer's forward + backward under gradient checkpointing (what the trainer runs per layer: the
   forward, then in the backward the recomputed forward and the backward), compiled, with the native
   decoder kernels (RMSNorm, rotary embedding, SwiGLU product; `mlxrl.cpu.fastmath`) against MLX's ops
   for the same three; our LoRA layer's dropout + A without its fusion (`Dropout.matmul` as dropout then
   matmul: the dropped copy of x written and kept); and mlx-lm's `LoRALinear.__call__` in place of ours
   (that copy, then matmul, scale, add, where ours adds inside the matmul, `mx.addmm`); alternating,
   median of `--repeats`; the attention with its scores kept (a boolean causal mask: the scores path,
   [H, L, L] scores, mask, native softmax, values) in place of the FlashAttention kernel; and
   `keep_attention` (the recompute reuses the forward's attention output and log-sum-exp); and the MLP
   untiled (every variant else runs it as the trainers do with checkpointing: `--tiled_mlp`, tiles of the
   hidden size).
2. Its parts, each timed alone: every projection's forward and input-gradient matmul (GFLOP/s against
   the fp32 GEMM peak measured here), and the causal attention forward and forward + backward
   (`fastmath.scaled_dot_product_attention`: the native FlashAttention kernel; `scripts/bench_attention.py`
   compares it with the scores path and MLX's own).
3. The model of the layer's time: 2 forwards + 1 backward of the projections at their measured rates,
   attention forward + forward-and-backward, and the rest (norms, rotary, SiLU, LoRA's small matmuls,
   residual adds, copies) as the difference.
"""

import argparse  # noqa: I001  (mlxrl must come before mlx.core)
import statistics
import time

import mlxrl  # (first: the fast BLAS before mlx.core)
import mlx.core as mx
import mlx.nn as nn

from mlxrl.cpu import fastmath, native
from mlxrl.models import dropout, lora
from mlxrl.models.language import DecoderLayer, RotaryEmbedding, TextConfig
from mlxrl.models.tiled import tile_tokens_for

SHAPES = {
    "qwen3-0.6b": {"hidden_size": 1024, "intermediate_size": 3072, "num_attention_heads": 16,
                   "num_key_value_heads": 8, "head_dim": 128},
    "qwen3-1.7b": {"hidden_size": 2048, "intermediate_size": 6144, "num_attention_heads": 16,
                   "num_key_value_heads": 8, "head_dim": 128},
}


def median_time(fn, repeats):
    mx.eval(fn())
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def mlx_ops():
    """RMSNorm, rotary and the SwiGLU product as MLX's ops (what the graph path runs)."""
    def rms_norm(x, w, eps):
        return mx.fast.rms_norm(x, w, eps)

    def rotary(x, cos, sin):
        half = x.shape[-1] // 2
        return (x * cos + mx.concatenate([-x[..., half:], x[..., :half]], axis=-1) * sin).astype(x.dtype)

    def silu_mul(g, u):
        return fastmath.silu(g) * u

    return rms_norm, rotary, silu_mul


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip", nargs="*", default=[],
                    choices=["MLX ops", "dropped copy", "mlx-lm", "scores kept", "untiled"],
                    help="leave these variants out (the scores kept hold [H, L, L] float32 scores: 4.3 GB at 8192)")
    a = ap.parse_args()
    if native.load() is None:
        raise SystemExit("the native kernels are not available here (MLXRL_NATIVE=0, not Linux, or no compiler)")
    mlxrl.runtime.setup()  # as the trainers: MLX's CPU buffer cache, malloc keeping freed memory
    L = a.length
    cfg = TextConfig.from_dict({**SHAPES[a.shape], "num_hidden_layers": 1, "vocab_size": 151936, "qk_norm": True})
    mx.random.seed(0)

    n = 2048
    ma, mb = mx.random.normal((n, n)), mx.random.normal((n, n))
    peak = 2 * n**3 / min(median_time(lambda: ma @ mb, 3) for _ in range(2)) / 1e9
    print(f"fp32 GEMM peak ({n}^2): {peak:.1f} GFLOP/s")

    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = [DecoderLayer(cfg)]

    model = Holder()
    lora.apply_lora(model, r=16, alpha=32, dropout=0.05)
    mx.eval(model.parameters())
    model.train()
    layer = model.layers[0]
    cos, sin = RotaryEmbedding(cfg)(mx.arange(L)[None])
    x = mx.random.normal((1, L, cfg.hidden_size)) * 0.5
    mx.eval(x, cos, sin)

    keep = {"attention": False}  # keep_attention: the recompute reuses the forward's attention output

    def loss(params, x):
        layer.update(params)
        return dropout.keyed(layer, lambda h: layer(h, cos, sin, "causal"), checkpoint=True,
                             keep_attention=keep["attention"])(x).sum()

    params = layer.trainable_parameters()
    native_ops = (fastmath.rms_norm, fastmath.rotary, fastmath.silu_mul)
    ours_lora, mlxlm_lora = lora.LoRALinear.__call__, lora.MlxLmLoRALinear.__call__
    fused = dropout.Dropout.matmul

    def copied(self, x, w):  # dropout(x) @ A as two steps: the dropped copy of x is written and kept
        return self(x) @ w if self._keep < 1.0 and self.training else x @ w

    flash = fastmath.scaled_dot_product_attention
    causal_mask = mx.arange(L)[:, None] >= mx.arange(L)[None]

    def scores_kept(q, k, v, *, scale, mask=None):  # the scores path: a boolean mask, [H, L, L] scores
        return flash(q, k, v, scale=scale, mask=causal_mask if isinstance(mask, str) else mask)

    tile = tile_tokens_for(cfg.hidden_size, checkpointing=True)  # the trainers' default (`--tiled_mlp`)
    variants = {"native decoder kernels": (native_ops, ours_lora, fused, flash, False, tile),
                "MLX ops for them": (mlx_ops(), ours_lora, fused, flash, False, tile),
                "dropped copy of x": (native_ops, ours_lora, copied, flash, False, tile),
                "mlx-lm's LoRA layer": (native_ops, mlxlm_lora, copied, flash, False, tile),
                "attention scores kept": (native_ops, ours_lora, fused, scores_kept, False, tile),
                "keep_attention": (native_ops, ours_lora, fused, flash, True, tile),
                "untiled MLP": (native_ops, ours_lora, fused, flash, False, 0)}
    skipped = {"MLX ops": "MLX ops for them", "dropped copy": "dropped copy of x", "mlx-lm": "mlx-lm's LoRA layer",
               "scores kept": "attention scores kept", "untiled": "untiled MLP"}
    for name in a.skip:
        del variants[skipped[name]]
    times = {k: [] for k in variants}
    for _ in range(a.repeats):
        for name, (ops, lora_call, down, attention, keep["attention"], layer.mlp.tile_tokens) in variants.items():
            fastmath.rms_norm, fastmath.rotary, fastmath.silu_mul = ops
            lora.LoRALinear.__call__, dropout.Dropout.matmul = lora_call, down
            fastmath.scaled_dot_product_attention = attention
            step = mx.compile(mx.value_and_grad(loss, argnums=(0, 1)))
            mx.eval(step(params, x))
            t = time.perf_counter()
            mx.eval(step(params, x))
            times[name].append(time.perf_counter() - t)
    fastmath.rms_norm, fastmath.rotary, fastmath.silu_mul = native_ops
    lora.LoRALinear.__call__, dropout.Dropout.matmul = ours_lora, fused
    fastmath.scaled_dot_product_attention = flash
    keep["attention"], layer.mlp.tile_tokens = False, tile
    print(f"\n{a.shape} layer, L = {L}, LoRA r16 on 7 projections, forward + backward with checkpointing "
          f"(median of {a.repeats}, alternating):")
    layer_s = {k: statistics.median(v) for k, v in times.items()}
    for name, s in layer_s.items():
        print(f"  {name:<24} {s:7.2f} s   ({', '.join(f'{t:.2f}' for t in times[name])})")
    ours = layer_s["native decoder kernels"]
    kept_mb = 4 * L * cfg.num_attention_heads * (cfg.head_dim + 1) / 1e6
    what = {"MLX ops for them": ("the native decoder kernels", False),
            "dropped copy of x": ("the fused dropout + A", False),
            "mlx-lm's LoRA layer": ("our LoRA layer (fused dropout + A, adapter added inside the matmul) over "
                                    "mlx-lm's", False),
            "attention scores kept": ("the FlashAttention kernel over the scores kept", False),
            "keep_attention": (f"keep_attention (the recompute reuses the forward's attention output: "
                               f"+{kept_mb:.1f} MB kept per layer)", True),
            "untiled MLP": (f"the tiled MLP (tiles of {tile}) over the untiled", False)}
    print("  speed-up of " + "; of ".join(f"{label} {ours / layer_s[k] if inverse else layer_s[k] / ours:.2f}x"
                                        for k, (label, inverse) in what.items() if k in layer_s))

    D, inter, Hq, Hkv, hd = (cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads,
                         cfg.num_key_value_heads, cfg.head_dim)
    projections = {"q": (Hq * hd, D), "k": (Hkv * hd, D), "v": (Hkv * hd, D), "o": (D, Hq * hd),
                   "gate": (inter, D), "up": (inter, D), "down": (D, inter)}
    print("\nprojections (frozen base: forward x W^T and input gradient g W):")
    fwd_s = bwd_s = 0.0
    for name, (out_f, in_f) in projections.items():
        w = mx.random.normal((out_f, in_f)) * 0.02
        xi, g = mx.random.normal((L, in_f)), mx.random.normal((L, out_f))
        mx.eval(w, xi, g)
        flops = 2 * L * out_f * in_f
        tf = median_time(lambda: xi @ w.T, a.repeats)  # noqa: B023
        tb = median_time(lambda: g @ w, a.repeats)  # noqa: B023
        fwd_s, bwd_s = fwd_s + tf, bwd_s + tb
        print(f"  {name:<5} [{L}, {in_f}] -> {out_f}: forward {tf * 1e3:6.1f} ms ({flops / tf / 1e9:5.1f} GFLOP/s), "
              f"input gradient {tb * 1e3:6.1f} ms ({flops / tb / 1e9:5.1f} GFLOP/s)")
    linear_s = 2 * fwd_s + bwd_s
    print(f"  2 forwards + 1 backward: {linear_s:.2f} s")

    q = mx.random.normal((1, Hq, L, hd))
    k, v = mx.random.normal((1, Hkv, L, hd)), mx.random.normal((1, Hkv, L, hd))
    mx.eval(q, k, v)
    scale = hd**-0.5

    def attend(q, k, v):
        return fastmath.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal")

    fwd = mx.compile(attend)
    fwd_bwd = mx.compile(mx.grad(lambda q, k, v: (attend(q, k, v) * q).sum(), argnums=(0, 1, 2)))
    causal_flops = 2 * 2 * Hq * hd * L * (L + 1) / 2  # q k^T and p v over the causal half
    att_f = median_time(lambda: fwd(q, k, v), a.repeats)
    att_fb = median_time(lambda: fwd_bwd(q, k, v), a.repeats)
    print(f"\ncausal attention ({Hq}/{Hkv} heads of {hd}, the FlashAttention kernel): "
          f"forward {att_f * 1e3:.0f} ms ({causal_flops / att_f / 1e9:.1f} GFLOP/s), forward + backward "
          f"{att_fb * 1e3:.0f} ms ({3.5 * causal_flops / att_fb / 1e9:.1f} GFLOP/s: 1 + 2.5 forwards of matmuls)")

    model_s = linear_s + att_f + att_fb
    rest = layer_s["native decoder kernels"] - model_s
    total = layer_s["native decoder kernels"]
    print(f"\nthe layer ({total:.2f} s) = projections {linear_s:.2f} s ({linear_s / total:.0%}) + attention "
          f"{att_f + att_fb:.2f} s ({(att_f + att_fb) / total:.0%}: forward, then forward + backward in the "
          f"recompute) + the rest {rest:.2f} s ({rest / total:.0%})")
    ideal = (3 * sum(2 * L * o * i for o, i in projections.values()) + 4.5 * causal_flops) / peak / 1e9
    print(f"at the GEMM peak ({peak:.0f} GFLOP/s) the same matmuls would take {ideal:.2f} s")


if __name__ == "__main__":
    main()
