"""The progress a user sees during `train()`: one line before the first step, then a bar whose time
left counts steady steps only.

The first step of each batch shape builds and compiles the training step (and, on a machine's first
run, the native CPU kernels are compiled before it): it takes many times a steady step. tqdm's own
estimate averages it in and shows an hour's ETA for a run of minutes, so the bar hides tqdm's and
shows ours: the mean time between the ends of the last `WINDOW` steps that ran a step already built
(no new batch shape), times the steps left; "eta …" until such a step has run. Evaluation and saves
between two steps count in that time, as they count in the run's.
"""

from __future__ import annotations

import time
from collections import deque

WINDOW = 20


def eta_text(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


class SteadyEta:
    """Time left from the steps that did not build a new compiled step."""

    def __init__(self, total: int, done: int, clock=time.perf_counter):
        self.total, self.done, self.clock = total, done, clock
        self.last = None
        self.intervals: deque[float] = deque(maxlen=WINDOW)

    def start(self) -> None:
        self.last = self.clock()

    def step(self, fresh: bool) -> None:
        """One optimizer step ended; `fresh`: it ran a batch shape not seen before (built/compiled)."""
        now = self.clock()
        if not fresh and self.last is not None:
            self.intervals.append(now - self.last)
        self.last = now
        self.done += 1

    def seconds_left(self) -> float | None:
        if not self.intervals:
            return None
        return sum(self.intervals) / len(self.intervals) * max(0, self.total - self.done)


class Progress:
    """The bar (tqdm, when `bar` is on) and the first-step line (always, on the writing rank)."""

    def __init__(self, total: int, done: int, *, bar: bool, print_fn, compiled: bool):
        self.eta = SteadyEta(total, done)
        self.bar = None
        what = "compiling the training step" if compiled else "building the training step"
        print_fn(f"{what} for each new batch shape: the first steps are slow; the time left counts steady "
                 "steps only")
        if bar:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=done, desc="train", dynamic_ncols=True,
                            bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]")
        self.eta.start()

    def step(self, loss: float, fresh: bool) -> None:
        self.eta.step(fresh)
        if self.bar is None:
            return
        left = self.eta.seconds_left()
        self.bar.set_postfix_str(f"loss={loss:.4f}, " + (f"eta {eta_text(left)}" if left is not None
                                                          else "eta after the first steps"), refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
