"""The planner's input: a model's config.json, read and checked before anything is built from it.

The memory model turns config.json's sizes into layer counts, widths and divisions; a damaged file
(a string, zero or a negative number where a size belongs, a JSON list, no model_type) would surface
as a ZeroDivisionError or a TypeError deep inside the model's constructor. `load_config` refuses it
first, in one line naming the file and the field (`MlxrlError`, which the CLIs print without a
traceback).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..errors import MlxrlError

# the language model's sizes: every supported model_type needs these (TextConfig's required fields)
TEXT_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
# optional sizes: when present (and not null) they must be positive integers too
TEXT_OPTIONAL = ("num_key_value_heads", "head_dim", "max_position_embeddings")
# the vision tower's sizes (each family has defaults for the ones a config.json leaves out)
VISION_SIZES = ("depth", "hidden_size", "embed_dim", "intermediate_size", "num_heads", "patch_size",
                "spatial_merge_size", "temporal_patch_size", "out_hidden_size", "in_channels")
TEXT_FLAGS = ("tie_word_embeddings", "attention_bias")
DAMAGED = "a damaged config.json: re-download the checkpoint"


def load_config(model: str | os.PathLike | None = None) -> dict:
    """config.json of a local folder or cached Hub id (weights are never read); None: the embedded default.
    A file the planner cannot use is an MlxrlError naming it and its field (`check_config_json`)."""
    from ..hub import resolve_model_path
    from ..loading import DEFAULT_CONFIG, read_config

    if model is None:
        cfg = json.loads(Path(DEFAULT_CONFIG).read_text())
        cfg.pop("preprocessor_config", None)
        return cfg
    p = Path(model).expanduser()
    folder = p if (p / "config.json").exists() else resolve_model_path(str(model))
    where = folder / "config.json"
    try:
        cfg = read_config(folder)
    except OSError as e:  # a folder named config.json, no permission
        raise MlxrlError(f"cannot read {where}: {e.strerror or e}") from None
    check_config_json(cfg, str(where))
    cfg.pop("preprocessor_config", None)
    return cfg


def check_config_json(cfg, where: str = "config.json") -> None:
    """Refuse what would break the planner's model of `cfg`: not a JSON object, a missing or unsupported
    model_type, a language-model size that is missing or not a positive integer (booleans included: JSON's
    true is not a width), a vision size or an MLX quantization entry of the wrong kind. `where`: the file."""
    vl = _check_model_type(where, cfg)
    _check_text(where, cfg, vl)
    vision = cfg["vision_config"] if vl else {}
    for name in VISION_SIZES:
        if vision.get(name) is not None:
            _positive_int(where, f"vision_config.{name}", vision[name])
    _check_quantization(where, cfg)


def _check_model_type(where: str, cfg) -> bool:
    """A JSON object with a supported model_type; a VL one with its text_config / vision_config objects.
    Returns whether the model is a vision-language one."""
    from ..models import ARCHITECTURES, VL_TYPES

    if not isinstance(cfg, dict):
        raise MlxrlError(f"{where}: expected a JSON object of model settings, got a JSON {_json_kind(cfg)}; {DAMAGED}")
    model_type = cfg.get("model_type")
    if model_type is None:
        raise MlxrlError(f"{where}: no model_type field (e.g. \"model_type\": \"qwen3\"); {DAMAGED}")
    if not isinstance(model_type, str) or model_type not in ARCHITECTURES:
        raise MlxrlError(f"{where}: unsupported model_type {model_type!r}: mlxrl supports {', '.join(ARCHITECTURES)}")
    if model_type not in VL_TYPES:
        return False
    if cfg.get("vision_config") is None:  # every Qwen-VL release has one; the planner sizes images by it
        raise MlxrlError(f"{where}: missing field vision_config (the {model_type} vision tower's settings); {DAMAGED}")
    for name in ("text_config", "vision_config"):
        if cfg.get(name) is not None and not isinstance(cfg[name], dict):
            raise MlxrlError(f"{where}: {name} must be a JSON object, got a JSON {_json_kind(cfg[name])}; {DAMAGED}")
    return True


def _check_text(where: str, cfg: dict, vl: bool) -> None:
    """The language model's sizes (required and optional), its true / false settings and its heads."""
    text = _text_fields(cfg, vl)
    for name in TEXT_SIZES:
        if name not in text:
            raise MlxrlError(f"{where}: missing field {_label(cfg, name, vl)} (a language-model size); {DAMAGED}")
        _positive_int(where, _label(cfg, name, vl), text[name])
    for name in TEXT_OPTIONAL:
        if text.get(name) is not None:
            _positive_int(where, _label(cfg, name, vl), text[name])
    for name in TEXT_FLAGS:
        if text.get(name) is not None and not isinstance(text[name], bool):
            raise MlxrlError(f"{where}: {_label(cfg, name, vl)} must be true or false, got {text[name]!r}; {DAMAGED}")
    _check_heads(where, cfg, text, vl)


def _text_fields(cfg: dict, vl: bool) -> dict:
    """The language model's settings as the models read them: a VL config's nested text_config over its
    top level (`models.vl.text_config_dict`), a text model's top level."""
    if not vl:
        return cfg
    flat = {k: v for k, v in cfg.items() if k not in ("vision_config", "text_config")}
    return {**flat, **(cfg.get("text_config") or {})}


def _label(cfg: dict, name: str, vl: bool) -> str:
    """Where `name` sits in the file: text_config.<name> when a VL config nests it (or nests the text
    settings at all and lacks it), <name> at the top level otherwise."""
    nested = cfg.get("text_config") if vl else None
    if isinstance(nested, dict) and (name in nested or name not in cfg):
        return f"text_config.{name}"
    return name


def _positive_int(where: str, label: str, value) -> None:
    # bool is an int in Python: `true` would pass as a width of 1
    if isinstance(value, bool) or not isinstance(value, int):
        raise MlxrlError(f"{where}: {label} must be a positive integer, got {value!r}; {DAMAGED}")
    if value < 1:
        raise MlxrlError(f"{where}: {label} must be a positive integer, got {value}; {DAMAGED}")


def _check_heads(where: str, cfg: dict, text: dict, vl: bool) -> None:
    """Grouped-query attention shares each key/value head among a whole number of query heads; without
    head_dim the head width is hidden_size / num_attention_heads, which must be whole."""
    heads, kv = text["num_attention_heads"], text.get("num_key_value_heads")
    if kv is not None and heads % kv:
        raise MlxrlError(f"{where}: {_label(cfg, 'num_attention_heads', vl)} {heads} is not a multiple of "
                         f"{_label(cfg, 'num_key_value_heads', vl)} {kv}; {DAMAGED}")
    if text.get("head_dim") is None and text["hidden_size"] % heads:
        raise MlxrlError(f"{where}: {_label(cfg, 'hidden_size', vl)} {text['hidden_size']} is not a multiple of "
                         f"{_label(cfg, 'num_attention_heads', vl)} {heads} (and there is no head_dim); {DAMAGED}")


def _check_quantization(where: str, cfg: dict) -> None:
    """An MLX-quantized checkpoint's entry (`models.quantize.checkpoint_quantization`: other formats are
    refused there): the bits and group size the planner counts the frozen base with."""
    from ..models.quantize import checkpoint_quantization

    q = checkpoint_quantization(cfg, where)
    if not q:
        return
    key = "quantization" if cfg.get("quantization") is not None else "quantization_config"
    for name in ("bits", "group_size"):
        if q.get(name) is not None:
            _positive_int(where, f"{key}.{name}", q[name])


def _json_kind(value) -> str:
    """JSON's name for a parsed value's type (a list is a JSON array, a str a string)."""
    names = {list: "array", str: "string", bool: "boolean", int: "number", float: "number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def quantization_of(cfg: dict, args) -> tuple[int, int] | None:
    """(bits, group size) of the frozen base: `load_in_4bit` / `load_in_8bit` (`q_group_size`), or an
    MLX-quantized checkpoint's `quantization` entry; None for a float base."""
    if (asked := args.quantization) is not None:
        return asked
    q = cfg.get("quantization") or cfg.get("quantization_config")
    if isinstance(q, dict) and q.get("bits"):
        return int(q["bits"]), int(q.get("group_size", 64))
    return None
