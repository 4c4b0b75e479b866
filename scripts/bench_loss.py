"""Peak memory and time of the LM head + NLL (loss and gradients w.r.t. hidden and weight):
naive full logits vs `head_logprobs` (differentiable, vocab-tiled streamed VJP) vs the two-phase
streamed step (`streamed_logprobs` + `streamed_head_backward`) vs the fused row-chunked head + loss
(`fused_head_loss` under `mx.value_and_grad`, and its eager twin `fused_head_grads`).

    python scripts/bench_loss.py [--n 1024 4096 8192] [--d 1024] [--v 151936] [--repeats 2]
                                 [--methods naive differentiable two-phase fused fused-eager]
                                 [--dtype float32|bfloat16] [--graph] [--compile] [--frozen] [--kept]

--graph runs MLX's ops instead of mlxrl's native CPU kernels (MLXRL_NATIVE=0: the path of Metal and
CUDA); --dtype bfloat16 casts hidden and weight (slow on the CPU: keep D and N small); --compile wraps
the fused head's value_and_grad in mx.compile (as the trainers' steps are); --frozen differentiates
w.r.t. hidden only, with weight_grad=False (a frozen head: LoRA); --kept keeps that frozen weight in
bfloat16 under float32 hidden states (a LoRA run over a bfloat16 checkpoint, `models.widened`).

Peak is `mx.get_peak_memory()` after `mx.reset_peak_memory()`, minus the inputs (hidden, weight,
targets) which all three hold. Each configuration runs in a fresh subprocess so
one method's cache does not colour another's peak.
"""

import argparse
import json
import os
import subprocess
import sys

CHILD = r"""
import json, sys, time
import mlxrl
mlxrl.runtime.setup()  # the CPU buffer cache, as the trainers set it
import mlx.core as mx
from mlxrl.losses.fused_head import fused_head_grads, fused_head_loss
from mlxrl.losses.head import head_logprobs, streamed_head_backward, streamed_logprobs
method, n, d, v, reps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
dtype = getattr(mx, sys.argv[6])
compiled, frozen, kept = sys.argv[7] == "1", sys.argv[8] == "1", sys.argv[9] == "1"
mx.random.seed(0)
h = (mx.random.normal((n, d)) * 0.5).astype(dtype)
w = (mx.random.normal((v, d)) * 0.02).astype(mx.bfloat16 if kept else dtype)
t = mx.random.randint(0, v, (n,))
mx.eval(h, w, t)
inputs = h.nbytes + w.nbytes + t.nbytes

def naive(h, w, t):
    z = h @ w.astype(h.dtype).T
    lp = mx.take_along_axis(z, t[:, None], -1)[:, 0] - mx.logsumexp(z, -1)
    return -lp.mean()

def diff(h, w, t):
    return -head_logprobs(h, w, t).mean()

def run(h=h, w=w, t=t):
    if method == "naive":
        out = mx.value_and_grad(naive, argnums=0 if frozen else (0, 1))(h, w, t)
    elif method == "differentiable":
        out = mx.value_and_grad(diff, argnums=(0, 1))(h, w, t)
    elif method == "fused":  # loss = mean NLL, as naive
        out = fused_step(h, w, t)
    elif method == "fused-eager":
        loss, _, dh, dw = fused_head_grads(h, w, t)
        out = (loss, dh, dw)
    else:
        lp, ent, lse, _ = streamed_logprobs(h, w, t)
        loss, g = mx.value_and_grad(lambda x: -x.mean())(lp)
        out = (loss, streamed_head_backward(h, w, t, lse, ent, g))
    mx.eval(out)
    return out

def fused(h, w, t):
    return fused_head_loss(h, w, t, skip_ignored=False, weight_grad=not frozen)[0]

fused_step = mx.value_and_grad(fused, argnums=0 if frozen else (0, 1))
if compiled:
    fused_step = mx.compile(fused_step)
run(h[:64], w[:4096], t[:64] % 4096)  # warm-up on a small problem (kernels, lazy imports)
mx.clear_cache()
mx.reset_peak_memory()
times = []
for _ in range(reps):
    t0 = time.perf_counter(); out = run(); times.append(time.perf_counter() - t0)
    del out
peak = mx.get_peak_memory() - inputs
print(json.dumps({"peak": peak, "time": min(times)}))
"""


METHODS = ("naive", "differentiable", "two-phase", "fused", "fused-eager")


def measure(method, n, d, v, reps, dtype="float32", graph=False, compiled=False, frozen=False, kept=False):
    env = {**os.environ, "MLXRL_NATIVE": "0"} if graph else None
    out = subprocess.run([sys.executable, "-c", CHILD, method, str(n), str(d), str(v), str(reps), dtype,
                          str(int(compiled)), str(int(frozen or kept)), str(int(kept))],
                         capture_output=True, text=True, env=env)
    if out.returncode:
        return {"error": (out.stderr.strip().splitlines() or ["killed"])[-1][:60]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, nargs="+", default=[1024, 4096, 8192])
    ap.add_argument("--d", type=int, default=1024)
    ap.add_argument("--v", type=int, default=151936)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS,
                    help="the first one is the baseline of the 'x naive' columns")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--graph", action="store_true", help="MLX's ops, not the native CPU kernels (MLXRL_NATIVE=0)")
    ap.add_argument("--compile", action="store_true", help="mx.compile the fused head's value_and_grad")
    ap.add_argument("--frozen", action="store_true", help="naive, fused: a frozen head (gradient w.r.t. hidden only)")
    ap.add_argument("--kept", action="store_true", help="a frozen bfloat16 weight under float32 hidden states (a LoRA "
                    "run over a bfloat16 checkpoint: models.widened); implies --frozen")
    args = ap.parse_args()
    path = "graph path" if args.graph else "native kernels where they apply"
    wrt = "hidden (frozen head)" if args.frozen or args.kept else "hidden and weight"
    wrt += ", the weight kept in bfloat16" if args.kept else ""
    print(f"LM head + NLL, loss and grads w.r.t. {wrt}; D={args.d}, V={args.v}, {args.dtype}, {path}"
          f"{', compiled' if args.compile else ''}")
    print(f"{'N':>6} {'method':<15} {'peak GB':>8} {'x naive':>8} {'time s':>7} {'x naive':>8}")
    for n in args.n:
        base = None
        for method in args.methods:
            r = measure(method, n, args.d, args.v, args.repeats, args.dtype, args.graph, args.compile, args.frozen,
                        args.kept)
            if "error" in r:
                print(f"{n:>6} {method:<15} failed: {r['error']}")
                continue
            base = base or r
            print(f"{n:>6} {method:<15} {r['peak'] / 1e9:8.2f} {r['peak'] / base['peak']:8.2f} "
                  f"{r['time']:7.2f} {r['time'] / base['time']:8.2f}")


if __name__ == "__main__":
    main()
