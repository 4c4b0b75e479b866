"""Quantized base (QLoRA) measurements on this machine: matmul speed, weight memory, a LoRA step.

    python scripts/bench_quant.py matmul          # fp32 BLAS vs mx.quantized_matmul vs our CPU layer
    python scripts/bench_quant.py memory          # weight bytes of real Qwen shapes per quantization choice
    python scripts/bench_quant.py step --layers 28 --seq 128   # LoRA step, Qwen3-0.6B shape: float / 4-bit / mlx-lm
    python scripts/bench_quant.py accuracy --max_steps 60      # held-out accuracy per choice of what to quantize

`matmul`: [M, K] x [K, N] at K=1024, N=3072 (a 0.6B-model MLP), M rows from 1 (decoding) to 512
(training), 4- and 8-bit, group 64. `memory`: analytic bytes (nothing is allocated) of Qwen3-0.6B,
Qwen3-VL-2B and Qwen3-8B in bfloat16 and with each choice of what to quantize (16-bit scales).
`step`: random weights of the Qwen3-0.6B shape (`--layers` of its 28), one LoRA (r 16, all
decoder linears) training step (forward + backward + Adam, compiled, cross-entropy over full logits),
float32 base, our 4-bit base (decoder linears) and mlx-lm's QLoRA (its `nn.quantize` of the same
float weights, embedding and head included, and its LoRA layers): median seconds per step.
`accuracy`: the embedded SFT demo (tiny Qwen3-VL, synthetic VQA, `python -m mlxrl.sft --load_in_4bit`'s
settings, `--max_steps` LoRA steps) over each choice of base: float32, 8-bit, 4-bit decoder linears
(the default) with group 32 / 64 / 128, 4-bit plus the vision tower, 4-bit plus the embedding / head
(rounded to the 4-bit grid and back: the numbers a quantized head computes with); the base's logit
error on held-out rows (relative, against float32) and the held-out exact match before and after.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlxrl  # noqa: E402,F401,I001  (the fast BLAS before mlx.core)
import mlx.core as mx  # noqa: E402,I001
import mlx.nn as nn  # noqa: E402,I001

QWEN3_06B = {"model_type": "qwen3", "vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072,
             "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
             "tie_word_embeddings": True, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0}
QWEN3_8B = {**QWEN3_06B, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
            "num_attention_heads": 32, "tie_word_embeddings": False}
QWEN3_VL_2B = {"model_type": "qwen3_vl", "tie_word_embeddings": True,
               "text_config": {**QWEN3_06B, "model_type": "qwen3_vl_text", "hidden_size": 2048,
                               "intermediate_size": 6144,
                               "rope_parameters": {"rope_type": "default", "rope_theta": 5e6,
                                                   "mrope_section": [24, 20, 20], "mrope_interleaved": True}},
               "vision_config": {"depth": 24, "hidden_size": 1024, "intermediate_size": 4096, "num_heads": 16,
                                 "out_hidden_size": 2048, "patch_size": 16, "spatial_merge_size": 2,
                                 "temporal_patch_size": 2, "num_position_embeddings": 2304,
                                 "deepstack_visual_indexes": [5, 11, 17], "in_channels": 3}}


def timed(f, seconds=1.0):
    mx.eval(f())
    t, n = time.perf_counter(), 0
    while time.perf_counter() - t < seconds or n < 2:
        mx.eval(f())
        n += 1
    return (time.perf_counter() - t) / n


def bench_matmul(_args):
    from mlxrl.models.quantize import QuantizedLinear

    K, N = 1024, 3072
    print(f"[M, {K}] x [{K}, {N}], GFLOP/s (2 M K N / time)")
    print(f"{'M':>5} {'fp32 BLAS':>10} {'q4 MLX':>8} {'q4 ours':>8} {'q8 MLX':>8} {'q8 ours':>8}")
    mx.random.seed(0)
    lin = nn.Linear(K, N, bias=False)
    layers = {b: QuantizedLinear.of(nn.QuantizedLinear.from_linear(lin, 64, b)) for b in (4, 8)}
    for M in (1, 8, 64, 512):
        x = mx.random.normal((M, K))
        row = [timed(lambda x=x: lin(x))]
        for b in (4, 8):
            q = layers[b]
            row.append(timed(lambda x=x, q=q: mx.quantized_matmul(x, q.weight, q.scales, q.biases, transpose=True,
                                                                   group_size=64, bits=q.bits)))
            row.append(timed(lambda x=x, q=q: q(x)))
        widths = (10, 8, 8, 8, 8)
        print(f"{M:>5} " + " ".join(f"{2 * M * K * N / t / 1e9:>{w}.1f}" for t, w in zip(row, widths, strict=True)))


def _bytes(cfg, *, bits=None, group=64, embed=False, vision=False):
    """Weight bytes of `cfg` in bfloat16, with the chosen layers quantized (16-bit scales + offsets)."""
    from mlx.utils import tree_flatten

    from mlxrl.models import build_model
    from mlxrl.models.quantize import _is_vision

    model = build_model(cfg)  # lazy: nothing is allocated
    total = 0
    linears = {p for p, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Embedding))}
    for name, v in tree_flatten(model.parameters()):
        owner = name.rsplit(".", 1)[0]
        quantize = bits is not None and owner in linears and name.endswith(".weight") and v.ndim == 2 and \
            v.shape[-1] % group == 0 and (embed or not (owner == "lm_head" or owner.endswith("embed_tokens"))) and \
            (vision or not _is_vision(owner))
        total += v.size * bits // 8 + 2 * 2 * v.size // group if quantize else v.size * 2
    return total


def bench_memory(_args):
    rows = [("bfloat16", {}), ("4-bit decoder linears (default)", {"bits": 4}),
            ("4-bit + embedding / head", {"bits": 4, "embed": True}),
            ("4-bit + vision tower", {"bits": 4, "vision": True}),
            ("4-bit everything", {"bits": 4, "embed": True, "vision": True}),
            ("8-bit decoder linears", {"bits": 8})]
    names = [("Qwen3-0.6B", QWEN3_06B), ("Qwen3-VL-2B", QWEN3_VL_2B), ("Qwen3-8B", QWEN3_8B)]
    print(f"{'weights, GB':<34}" + "".join(f"{n:>13}" for n, _ in names))
    for label, kw in rows:
        print(f"{label:<34}" + "".join(f"{_bytes(c, **kw) / 1e9:>13.2f}" for _, c in names))


def bench_step(args):
    import numpy as np
    from mlx.utils import tree_flatten
    from mlx_lm.models import qwen3 as mlx_lm_qwen3
    from mlx_lm.tuner.utils import linear_to_lora_layers

    from mlxrl.loading import init_weights
    from mlxrl.models import build_model, lora
    from mlxrl.models.quantize import quantize_model, weight_stats

    cfg = {**QWEN3_06B, "num_hidden_layers": args.layers}
    mx.random.seed(0)
    ids = mx.array(np.random.default_rng(0).integers(0, 151000, (args.batch, args.seq + 1)))
    x, y = ids[:, :-1], ids[:, 1:]

    def ours(bits):
        model = build_model(cfg)
        init_weights(model)
        mx.eval(model.parameters())
        if bits:
            quantize_model(model, bits, 64)
        lora.apply_lora(model, r=16, alpha=32, dropout=0.0)
        return model, weight_stats(model)["total_bytes"], lambda m: m(input_ids=x)

    def mlx_lm_q4():
        float_model, _, _ = ours(None)
        lora.merge_lora(float_model)
        model = mlx_lm_qwen3.Model(mlx_lm_qwen3.ModelArgs(**{**cfg, "max_position_embeddings": 4096}))
        model.load_weights(list(tree_flatten(float_model.parameters())), strict=True)
        nn.quantize(model, 64, 4)  # what mlx_lm.convert -q does: embedding and head too
        model.freeze()
        linear_to_lora_layers(model, args.layers, {"rank": 16, "scale": 2.0, "dropout": 0.0})
        mx.eval(model.parameters())
        size = sum(v.nbytes for k, v in tree_flatten(model.parameters()) if "lora" not in k)
        return model, size, lambda m: m(x)

    for name, build in [("float32 base", lambda: ours(None)), ("4-bit base (mlxrl)", lambda: ours(4)),
                        ("mlx-lm QLoRA (4-bit)", mlx_lm_q4)]:
        model, size, forward = build()

        times = _time_steps(model, forward, y, args.steps)
        print(f"{name:<24} weights {size / 1e9:.2f} GB, step {np.median(times[1:]):.2f} s "
              f"(first {times[0]:.2f} s), peak {mx.get_peak_memory() / 1e9:.2f} GB", flush=True)
        del model


def _time_steps(model, forward, targets, steps):
    """Seconds of each of `steps` compiled LoRA steps (forward + backward + Adam)."""
    import mlx.optimizers as optim

    def loss(m):
        return nn.losses.cross_entropy(forward(m).astype(mx.float32), targets).mean()

    opt = optim.Adam(learning_rate=1e-4)
    state = [model.state, opt.state]

    def update():
        value, grads = nn.value_and_grad(model, loss)(model)
        opt.update(model, grads)
        return value

    step = mx.compile(update, inputs=state, outputs=state)
    times = []
    mx.reset_peak_memory()
    for _ in range(steps):
        t = time.perf_counter()
        mx.eval(step(), state)
        times.append(time.perf_counter() - t)
    return times


def bench_accuracy(args):
    import tempfile

    import numpy as np

    from mlxrl import load_default
    from mlxrl.cli.common import apply_overrides
    from mlxrl.cli.sft import DEMO_OVERRIDES, DEMO_TEST, DEMO_TRAIN
    from mlxrl.data.synthetic import demo_rows
    from mlxrl.evaluate import _encode, exact_match
    from mlxrl.models.quantize import dequantize, quantize_model, weight_stats
    from mlxrl.trainers.flags import parse_config
    from mlxrl.trainers.sft.trainer import SFTConfig, SFTTrainer

    def head_rounded(model, bits=4, group=64):
        emb = model.language_model.embed_tokens
        q = mx.quantize(emb.weight, group_size=group, bits=bits)
        emb.weight = dequantize(*q, group_size=group, bits=bits, dtype=emb.weight.dtype)

    choices = [("float32 base", None, {}), ("8-bit decoder linears", 8, {}),
               ("4-bit decoder linears, group 32", 4, {"group_size": 32}),
               ("4-bit decoder linears (default)", 4, {}),
               ("4-bit decoder linears, group 128", 4, {"group_size": 128}),
               ("4-bit + vision tower", 4, {"vision": True}), ("4-bit + embedding / head", 4, {"head": True})]
    print(f"embedded SFT demo, LoRA, {args.max_steps} steps; held-out exact match, logit error vs float32")
    print(f"{'base':<34} {'weights MB':>10} {'bits/param':>10} {'logit err':>9} {'before':>7} {'after':>6}")
    reference = None
    for label, bits, kw in choices:
        with tempfile.TemporaryDirectory() as tmp:
            cfg = parse_config(SFTConfig, ["--use_peft", "--max_steps", str(args.max_steps), "--output_dir", tmp,
                                           "--disable_tqdm", "--logging_steps", str(args.max_steps)])
            apply_overrides(cfg, {"use_peft", "max_steps", "output_dir", "disable_tqdm", "logging_steps"},
                            DEMO_OVERRIDES)
            model, processor = load_default(seed=cfg.seed)
            if bits:
                quantize_model(model, bits, kw.get("group_size", 64), vision=kw.get("vision", False))
            if kw.get("head"):
                head_rounded(model)
            train = demo_rows(processor, DEMO_TRAIN, seed=cfg.seed, split="train")
            test = demo_rows(processor, DEMO_TEST, seed=cfg.seed + 1, split="test")
            batch, rows_at, pos, _ = _encode(processor, test[:16])  # the answers' positions
            inputs = {k: mx.array(v if v.dtype == np.float32 else v.astype(np.int32)) for k, v in batch.items()}
            hidden = model(**inputs, return_hidden=True)[mx.array(rows_at), mx.array(pos)]
            logits = model.apply_lm_head(hidden).astype(mx.float32)
            if reference is None:
                reference = logits
            err = float(mx.linalg.norm(logits - reference) / mx.linalg.norm(reference))
            before = exact_match(model, processor, test)
            SFTTrainer(model=model, processor=processor, args=cfg, train_dataset=train).train()
            after = exact_match(model, processor, test)
            stats = weight_stats(model)
            bpp = f"{stats['bits_per_param']:.2f}" if bits else "32"
            print(f"{label:<34} {stats['total_bytes'] / 1e6:>10.1f} {bpp:>10} {err:>9.2%} {before:>7.1%} "
                  f"{after:>6.1%}", flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=("matmul", "memory", "step", "accuracy"))
    p.add_argument("--layers", type=int, default=28, help="step: decoder layers of the 0.6B shape")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--max_steps", type=int, default=60, help="accuracy: LoRA steps of the embedded demo")
    args = p.parse_args(argv)
    {"matmul": bench_matmul, "memory": bench_memory, "step": bench_step,
     "accuracy": bench_accuracy}[args.what](args)


if __name__ == "__main__":
    main()
