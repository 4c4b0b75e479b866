"""The one training engine shared by SFT, DPO and GRPO: the only training loop.

A trainer supplies a batch source (`sources`: SFT's and DPO's datasets through `make_batches(epoch)`, GRPO's
generation rounds through `make_source()`) and a pure `loss(model, batch, normalizer) -> (loss, metrics)`; the
engine owns everything else: trainable parameters (full / LoRA / frozen vision), the optimizer with its schedule,
gradient accumulation (losses normalised by the trained items of the whole accumulated batch, as TRL), grad-norm
clipping, an `mx.compile`d step per shape bucket (state = model, optimizer, random state; one `mx.eval` per
micro-batch), evaluation, resumable checkpoints (`saving`: trainable weights, optimizer state, step, data position
and the source's state; the RNG is reseeded from (seed, step) every step, so resuming reproduces the uninterrupted
run), logging with TRL's metric names plus tokens/s and peak memory (`reporting`), a progress bar, metrics.jsonl,
and data parallel sums over the ranks (`distributed`).

Nothing is lost (see `checkpoint` and `mlxrl.atomic`): every folder is written aside and renamed into
place; an output_dir holding another run is refused; Ctrl-C and (in one process) SIGTERM stop at the
end of the current update or save and leave a resumable checkpoint; an error inside the loop saves
one of the finished steps before it is raised; Ctrl-C during the final save lets the save finish.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import signal
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from .. import runtime
from ..cpu import fastmath
from ..data.batches import pad_image_patches
from ..data.files import naming_rows
from ..models import lora as lora_lib
from ..models import quantize as quantize_lib
from ..optim.optimizers import no_decay_names
from . import checkpoint as checkpoint_lib
from . import run_dir
from .checkpoint import CHECKPOINT_PREFIX  # noqa: F401  (engine.CHECKPOINT_PREFIX)
from .config import check_config
from .distributed import DataParallel, PeerLostError, accumulate
from .forward import hidden_rows, hidden_states, router_aux_coef  # noqa: F401  (engine.hidden_*)
from .model_setup import check_for_training, prepare_for_training
from .progress import Progress
from .reporting import LogWindow, RunLog, memory_plan, precision
from .saving import Checkpoints, check_data, continued_run_id, data_position, save_final
from .signals import StopSignals, TrainingInterrupted
from .sources import DatasetSource, step_seed  # noqa: F401  (engine.step_seed)
from .state import TrainState, state_field
from .trl_api import TRLSurface
from .trl_fields import best_metric_key, every_steps


class Trainer(TRLSurface):
    """Subclasses implement the hooks of `hooks.TrainerHooks`: `loss(model, batch, normalizer)` and either
    `make_batches(epoch)` (a dataset) or `make_source()` (another batch source, see `sources`), and may
    replace the others' defaults below. Everything else is the engine's: the loop (`_train`, read top to
    bottom) and the objects it holds: the counters (`state.TrainState`, `self.train_state`), the checkpoints
    (`saving.Checkpoints`, `self.checkpoints`), stop signals (`signals.StopSignals`, `self.signals`), the
    data-parallel ranks (`distributed.DataParallel`, `self.parallel`) and the log (`reporting.RunLog`,
    `self.run_log`)."""

    metric_names: tuple[str, ...] = ()
    global_step = state_field("global_step", "optimizer steps taken (`train_state`)")
    epoch = state_field("epoch", "epochs finished (`train_state`)")
    batch_in_epoch = state_field("batch_in_epoch", "micro-batches of the current epoch consumed (`train_state`)")
    num_tokens = state_field("num_tokens", "real tokens trained on, every rank's (`train_state`)")
    log_history = state_field("log_history", "every log entry (`train_state`)")
    run_id = state_field("run_id", "this run's id, in every checkpoint (`train_state`)")

    def __init__(self, model, processor, args):
        if not isinstance(getattr(type(self), "trainer_name", None), str):  # the engine has no default identity
            raise TypeError(f"{type(self).__name__} declares no trainer_name (its command, what its checkpoints "
                            "record and the memory planner's model): set it on the class, e.g. trainer_name = \"sft\"")
        self.model, self.processor, self.args = model, processor, args
        # data parallel: launched by `mlx.launch` (ring / MPI / NCCL / JACCL), else a group of one
        self.parallel = DataParallel(mx.distributed.init(), self._peer_lost)
        self.rank, self.world_size = self.parallel.rank, self.parallel.world_size
        self.is_main = self.rank == 0
        self.output_dir = Path(args.output_dir)
        check_config(args)  # types, ranges, choices, refused TRL fields, the optimizer: one line each, no folder yet
        check_for_training(model, args)  # bf16 against the model, the checkpointing segments it can have
        run_dir.check_target(args.output_dir, model=model)  # empty, the current folder, the model's own folder
        run_dir.check_output_dir(self.output_dir)
        if self.is_main:  # before any work: a folder another run writes or holds, files the final save would replace
            run_dir.check_unlocked(self.output_dir)
            run_dir.check_run_dir(self.output_dir, resume=args.resume_from_checkpoint,
                                  overwrite=bool(args.overwrite_output_dir), lora=bool(args.use_peft),
                                  merged=run_dir.merged_folders(args), other_run_ok=True)
        runtime.setup(tf32=args.tf32, use_cpu=args.use_cpu)  # MLX's CPU cache, TF32 on a GPU, --use_cpu
        runtime.set_memory_limits(args.memory_limit, args.wired_limit, args.cache_limit)
        mx.random.seed(args.seed)
        self.router_aux_coef = router_aux_coef(model, args.router_aux_loss_coef)
        prepare_for_training(model, args)  # quantized (unless it loaded so), checkpointing, tiling, LoRA / unfrozen
        self.optimizer = None
        self.train_state = TrainState()  # step, epoch, data position, tokens, log history, run id
        self._compiled: dict = {}  # batch shape -> step function (compiled or eager)
        self._n_compiled = 0
        self._shapes_seen: set = set()
        self._dtypes_checked = False  # whether an update has been checked to keep every parameter's dtype
        self.rows_fingerprint = None  # the training rows' digest (set by the trainers): a resume checks it
        self.row_origins = None  # the training rows' files and lines (data.files.origins_of; set by the trainers)
        self.source = None  # the batch source (`make_source`), made when training starts
        self._consistent = True  # False while an update is half applied (no checkpoint then)
        self.signals = StopSignals()  # Ctrl-C / SIGTERM held inside updates and saves
        self.checkpoints = Checkpoints(self.output_dir, args, is_main=self.is_main, signals=self.signals,
                                       print_fn=self.print)
        self.run_log = RunLog(args, self.output_dir, is_main=self.is_main)  # stdout, metrics.jsonl, trackers
        self.memory_plan = None

    def _peer_lost(self, why: str) -> str:
        """The one line a rank prints when another rank is lost: its step, and what resuming starts from."""
        found = self.checkpoints.listed()
        last = f"the last checkpoint {found[-1]} is intact" if found else "no checkpoint was saved yet"
        return (f"rank {self.rank} of {self.world_size}: lost another rank at step {self.global_step} ({why}); "
                f"{last}: resume with --resume_from_checkpoint last, on any number of ranks")

    # ------------------------------------------------------------------ parameters
    @property
    def head_trainable(self) -> bool:
        """Whether the LM-head weight receives a gradient (not with LoRA or frozen tied embeddings)."""
        weight = self.model.lm_head_weight()
        return any(v is weight for _, v in tree_flatten(self.model.trainable_parameters()))

    # ------------------------------------------------------------------ the step
    def step_function(self):
        """(batch, normalizer) -> (loss, metrics, grads): the step the engine compiles per batch shape. A hook:
        by default `nn.value_and_grad` of `loss`; SFT's two-phase head differentiates its own way."""
        loss_and_grad = nn.value_and_grad(self.model, self.loss)

        def step(batch, normalizer):
            (loss, metrics), grads = loss_and_grad(self.model, batch, normalizer)
            return loss, metrics, grads

        return step

    @property
    def compilable(self) -> bool:
        """Whether the step can be traced by mx.compile (an eager step evaluates inside: it cannot)."""
        return True

    def _step_for(self, batch):
        """A compiled step per batch shape (up to max_compiled_shapes, then eager)."""
        key = tuple(sorted((k, v.shape, v.dtype) for k, v in batch.items() if isinstance(v, mx.array)))
        if key not in self._compiled:
            fn = self.step_function()
            if self.args.compile and self.compilable and self._n_compiled < self.args.max_compiled_shapes:
                state = [self.model.state, mx.random.state]
                fn = mx.compile(fn, inputs=state, outputs=state)
                self._n_compiled += 1
            self._compiled[key] = fn
        return self._compiled[key]

    def _update(self, grads):
        """Clip (global norm, folded into the optimizer's update) and update; returns the norm."""
        norm = mx.sqrt(sum(fastmath.sum_squares(g) for _, g in tree_flatten(grads)))
        clip = self.args.max_grad_norm
        # torch's clip_grad_norm_: scale by max_norm / (norm + 1e-6) when that is below 1
        self.optimizer.grad_scale = mx.minimum(1.0, clip / (norm + 1e-6)) if clip and clip > 0 else mx.array(1.0)
        self.optimizer.update(self.model, grads)
        return norm

    # ------------------------------------------------------------------ hooks for subclasses
    def make_batches(self, epoch: int) -> list[dict]:
        raise NotImplementedError

    def loss(self, model, batch: dict, normalizer):
        raise NotImplementedError

    def to_device(self, batch: dict) -> dict:
        """np -> mx for the arrays the step uses, and the vision tower's layout of a batch's images
        (`vision_meta`, computed once on the host instead of inside the compiled step)."""
        arrays = {k: mx.array(v) for k, v in batch.items() if isinstance(v, np.ndarray)}
        if "image_grid_thw" in batch:
            arrays["vision_meta"] = self.model.vision_metadata(batch["image_grid_thw"])
        return arrays

    def gradient_free_inputs(self, arrays: dict) -> dict:
        """Inputs of the loss computed without a gradient before the step (DPO: the reference model's
        log-probs); by default none."""
        return arrays

    def bucket_images(self, batch: dict) -> dict:
        """With a compiled step and patch_buckets: the batch's image patches padded to a bucket by a
        dummy image (`data.batches.pad_image_patches`), so batches with differently sized images share
        a compiled step; otherwise the batch unchanged."""
        a = self.args
        if "pixel_values" not in batch or not (a.compile and a.patch_buckets and self.compilable):
            return batch
        pixels, grid = pad_image_patches(np.asarray(batch["pixel_values"]), np.asarray(batch["image_grid_thw"]))
        return {**batch, "pixel_values": pixels, "image_grid_thw": grid}

    def batch_tokens(self, batch: dict) -> tuple[int, float]:
        """(real tokens, this micro-batch's share of the loss normaliser) of a prepared batch. The engine sums
        the shares over the accumulated global batch (every rank's) and passes the sum to `loss` as
        `normalizer`: trained tokens (SFT, TRL's num_items_in_batch), pairs (DPO), completion tokens per
        micro-batch or one per micro-batch (GRPO's token-sum and mean losses)."""
        return int(batch["num_tokens"]), float(batch["normalizer"])

    def evaluation_metrics(self) -> dict:
        """The evaluation set's metrics, un-prefixed (`evaluate()`, TRL's, adds eval_); none by default."""
        return {}

    def make_source(self):
        """What the loop consumes (see `sources`): by default the dataset of `make_batches(epoch)`."""
        return DatasetSource(self.make_batches)

    # ------------------------------------------------------------------ training loop
    def _plan(self):
        """(optimizer steps per epoch, total optimizer steps); makes the batch source."""
        self.source = self.make_source()
        self._epoch_batches = self.source.epoch_length(0)
        # transformers' Trainer: ceil(micro-batches / accumulation) steps an epoch, the last on the leftovers
        per_epoch = max(1, math.ceil(self._epoch_batches / self.args.gradient_accumulation_steps))
        if self.args.max_steps and self.args.max_steps > 0:
            total = self.args.max_steps
        else:
            total = int(math.ceil(self.args.num_train_epochs * per_epoch))
        return per_epoch, total

    @property
    def data_seed(self) -> int:
        return self.args.seed if self.args.data_seed is None else self.args.data_seed  # TrainingArguments'

    @property
    def shuffles(self) -> bool:
        """Whether the training batches come in a new order every epoch (TrainingArguments'
        train_sampling_strategy "random"; "sequential": the dataset's order)."""
        return getattr(self.args, "train_sampling_strategy", "random") != "sequential"

    @property
    def has_eval_data(self) -> bool:
        return bool(getattr(self, "eval_examples", None))

    def train(self, resume_from_checkpoint=None, **unused):
        """Train; returns transformers' `TrainOutput(global_step, training_loss, metrics)` (TRL's; the run's
        last log entry). resume_from_checkpoint: True (the newest checkpoint of output_dir), a checkpoint
        folder, or None (the config's)."""
        if unused:
            raise TypeError(f"train() got an unexpected keyword argument {sorted(unused)[0]!r}")
        if resume_from_checkpoint not in (None, False):
            spec = "last" if resume_from_checkpoint is True else str(resume_from_checkpoint)
            self.args = dataclasses.replace(self.args, resume_from_checkpoint=spec)
        start, first_step = time.perf_counter(), self.global_step
        with naming_rows(self.row_origins):  # a bad training row found in the loop: its file and line
            self._run()
        return self._summary(time.perf_counter() - start, first_step)

    def _run(self):
        """The whole run: the folder locked, the loop, the final save."""
        args = self.args
        if (args.eval_strategy != "no" or args.eval_on_start) and not self.has_eval_data:  # HF's Trainer raises too
            what = "eval_strategy" if args.eval_strategy != "no" else "eval_on_start"
            raise ValueError(f"{what} {getattr(args, what)!r} needs evaluation data: pass --eval_dataset (or "
                             f"--eval_split), or set --{what} {'no' if what == 'eval_strategy' else 'false'}")
        lock = run_dir.RunLock(self.output_dir).acquire() if self.is_main else None  # until train() returns
        try:
            return self._train()
        finally:
            if lock is not None:
                lock.release()

    def _train(self):
        """The run, top to bottom: the folder, the plan and the optimizer (a resumed run's state read back), then
        the loop (a group of micro-batches, one optimizer step on it (`_step`), then logging / evaluation /
        checkpoints at their cadence; epochs end when the source's do), then the final save. A stop anywhere in the loop
        (Ctrl-C, SIGTERM, an error) leaves a resumable checkpoint of the finished steps (`_saved_when_stopped`)."""
        args = self.args
        self.model.train()  # as transformers' loop does: whatever mode a script or an evaluation left it in
        if self.is_main:
            run_dir.start_run(self.output_dir, resume=args.resume_from_checkpoint,
                              overwrite=bool(args.overwrite_output_dir), lora=bool(args.use_peft),
                              merged=run_dir.merged_folders(args))
        steps_per_epoch, total = self._plan()
        self.total_steps = total
        # (log, evaluate, save) every so many steps; TrainingArguments' fractions of the total resolved
        self._every = tuple(every_steps(v, total) for v in (args.logging_steps, args.eval_steps or args.logging_steps,
                                                            args.save_steps))
        self.optimizer = args.make_optimizer(total, no_decay_names(self.model))  # transformers' decay groups
        if args.resume_from_checkpoint:
            self.load_checkpoint(args.resume_from_checkpoint)
        if self.is_main:  # this run now owns the folder: `last` continues it, its metrics.jsonl is ours
            run_dir.write_record(self.output_dir, self.run_id)
        self._announce(steps_per_epoch, total)
        if args.eval_on_start:
            self._log_eval()
        restore_signals = self.signals.catch(self.world_size)
        self._event("on_train_begin")
        try:
            with runtime.free_pages_returned(), self._saved_when_stopped(total) as bar:
                source, window = self.source, LogWindow()
                mx.reset_peak_memory()
                while self.global_step < total and not self.stop_requested:
                    if not self._epoch_done():
                        with source.open(self.epoch, self.batch_in_epoch, self._epoch_usable(),
                                         args.gradient_accumulation_steps) as items:
                            while self.global_step < total and not self.stop_requested:
                                group = [next(items) for _ in range(self._group_size())]
                                window.metrics.extend(source.pop_metrics())
                                self._step(group, window, bar, total)
                                window = self._after_step(window, total)
                                if self._epoch_done():
                                    break
                    if self._epoch_done():
                        self._end_epoch()
            self._final_save()
        finally:
            restore_signals()
        self._event("on_train_end")
        self.run_log.close()

    def _announce(self, steps_per_epoch: int, total: int) -> None:
        """The run's first lines (precision, a quantized base's bytes, compilation, trainable parameters, steps) and
        its memory plan."""
        args = self.args
        trainable, total_params = lora_lib.trainable_count(self.model)
        ranks = f"; {self.world_size} data-parallel ranks" if self.world_size > 1 else ""
        self.print(runtime.startup_line(*precision(self.model, args.master_weights)))
        if quantize_lib.is_quantized(self.model):
            self.print(quantize_lib.describe(self.model))
        if note := runtime.compile_note(args.compile and self.compilable):
            self.print(note)
        self.print(f"trainable parameters: {trainable / 1e6:.2f}M of {total_params / 1e6:.2f}M; "
                   f"{total} optimizer steps, {steps_per_epoch} per epoch{ranks}")
        self.memory_plan = self._memory_plan()

    @contextlib.contextmanager
    def _saved_when_stopped(self, total):
        """Around the loop: its progress bar (yielded), the data-parallel SIGTERM handler and watchdog, and a
        resumable checkpoint of the finished steps when the loop stops early (Ctrl-C, SIGTERM, an error), which is
        then raised again. A lost peer is raised as it is (its checkpoint would not be consistent across ranks)."""
        args = self.args
        bar = Progress(total, self.global_step, bar=not args.disable_tqdm and self.is_main, print_fn=self.print,
                       compiled=bool(args.compile and self.compilable))
        previous_term = signal.getsignal(signal.SIGTERM)
        stop_watchdog = None
        if self.world_size > 1:  # mlx.launch terminates the other ranks when one dies
            signal.signal(signal.SIGTERM, self.parallel.terminated)
            stop_watchdog = self.parallel.term_watchdog()
        failure = None
        try:
            yield bar
        except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM in one process
            failure = e
        except PeerLostError:
            raise
        except RuntimeError as e:
            if self.world_size > 1 and any(w in str(e) for w in ("peer", "connection", "[ring]", "[mpi]")):
                raise PeerLostError(self._peer_lost(str(e).splitlines()[0])) from None
            failure = e
        except Exception as e:  # e.g. an unreadable image in a batch: keep the finished steps
            failure = e
        finally:
            bar.close()
            if self.world_size > 1:
                signal.signal(signal.SIGTERM, previous_term)
                stop_watchdog()
        if failure is not None:
            self.checkpoints.keep_finished(failure, self.global_step, consistent=self._consistent,
                                           save=self.save_checkpoint)
            raise failure

    def _step(self, group: list[dict], window: LogWindow, bar, total: int) -> None:
        """One optimizer step: the group's forward and backward (`_accumulate`), then the update and its counters
        with Ctrl-C / SIGTERM held until they are done (a signal's checkpoint then holds this step's log entry).
        The gradients die with this call, before the next step's backward."""
        shapes = self.step_shapes
        loss, metrics, grads, tokens = self._accumulate(group)
        with self.signals.critical():
            self._update_and_count(grads, loss, metrics, tokens, len(group), window)
            bar.step(loss, fresh=self.step_shapes > shapes)
            if self.signals.pending is not None and (self.global_step % self._every[0] == 0
                                                     or self.global_step == total):
                self._log(window)  # the step's entry goes into the checkpoint the signal is about to save

    def _accumulate(self, group: list[dict]) -> tuple[float, list[dict], dict, int]:
        """One optimizer step's forward and backward: each micro-batch of `group` through its compiled step, the
        gradients summed in float32 (and over the ranks). Returns (loss, per-micro-batch metrics, gradients,
        real tokens), each summed over the global batch."""
        args = self.args
        # dropout noise is a function of (seed, step, rank): a resumed run draws what the uninterrupted one did
        mx.random.seed(step_seed(args.seed, self.global_step, self.rank))
        # the loss is normalised by the trained tokens of the whole global batch (every rank's), as TRL
        normalizer = self.parallel.all_sum(np.array([sum(self.batch_tokens(b)[1] for b in group)], np.float64))[0]
        grads_sum, loss_sum, metric_sums, tokens = None, 0.0, [], 0
        for b in group:
            arrays = self.gradient_free_inputs(self.to_device(self.bucket_images(b)))
            if self.router_aux_coef:  # TRL's weighted aux loss: a mean per micro-batch, averaged over them and ranks
                arrays["router_aux_scale"] = mx.array(self.router_aux_coef / (len(group) * self.world_size),
                                                      mx.float32)
            step = self._step_for(arrays)
            loss, metrics, grads = step(arrays, mx.array(normalizer, dtype=mx.float32))
            grads_sum = grads if len(group) == 1 else accumulate(grads_sum, grads)
            mx.eval(loss, metrics, grads_sum)
            loss_sum += loss.item()
            metric_sums.append({k: v.item() for k, v in metrics.items()})
            tokens += self.batch_tokens(b)[0]
        if self.world_size > 1:
            grads_sum = self.parallel.all_sum_tree(grads_sum)
            keys = sorted({k for m in metric_sums for k in m})
            local = [loss_sum, tokens] + [float(np.mean([m[k] for m in metric_sums if k in m])) for k in keys]
            total_ = self.parallel.all_sum(np.array(local, np.float64))
            loss_sum, tokens = float(total_[0]), int(total_[1])
            metric_sums = [{k: float(v) / self.world_size for k, v in zip(keys, total_[2:], strict=True)}]
        return loss_sum, metric_sums, grads_sum, tokens

    def _update_and_count(self, grads, loss: float, metrics: list[dict], tokens: int, micro_batches: int,
                          window: LogWindow) -> None:
        """The update and the counters, which change together (`_step` holds signals around them): an exception
        here marks the state inconsistent (no checkpoint of it is saved). The first update is checked to keep
        every trainable parameter's dtype."""
        self._consistent = False
        first = not self._dtypes_checked
        dtypes = {k: v.dtype for k, v in tree_flatten(self.model.trainable_parameters())} if first else {}
        norm = self._update(grads)
        mx.eval(self.model.parameters(), self.optimizer.state, norm)
        if first:  # the optimizer re-casts from its float32 state: a change here is a bug, not a user error
            changed = [k for k, v in tree_flatten(self.model.trainable_parameters()) if v.dtype != dtypes[k]]
            if changed:
                raise RuntimeError(f"parameter {changed[0]} changed dtype in the update ({dtypes[changed[0]]})")
            self._dtypes_checked = True
        self.train_state.step_done(loss, tokens, micro_batches)
        self._consistent = True
        window.step_done(loss, metrics, tokens, norm.item())

    def _after_step(self, window: LogWindow, total: int) -> LogWindow:
        """Logging, evaluation and checkpoints at their step cadence; returns the log window."""
        args, step = self.args, self.global_step
        log_every, eval_every, save_every = self._every
        self._event("on_step_end")  # TrainerCallbacks; control.should_log / should_evaluate / should_save ask too
        if (self._asked("should_log") or step % log_every == 0 or step == total
                or (step == 1 and args.logging_first_step)):
            self._log(window)
            window = LogWindow()
        if self._asked("should_evaluate") or args.eval_strategy == "steps" and step % eval_every == 0:
            self._log_eval()
        if self._asked("should_save") or args.save_strategy == "steps" and save_every and step % save_every == 0:
            self.save_checkpoint()
        return window

    def _epoch_usable(self) -> int:
        """Micro-batches the current epoch trains on: all of them."""
        n = self.source.epoch_length(self.epoch)
        if n == 0:
            raise ValueError("the training data makes no batch (fewer rows than the batch size, or every row dropped)")
        return n

    def _group_size(self) -> int:
        """Micro-batches of the next optimizer step: gradient_accumulation_steps, but a dataset's epoch ends on
        its leftover micro-batches (transformers' ragged last step: its loss normalised by its own tokens);
        generation rounds go on into the next epoch."""
        accum = self.args.gradient_accumulation_steps
        if not self.source.epoch_bound:
            return accum
        return min(accum, self._epoch_usable() - self.batch_in_epoch)

    def _epoch_done(self) -> bool:
        return self.batch_in_epoch >= self._epoch_usable()

    def _end_epoch(self):
        # a step may take micro-batches of two epochs (GRPO's rounds): the rest belong to the next one
        self.train_state.epoch_done(self._epoch_usable(), self.source.epoch_bound)
        self._event("on_epoch_end")
        if self.args.eval_strategy == "epoch":
            self._log_eval()
        if self.args.save_strategy == "epoch":
            self.save_checkpoint()

    # ------------------------------------------------------------------ the log
    def print(self, *args):
        if self.is_main:
            print(*args, flush=True)

    def _log(self, window: LogWindow) -> None:
        plan = self.memory_plan
        self._record(window.entry(step=self.global_step, epoch=self._epoch_float(),
                                  learning_rate=float(self.optimizer.learning_rate.item()), num_tokens=self.num_tokens,
                                  predicted_peak=plan.total if plan is not None else None))

    def _log_eval(self) -> None:
        if self.is_main:  # the weights are the same on every rank: rank 0 evaluates
            self.evaluate()

    def _record(self, entry: dict) -> None:
        """A log entry: into log_history, to the callbacks' on_log, and out through the run's log (rank 0)."""
        self.log_history.append(entry)
        self._event("on_log", logs=entry)
        self.run_log.write(entry)

    def _memory_plan(self):
        kw, shape = self.plan_shape()
        return memory_plan(self.model, self.args, self.trainer_name, kw, shape, self.print)

    def plan_shape(self) -> tuple[dict, str]:
        """(extra planner arguments, the shape the prediction assumes, in words)."""
        return {}, "every row at max_length"

    @property
    def compiled_shapes(self) -> int:
        """Distinct batch shapes a compiled step was built for (at most max_compiled_shapes)."""
        return self._n_compiled

    @property
    def step_shapes(self) -> int:
        """Distinct batch shapes seen (compiled or run eagerly)."""
        return len(self._compiled)

    # ------------------------------------------------------------------ checkpoints and the final save
    def trainable_state(self) -> dict:
        return dict(tree_flatten(self.model.trainable_parameters()))

    def save_checkpoint(self) -> Path:
        """checkpoint-<step> of this run (`saving.Checkpoints.write`): the trainable weights, the optimizer state,
        the batch source's state and trainer_state.json with the counters and what the checkpoint belongs to
        (`checkpoint.run_record`)."""
        if not self.is_main:  # the ranks hold the same weights: rank 0 writes
            return self.checkpoints.path(self.global_step)
        record = {**self.train_state.as_record(),
                  "world_size": self.world_size, "per_device_batch": self.args.per_device_train_batch_size,
                  "data": {"rows": self.rows_fingerprint, "data_seed": self.data_seed if self.shuffles else None},
                  "mlxrl": checkpoint_lib.run_record(self)}
        files = {"trainable.safetensors": self.trainable_state(),
                 "optimizer.safetensors": dict(tree_flatten(self.optimizer.state))}
        source = {k: mx.array(v) for k, v in (self.source.state_dict() if self.source else {}).items()}
        if source:
            files["batch_source.safetensors"] = source
        path = self.checkpoints.write(self.global_step, record, files, run_id=self.run_id,
                                      log_history=self.log_history)
        self._draw_run()
        self._event("on_save")
        return path

    def load_checkpoint(self, path) -> None:
        """Resume: the checkpoint is checked against this run and its data (one line naming the first difference)
        before anything is loaded; metrics.jsonl is cut back to the checkpoint's history."""
        path, state, weights, opt, source = self.checkpoints.read(path, checkpoint_lib.run_record(self))
        check_data(state, path, self.args, rows_fingerprint=self.rows_fingerprint, data_seed=self.data_seed)
        epoch, batch_in_epoch = data_position(state, path, self.args, world_size=self.world_size,
                                              epoch_length=self.source.epoch_length)
        self.optimizer.init(self.model.trainable_parameters())
        checkpoint_lib.check_optimizer_state(opt, dict(tree_flatten(self.optimizer.state)), path)
        self.model.load_weights(list(weights.items()), strict=False)
        self.optimizer.state = tree_unflatten(list(opt.items()))
        self.train_state.restore(state, epoch, batch_in_epoch)
        if source is not None:
            self.source.load_state_dict(source)
        self.run_id = continued_run_id(state, path, self.output_dir, self.run_id, self.print)
        self.checkpoints.resumed(path, state)
        if self.is_main:  # the steps after the checkpoint are trained again: do not repeat them
            checkpoint_lib.rewrite_metrics(self.output_dir, self.log_history)
        mx.eval(self.model.parameters(), self.optimizer.state)
        self.print(f"resumed from {path} at step {self.global_step}")

    def save_final(self) -> None:
        """The trained model into output_dir (`saving.save_final`), on rank 0."""
        if self.is_main:
            save_final(self.model, self.processor, self.output_dir, self.args)

    def _final_save(self) -> None:
        """save_final with Ctrl-C / SIGTERM held until it completes (then raised); if the save fails, the trained
        weights are kept as a resumable checkpoint before the error is raised. With load_best_model_at_end the
        best checkpoint's weights are loaded first."""
        try:
            with self.signals.critical(raise_pending=False):
                if (best := self.checkpoints.best_weights()) is not None:
                    self.model.load_weights(list(best[1].items()), strict=False)
                    mx.eval(self.model.parameters())
                    self.print(f"loaded the best checkpoint {best[0]} ({best_metric_key(self.args)[0]} "
                               f"{self.checkpoints.best[1]:.6g})")
                self.save_final()
        except Exception:
            self.checkpoints.keep_after_failed_save(self.global_step, self.save_checkpoint)
            raise
        self._draw_run()
        if self.signals.pending is not None:
            signum, self.signals.pending = self.signals.pending, None
            self.print(f"{signal.Signals(signum).name} during the final save: the save completed "
                       f"({self.output_dir}); stopping")
            self.run_log.close()
            raise TrainingInterrupted(signum)

    def _draw_run(self) -> None:
        self.run_log.draw(self.log_history, self.run_id, f"{type(self).__name__}: {self.output_dir.name}")
