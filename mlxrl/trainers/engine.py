"""The one training engine shared by SFT, DPO and GRPO.

A trainer supplies `make_batches(epoch) -> list[dict of np arrays, or callables that build one on
the background data worker]` and a pure
`loss(model, batch, num_items) -> (loss, metrics)`; the engine owns everything else: trainable
parameters (full / LoRA / frozen vision), AdamW with warmup + linear/cosine decay, gradient
accumulation (losses normalised by the trained tokens of the whole accumulated batch, as TRL),
grad-norm clipping, an `mx.compile`d step per shape bucket (state = model, optimizer, random
state; one `mx.eval` per micro-batch), evaluation, resumable checkpoints (trainable weights,
optimizer state, step and data position; the RNG is reseeded from (seed, step) every step, so
resuming reproduces the uninterrupted run), logging
with TRL's metric names plus tokens/s and peak memory, a progress bar, metrics.jsonl.

Nothing is lost (see `checkpoint` and `mlxrl.atomic`): every folder is written aside and renamed into
place; an output_dir holding another run is refused; Ctrl-C and (in one process) SIGTERM stop at the
end of the current update or save and leave a resumable checkpoint; an error inside the loop saves
one of the finished steps before it is raised; Ctrl-C during the final save lets the save finish.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from .. import fastmath, runtime
from ..atomic import write_atomically
from ..data.batches import Prefetcher, pad_image_patches
from ..hub import MlxrlError
from ..models import lora as lora_lib
from . import checkpoint as checkpoint_lib
from .checkpoint import CHECKPOINT_PREFIX
from .config import check_optim
from .optim import make_optimizer
from .reporting import Reporter


class PeerLostError(MlxrlError):
    """Another data-parallel rank exited or was killed."""


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT), or SIGTERM in a single process: raised by `train()` once a resumable
    checkpoint of the finished steps is saved (a KeyboardInterrupt, so callers treat both alike)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def accumulate(total, grads):
    """total + grads in float32 (a bf16 running sum of micro-batch gradients loses their low bits);
    total is None for the first micro-batch."""
    if total is None:
        return tree_map(lambda g: g.astype(mx.float32), grads)
    return tree_map(lambda t, g: t + g.astype(mx.float32), total, grads)


def check_trainable_dtypes(model) -> None:
    """Refuse float16 training (it needs loss scaling, which the engine does not do: gradients below
    6e-8 flush to zero and large activations overflow): a one-line error naming the fix."""
    if any(v.dtype == mx.float16 for _, v in tree_flatten(model.parameters())):
        raise MlxrlError("the model is in float16, which cannot train without loss scaling (small gradients flush "
                         "to zero): load it in bfloat16 (--dtype bfloat16 or MLXRL_DTYPE=bfloat16) or float32")


class Trainer:
    """Subclasses implement `make_batches(epoch)`, `loss(model, batch, num_items)` and may
    override `evaluate()` and `save_final()`."""

    metric_names: tuple[str, ...] = ()

    def __init__(self, model, processor, args):
        self.model, self.processor, self.args = model, processor, args
        # data parallel: launched by `mlx.launch` (ring / MPI / NCCL / JACCL), else a group of one
        self.world = mx.distributed.init()
        self.rank, self.world_size = self.world.rank(), self.world.size()
        self.is_main = self.rank == 0
        self.output_dir = Path(args.output_dir)
        checkpoint_lib.check_output_dir(self.output_dir)
        if self.is_main:  # before any work: a folder holding another run, or files the final save would replace
            checkpoint_lib.check_run_dir(self.output_dir, resume=args.resume_from_checkpoint,
                                         overwrite=self.overwrite_output_dir, lora=bool(args.use_peft),
                                         merge=bool(args.merge))
        check_optim(args)
        check_trainable_dtypes(model)
        runtime.set_memory_limits(args.memory_limit, args.wired_limit, args.cache_limit)
        mx.random.seed(args.seed)
        self._setup_trainable()
        self.optimizer = None
        self.global_step = 0
        self.epoch = 0
        self.batch_in_epoch = 0  # micro-batches of the current epoch already consumed
        self.num_tokens = 0
        self.log_history: list[dict] = []
        self._compiled: dict = {}  # batch shape -> step function (compiled or eager)
        self._n_compiled = 0
        self._shapes_seen: set = set()
        self._dtypes_checked = False  # whether an update has been checked to keep every parameter's dtype
        self.run_id = secrets.token_hex(8)  # in every checkpoint: pruning touches this run's only
        self._critical_depth = 0  # > 0 inside an update or a save: Ctrl-C / SIGTERM wait for its end
        self._pending_signal = None
        self._consistent = True  # False while an update is half applied (no checkpoint then)
        self._saved_step = None  # the step of the last checkpoint written by this run
        self._save_failed = False
        # W&B / TensorBoard when report_to asks (rank 0 only)
        self.reporter = Reporter(args if self.is_main else None, self.output_dir)

    # ------------------------------------------------------------------ parameters
    def _setup_trainable(self):
        a, m = self.args, self.model
        m.language_model.gradient_checkpointing = bool(a.gradient_checkpointing)
        if a.use_peft:
            lora_lib.apply_lora(m, r=a.lora_r, alpha=a.lora_alpha, dropout=a.lora_dropout,
                                target_modules=a.lora_target_modules, use_dora=a.use_dora)
        else:
            m.unfreeze()
            if a.freeze_vision_tower and hasattr(m, "vision_tower"):
                m.vision_tower.freeze()
            if a.freeze_embeddings:
                m.language_model.embed_tokens.freeze()
        m.train()

    @property
    def head_trainable(self) -> bool:
        """Whether the LM-head weight receives a gradient (not with LoRA or frozen tied embeddings)."""
        weight = self.model.lm_head_weight()
        return any(v is weight for _, v in tree_flatten(self.model.trainable_parameters()))

    # ------------------------------------------------------------------ the step
    def _grad_fn(self):
        loss_and_grad = nn.value_and_grad(self.model, self.loss)

        def step(batch, num_items):
            (loss, metrics), grads = loss_and_grad(self.model, batch, num_items)
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
            fn = self._grad_fn()
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

    def loss(self, model, batch: dict, num_items):
        raise NotImplementedError

    def to_device(self, batch: dict) -> dict:
        """np -> mx for the arrays the step uses (subclasses may add vision metadata)."""
        return {k: mx.array(v) for k, v in batch.items() if isinstance(v, np.ndarray)}

    def bucket_images(self, batch: dict) -> dict:
        """With a compiled step and patch_buckets: the batch's image patches padded to a bucket by a
        dummy image (`data.batches.pad_image_patches`), so batches with differently sized images share
        a compiled step; otherwise the batch unchanged."""
        a = self.args
        if "pixel_values" not in batch or not (a.compile and a.patch_buckets and self.compilable):
            return batch
        pixels, grid = pad_image_patches(np.asarray(batch["pixel_values"]), np.asarray(batch["image_grid_thw"]))
        return {**batch, "pixel_values": pixels, "image_grid_thw": grid}

    def batch_tokens(self, batch: dict) -> tuple[int, int]:
        """(real tokens, trained tokens) of a prepared batch."""
        return int(batch["num_tokens"]), int(batch["num_items"])

    def evaluate(self) -> dict:
        return {}

    def batch_source_state(self) -> dict[str, np.ndarray]:
        """Arrays the batch source needs to resume exactly from the current step, saved with the
        checkpoint (GRPO: a generation round half trained on). Default: none (batches are a function
        of the seed, the epoch and the position)."""
        return {}

    def load_batch_source_state(self, arrays: dict[str, np.ndarray]) -> None:
        """Restore what `batch_source_state` returned (called by a resume)."""

    # ------------------------------------------------------------------ training loop
    def _plan(self):
        batches0 = self.make_batches(0)
        self._epoch_batches = len(batches0)
        per_epoch = max(1, len(batches0) // self.args.gradient_accumulation_steps)
        if self.args.max_steps and self.args.max_steps > 0:
            total = self.args.max_steps
        else:
            total = int(math.ceil(self.args.num_train_epochs * per_epoch))
        return batches0, per_epoch, total

    @property
    def overwrite_output_dir(self) -> bool:
        """HF's overwrite_output_dir: start over in an output_dir holding another run (its checkpoints and
        metrics.jsonl are deleted; nothing else)."""
        return bool(getattr(self.args, "overwrite_output_dir", False))

    @property
    def has_eval_data(self) -> bool:
        return bool(getattr(self, "eval_examples", None))

    def train(self):
        args = self.args
        if args.eval_strategy in ("steps", "epoch") and not self.has_eval_data:
            # the HF Trainer raises here too (it would otherwise be silently ignored)
            raise ValueError(f"eval_strategy {args.eval_strategy!r} needs evaluation data: pass --eval_dataset (or "
                             "--eval_split), or set --eval_strategy no")
        if self.is_main:
            checkpoint_lib.start_run(self.output_dir, resume=args.resume_from_checkpoint,
                                     overwrite=self.overwrite_output_dir, lora=bool(args.use_peft),
                                     merge=bool(args.merge))
        batches, steps_per_epoch, total = self._plan()
        self.total_steps = total
        self.optimizer = make_optimizer(args, total)
        if args.resume_from_checkpoint:
            self.load_checkpoint(args.resume_from_checkpoint)
        trainable, total_params = lora_lib.trainable_count(self.model)
        ranks = f"; {self.world_size} data-parallel ranks" if self.world_size > 1 else ""
        self.print(runtime.startup_line(*self._precision()))
        self.print(f"trainable parameters: {trainable / 1e6:.2f}M of {total_params / 1e6:.1f}M; "
                   f"{total} optimizer steps, {steps_per_epoch} per epoch{ranks}")
        self.memory_plan = self._memory_plan()
        restore_signals = self._catch_signals()
        try:
            self._train_loop(batches, total)
            self._final_save()
        finally:
            restore_signals()
        self.reporter.close()
        return self.log_history

    def _train_loop(self, batches, total):
        """The loop, with a resumable checkpoint saved when it stops early (Ctrl-C, SIGTERM, an error)."""
        args = self.args
        bar = None
        if not args.disable_tqdm and self.is_main:
            from tqdm.auto import tqdm

            bar = tqdm(total=total, initial=self.global_step, desc="train", dynamic_ncols=True)
        previous_term = signal.getsignal(signal.SIGTERM)
        stop_watchdog = None
        if self.world_size > 1:  # mlx.launch terminates the other ranks when one dies
            signal.signal(signal.SIGTERM, self._terminated)
            stop_watchdog = self._start_term_watchdog()
        failure = None
        try:
            self._loop(batches, total, bar)
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
            if bar is not None:
                bar.close()
            if self.world_size > 1:
                signal.signal(signal.SIGTERM, previous_term)
                stop_watchdog()
        if failure is not None:
            self._save_on_failure(failure)
            raise failure

    # ------------------------------------------------------------------ stopping safely
    def _catch_signals(self):
        """Ctrl-C (and SIGTERM in a single process: what schedulers and `timeout` send) raise
        TrainingInterrupted, but not inside an update or a save: there the signal is held until it ends.
        Returns the function that restores the previous handlers (main thread only; a no-op elsewhere)."""
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        wanted = [signal.SIGINT] + ([signal.SIGTERM] if self.world_size == 1 else [])
        saved = {}
        for sig in wanted:
            previous = signal.getsignal(sig)
            if previous is signal.SIG_IGN:  # e.g. a background job: the user chose to ignore it
                continue
            saved[sig] = signal.SIG_DFL if previous is None else previous
            signal.signal(sig, self._on_signal)

        def restore():
            for sig, handler in saved.items():
                signal.signal(sig, handler)

        return restore

    def _on_signal(self, signum, frame):
        if self._critical_depth > 0:
            self._pending_signal = signum
            return
        raise TrainingInterrupted(signum)

    @contextlib.contextmanager
    def _critical(self, raise_pending: bool = True):
        """Hold Ctrl-C / SIGTERM until the block ends; then (raise_pending) raise TrainingInterrupted."""
        self._critical_depth += 1
        try:
            yield
        finally:
            self._critical_depth -= 1
        if raise_pending and self._critical_depth == 0 and self._pending_signal is not None:
            signum, self._pending_signal = self._pending_signal, None
            raise TrainingInterrupted(signum)

    @staticmethod
    def _stop_words(failure) -> str:
        if isinstance(failure, TrainingInterrupted) and failure.signum == signal.SIGTERM:
            return "terminated (SIGTERM)"
        if isinstance(failure, KeyboardInterrupt):
            return "interrupted"
        return f"stopped by an error at step {{step}} ({type(failure).__name__})"

    def _save_on_failure(self, failure) -> None:
        """A resumable checkpoint of the finished steps (rank 0), unless an update was half applied."""
        words = self._stop_words(failure).format(step=self.global_step + 1)
        if not self.is_main or not self._consistent or self._save_failed:
            return
        if self.global_step == 0:
            self.print(f"{words} before the first optimizer step: nothing to save")
            return
        try:
            with self._critical(raise_pending=False):
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
        trained weights are kept as a resumable checkpoint before the error is raised."""
        try:
            with self._critical(raise_pending=False):
                self.save_final()
        except Exception:
            if self.is_main and self.global_step > 0 and not self._save_failed:
                try:
                    with self._critical(raise_pending=False):
                        path = self._last_checkpoint() or self.save_checkpoint()
                    self.print(f"the final save failed: the trained weights are in the resumable checkpoint {path} "
                               f"(resume with --resume_from_checkpoint {path} to save them)")
                except MlxrlError as e:
                    self.print(f"the final save failed and so did a checkpoint ({e})")
            raise
        if self._pending_signal is not None:
            signum, self._pending_signal = self._pending_signal, None
            self.print(f"{signal.Signals(signum).name} during the final save: the save completed "
                       f"({self.output_dir}); stopping")
            self.reporter.close()
            raise TrainingInterrupted(signum)

    planner_kind = "sft"

    def _precision(self) -> tuple[mx.Dtype, str]:
        """The model's compute dtype and how its trainable weights are updated, for the start-up line."""
        dtype = self.model.lm_head_weight().dtype
        if any(v.dtype != mx.float32 for _, v in tree_flatten(self.model.trainable_parameters())):
            how = "fp32 master weights" if self.args.master_weights else "bf16 weights, stochastic rounding"
            return dtype, f" ({how}, fp32 optimizer state)"
        return dtype, ""

    def _memory_plan(self):
        """The planner's prediction for this run (printed at start-up, logged next to the measured
        peak); None where it cannot model the run."""
        from ..plan import predict

        try:
            kw, shape = self._plan_shape()
            plan = predict(dict(self.model.config), self.args, self.planner_kind, suggest=False, **kw)
        except (ValueError, KeyError, NotImplementedError) as e:
            self.print(f"memory plan: not available for this run ({e})")
            return None
        self.print(f"memory plan: predicted peak {plan.total / 1e9:.2f} GB with {shape} "
                   "(python -m mlxrl.plan for the breakdown)")
        return plan

    def _plan_shape(self) -> tuple[dict, str]:
        """(extra planner arguments, the shape the prediction assumes, in words)."""
        return {}, "every row at max_length"

    def print(self, *args):
        if self.is_main:
            print(*args, flush=True)

    def _peer_lost(self, why: str) -> str:
        found = self._checkpoints()
        last = f"the last checkpoint {found[-1]} is intact" if found else "no checkpoint was saved yet"
        return (f"rank {self.rank} of {self.world_size}: lost another rank at step {self.global_step} ({why}); "
                f"{last}: resume with --resume_from_checkpoint last, on any number of ranks")

    def _start_term_watchdog(self, grace: float = 10.0):
        """Python runs the SIGTERM handler only between bytecodes: a rank blocked inside a collective
        whose peer died never would. The signal also lands on a wakeup pipe; a thread reading it
        gives the main thread `grace` seconds to leave the training loop (with PeerLostError), and if
        it has not, prints the same error and exits with 2 (the CLI's error code). Returns the
        function that stops the watchdog (restores the previous wakeup fd, closes the pipe)."""
        import threading

        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        previous = signal.set_wakeup_fd(write_fd)
        stopped = threading.Event()

        def watch():
            with os.fdopen(read_fd, "rb", buffering=0) as pipe:
                while data := pipe.read(64):  # b"" once stop() has closed the write end
                    if signal.SIGTERM in data and not stopped.wait(grace):
                        why = "terminated by the launcher after another rank exited; stuck in a collective"
                        print(f"error: {self._peer_lost(why)}", file=sys.stderr, flush=True)
                        os._exit(2)

        def stop():
            stopped.set()
            signal.set_wakeup_fd(previous)
            os.close(write_fd)

        threading.Thread(target=watch, daemon=True, name="mlxrl-term-watchdog").start()
        return stop

    def _terminated(self, signum, frame):
        raise PeerLostError(self._peer_lost("terminated by the launcher after another rank exited"))

    def load_batch(self, item) -> dict:
        """A batch of `make_batches`: a prepared dict, or a zero-argument callable that prepares it
        (called on the background data worker)."""
        return item() if callable(item) else item

    def _loop(self, batches, total, bar):
        args = self.args
        accum = args.gradient_accumulation_steps
        window = {"t0": time.perf_counter(), "tokens": 0, "metrics": [], "losses": []}
        mx.reset_peak_memory()
        while self.global_step < total:
            if self.epoch > 0 or batches is None:
                batches = self.make_batches(self.epoch)
            usable = len(batches) // accum * accum
            if usable == 0:
                raise ValueError(f"fewer batches ({len(batches)}) than gradient_accumulation_steps ({accum})")
            todo = batches[self.batch_in_epoch:usable]
            # data preparation (collating, decoding and resizing images) runs ahead on a worker thread,
            # at most `depth` batches ahead so it cannot pile up memory
            with Prefetcher(lambda todo=todo: map(self.load_batch, todo), depth=max(2, accum + 1)) as ready:
                while self.batch_in_epoch < usable and self.global_step < total:
                    self._optimizer_step([next(ready) for _ in range(accum)], window, bar, total)
                    if self.global_step % args.logging_steps == 0 or self.global_step == total:
                        self._log(window)
                        window = {"t0": time.perf_counter(), "tokens": 0, "metrics": [], "losses": []}
                    every = args.eval_steps or args.logging_steps
                    if args.eval_strategy == "steps" and self.global_step % every == 0:
                        self._log_eval()
                    if args.save_strategy == "steps" and args.save_steps and self.global_step % args.save_steps == 0:
                        self.save_checkpoint()
            if self.batch_in_epoch >= usable:
                self.epoch += 1
                self.batch_in_epoch = 0
                batches = None
                if args.eval_strategy == "epoch":
                    self._log_eval()
                if args.save_strategy == "epoch":
                    self.save_checkpoint()

    def _optimizer_step(self, group, window, bar, total):
        args = self.args
        # dropout noise is a function of (seed, step, rank): a resumed run draws what the uninterrupted one did
        mx.random.seed(args.seed * 1_000_003 + self.global_step + 7919 * self.rank)
        # the loss is normalised by the trained tokens of the whole global batch (every rank's), as TRL
        num_items = self.all_sum(np.array([sum(self.batch_tokens(b)[1] for b in group)], np.float64))[0]
        grads_sum, loss_sum, metric_sums, tokens = None, 0.0, [], 0
        for b in group:
            arrays = self.to_device(self.bucket_images(b))
            step = self._step_for(arrays)
            loss, metrics, grads = step(arrays, mx.array(num_items, dtype=mx.float32))
            grads_sum = grads if len(group) == 1 else accumulate(grads_sum, grads)
            mx.eval(loss, metrics, grads_sum)
            loss_sum += loss.item()
            metric_sums.append({k: v.item() for k, v in metrics.items()})
            tokens += self.batch_tokens(b)[0]
        if self.world_size > 1:
            grads_sum = self.all_sum_tree(grads_sum)
            keys = sorted({k for m in metric_sums for k in m})
            local = [loss_sum, tokens] + [float(np.mean([m[k] for m in metric_sums if k in m])) for k in keys]
            total_ = self.all_sum(np.array(local, np.float64))
            loss_sum, tokens = float(total_[0]), int(total_[1])
            metric_sums = [{k: float(v) / self.world_size for k, v in zip(keys, total_[2:], strict=True)}]
        # the update and the counters change together: a signal here waits, an exception marks the state
        # inconsistent (no checkpoint of it is saved)
        with self._critical():
            self._consistent = False
            first = not self._dtypes_checked
            dtypes = {k: v.dtype for k, v in tree_flatten(self.model.trainable_parameters())} if first else {}
            norm = self._update(grads_sum)
            mx.eval(self.model.parameters(), self.optimizer.state, norm)
            if first:  # the optimizer re-casts from its float32 state: a change here is a bug, not a user error
                changed = [k for k, v in tree_flatten(self.model.trainable_parameters()) if v.dtype != dtypes[k]]
                if changed:
                    raise RuntimeError(f"parameter {changed[0]} changed dtype in the update ({dtypes[changed[0]]})")
                self._dtypes_checked = True
            window["tokens"] += tokens
            self.num_tokens += tokens
            self.batch_in_epoch += len(group)
            self.global_step += 1
            self._consistent = True
            window["losses"].append(loss_sum)
            window["metrics"].extend(metric_sums)
            window["grad_norm"] = norm.item()
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{loss_sum:.4f}")
            if self._pending_signal is not None and (self.global_step % args.logging_steps == 0 or
                                                     self.global_step == total):
                self._log(window)  # the step's log entry goes into the checkpoint the signal is about to save

    # ------------------------------------------------------------------ data parallel
    def all_sum(self, values: np.ndarray) -> np.ndarray:
        """Sum a small float vector over the ranks (identity with one process)."""
        if self.world_size == 1:
            return values
        out = mx.distributed.all_sum(mx.array(values.astype(np.float32)), group=self.world)
        return np.asarray(out, dtype=np.float64)

    def all_sum_tree(self, grads, bucket_bytes: int = 64 << 20):
        """Sum a gradient tree over the ranks in float32, packed into few large buckets (one
        message per ~64 MB instead of one per parameter)."""
        flat = tree_flatten(grads)
        out, bucket, size = [], [], 0

        def flush():
            if not bucket:
                return
            packed = mx.concatenate([g.astype(mx.float32).reshape(-1) for _, g in bucket])
            summed = mx.distributed.all_sum(packed, group=self.world)
            offset = 0
            for k, g in bucket:
                out.append((k, summed[offset:offset + g.size].reshape(g.shape).astype(g.dtype)))
                offset += g.size
            mx.eval([v for _, v in out[-len(bucket):]])
            bucket.clear()

        for k, g in flat:
            bucket.append((k, g))
            size += g.size * 4
            if size >= bucket_bytes:
                flush()
                size = 0
        flush()
        return tree_unflatten(out)

    def _log(self, window):
        dt = max(time.perf_counter() - window["t0"], 1e-9)
        epoch = self.epoch + self.batch_in_epoch / max(1, self._epoch_len())
        entry = {"step": self.global_step, "epoch": round(epoch, 4),
                 "loss": float(np.mean(window["losses"])), "grad_norm": window.get("grad_norm"),
                 "learning_rate": float(self.optimizer.learning_rate.item()), "num_tokens": self.num_tokens}
        keys = {k for m in window["metrics"] for k in m}
        entry.update({k: float(np.mean([m[k] for m in window["metrics"] if k in m])) for k in sorted(keys)})
        entry["tokens_per_second"] = window["tokens"] / dt
        entry["peak_memory_gb"] = mx.get_peak_memory() / 1e9
        if getattr(self, "memory_plan", None) is not None:
            entry["predicted_peak_memory_gb"] = self.memory_plan.total / 1e9
        self._record(entry)

    def _log_eval(self):
        if not self.is_main:  # the weights are the same on every rank: rank 0 evaluates
            return
        metrics = self.evaluate()
        if metrics:
            self._record({"step": self.global_step, **{f"eval_{k}": v for k, v in metrics.items()}})
            self.model.train()

    def _record(self, entry):
        self.log_history.append(entry)
        if not self.is_main:
            return
        self.reporter.log(entry)
        with open(self.output_dir / "metrics.jsonl", "a") as fh:
            fh.write(json.dumps(entry) + "\n")
        shown = {k: (round(v, 5) if isinstance(v, float) else v) for k, v in entry.items() if v is not None}
        print(json.dumps(shown), flush=True)

    def _epoch_len(self):
        return getattr(self, "_epoch_batches", 1)

    @property
    def compiled_shapes(self) -> int:
        """Distinct batch shapes a compiled step was built for (at most max_compiled_shapes)."""
        return self._n_compiled

    @property
    def step_shapes(self) -> int:
        """Distinct batch shapes seen (compiled or run eagerly)."""
        return len(self._compiled)

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
        state = {"global_step": self.global_step, "epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch,
                 "world_size": self.world_size, "per_device_batch": self.args.per_device_train_batch_size,
                 "num_tokens": self.num_tokens, "log_history": self.log_history, "run_id": self.run_id,
                 "mlxrl": checkpoint_lib.run_record(self)}

        source = {k: mx.array(v) for k, v in self.batch_source_state().items()}

        def write(tmp: Path) -> None:
            mx.save_safetensors(str(tmp / "trainable.safetensors"), trainable)
            mx.save_safetensors(str(tmp / "optimizer.safetensors"), opt)
            if source:
                mx.save_safetensors(str(tmp / "batch_source.safetensors"), source)
            (tmp / "trainer_state.json").write_text(json.dumps(state, indent=1))

        with self._critical():  # Ctrl-C waits for the checkpoint (then stops with it)
            try:
                write_atomically(final, write, what=f"checkpoint {final.name}")
            except BaseException:
                self._save_failed = True
                raise
            self._saved_step = self.global_step
            self._rotate()
        return final

    def _checkpoints(self) -> list[Path]:
        return checkpoint_lib.list_checkpoints(self.output_dir)

    def _rotate(self):
        """save_total_limit: delete this run's oldest checkpoints (checkpoint-<int> folders whose
        trainer_state.json carries this run's id and that hold only our files)."""
        limit = self.args.save_total_limit
        if limit:
            for old in checkpoint_lib.list_checkpoints(self.output_dir, self.run_id)[:-limit]:
                if checkpoint_lib.is_our_checkpoint(old):
                    shutil.rmtree(old, ignore_errors=True)

    def load_checkpoint(self, path):
        """Resume: the checkpoint is checked against this run (one line naming the first difference)
        before anything is loaded; metrics.jsonl is cut back to the checkpoint's history."""
        path = checkpoint_lib.resolve_checkpoint(self.output_dir, path)
        state, weights, opt = checkpoint_lib.read_checkpoint(path)
        here = checkpoint_lib.run_record(self)
        if isinstance(state.get("mlxrl"), dict):
            checkpoint_lib.check_compatible(state["mlxrl"], here, path)
        checkpoint_lib.check_shapes({k: v.shape for k, v in weights.items()}, here["trainable"],
                                     f"--resume_from_checkpoint {path}", "trains")
        self.optimizer.init(self.model.trainable_parameters())
        checkpoint_lib.check_optimizer_state(opt, dict(tree_flatten(self.optimizer.state)), path)
        self.model.load_weights(list(weights.items()), strict=False)
        self.optimizer.state = tree_unflatten(list(opt.items()))
        self.global_step, self.epoch = state["global_step"], state["epoch"]
        self.batch_in_epoch, self.num_tokens = state["batch_in_epoch"], state["num_tokens"]
        # the rows of the epoch already consumed, cut into this run's per-rank batches (a checkpoint
        # resumes on any number of ranks; keep the global batch the same to continue the same run)
        here_batch = self.world_size * self.args.per_device_train_batch_size
        saved_batch = int(state.get("per_device_batch", self.args.per_device_train_batch_size))
        saved = int(state.get("world_size", 1)) * saved_batch
        self.batch_in_epoch = self.batch_in_epoch * saved // here_batch
        self.log_history = list(state.get("log_history", []))
        if (path / "batch_source.safetensors").exists():
            source = checkpoint_lib.load_file(path, "batch_source.safetensors", "the batch source's state")
            self.load_batch_source_state({k: np.array(v) for k, v in source.items()})
        self.run_id = state.get("run_id") or self.run_id
        if path.resolve().parent == self.output_dir.resolve():
            self._saved_step = self.global_step  # this checkpoint is this run's
        if self.is_main:  # the steps after the checkpoint are trained again: do not repeat them
            checkpoint_lib.rewrite_metrics(self.output_dir, self.log_history)
        mx.eval(self.model.parameters(), self.optimizer.state)
        self.print(f"resumed from {path} at step {self.global_step}")

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
            if args.merge:
                lora_lib.merge_lora(self.model)
                save(self.model, self.processor, self.output_dir / "merged", overwrite=True)
        else:
            save(self.model, self.processor, self.output_dir / "model", overwrite=True)
