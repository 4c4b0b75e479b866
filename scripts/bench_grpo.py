"""mlxrl's GRPOTrainer vs TRL 1.16's GRPOTrainer, side by side, on the same tiny checkpoint, prompts and reward.

    python scripts/bench_grpo.py                       # G=8, prompt 512 tokens, completion 128 (~10 min, 2 cores)
    python scripts/bench_grpo.py --prompt_length 128 --completion_length 32 --steps 2 --warmup 1   # quick

Every side: the tiny random Qwen3 checkpoint of scripts/tiny_checkpoints.py, full fine-tuning, float32,
no gradient checkpointing, beta 0 (no reference model), loss_type dapo, temperature 1.0, one prompt
of exactly `--prompt_length` tokens (repeated words) per step with `--num_generations` completions of
at most `--completion_length` tokens (per_device_train_batch_size = G, gradient_accumulation_steps 1,
so every step is one generation round plus one optimizer step), the same reward function. Sides:
mlxrl with prompt sharing on (`shared_prompt=True`: each prompt forwarded once per group in training)
and off (every prompt+completion row forwarded separately), TRL (torch CPU, transformers generate).
Each side runs in its own subprocess. s/step is the median over `--steps` timed steps after
`--warmup`; "generation s" is the generation round (mlxrl: `generate_round`, TRL:
`_generate_and_score_completions`: sampling, decoding, rewards, advantages) and "training s" the rest
of the step (forward, backward, optimizer); "pure gen s" is sampling alone (mlxrl's logged
`generation_seconds`, TRL's `_generate`). Peak RSS is the process's peak resident set size (ru_maxrss)
minus its size right before the model was loaded. Completions end at EOS, so the mean completion
length of each side is printed too (a random model rarely samples EOS).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
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


def reward_vowels(prompts, completions, completion_ids, **kwargs):
    """The benchmark's reward: the share of vowels among a completion's letters (cheap, varies per sample)."""
    out = []
    for c in completions:
        text = c if isinstance(c, str) else c[0]["content"]
        letters = [ch for ch in text.lower() if ch.isalpha()]
        out.append(sum(ch in "aeiou" for ch in letters) / len(letters) if letters else 0.0)
    return out


def make_prompts(ckpt: str, n: int, length: int, seed: int = 0) -> list[dict]:
    """n plain-string prompts of exactly `length` tokens (checked by re-tokenising) from repeated words."""
    import numpy as np
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(ckpt)
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        ids = []
        while len(ids) < length + 8:
            ids = tok(" ".join(rng.choice(WORDS, 2 * length + 16)), add_special_tokens=False)["input_ids"]
        cut = length
        while True:  # a cut that re-tokenises to exactly `length` tokens
            text = tok.decode(ids[:cut])
            got = len(tok(text, add_special_tokens=False)["input_ids"])
            if got == length:
                break
            cut += 1 if got < length else -1
        rows.append({"prompt": text})
    return rows


def _args_common(a) -> dict:
    return dict(max_steps=a.steps + a.warmup, per_device_train_batch_size=a.num_generations,
                gradient_accumulation_steps=1, num_generations=a.num_generations,
                max_completion_length=a.completion_length, learning_rate=1e-6, beta=0.0, loss_type="dapo",
                temperature=1.0, logging_steps=1, gradient_checkpointing=False, disable_tqdm=True,
                shuffle_dataset=False, seed=42)


def run_ours(a, rows: list[dict], shared: bool) -> dict:
    sys.path.insert(0, str(ROOT))
    import mlxrl  # noqa: I001  (first: it loads the fast BLAS before mlx.core)
    import mlx.core as mx
    from mlxrl.trainers.grpo.trainer import GRPOConfig, GRPOTrainer

    base = rss_gb()
    model, processor = mlxrl.load(a.ckpt)
    stamps, rounds = [], []

    class Timed(GRPOTrainer):
        def generate_round(self, round_index):
            t0 = time.perf_counter()
            micro, metrics = super().generate_round(round_index)
            rounds.append((time.perf_counter() - t0, metrics["generation_seconds"]))
            return micro, metrics

        def _record(self, entry):
            stamps.append(time.perf_counter())
            super()._record(entry)

    args = GRPOConfig(output_dir=a.out, save_steps=0, shared_prompt=shared, **_args_common(a))
    trainer = Timed(model, processor, args, train_dataset=rows, reward_funcs=[reward_vowels])
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    trainer.train()
    lengths = [e["completions/mean_length"] for e in trainer.log_history if "completions/mean_length" in e]
    return {"stamps": [t0, *stamps], "rounds": rounds, "peak_rss_gb": rss_gb() - base,
            "mlx_peak_gb": mx.get_peak_memory() / 1e9, "mean_length": lengths}


def run_trl(a, rows: list[dict]) -> dict:
    import torch
    import transformers
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(a.threads)
    base = rss_gb()
    model = transformers.AutoModelForCausalLM.from_pretrained(a.ckpt, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(a.ckpt)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    stamps, rounds = [], []
    pure = []

    class Timed(GRPOTrainer):
        def _generate_and_score_completions(self, *args, **kwargs):
            t0 = time.perf_counter()
            n = len(pure)
            out = super()._generate_and_score_completions(*args, **kwargs)
            rounds.append((time.perf_counter() - t0, sum(pure[n:])))
            return out

        def _generate(self, *args, **kwargs):
            t0 = time.perf_counter()
            out = super()._generate(*args, **kwargs)
            pure.append(time.perf_counter() - t0)
            return out

    class Stamp(TrainerCallback):
        def on_step_end(self, *args, **kwargs):
            stamps.append(time.perf_counter())

    common = _args_common(a)
    common.pop("shuffle_dataset")
    args = GRPOConfig(output_dir=a.out, save_strategy="no", report_to="none", bf16=False, use_cpu=True,
                      shuffle_dataset=False, **common)
    trainer = Timed(model=model, reward_funcs=[reward_vowels], args=args, train_dataset=Dataset.from_list(rows),
                    processing_class=tok, callbacks=[Stamp()])
    t0 = time.perf_counter()
    trainer.train()
    lengths = [e["completions/mean_length"] for e in trainer.state.log_history if "completions/mean_length" in e]
    return {"stamps": [t0, *stamps], "rounds": rounds, "peak_rss_gb": rss_gb() - base, "mean_length": lengths}


def summarise(r: dict, warmup: int) -> dict:
    st = r["stamps"]
    steps = [b - c for b, c in zip(st[warmup + 1:], st[warmup:-1], strict=True)]
    gen = [g for g, _ in r["rounds"][warmup:warmup + len(steps)]]
    pure = [p for _, p in r["rounds"][warmup:warmup + len(steps)]]
    r["s_per_step"] = statistics.median(steps)
    r["gen_s"] = statistics.median(gen)
    r["pure_gen_s"] = statistics.median(pure)
    r["train_s"] = statistics.median([s - g for s, g in zip(steps, gen, strict=True)])
    r["len"] = statistics.mean(r["mean_length"][warmup:] or r["mean_length"] or [float("nan")])
    return r


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num_generations", type=int, default=8, help="completions per prompt (G)")
    ap.add_argument("--prompt_length", type=int, default=512, help="prompt tokens")
    ap.add_argument("--completion_length", type=int, default=128, help="max_completion_length")
    ap.add_argument("--steps", type=int, default=3, help="timed steps")
    ap.add_argument("--warmup", type=int, default=1, help="untimed first steps (compilation, caches)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads for TRL")
    ap.add_argument("--sides", nargs="+", default=["shared", "unshared", "trl"], choices=["shared", "unshared", "trl"])
    ap.add_argument("--side", choices=["shared", "unshared", "trl"], help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    ap.add_argument("--rows", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.side:  # a child process: one side
        rows = json.loads(Path(a.rows).read_text())
        r = run_trl(a, rows) if a.side == "trl" else run_ours(a, rows, shared=a.side == "shared")
        print("RESULT " + json.dumps(r), flush=True)
        return
    sys.path.insert(0, str(ROOT / "scripts"))
    from tiny_checkpoints import build

    res = {}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = build("qwen3", tmp)
        rows_path = Path(tmp) / "rows.json"
        rows_path.write_text(json.dumps(make_prompts(str(ckpt), a.steps + a.warmup, a.prompt_length)))
        for side in a.sides:
            cmd = [sys.executable, __file__, "--side", side, "--ckpt", str(ckpt), "--rows", str(rows_path),
                   "--out", str(Path(tmp) / side), "--steps", str(a.steps), "--warmup", str(a.warmup),
                   "--num_generations", str(a.num_generations), "--prompt_length", str(a.prompt_length),
                   "--completion_length", str(a.completion_length), "--threads", str(a.threads)]
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True)
            line = [s for s in proc.stdout.splitlines() if s.startswith("RESULT ")]
            if proc.returncode or not line:
                sys.exit(f"{side} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
            res[side] = summarise(json.loads(line[-1][len("RESULT "):]), a.warmup)
            print(f"[{side} done in {time.perf_counter() - t0:.0f} s]", file=sys.stderr, flush=True)
    names = {"shared": "mlxrl shared", "unshared": "mlxrl unshared", "trl": "TRL"}
    print(f"GRPO step, tiny qwen3, full fine-tuning, fp32, beta 0, dapo: 1 prompt x G={a.num_generations}, "
          f"prompt {a.prompt_length} tokens, completion <= {a.completion_length}; median of {a.steps} steps "
          f"after {a.warmup}")
    print(f"{'side':15} {'s/step':>8} {'gen s':>8} {'pure gen s':>10} {'train s':>8} {'peak RSS GB':>11} "
          f"{'MLX peak GB':>11} {'mean len':>8} {'step xTRL':>9} {'gen xTRL':>8} {'train xTRL':>10} {'RSS xTRL':>8}")
    t = res.get("trl")
    for side in a.sides:
        r = res[side]
        mlx_peak = f"{r['mlx_peak_gb']:11.2f}" if "mlx_peak_gb" in r else f"{'':11}"
        if t:
            ratios = (f"{r['s_per_step'] / t['s_per_step']:9.2f} {r['gen_s'] / t['gen_s']:8.2f} "
                      f"{r['train_s'] / t['train_s']:10.2f} {r['peak_rss_gb'] / t['peak_rss_gb']:8.2f}")
        else:
            ratios = ""
        print(f"{names[side]:15} {r['s_per_step']:8.3f} {r['gen_s']:8.3f} {r['pure_gen_s']:10.3f} "
              f"{r['train_s']:8.3f} {r['peak_rss_gb']:11.2f} {mlx_peak} {r['len']:8.1f} {ratios}")


if __name__ == "__main__":
    main()
