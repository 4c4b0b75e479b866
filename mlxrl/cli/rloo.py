"""`python -m mlxrl.rloo`: REINFORCE leave-one-out of a Qwen / Qwen-VL model (TRL's RLOOTrainer flags).

    python -m mlxrl.rloo                                   # embedded default: tiny Qwen3-VL, synthetic colour questions
    python -m mlxrl.rloo --model Qwen/Qwen3-0.6B --dataset prompts.jsonl --reward_funcs my_rewards:accuracy \\
        --num_generations 4 --beta 0.05 --use_peft --output_dir out
    python -m mlxrl.rloo --config rloo.yaml --normalize_advantages true   # CLI > YAML > defaults

Every RLOOConfig field is a flag (`--help` lists them); `--reward_funcs` as `python -m mlxrl.grpo`'s (module:function
entries and reward model folders). Errors print one line and exit with status 2 (MLXRL_DEBUG=1 shows the traceback);
Ctrl-C saves a resumable checkpoint.

The embedded default (no --model, no --dataset): GRPO's demo with RLOO's advantages and loss: a brief SFT of the tiny
default on the synthetic colour questions, then RLOO with LoRA on fresh questions, rewarded 1 for exactly the right
colour word; it prints the mean reward of every step's completions and held-out exact match before and after.
"""

from __future__ import annotations

from .grpo import rollout_main, run_demo  # noqa: F401  (run_demo(..., trainer="rloo"))

__all__ = ["main"]


def main(argv=None) -> int:
    return rollout_main(argv, "rloo", __doc__)
