"""Where a run's log entries go (`RunLog`: stdout, metrics.jsonl, run.png and the trackers), the log window of the
steps since the last entry (`LogWindow`), and the start-up lines' precision and memory plan.

The optional experiment trackers (`report_to`, transformers' names) are Weights & Biases and TensorBoard:

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
import math
import os
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from ..errors import MlxrlError
from . import plot, run_dir

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


@dataclasses.dataclass
class LogWindow:
    """The optimizer steps since the last log entry: their losses, metrics, tokens and time."""

    t0: float = dataclasses.field(default_factory=time.perf_counter)
    tokens: int = 0
    losses: list = dataclasses.field(default_factory=list)
    metrics: list = dataclasses.field(default_factory=list)
    grad_norm: float | None = None

    def step_done(self, loss: float, metrics: list[dict], tokens: int, grad_norm: float) -> None:
        self.losses.append(loss)
        self.metrics.extend(metrics)
        self.tokens += tokens
        self.grad_norm = grad_norm

    def entry(self, *, step: int, epoch: float, learning_rate: float, num_tokens: int,
              predicted_peak: float | None) -> dict:
        """The log entry of these steps, with TRL's names: the mean loss and metrics, the last grad norm, plus
        tokens/s, MLX's peak memory and the planner's prediction (bytes; None: no prediction). A metric that is
        NaN in a micro-batch is absent from it (KTO's rewards/chosen of a micro-batch without a desirable example,
        which TRL does not log): the mean is over the others, and a metric absent from all is not logged."""
        dt = max(time.perf_counter() - self.t0, 1e-9)
        entry = {"step": step, "epoch": round(epoch, 4), "loss": float(np.mean(self.losses)),
                 "grad_norm": self.grad_norm, "learning_rate": learning_rate, "num_tokens": num_tokens}
        present = {}
        for m in self.metrics:
            for k, v in m.items():
                if not (isinstance(v, float) and math.isnan(v)):
                    present.setdefault(k, []).append(v)
        entry.update({k: float(np.mean(v)) for k, v in sorted(present.items())})
        entry["tokens_per_second"] = self.tokens / dt
        entry["peak_memory_gb"] = mx.get_peak_memory() / 1e9
        if predicted_peak is not None:
            entry["predicted_peak_memory_gb"] = predicted_peak / 1e9
        return entry


class RunLog:
    """Where a run's log entries go on the writing rank (`is_main`): stdout, output_dir/metrics.jsonl, the trackers
    `report_to` asks for (`Reporter`), and output_dir/run.png drawn from the history (`plot`). A run.png that no
    mlxrl run drew is left alone; a failure to draw is a note, never a stop."""

    def __init__(self, args, output_dir: Path, *, is_main: bool):
        self.output_dir, self.is_main = Path(output_dir), is_main
        self.trackers = Reporter(args if is_main else None, self.output_dir)  # W&B / TensorBoard, rank 0 only
        self.plot_refused = False

    def write(self, entry: dict) -> None:
        if not self.is_main:
            return
        self.trackers.log(entry)
        with open(self.output_dir / "metrics.jsonl", "a") as fh:
            fh.write(json.dumps(entry) + "\n")
        shown = {k: (round(v, 5) if isinstance(v, float) else v) for k, v in entry.items() if v is not None}
        print(json.dumps(shown), flush=True)

    def draw(self, history: list[dict], run_id: str, title: str) -> None:
        """output_dir/run.png from `history`, recorded as the run `run_id`'s file."""
        path = self.output_dir / plot.PLOT
        if not self.is_main or self.plot_refused:
            return
        try:
            if plot.PLOT not in (run_dir.read_record(self.output_dir) or {"files": []})["files"]:
                if path.exists():
                    self.plot_refused = True
                    print(f"note: {path} is not mlxrl's: the run's picture is not drawn (nothing was changed)",
                          flush=True)
                    return
                run_dir.write_record(self.output_dir, run_id, files=(plot.PLOT,))
            plot.draw(history, path, title=title)
        except Exception as e:  # matplotlib, a full disk: the weights matter, the picture does not
            self.plot_refused = True
            print(f"note: the run's picture {path} was not drawn ({type(e).__name__}: {e})", flush=True)

    def close(self) -> None:
        self.trackers.close()


def memory_plan(model, args, kind: str, plan_kw: dict, shape: str, print_fn):
    """The planner's prediction for a run of `model` (printed at start-up, logged next to the measured peak);
    None where it cannot model the run. A mixture of experts trained whole past its memory limit is refused."""
    from ..models.widened import planned_config
    from ..plan import predict

    try:
        plan = predict(planned_config(model), args, kind, suggest=False, **plan_kw)
    except (ValueError, KeyError, NotImplementedError) as e:
        print_fn(f"memory plan: not available for this run ({e})")
        return None
    print_fn(f"memory plan: predicted peak {plan.total / 1e9:.2f} GB with {shape} "
             "(python -m mlxrl.plan for the breakdown)")
    if not plan.fits and not args.use_peft and getattr(model, "moe_config", None) is not None:
        # a mixture of experts trained whole past the memory it has would page all its experts
        raise MlxrlError(f"full fine-tuning of this mixture of experts is predicted to need "
                         f"{plan.total / 1e9:.1f} GB, over its limit of {plan.limit / 1e9:.1f} GB "
                         f"({plan.limit_source}): train LoRA (--use_peft; --load_in_4bit quantizes the experts), "
                         "or raise --memory_limit")
    return plan


def precision(model, master_weights: bool) -> tuple[mx.Dtype, str]:
    """The model's compute dtype and how its trainable weights are updated, for the start-up line."""
    if any(v.dtype != mx.float32 for _, v in tree_flatten(model.trainable_parameters())):
        how = "fp32 master weights" if master_weights else "bf16 weights, stochastic rounding"
        return model.compute_dtype(), f" ({how}, fp32 optimizer state)"
    return model.compute_dtype(), ""
