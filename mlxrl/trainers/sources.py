"""Batch sources: what the engine's one loop consumes.

A batch source hands the loop micro-batches (numpy dicts the trainer's `to_device` turns into
arrays) and knows the shape of an epoch; the loop owns the optimizer steps, the accumulation, the
logging, evaluation and checkpoint cadence. Two kinds exist:

- `DatasetSource` (SFT, DPO): an epoch is the trainer's `make_batches(epoch)` (shuffled, bucketed,
  sharded over the ranks); batches are prepared ahead on a worker thread; an epoch ends with its last
  micro-batch (a last step on fewer than gradient_accumulation_steps micro-batches, as transformers'
  Trainer takes it).
- `GenerationRounds` (GRPO): a round is generated, scored and cut into
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


class GenerationRounds:
    """GRPO's batch source: generation rounds, each generated, scored and cut into steps_per_generation
    micro-batches on the training thread with the current weights when the loop reaches it, then
    trained on num_iterations times. An epoch is every prompt once (incomplete rounds dropped); a
    step may take micro-batches of two epochs (nothing is dropped at an epoch's end)."""

    epoch_bound = False

    def __init__(self, trainer):
        a = trainer.args
        self.trainer = trainer
        self.steps_per_generation = trainer.steps_per_generation
        self.generate_every = trainer.steps_per_generation * a.num_iterations
        rounds_per_epoch = len(trainer.rows) // (trainer.prompts_per_round * trainer.world_size)
        self.length = rounds_per_epoch * self.generate_every
        self.round: list[dict] | None = None  # the micro-batches of the round being trained on
        self.uses: list[int] = []  # how often each was trained on
        self.position = 0  # the global micro-batch the next item is
        self._metrics: list[dict] = []

    def epoch_length(self, epoch: int) -> int:
        return self.length

    @contextlib.contextmanager
    def open(self, epoch: int, start: int, stop: int, accum: int):
        yield self._stream(epoch * self.length + start)  # on into the next epoch: a step may span two

    def _stream(self, micro: int):
        while True:
            if micro % self.generate_every == 0 or self.round is None:
                self.round, metrics = self.trainer.generate_round(micro // self.generate_every)
                self.uses = [0] * len(self.round)
                self._metrics.append(metrics)
            k = micro % self.steps_per_generation
            # num_tokens (TRL): tokens generated, counted once however often the round is reused
            item = self.round[k] if self.uses[k] == 0 else {**self.round[k], "num_tokens": 0}
            self.uses[k] += 1
            micro += 1
            self.position = micro  # before the yield: a checkpoint taken now holds this item's round
            yield item

    def pop_metrics(self) -> list[dict]:
        out, self._metrics = self._metrics, []
        return out

    def state_dict(self) -> dict[str, np.ndarray]:
        """Mid-round, the round being trained on: it was generated (and scored, and its old/reference
        log-probs computed) with earlier weights, so regenerating it on resume would train on other
        completions."""
        if self.round is None or self.position % self.generate_every == 0:
            return {}
        out = {f"uses.{i}": np.array(u) for i, u in enumerate(self.uses)}
        out.update({f"round.{i}.{k}": np.asarray(v) for i, mb in enumerate(self.round) for k, v in mb.items()})
        return out

    def load_state_dict(self, arrays: dict[str, np.ndarray]) -> None:
        n = len([k for k in arrays if k.startswith("uses.")])
        self.uses = [int(arrays[f"uses.{i}"]) for i in range(n)]
        self.round = [{} for _ in range(n)]
        for key, v in arrays.items():
            if key.startswith("round."):
                _, i, name = key.split(".", 2)
                self.round[int(i)][name] = v.item() if v.ndim == 0 else v


def step_seed(seed: int, position: int, stream: int = 0) -> int:
    """A 31-bit seed for one draw of a run: a function of the run's seed, a position (the optimizer step,
    a prompt's place in a round) and a stream (the rank, the generation round), so a resumed run or
    another number of ranks draws what the uninterrupted one did."""
    return (seed * 1_000_003 + position + 7919 * stream) % (2**31 - 1)
