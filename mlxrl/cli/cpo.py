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

from .paired import demo_of, paired_main

__all__ = ["main", "run_demo"]

# The embedded default's settings (used only for fields the user did not set)
DEMO_OVERRIDES = {"overwrite_output_dir": True, "learning_rate": 2e-3, "max_steps": 15,
                  "per_device_train_batch_size": 8, "beta": 0.5, "use_peft": True, "lora_r": 16, "lora_alpha": 32,
                  "lr_scheduler_type": "constant", "warmup_steps": 0, "logging_steps": 5, "save_steps": 0,
                  "gradient_checkpointing": False, "max_length": 256, "output_dir": "out/cpo-demo",
                  "disable_tqdm": True}

run_demo = demo_of("cpo", DEMO_OVERRIDES, lambda a: f"CPO ({a.loss_type}, beta {a.beta:g}, cpo_alpha {a.cpo_alpha:g})")


def main(argv=None) -> int:
    return paired_main(argv, "cpo", __doc__, run_demo)
