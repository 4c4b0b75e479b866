"""`python -m mlxrl.cpo`: contrastive preference optimisation of a Qwen / Qwen-VL model, and SimPO / AlphaPO
(trl.experimental's CPOTrainer flags): reference-free, --loss_type sigmoid | hinge | ipo | simpo | alphapo.

    python -m mlxrl.cpo                                    # embedded default: tiny Qwen3-VL, synthetic VQA preferences
    python -m mlxrl.cpo --model Qwen/Qwen3-0.6B --dataset prefs.jsonl --use_peft --output_dir out
    python -m mlxrl.cpo --loss_type simpo --cpo_alpha 0 --beta 2.0 --simpo_gamma 0.5 --dataset prefs.jsonl  # SimPO

Every CPOConfig field is a flag (`--help` lists them). Errors print one line and exit with status 2
(MLXRL_DEBUG=1 shows the traceback); Ctrl-C saves a resumable checkpoint. Flags, the YAML file and
the dataset's rows are checked before the model loads.

The embedded default (no --model, no --dataset) is the paired trainers' demo (`cli.paired`): a brief SFT of the
tiny default, then CPO with LoRA on colour pairs; it prints the held-out exact match and preference accuracy
before and after.
"""

from __future__ import annotations

from ..trainers.cpo.config import CPOConfig, check_cpo_config
from ..trainers.flags import build_parser
from .common import run
from .paired import DEMO_TEST, add_paired_flags, paired_command, run_paired_demo

__all__ = ["main", "run_demo"]

# The embedded default's settings (used only for fields the user did not set)
DEMO_OVERRIDES = {"overwrite_output_dir": True, "learning_rate": 2e-3, "max_steps": 15,
                  "per_device_train_batch_size": 8, "beta": 0.5, "use_peft": True, "lora_r": 16, "lora_alpha": 32,
                  "lr_scheduler_type": "constant", "warmup_steps": 0, "logging_steps": 5, "save_steps": 0,
                  "gradient_checkpointing": False, "max_length": 256, "output_dir": "out/cpo-demo",
                  "disable_tqdm": True}


def run_demo(args: CPOConfig, explicit: set, model_path: str | None = None, sft_steps: int | None = None,
             n_test: int = DEMO_TEST, n_pairs: int | None = None, overrides: dict | None = None,
             demo: str = "qwen3_vl") -> dict:
    """The embedded default (`cli.paired.run_paired_demo`); overrides: demo settings replacing DEMO_OVERRIDES."""
    from ..trainers.cpo.trainer import CPOTrainer
    from .common import apply_overrides

    settings = {**DEMO_OVERRIDES, **(overrides or {})}
    apply_overrides(args, explicit, settings)
    label = f"CPO ({args.loss_type}, beta {args.beta:g}, cpo_alpha {args.cpo_alpha:g})"
    return run_paired_demo(CPOTrainer, label, args, explicit, settings, model_path, sft_steps, n_test, n_pairs, demo)


def main(argv=None) -> int:
    parser = build_parser(CPOConfig, "python -m mlxrl.cpo", __doc__.splitlines()[0],
                          extra=lambda p: add_paired_flags(p, "CPO"))
    ns = parser.parse_args(argv)
    return run(lambda: _main(ns))


def _main(ns) -> None:
    from ..trainers.cpo.trainer import CPOTrainer

    paired_command(ns, CPOConfig, check_cpo_config, CPOTrainer, run_demo)
