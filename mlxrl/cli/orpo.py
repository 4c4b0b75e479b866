"""`python -m mlxrl.orpo`: odds-ratio preference optimisation of a Qwen / Qwen-VL model (trl.experimental's ORPOTrainer
flags): the chosen answers' NLL and an odds-ratio term in one loss, no reference model, no SFT stage needed.

    python -m mlxrl.orpo                                   # embedded default: tiny Qwen3-VL, synthetic VQA preferences
    python -m mlxrl.orpo --model Qwen/Qwen3-0.6B --dataset prefs.jsonl --use_peft --beta 0.1 --output_dir out
    python -m mlxrl.orpo --config orpo.yaml --learning_rate 8e-6   # CLI > YAML > defaults

Every ORPOConfig field is a flag (`--help` lists them). Errors print one line and exit with status 2
(MLXRL_DEBUG=1 shows the traceback); Ctrl-C saves a resumable checkpoint. Flags, the YAML file and
the dataset's rows are checked before the model loads.

The embedded default (no --model, no --dataset) is the paired trainers' demo (`cli.paired`): a brief SFT of the
tiny default, then ORPO with LoRA on colour pairs; it prints the held-out exact match and preference accuracy
before and after.
"""

from __future__ import annotations

from ..trainers.flags import build_parser
from ..trainers.orpo.config import ORPOConfig, check_orpo_config
from .common import run
from .paired import DEMO_TEST, add_paired_flags, paired_command, run_paired_demo

__all__ = ["main", "run_demo"]

# The embedded default's settings (used only for fields the user did not set)
DEMO_OVERRIDES = {"overwrite_output_dir": True, "learning_rate": 5e-4, "max_steps": 15,
                  "per_device_train_batch_size": 8, "beta": 0.5, "use_peft": True, "lora_r": 16, "lora_alpha": 32,
                  "lr_scheduler_type": "constant", "warmup_steps": 0, "logging_steps": 5, "save_steps": 0,
                  "gradient_checkpointing": False, "max_length": 256, "output_dir": "out/orpo-demo",
                  "disable_tqdm": True}


def run_demo(args: ORPOConfig, explicit: set, model_path: str | None = None, sft_steps: int | None = None,
             n_test: int = DEMO_TEST, n_pairs: int | None = None, overrides: dict | None = None,
             demo: str = "qwen3_vl") -> dict:
    """The embedded default (`cli.paired.run_paired_demo`); overrides: demo settings replacing DEMO_OVERRIDES."""
    from ..trainers.orpo.trainer import ORPOTrainer
    from .common import apply_overrides

    settings = {**DEMO_OVERRIDES, **(overrides or {})}
    apply_overrides(args, explicit, settings)
    return run_paired_demo(ORPOTrainer, f"ORPO (beta {args.beta:g})", args, explicit, settings, model_path,
                           sft_steps, n_test, n_pairs, demo)


def main(argv=None) -> int:
    parser = build_parser(ORPOConfig, "python -m mlxrl.orpo", __doc__.splitlines()[0],
                          extra=lambda p: add_paired_flags(p, "ORPO"))
    ns = parser.parse_args(argv)
    return run(lambda: _main(ns))


def _main(ns) -> None:
    from ..trainers.orpo.trainer import ORPOTrainer

    paired_command(ns, ORPOConfig, check_orpo_config, ORPOTrainer, run_demo)
