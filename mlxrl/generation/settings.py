"""Sampling settings and their defaults (a model's generation_config.json, as transformers reads it)."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import MlxrlError
from .engine import DEFAULT_STOP_TOKEN_IDS

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

    def problem(self) -> str | None:
        """The first setting out of its range, as "name value: must be ..." (None when all are in range)."""
        bad = [(n, v, want) for n, v, ok, want in (
            ("max_new_tokens", self.max_new_tokens, self.max_new_tokens >= 1, ">= 1"),
            ("temperature", self.temperature, self.temperature >= 0, ">= 0"),
            ("top_p", self.top_p, 0 < self.top_p <= 1, "in (0, 1]"),
            ("top_k", self.top_k, self.top_k >= 0, ">= 0"),
            ("min_p", self.min_p, 0 <= self.min_p <= 1, "in [0, 1]"),
            ("repetition_penalty", self.repetition_penalty, self.repetition_penalty > 0, "> 0"),
        ) if not ok]
        if not bad:
            return None
        name, value, want = bad[0]
        return f"{name} {value}: must be {want}"

    def check(self) -> Settings:
        """Self, or one line naming the flag out of range."""
        problem = self.problem()
        if problem:
            raise MlxrlError(f"--{problem}")
        return self


def _field(cfg: dict, key: str, kind: type, path: Path, default=None):
    """cfg[key] as `kind` (bool, int or float; JSON null or absent: `default`, as transformers reads it),
    or one line naming the file and the field (a string, a list, a fraction where an integer belongs)."""
    value = cfg.get(key)
    if value is None:
        return default
    if kind is bool:
        ok = isinstance(value, bool)
    else:
        ok = not isinstance(value, bool) and isinstance(value, (int, float)) and \
            (kind is float or (math.isfinite(value) and float(value).is_integer()))
    if not ok:
        want = {bool: "true or false", int: "an integer", float: "a number"}[kind]
        raise MlxrlError(f"{path}: {key} is {json.dumps(value)}, not {want}: fix the file or remove the field")
    return kind(value)


def _stop_ids(cfg: dict, path: Path) -> tuple[int, ...] | None:
    """eos_token_id: an id or a list of ids (None when absent)."""
    eos = cfg.get("eos_token_id")
    if eos is None:
        return None
    ids = eos if isinstance(eos, list) else [eos]
    if not all(isinstance(e, int) and not isinstance(e, bool) and e >= 0 for e in ids):
        raise MlxrlError(f"{path}: eos_token_id is {json.dumps(eos)}, not a token id or a list of token ids: fix "
                         "the file or remove the field")
    return tuple(ids)


def generation_config_defaults(folder) -> dict:
    """Settings fields from `folder/generation_config.json`, as transformers' `generate()` reads it:
    sampling only with do_sample (else greedy), absent fields at transformers' global defaults
    (temperature 1, top_k 50, top_p 1); eos_token_id (an id or a list) are the stop tokens.
    {} when the folder has no such file. A field of the wrong type or out of range is one line naming
    the file and the field."""
    path = Path(folder) / "generation_config.json" if folder else None
    if path is None or not path.is_file():
        return {}
    try:
        cfg = json.loads(path.read_text())
    except ValueError as e:
        raise MlxrlError(f"{path} is not valid JSON ({e})") from None
    except OSError as e:
        raise MlxrlError(f"{path}: cannot read it ({e.strerror or e})") from None
    if not isinstance(cfg, dict):
        raise MlxrlError(f"{path}: expected a JSON object")
    out: dict = {}
    if _field(cfg, "do_sample", bool, path, False):
        out["temperature"] = _field(cfg, "temperature", float, path, 1.0)
        out["top_k"] = _field(cfg, "top_k", int, path, 50)
        out["top_p"] = _field(cfg, "top_p", float, path, 1.0)
        out["min_p"] = _field(cfg, "min_p", float, path, 0.0)
    else:
        for key, kind in (("temperature", float), ("top_k", int), ("top_p", float), ("min_p", float)):
            _field(cfg, key, kind, path)  # unused when greedy, but a bad value is still named
        out["temperature"] = 0.0
    repetition_penalty = _field(cfg, "repetition_penalty", float, path)
    if repetition_penalty not in (None, 1.0):
        out["repetition_penalty"] = repetition_penalty
    max_new_tokens = _field(cfg, "max_new_tokens", int, path)
    if max_new_tokens is not None:
        out["max_new_tokens"] = max_new_tokens
    stop = _stop_ids(cfg, path)
    if stop is not None:
        out["stop_token_ids"] = stop
    problem = Settings(**out).problem()  # in range, as transformers' GenerationConfig.validate asks
    if problem:
        raise MlxrlError(f"{path}: {problem}")
    return out
