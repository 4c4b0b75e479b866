"""mlx-vlm's side: its own SFT trainer (scripts/bench_scale_mlxvlm.py), on this run's rows and LoRA targets."""

from __future__ import annotations

from .checkpoints import lora_keys
from .common import MLXVLM, rss_gb
from .data import Stamps, ids_hash, make_rows


def run_mlxvlm(s: dict) -> dict:
    """mlx-vlm's own SFT trainer on this run's rows and LoRA targets (bench_scale_mlxvlm.py)."""
    return MLXVLM.run(s, make_rows=make_rows, targets=lora_keys(s["ckpt"]), rss_gb=rss_gb, ids_hash=ids_hash,
                      stamps=Stamps("mlxvlm"))
