"""The GPU side's matmul peak (--gpu: the MFU denominator)."""

from __future__ import annotations

import sys
import time

from .common import ROOT


def run_gpu_peak(s: dict) -> dict:
    """Child: the best bf16 n x n matmul of MLX on its default device and of torch on CUDA, TFLOP/s (best of 5
    timed products after 3 warm-ups; the GPU side's MFU denominator)."""
    sys.path.insert(0, str(ROOT))
    import mlxrl  # noqa: F401, I001
    import mlx.core as mx
    import torch

    n, flops, res = s["n"], 2 * s["n"] ** 3, {}
    a = mx.random.normal((n, n)).astype(mx.bfloat16)
    times = []
    for _ in range(8):
        t0 = time.perf_counter()
        mx.eval(a @ a)
        times.append(time.perf_counter() - t0)
    res["mlx"] = flops / min(times[3:]) / 1e12
    if torch.cuda.is_available():
        x = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        times = []
        for _ in range(8):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            x @ x
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        res["torch"] = flops / min(times[3:]) / 1e12
    return {**res, "mlx_device": str(mx.default_device())}
