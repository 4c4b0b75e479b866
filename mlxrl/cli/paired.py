"""What the chosen / rejected commands share (`python -m mlxrl.dpo|orpo|cpo`): their flags beyond the config's, the
embedded demo's preference pairs and held-out measures, the demo run, and the command's body (checks before any
model loads, then the data, the model and the trainer).

The embedded demo (no --model, no --dataset): the tiny default model gets a brief SFT on the synthetic colour
questions (or start from --model; a text-only model gets the task's text variant), then the trainer with LoRA on
pairs drawn from the same task: chosen = the right colour, rejected = another colour. The brief SFT is kept short
on purpose: the model has begun to answer with a colour but still often names the wrong one, which is what
preference pairs can fix. It prints rewards/accuracies and rewards/margins as they rise, and two held-out measures
before and after on the same held-out questions: exact match (greedy answers, `mlxrl.evaluate.exact_match`) and
preference accuracy (the share of held-out pairs whose chosen answer the policy finds more likely than the
rejected one, summed log-probs).
"""

from __future__ import annotations

import time

from .common import apply_overrides, load_model_and_rows
from .demos import DEMO_SFT, briefly_sft_default

DEMO_SFT_STEPS, DEMO_TEST = 6, 192
QWEN3_5_SFT_STEPS = 20  # the tiny Qwen3.5 learns the answer format more slowly (its held-out exact match, docs/dpo.md)


def add_paired_flags(parser, name: str, demo: str = "qwen3_vl", demos=None, sft_steps: int = DEMO_SFT_STEPS) -> None:
    from .demos import add_demo_flag

    add_demo_flag(parser, demo, demos)
    parser.add_argument("--model", default=None, help="Hub id or local folder (default: the embedded demo)")
    parser.add_argument("--dataset", default=None, help="local .json/.jsonl/.parquet file or folder, or a Hub dataset")
    parser.add_argument("--dataset_split", default="train", help="split of a Hub dataset")
    parser.add_argument("--eval_dataset", default=None, help="evaluation data (same formats as --dataset)")
    parser.add_argument("--sft_steps", type=int, default=None,
                        help=f"embedded default only: SFT steps before {name} when starting from the tiny model "
                             f"(default: {sft_steps}; {QWEN3_5_SFT_STEPS} for the tiny Qwen3.5)")


def preference_pairs(rows: list[dict], seed: int = 0) -> list[dict]:
    """Synthetic VQA rows (or their text variant) -> TRL preference rows: chosen = the right answer,
    rejected = another answer of the same question type, drawn at random."""
    import numpy as np

    from ..data.synthetic import COLORS, COUNTS, SHAPES, SIDES
    from ..evaluate import split_row

    answers = {"color": tuple(COLORS), "shape": SHAPES, "count": COUNTS, "position": SIDES}
    rng = np.random.default_rng(seed)
    out = []
    for row in rows:
        prompt, answer = split_row(row)
        wrong = [a for a in answers[row.get("type", "color")] if a != answer]
        other = wrong[int(rng.integers(len(wrong)))]
        pair = {"prompt": prompt,
                "chosen": [{"role": "assistant", "content": [{"type": "text", "text": answer}]}],
                "rejected": [{"role": "assistant", "content": [{"type": "text", "text": other}]}]}
        if row.get("images"):
            pair["images"] = row["images"]
        out.append(pair)
    return out


def preference_accuracy(trainer, pairs: list[dict]) -> float:
    """Share of `pairs` whose chosen answer `trainer.model` finds more likely than the rejected one
    (summed completion log-probs; no reference plays a part)."""
    import numpy as np

    hits = []
    for batch in trainer.pair_batches(trainer.tokenize_eval(pairs), 0, False, trainer.args.per_device_eval_batch_size):
        logps = np.array(trainer.sequence_logps(trainer.model, trainer.to_device(batch)))  # [2B]: chosen, rejected
        b = int(batch["num_pairs"])
        hits.extend(logps[:b] > logps[b:2 * b])
    return float(np.mean(hits))


def held_out(trainer, rows: list[dict], pairs: list[dict]) -> dict:
    """{"exact_match": of `rows` (greedy), "preference": preference accuracy of `pairs`} of the trainer's model."""
    from mlxrl.evaluate import exact_match

    return {"exact_match": exact_match(trainer.model, trainer.processor, rows),
            "preference": preference_accuracy(trainer, pairs)}


def run_paired_demo(trainer_class, label: str, args, explicit: set, settings: dict, model_path: str | None = None,
                    sft_steps: int | None = None, n_test: int = DEMO_TEST, n_pairs: int | None = None,
                    demo: str = "qwen3_vl") -> dict:
    """The embedded demo of a paired trainer (module docstring). label: the run in words ("DPO (sigmoid, beta
    0.5)"); settings: the demo's config values for the fields the user did not set; n_pairs: distinct pairs
    (default one per trained example, so every batch is new); demo: the embedded default's architecture
    (`loading.DEMOS`). Returns held-out exact match and preference accuracy before and after, and the logged
    training metrics."""
    from ..data.synthetic import demo_rows

    apply_overrides(args, explicit, settings)
    t0 = time.perf_counter()
    if sft_steps is None:
        sft_steps = QWEN3_5_SFT_STEPS if demo == "qwen3_5" else DEMO_SFT_STEPS
    model, processor = briefly_sft_default(args, sft_steps, DEMO_SFT, model_path, demo)
    test = demo_rows(processor, n_test, seed=args.seed + 1, split="test")
    test_pairs = preference_pairs(test, seed=args.seed + 3)
    n_pairs = n_pairs or args.max_steps * args.per_device_train_batch_size * args.gradient_accumulation_steps
    pairs = preference_pairs(demo_rows(processor, n_pairs, seed=args.seed + 7, split="train"), seed=args.seed)
    trainer = trainer_class(model=model, processor=processor, args=args, train_dataset=pairs)
    # the adapters start at zero: the policy is still the model the trainer starts from
    before = held_out(trainer, test, test_pairs)
    name = label.split(" ")[0]
    print(f"{label} on {len(pairs)} synthetic preference pairs (chosen = the right colour, rejected = another); "
          f"before {name}, on {len(test)} held-out questions: exact match {before['exact_match']:.1%}, preference "
          f"accuracy (the share of held-out pairs whose chosen answer the model finds more likely) "
          f"{before['preference']:.1%}", flush=True)
    trainer.train()
    after = held_out(trainer, test, test_pairs)
    logged = [e for e in trainer.log_history if "rewards/accuracies" in e]
    trend = "  ".join(f"step {e['step']}: acc {e['rewards/accuracies']:.2f} margin {e['rewards/margins']:+.3f}"
                      for e in logged)
    print(f"rewards/accuracies and rewards/margins: {trend}", flush=True)
    # a 95% interval of a share of n rows is at most 1.96 * 0.5 / sqrt(n) wide on each side
    spread = 0.98 / len(test) ** 0.5
    print(f"after {name}, on {len(test)} held-out questions: exact match {before['exact_match']:.1%} -> "
          f"{after['exact_match']:.1%}, preference accuracy {before['preference']:.1%} -> {after['preference']:.1%} "
          f"(95% intervals: +/-{spread:.0%} at most); {trainer.step_shapes} batch shapes, {trainer.compiled_shapes} "
          f"compiled steps; {time.perf_counter() - t0:.0f}s in all; saved to {args.output_dir}", flush=True)
    return {"before": before, "after": after, "history": logged}


def demo_of(name: str, defaults: dict, label):
    """The `run_demo(args, explicit, model_path, sft_steps, n_test, n_pairs, overrides, demo)` of the paired
    trainer `name` (`mlxrl.registry`): `defaults` its demo settings for the fields the user did not set (the
    call's overrides on top: tests use shorter runs), label(args) the run in words."""
    def run_demo(args, explicit: set, model_path: str | None = None, sft_steps: int | None = None,
                 n_test: int = DEMO_TEST, n_pairs: int | None = None, overrides: dict | None = None,
                 demo: str = "qwen3_vl") -> dict:
        from ..registry import trainer_class

        settings = {**defaults, **(overrides or {})}
        apply_overrides(args, explicit, settings)
        return run_paired_demo(trainer_class(name), label(args), args, explicit, settings, model_path, sft_steps,
                               n_test, n_pairs, demo)

    return run_demo


def paired_main(argv, name: str, doc: str, run_demo) -> int:
    """`python -m mlxrl.NAME` of the paired trainer `name`: its config's flags and the paired flags, then
    `paired_command`."""
    from ..registry import check_config, config_class, trainer_class
    from ..trainers.flags import build_parser
    from .common import run

    cls = config_class(name)
    parser = build_parser(cls, f"python -m mlxrl.{name}", doc.splitlines()[0],
                          extra=lambda p: add_paired_flags(p, name.upper()))
    ns = parser.parse_args(argv)
    return run(lambda: paired_command(ns, cls, lambda a: check_config(name, a), trainer_class(name), run_demo))


def paired_command(ns, config_class, check, trainer_class, run_demo, check_row=None) -> None:
    """The body of a paired trainer's command: the config from the flags and its checks, the evaluation data's,
    --sft_steps', --demo's, all before a model loads; then the embedded demo (`run_demo(args, explicit,
    model_path, sft_steps, demo=...)`) or the user's data and model, trained and saved. check_row(row, index): the
    rows' own check (default: preference rows')."""
    from ..data.preference import check_preference_row
    from ..errors import MlxrlError
    from ..trainers.flags import config_from_args
    from .common import check_eval_data, each_row
    from .demos import check_demo_flag

    args = config_from_args(config_class, ns)
    check(args)  # before any model is loaded or trained
    check_eval_data(ns, args)
    if ns.sft_steps is not None and ns.sft_steps < 0:
        raise MlxrlError(f"--sft_steps {ns.sft_steps}: must be >= 0")
    demo = check_demo_flag(ns)
    if ns.dataset is None:
        if ns.model is not None and ns.sft_steps is not None:
            raise MlxrlError("--sft_steps applies to the embedded default without --model")
        if ns.eval_dataset:
            raise MlxrlError("--eval_dataset needs --dataset (the embedded task brings its own held-out rows)")
        run_demo(args, ns.explicit_fields, ns.model, ns.sft_steps, demo=demo)
        return
    if ns.sft_steps is not None:
        raise MlxrlError("--sft_steps applies to the embedded default (no --dataset)")
    model, processor, train, evaluation = load_model_and_rows(ns, args,
                                                              check_rows=each_row(check_row or check_preference_row))
    trainer_class(model=model, processor=processor, args=args, train_dataset=train, eval_dataset=evaluation).train()
    print(f"saved to {args.output_dir}", flush=True)
