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

from .paired import demo_of, paired_main

__all__ = ["main", "run_demo"]

# The embedded default's settings (used only for fields the user did not set)
DEMO_OVERRIDES = {"overwrite_output_dir": True, "learning_rate": 5e-4, "max_steps": 15,
                  "per_device_train_batch_size": 8, "beta": 0.5, "use_peft": True, "lora_r": 16, "lora_alpha": 32,
                  "lr_scheduler_type": "constant", "warmup_steps": 0, "logging_steps": 5, "save_steps": 0,
                  "gradient_checkpointing": False, "max_length": 256, "output_dir": "out/orpo-demo",
                  "disable_tqdm": True}

run_demo = demo_of("orpo", DEMO_OVERRIDES, lambda a: f"ORPO (beta {a.beta:g})")


def main(argv=None) -> int:
    return paired_main(argv, "orpo", __doc__, run_demo)
