"""Checkpoints of a run (`Checkpoints`, held by the engine's `Trainer` as `trainer.checkpoints`), what a resume
checks against the run's data, and the final save. The file formats and checks are `checkpoint`'s.

checkpoint-<step> holds the trainable weights, the optimizer state, the batch source's state and
trainer_state.json with what the checkpoint belongs to; it is written aside and renamed into place.
An error or a signal inside the loop saves the finished steps before it is raised (`keep_finished`); a
failed final save keeps the trained weights as a checkpoint (`keep_after_failed_save`).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..atomic import write_atomically
from ..errors import MlxrlError
from ..models import lora as lora_lib
from . import checkpoint as checkpoint_lib
from . import run_dir
from .checkpoint import CHECKPOINT_PREFIX
from .signals import StopSignals, stop_words
from .trl_fields import best_metric_key


class Checkpoints:
    """The checkpoint-<step> folders of one run in `output_dir`: written aside and renamed into place (rank 0
    writes: the ranks hold the same weights), rotated (save_total_limit, never the best one), ranked for
    load_best_model_at_end, and read back, checked, on resume. Ctrl-C / SIGTERM wait for a write (`signals`)."""

    def __init__(self, output_dir: Path, args, *, is_main: bool, signals: StopSignals, print_fn: Callable):
        self.output_dir, self.args, self.is_main = Path(output_dir), args, is_main
        self.signals, self.print = signals, print_fn
        self.saved_step: int | None = None  # the step of the last checkpoint this run wrote
        self.failed = False  # a write failed: a stop does not try another
        self.best: tuple[str, float] | None = None  # load_best_model_at_end: (checkpoint name, its metric)

    def path(self, step: int) -> Path:
        return self.output_dir / f"{CHECKPOINT_PREFIX}{step}"

    def written(self, step: int) -> Path | None:
        """This run's checkpoint of `step`, if it was already written."""
        path = self.path(step)
        return path if self.saved_step == step and path.is_dir() else None

    def listed(self, run_id: str | None = None) -> list[Path]:
        """The checkpoints in output_dir (of the run `run_id` only, when given), oldest first."""
        return checkpoint_lib.list_checkpoints(self.output_dir, run_id)

    def write(self, step: int, record: dict, files: dict[str, dict], *, run_id: str, log_history: list) -> Path:
        """checkpoint-<step>: `files` (safetensors name -> arrays) and trainer_state.json (`record`, plus
        transformers' best_model_checkpoint / best_metric), written aside and renamed into place; then the
        run's oldest checkpoints past save_total_limit are removed."""
        final = self.path(step)
        if not self.is_main:
            return final
        best = self._ranked(final.name, step, log_history)
        if best is not None:
            record = {**record, "best_model_checkpoint": best[0], "best_metric": best[1]}

        def write(tmp: Path) -> None:
            for name, arrays in files.items():
                mx.save_safetensors(str(tmp / name), arrays)
            (tmp / "trainer_state.json").write_text(json.dumps(record, indent=1))

        with self.signals.critical():  # Ctrl-C waits for the checkpoint (then stops with it)
            try:
                write_atomically(final, write, what=f"checkpoint {final.name}")
            except BaseException:
                self.failed = True
                raise
            self.saved_step, self.best = step, best
            self._rotate(run_id)
        return final

    def _ranked(self, name: str, step: int, log_history: list):
        """(best checkpoint's name, its metric) once the checkpoint `name` of `step` is counted: the evaluation
        logged at this step against the best so far (transformers' rule); None when not asked."""
        if not getattr(self.args, "load_best_model_at_end", False):
            return None
        evals = [e for e in log_history if e.get("step") == step and any(k.startswith("eval_") for k in e)]
        if not evals:
            return self.best
        key, greater = best_metric_key(self.args)
        if key not in evals[-1]:
            names = ", ".join(k[5:] for k in evals[-1] if k.startswith("eval_"))
            raise MlxrlError(f"metric_for_best_model {key[5:]!r} is not an evaluation metric of this trainer "
                             f"(it logs {names})")
        value = float(evals[-1][key])
        if self.best is None or (value > self.best[1] if greater else value < self.best[1]):
            return name, value
        return self.best

    def _rotate(self, run_id: str) -> None:
        """save_total_limit: delete this run's oldest checkpoints (checkpoint-<int> folders whose
        trainer_state.json carries this run's id and that hold only our files), never the best one."""
        limit = self.args.save_total_limit
        if limit:
            for old in self.listed(run_id)[:-limit]:
                if checkpoint_lib.is_our_checkpoint(old) and (self.best is None or old.name != self.best[0]):
                    shutil.rmtree(old, ignore_errors=True)

    def best_weights(self) -> tuple[Path, dict] | None:
        """(path, trainable weights) of the best checkpoint, with load_best_model_at_end on rank 0; else None."""
        if not getattr(self.args, "load_best_model_at_end", False) or self.best is None or not self.is_main:
            return None
        path = self.output_dir / self.best[0]
        return path, checkpoint_lib.read_checkpoint(path)[1]

    def read(self, path, here: dict) -> tuple[Path, dict, dict, dict, dict | None]:
        """(path, trainer_state.json, trainable weights, optimizer state, the batch source's state or None) of the
        checkpoint `path` (or `last`), checked against this run's record `here` (one line naming the first
        difference) before anything is loaded."""
        path = run_dir.resolve_checkpoint(self.output_dir, path)
        state, weights, opt = checkpoint_lib.read_checkpoint(path)
        if isinstance(state.get("mlxrl"), dict):
            checkpoint_lib.check_compatible(state["mlxrl"], here, path)
        checkpoint_lib.check_shapes({k: v.shape for k, v in weights.items()}, here["trainable"],
                                     f"--resume_from_checkpoint {path}", "trains")
        source = None
        if (path / "batch_source.safetensors").exists():
            arrays = checkpoint_lib.load_file(path, "batch_source.safetensors", "the batch source's state")
            source = {k: np.array(v) for k, v in arrays.items()}
        return path, state, weights, opt, source

    def resumed(self, path: Path, state: dict) -> None:
        """The checkpoint `path` was loaded: its best checkpoint is this run's, and it is this run's last one when it
        lies in output_dir."""
        if state.get("best_model_checkpoint") is not None:
            self.best = (state["best_model_checkpoint"], float(state["best_metric"]))
        if path.resolve().parent == self.output_dir.resolve():
            self.saved_step = state["global_step"]

    def keep_finished(self, failure: BaseException, step: int, *, consistent: bool, save: Callable[[], Path]) -> None:
        """A resumable checkpoint of the `step` finished steps when the loop stopped on `failure` (rank 0), unless
        an update was half applied (`consistent` false) or a write already failed; `save` writes one."""
        words = stop_words(failure).format(step=step + 1)
        if not self.is_main or not consistent or self.failed:
            return
        if step == 0:
            self.print(f"{words} before the first optimizer step: nothing to save")
            return
        try:
            with self.signals.critical(raise_pending=False):
                path = self.written(step) or save()
        except MlxrlError as e:
            if isinstance(failure, KeyboardInterrupt):
                raise e from None  # why there is no checkpoint, in one line
            self.print(f"{words}: could not save a checkpoint ({e})")
            return
        self.print(f"{words}: saved resumable checkpoint {path} (resume with --resume_from_checkpoint {path})")

    def keep_after_failed_save(self, step: int, save: Callable[[], Path]) -> None:
        """The final save failed: the trained weights of `step` kept as a resumable checkpoint (rank 0)."""
        if not self.is_main or step == 0 or self.failed:
            return
        try:
            with self.signals.critical(raise_pending=False):
                path = self.written(step) or save()
            self.print(f"the final save failed: the trained weights are in the resumable checkpoint {path} "
                       f"(resume with --resume_from_checkpoint {path} to save them)")
        except MlxrlError as e:
            self.print(f"the final save failed and so did a checkpoint ({e})")


def data_position(state: dict, path: Path, args, *, world_size: int, epoch_length: Callable[[int], int]
                  ) -> tuple[int, int]:
    """(epoch, micro-batches of it consumed) to resume at: the epoch's rows already consumed, cut into this run's
    per-rank batches (a checkpoint resumes on any number of ranks; keep the global batch the same to continue the
    same run); epoch 0's start with ignore_data_skip, as TrainingArguments'."""
    if args.ignore_data_skip:
        return 0, 0
    here_batch = world_size * args.per_device_train_batch_size
    saved = state.get("world_size", 1) * state.get("per_device_batch", args.per_device_train_batch_size)
    epoch, position = state["epoch"], state["batch_in_epoch"] * saved // here_batch
    if position > epoch_length(epoch):
        raise MlxrlError(f"--resume_from_checkpoint {path}: trainer_state.json's data position (batch "
                         f"{state['batch_in_epoch']} of epoch {epoch}) is past the end of this run's epoch "
                         f"({epoch_length(epoch)} batches): resume with the same --dataset and batch size, or from "
                         "another checkpoint")
    return epoch, position


def check_data(state: dict, path: Path, args, *, rows_fingerprint, data_seed: int) -> None:
    """The checkpoint's data position means something only on the same rows in the same order: another dataset or
    data seed is refused in one line (ignore_data_skip starts the new data at its beginning)."""
    saved = state.get("data") or {}
    if args.ignore_data_skip or not saved:
        return
    where = f"--resume_from_checkpoint {path}"
    skip = "or pass --ignore_data_skip true to start this run's data at its first batch"
    if saved.get("rows") not in (None, rows_fingerprint):
        raise MlxrlError(f"{where} was trained on other rows than this run's dataset (its data position would "
                         f"skip or repeat rows): resume with the same --dataset, {skip}")
    if saved.get("data_seed") not in (None, data_seed):
        raise MlxrlError(f"{where} was trained with data order seed {saved['data_seed']} and this run's is "
                         f"{data_seed}: resume with --seed {saved['data_seed']} (or --data_seed), {skip}")


def continued_run_id(state: dict, path: Path, output_dir: Path, run_id: str, print_fn: Callable) -> str:
    """The run a resume continues: the checkpoint's, unless that run went on past it in output_dir; then resuming
    from the earlier checkpoint starts a new run (`run_id`), so that rotation (save_total_limit) keeps this run's
    checkpoints and `last` continues this run, not the abandoned one."""
    saved_id = state.get("run_id")
    newer = [p.name for p in checkpoint_lib.list_checkpoints(output_dir, saved_id)
             if saved_id and checkpoint_lib.checkpoint_step(p) > state["global_step"]]
    if not newer:
        return saved_id or run_id
    print_fn(f"{path.name} is an earlier checkpoint of a run that went on to {newer[-1]}: this is a new run from it; "
             "that run's later checkpoints are kept except those this run's saves replace")
    return run_id


def save_final(model, processor, output_dir: Path, args) -> None:
    """The trained model: a LoRA run's adapter (and --merge / --merge_quantized's merged models beside it), or the
    full model into output_dir itself, as TRL's save_model writes it (beside the checkpoints and metrics.jsonl)."""
    from ..loading import save

    if not getattr(model, "lora_config", None):
        save(model, processor, output_dir, into=True)
        run_dir.remove_replaced(output_dir)
        return

    # the adapter and processor files are written aside, then renamed into output_dir (which also holds the
    # checkpoints): a failure leaves the previous adapter loadable
    def write(tmp: Path) -> None:
        lora_lib.save_adapter(model, tmp, getattr(model, "name_or_path", None))
        if processor is not None:
            processor.save_pretrained(tmp)

    write_atomically(output_dir, write, what="the LoRA adapter", kind="adapter", into="adapter")
    if getattr(args, "merge_quantized", False):  # first: the float merge below dequantizes the base
        with lora_lib.merged(model, dequantize=False):
            save(model, processor, output_dir / "merged-quantized", overwrite=True)
    if args.merge:
        lora_lib.merge_lora(model)
        save(model, processor, output_dir / "merged", overwrite=True)
    run_dir.remove_replaced(output_dir, run_dir.merged_folders(args))
