"""The graph path (what Metal and CUDA run: MLX's ops and mlxrl's MLX-graph versions) against the native CPU
path, side by side in one run, float32 so that both compute the same thing (issue 67's targets):

- each Qwen3.5 layer kind's training step (`bench_layer_memory.layer_peak`: two layers of one kind, LoRA r16,
  checkpointed, tiled MLP, compiled) at each length: MLX's peak above the weights on both paths, the ratio
  graph / native and the growth per doubling of the length;
- the delta rule's primitives per 64-token chunk: the nodes of one value_and_grad of `gated_delta_rule` on the
  graph path (`mx.export_to_dot`) at two lengths, their difference over the added chunks;
- with `--step`: a whole training step as the SFT trainer runs it (`scripts/bench_scale.py`'s own side: a
  4-layer cut of the real shape, random float32 weights, LoRA r16 on every linear, checkpointing, one row,
  compiled, two steps), MLX's peak (weights included) on both paths and their ratio.

Each figure comes from its own subprocess (MLXRL_NATIVE=0 for the graph path), so one run's cache and peak
never reach the next.

    python scripts/bench_graph_path.py                                   # 0.8B widths, 2048 4096 8192 tokens
    python scripts/bench_graph_path.py --kinds attention --tokens 1024 2048
    python scripts/bench_graph_path.py --kinds --step --step_shapes qwen3.5-0.8b qwen3-0.6b --tokens 4096 8192
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent

LAYER = """
import json, sys
sys.path.insert(0, {here!r})
import mlxrl
from mlxrl.models import attention
if {untiled}:
    attention.TILE_BYTES = 2 ** 62  # the dense scores, as the graph path ran before its tiled attention
import bench_layer_memory
base, peak = bench_layer_memory.layer_peak({shape!r}, {kind!r}, {tokens})
print(json.dumps({{"base": base, "peak": peak}}))
"""

PRIMITIVES = """
import json, os, tempfile
import mlxrl
import mlx.core as mx
from mlxrl.cpu import native
from mlxrl.models.gated_delta import gated_delta_rule
native.load = lambda: None  # the graph path

def count(T, H=4, d=32):
    mx.random.seed(0)
    q, k = (mx.random.normal((1, T, H, d)) for _ in range(2))
    v = mx.random.normal((1, T, H, d))
    g = -mx.random.uniform(0.01, 1.0, (1, T, H))
    beta = mx.random.uniform(0.1, 0.9, (1, T, H))
    def loss(q, k, v, g, beta):
        out, final = gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
        return out.sum() + final.sum()
    value, grads = mx.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))(q, k, v, g, beta)
    path = os.path.join(tempfile.mkdtemp(), "graph.dot")
    mx.export_to_dot(path, value, *grads)
    return sum(1 for line in open(path) if "shape=rectangle" in line)  # one line per primitive

a, b = {lengths}
ca, cb = count(a), count(b)
print(json.dumps({{"counts": [ca, cb], "per_chunk": (cb - ca) / ((b - a) / 64)}}))
"""


def child(code: str, graph: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "MLXRL_NATIVE"}
    if graph:
        env["MLXRL_NATIVE"] = "0"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    if res.returncode:
        raise SystemExit(res.stderr[-3000:])
    return json.loads(res.stdout.strip().splitlines()[-1])


def whole_step(shape: str, tokens: int, graph: bool, layers: int) -> dict:
    """bench_scale's "ours" side for one SFT LoRA run on one path: its MLX peak, losses and seconds a step."""
    env = {k: v for k, v in os.environ.items() if k != "MLXRL_NATIVE"}
    if graph:
        env["MLXRL_NATIVE"] = "0"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "step.json"
        cmd = [sys.executable, str(HERE / "bench_scale.py"), "--shapes", shape, "--layers", str(layers),
               "--modes", "lora", "--sides", "ours", "--max_length", str(tokens), "--steps", "1", "--warmup", "1",
               "--json", str(out)]
        res = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if res.returncode:
            raise SystemExit(res.stdout[-2000:] + res.stderr[-3000:])
        return json.loads(out.read_text())["sft"]["runs"][0]["sides"]["ours"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="0.8b")
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 4096, 8192])
    ap.add_argument("--kinds", nargs="*", default=["attention", "deltanet"])
    ap.add_argument("--primitives", type=int, nargs=2, default=[1024, 2048], metavar=("T1", "T2"))
    ap.add_argument("--untiled", action="store_true", help="also the graph path with the tiled attention off")
    ap.add_argument("--step", action="store_true", help="also a whole LoRA step per shape and length")
    ap.add_argument("--step_shapes", nargs="+", default=["qwen3.5-0.8b", "qwen3-0.6b"])
    ap.add_argument("--step_layers", type=int, default=4)
    a = ap.parse_args()
    print(f"Qwen3.5-{a.shape} widths, two layers of one kind, LoRA r16, checkpointed, tiled MLP, compiled, float32; "
          "MLX peak above the weights")
    print(f"{'kind':<10} {'tokens':>6} {'native GB':>10} {'graph GB':>9} {'graph/native':>12} {'growth':>7}"
          + ("  graph untiled GB" if a.untiled else ""))
    for kind in a.kinds:
        last = None
        for t in a.tokens:
            code = LAYER.format(here=str(HERE), shape=a.shape, kind=kind, tokens=t, untiled=False)
            nat, gra = child(code, graph=False)["peak"], child(code, graph=True)["peak"]
            growth = f"{gra / last:.2f}x" if last else "-"
            untiled = ""
            if a.untiled:
                off = child(LAYER.format(here=str(HERE), shape=a.shape, kind=kind, tokens=t, untiled=True), True)
                untiled = f"  {off['peak'] / 1e9:>16.3f}"
            print(f"{kind:<10} {t:>6} {nat / 1e9:>10.3f} {gra / 1e9:>9.3f} {gra / nat:>11.2f}x {growth:>7}{untiled}",
                  flush=True)
            last = gra
    if "deltanet" in a.kinds:
        out = child(PRIMITIVES.format(lengths=tuple(a.primitives)), graph=True)
        print(f"delta rule, graph path, one value_and_grad: {out['counts'][0]} primitives at T={a.primitives[0]}, "
              f"{out['counts'][1]} at T={a.primitives[1]}: {out['per_chunk']:.1f} per 64-token chunk")


    if a.step:
        print(f"whole SFT step, {a.step_layers} layers, LoRA r16, checkpointed, one row, compiled, float32; MLX peak "
              "with the weights")
        print(f"{'shape':<14} {'tokens':>6} {'native GB':>10} {'graph GB':>9} {'graph/native':>12} "
              f"{'native s':>9} {'graph s':>8}  losses native / graph")
        for shape in a.step_shapes:
            for t in a.tokens:
                nat, gra = (whole_step(shape, t, g, a.step_layers) for g in (False, True))
                print(f"{shape:<14} {t:>6} {nat['mlx_peak_gb']:>10.3f} {gra['mlx_peak_gb']:>9.3f} "
                      f"{gra['mlx_peak_gb'] / nat['mlx_peak_gb']:>11.2f}x {nat['s_per_step']:>9.1f} "
                      f"{gra['s_per_step']:>8.1f}  {[round(x, 4) for x in nat['loss']]} / "
                      f"{[round(x, 4) for x in gra['loss']]}", flush=True)


if __name__ == "__main__":
    main()
