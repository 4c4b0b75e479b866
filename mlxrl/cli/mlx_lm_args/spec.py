"""mlx-lm's flags, YAML keys and defaults (mlx-lm 0.32's `mlx_lm/lora.py`), and an mlx-lm run."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

# mlx-lm 0.32's CONFIG_DEFAULTS (mlx_lm/lora.py; tests compare them), less `config`
DEFAULTS = {
    "model": "Qwen/Qwen3-0.6b", "train": False, "fine_tune_type": "lora", "optimizer": "adam",
    "optimizer_config": {"adam": {}, "adamw": {}, "muon": {}, "sgd": {}, "adafactor": {}},
    "data": "mlx-community/WikiSQL", "seed": 0, "num_layers": 16, "batch_size": 4, "iters": 1000, "val_batches": 25,
    "learning_rate": 1e-5, "steps_per_report": 10, "steps_per_eval": 200, "resume_adapter_file": None,
    "adapter_path": "adapters", "save_every": 100, "test": False, "test_batches": 500, "max_seq_length": 2048,
    "grad_checkpoint": False, "grad_accumulation_steps": 1, "clear_cache_threshold": 0, "lr_schedule": None,
    "lora_parameters": {"rank": 8, "dropout": 0.0, "scale": 20.0}, "mask_prompt": False, "report_to": None,
    "project_name": None, "trust_remote_code": False,
}
# the row columns mlx-lm's datasets read (mlx_lm/tuner/datasets.py create_dataset), and its Hub collection key
FEATURES = {"prompt_feature": "prompt", "completion_feature": "completion", "chat_feature": "messages",
            "text_feature": "text"}
YAML_ONLY = ("optimizer_config", "lr_schedule", "lora_parameters", "hf_dataset", *FEATURES)


@dataclass(frozen=True)
class Flag:
    """One of mlx-lm's flags: its spelling, YAML kind (int, float, bool, str, size, mapping) and help."""

    flag: str
    kind: str
    help: str
    choices: tuple = ()


# mlx-lm's flags (mlx_lm.lora.build_parser; --model, --seed and -c/--config are shared with ours)
FLAGS = {
    "train": Flag("--train", "bool", "accepted: training is what python -m mlxrl.sft does"),
    "data": Flag("--data", "str", "mlx-lm's --dataset: a folder of train/valid/test.jsonl, a file, or a Hub "
                                  "dataset. In a folder: train.jsonl (trained), valid.jsonl (evaluated) and "
                                  "test.jsonl (read only with --test)"),
    "fine_tune_type": Flag("--fine-tune-type", "str", "lora: --use_peft; dora: --use_peft --use_dora; full: the "
                                                      "whole model but the token embeddings", ("lora", "dora", "full")),
    "optimizer": Flag("--optimizer", "str", "mlx-lm's optimizer as --optim: adam or adamw; muon, sgd, "
                                            "adafactor: refused. With adam: --optim adamw_torch --weight_decay 0 "
                                            "(torch's AdamW, with bias correction); adamw: weight decay 0.01",
                      ("adam", "adamw", "muon", "sgd", "adafactor")),
    "mask_prompt": Flag("--mask-prompt", "bool", "train only the completion, or a conversation's last message "
                                                 "(--completion_only_loss)"),
    "num_layers": Flag("--num-layers", "int", "-1 (or at least the model's layer count): mlxrl adapts every layer; "
                                              "fewer is refused"),
    "batch_size": Flag("--batch-size", "int", "--per_device_train_batch_size and --per_device_eval_batch_size"),
    "iters": Flag("--iters", "int", "--max_steps"),
    "val_batches": Flag("--val-batches", "int", "evaluate the first N x batch-size validation rows (-1: all)"),
    "learning_rate": Flag("--learning-rate", "float", "--learning_rate (constant, as mlx-lm's)"),
    "steps_per_report": Flag("--steps-per-report", "int", "--logging_steps"),
    "steps_per_eval": Flag("--steps-per-eval", "int", "--eval_steps (with validation data: --eval_strategy steps "
                                                      "and --eval_on_start)"),
    "grad_accumulation_steps": Flag("--grad-accumulation-steps", "int", "only 1: use --gradient_accumulation_steps"),
    "resume_adapter_file": Flag("--resume-adapter-file", "str", "refused: resume with --resume_from_checkpoint"),
    "adapter_path": Flag("--adapter-path", "str", "--output_dir, where the adapter goes in PEFT's layout. "
                                                  "PEFT's adapter_model.safetensors + adapter_config.json (not "
                                                  "mlx-lm's adapters.safetensors)"),
    "save_every": Flag("--save-every", "int", "--save_steps (resumable checkpoint-N/ folders)"),
    "test": Flag("--test", "bool", "after training, print the test split's loss and perplexity"),
    "test_batches": Flag("--test-batches", "int", "test the first N x batch-size test rows (-1: all)"),
    "max_seq_length": Flag("--max-seq-length", "int", "--max_length"),
    "grad_checkpoint": Flag("--grad-checkpoint", "bool", "--gradient_checkpointing"),
    "clear_cache_threshold": Flag("--clear-cache-threshold", "size", "only 0: use --cache_limit"),
    "report_to": Flag("--report-to", "str", "--report_to (wandb)"),
    "project_name": Flag("--project-name", "str", "refused: set WANDB_PROJECT"),
    "trust_remote_code": Flag("--trust-remote-code", "bool", "refused: mlxrl never runs model code from the Hub"),
}
SHARED = ("model", "seed", "config")  # flags both spellings have: ours parse them
KINDS = {**{k: f.kind for k, f in FLAGS.items()}, "model": "str", "seed": "int", "optimizer_config": "mapping",
         "lr_schedule": "mapping", "lora_parameters": "mapping", "hf_dataset": "any",
         **{k: "str" for k in FEATURES}}
OPTIONAL = ("resume_adapter_file", "report_to", "project_name", "lr_schedule", "hf_dataset")
# mode settings of every mlx-lm run that no key names: a constant rate unless lr_schedule, no clipping,
# no warmup, whole batches (mlx-lm's iterate_batches never makes a partial one), no assistant-only masking
MODE = {"lr_scheduler_type": "constant", "max_grad_norm": 0.0, "warmup_steps": 0, "warmup_ratio": 0.0,
        "dataloader_drop_last": True, "assistant_only_loss": False}


def dest(key: str) -> str:
    return f"mlx_lm_{key}"


def add_flags(parser: argparse.ArgumentParser) -> None:
    """mlx-lm's flags, each stored under its own name (`dest`), absent unless given."""
    group = parser.add_argument_group("mlx-lm's flags (mlx_lm.lora; using one makes this mlx-lm's run, see "
                                      "mlxrl/cli/mlx_lm_args/)")
    for key, spec in FLAGS.items():
        kw = {"dest": dest(key), "default": argparse.SUPPRESS, "help": spec.help}
        if spec.kind == "bool":
            kw["action"] = "store_true"
        else:
            kw["type"] = {"int": int, "float": float, "size": _size}.get(spec.kind, str)
            if spec.choices:
                kw["choices"] = spec.choices
            else:
                kw["metavar"] = {"int": "N", "float": "X", "size": "BYTES"}.get(spec.kind, key.split("_")[-1].upper())
        group.add_argument(spec.flag, **kw)


def _size(text: str) -> int:
    """A size as mlx-lm reads it ("1GB", "500M", bytes)."""
    from mlx_lm.utils import _parse_size

    try:
        return _parse_size(text)
    except (ValueError, KeyError, ArithmeticError):
        raise argparse.ArgumentTypeError(f"expected a size such as 2GB, got {text!r}") from None


# ------------------------------------------------------------------------------------------ the run


@dataclass
class Run:
    """An mlx-lm run: `settings` (mlx-lm's keys, defaults < YAML < flags), where the user gave each
    (`given`: key -> "--iters" or "--config f.yaml line 3: iters"), and the SFTConfig fields they set."""

    settings: dict
    given: dict
    spelled: object = None  # flags.Spelled

    def label(self, key: str) -> str:
        return self.given.get(key, key)

    @property
    def features(self) -> dict:
        return {k: self.settings.get(k, v) for k, v in FEATURES.items()}
