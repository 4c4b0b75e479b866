"""`python -m mlxrl.dpo`: direct preference optimisation of a Qwen / Qwen-VL model (TRL's DPOTrainer flags).

    python -m mlxrl.dpo                                    # embedded default: tiny Qwen3-VL, synthetic VQA preferences
    python -m mlxrl.dpo --model Qwen/Qwen3-VL-2B-Instruct --dataset prefs.jsonl --use_peft --output_dir out
    python -m mlxrl.dpo --model ./sft-out/model --dataset prefs.jsonl --ref_model ./base --loss_type sigmoid sft
    python -m mlxrl.dpo --config dpo.yaml --beta 0.2       # CLI > YAML > defaults

Every DPOConfig field is a flag (`--help` lists them). Errors print one line and exit with status 2
(MLXRL_DEBUG=1 shows the traceback); Ctrl-C saves a resumable checkpoint. Flags, the YAML file and
the dataset's rows are checked before the model loads.

The embedded default (no --model, no --dataset) is the paired trainers' demo (`cli.paired`): a brief SFT of the
tiny default, then DPO with LoRA (so the reference is the same model with its adapters off) on colour pairs. The
loss is TRL's `loss_type=["sigmoid", "sft"]` (DPO plus a weighted NLL of the chosen answers, RPO): the chosen and
rejected answers end with the same <|im_end|> token, and DPO alone pushes it down along with the rejected answers,
so greedy answers stop ending where they should; the sft term keeps the chosen answer, its end included, likely.
TRL's rewards/accuracies asks of the policy relative to the reference what the demo's held-out preference
accuracy asks of the policy alone; it is 0 before any step.
"""

from __future__ import annotations

from ..trainers.dpo.config import DPOConfig, check_dpo_config
from ..trainers.flags import build_parser
from .common import apply_overrides, run
from .paired import DEMO_TEST, add_paired_flags, paired_command, preference_pairs, run_paired_demo

__all__ = ["main", "preference_pairs", "run_demo"]

# The embedded default's settings (used only for fields the user did not set): DPO's sigmoid term and a
# light sft term (weight 0.2) that keeps the chosen answers likely (see above).
DEMO_OVERRIDES = {"overwrite_output_dir": True,  # the demo's own folder: a rerun starts over
                  "learning_rate": 2e-3, "max_steps": 15, "per_device_train_batch_size": 8, "beta": 0.5,
                  "loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.2],
                  "use_peft": True, "lora_r": 16, "lora_alpha": 32,
                  "lr_scheduler_type": "constant", "warmup_steps": 0, "logging_steps": 5, "save_steps": 0,
                  "gradient_checkpointing": False, "max_length": 256, "output_dir": "out/dpo-demo",
                  "disable_tqdm": True}
# loss_type and loss_weights go together: a user's own loss_type keeps its own (default) weights
LOSS_FIELDS = ("loss_type", "loss_weights")


def run_demo(args: DPOConfig, explicit: set, model_path: str | None = None, sft_steps: int | None = None,
             n_test: int = DEMO_TEST, n_pairs: int | None = None, overrides: dict | None = None,
             demo: str = "qwen3_vl") -> dict:
    """The embedded default (`cli.paired.run_paired_demo`); overrides: demo settings replacing DEMO_OVERRIDES
    (tests use a shorter run)."""
    from ..trainers.dpo.trainer import DPOTrainer

    settings = {**DEMO_OVERRIDES, **(overrides or {})}
    if explicit & set(LOSS_FIELDS):
        settings = {k: v for k, v in settings.items() if k not in LOSS_FIELDS}
    apply_overrides(args, explicit, settings)  # the label names what will run
    loss = " + ".join(f"{w:g} {t}" for t, w in zip(args.loss_type, args.loss_weights or [1.0] * len(args.loss_type),
                                                     strict=True))
    return run_paired_demo(DPOTrainer, f"DPO ({loss}, beta {args.beta:g})", args, explicit, settings, model_path,
                           sft_steps, n_test, n_pairs, demo)


def main(argv=None) -> int:
    parser = build_parser(DPOConfig, "python -m mlxrl.dpo", __doc__.splitlines()[0],
                          extra=lambda p: add_paired_flags(p, "DPO"))
    ns = parser.parse_args(argv)
    return run(lambda: _main(ns))


def _main(ns) -> None:
    from ..trainers.dpo.trainer import DPOTrainer

    paired_command(ns, DPOConfig, check_dpo_config, DPOTrainer, run_demo)
