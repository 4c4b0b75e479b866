"""`python -m mlxrl.distill`: on-policy distillation of a Qwen / Qwen-VL student from a teacher (TRL's
DistillationTrainer flags).

    python -m mlxrl.distill                                # embedded default: tiny Qwen3-VL teacher and student
    python -m mlxrl.distill --model Qwen/Qwen3-0.6B --teacher_model_name_or_path Qwen/Qwen3-4B \\
        --dataset prompts.jsonl --beta 0.5 --use_peft --output_dir out
    python -m mlxrl.distill --config distill.yaml --temperature 0.9   # CLI > YAML > defaults

Every DistillationConfig field is a flag (`--help` lists them); the dataset's rows are prompts ({"prompt": str or
messages}, optional "images"). The student samples one completion per prompt and learns the teacher's next-token
distribution at each of its tokens (the generalized JSD: --beta 0 forward KL, 1 reverse). Errors print one line and
exit with status 2 (MLXRL_DEBUG=1 shows the traceback); Ctrl-C saves a resumable checkpoint.

The embedded default (no --model, no --dataset): a teacher, the tiny default after a longer SFT on the synthetic
colour questions (40 steps), and a student, the same default after a brief one (10 steps); the student is distilled
on fresh questions with LoRA. It prints each logged step's divergence and the student's held-out exact match before and
after, next to the teacher's.
"""

from __future__ import annotations

import dataclasses
import os
import time

from ..trainers.distill.config import DistillationConfig, check_distillation_config
from ..trainers.flags import build_parser, config_from_args
from .common import apply_overrides, load_model_and_rows, run
from .demos import DEMO_SFT, add_demo_flag, briefly_sft_default, check_demo_flag
from .grpo import add_tools_flag, tools_of

__all__ = ["main", "run_demo"]

# The embedded default's settings (used only for fields the user did not set); why these: docs/distill.md.
DEMO_OVERRIDES = {"overwrite_output_dir": True,  # the demo's own folder: a rerun starts over
                  "learning_rate": 2e-3, "max_steps": 30, "per_device_train_batch_size": 16,
                  "max_completion_length": 4, "temperature": 1.0, "top_k": 8, "use_peft": True, "lora_r": 16,
                  "lora_alpha": 32, "lr_scheduler_type": "constant", "warmup_steps": 0, "logging_steps": 5,
                  "save_steps": 0, "gradient_checkpointing": False, "output_dir": "out/distill-demo",
                  "disable_tqdm": True}
TEACHER_SFT_STEPS, STUDENT_SFT_STEPS, DEMO_TEST = 40, 10, 96


def _extra(parser):
    add_demo_flag(parser)
    parser.add_argument("--model", default=None, help="the student: Hub id or local folder (default: the embedded "
                                                      "demo)")
    parser.add_argument("--dataset", default=None, help="local .json/.jsonl/.parquet file or folder, or a Hub dataset")
    parser.add_argument("--dataset_split", default="train", help="split of a Hub dataset")
    add_tools_flag(parser)


def run_demo(args: DistillationConfig, explicit: set, demo: str = "qwen3_vl", overrides: dict | None = None,
             teacher_steps: int = TEACHER_SFT_STEPS, student_steps: int = STUDENT_SFT_STEPS,
             n_test: int = DEMO_TEST) -> dict:
    """The embedded default (`demo`: its architecture); overrides replace DEMO_OVERRIDES (tests use a shorter run)."""
    from ..cli.grpo import prompt_rows
    from ..data.synthetic import demo_rows
    from ..evaluate import exact_match
    from ..trainers.distill.trainer import DistillationTrainer

    apply_overrides(args, explicit, {**DEMO_OVERRIDES, **(overrides or {})})
    check_distillation_config(args)
    t0 = time.perf_counter()
    teacher_args = dataclasses.replace(args, output_dir=os.path.join(args.output_dir, "teacher"))
    teacher, processor = briefly_sft_default(teacher_args, teacher_steps, DEMO_SFT, None, demo)
    teacher.freeze()
    student, processor = briefly_sft_default(args, student_steps, DEMO_SFT, None, demo)
    test = demo_rows(processor, n_test, seed=args.seed + 1, split="test")
    teacher_em, before = exact_match(teacher, processor, test), exact_match(student, processor, test)
    n_prompts = max(args.max_steps * args.per_device_train_batch_size * args.gradient_accumulation_steps, 8)
    rows = [{k: v for k, v in r.items() if k != "answer"}
            for r in prompt_rows(demo_rows(processor, n_prompts, seed=args.seed + 7, split="train"))]
    print(f"distillation on {len(rows)} synthetic colour questions, one completion each; held-out exact match: "
          f"teacher {teacher_em:.1%}, student before {before:.1%}", flush=True)
    trainer = DistillationTrainer(model=student, processor=processor, args=args, train_dataset=rows,
                                  teacher_model=teacher)
    trainer.train()
    after = exact_match(student, processor, test)
    logged = [e for e in trainer.log_history if "loss" in e]
    trend = " ".join(f"{e['loss']:.3f}" for e in logged)
    print(f"divergence per logged step: {trend}", flush=True)
    print(f"held-out exact match: student {before:.1%} -> {after:.1%} (teacher {teacher_em:.1%}); "
          f"{time.perf_counter() - t0:.0f}s in all; saved to {args.output_dir}", flush=True)
    return {"before": before, "after": after, "teacher": teacher_em, "history": logged, "model": student,
            "processor": processor}


def main(argv=None) -> int:
    parser = build_parser(DistillationConfig, "python -m mlxrl.distill", __doc__.splitlines()[0], extra=_extra)
    ns = parser.parse_args(argv)
    return run(lambda: _main(ns))


def _main(ns) -> None:
    from ..data.formats import check_prompt_rows
    from ..errors import MlxrlError
    from ..trainers.distill.trainer import DistillationTrainer

    args = config_from_args(DistillationConfig, ns)
    check_distillation_config(args)  # before any model is loaded or trained
    demo = check_demo_flag(ns)
    tools = tools_of(ns)
    if ns.dataset is None:
        if tools:
            raise MlxrlError("--tools needs --model and --dataset (the embedded demo has its own task)")
        if ns.model is not None:
            raise MlxrlError("--model needs --dataset (prompt rows); without both the embedded demo runs")
        run_demo(args, ns.explicit_fields, demo)
        return
    if ns.model is None:
        raise MlxrlError("--model is required with --dataset (a Hub id or a local folder)")
    if args.teacher_model_name_or_path is None:
        raise MlxrlError("--teacher_model_name_or_path is required with --dataset (the teacher's Hub id or folder)")
    model, processor, train, _ = load_model_and_rows(ns, args, with_eval=False, check_rows=check_prompt_rows)
    DistillationTrainer(model=model, processor=processor, args=args, train_dataset=train,
                        **({"tools": tools} if tools else {})).train()
    print(f"saved to {args.output_dir}", flush=True)
