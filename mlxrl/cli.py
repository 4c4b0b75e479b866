"""What the trainer CLIs (`python -m mlxrl.sft | dpo | grpo`) share: one-line errors with exit
codes, loading data then a model (the data is checked before the model loads; --load_in_4bit /
--load_in_8bit quantize it), the embedded demos' settings and synthetic rows (a text variant for
text-only models), and the brief SFT warm start."""

from __future__ import annotations

import os
import sys

from .hub import MlxrlError, check_model_reference

ERRORS = (MlxrlError, ValueError, FileNotFoundError, NotImplementedError)


def run(body) -> int:
    """The error boundary of every entry point: run `body()`; a user error prints one line (MLXRL_DEBUG=1:
    the traceback) and returns 2, as does a disk error from any library (a full disk while tokenizers
    writes tokenizer.json); Ctrl-C returns 130 (the trainer has saved a resumable checkpoint), and a
    second Ctrl-C during the shutdown that follows is ignored (no "Exception ignored in atexit" noise)."""
    from .atomic import write_error_reason

    try:
        return body() or 0
    except KeyboardInterrupt:
        _ignore_further_interrupts()
        return 130
    except ERRORS as e:
        return _one_line(e)
    except Exception as e:
        reason = write_error_reason(e)
        if reason is None:
            raise
        return _one_line(MlxrlError(f"cannot write to disk: {reason} ({str(e).splitlines()[0] if str(e) else ''}); "
                                    "free space or choose another folder"))


def _one_line(e: BaseException) -> int:
    if os.environ.get("MLXRL_DEBUG"):
        raise e
    print(f"error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
    return 2


def _ignore_further_interrupts() -> None:
    """In a `python -m mlxrl...` process only (not a program or test calling `main()`): the process is
    about to exit, and a Ctrl-C in its shutdown would interrupt an atexit callback."""
    import signal
    import threading

    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name.startswith("mlxrl") and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def apply_overrides(args, explicit: set, overrides: dict) -> None:
    """Demo settings for the config fields the user did not set."""
    for k, v in overrides.items():
        if k not in explicit:
            setattr(args, k, v)


def check_eval_data(ns, args) -> None:
    """eval_strategy needs evaluation data: refused here, before any model loads (the HF Trainer raises too)."""
    if getattr(args, "eval_strategy", "no") != "no" and not getattr(ns, "eval_dataset", None) and \
            not getattr(args, "eval_split", 0):
        raise MlxrlError(f"--eval_strategy {args.eval_strategy} needs evaluation data: pass --eval_dataset (or "
                         "--eval_split), or set --eval_strategy no")


def each_row(check):
    """`check(row, index)` -> a check of a list of rows."""
    def check_rows(rows):
        for i, row in enumerate(rows):
            check(row, i)
    return check_rows


def prepare_base(model, args):
    """--load_in_4bit / --load_in_8bit: the loaded base quantized before the trainer adds LoRA, and its
    weight bytes printed (`models.quantize.quantize_for`: full fine-tuning of a quantized base is refused)."""
    from .models.quantize import describe, is_quantized, quantize_for

    quantize_for(model, args)
    if is_quantized(model):
        print(describe(model), flush=True)
    return model


def load_model_and_rows(ns, args, *, with_eval: bool = True, check_rows=None):
    """(model, processor, train rows, eval rows or None) from --model / --dataset / --eval_dataset,
    holding out `eval_split` of the training rows when no eval set is given. The rows are read (and
    passed to `check_rows(rows)`) before the model loads; a folder dataset never yields the run's own
    output_dir."""
    import mlxrl
    from mlxrl.data import load_rows
    from mlxrl.models.widened import keeps_checkpoint_dtype

    if ns.model is None:
        raise MlxrlError("--model is required with --dataset (a Hub id or a local folder)")
    check_model_reference(ns.model)  # a missing folder or a mistyped id, before reading the data
    from .trainers.run_dir import check_target

    check_target(args.output_dir, model=ns.model, data=(ns.dataset, getattr(ns, "eval_dataset", None)))
    exclude = (args.output_dir,)
    train = load_rows(ns.dataset, split=ns.dataset_split, exclude=exclude)
    evaluation = None
    if with_eval and getattr(ns, "eval_dataset", None):
        evaluation = load_rows(ns.eval_dataset, exclude=exclude)
    if check_rows is not None:
        _check_located(check_rows, train, "")
        if evaluation is not None:  # no --eval_dataset: nothing to check (an empty list is refused)
            _check_located(check_rows, evaluation, f"--eval_dataset {ns.eval_dataset}: ")
    # a LoRA run's frozen base stays in the checkpoint's bfloat16 (`models.widened`)
    model, processor = mlxrl.load(ns.model, dtype=args.dtype, keep_linear_dtype=keeps_checkpoint_dtype(args))
    prepare_base(model, args)
    if not with_eval:
        return model, processor, train, None
    if evaluation is None and args.eval_split > 0:
        cut = int(len(train) * (1 - args.eval_split))
        if cut < 1 or cut == len(train):
            raise MlxrlError(f"--eval_split {args.eval_split} of {len(train)} rows leaves "
                             f"{'no training' if cut < 1 else 'no evaluation'} rows")
        train, evaluation = train[:cut], train[cut:]
    return model, processor, train, evaluation


def _check_located(check_rows, rows, prefix: str) -> None:
    """check_rows(rows), its "row N: ..." error naming the file and line of row N."""
    from .data.files import locate

    try:
        check_rows(rows)
    except MlxrlError as e:
        raise MlxrlError(f"{prefix}{locate(rows, str(e))}") from None


# Objects and colours of the text variant of the synthetic task (for text-only models).
_TEXT_SHAPES = ("circle", "square", "triangle", "star")


def text_colour_rows(n: int, seed: int = 0, split: str = "train") -> list[dict]:
    """The synthetic colour task in words, for text-only models: two coloured shapes are described and the
    question asks the colour of one ("A red circle and a blue square. What color is the square?" -> blue);
    one-word answers, rows shaped like `make_vqa`'s without images. Deterministic in (n, seed, split)."""
    import numpy as np

    from .data.synthetic import COLORS

    colours = list(COLORS)
    rng = np.random.default_rng([int(seed), {"train": 0, "test": 1}[split], 7])
    rows = []
    for _ in range(n):
        shapes = rng.choice(len(_TEXT_SHAPES), 2, replace=False)
        cols = rng.choice(len(colours), 2, replace=False)
        a, b = (_TEXT_SHAPES[k] for k in shapes)
        ca, cb = (colours[k] for k in cols)
        asked = int(rng.integers(2))
        question = f"A {ca} {a} and a {cb} {b}. What color is the {(a, b)[asked]}? Answer with one word."
        rows.append({"messages": [{"role": "user", "content": [{"type": "text", "text": question}]},
                                  {"role": "assistant", "content": [{"type": "text", "text": (ca, cb)[asked]}]}],
                     "type": "color"})
    return rows


def demo_rows(processor, n: int, seed: int, split: str) -> list[dict]:
    """The embedded task's rows: synthetic VQA for a vision-language model, its text variant otherwise."""
    from .data.synthetic import make_vqa

    if processor.image_processor is None:
        return text_colour_rows(n, seed=seed, split=split)
    return make_vqa(n, seed=seed, split=split)


def briefly_sft_default(args, sft_steps: int, sft_settings: dict, model_path: str | None):
    """The DPO / GRPO demos' starting point: `model_path`, or the embedded default after `sft_steps`
    of SFT on synthetic colour questions (so the policy is partly trained)."""
    import mlxrl
    from mlxrl.data.synthetic import make_vqa

    from .trainers.config import SFTConfig
    from .trainers.sft import SFTTrainer

    if model_path is not None:
        model, processor = mlxrl.load(model_path, dtype=args.dtype)
        return prepare_base(model, args), processor
    model, processor = mlxrl.load_default(seed=args.seed, dtype=args.dtype)
    if sft_steps > 0:
        print(f"embedded default: tiny Qwen3-VL, brief SFT ({sft_steps} steps) on synthetic colour questions",
              flush=True)
        sft_args = SFTConfig(**{**sft_settings, "max_steps": sft_steps, "seed": args.seed,
                                "logging_steps": max(1, sft_steps // 2),
                                "output_dir": os.path.join(args.output_dir, "sft"), "overwrite_output_dir": True})
        SFTTrainer(model, processor, sft_args,
                   train_dataset=make_vqa(sft_steps * 8, seed=args.seed, split="train")).train()
        model.unfreeze()  # the next trainer sets up its own trainable parameters
    return prepare_base(model, args), processor
