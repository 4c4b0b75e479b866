"""mlxrl's DPOTrainer vs TRL 1.16's DPOTrainer, side by side, on the same tiny checkpoint and data.

    python scripts/bench_dpo.py                        # qwen3 text and qwen2_vl vision, 8 timed steps each
    python scripts/bench_dpo.py --arch qwen3 --steps 12 --batch 8

Both sides: full fine-tuning with a frozen reference model (TRL loads a second copy; mlxrl keeps a
frozen one), float32, no gradient checkpointing (TRL's defaults bf16=True and
gradient_checkpointing=True are turned off so both run the same math), AdamW, sigmoid loss, the
same pairs in the same order, batch `--batch` pairs. Each side runs in its own subprocess; seconds
per step are the median over the timed steps after `--warmup` steps; peak memory is the process's
peak resident set size (ru_maxrss) minus its size right before the model was loaded, and for mlxrl
also MLX's own allocator peak (`mx.get_peak_memory()`).
"""

from __future__ import annotations

import argparse
import json
import pickle
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
         "quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()


def rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KB on Linux


def text_rows(n: int, seed: int = 0) -> list[dict]:
    import numpy as np

    rng = np.random.default_rng(seed)

    def words(k):
        return " ".join(rng.choice(WORDS, k))

    return [{"prompt": words(int(rng.integers(40, 80))), "chosen": " " + words(int(rng.integers(15, 40))),
             "rejected": " " + words(int(rng.integers(15, 40)))} for _ in range(n)]


def vision_rows(n: int, seed: int = 0) -> list[dict]:
    sys.path.insert(0, str(ROOT))
    from mlxrl.cli.dpo import preference_pairs
    from mlxrl.data.synthetic import make_vqa

    return preference_pairs(make_vqa(n, seed=seed), seed=seed)


def run_ours(ckpt: str, arch: str, steps: int, batch: int, out: str, rows: list[dict]) -> dict:
    sys.path.insert(0, str(ROOT))
    import mlxrl
    from mlxrl.trainers.dpo.config import DPOConfig
    from mlxrl.trainers.dpo.trainer import DPOTrainer

    base = rss_gb()
    model, processor = mlxrl.load(ckpt)
    stamps = []

    class Timed(DPOTrainer):
        def _record(self, entry):
            stamps.append(time.perf_counter())
            super()._record(entry)

    args = DPOConfig(output_dir=out, max_steps=steps, per_device_train_batch_size=batch, learning_rate=1e-5,
                     logging_steps=1, save_steps=0, disable_tqdm=True, gradient_checkpointing=False,
                     compile=arch == "qwen3", max_length=512)
    import mlx.core as mx

    trainer = Timed(model, processor, args, train_dataset=rows)
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    trainer.train()
    return {"stamps": [t0, *stamps], "peak_rss_gb": rss_gb() - base, "mlx_peak_gb": mx.get_peak_memory() / 1e9,
            "loss": [e for e in trainer.log_history if "loss" in e][-1]["loss"]}


def run_trl(ckpt: str, arch: str, steps: int, batch: int, out: str, rows: list[dict]) -> dict:
    sys.path.insert(0, str(ROOT))
    import torch
    import transformers
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import DPOConfig, DPOTrainer

    torch.set_num_threads(2)
    base = rss_gb()
    if arch == "qwen3":
        model = transformers.Qwen3ForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
        processing = transformers.AutoTokenizer.from_pretrained(ckpt)
    else:
        model = transformers.Qwen2VLForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32)
        sys.path.insert(0, str(ROOT / "scripts"))
        from tiny_checkpoints import hf_processor

        processing = hf_processor(ckpt)
    stamps = []

    class Stamp(TrainerCallback):
        def on_step_end(self, *a, **k):
            stamps.append(time.perf_counter())

    args = DPOConfig(output_dir=out, max_steps=steps, per_device_train_batch_size=batch, learning_rate=1e-5,
                     logging_steps=1, save_strategy="no", report_to="none", bf16=False, use_cpu=True,
                     gradient_checkpointing=False, max_length=512, disable_tqdm=True, seed=42)
    trainer = DPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=processing,
                         callbacks=[Stamp()])
    t0 = time.perf_counter()
    trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    return {"stamps": [t0, *stamps], "peak_rss_gb": rss_gb() - base, "loss": losses[-1]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", nargs="+", default=["qwen3", "qwen2_vl"], choices=["qwen3", "qwen2_vl"])
    ap.add_argument("--steps", type=int, default=8, help="timed steps")
    ap.add_argument("--warmup", type=int, default=2, help="untimed first steps (compilation, caches)")
    ap.add_argument("--batch", type=int, default=4, help="pairs per step")
    ap.add_argument("--side", choices=["ours", "trl"], help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--rows", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    total = a.steps + a.warmup
    if a.side:  # a child process: one side, one arch
        fn = run_ours if a.side == "ours" else run_trl
        rows = pickle.loads(Path(a.rows).read_bytes())  # drawn by the parent: the TRL child never imports mlxrl
        print("RESULT " + json.dumps(fn(a.ckpt, a.arch[0], total, a.batch, a.out, rows)), flush=True)
        return
    sys.path.insert(0, str(ROOT / "scripts"))
    import statistics

    from tiny_checkpoints import build

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for arch in a.arch:
            ckpt = build(arch, tmp)
            rows_path = Path(tmp) / f"{arch}-rows.pkl"
            rows_path.write_bytes(pickle.dumps(text_rows(total * a.batch) if arch == "qwen3"
                                               else vision_rows(total * a.batch)))
            res = {}
            for side in ("ours", "trl"):
                cmd = [sys.executable, __file__, "--side", side, "--arch", arch, "--ckpt", str(ckpt),
                       "--out", str(Path(tmp) / f"{arch}-{side}"), "--steps", str(a.steps), "--warmup",
                       str(a.warmup), "--batch", str(a.batch), "--rows", str(rows_path)]
                proc = subprocess.run(cmd, capture_output=True, text=True)
                line = [s for s in proc.stdout.splitlines() if s.startswith("RESULT ")]
                if proc.returncode or not line:
                    sys.exit(f"{side} {arch} failed:\n{proc.stderr[-3000:]}")
                r = json.loads(line[-1][len("RESULT "):])
                st = r["stamps"]
                steps = [b - c for b, c in zip(st[a.warmup + 1:], st[a.warmup:-1], strict=True)]
                r["s_per_step"] = statistics.median(steps)
                res[side] = r
            rows.append((arch, res))
    print(f"DPO step, full fine-tuning + frozen reference, {a.batch} pairs/step, fp32, no grad checkpointing, "
          f"median of {a.steps} steps after {a.warmup}")
    print(f"{'model':10} {'side':6} {'s/step':>8} {'x TRL':>7} {'peak RSS GB':>12} {'x TRL':>7} {'MLX peak GB':>12}")
    for arch, res in rows:
        t, m = res["trl"]["s_per_step"], res["trl"]["peak_rss_gb"]
        for side in ("ours", "trl"):
            r = res[side]
            mlx_peak = f"{r['mlx_peak_gb']:12.2f}" if "mlx_peak_gb" in r else f"{'':12}"
            name = "mlxrl" if side == "ours" else "TRL"
            print(f"{arch:10} {name:6} {r['s_per_step']:8.3f} {r['s_per_step'] / t:7.2f} {r['peak_rss_gb']:12.2f} "
                  f"{r['peak_rss_gb'] / m:7.2f} {mlx_peak}")


if __name__ == "__main__":
    main()
