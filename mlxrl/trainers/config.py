"""Trainer configs: one dataclass per trainer is the single source of its CLI flags.

Field names and defaults are TRL's (and transformers' TrainingArguments') where they have them;
our additions are marked "(mlxrl)". Precedence: CLI > YAML (`--config file.yaml`) > defaults.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import types
import typing
from dataclasses import dataclass, field


def _f(default, help, **kw):
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class TrainConfig:
    """What every trainer shares (the engine's knobs)."""

    output_dir: str = _f("out", "where checkpoints, metrics.jsonl and the final model go")
    overwrite_output_dir: bool = _f(False, "Overwrite the content of the output directory. Use this to continue "
                                           "training if output_dir points to a checkpoint directory.")
    learning_rate: float = _f(2e-5, "peak learning rate of AdamW")
    num_train_epochs: float = _f(3.0, "epochs over the training set (ignored when max_steps > 0)")
    max_steps: int = _f(-1, "optimizer steps to run; > 0 overrides num_train_epochs")
    per_device_train_batch_size: int = _f(8, "examples (or packed rows) per micro-batch")
    per_device_eval_batch_size: int = _f(8, "examples per evaluation batch")
    gradient_accumulation_steps: int = _f(1, "micro-batches per optimizer step")
    lr_scheduler_type: str = _f("linear", "linear | cosine | constant (after warmup)")
    warmup_ratio: float = _f(0.0, "fraction of the steps spent warming up (used when warmup_steps is 0)")
    warmup_steps: int = _f(0, "linear warmup steps")
    weight_decay: float = _f(0.0, "AdamW weight decay")
    adam_beta1: float = _f(0.9, "AdamW beta1")
    adam_beta2: float = _f(0.999, "AdamW beta2")
    adam_epsilon: float = _f(1e-8, "AdamW epsilon")
    max_grad_norm: float = _f(1.0, "clip the global gradient norm to this (0 disables)")
    optim: str = _f("adamw_torch", "adamw_torch (AdamW; adamw_torch_fused is the same here) | adafactor "
                                   "(transformers' Adafactor as the HF Trainer sets it up: factored second moments, "
                                   "no first moment, a fraction of AdamW's state)")
    logging_steps: int = _f(10, "log every N optimizer steps")
    eval_strategy: str = _f("no", "no | steps | epoch")
    eval_steps: int | None = _f(None, "evaluate every N steps (eval_strategy=steps; default logging_steps)")
    save_strategy: str = _f("steps", "no | steps | epoch")
    save_steps: int = _f(500, "save a resumable checkpoint every N steps")
    save_total_limit: int | None = _f(None, "keep at most this many checkpoints (oldest deleted)")
    resume_from_checkpoint: str | None = _f(None, "checkpoint folder to resume from, or 'last'")
    seed: int = _f(42, "seed for data order, LoRA init and dropout")
    report_to: str = _f("none", "none | wandb | tensorboard | all, or a comma-separated list (metrics.jsonl always)")
    run_name: str | None = _f(None, "run name for W&B")
    logging_dir: str | None = _f(None, "TensorBoard log folder (default: output_dir/runs)")
    gradient_checkpointing: bool = _f(True, "recompute each decoder layer in backward (less memory, more compute)")
    dtype: str | None = _f(None, "(mlxrl) float32 | bfloat16 (default: fp32 on CPU, bf16 on GPU); float16 cannot train "
                                 "(no loss scaling): use bfloat16")
    master_weights: bool = _f(True, "(mlxrl) with a bf16 model: keep a float32 master copy of the trainable weights "
                                    "(as torch AMP); false: update the bf16 weights with stochastic rounding instead "
                                    "(4 bytes per trainable parameter less; see README, GPU and Apple Silicon)")
    # LoRA (TRL's ModelConfig names)
    use_peft: bool = _f(False, "train LoRA adapters instead of the full model")
    lora_r: int = _f(16, "LoRA rank")
    lora_alpha: int = _f(32, "LoRA alpha (scale = alpha / r)")
    lora_dropout: float = _f(0.05, "LoRA dropout")
    lora_target_modules: list[str] | None = _f(None, "module names to adapt (default: all linear layers of the LM)")
    use_dora: bool = _f(False, "DoRA instead of LoRA")
    freeze_vision_tower: bool = _f(False, "(mlxrl) keep the vision tower frozen in full fine-tuning")
    freeze_embeddings: bool = _f(False, "(mlxrl) keep the token embeddings (and a tied LM head) frozen")
    merge: bool = _f(False, "(mlxrl) with use_peft: also save a merged HF-layout model in output_dir/merged")
    # memory and speed (mlxrl)
    chunk_size: int | None = _f(None, "(mlxrl) vocab columns per streamed LM-head tile (default: 16 MB tiles)")
    head_mode: str = _f("fused", "(mlxrl) fused | two_phase | differentiable: how the streamed LM head runs "
                                 "(see README, Losses)")
    seq_buckets: list[int] | None = _f(None, "(mlxrl) padded lengths (default: powers of two up to max_length)")
    compile: bool = _f(True, "(mlxrl) mx.compile the step per shape bucket")
    patch_buckets: bool = _f(True, "(mlxrl) with compile: pad each batch's image patches to one of four sizes per "
                                   "doubling (a dummy image, discarded) so compiled steps are reused")
    max_compiled_shapes: int = _f(16, "(mlxrl) past this many distinct shapes, new shapes run uncompiled")
    memory_limit: str | None = _f(None, "(mlxrl) mx.set_memory_limit: bytes, '12GB' or a fraction of memory")
    cache_limit: str | None = _f(None, "(mlxrl) mx.set_cache_limit: bytes, '2GB' or a fraction of memory")
    wired_limit: str | None = _f(None, "(mlxrl) mx.set_wired_limit (Metal): bytes, '8GB' or a fraction")
    disable_tqdm: bool = _f(False, "no progress bar")


@dataclass
class SFTConfig(TrainConfig):
    """TRL's SFTConfig fields (1.16 names and defaults)."""

    max_length: int | None = _f(1024, "truncate examples (or pack rows) to this many tokens")
    truncation_mode: str = _f("keep_start", "keep_start | keep_end")
    packing: bool = _f(False, "pack several examples per row (attention cannot cross them)")
    packing_strategy: str = _f("bfd", "bfd (best-fit decreasing) | wrapped")
    padding_free: bool = _f(False, "concatenate each batch into one row without padding")
    completion_only_loss: bool | None = _f(None, "train only on completions (default: on for prompt-completion data)")
    assistant_only_loss: bool = _f(False, "train only on assistant turns of conversations")
    loss_type: str = _f("nll", "nll | dft")
    dataset_text_field: str = _f("text", "column of language-modelling datasets")
    eval_split: float = _f(0.0, "(mlxrl) hold out this fraction of the training set for evaluation")


def _parse_bool(s: str) -> bool:
    if s.lower() in ("1", "true", "yes", "y", "on"):
        return True
    if s.lower() in ("0", "false", "no", "n", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {s!r}")


def _arg_type(tp):
    """(type, nargs) for a dataclass field annotation (strings under `from __future__`)."""
    if typing.get_origin(tp) is list:
        return typing.get_args(tp)[0], "+"
    args = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else ()
    inner = [a for a in args if a is not type(None)] if args else [tp]
    base = inner[0] if inner else str
    if typing.get_origin(base) is list:
        return typing.get_args(base)[0], "+"
    if base is bool:
        return _parse_bool, "?"
    return base, None


def build_parser(cls, prog: str, description: str, extra=None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    if extra:
        extra(parser)
    parser.add_argument("--config", default=None, help="YAML file of config fields (CLI flags override it)")
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group(f"{cls.__name__} fields")
    for f in dataclasses.fields(cls):
        tp, nargs = _arg_type(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        kw = {"type": tp, "default": argparse.SUPPRESS, "help": f"{f.metadata.get('help', '')} (default: {default})"}
        if nargs == "?":
            kw.update(nargs="?", const=True)
        elif nargs:
            kw["nargs"] = nargs
        group.add_argument(f"--{f.name}", **kw)
    return parser


def config_from_args(cls, ns: argparse.Namespace):
    """defaults < YAML (--config) < explicit CLI flags."""
    values = {}
    if getattr(ns, "config", None):
        import yaml

        try:
            with open(ns.config) as fh:
                loaded = yaml.safe_load(fh) or {}
        except OSError as e:
            raise ValueError(f"cannot read --config {ns.config}: {e.strerror}") from None
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(loaded) - names)
        if unknown:
            raise ValueError(f"--config {ns.config}: unknown field(s) {', '.join(unknown)}")
        values.update(loaded)
    values.update({f.name: getattr(ns, f.name) for f in dataclasses.fields(cls) if hasattr(ns, f.name)})
    cfg = cls(**values)
    check_optim(cfg)  # before any model is loaded
    return cfg


OPTIMIZERS = ("adamw_torch", "adamw_torch_fused", "adafactor")


def check_optim(args) -> None:
    if args.optim not in OPTIMIZERS:
        raise ValueError(f"optim {args.optim!r} is not supported: use adamw_torch (the default; adamw_torch_fused "
                         "is the same kernel here) or adafactor")


def parse_config(cls, argv=None, prog=None, description=""):
    parser = build_parser(cls, prog or sys.argv[0], description)
    return config_from_args(cls, parser.parse_args(argv))
