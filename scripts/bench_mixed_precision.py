"""bf16 training on the graph path against float32: loss curves, weight movement and optimizer memory.

    python scripts/bench_mixed_precision.py                  # 50 SFT steps of the embedded default
    python scripts/bench_mixed_precision.py --steps 20 --lr 1e-5

Runs SFT of the embedded tiny Qwen3-VL (full fine-tuning, the demo's data and batch size) from the same
bf16-representable initial weights over the same batches, on MLX's own ops (the path of Metal and
CUDA: mlxrl's native CPU kernels off), four ways:

* fp32          float32 weights, moments and compute (the reference)
* bf16 master   bf16 weights and compute, float32 master weights and moments (the default in bf16)
* bf16 SR       bf16 weights, float32 moments, stochastic rounding, no master (--master_weights false)
* bf16 nearest  the same with round-to-nearest (what mlxrl did before mixed precision: updates
                below half a bf16 step are lost)

and prints the loss every few steps, the largest and mean gap of each curve to fp32's, the share of
fp32's (bf16-representable) weight movement each run missed, and the optimizer state's bytes.
"""

from __future__ import annotations  # noqa: I001  (mlxrl must come before mlx.core)

import argparse
import contextlib
import sys
import tempfile
from pathlib import Path

import mlxrl  # noqa: F401  (first: the fast BLAS before mlx.core)
import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from mlxrl.cpu import native
from mlxrl.data.synthetic import make_vqa
from mlxrl.optim import optimizers as optim_lib
from mlxrl.trainers.sft.config import SFTConfig
from mlxrl.trainers.sft.trainer import SFTTrainer

BF16 = mx.bfloat16


def weights(model) -> dict[str, np.ndarray]:
    return {k: np.array(v.astype(mx.float32)) for k, v in tree_flatten(model.parameters())}


def run(name, dtype, init, rows, out, steps, lr, master=True):
    model, processor = mlxrl.load_default(seed=0, dtype=dtype)
    model.load_weights([(k, mx.array(v).astype(dtype)) for k, v in init.items()])
    args = SFTConfig(output_dir=str(out / name), max_steps=steps, learning_rate=lr, lr_scheduler_type="cosine",
                     warmup_ratio=0.1, per_device_train_batch_size=8, freeze_embeddings=True,
                     assistant_only_loss=True, max_length=256, gradient_checkpointing=False, logging_steps=1,
                     save_steps=0, disable_tqdm=True, master_weights=master, seed=0)
    trainer = SFTTrainer(model, processor, args, train_dataset=rows)
    with contextlib.redirect_stdout(sys.stderr):  # the trainer's log lines; the table goes to stdout
        losses = [e["loss"] for e in trainer.train_log() if "loss" in e]
    state = sum(v.nbytes for _, v in tree_flatten(trainer.optimizer.state) if isinstance(v, mx.array))
    return np.array(losses), weights(model), state


def missed_share(w, w32, w0) -> float:
    num = den = 0.0
    for k in w0:
        target = np.array(mx.array(w32[k]).astype(BF16).astype(mx.float32))
        num += float(np.square(w[k] - target).sum())
        den += float(np.square(target - w0[k]).sum())
    return float(np.sqrt(num / max(den, 1e-30)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (the SFT demo's)")
    p.add_argument("--every", type=int, default=5, help="print the loss every N steps")
    ns = p.parse_args(argv)
    native.load = lambda: None  # the graph path: MLX's ops, as on Metal / CUDA
    rows = make_vqa(ns.steps * 8, seed=1)
    start, _ = mlxrl.load_default(seed=0, dtype=BF16)
    w0 = weights(start)
    del start
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        for name, dtype, master in (("fp32", mx.float32, True), ("bf16 master", BF16, True),
                                    ("bf16 SR", BF16, False)):
            print(f"running {name} ...", file=sys.stderr, flush=True)
            runs[name] = run(name, dtype, w0, rows, out, ns.steps, ns.lr, master)
        keep = optim_lib.stochastic_round
        optim_lib.stochastic_round = lambda x, dtype: x.astype(dtype)
        print("running bf16 nearest ...", file=sys.stderr, flush=True)
        runs["bf16 nearest"] = run("bf16 nearest", BF16, w0, rows, out, ns.steps, ns.lr, False)
        optim_lib.stochastic_round = keep
    ref, w32 = runs["fp32"][0], runs["fp32"][1]
    names = list(runs)
    print(f"SFT of the embedded default, full fine-tuning (embeddings frozen), graph path, {ns.steps} steps, "
          f"lr {ns.lr:g} cosine, batch 8")
    print("step  " + "".join(f"{n:>14}" for n in names))
    for i in range(0, ns.steps, ns.every):
        print(f"{i + 1:>4}  " + "".join(f"{runs[n][0][i]:>14.4f}" for n in names))
    print(f"{ns.steps:>4}  " + "".join(f"{runs[n][0][-1]:>14.4f}" for n in names))
    print("\nrun             max |loss - fp32|  mean |loss - fp32|  last-10 mean   missed movement  optimizer state")
    for n in names:
        losses, w, state = runs[n]
        gap = np.abs(losses - ref)
        print(f"{n:<14}  {gap.max():>17.4f}  {gap.mean():>18.4f}  {losses[-10:].mean():>12.4f}  "
              f"{missed_share(w, w32, w0):>15.3f}  {state / 1e6:>12.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
