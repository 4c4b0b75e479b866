"""Optional experiment trackers (`report_to`, transformers' names): Weights & Biases and TensorBoard.

    --report_to none                # default: metrics.jsonl and stdout only
    --report_to wandb               # needs `pip install wandb` (project: $WANDB_PROJECT, default "mlxrl")
    --report_to tensorboard         # needs `pip install tensorboard`; event files in <output_dir>/runs
    --report_to wandb,tensorboard   # several; "all" = every tracker that is installed

Keys are namespaced as transformers' callbacks do: `train/loss`, `eval/loss` (from `eval_loss`).
Only numbers are sent; every entry still goes to metrics.jsonl.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from ..errors import MlxrlError

TRACKERS = ("wandb", "tensorboard")


def _names(report_to) -> list[str]:
    if report_to is None:
        return []
    items = report_to if isinstance(report_to, (list, tuple)) else str(report_to).split(",")
    names = [s.strip().lower() for s in items if s.strip()]
    if names in ([], ["none"]):
        return []
    if names == ["all"]:
        return [t for t in TRACKERS if _installed(t)]
    bad = [n for n in names if n not in TRACKERS]
    if bad:
        raise ValueError(f"report_to: unknown tracker(s) {', '.join(bad)}; use none, all, or a comma-separated "
                         f"subset of {', '.join(TRACKERS)}")
    return names


def _installed(name: str) -> bool:
    if name == "wandb":
        return importlib.util.find_spec("wandb") is not None
    return any(importlib.util.find_spec(m) is not None for m in ("tensorboard", "tensorboardX"))


def _summary_writer():
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            raise ValueError("report_to=tensorboard needs TensorBoard: pip install tensorboard "
                             "(or tensorboardX)") from None
    return SummaryWriter


class Reporter:
    """Sends each logged entry to the configured trackers (none by default)."""

    def __init__(self, args, output_dir: Path):
        self.wandb_run = self.writer = None
        names = _names(getattr(args, "report_to", None))
        if "wandb" in names:
            try:
                import wandb
            except ImportError:
                raise ValueError("report_to=wandb needs the wandb package: pip install wandb") from None
            config = dataclasses.asdict(args) if dataclasses.is_dataclass(args) else dict(vars(args))
            self.wandb_run = wandb.init(project=os.environ.get("WANDB_PROJECT", "mlxrl"),
                                        name=getattr(args, "run_name", None), dir=str(output_dir), config=config)
        if "tensorboard" in names:
            log_dir = getattr(args, "logging_dir", None) or str(Path(output_dir) / "runs")
            self.writer = _summary_writer()(log_dir=log_dir)

    @staticmethod
    def _scalars(entry: dict) -> dict:
        out = {}
        for k, v in entry.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)) or k == "step":
                continue
            out[f"eval/{k[5:]}" if k.startswith("eval_") else f"train/{k}"] = float(v)
        return out

    def log(self, entry: dict) -> None:
        if self.wandb_run is None and self.writer is None:
            return
        step = int(entry.get("step", 0))
        scalars = self._scalars(entry)
        if self.wandb_run is not None:
            self.wandb_run.log(scalars, step=step)
        if self.writer is not None:
            for k, v in scalars.items():
                self.writer.add_scalar(k, v, step)
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None


class Logging:
    """Mixin of the engine's `Trainer`: the log window of the steps since the last entry, and the
    entries (stdout, metrics.jsonl, the trackers; rank 0 writes)."""

    @staticmethod
    def _new_window() -> dict:
        return {"t0": time.perf_counter(), "tokens": 0, "metrics": [], "losses": []}

    def _log(self, window):
        dt = max(time.perf_counter() - window["t0"], 1e-9)
        epoch = self._epoch_float()
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
        self.evaluate()

    def _record(self, entry):
        self.log_history.append(entry)
        self._event("on_log", logs=entry)
        if not self.is_main:
            return
        self.reporter.log(entry)
        with open(self.output_dir / "metrics.jsonl", "a") as fh:
            fh.write(json.dumps(entry) + "\n")
        shown = {k: (round(v, 5) if isinstance(v, float) else v) for k, v in entry.items() if v is not None}
        print(json.dumps(shown), flush=True)

    def _precision(self) -> tuple[mx.Dtype, str]:
        """The model's compute dtype and how its trainable weights are updated, for the start-up line."""
        dtype = self.model.compute_dtype()
        if any(v.dtype != mx.float32 for _, v in tree_flatten(self.model.trainable_parameters())):
            how = "fp32 master weights" if self.args.master_weights else "bf16 weights, stochastic rounding"
            return dtype, f" ({how}, fp32 optimizer state)"
        return dtype, ""

    def _memory_plan(self):
        """The planner's prediction for this run (printed at start-up, logged next to the measured
        peak); None where it cannot model the run."""
        from ..models.widened import planned_config
        from ..plan import predict

        try:
            kw, shape = self.plan_shape()
            plan = predict(planned_config(self.model), self.args, self.planner_kind, suggest=False, **kw)
        except (ValueError, KeyError, NotImplementedError) as e:
            self.print(f"memory plan: not available for this run ({e})")
            return None
        self.print(f"memory plan: predicted peak {plan.total / 1e9:.2f} GB with {shape} "
                   "(python -m mlxrl.plan for the breakdown)")
        if not plan.fits and not self.args.use_peft and getattr(self.model, "moe_config", None) is not None:
            # a mixture of experts trained whole past the memory it has would page all its experts
            raise MlxrlError(f"full fine-tuning of this mixture of experts is predicted to need "
                             f"{plan.total / 1e9:.1f} GB, over its limit of {plan.limit / 1e9:.1f} GB "
                             f"({plan.limit_source}): train LoRA (--use_peft; --load_in_4bit quantizes the experts), "
                             "or raise --memory_limit")
        return plan

    def plan_shape(self) -> tuple[dict, str]:
        """(extra planner arguments, the shape the prediction assumes, in words)."""
        return {}, "every row at max_length"

    def print(self, *args):
        if self.is_main:
            print(*args, flush=True)

    @property
    def compiled_shapes(self) -> int:
        """Distinct batch shapes a compiled step was built for (at most max_compiled_shapes)."""
        return self._n_compiled

    @property
    def step_shapes(self) -> int:
        """Distinct batch shapes seen (compiled or run eagerly)."""
        return len(self._compiled)
