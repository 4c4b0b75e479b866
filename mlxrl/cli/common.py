"""What the trainer CLIs (`python -m mlxrl.sft | dpo | grpo`) share: one-line errors with exit
codes, loading data then a model (the data is checked before the model loads; the model loads as the
run asks, `trainers.model_setup.load_for_training`). The embedded demos' flag and warm start are `cli.demos`, their rows
`data.synthetic`.

Data roles (`data_sources`): --dataset's `--dataset_split` trains. A folder of split files (mlx-lm's
train.jsonl / valid.jsonl / test.jsonl, or `datasets`' split names: `data.files.folder_splits`) is read
split by split: its validation split is the evaluation set unless --eval_dataset is given, and its test
split is read only when asked for (mlx-lm's --test); no split is merged into another."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from ..errors import MlxrlError
from ..hub import check_model_reference

ERRORS = (MlxrlError, ValueError, FileNotFoundError, NotImplementedError)


def run(body) -> int:
    """The error boundary of every entry point: run `body()`; a user error prints one line (MLXRL_DEBUG=1:
    the traceback) and returns 2, as does a disk error from any library (a full disk while tokenizers
    writes tokenizer.json); Ctrl-C returns 130 (the trainer has saved a resumable checkpoint), and a
    second Ctrl-C during the shutdown that follows is ignored (no "Exception ignored in atexit" noise)."""
    from ..atomic import write_error_reason

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


def check_eval_data(ns, args, sources=None) -> None:
    """eval_strategy needs evaluation data (--eval_dataset, --eval_split, or the validation split of a folder
    of splits): refused here, before any model loads (the HF Trainer raises too)."""
    if getattr(args, "eval_strategy", "no") == "no" or getattr(ns, "eval_dataset", None) or \
            getattr(args, "eval_split", 0):
        return
    if sources is None and getattr(ns, "dataset", None):
        sources = data_sources(ns, args)
    if sources is None or sources.evaluation is None:
        raise MlxrlError(f"--eval_strategy {args.eval_strategy} needs evaluation data: pass --eval_dataset (or "
                         "--eval_split, or a folder with a validation split such as mlx-lm's valid.jsonl), or set "
                         "--eval_strategy no")


@dataclass
class Sources:
    """Which (dataset, split) each role reads: `train`, `evaluation` (None: none), `test` (None: not asked
    for); `splits`: --dataset's split files when it is a folder of them."""

    train: tuple[str, str]
    evaluation: tuple[str, str] | None = None
    test: tuple[str, str] | None = None
    splits: object = None

    def note(self, evaluates: bool = True) -> str | None:
        """What each split file of a folder of splits is used for, in one line (None for other datasets);
        `evaluates`: whether the run evaluates its evaluation set."""
        if self.splits is None:
            return None
        roles = {self.train[1]: "training"}
        if self.evaluation is not None and self.evaluation[0] == self.train[0]:
            roles[self.evaluation[1]] = ("the evaluation set" if evaluates else
                                         "the evaluation set, read; --eval_strategy steps or epoch evaluates it")
        if self.test is not None:
            roles[self.test[1]] = "a test loss after training"
        parts = [f"{split}: {self.splits.names(split)} ({roles.get(split, 'not read')})" for split in self.splits.files]
        return (f"note: dataset {self.splits.folder} holds splits (named as mlx-lm's train/valid/test.jsonl or "
                f"datasets' split files): {'; '.join(parts)}")


def _is_local(dataset) -> bool:
    return os.path.exists(os.path.expanduser(str(dataset))) or str(dataset).startswith((".", "/", "~"))


def data_sources(ns, args, *, with_eval: bool = True, test: bool = False, hub_splits: bool = False) -> Sources:
    """The roles of --dataset's splits (and --eval_dataset's): see the module docstring. `test`: the test
    split is wanted (an error if there is none); `hub_splits`: a Hub dataset's validation and test splits are
    looked up too (mlx-lm's --data reads its train / valid / test splits)."""
    from ..data.files import folder_splits, hub_split_names, split_named

    exclude = (args.output_dir,)
    splits = folder_splits(ns.dataset, exclude)
    names = list(splits.files) if splits else None
    if names is None and hub_splits and not _is_local(ns.dataset):
        names = hub_split_names(ns.dataset)
    train = split_named(ns.dataset_split, names or ()) or ns.dataset_split
    sources = Sources(train=(ns.dataset, train), splits=splits)
    eval_dataset = getattr(ns, "eval_dataset", None)
    if with_eval and eval_dataset:
        own = folder_splits(eval_dataset, exclude)
        pick = (split_named("validation", own.files) or split_named("test", own.files)) if own else None
        sources.evaluation = (eval_dataset, pick or "train")
    elif with_eval and names:
        validation = split_named("validation", names)
        if validation is not None and validation != train:
            sources.evaluation = (ns.dataset, validation)
    if test:
        split = split_named("test", names or ())
        if split is None:
            raise MlxrlError(f"--test reports the test split's loss after training, but dataset {ns.dataset} has no "
                             "test split (mlx-lm's test.jsonl)")
        if split == train:
            raise MlxrlError(f"--test reports the loss of the test split, which --dataset_split {ns.dataset_split} "
                             "trains on: train on another split")
        sources.test = (ns.dataset, split)
    return sources


def each_row(check):
    """`check(row, index)` -> a check of a list of rows."""
    def check_rows(rows):
        for i, row in enumerate(rows):
            check(row, i)
    return check_rows


@dataclass
class Data:
    """The rows a run reads: training, evaluation (None: none) and test (None: not asked for)."""

    train: list
    evaluation: list | None = None
    test: list | None = None


def check_inputs(ns, args) -> None:
    """The model reference and the output folder, before any data is read."""
    if ns.model is None:
        raise MlxrlError("--model is required with --dataset (a Hub id or a local folder)")
    check_model_reference(ns.model)  # a missing folder or a mistyped id, before reading the data
    from ..trainers.run_dir import check_target

    check_target(args.output_dir, model=ns.model, data=(ns.dataset, getattr(ns, "eval_dataset", None)))


def read_data(ns, args, sources: Sources | None = None, *, with_eval: bool = True, convert=None,
              check_rows=None) -> Data:
    """The rows of each role in `sources` (default `data_sources(ns, args)`), each passed through
    `convert(rows)` and `check_rows(rows)` (errors name the file and line); --eval_split holds out the end of
    the training rows when nothing else is the evaluation set. A folder never yields the run's output_dir."""
    from mlxrl.data import load_rows

    sources = sources or data_sources(ns, args, with_eval=with_eval)
    exclude = (args.output_dir,)
    evaluates = getattr(args, "eval_strategy", "no") != "no" or getattr(args, "eval_on_start", False)
    if (note := sources.note(evaluates)) is not None:
        print(note, file=sys.stderr, flush=True)
    train = load_rows(sources.train[0], split=sources.train[1], exclude=exclude)
    evaluation = test = None
    if sources.evaluation is not None:
        dataset, split = sources.evaluation
        evaluation = load_rows(dataset, split=split, exclude=exclude, note=dataset != sources.train[0])
    if sources.test is not None:
        test = load_rows(sources.test[0], split=sources.test[1], exclude=exclude, note=False)
    eval_prefix = f"--eval_dataset {ns.eval_dataset}: " if getattr(ns, "eval_dataset", None) else ""
    parts = [(train, ""), (evaluation, eval_prefix), (test, "")]
    train, evaluation, test = (None if rows is None else _prepared(rows, prefix, convert, check_rows)
                               for rows, prefix in parts)
    if with_eval and getattr(args, "eval_split", 0) > 0:
        if evaluation is not None:
            what = (f"--eval_dataset {ns.eval_dataset}" if eval_prefix else
                    f"the validation split of {ns.dataset} ({sources.splits.names(sources.evaluation[1])})"
                    if sources.splits else f"the {sources.evaluation[1]!r} split of {ns.dataset}")
            raise MlxrlError(f"--eval_split holds out training rows, but {what} is the evaluation set: drop "
                             "--eval_split")
        cut = int(len(train) * (1 - args.eval_split))
        if cut < 1 or cut == len(train):
            raise MlxrlError(f"--eval_split {args.eval_split} of {len(train)} rows leaves "
                             f"{'no training' if cut < 1 else 'no evaluation'} rows")
        train, evaluation = sliced_rows(train, 0, cut), sliced_rows(train, cut, len(train))
    return Data(train, evaluation, test)


def _prepared(rows, prefix: str, convert, check_rows):
    """`convert(rows)` then `check_rows` on them, an error about row N naming its file and line."""
    if convert is not None:
        try:
            rows = convert(rows)
        except MlxrlError as e:
            raise MlxrlError(f"{prefix}{_locate(rows, str(e))}") from None
    if check_rows is not None:
        _check_located(check_rows, rows, prefix)
    return rows


def sliced_rows(rows, start: int, stop: int):
    """rows[start:stop], keeping where each row came from (`data.files.Rows`)."""
    from ..data.files import Rows

    out = Rows(rows[start:stop])
    origins = getattr(rows, "origins", None)
    out.origins = list(origins[start:stop]) if origins else []
    return out


def _locate(rows, message: str) -> str:
    from ..data.files import locate

    return locate(rows, message)


def load_model(ns, args):
    """(model, processor) of --model as the run asks: its dtype, a LoRA run's frozen base kept in the checkpoint's
    bfloat16 (`models.widened`), or quantized as it loads (--load_in_4bit / --load_in_8bit)."""
    from ..trainers.model_setup import load_for_training

    return load_for_training(ns.model, args)


def load_model_and_rows(ns, args, *, with_eval: bool = True, check_rows=None):
    """(model, processor, train rows, eval rows or None) from --model / --dataset / --eval_dataset (see
    `read_data`). The rows are read (and passed to `check_rows(rows)`) before the model loads."""
    check_inputs(ns, args)
    data = read_data(ns, args, with_eval=with_eval, check_rows=check_rows)
    model, processor = load_model(ns, args)
    return model, processor, data.train, data.evaluation


def _check_located(check_rows, rows, prefix: str) -> None:
    """check_rows(rows), its "row N: ..." error naming the file and line of row N."""
    from ..data.files import locate

    try:
        check_rows(rows)
    except MlxrlError as e:
        raise MlxrlError(f"{prefix}{locate(rows, str(e))}") from None
