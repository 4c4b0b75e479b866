"""What one Qwen3.5 decoder layer holds through a training step, by layer kind: two layers of one kind (Gated
DeltaNet or gated attention) at a real shape's widths, random float32 weights, a 1024-token vocabulary (so the
head is negligible), LoRA r16 α32 on the default projections, gradient checkpointing and the tiled MLP as the
trainers run them, one compiled step (forward, then each layer's recompute and backward). Prints MLX's peak
above the weights and adapters, in MB and per token: the layer's working set, which bounds a long row's peak
on top of the weights and the checkpointed layer inputs (`docs/benchmarks.md`, real scale, run 12).

    python scripts/bench_layer_memory.py                         # the 2B shape's widths, 4096 tokens
    python scripts/bench_layer_memory.py --shape 0.8b --tokens 2048 8192
"""

import argparse  # noqa: I001  (mlxrl must come before mlx.core)

import mlxrl  # noqa: F401  (first: the fast BLAS before mlx.core)
import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxrl.models import build_model
from mlxrl.models.lora import apply_lora

WIDTHS = {  # the Hub's Qwen3.5 text configs (the DeltaNet layers: 16 key and 16 value heads of 128 in both)
    "0.8b": dict(hidden_size=1024, intermediate_size=3584, num_attention_heads=8, num_key_value_heads=2),
    "2b": dict(hidden_size=2048, intermediate_size=6144, num_attention_heads=8, num_key_value_heads=2),
}
KINDS = {"deltanet": "linear_attention", "attention": "full_attention"}


def layer_peak(shape: str, kind: str, tokens: int) -> tuple[int, int]:
    """(weights and adapters' bytes, MLX's peak above them over the second of two identical steps)."""
    cfg = dict(model_type="qwen3_5_text", vocab_size=1024, num_hidden_layers=2, head_dim=256,
               linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=16,
               linear_value_head_dim=128, layer_types=[KINDS[kind]] * 2, tie_word_embeddings=True,
               partial_rotary_factor=0.25, rope_theta=1e7, **WIDTHS[shape])
    mx.random.seed(0)
    model = build_model(cfg)
    apply_lora(model, r=16, alpha=32, dropout=0.0)
    model.language_model.gradient_checkpointing = True
    model.language_model.tile_mlp(cfg["hidden_size"])  # the trainers' tiles with checkpointing
    mx.eval(model.parameters())
    ids = mx.array(np.random.default_rng(0).integers(0, 1024, (1, tokens)))

    def loss(ids):
        return (model(input_ids=ids, return_hidden=True).astype(mx.float32) ** 2).mean()

    step = mx.compile(nn.value_and_grad(model, loss), inputs=[model.state], outputs=[model.state])
    for _ in range(2):  # the first compiles
        mx.synchronize()
        mx.clear_cache()
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        mx.eval(step(ids))
    return base, mx.get_peak_memory() - base


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(WIDTHS), default="2b")
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096])
    ap.add_argument("--kinds", nargs="+", choices=sorted(KINDS), default=["deltanet", "attention"])
    a = ap.parse_args()
    print(f"Qwen3.5-{a.shape} widths, two layers of one kind, LoRA r16, checkpointed, tiled MLP, compiled, float32")
    print(f"{'kind':<10} {'tokens':>6} {'weights MB':>10} {'peak above MB':>13} {'per token KB':>12}")
    for t in a.tokens:
        for kind in a.kinds:
            base, peak = layer_peak(a.shape, kind, t)
            print(f"{kind:<10} {t:>6} {base / 1e6:>10.0f} {peak / 1e6:>13.0f} {peak / t / 1e3:>12.1f}", flush=True)


if __name__ == "__main__":
    main()
