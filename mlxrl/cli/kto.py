"""`python -m mlxrl.kto`: Kahneman-Tversky optimisation of a Qwen model (TRL's KTOTrainer flags) from unpaired rows
(prompt, completion, label: desirable or not) or preference rows (unpaired as TRL unpairs them).

    python -m mlxrl.kto                                    # embedded default: tiny Qwen3-VL's text task, colour answers
    python -m mlxrl.kto --model Qwen/Qwen3-0.6B --dataset kto.jsonl --use_peft --output_dir out
    python -m mlxrl.kto --model ./sft-out/model --dataset kto.jsonl --loss_type apo_zero_unpaired --beta 0.1

Every KTOConfig field is a flag (`--help` lists them). Errors print one line and exit with status 2
(MLXRL_DEBUG=1 shows the traceback); Ctrl-C saves a resumable checkpoint. Flags, the YAML file and
the dataset's rows are checked before the model loads.

The embedded default (no --model, no --dataset): a brief SFT of the tiny default on the synthetic colour
questions' text variant, then KTO with LoRA on the task's text variant, each a desirable (the
right colour) or an undesirable (another colour) completion; it prints the held-out exact match before and after,
and the rewards as they separate.
"""

from __future__ import annotations

import time

from ..trainers.flags import build_parser
from ..trainers.kto.config import KTOConfig, check_kto_config
from .common import apply_overrides, run
from .paired import DEMO_TEST, QWEN3_5_SFT_STEPS, add_paired_flags, paired_command, preference_pairs

__all__ = ["main", "run_demo"]

# measured over seeds (docs/kto.md): lr 2e-3 with batches of 8 collapsed at seed 1; desirable_weight 1.33 (TRL's
# recommended range for balanced data) moved the seed at which the others stayed flat
DEMO_OVERRIDES = {"overwrite_output_dir": True, "learning_rate": 1e-3, "max_steps": 30,
                  "per_device_train_batch_size": 16, "beta": 0.5, "desirable_weight": 1.33, "use_peft": True,
                  "lora_r": 16, "lora_alpha": 32,
                  "lr_scheduler_type": "constant", "warmup_steps": 0, "logging_steps": 5, "save_steps": 0,
                  "gradient_checkpointing": False, "max_length": 256, "output_dir": "out/kto-demo",
                  "disable_tqdm": True}


def unpaired_rows(pairs: list[dict]) -> list[dict]:
    """Preference pairs -> KTO rows, each pair's desirable then its undesirable completion (the held-out rows that
    `preference_accuracy` compares two by two)."""
    return [{"prompt": p["prompt"], "completion": p[side], "label": side == "chosen"}
            for p in pairs for side in ("chosen", "rejected")]


def training_rows(pairs: list[dict]) -> list[dict]:
    """Preference pairs -> the demo's KTO training rows: the labels alternate (every batch holds both; TRL's own
    unpairing puts a chunk's desirable rows first, which in sequential order gives batches of one label) and no two
    neighbours share a prompt: the KL term's mismatched pair of a row is its own prompt with the previous row's
    completion, which for a pair's two rows side by side would be the prompt's own right answer, and the KL estimate
    would then rise exactly as the desirable completions are learned. Pair k's chosen (k even) or rejected (k odd)
    first, then the other half."""
    sides = ("chosen", "rejected")
    first = [{"prompt": p["prompt"], "completion": p[sides[k % 2]], "label": k % 2 == 0} for k, p in enumerate(pairs)]
    second = [{"prompt": p["prompt"], "completion": p[sides[1 - k % 2]], "label": k % 2 == 1}
              for k, p in enumerate(pairs)]
    return first + second


# the brief SFT trains the task KTO then trains (its text variant), long enough that the policy answers in the
# task's format: KTO's per-example signal moves a policy that is partly right, not one at chance (docs/kto.md)
SFT_ON_TEXT, KTO_SFT_STEPS = True, 20


def preference_accuracy(trainer, rows: list[dict]) -> float:
    """Share of the held-out pairs in `rows` (`unpaired_rows`: desirable, undesirable, ...) whose desirable
    completion the policy finds more likely (summed completion log-probs)."""
    import numpy as np

    examples = trainer.tokenize_eval(rows)
    logps = np.concatenate([np.array(trainer.completion_logps(trainer.model, trainer.to_device(b)))
                            for b in trainer.example_batches(examples, 0, False, 16)])
    return float(np.mean(logps[0::2] > logps[1::2]))


def run_demo(args: KTOConfig, explicit: set, model_path: str | None = None, sft_steps: int | None = None,
             n_test: int = DEMO_TEST, n_pairs: int | None = None, overrides: dict | None = None,
             demo: str = "qwen3_vl") -> dict:
    """The embedded default (module docstring); overrides: demo settings replacing DEMO_OVERRIDES. Returns the
    held-out preference accuracy and exact match before and after, and the logged training metrics."""
    from ..data.synthetic import text_colour_rows
    from ..evaluate import exact_match
    from ..trainers.kto.trainer import KTOTrainer
    from .demos import DEMO_SFT, briefly_sft_default

    apply_overrides(args, explicit, {**DEMO_OVERRIDES, **(overrides or {})})
    t0 = time.perf_counter()
    if sft_steps is None:
        sft_steps = QWEN3_5_SFT_STEPS if demo == "qwen3_5" else KTO_SFT_STEPS
    model, processor = briefly_sft_default(args, sft_steps, DEMO_SFT, model_path, demo,
                                           make_rows=text_colour_rows if SFT_ON_TEXT else None)
    test = text_colour_rows(n_test, seed=args.seed + 1, split="test")  # the task's text variant
    # each pair gives a desirable and an undesirable example
    n_pairs = n_pairs or args.max_steps * args.per_device_train_batch_size * args.gradient_accumulation_steps // 2
    rows = training_rows(preference_pairs(text_colour_rows(n_pairs, seed=args.seed + 7, split="train"),
                                          seed=args.seed))
    held = unpaired_rows(preference_pairs(test, seed=args.seed + 3))
    trainer = KTOTrainer(model=model, processor=processor, args=args, train_dataset=rows)
    # the adapters start at zero: the policy is still the model KTO starts from
    before = {"exact_match": exact_match(trainer.model, trainer.processor, test),
              "preference": preference_accuracy(trainer, held)}
    print(f"KTO ({args.loss_type}, beta {args.beta:g}) on {len(rows)} synthetic examples (the right colour "
          f"desirable, another undesirable); before KTO, on {len(test)} held-out questions: preference accuracy (the "
          f"share whose right answer the model finds more likely than a wrong one) {before['preference']:.1%}, "
          f"exact match {before['exact_match']:.1%}", flush=True)
    trainer.train()
    after = {"exact_match": exact_match(trainer.model, trainer.processor, test),
             "preference": preference_accuracy(trainer, held)}
    logged = [e for e in trainer.log_history if "rewards/chosen" in e]
    trend = "  ".join(f"step {e['step']}: chosen {e['rewards/chosen']:+.3f} rejected "
                      f"{e.get('rewards/rejected', 0):+.3f}" for e in logged)
    print(f"rewards: {trend}", flush=True)
    print(f"after KTO, held-out preference accuracy {before['preference']:.1%} -> {after['preference']:.1%}, exact "
          f"match {before['exact_match']:.1%} -> {after['exact_match']:.1%} (95% intervals: +/-"
          f"{0.98 / len(test) ** 0.5:.0%} at most); {time.perf_counter() - t0:.0f}s in all; saved to "
          f"{args.output_dir}", flush=True)
    return {"before": before, "after": after, "history": logged}


def main(argv=None) -> int:
    parser = build_parser(KTOConfig, "python -m mlxrl.kto", __doc__.splitlines()[0],
                          extra=lambda p: add_paired_flags(p, "KTO", sft_steps=KTO_SFT_STEPS))
    ns = parser.parse_args(argv)
    return run(lambda: _main(ns))


def _main(ns) -> None:
    from ..data.unpaired import check_unpaired_row
    from ..trainers.kto.trainer import KTOTrainer

    paired_command(ns, KTOConfig, check_kto_config, KTOTrainer, run_demo, check_row=check_unpaired_row)
