"""Learning-rate schedules: transformers' `lr_scheduler_type` names, their `lr_scheduler_kwargs`, its warmup.

Each schedule is the learning rate times a multiplier of the optimizer's step count s (0 for the first
update, as torch's LambdaLR gives it), written with MLX ops so the compiled step traces it. With W warmup
steps and T training steps, p = (s - W) / max(1, T - W) the progress after the warmup:

    warmup (s < W)        s / max(1, W)                       (every schedule but constant)
    linear                max(0, (T - s) / max(1, T - W))
    cosine                max(0, (1 + cos(2 pi num_cycles p)) / 2)               num_cycles = 0.5
    cosine_with_restarts  0 once p >= 1, else max(0, (1 + cos(pi ((num_cycles p) mod 1))) / 2)   num_cycles = 1
    cosine_with_min_lr    r + (1 - r) (1 + cos(2 pi num_cycles p)) / 2, r = min_lr_rate or min_lr / lr
    polynomial            ((lr - lr_end) (1 - p)^power + lr_end) / lr, lr_end / lr past T   lr_end 1e-7, power 1
    inverse_sqrt          1 / sqrt((s + timescale - W) / timescale)       timescale = W, or 10000 without warmup
    constant              1;  constant_with_warmup: 1 after the warmup

The warmup is `warmup_steps` (an integer >= 1, or transformers 5's fraction of T when below 1) or else
`warmup_ratio` (transformers 4's name), rounded up. `tests/test_schedules.py` compares every schedule with
transformers' `get_scheduler` step by step.
"""

from __future__ import annotations

import json
import math

import mlx.core as mx

from ..errors import ConfigError

# name -> the lr_scheduler_kwargs it accepts
SCHEDULES = {
    "linear": (),
    "cosine": ("num_cycles",),
    "cosine_with_restarts": ("num_cycles",),
    "cosine_with_min_lr": ("num_cycles", "min_lr", "min_lr_rate"),
    "polynomial": ("lr_end", "power"),
    "inverse_sqrt": ("timescale",),
    "constant": (),
    "constant_with_warmup": (),
}


def warmup_steps(total_steps: int, warmup_steps: float | None = 0, warmup_ratio: float | None = 0.0) -> int:
    """Warmup steps as transformers counts them: `warmup_steps` (a fraction of the run when below 1), else
    `warmup_ratio` of the run."""
    w = float(warmup_steps or 0)
    if 0 < w < 1:  # transformers 5: a fraction of the training steps
        return int(math.ceil(w * total_steps))
    return int(w) if w >= 1 else int(math.ceil((warmup_ratio or 0.0) * total_steps))


def check_options(kind: str, kw: dict) -> None:
    """One-line ConfigError for an option the schedule `kind` does not take, or cosine_with_min_lr without
    its floor."""
    allowed = SCHEDULES.get(kind, ())
    other = sorted(set(kw) - set(allowed))
    if other:
        takes = f"takes {', '.join(allowed)}" if allowed else "takes none"
        raise ConfigError(f"lr_scheduler_kwargs: {', '.join(map(repr, other))} not an option of the {kind} "
                         f"schedule (it {takes})")
    if kind == "cosine_with_min_lr" and ("min_lr" in kw) == ("min_lr_rate" in kw):
        raise ConfigError("lr_scheduler_type cosine_with_min_lr needs one of lr_scheduler_kwargs min_lr and "
                         "min_lr_rate")


def scheduler_kwargs(kind: str, options) -> dict:
    """A schedule's options (transformers' lr_scheduler_kwargs) as a dict: JSON text from the command line
    parsed (the trainers' config check has refused a malformed one in one line before the run)."""
    value = options or {}
    kw = json.loads(value) if isinstance(value, str) else dict(value)
    check_options(kind, kw)
    return kw


def multiplier(kind: str, step, warmup: int, total: int, lr: float, kw: dict):
    """The learning-rate multiplier at `step` (an mx array or a number) for schedule `kind`."""
    s = mx.array(step, mx.float32) if not isinstance(step, mx.array) else step.astype(mx.float32)
    if kind == "constant":
        return mx.ones_like(s)
    warm = s / max(1, warmup)
    p = (s - warmup) / max(1, total - warmup)
    if kind == "constant_with_warmup":
        after = mx.ones_like(s)
    elif kind == "linear":
        after = mx.maximum(0.0, (total - s) / max(1, total - warmup))
    elif kind in ("cosine", "cosine_with_min_lr"):
        cycles = kw.get("num_cycles", 0.5)
        after = 0.5 * (1.0 + mx.cos(math.pi * 2.0 * cycles * p))
        if kind == "cosine":
            after = mx.maximum(0.0, after)
        else:
            rate = kw["min_lr_rate"] if "min_lr_rate" in kw else kw["min_lr"] / lr
            after = after * (1 - rate) + rate
    elif kind == "cosine_with_restarts":
        cycles = kw.get("num_cycles", 1)
        phase = mx.remainder(cycles * p, 1.0)
        after = mx.where(p >= 1.0, 0.0, mx.maximum(0.0, 0.5 * (1.0 + mx.cos(math.pi * phase))))
    elif kind == "polynomial":
        end, power = kw.get("lr_end", 1e-7), kw.get("power", 1.0)
        if not lr > end:
            raise ValueError(f"lr_end ({end}) must be smaller than the learning rate ({lr})")
        decayed = ((lr - end) * mx.power(mx.maximum(1.0 - p, 0.0), power) + end) / lr
        after = mx.where(s > total, end / lr, decayed)
    elif kind == "inverse_sqrt":
        timescale = kw.get("timescale") or (warmup or 10_000)
        after = 1.0 / mx.sqrt(mx.maximum(s + (timescale - warmup), 1e-12) / timescale)
    else:
        raise ValueError(f"lr_scheduler_type {kind!r} is not supported: use one of {', '.join(SCHEDULES)}")
    return mx.where(s < warmup, warm, after) if warmup > 0 else after


def make_schedule(kind: str, learning_rate: float, total_steps: int, warmup: int = 0, options=None):
    """step -> learning rate (float32) for the optimizer (MLX optimizers call it with their step count):
    schedule `kind` (transformers' lr_scheduler_type) peaking at `learning_rate` after `warmup` steps."""
    lr, kw = float(learning_rate), scheduler_kwargs(kind, options)
    multiplier(kind, 0, warmup, total_steps, lr, kw)  # a bad name or option is refused here, not in the step

    def schedule(step):
        return (lr * multiplier(kind, step, warmup, total_steps, lr, kw)).astype(mx.float32)

    return schedule
