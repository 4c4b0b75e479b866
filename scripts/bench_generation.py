"""Prompt sharing, measured: generation with one prefill per prompt whose keys / values its G samples
read from one copy (`SharedPrefixCache`), vs a prefill per sample and vs one prefill whose cache is then
repeated G times along the batch (what `generate` did before the shared cache); and the prompt-shared
training forward+backward (P + G*C tokens) vs the repeated one (G*(P+C) tokens), on the tiny default
model and a larger random Qwen3-VL config.

    python scripts/bench_generation.py [--prompts 2] [--G 8] [--prompt-len 256] [--completion-len 64]
                                       [--sizes default larger] [--repeats 2]

Prompts are VL prompts (one image each, filler text up to about --prompt-len tokens, lengths
differing by 16 so that left padding matters). Generation samples at temperature 1 with no stop
token, so every row runs --completion-len steps; tokens/s counts the P*G*C generated tokens. The
training step is `nn.value_and_grad` of sum(w * logp) over all parameters (logp from the streamed
head, temperature 1). Peak = `mx.get_peak_memory()` after `mx.reset_peak_memory()`, minus the
model's weights; time = best of --repeats after a warm-up. float32. Each configuration runs in a
fresh subprocess.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

LARGER = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
              num_key_value_heads=4, head_dim=64)

CHILD = r"""
import json, sys, time
import numpy as np
import mlxrl
mlxrl.runtime.setup()  # the CPU buffer cache, as the trainers set it
import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from PIL import Image
from mlxrl.generation.engine import generate
from mlxrl.generation.shared_prompt import repeated_logprobs, shared_prompt_logprobs
from mlxrl.loading import load_default, init_weights
from mlxrl.models import build_model

size, method, P, G, Lp, C, reps, larger = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:8]), json.loads(sys.argv[8])
model, processor = load_default(seed=0, dtype="float32")
if size == "larger":
    cfg = json.loads(mlxrl.loading.DEFAULT_CONFIG.read_text()); cfg.pop("preprocessor_config")
    cfg["text_config"].update(larger)
    hd = larger["head_dim"]
    cfg["text_config"]["rope_parameters"]["mrope_section"] = [hd // 2 - 2 * (hd // 6), hd // 6, hd // 6]
    cfg["vision_config"]["out_hidden_size"] = larger["hidden_size"]
    mx.random.seed(0)
    model = build_model(cfg)
    init_weights(model, 0.02, 0.1)
    mx.eval(model.parameters()); model.eval()
weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
n_params = sum(v.size for _, v in tree_flatten(model.parameters()))

def render(words):
    content = [{"type": "image"}, {"type": "text", "text": " ".join(words)}]
    return processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)

def prompt(i, target):
    img = Image.new("RGB", (96, 96), (40 * i % 255, 90, 200))
    words = ("describe the colour and the shape of what you see in this picture " * 200).split()
    over = processor(text=[render(words)], images=[[img]])["input_ids"].shape[1] - target
    while over > 0:  # cut the filler until the row has about `target` tokens
        words = words[:-max(1, over // 2)]
        over = processor(text=[render(words)], images=[[img]])["input_ids"].shape[1] - target
    return render(words), img

rows = [prompt(i, Lp - 16 * i) for i in range(P)]
batch = processor(text=[r[0] for r in rows], images=[[r[1]] for r in rows], padding_side="left")
imgs = dict(pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"])

if method == "gen_repeated_cache":  # the prompt prefilled once, its cache then repeated G times along the batch
    from mlx_lm.models.cache import KVCache
    import mlxrl.generation.engine as generation

    def repeated_cache(keys, values, group):
        c = KVCache()
        c.update_and_fetch(mx.repeat(keys, group, axis=0), mx.repeat(values, group, axis=0))
        return c
    generation.SharedPrefixCache = repeated_cache

def run():
    if method in ("gen_shared", "gen_per_sample", "gen_repeated_cache"):
        out = generate(model, **batch, num_generations=G, max_tokens=C, temperature=1.0, stop_token_ids=[],
                       seed=0, shared_prefill=method != "gen_per_sample")
        mx.eval(out.completion_ids)
        return out.completion_ids.size
    fn = shared_prompt_logprobs if method == "train_shared" else repeated_logprobs
    rng = np.random.default_rng(0)
    cids = mx.array(rng.integers(0, 151000, (P * G, C)).astype(np.int32))
    cmask = mx.ones((P * G, C), dtype=mx.int32)
    w = mx.array(rng.standard_normal((P * G, C)).astype(np.float32))
    def loss():
        return (w * fn(model, batch["input_ids"], batch["attention_mask"], cids, cmask, **imgs)).sum()
    value, grads = nn.value_and_grad(model, loss)()
    mx.eval(value, grads)
    return P * G * C

run()  # warm-up
mx.clear_cache()
mx.reset_peak_memory()
times = []
for _ in range(reps):
    t0 = time.perf_counter(); tokens = run(); times.append(time.perf_counter() - t0)
print(json.dumps({"time": min(times), "tokens": tokens, "peak": mx.get_peak_memory() - weights,
                  "params": n_params, "prompt_len": int(batch["input_ids"].shape[1])}))
"""


def measure(size, method, args):
    cmd = [sys.executable, "-c", CHILD, size, method, str(args.prompts), str(args.G), str(args.prompt_len),
           str(args.completion_len), str(args.repeats), json.dumps(LARGER)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{size} {method} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--G", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--completion-len", type=int, default=64)
    ap.add_argument("--sizes", nargs="+", default=["default", "larger"], choices=["default", "larger"])
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args(argv)
    print(f"P={args.prompts} prompts (VL, one image each) x G={args.G}, prompt ~{args.prompt_len} tokens, "
          f"completion {args.completion_len} tokens, float32")
    print(f"{'model':<22} {'what':<37} {'time s':>8} {'tok/s':>9} {'peak MB':>9} {'time x':>7} {'peak x':>7}")
    for size in args.sizes:
        groups = [("generation", [("per sample", "gen_per_sample"), ("prompt cache repeated", "gen_repeated_cache"),
                                  ("shared prompt", "gen_shared")]),
                  ("train fwd+bwd", [("per sample", "train_repeated"), ("shared prompt", "train_shared")])]
        for what, methods in groups:
            runs = [(f"{what}: {name}", measure(size, m, args)) for name, m in methods]
            base = runs[0][1]
            label = f"{size} ({base['params'] / 1e6:.0f}M)"
            for name, r in runs:
                tx, px = r["time"] / base["time"], r["peak"] / max(base["peak"], 1)
                print(f"{label:<22} {name:<37} {r['time']:8.2f} {r['tokens'] / r['time']:9.1f} "
                      f"{r['peak'] / 2**20:9.1f} {tx:7.2f} {px:7.2f}", flush=True)


if __name__ == "__main__":
    main()
