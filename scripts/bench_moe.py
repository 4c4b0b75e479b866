"""The mixture-of-experts layer alone, LoRA on the experts, forward + backward: mlxrl against mlx-lm's `SwitchGLU`
with its `LoRASwitchLinear` and against transformers' `Qwen3MoeExperts` with PEFT's `target_parameters` LoRA
under torch autograd, side by side in one run (each side in its own process, one after another).

Qwen3-30B-A3B's widths by default: 128 experts, top 8, hidden 2048, expert width 768; T tokens of one row. Every
side gets the same routing (the top 8 of the same random router logits, normalised) and the same float32 weights,
LoRA r = 8 on both expert parameters (gate and up, down), the frozen experts float32; the step is the expert
layer's forward and the gradients of sum(y * c) (c a fixed random cotangent) for the input and the adapters.

Sides: `ours` (mlxrl's `LoRAExperts`: on float32 CPU arrays one BLAS GEMM per expert over its sorted rows,
`cpu/native/experts.cpp`), `ours_graph` (the same module on MLX's `gather_mm`: the graph path Metal and CUDA
run), `mlxlm` (mlx-lm 0.32's SwitchGLU over `gather_mm`, LoRA on its three SwitchLinear layers), `torch` (PEFT
0.21's LoRA on transformers 5.24's experts: a loop over the hit experts, the per-expert update materialised).
Printed per side: median seconds of `--repeats` steps after one warm-up step, GFLOP/s (the experts' model FLOPs:
6 M D I per pass, 3 passes for forward + backward, LoRA's thin matmuls not counted), and the peak resident memory
above the side's inputs and weights (VmHWM after VmRSS is reset, `/proc/self/clear_refs`); then ratios to ours.

    python scripts/bench_moe.py                          # T = 4096, every side
    python scripts/bench_moe.py --tokens 512 --experts 16 --sides ours torch    # quick

`--step`: instead, one LoRA step of a `--layers`-layer Qwen3-MoE model at Qwen3-30B-A3B's shape (hidden 2048, 32 / 4
heads of 128, the widths above, untied `--vocab` 151936) whose weights hold bfloat16 values, as a LoRA run over the
Hub's bfloat16 checkpoint loads it under float32 compute: the linears and the embedding kept bfloat16
(`models.widened`), the expert stacks either float32 (`widened`: widened on load, as before they were kept) or kept
bfloat16 too (`kept`: the native kernel widens one expert's matrix at a time; `kept_whole`: the whole stack widened
per call and tied to it, what the graph path does, here before the native float32 kernel). `*_graph` sides run
MLX's ops (MLXRL_NATIVE=0). LoRA r`--rank` (alpha 2r) on the four attention projections and both expert parameters,
gradient checkpointing per layer, the step compiled as the engine compiles it; the loss is the mean square of the
last hidden state (the head is the same on every side). Printed per side: MLX's peak over the step (weights
included: mx.get_peak_memory after mx.reset_peak_memory, over a warm-up step and a timed one), the weights' bytes
before it, and the timed step's seconds.

    python scripts/bench_moe.py --step --tokens 512 --sides widened kept kept_whole widened_graph kept_graph
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIDES = ("ours", "ours_graph", "mlxlm", "torch")
STEP_SIDES = ("widened", "kept", "kept_whole", "widened_graph", "kept_graph")


def rss(field: str) -> float:
    """VmRSS / VmHWM of this process, GB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024 / 1e9
    return float("nan")


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # Linux: VmHWM := VmRSS


def data(a):
    """The shared inputs as numpy (seeded): x, routing indices and weights, expert weights, cotangent."""
    import numpy as np

    rng = np.random.default_rng(0)
    T, D, W, E, k = a.tokens, a.hidden, a.width, a.experts, a.top_k
    x = rng.normal(0, 1, (T, D)).astype(np.float32)
    logits = rng.normal(0, 1, (T, E)).astype(np.float32)
    idx = np.argsort(-logits, axis=-1)[:, :k]
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p = p / p.sum(-1, keepdims=True)
    wts = np.take_along_axis(p, idx, -1)
    wts = (wts / wts.sum(-1, keepdims=True)).astype(np.float32)
    gate_up = rng.normal(0, 0.02, (E, 2 * W, D)).astype(np.float32)
    down = rng.normal(0, 0.02, (E, D, W)).astype(np.float32)
    cot = rng.normal(0, 1, (T, D)).astype(np.float32)
    return x, idx.astype(np.int64), wts, gate_up, down, cot


def run_mlx(a, side: str) -> dict:
    import mlxrl  # noqa: F401, I001  (the fast BLAS before mlx.core)
    import mlx.core as mx

    if side == "ours_graph":
        from mlxrl.cpu import native

        native.load = lambda: None  # MLXRL_NATIVE=0 for this process: MLX's gather_mm
    x, idx, wts, gate_up, down, cot = (mx.array(v) for v in data(a))
    if side in ("ours", "ours_graph"):
        from mlxrl.models.lora_experts import LoRAExperts
        from mlxrl.models.moe import Experts

        base = Experts(a.experts, a.hidden, a.width)
        base.update({"gate_up_proj": gate_up, "down_proj": down})
        layer = LoRAExperts(base, ("gate_up_proj", "down_proj"), a.rank, 2.0)
        layer.base.freeze()

        def forward(x):
            return layer(x, wts, idx.astype(mx.uint32))
    else:
        from mlx_lm.models.switch_layers import SwitchGLU
        from mlx_lm.tuner.lora import LoRASwitchLinear

        layer = SwitchGLU(a.hidden, a.width, a.experts)
        layer.gate_proj.weight, layer.up_proj.weight = gate_up[:, : a.width], gate_up[:, a.width:]
        layer.down_proj.weight = down
        layer.freeze()
        for name in ("gate_proj", "up_proj", "down_proj"):
            setattr(layer, name, LoRASwitchLinear.from_base(getattr(layer, name), r=a.rank, scale=2.0))

        def forward(x):
            return (layer(x, idx.astype(mx.uint32)) * wts[..., None]).sum(axis=-2)

    def loss(params, x):
        layer.update(params)
        return (forward(x) * cot).sum()

    step = mx.grad(loss, argnums=(0, 1))
    params = layer.trainable_parameters()
    mx.eval(x, idx, wts, cot, params, layer.parameters())
    base_rss = rss("VmRSS")
    times, peak = [], 0.0
    for i in range(a.repeats + 1):
        mx.clear_cache()
        reset_peak()
        t0 = time.perf_counter()
        g = step(params, x)
        mx.eval(g)
        dt = time.perf_counter() - t0
        peak = max(peak, rss("VmHWM") - base_rss)
        if i:
            times.append(dt)
        del g
    return {"times": times, "peak_gb": peak}


def run_torch(a) -> dict:
    import peft
    import torch
    import transformers

    torch.set_num_threads(os.cpu_count() or 1)
    x, idx, wts, gate_up, down, cot = (torch.from_numpy(v) for v in data(a))
    cfg = transformers.Qwen3MoeConfig(hidden_size=a.hidden, moe_intermediate_size=a.width, num_experts=a.experts,
                                      num_experts_per_tok=a.top_k, num_hidden_layers=1, num_attention_heads=1,
                                      num_key_value_heads=1, vocab_size=8)

    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeExperts(cfg)

    holder = Holder()
    with torch.no_grad():
        holder.experts.gate_up_proj.copy_(gate_up)
        holder.experts.down_proj.copy_(down)
    lora = peft.LoraConfig(r=a.rank, lora_alpha=2 * a.rank, target_modules=[], lora_dropout=0.0,
                           target_parameters=["experts.gate_up_proj", "experts.down_proj"])
    model = peft.get_peft_model(holder, lora)
    xg = x.clone().requires_grad_(True)
    base_rss = rss("VmRSS")
    times, peak = [], 0.0
    for i in range(a.repeats + 1):
        model.zero_grad()
        xg.grad = None
        reset_peak()
        t0 = time.perf_counter()
        y = model.base_model.model.experts(xg, idx, wts)
        (y * cot).sum().backward()
        dt = time.perf_counter() - t0
        peak = max(peak, rss("VmHWM") - base_rss)
        if i:
            times.append(dt)
        del y
    return {"times": times, "peak_gb": peak}


def run_step(a, side: str) -> dict:
    """One compiled, checkpointed LoRA step of the `--step` model (see the module docstring) on `side`."""
    import mlxrl  # noqa: F401, I001  (the fast BLAS before mlx.core)
    import mlx.core as mx
    import mlx.nn as nn
    import numpy as np
    from mlx.utils import tree_flatten, tree_unflatten

    from mlxrl.models import build_model, widened
    from mlxrl.models.lora import apply_lora

    if side.endswith("_graph"):
        from mlxrl.cpu import native

        native.load = lambda: None  # MLXRL_NATIVE=0 for this process
    if side == "kept_whole":  # the whole stack widened per call (tied), then the native float32 kernel
        widened.widened_gathered = widened.widened_stack_product
    cfg = dict(model_type="qwen3_moe", vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=6144,
               num_hidden_layers=a.layers, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
               num_experts=a.experts, num_experts_per_tok=a.top_k, moe_intermediate_size=a.width,
               norm_topk_prob=True, tie_word_embeddings=False, rms_norm_eps=1e-6)
    model = build_model(cfg)
    keep_stacks = side.startswith("kept")
    mx.random.seed(0)
    kept = {}
    for k, v in tree_flatten(model.parameters()):  # one parameter at a time: no float32 copy of the whole model
        if k.endswith("norm.weight"):
            continue
        w = (mx.random.normal(v.shape) * 0.02).astype(mx.bfloat16)
        stack = k.endswith(("experts.gate_up_proj", "experts.down_proj"))
        # the router is a plain float32 linear (not `keepable`); the stacks float32 unless kept
        if k.endswith("mlp.gate.weight") or (stack and not keep_stacks):
            w = w.astype(mx.float32)
        else:
            kept[k] = w
        mx.eval(w)
        model.update(tree_unflatten([(k, w)]))
    widened.keep_linears(model, kept)
    apply_lora(model, r=a.rank, alpha=2 * a.rank, dropout=0.0)
    model.language_model.set_checkpointing(True)
    mx.eval(model.parameters())
    narrow = sum(v.nbytes for _, v in tree_flatten(model.parameters()) if v.dtype == mx.bfloat16)
    ids = mx.array(np.random.default_rng(0).integers(0, a.vocab, (1, a.tokens)))

    def loss(ids):
        h = model(input_ids=ids, return_hidden=True)
        return (h.astype(mx.float32) ** 2).mean()

    grad = mx.compile(nn.value_and_grad(model, loss), inputs=[model.state], outputs=[model.state])
    peaks, times = [], []
    for _ in range(1 + a.repeats):  # the first step compiles: its time is left out, not its peak
        mx.synchronize()
        mx.clear_cache()
        weights = mx.get_active_memory()
        mx.reset_peak_memory()
        t0 = time.perf_counter()
        value, grads = grad(ids)
        mx.eval(value, grads)
        times.append(time.perf_counter() - t0)
        peaks.append(mx.get_peak_memory())
        del grads
    return {"peak_gb": max(peaks) / 1e9, "weights_gb": weights / 1e9, "bf16_gb": narrow / 1e9,
            "seconds": sorted(times[1:])[len(times[1:]) // 2] if a.repeats else times[0], "loss": float(value)}


def child(a) -> None:
    if a.step:
        out = run_step(a, a.side)
    else:
        out = run_torch(a) if a.side == "torch" else run_mlx(a, a.side)
    print("RESULT " + json.dumps(out), flush=True)


def main_step(a) -> None:
    print(f"Qwen3-MoE LoRA step, {a.layers} layers at Qwen3-30B-A3B's shape ({a.experts} experts, top {a.top_k}, "
          f"hidden {a.hidden}, width {a.width}, vocab {a.vocab}), {a.tokens} tokens, float32 compute over bfloat16 "
          f"weights, LoRA r{a.rank}, checkpointed, compiled; a warm-up step and a timed one per side, each in its own "
          "process", flush=True)
    results = {}
    for side in a.sides:
        cmd = [sys.executable, __file__, "--step", "--side", side, *sum(([f"--{k}", str(getattr(a, k))] for k in
               ("tokens", "experts", "top_k", "hidden", "width", "rank", "layers", "vocab", "repeats")), [])]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-2:]
            print(f"  {side:14s} failed (exit {proc.returncode}): {' | '.join(tail)}", flush=True)
            continue
        r = results[side] = json.loads(line[len("RESULT "):])
        print(f"  {side:14s} MLX peak {r['peak_gb']:6.2f} GB   weights {r['weights_gb']:6.2f} GB (bfloat16 "
              f"{r['bf16_gb']:5.2f})   step {r['seconds']:7.2f} s   loss {r['loss']:.6f}", flush=True)
    for base, side in (("widened", "kept"), ("widened", "kept_whole"), ("widened_graph", "kept_graph")):
        if base in results and side in results:
            b, r = results[base], results[side]
            print(f"  {side} against {base}: peak {r['peak_gb'] - b['peak_gb']:+.2f} GB "
                  f"({r['peak_gb'] / b['peak_gb']:.2f}x), step {r['seconds'] / b['seconds']:.2f}x the time", flush=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top_k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--width", type=int, default=768, help="each expert's intermediate width")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--step", action="store_true", help="a LoRA step of a --layers-layer model, stacks kept vs "
                                                         "widened (see the module docstring)")
    p.add_argument("--layers", type=int, default=4, help="--step: decoder layers")
    p.add_argument("--vocab", type=int, default=151936, help="--step: vocabulary")
    p.add_argument("--sides", nargs="+", choices=SIDES + STEP_SIDES, default=None)
    p.add_argument("--side", choices=SIDES + STEP_SIDES, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.side:
        return child(a)
    if a.step:
        a.sides = a.sides or ["widened", "kept", "kept_whole"]
        a.repeats = min(a.repeats, 1)  # a warm-up step and one timed: a step at this shape takes a while
        return main_step(a)
    a.sides = a.sides or list(SIDES)
    flops = 3 * 6 * a.tokens * a.top_k * a.hidden * a.width / 1e9
    print(f"MoE expert layer, LoRA r{a.rank} on both expert parameters: {a.experts} experts, top {a.top_k}, hidden "
          f"{a.hidden}, width {a.width}, {a.tokens} tokens, float32 CPU; forward + backward {flops:.1f} GFLOP; "
          f"median of {a.repeats} after a warm-up", flush=True)
    results = {}
    for side in a.sides:
        cmd = [sys.executable, __file__, "--side", side, *sum(([f"--{k}", str(getattr(a, k))] for k in
               ("tokens", "experts", "top_k", "hidden", "width", "rank", "repeats")), [])]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-2:]
            print(f"  {side:10s} failed (exit {proc.returncode}): {' | '.join(tail)}", flush=True)
            continue
        r = json.loads(line[len("RESULT "):])
        r["median"] = sorted(r["times"])[len(r["times"]) // 2]
        results[side] = r
        print(f"  {side:10s} {r['median']:8.2f} s  {flops / r['median']:6.1f} GFLOP/s  peak above inputs "
              f"{r['peak_gb']:6.2f} GB   ({', '.join(f'{t:.2f}' for t in r['times'])})", flush=True)
    if "ours" in results:
        o = results["ours"]
        for side, r in results.items():
            if side != "ours":
                print(f"  ours / {side}: {r['median'] / o['median']:.2f}x faster, "
                      f"{o['peak_gb'] / max(r['peak_gb'], 1e-9):.2f}x the peak", flush=True)


if __name__ == "__main__":
    main()
