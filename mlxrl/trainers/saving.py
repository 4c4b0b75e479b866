"""Checkpoints and the final save of the engine's `Trainer` (the helpers they use: `checkpoint`).

checkpoint-<step> holds the trainable weights, the optimizer state, the batch source's state and
trainer_state.json with what the checkpoint belongs to; it is written aside and renamed into place.
An error or a signal inside the loop saves the finished steps before it is raised; a failed final
save keeps the trained weights as a checkpoint.
"""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from ..atomic import write_atomically
from ..errors import MlxrlError
from ..models import lora as lora_lib
from . import checkpoint as checkpoint_lib
from . import plot, run_dir
from .checkpoint import CHECKPOINT_PREFIX
from .signals import TrainingInterrupted, stop_words
from .trl_fields import best_metric_key


class Saving:
    """Mixin of the engine's `Trainer`."""

    def _save_on_failure(self, failure) -> None:
        """A resumable checkpoint of the finished steps (rank 0), unless an update was half applied."""
        words = stop_words(failure).format(step=self.global_step + 1)
        if not self.is_main or not self._consistent or self._save_failed:
            return
        if self.global_step == 0:
            self.print(f"{words} before the first optimizer step: nothing to save")
            return
        try:
            with self.signals.critical(raise_pending=False):
                path = self._last_checkpoint() or self.save_checkpoint()
        except MlxrlError as e:
            if isinstance(failure, KeyboardInterrupt):
                raise e from None  # why there is no checkpoint, in one line
            self.print(f"{words}: could not save a checkpoint ({e})")
            return
        self.print(f"{words}: saved resumable checkpoint {path} (resume with --resume_from_checkpoint {path})")

    def _last_checkpoint(self) -> Path | None:
        """This run's checkpoint of the current step, if it was already written."""
        path = self.output_dir / f"{CHECKPOINT_PREFIX}{self.global_step}"
        return path if self._saved_step == self.global_step and path.is_dir() else None

    def _final_save(self) -> None:
        """save_final with Ctrl-C / SIGTERM held until it completes (then raised); if the save fails, the
        trained weights are kept as a resumable checkpoint before the error is raised. With
        load_best_model_at_end the best checkpoint's weights are loaded first."""
        try:
            with self.signals.critical(raise_pending=False):
                self._load_best()
                self.save_final()
        except Exception:
            if self.is_main and self.global_step > 0 and not self._save_failed:
                try:
                    with self.signals.critical(raise_pending=False):
                        path = self._last_checkpoint() or self.save_checkpoint()
                    self.print(f"the final save failed: the trained weights are in the resumable checkpoint {path} "
                               f"(resume with --resume_from_checkpoint {path} to save them)")
                except MlxrlError as e:
                    self.print(f"the final save failed and so did a checkpoint ({e})")
            raise
        self._draw_run()
        if self.signals.pending is not None:
            signum, self.signals.pending = self.signals.pending, None
            self.print(f"{signal.Signals(signum).name} during the final save: the save completed "
                       f"({self.output_dir}); stopping")
            self.reporter.close()
            raise TrainingInterrupted(signum)

    # ------------------------------------------------------------------ checkpoints
    def trainable_state(self) -> dict:
        return dict(tree_flatten(self.model.trainable_parameters()))

    def save_checkpoint(self) -> Path:
        """checkpoint-<step>: trainable weights, optimizer state, trainer_state.json with what the
        checkpoint belongs to (`checkpoint.run_record`); written aside and renamed into place."""
        final = self.output_dir / f"{CHECKPOINT_PREFIX}{self.global_step}"
        if not self.is_main:  # the ranks hold the same weights: rank 0 writes
            return final
        trainable = self.trainable_state()
        opt = dict(tree_flatten(self.optimizer.state))
        state = {**self.train_state.as_record(),
                 "world_size": self.world_size, "per_device_batch": self.args.per_device_train_batch_size,
                 "data": {"rows": self.rows_fingerprint, "data_seed": self.data_seed if self.shuffles else None},
                 "mlxrl": checkpoint_lib.run_record(self)}
        best = self._rank_checkpoint(final.name)
        if best is not None:  # transformers' names in trainer_state.json
            state["best_model_checkpoint"], state["best_metric"] = best

        source = {k: mx.array(v) for k, v in (self.source.state_dict() if self.source else {}).items()}

        def write(tmp: Path) -> None:
            mx.save_safetensors(str(tmp / "trainable.safetensors"), trainable)
            mx.save_safetensors(str(tmp / "optimizer.safetensors"), opt)
            if source:
                mx.save_safetensors(str(tmp / "batch_source.safetensors"), source)
            (tmp / "trainer_state.json").write_text(json.dumps(state, indent=1))

        with self.signals.critical():  # Ctrl-C waits for the checkpoint (then stops with it)
            try:
                write_atomically(final, write, what=f"checkpoint {final.name}")
            except BaseException:
                self._save_failed = True
                raise
            self._saved_step = self.global_step
            self._best = best
            self._rotate()
        self._draw_run()
        self._event("on_save")
        return final

    def _draw_run(self) -> None:
        """output_dir/run.png from the log history (`plot`), on the writing rank. A run.png that no mlxrl
        run drew is left alone; a failure to draw is a note, never a stop."""
        path = self.output_dir / plot.PLOT
        if not self.is_main or getattr(self, "_plot_refused", False):
            return
        try:
            if plot.PLOT not in (run_dir.read_record(self.output_dir) or {"files": []})["files"]:
                if path.exists():
                    self._plot_refused = True
                    self.print(f"note: {path} is not mlxrl's: the run's picture is not drawn (nothing was changed)")
                    return
                run_dir.write_record(self.output_dir, self.run_id, files=(plot.PLOT,))
            plot.draw(self.log_history, path, title=f"{type(self).__name__}: {self.output_dir.name}")
        except Exception as e:  # matplotlib, a full disk: the weights matter, the picture does not
            self._plot_refused = True
            self.print(f"note: the run's picture {path} was not drawn ({type(e).__name__}: {e})")

    # ------------------------------------------------------------------ load_best_model_at_end
    def _rank_checkpoint(self, name: str):
        """(best checkpoint's name, its metric) once the checkpoint `name` of this step is counted: the
        evaluation logged at this step against the best so far (transformers' rule); None when not asked."""
        if not getattr(self.args, "load_best_model_at_end", False):
            return None
        best = getattr(self, "_best", None)
        evals = [e for e in self.log_history if e.get("step") == self.global_step and any(k.startswith("eval_")
                                                                                            for k in e)]
        if not evals:
            return best
        key, greater = best_metric_key(self.args)
        if key not in evals[-1]:
            names = ", ".join(k[5:] for k in evals[-1] if k.startswith("eval_"))
            raise MlxrlError(f"metric_for_best_model {key[5:]!r} is not an evaluation metric of this trainer "
                             f"(it logs {names})")
        value = float(evals[-1][key])
        if best is None or (value > best[1] if greater else value < best[1]):
            return name, value
        return best

    def _load_best(self) -> None:
        best = getattr(self, "_best", None)
        if not getattr(self.args, "load_best_model_at_end", False) or best is None or not self.is_main:
            return
        path = self.output_dir / best[0]
        _, weights, _ = checkpoint_lib.read_checkpoint(path)
        self.model.load_weights(list(weights.items()), strict=False)
        mx.eval(self.model.parameters())
        self.print(f"loaded the best checkpoint {path} ({best_metric_key(self.args)[0]} {best[1]:.6g})")

    def _checkpoints(self) -> list[Path]:
        return checkpoint_lib.list_checkpoints(self.output_dir)

    def _rotate(self):
        """save_total_limit: delete this run's oldest checkpoints (checkpoint-<int> folders whose
        trainer_state.json carries this run's id and that hold only our files), never the best one."""
        limit = self.args.save_total_limit
        if limit:
            best = getattr(self, "_best", None)
            for old in checkpoint_lib.list_checkpoints(self.output_dir, self.run_id)[:-limit]:
                if checkpoint_lib.is_our_checkpoint(old) and (best is None or old.name != best[0]):
                    shutil.rmtree(old, ignore_errors=True)

    def load_checkpoint(self, path):
        """Resume: the checkpoint is checked against this run (one line naming the first difference)
        before anything is loaded; metrics.jsonl is cut back to the checkpoint's history."""
        path = run_dir.resolve_checkpoint(self.output_dir, path)
        state, weights, opt = checkpoint_lib.read_checkpoint(path)
        here = checkpoint_lib.run_record(self)
        if isinstance(state.get("mlxrl"), dict):
            checkpoint_lib.check_compatible(state["mlxrl"], here, path)
        checkpoint_lib.check_shapes({k: v.shape for k, v in weights.items()}, here["trainable"],
                                     f"--resume_from_checkpoint {path}", "trains")
        self._check_data(state, path)
        epoch, batch_in_epoch = self._data_position(state, path)
        self.optimizer.init(self.model.trainable_parameters())
        checkpoint_lib.check_optimizer_state(opt, dict(tree_flatten(self.optimizer.state)), path)
        self.model.load_weights(list(weights.items()), strict=False)
        self.optimizer.state = tree_unflatten(list(opt.items()))
        self.train_state.restore(state, epoch, batch_in_epoch)
        if (path / "batch_source.safetensors").exists():
            source = checkpoint_lib.load_file(path, "batch_source.safetensors", "the batch source's state")
            self.source.load_state_dict({k: np.array(v) for k, v in source.items()})
        self._take_run_id(state, path)
        if state.get("best_model_checkpoint") is not None:
            self._best = (state["best_model_checkpoint"], float(state["best_metric"]))
        if path.resolve().parent == self.output_dir.resolve():
            self._saved_step = self.global_step  # this checkpoint is this run's
        if self.is_main:  # the steps after the checkpoint are trained again: do not repeat them
            checkpoint_lib.rewrite_metrics(self.output_dir, self.log_history)
        mx.eval(self.model.parameters(), self.optimizer.state)
        self.print(f"resumed from {path} at step {self.global_step}")

    def _data_position(self, state: dict, path: Path) -> tuple[int, int]:
        """(epoch, micro-batches of it consumed) to resume at: the epoch's rows already consumed, cut into
        this run's per-rank batches (a checkpoint resumes on any number of ranks; keep the global batch the
        same to continue the same run); epoch 0's start with ignore_data_skip, as TrainingArguments'."""
        if self.args.ignore_data_skip:
            return 0, 0
        here_batch = self.world_size * self.args.per_device_train_batch_size
        saved = state.get("world_size", 1) * state.get("per_device_batch", self.args.per_device_train_batch_size)
        epoch, position = state["epoch"], state["batch_in_epoch"] * saved // here_batch
        if position > self.source.epoch_length(epoch):
            raise MlxrlError(f"--resume_from_checkpoint {path}: trainer_state.json's data position (batch "
                             f"{state['batch_in_epoch']} of epoch {epoch}) is past the end of this run's epoch "
                             f"({self.source.epoch_length(epoch)} batches): resume with the same --dataset and batch "
                             "size, or from another checkpoint")
        return epoch, position

    def _check_data(self, state: dict, path: Path) -> None:
        """The checkpoint's data position means something only on the same rows in the same order: another
        dataset or data seed is refused in one line (ignore_data_skip starts the new data at its beginning)."""
        saved = state.get("data") or {}
        if self.args.ignore_data_skip or not saved:
            return
        where = f"--resume_from_checkpoint {path}"
        skip = "or pass --ignore_data_skip true to start this run's data at its first batch"
        if saved.get("rows") not in (None, self.rows_fingerprint):
            raise MlxrlError(f"{where} was trained on other rows than this run's dataset (its data position would "
                             f"skip or repeat rows): resume with the same --dataset, {skip}")
        if saved.get("data_seed") not in (None, self.data_seed):
            raise MlxrlError(f"{where} was trained with data order seed {saved['data_seed']} and this run's is "
                             f"{self.data_seed}: resume with --seed {saved['data_seed']} (or --data_seed), {skip}")

    def _take_run_id(self, state: dict, path: Path) -> None:
        """Continue the checkpoint's run, unless that run went on past it in this output_dir: then resuming
        from the earlier checkpoint starts a new run, so that rotation (save_total_limit) keeps this run's
        checkpoints and `last` continues this run, not the abandoned one."""
        saved_id = state.get("run_id")
        newer = [p.name for p in checkpoint_lib.list_checkpoints(self.output_dir, saved_id)
                 if saved_id and checkpoint_lib.checkpoint_step(p) > state["global_step"]]
        if not newer:
            self.run_id = saved_id or self.run_id
            return
        self.print(f"{path.name} is an earlier checkpoint of a run that went on to {newer[-1]}: this is a new run "
                   f"from it; that run's later checkpoints are kept except those this run's saves replace")

    def save_final(self):
        from ..loading import save

        args = self.args
        if not self.is_main:
            return
        if getattr(self.model, "lora_config", None):
            # the adapter and processor files are written aside, then renamed into output_dir (which also
            # holds the checkpoints): a failure leaves the previous adapter loadable
            def write(tmp: Path) -> None:
                lora_lib.save_adapter(self.model, tmp, getattr(self.model, "name_or_path", None))
                if self.processor is not None:
                    self.processor.save_pretrained(tmp)

            write_atomically(self.output_dir, write, what="the LoRA adapter", kind="adapter", into="adapter")
            if getattr(args, "merge_quantized", False):  # first: the float merge below dequantizes the base
                with lora_lib.merged(self.model, dequantize=False):
                    save(self.model, self.processor, self.output_dir / "merged-quantized", overwrite=True)
            if args.merge:
                lora_lib.merge_lora(self.model)
                save(self.model, self.processor, self.output_dir / "merged", overwrite=True)
        else:
            # into output_dir itself, as TRL's save_model writes it (beside the checkpoints and metrics.jsonl)
            save(self.model, self.processor, self.output_dir, into=True)
