"""Data-parallel SFT on this machine: tokens/s with 1 process vs N ranks (`mlx.launch --backend ring`
on loopback), and the time each optimizer step spends in the gradient all-reduce.

    python scripts/bench_distributed.py [--ranks 2] [--steps 8] [--batch 4] [--max_length 256]

Both runs train the same random tiny Qwen3 (the embedded default's text model, 21M parameters of
which 19M are the tied embedding: the all-reduce sends every trainable parameter each step) on
the same global batch: 1 process x `batch` rows vs N ranks x `batch / N` rows. The first two
steps are skipped (warm-up). tokens/s is the global figure that metrics.jsonl reports; the
all-reduce time is measured inside each rank by timing `Trainer.all_sum_tree` (with an mx.eval)
after a one-float barrier (so it is the transfer, not the wait for the slower rank), averaged over
ranks. On a machine whose ranks share the same cores the speed-up is not the point:
the communication overhead is.
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, sys, time
import mlxrl  # first: it loads the fast BLAS before mlx.core
import mlx.core as mx
from mlxrl.trainers import engine
timings = []
reduce = engine.Trainer.all_sum_tree
def timed(self, grads, *a, **k):
    mx.eval(grads)
    if self.world_size > 1:  # wait for the slower rank first, so the time is the transfer alone
        mx.eval(mx.distributed.all_sum(mx.zeros(1)))
    t0 = time.perf_counter(); out = reduce(self, grads, *a, **k); mx.eval(out)
    timings.append(time.perf_counter() - t0)
    return out
engine.Trainer.all_sum_tree = timed
from mlxrl.sft import main
code = main(sys.argv[2:])
g = mx.distributed.init()
print("ALLREDUCE", json.dumps({"rank": g.rank(), "times": timings}), flush=True)
sys.exit(code)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_data(path: Path, n: int, words: int):
    import numpy as np

    rng = np.random.default_rng(0)
    vocab = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi".split()
    with open(path, "w") as fh:
        for i in range(n):
            text = " ".join(rng.choice(vocab, size=words))
            fh.write(json.dumps({"messages": [{"role": "user", "content": f"Row {i}"},
                                              {"role": "assistant", "content": text}]}) + "\n")


def run(ranks: int, child: Path, args: list[str], out: Path) -> dict:
    cmd = [sys.executable, str(child), "--", *args, "--output_dir", str(out)]
    if ranks > 1:
        launcher = shutil.which("mlx.launch")
        if launcher is None:
            raise SystemExit("mlx.launch is not on PATH (it comes with the mlx package)")
        cmd = [launcher, "-n", str(ranks), "--backend", "ring", "--starting-port", str(free_port()), "--", *cmd]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0 or "ALLREDUCE" not in res.stdout:
        raise SystemExit(f"run with {ranks} rank(s) failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    entries = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    reduces = [json.loads(line.split("ALLREDUCE", 1)[1]) for line in res.stdout.splitlines() if "ALLREDUCE" in line]
    return {"entries": entries, "reduce": reduces}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch", type=int, default=4, help="global batch (rows per optimizer step)")
    ap.add_argument("--max_length", type=int, default=256)
    a = ap.parse_args()
    if a.batch % a.ranks:
        raise SystemExit(f"--batch {a.batch} must be a multiple of --ranks {a.ranks}")
    sys.path.insert(0, str(Path(__file__).parent))
    import tiny_checkpoints

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        folder = tiny_checkpoints.build("qwen3", tmp / "ckpt")
        data = tmp / "rows.jsonl"
        make_data(data, a.batch * (a.steps + 2), words=max(8, a.max_length // 2 - 20))
        child = tmp / "child.py"
        child.write_text(CHILD)
        common = ["--model", str(folder), "--dataset", str(data), "--max_length", str(a.max_length),
                  "--max_steps", str(a.steps), "--learning_rate", "1e-4", "--logging_steps", "1",
                  "--gradient_checkpointing", "false", "--disable_tqdm", "true", "--save_steps", "0",
                  "--save_strategy", "no", "--compile", "false"]
        results = {}
        for ranks in (1, a.ranks):
            per = a.batch // ranks
            results[ranks] = run(ranks, child, [*common, "--per_device_train_batch_size", str(per)],
                                 tmp / f"out{ranks}")
    rows = []
    for ranks, r in results.items():
        train = [e for e in r["entries"] if "tokens_per_second" in e][2:]
        tps = sum(e["tokens_per_second"] for e in train) / max(1, len(train))
        times = [t for rank in r["reduce"] for t in rank["times"][2:]]
        reduce_ms = 1e3 * sum(times) / max(1, len(times))
        loss = r["entries"][-1]["loss"] if r["entries"] else float("nan")
        rows.append((ranks, tps, reduce_ms, loss))
    print(f"SFT, {folder.name if False else 'tiny Qwen3'} ({a.max_length} tokens/row, global batch {a.batch}), "
          f"{a.steps} steps (first 2 skipped), ring backend on loopback")
    print(f"{'ranks':>5} {'tokens/s':>10} {'x 1 rank':>9} {'all-reduce ms/step':>19} {'final loss':>11}")
    for ranks, tps, reduce_ms, loss in rows:
        print(f"{ranks:>5} {tps:>10.0f} {tps / rows[0][1]:>9.2f} {reduce_ms:>19.1f} {loss:>11.4f}")


if __name__ == "__main__":
    main()
