"""The gated delta rule's forward + backward, side by side: ours (`mlxrl.models.gated_delta`, the chunked
op with its own VJP) on its two paths, "native" (the C++ kernel `mlxrl/cpu/native/gated_delta.cpp`, what
float32 CPU arrays take) and "graph" (the MLX-ops path, run here with MLXRL_NATIVE=0: what Metal, CUDA and
bf16 take); MLX's autograd of the same chunked forward (`custom_vjp=False`); mlx-vlm's `gated_delta_chunked`
(its Qwen3.5 training path off Metal) under MLX's autograd, when mlx-vlm is importable (its
`models/qwen3_5/gated_delta.py` is loaded on its own: the package's other dependencies are not needed); and
transformers' `torch_chunk_gated_delta_rule` under torch autograd (Qwen3.5's training path without
flash-linear-attention). Qwen3.5-0.8B's DeltaNet widths by default (16 key and 16 value heads of 128; with
more value heads than key heads, q and k serve Hv / Hk value heads each, as transformers' repeat_interleave),
q and k L2-normalised and q scaled as Qwen3.5 calls each (in the op for ours and torch; mlx-vlm's model does
it before the call, with its RMSNorm form, and passes the decay as exp(g)), float32, loss sum(out * w).

Each measurement runs in its own process, so peaks do not mix: the first step's peak resident memory above
the inputs (ru_maxrss minus the RSS before it; every side) and MLX's own peak (`mx.get_peak_memory` after
`mx.reset_peak_memory`, above the active memory before; MLX sides), then the median time of `--repeats`
further steps. Ratios are against the native path. MLX sides also count the primitives in one step's graph
(forward + backward, the nodes of `mx.export_to_dot`), per 64-token chunk: on a GPU each one that computes
is a kernel launch.

    python scripts/bench_gated_delta.py                                  # T = 4096 and 8192, Qwen3.5-0.8B
    python scripts/bench_gated_delta.py --lengths 2048 --heads 16 32     # Qwen3.5's default config widths
    python scripts/bench_gated_delta.py --sides native graph             # the two paths only
"""

import argparse  # noqa: I001  (mlxrl must come before mlx.core)
import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

SIDES = ("native", "graph", "mlx_autograd", "mlx_vlm", "torch")
LABELS = {"native": "ours, native", "graph": "ours, graph", "mlx_autograd": "MLX autograd", "mlx_vlm": "mlx-vlm",
          "torch": "torch"}


def _mlx_vlm_ops():
    """mlx-vlm's models/qwen3_5/gated_delta.py as a module of its own (it imports only mlx), or None."""
    spec = importlib.util.find_spec("mlx_vlm")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(spec.submodule_search_locations[0], "models", "qwen3_5", "gated_delta.py")
    if not os.path.exists(path):
        return None
    module_spec = importlib.util.spec_from_file_location("mlx_vlm_qwen3_5_gated_delta", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _max_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _inputs(np, a):
    rng = np.random.default_rng(0)
    (hk, hv), (dk, dv), B, T = a.heads, a.dims, a.batch, a.length
    f32 = np.float32
    return (rng.standard_normal((B, T, hk, dk), f32), rng.standard_normal((B, T, hk, dk), f32),
            rng.standard_normal((B, T, hv, dv), f32), -rng.uniform(0.01, 1.0, (B, T, hv)).astype(f32),
            rng.uniform(0.0, 1.0, (B, T, hv)).astype(f32), rng.standard_normal((B, T, hv, dv), f32))


def _primitives(mx, results) -> int:
    """The primitives in the (unevaluated) graph of one step's results: the nodes `mx.export_to_dot` writes
    (on a GPU each op that computes is a kernel launch)."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "step.dot")
        mx.export_to_dot(path, *_leaves(results))
        with open(path) as f:
            return f.read().count("shape=rectangle")


def _leaves(tree) -> list:
    return [x for t in tree for x in _leaves(t)] if isinstance(tree, (list, tuple)) else [tree]


def _worker(a) -> dict:
    import numpy as np

    arrays = _inputs(np, a)
    if a.worker == "torch":
        import torch
        from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

        *ins, w = (torch.from_numpy(x) for x in arrays)

        def step():
            leaves = [x.clone().requires_grad_(True) for x in ins]
            out, _ = torch_chunk_gated_delta_rule(*leaves, use_qk_l2norm_in_kernel=True)
            (out * w).sum().backward()
            return [x.grad for x in leaves]

        rss = _rss()
        start = time.perf_counter()
        step()
        first = time.perf_counter() - start
        result = {"rss_peak": max(_max_rss() - rss, 0), "mlx_peak": None}
    else:
        import mlxrl  # noqa: F401, I001  (the fast BLAS before mlx.core)
        import mlx.core as mx
        from mlxrl.models import gated_delta
        from mlxrl.models.gated_delta import gated_delta_rule

        *ins, w = (mx.array(x) for x in arrays)
        mx.eval(ins, w)

        if a.worker == "mlx_vlm":
            vlm = _mlx_vlm_ops()
            if vlm is None:
                raise SystemExit("mlx-vlm is not installed")
            dk = ins[0].shape[-1]

            def loss(q, k, v, g, beta):  # mlx-vlm's Qwen3.5 layer: its q / k normalisation, then the chunked rule
                q = dk ** -1.0 * mx.fast.rms_norm(q, None, 1e-6 / dk)
                k = dk ** -0.5 * mx.fast.rms_norm(k, None, 1e-6 / dk)
                out, _ = vlm.gated_delta_chunked(q, k, v, mx.exp(g), beta, None)
                return (out * w).sum()
        else:
            if a.worker in ("native", "graph"):
                took = gated_delta._path(*ins, mx.zeros((1,), mx.float32))
                if took != a.worker:
                    raise SystemExit(f"the op's dispatch took the {took} path, not {a.worker}")

            def loss(q, k, v, g, beta):
                out, _ = gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True,
                                          custom_vjp=a.worker != "mlx_autograd")
                return (out * w).sum()

        grad = mx.value_and_grad(loss, argnums=list(range(5)))

        def step():
            result = grad(*ins)
            mx.eval(result)
            return result

        rss, base = _rss(), mx.get_active_memory()
        mx.reset_peak_memory()
        start = time.perf_counter()
        step()
        first = time.perf_counter() - start
        result = {"rss_peak": max(_max_rss() - rss, 0), "mlx_peak": mx.get_peak_memory() - base,
                  "primitives": _primitives(mx, grad(*ins)) / -(-a.length // 64)}
    times = []
    for _ in range(a.repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    result["time"] = statistics.median(times) if times else first
    result["first"] = first
    return result


def _measure(side: str, a) -> dict:
    cmd = [sys.executable, __file__, "--worker", side, "--length", str(a.length), "--batch", str(a.batch),
           "--heads", *map(str, a.heads), "--dims", *map(str, a.dims), "--repeats", str(a.repeats)]
    env = dict(os.environ, MLXRL_NATIVE="0") if side == "graph" else None
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if done.returncode:
        return {"error": (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _ratio(mine, theirs) -> str:
    return f"{mine / theirs:.2f}" if mine is not None and theirs else "-"


def _per_chunk(r) -> str:
    return "-" if r.get("primitives") is None else f"{r['primitives']:.1f}"


def _gb(x):
    return "-" if x is None else f"{x / 1e9:.2f} GB"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--length", type=int, default=4096, help=argparse.SUPPRESS)
    ap.add_argument("--heads", type=int, nargs=2, default=[16, 16], metavar=("HK", "HV"))
    ap.add_argument("--dims", type=int, nargs=2, default=[128, 128], metavar=("DK", "DV"))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES),
                    help="mlx_vlm is left out of the default when mlx-vlm is not installed")
    ap.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(_worker(a)))
        return
    if "mlx_vlm" in a.sides and importlib.util.find_spec("mlx_vlm") is None:
        print("(mlx-vlm is not installed: no mlx-vlm row)")
        a.sides = [side for side in a.sides if side != "mlx_vlm"]
    (hk, hv), (dk, dv) = a.heads, a.dims
    print(f"gated delta rule, forward + backward: B={a.batch}, heads {hk} key / {hv} value, dk={dk}, dv={dv}, "
          f"float32, median of {a.repeats} steps after the first; peaks from the first step")
    print(f"{'T':>6} {'side':<13} {'time':>9} {'x nat.':>7} {'RSS peak':>10} {'x nat.':>7} {'MLX peak':>10} "
          f"{'x nat.':>7} {'prims/chunk':>11}", flush=True)
    for length in a.lengths:
        a.length = length
        ref = {}
        for side in a.sides:  # printed as measured (the torch side takes minutes)
            r = _measure(side, a)
            if side == "native" and "error" not in r:
                ref = r
            if "error" in r:
                print(f"{length:>6} {LABELS[side]:<13} failed: {r['error']}", flush=True)
                continue
            x = {key: _ratio(r[key], ref.get(key)) for key in ("time", "rss_peak", "mlx_peak")}
            print(f"{length:>6} {LABELS[side]:<13} {r['time']:>8.2f}s {x['time']:>7} {_gb(r['rss_peak']):>10} "
                  f"{x['rss_peak']:>7} {_gb(r['mlx_peak']):>10} {x['mlx_peak']:>7} {_per_chunk(r):>11}", flush=True)


if __name__ == "__main__":
    main()
