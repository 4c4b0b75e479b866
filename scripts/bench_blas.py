"""fp32 matmul GFLOP/s: MLX with its bundled reference BLAS, MLX with OpenBLAS on the generic x86-64
kernels its own CPU detection falls back to on CPUs newer than the build (OPENBLAS_CORETYPE=Prescott,
what Debian's 0.3.21 picks on an Emerald Rapids VM), MLX with mlxrl's BLAS fix (OpenBLAS with the
kernel family chosen from the CPU flags), numpy.

    python scripts/bench_blas.py [--n 1024] [--repeats 10]

Each MLX variant runs in its own subprocess because the BLAS must be chosen before
`mlx.core` is first imported (MLXRL_BLAS=none vs auto).
"""

import argparse
import json
import os
import subprocess
import sys
import time

CHILD = r"""
import json, os, sys, time
import mlxrl.cpu.blas as rt
import mlx.core as mx
n, reps = int(sys.argv[1]), int(sys.argv[2])
a = mx.random.normal((n, n)); b = mx.random.normal((n, n)); mx.eval(a, b, a @ b)
t = time.perf_counter()
for _ in range(reps):
    mx.eval(a @ b)
dt = (time.perf_counter() - t) / reps
print(json.dumps({"blas": rt.BLAS_IN_USE, "gflops": 2 * n**3 / dt / 1e9}))
"""


def run_mlx(choice: str, n: int, reps: int, **extra_env) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_CORETYPE"}
    env.update(MLXRL_BLAS=choice, **extra_env)
    out = subprocess.run([sys.executable, "-c", CHILD, str(n), str(reps)], env=env, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(out.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_numpy(n: int, reps: int) -> float:
    import numpy as np

    a = np.random.randn(n, n).astype(np.float32)
    b = np.random.randn(n, n).astype(np.float32)
    a @ b
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * n**3 / ((time.perf_counter() - t) / reps) / 1e9


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    ref = run_mlx("none", args.n, max(2, args.repeats // 5))
    generic = run_mlx("auto", args.n, args.repeats, OPENBLAS_CORETYPE="Prescott")
    fixed = run_mlx("auto", args.n, args.repeats)
    np_gflops = run_numpy(args.n, args.repeats)
    print(f"fp32 matmul {args.n}x{args.n}, GFLOP/s")
    print(f"{'MLX, ' + ref['blas']:<70} {ref['gflops']:8.1f}")
    for r in (generic, fixed):
        print(f"{'MLX, ' + r['blas']:<70} {r['gflops']:8.1f}  ({r['gflops'] / ref['gflops']:.1f}x)")
    print(f"{'numpy':<70} {np_gflops:8.1f}")


if __name__ == "__main__":
    main()
