"""`python -m mlxrl.grpo`: group relative policy optimisation of a Qwen / Qwen-VL model (TRL's GRPOTrainer flags).

    python -m mlxrl.grpo                                   # embedded default: tiny Qwen3-VL, synthetic colour questions
    python -m mlxrl.grpo --model Qwen/Qwen3-VL-2B-Instruct --dataset prompts.jsonl \\
        --reward_funcs my_rewards:accuracy my_rewards:format --reward_weights 1.0 0.2 --use_peft --output_dir out
    python -m mlxrl.grpo --config grpo.yaml --beta 0.04    # CLI > YAML > defaults

Every GRPOConfig field is a flag (`--help` lists them). `--reward_funcs` takes `module:function` (or
`path/to/file.py:function`) entries, each a TRL reward function
`f(prompts, completions, completion_ids, **dataset_columns) -> list[float | None]`, and reward model folders or
Hub ids (a sequence classifier, `python -m mlxrl.reward`'s output), as TRL's GRPOTrainer takes them. Errors print one
line and exit with status 2 (MLXRL_DEBUG=1 shows the traceback); Ctrl-C saves a resumable checkpoint.

The embedded default (no --model, no --dataset): the tiny default model gets a brief SFT on the
synthetic colour questions (or start from --model), then GRPO with LoRA on fresh questions of the
same task, rewarded 1 when the completion is exactly the right colour word (`mlxrl.grpo:colour_reward`).
It prints the mean reward of every step's completions, and held-out exact match before and after.
"""

from __future__ import annotations

import time

from .. import registry
from ..trainers.flags import build_parser, config_from_args
from ..trainers.grpo.trainer import GRPOConfig
from .common import apply_overrides, load_model_and_rows, run
from .demos import briefly_sft_default
from .tool_demo import TOOL_DEMO_SFT_STEPS

# The embedded default's settings (used only for fields the user did not set).
DEMO_OVERRIDES = {"overwrite_output_dir": True,  # the demo's own folder: a rerun starts over
                  "learning_rate": 1e-3, "max_steps": 30, "per_device_train_batch_size": 64, "num_generations": 8,
                  "max_completion_length": 4, "temperature": 1.0, "top_k": 8, "use_peft": True, "lora_r": 16,
                  "lora_alpha": 32, "lr_scheduler_type": "constant", "warmup_steps": 0,
                  "logging_steps": 1, "save_steps": 0, "gradient_checkpointing": False, "output_dir": "out/grpo-demo",
                  "disable_tqdm": True}
DEMO_SFT_STEPS, DEMO_TEST = 10, 96
QWEN3_5_SFT_STEPS = 30  # the tiny Qwen3.5 after 10 steps answers almost nothing right: GRPO gets no reward to follow
# Why these settings (each measured over seeds: docs/grpo.md, the paragraph on robustness): a brief SFT teaches the
# answer format (a colour word) but leaves room for the reward to rise; top_k samples among the plausible words
# instead of the untrained tail of the vocabulary; LoRA at this learning rate, as a larger one oscillated and full
# fine-tuning fell (Adam scales the noisy RL gradient up).


def colour_reward(prompts, completions, completion_ids, answer, **kwargs):
    """1.0 when the completion is exactly the expected answer (surrounding whitespace ignored), else 0.0."""
    out = []
    for completion, want in zip(completions, answer, strict=True):
        text = completion[0]["content"] if isinstance(completion, list) else completion
        out.append(1.0 if text.strip() == want else 0.0)
    return out


def prompt_rows(rows: list[dict]) -> list[dict]:
    """Synthetic VQA rows (or their text variant) -> TRL prompt rows: {"prompt": messages, "answer": str}
    plus "images" when the row has them."""
    from ..evaluate import split_row

    out = []
    for row in rows:
        prompt, answer = split_row(row)
        out.append({"prompt": prompt, **({"images": row["images"]} if row.get("images") else {}), "answer": answer})
    return out


def add_tools_flag(parser) -> None:
    parser.add_argument("--tools", nargs="+", default=None,
                        help="module:function tools the model may call while it generates. TRL's tools=: Python "
                             "functions (or path/to/file.py:function), conversational prompts only")


def tools_of(ns) -> list | None:
    """The --tools functions, loaded (one line for a spec that does not name one)."""
    from ..trainers.grpo.rewards import load_reward_func

    return [load_reward_func(s, "tool") for s in ns.tools] if getattr(ns, "tools", None) else None


def _extra(parser, title: str = "GRPO"):
    from .demos import add_demo_flag

    add_demo_flag(parser)
    parser.add_argument("--model", default=None, help="Hub id or local folder (default: the embedded demo)")
    parser.add_argument("--dataset", default=None, help="local .json/.jsonl/.parquet file or folder, or a Hub dataset")
    parser.add_argument("--dataset_split", default="train", help="split of a Hub dataset")
    parser.add_argument("--reward_funcs", nargs="+", default=None,
                        help="module:function reward functions and reward model folders "
                             "(default: the demo's colour_reward)")
    if title == "GRPO":
        add_tools_flag(parser)
        parser.add_argument("--demo_task", default="colours", choices=("colours", "tools"),
                            help="embedded default only: the colour questions, or tools (questions only a tool "
                                 "can answer)")
    parser.add_argument("--sft_steps", type=int, default=None,
                        help=f"embedded default only: SFT steps before {title} from the tiny model "
                             f"({DEMO_SFT_STEPS}; {QWEN3_5_SFT_STEPS} for Qwen3.5; {TOOL_DEMO_SFT_STEPS} for tools)")


def run_demo(args: GRPOConfig, explicit: set, model_path: str | None = None, sft_steps: int | None = None,
             n_test: int = DEMO_TEST, overrides: dict | None = None, reward_funcs=None, demo: str = "qwen3_vl",
             trainer: str = "grpo") -> dict:
    """The embedded default (`demo`: its architecture) of GRPO or RLOO (`trainer`, a registry name); overrides
    replace DEMO_OVERRIDES (tests use a shorter run)."""
    import numpy as np

    from mlxrl.evaluate import exact_match

    from ..data.synthetic import demo_rows
    from .demos import DEMO_SFT

    title = registry.entry(trainer).title
    apply_overrides(args, explicit, {**DEMO_OVERRIDES, **(overrides or {})})
    registry.check_config(trainer, args)
    t0 = time.perf_counter()
    if sft_steps is None:
        sft_steps = QWEN3_5_SFT_STEPS if demo == "qwen3_5" else DEMO_SFT_STEPS
    model, processor = briefly_sft_default(args, sft_steps, DEMO_SFT, model_path, demo)
    test = demo_rows(processor, n_test, seed=args.seed + 1, split="test")
    prompts_needed = args.max_steps * args.per_device_train_batch_size * args.gradient_accumulation_steps
    n_prompts = max(prompts_needed // args.num_generations, 8)
    rows = prompt_rows(demo_rows(processor, n_prompts, seed=args.seed + 7, split="train"))
    before = exact_match(model, processor, test)
    print(f"{title} on {len(rows)} synthetic colour questions, {args.num_generations} completions each, reward 1 "
          f"for the right colour word; held-out exact match before {title}: {before:.1%}", flush=True)
    trainer = registry.trainer_class(trainer)(model=model, processor=processor, args=args, train_dataset=rows,
                                              reward_funcs=reward_funcs or [colour_reward])
    trainer.train()
    history = trainer.log_history
    after = exact_match(model, processor, test)
    logged = [e for e in history if "reward" in e]
    trend = " ".join(f"{e['reward']:.2f}" for e in logged)
    first, last = logged[: max(1, len(logged) // 4)], logged[-max(1, len(logged) // 4):]
    r0, r1 = float(np.mean([e["reward"] for e in first])), float(np.mean([e["reward"] for e in last]))
    print(f"mean reward per logged step: {trend}", flush=True)
    print(f"mean reward: first quarter {r0:.3f} -> last quarter {r1:.3f}; held-out exact match after {title}: "
          f"{after:.1%} (before {before:.1%}); {trainer.step_shapes} batch shapes, {trainer.compiled_shapes} compiled "
          f"steps; generation {trainer.generation_time:.0f}s, "
          f"{time.perf_counter() - t0:.0f}s in all; saved to {args.output_dir}", flush=True)
    return {"before": before, "after": after, "history": logged, "reward_first": r0, "reward_last": r1,
            "model": model, "processor": processor}


def main(argv=None) -> int:
    return rollout_main(argv, "grpo", __doc__)


def rollout_main(argv, trainer: str, doc: str) -> int:
    """`python -m mlxrl.<trainer>` for a trainer of GRPO's rollouts (grpo, rloo): its config's flags, the reward
    functions, the embedded demo."""
    e = registry.entry(trainer)
    parser = build_parser(registry.config_class(trainer), f"python -m mlxrl.{trainer}", doc.splitlines()[0],
                          extra=lambda p: _extra(p, e.title))
    ns = parser.parse_args(argv)
    return run(lambda: _main(ns, trainer))


def _main(ns, trainer: str = "grpo") -> None:
    from ..data.formats import check_prompt_rows
    from ..errors import MlxrlError
    from ..trainers.grpo.rewards import reward_entry
    from .demos import check_demo_flag

    args = config_from_args(registry.config_class(trainer), ns)
    registry.check_config(trainer, args)  # before any model is loaded or trained
    if ns.sft_steps is not None and ns.sft_steps < 0:
        raise MlxrlError(f"--sft_steps {ns.sft_steps}: must be >= 0")
    funcs = [reward_entry(s) for s in ns.reward_funcs] if ns.reward_funcs else None
    tools = tools_of(ns)
    explicit = ns.explicit_fields
    demo = check_demo_flag(ns)
    if ns.dataset is None:
        if ns.model is not None and ns.sft_steps is not None:
            raise MlxrlError("--sft_steps applies to the embedded default without --model")
        if tools:
            raise MlxrlError("--tools needs --model and --dataset (the embedded demo has its own task)")
        if getattr(ns, "demo_task", "colours") == "tools":
            from .tool_demo import run_tool_demo

            if ns.model is not None or funcs:
                raise MlxrlError("--demo_task tools runs the embedded default with its own reward: leave out --model "
                                 "and --reward_funcs")
            run_tool_demo(args, explicit, ns.sft_steps, demo)
            return
        run_demo(args, explicit, ns.model, ns.sft_steps, reward_funcs=funcs, demo=demo, trainer=trainer)
        return
    if getattr(ns, "demo_task", "colours") != "colours":
        raise MlxrlError("--demo_task picks the embedded default's task: leave out --dataset")
    if ns.model is None:
        raise MlxrlError("--model is required with --dataset (a Hub id or a local folder)")
    if not funcs:
        raise MlxrlError("--reward_funcs is required with --dataset (module:function or reward model folders ...)")
    model, processor, train, _ = load_model_and_rows(ns, args, with_eval=False,
                                                     check_rows=check_prompt_rows)
    registry.trainer_class(trainer)(model=model, processor=processor, args=args, train_dataset=train,
                                    reward_funcs=funcs, **({"tools": tools} if tools else {})).train()
    print(f"saved to {args.output_dir}", flush=True)
