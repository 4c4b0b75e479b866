"""Batch sources: what the engine's one loop consumes.

A batch source hands the loop micro-batches (numpy dicts the trainer's `to_device` turns into
arrays) and knows the shape of an epoch; the loop owns the optimizer steps, the accumulation, the
logging, evaluation and checkpoint cadence. Two kinds exist:

- `DatasetSource` (SFT, DPO): an epoch is the trainer's `make_batches(epoch)` (shuffled, bucketed,
  sharded over the ranks); batches are prepared ahead on a worker thread; an epoch ends with its last
  micro-batch (a last step on fewer than gradient_accumulation_steps micro-batches, as transformers'
  Trainer takes it).
- `trainers.rollout.rounds.GenerationRounds` (GRPO, RLOO, Distillation): a round is generated, scored and cut into
  micro-batches on the training thread, with the current weights, when the loop reaches it; a step
  may take micro-batches of two epochs.

The interface (duck-typed):

    epoch_length(epoch) -> int          micro-batches in that epoch (the logged epoch's denominator)
    epoch_bound: bool                   a step never spans two epochs: the leftover micro-batches make a short
                                        last step (a dataset); False: the step goes on into the next epoch
    open(epoch, start, stop, accum)     a context manager yielding the epoch's micro-batches from start
                                        (a dataset stops at stop; generation rounds go on)
    pop_metrics() -> list[dict]         metrics the source measured since the last call (logged)
    state_dict() / load_state_dict(d)   numpy arrays a checkpoint needs to resume exactly here
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import numpy as np

from ..data.batches import Prefetcher


class DatasetSource:
    """Micro-batches from `make_batches(epoch)`: prepared dicts, or zero-argument callables that
    prepare one (called on the background worker, at most accum + 1 ahead)."""

    epoch_bound = True

    def __init__(self, make_batches: Callable[[int], list]):
        self._make = make_batches
        self._cache: tuple[int, list] | None = None

    def batches(self, epoch: int) -> list:
        if self._cache is None or self._cache[0] != epoch:
            self._cache = (epoch, self._make(epoch))
        return self._cache[1]

    def epoch_length(self, epoch: int) -> int:
        return len(self.batches(epoch))

    @contextlib.contextmanager
    def open(self, epoch: int, start: int, stop: int, accum: int) -> Iterator[Iterator[dict]]:
        todo = self.batches(epoch)[start:stop]
        # data preparation (collating, decoding and resizing images) runs ahead on a worker thread, at
        # most `depth` batches ahead so it cannot pile up memory
        with Prefetcher(lambda: map(_prepare, todo), depth=max(2, accum + 1)) as ready:
            yield ready

    def pop_metrics(self) -> list[dict]:
        return []

    def state_dict(self) -> dict[str, np.ndarray]:
        """Nothing: the batches are a function of the seed, the epoch and the position."""
        return {}

    def load_state_dict(self, arrays: dict[str, np.ndarray]) -> None:
        if arrays:
            raise ValueError(f"a dataset source has no state to restore (got {sorted(arrays)[:3]})")


def _prepare(item) -> dict:
    return item() if callable(item) else item


def step_seed(seed: int, position: int, stream: int = 0) -> int:
    """A 31-bit seed for one draw of a run: a function of the run's seed, a position (the optimizer step,
    a prompt's place in a round) and a stream (the rank, the generation round), so a resumed run or
    another number of ranks draws what the uninterrupted one did."""
    return (seed * 1_000_003 + position + 7919 * stream) % (2**31 - 1)
