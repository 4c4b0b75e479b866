"""Paths, and the sibling scripts bench_scale uses as modules (stdlib-only at import)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]  # scripts/
ROOT = HERE.parent
SCRIPT = HERE / "bench_scale.py"  # the entry every side's process runs (`spawn.child`)


def _script(name: str):
    """A sibling script as a module (bench_sft, bench_grpo, tiny_checkpoints: stdlib-only at import)."""
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# our --optim -> TRL's (transformers') name for the same optimizer
TRL_OPTIM = {"adamw_torch": "adamw_torch", "adamw_8bit": "adamw_bnb_8bit"}
SFT = _script("bench_sft")  # text_rows, model_flops, rss_gb, _peaks, _timed_trainer
GRPO = _script("bench_grpo")  # reward_vowels, make_prompts, summarise, _args_common
MLXVLM = _script("bench_scale_mlxvlm")  # the mlxvlm side: available, run
rss_gb = SFT.rss_gb
