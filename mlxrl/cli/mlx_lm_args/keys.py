"""mlx-lm's keys -> SFTConfig fields: each key's handler, and what mlxrl refuses."""

from __future__ import annotations

import json

from ...errors import ConfigError
from .spec import DEFAULTS, Run

# ------------------------------------------------------------------------------------------ key -> fields

# the SFTConfig fields each key sets (for labels and conflicts)
_FIELD_NAMES = {
    "iters": ("max_steps",), "batch_size": ("per_device_train_batch_size",), "learning_rate": ("learning_rate",),
    "steps_per_report": ("logging_steps",), "steps_per_eval": ("eval_steps",), "save_every": ("save_steps",),
    "max_seq_length": ("max_length",), "grad_checkpoint": ("gradient_checkpointing",), "seed": ("seed",),
    "adapter_path": ("output_dir",), "mask_prompt": ("completion_only_loss",), "report_to": ("report_to",),
    "trust_remote_code": ("trust_remote_code",), "fine_tune_type": ("use_peft", "use_dora"),
    "optimizer": ("optim",), "optimizer_config": ("adam_beta1", "adam_beta2", "adam_epsilon", "weight_decay"),
    "lora_parameters": ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules"),
    "lr_schedule": ("learning_rate", "lr_scheduler_type", "lr_scheduler_kwargs", "warmup_steps"),
}


def _translate(keys: dict, run: Run) -> tuple[dict, dict]:
    """(fields the keys set, fields they imply besides), each computed from the run's merged settings so
    that a key reads its companions (lora_parameters' scale with its rank, lr_schedule with iters)."""
    fields, implied = {}, {}
    for key in keys:
        handler = _HANDLERS.get(key)
        if handler is not None:
            own, extra = handler(run.settings[key], run)
            fields.update(own)
            implied.update(extra)
    return fields, implied


def _simple(name):
    return lambda value, run: ({name: value}, {})


def _batch(value, run):
    return {"per_device_train_batch_size": value}, {"per_device_eval_batch_size": value}


def _learning_rate(value, run):
    return ({}, {}) if run.settings["lr_schedule"] else ({"learning_rate": value}, {})


def _fine_tune(value, run):
    return {"use_peft": value != "full", "use_dora": value == "dora"}, {"freeze_embeddings": value == "full"}


def _mask_prompt(value, run):
    return {"completion_only_loss": bool(value)}, {"assistant_only_loss": False}


def _report_to(value, run):
    if value is None:
        return {"report_to": "none"}, {}
    names = [n.strip() for n in str(value).split(",") if n.strip()]
    if "swanlab" in names:
        raise ConfigError(f"{run.label('report_to')} swanlab: mlxrl reports to wandb and tensorboard only")
    return {"report_to": ",".join(names) or "none"}, {}


def _text_feature(value, run):
    return {}, {"dataset_text_field": value}


def _optimizer(value, run):
    if value in ("muon", "sgd", "adafactor"):
        why = ("MLX's Adafactor takes a relative step (it ignores the learning rate); --optim adafactor is "
               "transformers' with a fixed rate" if value == "adafactor" else "mlxrl's optimizers are AdamW, 8-bit "
               "AdamW and Adafactor")
        raise ConfigError(f"{run.label('optimizer')} {value} is not supported: {why}; use adam or adamw")
    return {"optim": "adamw_torch"}, _optimizer_options(run)


def _optimizer_config(value, run):
    return _optimizer_options(run), {}


_OPTIONS = {"adam": ("betas", "eps", "bias_correction"), "adamw": ("betas", "eps", "weight_decay", "bias_correction")}


def _optimizer_options(run) -> dict:
    """optimizer_config of the chosen optimizer -> AdamW's fields (adamw's weight decay defaults to MLX's 0.01)."""
    name = run.settings["optimizer"]
    options = (run.settings["optimizer_config"] or {}).get(name) or {}
    where = f"{run.label('optimizer_config')}.{name}"
    if not isinstance(options, dict):
        raise ConfigError(f"{where}: expected a mapping of options, got {options!r}")
    unknown = sorted(set(options) - set(_OPTIONS.get(name, ())))
    if unknown:
        raise ConfigError(f"{where}.{unknown[0]}: not supported (mlxrl maps {', '.join(_OPTIONS.get(name, ()))})")
    if options.get("bias_correction") is False:
        raise ConfigError(f"{where}.bias_correction false: mlxrl's AdamW always corrects the moments' bias "
                          "(torch's); drop it")
    out = {"weight_decay": float(options.get("weight_decay", 0.01 if name == "adamw" else 0.0))}
    if "eps" in options:
        out["adam_epsilon"] = float(options["eps"])
    if "betas" in options:
        betas = options["betas"]
        if not isinstance(betas, (list, tuple)) or len(betas) != 2:
            raise ConfigError(f"{where}.betas: expected two numbers, got {betas!r}")
        out["adam_beta1"], out["adam_beta2"] = (float(b) for b in betas)
    return out


_LORA_KEYS = ("rank", "scale", "dropout", "keys")


def _lora(value, run):
    """lora_parameters -> lora_r, lora_alpha (= scale x rank: PEFT scales by alpha / r, mlx-lm by scale),
    lora_dropout, lora_target_modules (each key's last name). Ignored for full fine-tuning, as mlx-lm does."""
    if run.settings["fine_tune_type"] == "full":
        return {}, {}
    where = run.label("lora_parameters")
    if "alpha" in value and "scale" not in value:
        raise ConfigError(f"{where}: mlx-lm's LoRA key is scale (= alpha / rank), not alpha; or use --lora_alpha")
    unknown = sorted(set(value) - set(_LORA_KEYS))
    if unknown:
        raise ConfigError(f"{where}.{unknown[0]}: not one of mlx-lm's LoRA parameters ({', '.join(_LORA_KEYS)})")
    merged = {**DEFAULTS["lora_parameters"], **value}
    try:
        rank, scale, dropout = int(merged["rank"]), float(merged["scale"]), float(merged["dropout"])
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: rank, scale and dropout must be numbers, got {value!r}") from None
    alpha = rank * scale
    if rank < 1 or scale <= 0:
        raise ConfigError(f"{where}: rank must be >= 1 and scale > 0, got rank {rank}, scale {scale:g}")
    if abs(alpha - round(alpha)) > 1e-6:
        raise ConfigError(f"{where}: scale {scale:g} x rank {rank} = lora_alpha {alpha:g}, and mlxrl's lora_alpha is "
                          "an integer (TRL's): choose a scale that makes it whole")
    out = {"lora_r": rank, "lora_alpha": int(round(alpha)), "lora_dropout": dropout}
    if merged.get("keys"):
        keys = merged["keys"] if isinstance(merged["keys"], list) else [merged["keys"]]
        out["lora_target_modules"] = sorted({str(k).split(".")[-1] for k in keys})
    return out, {}


def _schedule(value, run):
    """lr_schedule ({name, arguments, warmup, warmup_init}) -> transformers' schedule of the same shape over
    the steps after the warmup (S = iters - warmup). MLX's cosine_decay [lr, D, end] is
    end + (lr - end) (1 + cos(pi k / D)) / 2: transformers' cosine (cosine_with_min_lr for end > 0) with
    num_cycles S / 2D; its linear_schedule [lr, end, D] falls by (lr - end) / D a step: transformers' linear
    (polynomial of power 1 to lr + (end - lr) S / D, for an end it does not reach). D < S would hold `end`
    for the last steps, which no transformers schedule does: refused. Without warmup the rates are MLX's
    step for step; with one, MLX holds the peak one step longer (its join_schedules boundary is warmup + 1)."""
    if not value:
        return {}, {}
    where = run.label("lr_schedule")
    name, args = value.get("name"), list(value.get("arguments") or [])
    warmup, start = int(value.get("warmup", 0) or 0), float(value.get("warmup_init", 0.0) or 0.0)
    if start != 0:
        raise ConfigError(f"{where}: warmup_init {start:g}: transformers' warmup starts at 0")
    steps = run.settings["iters"] - warmup
    if steps < 1:
        raise ConfigError(f"{where}: warmup {warmup} leaves none of the {run.settings['iters']} iterations")
    try:
        if name == "cosine_decay" and len(args) in (2, 3):
            lr, decay, end = float(args[0]), int(args[1]), float(args[2]) if len(args) == 3 else 0.0
        elif name == "linear_schedule" and len(args) == 3:
            lr, end, decay = float(args[0]), float(args[1]), int(args[2])
        else:
            name = None
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: arguments {args}: expected numbers") from None
    if name is None:
        raise ConfigError(f"{where}: {value.get('name')} {args}: mlxrl maps cosine_decay [lr, steps, end] and "
                          "linear_schedule "
                          "[lr, end, steps] (transformers' cosine and linear schedules)")
    if decay < steps:
        raise ConfigError(f"{where}: {name} ends after {decay} steps and then holds its last rate, which transformers' "
                          f"schedules do not: make it last iters - warmup = {steps} steps (or more)")
    if end > lr:
        raise ConfigError(f"{where}: {name} rising from {lr:g} to {end:g}: transformers' schedules fall")
    if name == "cosine_decay":
        kind, options = ("cosine", {}) if end == 0 else ("cosine_with_min_lr", {"min_lr": end})
        if decay != steps:
            options["num_cycles"] = steps / (2 * decay)
    else:
        reached = lr + (end - lr) * steps / decay
        kind, options = ("linear", {}) if reached == 0 else ("polynomial", {"lr_end": reached, "power": 1.0})
        if end == lr:
            kind, options = "constant", {}
    return {"learning_rate": lr, "lr_scheduler_type": kind, "warmup_steps": warmup,
            "lr_scheduler_kwargs": json.dumps(options) if options else None}, {}


_HANDLERS = {
    "iters": _simple("max_steps"), "batch_size": _batch, "learning_rate": _learning_rate,
    "steps_per_report": _simple("logging_steps"), "steps_per_eval": _simple("eval_steps"),
    "save_every": _simple("save_steps"), "max_seq_length": _simple("max_length"),
    "grad_checkpoint": lambda v, run: ({"gradient_checkpointing": bool(v)}, {}), "seed": _simple("seed"),
    "adapter_path": _simple("output_dir"), "mask_prompt": _mask_prompt, "report_to": _report_to,
    "trust_remote_code": lambda v, run: ({"trust_remote_code": bool(v)}, {}), "fine_tune_type": _fine_tune,
    "optimizer": _optimizer, "optimizer_config": _optimizer_config, "lora_parameters": _lora,
    "lr_schedule": _schedule, "text_feature": _text_feature,
}


def _refuse_unsupported(run: Run) -> None:
    """mlx-lm settings mlxrl cannot honour, each one line naming the flag (or key) and what to do instead."""
    s = run.settings
    refusals = (
        ("resume_adapter_file", s["resume_adapter_file"] is not None,
         "mlxrl cannot start from mlx-lm adapter weights; resume an mlxrl run with --resume_from_checkpoint"),
        ("grad_accumulation_steps", s["grad_accumulation_steps"] != 1,
         "mlx-lm counts micro-batches as iterations; use --gradient_accumulation_steps (optimizer steps, TRL's)"),
        ("clear_cache_threshold", s["clear_cache_threshold"] not in (0, None),
         "use --cache_limit (mx.set_cache_limit) to bound MLX's buffer cache"),
        ("project_name", s["project_name"] is not None, "set the WANDB_PROJECT environment variable instead"),
        ("hf_dataset", s.get("hf_dataset") not in (None, False, {}, []),
         "use --dataset NAME --dataset_split SPLIT (and --eval_dataset)"),
    )
    for key, bad, instead in refusals:
        if bad:
            raise ConfigError(f"{run.label(key)}={s[key]!r} is not supported: {instead}")
    if s["test"] and not s["train"]:
        raise ConfigError(f"{run.label('test')} without --train tests saved adapters without training, which "
                          "python -m mlxrl.sft does not do: add --train (train, then test)")
    if "learning_rate" in run.given and s["lr_schedule"]:
        raise ConfigError(f"{run.label('learning_rate')}: unused with lr_schedule (mlx-lm takes the schedule's first "
                          "argument): drop one")
    for key in ("iters", "batch_size", "steps_per_report", "steps_per_eval", "max_seq_length"):
        if s[key] < 1:
            raise ConfigError(f"{run.label(key)} {s[key]}: must be >= 1")
    for key in ("val_batches", "test_batches"):
        if s[key] < 1 and s[key] != -1:
            raise ConfigError(f"{run.label(key)} {s[key]}: must be >= 1, or -1 for all")
