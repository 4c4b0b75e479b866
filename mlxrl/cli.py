"""What the trainer CLIs (`python -m mlxrl.sft | dpo | grpo`) share: one-line errors with exit
codes, loading a model with its data, the embedded demos' settings and brief SFT warm start."""

from __future__ import annotations

import os
import sys

from .hub import MlxrlError

ERRORS = (MlxrlError, ValueError, FileNotFoundError, NotImplementedError)


def run(body) -> int:
    """Run `body()`; a user error prints one line (MLXRL_DEBUG=1: the traceback) and returns 2,
    Ctrl-C returns 130 (the trainer has saved a resumable checkpoint)."""
    try:
        return body() or 0
    except KeyboardInterrupt:
        return 130
    except ERRORS as e:
        if os.environ.get("MLXRL_DEBUG"):
            raise
        print(f"error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        return 2


def apply_overrides(args, explicit: set, overrides: dict) -> None:
    """Demo settings for the config fields the user did not set."""
    for k, v in overrides.items():
        if k not in explicit:
            setattr(args, k, v)


def load_model_and_rows(ns, args, *, with_eval: bool = True):
    """(model, processor, train rows, eval rows or None) from --model / --dataset / --eval_dataset,
    holding out `eval_split` of the training rows when no eval set is given."""
    import mlxrl
    from mlxrl.data import load_rows

    if ns.model is None:
        raise MlxrlError("--model is required with --dataset (a Hub id or a local folder)")
    model, processor = mlxrl.load(ns.model, dtype=args.dtype)
    train = load_rows(ns.dataset, split=ns.dataset_split)
    if not with_eval:
        return model, processor, train, None
    evaluation = load_rows(ns.eval_dataset) if getattr(ns, "eval_dataset", None) else None
    if evaluation is None and args.eval_split > 0:
        cut = int(len(train) * (1 - args.eval_split))
        train, evaluation = train[:cut], train[cut:]
    return model, processor, train, evaluation


def briefly_sft_default(args, sft_steps: int, sft_settings: dict, model_path: str | None):
    """The DPO / GRPO demos' starting point: `model_path`, or the embedded default after `sft_steps`
    of SFT on synthetic colour questions (so the policy is partly trained)."""
    import mlxrl
    from mlxrl.data.synthetic import make_vqa

    from .trainers.config import SFTConfig
    from .trainers.sft import SFTTrainer

    if model_path is not None:
        return mlxrl.load(model_path, dtype=args.dtype)
    model, processor = mlxrl.load_default(seed=args.seed, dtype=args.dtype)
    if sft_steps > 0:
        print(f"embedded default: tiny Qwen3-VL, brief SFT ({sft_steps} steps) on synthetic colour questions",
              flush=True)
        sft_args = SFTConfig(**{**sft_settings, "max_steps": sft_steps, "seed": args.seed,
                                "logging_steps": max(1, sft_steps // 2),
                                "output_dir": os.path.join(args.output_dir, "sft")})
        SFTTrainer(model, processor, sft_args,
                   train_dataset=make_vqa(sft_steps * 8, seed=args.seed, split="train")).train()
        model.unfreeze()  # the next trainer sets up its own trainable parameters
    return model, processor
