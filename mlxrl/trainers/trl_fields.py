"""transformers' TrainingArguments fields that TRL's configs inherit and mlxrl has no use for.

Each is a field of every mlxrl config (`TrainConfig` inherits them from `ElsewhereArguments`), so a
TRL script, YAML file or command line that names one is read as TRL reads it: at TRL's default it
is accepted (the default is what mlxrl does), any other value is refused by `config.check_config`
in one line saying why and what to use instead. They are left out of `--help` (`hidden`).
`tests/test_trl_fields.py` checks that every field of TRL's SFTConfig, DPOConfig and GRPOConfig is a
field of ours, with TRL's default where it is one of these.

Below them, the checks of the TRL / TrainingArguments fields that do work here and need more than a type,
a range or a choice (`config.check_config` calls them): the *_kwargs mappings, pad_to_multiple_of,
load_best_model_at_end, bf16 against the model given.
"""

from __future__ import annotations

import dataclasses
import math

from ..errors import ConfigError

DISTRIBUTED = "mlxrl runs one process per device on mx.distributed (mlx.launch; docs/distributed.md)"
DATA = "batches are prepared on one background thread of the trainer's process"
HUB = "upload output_dir (its folders are in the Hub's layouts) with `huggingface-cli upload`"
TORCH = "a torch option; mlxrl's step is compiled with mx.compile (--compile)"
LOGGING = "mlxrl logs every logging_steps optimizer steps to stdout and metrics.jsonl (report_to for W&B / TensorBoard)"
EVAL = "mlxrl's evaluation computes the loss over the whole evaluation set (no predictions kept)"
SCRIPTS = "a flag of HF's example scripts, which the Trainer itself ignores"

# name: (annotation, TRL's default, why not here)
ELSEWHERE: dict[str, tuple[object, object, str]] = {
    "optim_args": ("str | None", None, "AdamW's options are adam_beta1 / adam_beta2 / adam_epsilon / weight_decay"),
    "optim_target_modules": ("str | None", None, "GaLore / APOLLO optimizers are not implemented"),
    "average_tokens_across_devices": ("bool", True, "the loss is always normalised by the tokens of every rank"),
    "label_smoothing_factor": ("float", 0.0, "the streamed LM head computes each label's log-probability only"),
    "bf16_full_eval": ("bool", False, "evaluation runs in the model's dtype (--dtype / --bf16)"),
    "fp16_full_eval": ("bool", False, "float16 is not supported (use --bf16)"),
    "torch_compile": ("bool", False, TORCH),
    "torch_compile_backend": ("str | None", None, TORCH),
    "torch_compile_mode": ("str | None", None, TORCH),
    "use_liger_kernel": ("bool", False, "Liger's kernels are torch's; mlxrl's LM head is already fused (--head_mode)"),
    "liger_kernel_config": ("str | None", None, "Liger's kernels are torch's; mlxrl's LM head is already fused"),
    "use_cache": ("bool", False, "training never keeps a KV cache; generation always does"),
    "neftune_noise_alpha": ("float | None", None, "NEFTune is SFT's here (SFTTrainer adds the noise)"),
    "torch_empty_cache_steps": ("int | None", None, "MLX's cache: --cache_limit"),
    "auto_find_batch_size": ("bool", False, "the memory planner predicts the peak: `python -m mlxrl.plan`"),
    "logging_strategy": ("str", "steps", LOGGING),
    "log_on_each_node": ("bool", True, DISTRIBUTED),
    "logging_nan_inf_filter": ("bool", True, "a non-finite loss stops the run with a resumable checkpoint"),
    "include_num_input_tokens_seen": ("str", "no", "SFT logs num_tokens, the tokens seen so far"),
    "log_level": ("str", "passive", "mlxrl prints its progress; MLXRL_DEBUG=1 shows an error's traceback"),
    "log_level_replica": ("str", "warning", DISTRIBUTED),
    "project": ("str", "huggingface", "Trackio is not supported (report_to: wandb, tensorboard)"),
    "trackio_space_id": ("str | None", None, "Trackio is not supported (report_to: wandb, tensorboard)"),
    "trackio_bucket_id": ("str | None", None, "Trackio is not supported (report_to: wandb, tensorboard)"),
    "trackio_static_space_id": ("str | None", None, "Trackio is not supported (report_to: wandb, tensorboard)"),
    "eval_delay": ("float", 0, "evaluation follows eval_strategy from the first step"),
    "prediction_loss_only": ("bool", False, EVAL),
    "eval_do_concat_batches": ("bool", True, EVAL),
    "eval_use_gather_object": ("bool", False, DISTRIBUTED),
    "eval_accumulation_steps": ("int | None", None, EVAL),
    "include_for_metrics": ("list[str] | None", None, EVAL),
    "batch_eval_metrics": ("bool", False, EVAL),
    "save_only_model": ("bool", False, "every checkpoint is resumable: model, optimizer, scheduler and data position"),
    "save_on_each_node": ("bool", False, DISTRIBUTED),
    "enable_jit_checkpoint": ("bool", False, "Ctrl-C and SIGTERM always leave a resumable checkpoint"),
    "push_to_hub": ("bool", False, HUB),
    "hub_token": ("str | None", None, HUB),
    "hub_private_repo": ("bool | None", None, HUB),
    "hub_model_id": ("str | None", None, HUB),
    "hub_strategy": ("str", "every_save", HUB),
    "hub_always_push": ("bool", False, HUB),
    "hub_revision": ("str | None", None, HUB),
    "restore_callback_states_from_checkpoint": ("bool", False, "mlxrl has no callbacks"),
    "full_determinism": ("bool", False, "a run is a function of its seed already (MLX's kernels are deterministic)"),
    "accelerator_config": ("str | None", None, DISTRIBUTED),
    "parallelism_config": ("str | None", None, DISTRIBUTED),
    "dataloader_num_workers": ("int", 0, DATA),
    "dataloader_pin_memory": ("bool", True, DATA),
    "dataloader_persistent_workers": ("bool", False, DATA),
    "dataloader_prefetch_factor": ("int | None", None, DATA),
    "dataloader_multiprocessing_context": ("str | None", None, DATA),
    "dataloader_in_order": ("bool", True, DATA),
    "label_names": ("list[str] | None", None, "each trainer knows its labels"),
    "length_column_name": ("str", "length", "the batches are shuffled every epoch (seed, data_seed)"),
    "ddp_find_unused_parameters": ("bool | None", None, DISTRIBUTED),
    "ddp_bucket_cap_mb": ("int | None", None, DISTRIBUTED),
    "ddp_broadcast_buffers": ("bool | None", None, DISTRIBUTED),
    "ddp_static_graph": ("bool | None", None, DISTRIBUTED),
    "ddp_backend": ("str | None", None, DISTRIBUTED),
    "ddp_timeout": ("int", 1800, DISTRIBUTED),
    "fsdp": ("str | None", None, DISTRIBUTED),
    "fsdp_config": ("str | None", None, DISTRIBUTED),
    "deepspeed": ("str | None", None, DISTRIBUTED),
    "local_rank": ("int", -1, DISTRIBUTED),
    "debug": ("str", "", "MLXRL_DEBUG=1 shows an error's traceback"),
    "skip_memory_metrics": ("bool", True, "the memory planner and the logged peak memory cover it"),
    "do_train": ("bool", False, SCRIPTS),
    "do_eval": ("bool", False, SCRIPTS),
    "do_predict": ("bool", False, SCRIPTS),
}


def _field(default, reason):
    return dataclasses.field(default=default, metadata={"help": f"not supported: {reason}", "refused": reason,
                                                         "hidden": True})


# The fields' annotations are strings, as `from __future__ import annotations` makes every other config's.
ElsewhereArguments = dataclasses.make_dataclass(
    "ElsewhereArguments", [(name, annotation, _field(default, why))
                           for name, (annotation, default, why) in ELSEWHERE.items()])
ElsewhereArguments.__doc__ = "TrainingArguments fields with no counterpart in mlxrl (see the module's docstring)."
ElsewhereArguments.__module__ = __name__


# ---------------------------------------------------------- the TRL fields that work: their checks

def parse_mapping(name: str, value, example: str) -> dict:
    """A mapping-valued field (TrainingArguments' *_kwargs): a dict (Python, YAML) or its JSON text (a flag);
    None is empty. One-line ConfigError otherwise, showing `example`."""
    import json

    if value is None or value == "":
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise ConfigError(f"{name} {value!r}: expected a JSON object such as {example}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{name}: expected a mapping such as {example}, got {value!r}")
    return value


def checkpointing_kwargs(args) -> dict:
    """activation_checkpointing_kwargs (or its old name), checked: its only key may be torch's use_reentrant
    (both of torch's variants compute the same gradients; MLX has one)."""
    out = {}
    for name in ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs"):
        value = parse_mapping(name, getattr(args, name, None), '{"use_reentrant": false}')
        other = sorted(set(value) - {"use_reentrant"})
        if other:
            raise ConfigError(f"{name}: {', '.join(map(repr, other))} not supported (torch's checkpoint options; "
                              "MLX's checkpointing has none but use_reentrant, which changes nothing here)")
        out.update(value)
    return out


def check_best_model(args, p: str = "") -> None:
    """load_best_model_at_end as transformers' TrainingArguments checks it: an evaluation, and checkpoints
    saved when it runs (the same strategy; with steps, save_steps a multiple of eval_steps)."""
    if not getattr(args, "load_best_model_at_end", False):
        return
    if args.eval_strategy == "no" or args.save_strategy != args.eval_strategy:
        raise ConfigError(f"{p}load_best_model_at_end needs {p}eval_strategy and {p}save_strategy to be the same "
                          f"(steps or epoch), got {args.eval_strategy} and {args.save_strategy}")
    every, save = args.eval_steps or args.logging_steps, args.save_steps
    if args.eval_strategy != "steps":
        return
    if (save < 1) != (every < 1):
        raise ConfigError(f"{p}load_best_model_at_end needs {p}save_steps ({save:g}) and {p}eval_steps ({every:g}) "
                          "both as step counts or both as fractions of the total steps")
    if not save or round(save * 10**6) % round(every * 10**6):  # transformers' check, ratios included
        raise ConfigError(f"{p}load_best_model_at_end needs {p}save_steps ({save:g}) to be a multiple of "
                          f"{p}eval_steps ({every:g}): a checkpoint where each evaluation runs")


def every_steps(value: float | None, total: int) -> int:
    """logging_steps / eval_steps / save_steps as transformers' Trainer reads them: below 1, a fraction of
    the total optimizer steps (rounded up); otherwise a step count. 0 stays 0 (never)."""
    if not value:
        return 0
    return max(1, math.ceil(total * value)) if value < 1 else int(value)


def best_metric_key(args) -> tuple[str, bool]:
    """(log key of metric_for_best_model, whether greater is better), transformers' defaults."""
    name = args.metric_for_best_model or "loss"
    name = name if name.startswith("eval_") else f"eval_{name}"
    greater = args.greater_is_better
    return name, (name not in ("eval_loss",) and not name.endswith("_loss")) if greater is None else bool(greater)


def check_model_dtype(args, dtype) -> None:
    """bf16 set in a config (TRL's flag) must match the model given to the trainer: mlxrl computes in the
    model's dtype and changes no parameter's dtype (the CLIs load the model in the dtype it asks for)."""
    bf16 = getattr(args, "bf16", None)
    if bf16 is not None and (str(dtype).endswith("bfloat16") != bool(bf16)):
        want = "bfloat16" if bf16 else "float32"
        raise ConfigError(f"bf16={bf16}, but the model computes in {str(dtype).split('.')[-1]}: load it in {want} "
                          f"(mlxrl.load(..., dtype={want!r})) or leave bf16 unset")


def multiple_of(args, flags: bool = False) -> int | None:
    """pad_to_multiple_of as an int (None for unset or TRL's 'auto', which pads only on AWS Neuron)."""
    value = getattr(args, "pad_to_multiple_of", None)
    if value is None or str(value).strip().lower() == "auto":
        return None
    try:
        m = int(str(value).strip())
    except ValueError:
        m = 0
    if m < 1:
        raise ConfigError(f"{'--' if flags else ''}pad_to_multiple_of {value!r}: must be a positive integer or 'auto'")
    return m
