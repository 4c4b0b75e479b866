"""Model registry: config.json's `model_type` -> the MLX module that implements it."""

from __future__ import annotations

import importlib
import re

import mlx.core as mx

from ..errors import MlxrlError

# model_type -> module under mlxrl.models defining `Model`
ARCHITECTURES = {
    "qwen2": "qwen_text",
    "qwen3": "qwen_text",
    "qwen3_moe": "qwen_text",
    "qwen2_vl": "qwen2_vl.model",
    "qwen2_5_vl": "qwen2_5_vl.model",
    "qwen3_vl": "qwen3_vl.model",
    "qwen3_vl_moe": "qwen3_vl.model",
    "qwen3_5": "qwen3_5.vl",
    "qwen3_5_text": "qwen3_5.model",
    "qwen3_5_moe": "qwen3_5.vl",
    "qwen3_5_moe_text": "qwen3_5.model",
    "qwen3_next": "qwen3_5.model",
}

VL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")


class UnsupportedModelError(ValueError):
    pass


def model_class(config: dict):
    model_type = config.get("model_type")
    if model_type not in ARCHITECTURES:
        hint = ""
        raise UnsupportedModelError(
            f"unsupported model_type {model_type!r}{hint}: mlxrl supports {', '.join(ARCHITECTURES)}"
        )
    return importlib.import_module(f"{__name__}.{ARCHITECTURES[model_type]}").Model


def build_model(config: dict):
    """An uninitialised-weights model for `config` (a parsed config.json). A config whose model_type we
    support but whose fields are missing or malformed is an UnsupportedModelError in one line."""
    if not isinstance(config, dict):
        raise UnsupportedModelError(f"expected a JSON object, got {type(config).__name__}")
    cls = model_class(config)
    try:
        return cls(config)
    except Exception as e:  # the config's values flow into dataclasses, shapes and layer counts
        text = (str(e).strip().splitlines() or [""])[0]
        if isinstance(e, RuntimeError):  # the device or allocator failing (a CUDA error, no memory): not the config
            raise MlxrlError(f"building the {config.get('model_type')} model failed on {mx.default_device()} "
                             f"(RuntimeError: {text})") from None
        missing = re.findall(r"'(\w+)'", text) if "required" in text and "argument" in text else []
        if missing:
            why = f"is missing field(s) {', '.join(missing)}"
        else:
            why = f"has a field mlxrl cannot use ({type(e).__name__}: {text})"
        raise UnsupportedModelError(f"model_type {config.get('model_type')!r} {why}: an incomplete or damaged "
                                    "config.json; re-download the checkpoint") from None
