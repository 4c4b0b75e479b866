"""GRPO (--grpo): our sides (shared prompt on and off) and TRL's GRPOTrainer, and the GRPO table (`run_grpo`)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from .checkpoints import checkpoint, real_depth
from .common import GRPO, ROOT, SFT, rss_gb
from .report import NAMES, _ratio
from .spawn import child
from .trl import _lora_config


def _grpo_common(s: dict) -> dict:
    ns = argparse.Namespace(steps=s["steps"], warmup=s["warmup"], num_generations=s["G"],
                            completion_length=s["C"])
    return {**GRPO._args_common(ns), "learning_rate": s["lr"], "gradient_checkpointing": True}


def run_grpo_ours(s: dict, shared: bool) -> dict:
    sys.path.insert(0, str(ROOT))
    import mlxrl  # noqa: I001  (before mlx.core: it loads the fast BLAS)
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlxrl.trainers.grpo.trainer import GRPOConfig, GRPOTrainer

    rows = json.loads(Path(s["rows"]).read_text())
    base = rss_gb()
    model, processor = mlxrl.load(s["ckpt"])
    stamps, rounds = [], []

    class Timed(SFT._timed_trainer(GRPOTrainer, stamps)):
        def generate_round(self, round_index):
            t0 = time.perf_counter()
            micro, metrics = super().generate_round(round_index)
            rounds.append((time.perf_counter() - t0, metrics["generation_seconds"]))
            return micro, metrics

    args = GRPOConfig(output_dir=s["out"], save_steps=0, save_strategy="no", shared_prompt=shared, use_peft=True,
                      lora_r=16, lora_alpha=32, lora_dropout=s["lora_dropout"], **_grpo_common(s))
    trainer = Timed(model, processor, args, train_dataset=rows, reward_funcs=[GRPO.reward_vowels])
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    trainer.train()
    lengths = [e["completions/mean_length"] for e in trainer.log_history if "completions/mean_length" in e]
    return {"stamps": [t0, *stamps], "rounds": rounds, "peak_rss_gb": rss_gb(), "base_rss_gb": base,
            "mlx_peak_gb": mx.get_peak_memory() / 1e9, "mean_length": lengths,
            "loss": [e["loss"] for e in trainer.log_history if "loss" in e],
            "trainable": sum(v.size for _, v in tree_flatten(trainer.model.trainable_parameters()))}


def run_grpo_trl(s: dict) -> dict:
    import torch
    import transformers
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(2)
    rows = json.loads(Path(s["rows"]).read_text())
    base = rss_gb()
    model = transformers.AutoModelForCausalLM.from_pretrained(s["ckpt"], dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(s["ckpt"])
    stamps, rounds, pure = [], [], []

    class Timed(GRPOTrainer):
        def _generate_and_score_completions(self, *args, **kwargs):
            t0, n = time.perf_counter(), len(pure)
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

    args = GRPOConfig(output_dir=s["out"], save_strategy="no", report_to="none", bf16=False, use_cpu=True,
                      **_grpo_common(s))
    trainer = Timed(model=model, reward_funcs=[GRPO.reward_vowels], args=args, train_dataset=Dataset.from_list(rows),
                    processing_class=tok, callbacks=[Stamp()], peft_config=_lora_config(s))
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    t0 = time.perf_counter()
    trainer.train()
    logs = trainer.state.log_history
    return {"stamps": [t0, *stamps], "rounds": rounds, "peak_rss_gb": rss_gb(), "base_rss_gb": base,
            "mean_length": [e["completions/mean_length"] for e in logs if "completions/mean_length" in e],
            "loss": [e["loss"] for e in logs if "loss" in e], "trainable": trainable}


def run_grpo(a, root: Path, tmp: Path, env) -> dict:
    folder = checkpoint(root, a.grpo_shape, a.layers, env, a.ckpt_dtype)
    rows_path = tmp / "grpo_rows.json"
    rows_path.write_text(json.dumps(GRPO.make_prompts(str(folder), a.steps + a.warmup, a.prompt_length)))
    spec = {"ckpt": str(folder), "rows": str(rows_path), "steps": a.steps, "warmup": a.warmup,
            "G": a.num_generations, "C": a.completion_length, "lr": a.lr_lora, "lora_dropout": a.lora_dropout}
    res = {}
    for side in a.grpo_sides:
        r = child(side, {**spec, "out": str(tmp / side)}, env)
        res[side] = r if "error" in r else GRPO.summarise(r, a.warmup)
    depth = f"{a.layers} of {real_depth(a.grpo_shape)} layers" if a.layers else f"{real_depth(a.grpo_shape)} layers"
    print()
    print(f"GRPO step, {a.grpo_shape} ({depth}), LoRA r16 alpha 32 dropout {a.lora_dropout:g} lr {a.lr_lora:g}, fp32, "
          f"gradient checkpointing on, beta 0, dapo: 1 prompt of {a.prompt_length} tokens x G={a.num_generations}, "
          f"completion <= {a.completion_length}; median of {a.steps} step(s) after {a.warmup}")
    print(f"{'side':15} {'s/step':>8} {'gen s':>8} {'pure gen s':>10} {'train s':>8} {'peak RSS':>9} "
          f"{'above base':>10} {'MLX peak':>9} {'mean len':>8} {'step xTRL':>9} {'RSS xTRL':>8} "
          f"{'trainable':>10}  loss")
    t = res.get("grpo_trl")
    t = t if t and "error" not in t else None
    for side, r in res.items():
        if "error" in r:
            print(f"{NAMES[side]:15} failed: {r['error']}")
            continue
        mlx_peak = f"{r['mlx_peak_gb']:9.2f}" if "mlx_peak_gb" in r else f"{'-':>9}"
        print(f"{NAMES[side]:15} {r['s_per_step']:8.2f} {r['gen_s']:8.2f} {r['pure_gen_s']:10.2f} {r['train_s']:8.2f} "
              f"{r['peak_rss_gb']:9.2f} {r['peak_rss_gb'] - r['base_rss_gb']:10.2f} {mlx_peak} {r['len']:8.1f} "
              f"{_ratio(r['s_per_step'], t and t['s_per_step']):>9} "
              f"{_ratio(r['peak_rss_gb'], t and t['peak_rss_gb']):>8} {r['trainable'] / 1e6:9.2f}M  "
              f"{' '.join(f'{x:.4g}' for x in r['loss'])}")
    return res
