"""Sampling settings and their defaults (a model's generation_config.json, as transformers reads it)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from ..generation import DEFAULT_STOP_TOKEN_IDS
from ..hub import MlxrlError

DEFAULT_MAX_NEW_TOKENS = 256  # mlx-lm's default (transformers' max_length 20 is too short for a reply)
DEFAULT_BASE_SEED = 42  # the trainers' --seed: what the embedded default's random base is drawn from
PREFILL_STEP_SIZE = 2048  # mlx-lm's default chunk of prompt tokens per forward
DEFAULT_MODEL_NAME = "mlxrl:default"
ADAPTER_CONFIG, CHECKPOINT_STATE, CHECKPOINT_WEIGHTS = "adapter_config.json", "trainer_state.json", \
    "trainable.safetensors"
CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")


# ------------------------------------------------------------------------------------ settings
@dataclass(frozen=True)
class Settings:
    """How to decode. temperature 0 is greedy; top_k 0, top_p 1, min_p 0, repetition_penalty 1 are off."""

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = DEFAULT_STOP_TOKEN_IDS

    def check(self) -> Settings:
        bad = [(n, v, want) for n, v, ok, want in (
            ("max_new_tokens", self.max_new_tokens, self.max_new_tokens >= 1, ">= 1"),
            ("temperature", self.temperature, self.temperature >= 0, ">= 0"),
            ("top_p", self.top_p, 0 < self.top_p <= 1, "in (0, 1]"),
            ("top_k", self.top_k, self.top_k >= 0, ">= 0"),
            ("min_p", self.min_p, 0 <= self.min_p <= 1, "in [0, 1]"),
            ("repetition_penalty", self.repetition_penalty, self.repetition_penalty > 0, "> 0"),
        ) if not ok]
        if bad:
            name, value, want = bad[0]
            raise MlxrlError(f"--{name} {value}: must be {want}")
        return self


def generation_config_defaults(folder) -> dict:
    """Settings fields from `folder/generation_config.json`, as transformers' `generate()` reads it:
    sampling only with do_sample (else greedy), absent fields at transformers' global defaults
    (temperature 1, top_k 50, top_p 1); eos_token_id (an id or a list) are the stop tokens.
    {} when the folder has no such file."""
    path = Path(folder) / "generation_config.json" if folder else None
    if path is None or not path.is_file():
        return {}
    try:
        cfg = json.loads(path.read_text())
    except ValueError as e:
        raise MlxrlError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise MlxrlError(f"{path}: expected a JSON object")
    out: dict = {}
    if cfg.get("do_sample"):
        out["temperature"] = float(cfg.get("temperature") if cfg.get("temperature") is not None else 1.0)
        out["top_k"] = int(cfg.get("top_k") if cfg.get("top_k") is not None else 50)
        out["top_p"] = float(cfg.get("top_p") if cfg.get("top_p") is not None else 1.0)
        out["min_p"] = float(cfg.get("min_p") or 0.0)
    else:
        out["temperature"] = 0.0
    if cfg.get("repetition_penalty") not in (None, 1, 1.0):
        out["repetition_penalty"] = float(cfg["repetition_penalty"])
    if cfg.get("max_new_tokens"):
        out["max_new_tokens"] = int(cfg["max_new_tokens"])
    eos = cfg.get("eos_token_id")
    if eos is not None:
        out["stop_token_ids"] = tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
    return out
