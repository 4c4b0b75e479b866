"""How long building a compiled training step takes at real depth: `mx.compile`'s trace of the forward and
backward, its simplification and fusion, nothing evaluated (the weights are never materialised, so any shape
runs in seconds and little memory).

    python scripts/bench_trace.py                                  # 0.6B shape, 4096 / 16384 / 32768 tokens
    python scripts/bench_trace.py --shape qwen3-1.7b --lengths 8192 30720

Every trainer compiles its step once per batch shape (`--compile`, "GPU and Apple Silicon"), and an eager step
(`--compile false`, or past `--max_compiled_shapes`) pays the trace at every step. The step here is the
trainer's: LoRA r16 on the seven projections (dropout 0.05), gradient checkpointing, the model state and MLX's
random state as the compiled function's inputs; its loss is the sum of the trunk's output (the LM head's trace
does not grow with depth). Side by side in one process, per length: the tiled MLP (`--tiled_mlp`, the default
with checkpointing: tiles of the hidden size), the untiled MLP, and optionally `--keep_attention`. The tiled
step traces one MLP recompute per tile per layer, so its time grows with tiles x layers; what this measures is
that it grows no faster (a trace whose every tile walks the graph above it grows with its square: see
`models.tiled`).
"""

from __future__ import annotations  # noqa: I001  (mlxrl must come before mlx.core)

import argparse
import time

import mlxrl  # noqa: F401  (first: the fast BLAS before mlx.core)
import mlx.core as mx
import mlx.nn as nn

from mlxrl.models import build_model, lora
from mlxrl.models.tiled import tile_bounds, tile_tokens_for

SHAPES = {
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072),
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144),
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_attention_heads=32, tie_word_embeddings=False,
                     num_hidden_layers=36),
}
BASE = dict(model_type="qwen3", vocab_size=151936, num_hidden_layers=28, num_attention_heads=16,
            num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6, max_position_embeddings=40960,
            rope_theta=1_000_000.0, tie_word_embeddings=True)


def trunk_step(config: dict, length: int, tiles: bool = True, keep: bool = False, dtype=mx.float32,
               compiled: bool = True):
    """(model, step): the trainer's trunk step over `length` tokens, as described above (also what
    `gpu_probe.py step` times, evaluated); the weights stay unmaterialised until the caller evaluates them."""
    model = build_model(config)
    if dtype != mx.float32:
        model.set_dtype(dtype)
    lm = model.language_model
    lm.gradient_checkpointing, lm.keep_attention = True, keep
    lm.tile_mlp(tile_tokens_for(lm.config.hidden_size, checkpointing=True) if tiles else 0)
    lora.apply_lora(model, r=16, alpha=32, dropout=0.05)
    model.train()
    x = mx.random.normal((1, length, lm.config.hidden_size)).astype(dtype)
    positions = mx.arange(length)[None]
    state = [model.state, mx.random.state]

    def loss():
        return lm(x, positions, "causal").astype(mx.float32).sum()

    step = nn.value_and_grad(model, loss)
    return model, mx.compile(step, inputs=state, outputs=state) if compiled else step


def trace_seconds(config: dict, length: int, tiles: bool, keep: bool) -> float:
    """Seconds for the first call of the compiled step (trace + compile; outputs left unevaluated)."""
    _, step = trunk_step(config, length, tiles, keep)
    t = time.perf_counter()
    step()
    return time.perf_counter() - t


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 32768])
    ap.add_argument("--keep_attention", action="store_true", help="also the tiled step with keep_attention")
    a = ap.parse_args(argv)
    variants = {"tiled MLP (default)": (True, False), "untiled MLP": (False, False)}
    if a.keep_attention:
        variants["tiled + keep_attention"] = (True, True)
    config = {**BASE, **SHAPES[a.shape]}
    layers, tile = config["num_hidden_layers"], tile_tokens_for(config["hidden_size"], checkpointing=True)
    print(f"{a.shape} ({layers} layers), LoRA r16, gradient checkpointing: trace + compile of the step, seconds")
    print(f"{'tokens':>7} {'tiles':>6} " + " ".join(f"{k:>22}" for k in variants) + "   tiled / untiled")
    for length in a.lengths:
        got = {k: trace_seconds(config, length, *v) for k, v in variants.items()}
        tiles = layers * len(tile_bounds(length, tile))
        ratio = got["tiled MLP (default)"] / got["untiled MLP"]
        print(f"{length:>7} {tiles:>6} " + " ".join(f"{s:>22.2f}" for s in got.values()) + f"   {ratio:.1f}x",
              flush=True)


if __name__ == "__main__":
    main()
