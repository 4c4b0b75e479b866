"""Segment checkpointing's price and saving, side by side in one process: a Qwen3-0.6B-shaped decoder (hidden
1024, MLP 3072, 16/8 heads of 128; random weights, `--layers` deep) with LoRA r16 (dropout 0.05) on the seven
projections, one row of `--tokens` tokens, the trainers' compiled step (value and gradients), per-layer
checkpointing against `--segments` nested segments (`mlxrl.models.checkpointing`), alternating, `--repeats`
times each after a warm-up. The loss is a weighted sum of the final hidden states: the LM head, the same on
both sides, is left out so that the ratio is the decoder's. Prints each step's seconds, the medians, their
ratio, MLX's peak of each side and the saving against the naive count of the layer inputs no longer kept.

    python scripts/bench_segments.py                       # 9 layers, 4096 tokens, 3 segments
    python scripts/bench_segments.py --layers 28 --segments 5 --tokens 8192
"""

from __future__ import annotations  # noqa: I001  (mlxrl must come before mlx.core)

import argparse
import statistics
import time

import mlxrl  # noqa: F401  (first: the fast BLAS before mlx.core)
import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxrl.models import build_model
from mlxrl.models.checkpointing import kept_inputs
from mlxrl.models.lora import apply_lora


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=9)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--segments", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args(argv)
    width = 1024
    config = dict(model_type="qwen3", vocab_size=1024, hidden_size=width, intermediate_size=3072,
                  num_hidden_layers=a.layers, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                  tie_word_embeddings=True, max_position_embeddings=max(40960, a.tokens))
    mx.random.seed(0)
    model = build_model(config)
    apply_lora(model, r=16, alpha=32, dropout=0.05)
    model.train()
    ids = mx.array(np.random.default_rng(0).integers(0, 1024, (1, a.tokens)), mx.int32)
    w = mx.random.normal((1, a.tokens, width)) / a.tokens
    mx.eval(model.parameters(), w)
    lm = model.language_model
    fn = nn.value_and_grad(model, lambda m: (m(input_ids=ids, return_hidden=True) * w).sum())
    steps = {}
    for s in (0, a.segments):
        lm.set_checkpointing(True, False, s)
        state = [model.state, mx.random.state]
        steps[s] = mx.compile(lambda: fn(model), inputs=state, outputs=state)  # traced on its first call
    times, peaks, losses = {0: [], a.segments: []}, {}, {}
    for r in range(a.repeats + 1):
        for s in (0, a.segments):
            lm.set_checkpointing(True, False, s)
            mx.random.seed(r)  # the same dropout masks on both sides
            mx.clear_cache()
            mx.reset_peak_memory()
            t0 = time.perf_counter()
            loss, grads = steps[s]()
            mx.eval(loss, grads)
            dt = time.perf_counter() - t0
            peaks[s] = max(peaks.get(s, 0), mx.get_peak_memory())
            losses.setdefault(s, []).append(loss.item())
            if r:
                times[s].append(dt)
            print(f"  repeat {r}{' (warm-up)' if not r else ''}: {'segments' if s else 'per layer':9} {dt:7.2f} s",
                  flush=True)
            del loss, grads
    per, seg = statistics.median(times[0]), statistics.median(times[a.segments])
    naive = (a.layers - kept_inputs(a.layers, a.segments)) * a.tokens * width * 4
    print(f"\nQwen3-0.6B-shaped decoder, {a.layers} layers, {a.tokens} tokens, LoRA r16, compiled step, median of "
          f"{a.repeats} alternating:")
    print(f"  per layer          {per:7.2f} s  ({', '.join(f'{t:.2f}' for t in times[0])})  MLX peak "
          f"{peaks[0] / 1e9:.3f} GB")
    print(f"  {a.segments} segments         {seg:7.2f} s  ({', '.join(f'{t:.2f}' for t in times[a.segments])})  "
          f"MLX peak {peaks[a.segments] / 1e9:.3f} GB")
    print(f"  segments / per layer: {seg / per:.3f}x the time; MLX peak {(peaks[0] - peaks[a.segments]) / 1e9:.3f} "
          f"GB lower, the naive count of the inputs no longer kept {naive / 1e9:.3f} GB "
          f"({a.layers} -> {kept_inputs(a.layers, a.segments)} layer inputs of {a.tokens} x {width} float32)")
    print(f"  same losses: {losses[0] == losses[a.segments]}")


if __name__ == "__main__":
    main()
