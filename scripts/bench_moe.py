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


def child(a) -> None:
    out = run_torch(a) if a.side == "torch" else run_mlx(a, a.side)
    print("RESULT " + json.dumps(out), flush=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top_k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--width", type=int, default=768, help="each expert's intermediate width")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES))
    p.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.side:
        return child(a)
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
