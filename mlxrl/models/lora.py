"""LoRA / DoRA on our models with mlx-lm's layers, saved in PEFT's layout.

PEFT layout: `adapter_config.json` + `adapter_model.safetensors` with keys
`base_model.model.<module path>.lora_A.weight` [r, in] and `.lora_B.weight` [out, r]
(DoRA adds `.lora_magnitude_vector` [out]); the update is W + (alpha / r) * B A.
mlx-lm stores lora_a [in, r] and lora_b [r, out] with `scale` = alpha / r.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.tuner.dora import DoRALinear
from mlx_lm.tuner.lora import LoRALinear

# PEFT's "all-linear" for a Qwen decoder (the LM head excluded)
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _is_vision(path: str) -> bool:
    return path.startswith(("visual.", "model.visual."))


def apply_lora(model: nn.Module, *, r: int = 16, alpha: float = 32, dropout: float = 0.05,
               target_modules=None, use_dora: bool = False, include_vision: bool = False) -> list[str]:
    """Freeze the model and wrap the target Linear layers with LoRA (or DoRA). Returns the paths."""
    targets = tuple(target_modules or DEFAULT_TARGETS)
    if targets == ("all-linear",):
        targets = DEFAULT_TARGETS
    model.freeze()
    cls = DoRALinear if use_dora else LoRALinear
    replaced = []
    for path, module in model.named_modules():
        if not isinstance(module, nn.Linear) or isinstance(module, (LoRALinear, DoRALinear)):
            continue
        if path.split(".")[-1] not in targets or (_is_vision(path) and not include_vision):
            continue
        replaced.append(path)
    if not replaced:
        raise ValueError(f"lora_target_modules {list(targets)} match no Linear layer of this model")
    updates = [(p, cls.from_base(_get(model, p), r=r, dropout=dropout, scale=alpha / r)) for p in replaced]
    _set_modules(model, updates)
    # a plain attribute (not a child of the module tree, which would treat the dict as parameters)
    cfg = {"r": r, "lora_alpha": alpha, "lora_dropout": dropout, "use_dora": use_dora,
           "target_modules": sorted({p.split(".")[-1] for p in replaced}), "paths": replaced}
    object.__setattr__(model, "lora_config", cfg)
    return replaced


def _get(model, path):
    obj = model
    for part in path.split("."):
        obj = obj[int(part)] if part.isdigit() else getattr(obj, part)
    return obj


def _set_modules(model, updates):
    for path, new in updates:
        parent, name = path.rsplit(".", 1)
        holder = _get(model, parent)
        if name.isdigit():
            holder[int(name)] = new
        else:
            setattr(holder, name, new)


def lora_layers(model) -> list[tuple[str, nn.Module]]:
    return [(p, m) for p, m in model.named_modules() if isinstance(m, (LoRALinear, DoRALinear))]


def peft_state(model) -> dict[str, mx.array]:
    """Adapter weights under PEFT's names and layouts."""
    out = {}
    for path, m in lora_layers(model):
        key = f"base_model.model.{path}"
        out[f"{key}.lora_A.weight"] = m.lora_a.T
        out[f"{key}.lora_B.weight"] = m.lora_b.T
        if isinstance(m, DoRALinear):
            out[f"{key}.lora_magnitude_vector"] = m.m
    return out


def save_adapter(model, out_dir, base_model_name: str | None = None) -> Path:
    """adapter_config.json + adapter_model.safetensors (PEFT layout)."""
    cfg = model.lora_config
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "adapter_model.safetensors"), peft_state(model), metadata={"format": "pt"})
    peft_cfg = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg["r"], "lora_alpha": cfg["lora_alpha"],
        "lora_dropout": cfg["lora_dropout"], "use_dora": cfg["use_dora"], "bias": "none",
        "target_modules": cfg["target_modules"], "base_model_name_or_path": base_model_name,
        "inference_mode": True, "fan_in_fan_out": False,
        # vision layers are not adapted unless asked: keep PEFT from matching them on load
        "exclude_modules": None if any(_is_vision(p) for p in cfg["paths"]) else r".*visual.*",
    }
    (out / "adapter_config.json").write_text(json.dumps(peft_cfg, indent=2))
    return out


def load_adapter(model, adapter_dir) -> None:
    """Apply a PEFT-layout adapter saved by `save_adapter` (or PEFT) to a fresh model."""
    adapter_dir = Path(adapter_dir)
    cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
    weights = mx.load(str(adapter_dir / "adapter_model.safetensors"))
    paths = sorted({k[len("base_model.model."):].rsplit(".lora_", 1)[0] for k in weights})
    include_vision = any(_is_vision(p) for p in paths)
    apply_lora(model, r=cfg["r"], alpha=cfg["lora_alpha"], dropout=cfg.get("lora_dropout", 0.0),
               target_modules=cfg["target_modules"], use_dora=cfg.get("use_dora", False),
               include_vision=include_vision)
    for path, m in lora_layers(model):
        key = f"base_model.model.{path}"
        m.lora_a = weights[f"{key}.lora_A.weight"].T
        m.lora_b = weights[f"{key}.lora_B.weight"].T
        if isinstance(m, DoRALinear):
            m.m = weights[f"{key}.lora_magnitude_vector"]


def merge_lora(model) -> None:
    """Fold every adapter into its base Linear (W + scale * B A); the model is plain again."""
    _set_modules(model, [(p, m.fuse()) for p, m in lora_layers(model)])
    model.__dict__.pop("lora_config", None)


def trainable_count(model) -> tuple[int, int]:
    trainable = sum(v.size for _, v in tree_flatten(model.trainable_parameters()))
    total = sum(v.size for _, v in tree_flatten(model.parameters()))
    return trainable, total
