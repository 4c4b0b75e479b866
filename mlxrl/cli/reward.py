"""`python -m mlxrl.reward`: a reward model (TRL's RewardTrainer flags): a Qwen sequence classifier trained on
preference pairs with the Bradley-Terry loss, saved as a folder `AutoModelForSequenceClassification` loads (or a
PEFT adapter holding the score head).

    python -m mlxrl.reward                                 # embedded default: tiny Qwen3.5, synthetic colour pairs
    python -m mlxrl.reward --model Qwen/Qwen3-0.6B --dataset prefs.jsonl --use_peft --output_dir rm
    python -m mlxrl.reward --model Qwen/Qwen2.5-0.5B-Instruct --dataset prefs.jsonl --center_rewards_coefficient 0.01

Every RewardConfig field is a flag (`--help` lists them). Errors print one line and exit with status 2
(MLXRL_DEBUG=1 shows the traceback); Ctrl-C saves a resumable checkpoint. Flags, the YAML file and the dataset's
rows are checked before the model loads. A causal LM's folder gets a fresh score head (as TRL loads it); with
--use_peft the score head is trained whole beside the adapters (PEFT's SEQ_CLS task type).

The embedded default (no --model, no --dataset): the tiny Qwen3.5 (Qwen3-VL has no sequence classifier in
transformers) with a fresh score head, trained with LoRA on the colour task's text variant as pairs (chosen = the
right colour, rejected = another); it prints the held-out pairwise accuracy (the share of held-out pairs whose
chosen answer gets the higher reward) before and after.
"""

from __future__ import annotations

import time

from .common import apply_overrides
from .paired import DEMO_TEST, add_paired_flags, paired_command, preference_pairs

__all__ = ["main", "run_demo", "pairwise_accuracy"]

DEMO_OVERRIDES = {"overwrite_output_dir": True, "learning_rate": 2e-3, "max_steps": 30,
                  "per_device_train_batch_size": 16, "use_peft": True, "lora_r": 16, "lora_alpha": 32,
                  "lr_scheduler_type": "constant", "warmup_steps": 0, "logging_steps": 10, "save_steps": 0,
                  "gradient_checkpointing": False, "max_length": 256, "output_dir": "out/reward-demo",
                  "disable_tqdm": True}


def pairwise_accuracy(trainer, pairs: list[dict]) -> float:
    """Share of `pairs` whose chosen sequence the reward model scores above the rejected one."""
    import numpy as np

    hits = []
    for batch in trainer.pair_batches(trainer.tokenize_eval(pairs), 0, False, trainer.args.per_device_eval_batch_size):
        r = np.array(trainer.rewards(trainer.model, trainer.to_device(batch)))
        b = int(batch["num_pairs"])
        hits.extend(r[:b] > r[b:2 * b])
    return float(np.mean(hits))


def run_demo(args, explicit: set, model_path: str | None = None, sft_steps: int | None = None,
             n_test: int = DEMO_TEST, n_pairs: int | None = None, overrides: dict | None = None,
             demo: str = "qwen3_5") -> dict:
    """The embedded default (module docstring); returns the held-out pairwise accuracy before and after and the
    logged metrics."""
    from ..data.synthetic import text_colour_rows
    from ..errors import MlxrlError
    from ..trainers.model_setup import load_for_training
    from ..trainers.reward.trainer import RewardTrainer

    if sft_steps is not None:
        raise MlxrlError("--sft_steps: the reward demo starts from the embedded model itself (no SFT)")
    apply_overrides(args, explicit, {**DEMO_OVERRIDES, **(overrides or {})})
    t0 = time.perf_counter()
    model, processor = load_for_training(model_path, args, seed=args.seed, demo=demo)
    n_pairs = n_pairs or args.max_steps * args.per_device_train_batch_size * args.gradient_accumulation_steps
    pairs = preference_pairs(text_colour_rows(n_pairs, seed=args.seed + 7, split="train"), seed=args.seed)
    test = preference_pairs(text_colour_rows(n_test, seed=args.seed + 1, split="test"), seed=args.seed + 3)
    trainer = RewardTrainer(model=model, processor=processor, args=args, train_dataset=pairs)
    before = pairwise_accuracy(trainer, test)
    print(f"reward model on {len(pairs)} synthetic preference pairs (chosen = the right colour, rejected = "
          f"another); before training, on {len(test)} held-out pairs: pairwise accuracy (the share whose chosen "
          f"answer gets the higher reward) {before:.1%}", flush=True)
    trainer.train()
    after = pairwise_accuracy(trainer, test)
    logged = [e for e in trainer.log_history if "accuracy" in e]
    trend = "  ".join(f"step {e['step']}: accuracy {e['accuracy']:.2f} margin {e['margin']:+.3f}" for e in logged)
    print(f"training accuracy and margin: {trend}", flush=True)
    print(f"after training, held-out pairwise accuracy {before:.1%} -> {after:.1%} (95% interval: +/-"
          f"{0.98 / len(test) ** 0.5:.0%} at most); {time.perf_counter() - t0:.0f}s in all; saved to "
          f"{args.output_dir}", flush=True)
    return {"before": before, "after": after, "history": logged}


def main(argv=None) -> int:
    from ..trainers.flags import build_parser
    from ..trainers.reward.config import RewardConfig, check_reward_config
    from .common import run

    parser = build_parser(RewardConfig, "python -m mlxrl.reward", __doc__.splitlines()[0],
                          extra=lambda p: add_paired_flags(p, "reward modelling", "qwen3_5", ("qwen3_5",)))
    ns = parser.parse_args(argv)
    return run(lambda: _main(ns, RewardConfig, check_reward_config))


def _main(ns, config_class, check) -> None:
    from ..data.reward import check_reward_row
    from ..trainers.reward.trainer import RewardTrainer

    paired_command(ns, config_class, check, RewardTrainer, run_demo, check_row=check_reward_row)
