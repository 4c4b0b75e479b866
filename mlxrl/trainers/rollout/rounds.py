"""The rollout trainers' batch source (`sources`' interface): generation rounds, each made by the trainer's
`generate_round` (generate, score, cut, the gradient-free log-probs) when the loop reaches it."""

from __future__ import annotations

import contextlib

import numpy as np


class GenerationRounds:
    """The rollout trainers' batch source: generation rounds, each generated, scored and cut into steps_per_generation
    micro-batches on the training thread with the current weights when the loop reaches it, then
    trained on num_iterations times. An epoch is every prompt once (incomplete rounds dropped); a
    step may take micro-batches of two epochs (nothing is dropped at an epoch's end)."""

    epoch_bound = False

    def __init__(self, trainer):
        a = trainer.args
        self.trainer = trainer
        self.steps_per_generation = trainer.steps_per_generation
        self.generate_every = trainer.steps_per_generation * getattr(a, "num_iterations", 1)
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
