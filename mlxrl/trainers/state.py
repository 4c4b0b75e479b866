"""Where a run stands (`TrainState`): the counters the loop advances, the log history and the run's id.

A checkpoint's trainer_state.json holds them (`as_record`, with transformers' names), a resume puts them
back (`restore`); the trainer's `global_step`, `epoch`, `num_tokens`, `log_history` and `run_id` are
these fields (TRL's `trainer.state` is transformers' `TrainerState` made from them, `trl_api`).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field


@dataclass
class TrainState:
    global_step: int = 0  # optimizer steps taken
    epoch: int = 0  # epochs finished
    batch_in_epoch: int = 0  # micro-batches of the current epoch already consumed
    num_tokens: int = 0  # real tokens trained on (every rank's)
    log_history: list[dict] = field(default_factory=list)  # every log entry, as transformers' log_history
    step_losses: list[float] = field(default_factory=list)  # each optimizer step's loss (train_loss)
    run_id: str = field(default_factory=lambda: secrets.token_hex(8))  # in every checkpoint: pruning is per run

    def step_done(self, loss: float, tokens: int, micro_batches: int) -> None:
        """One optimizer step taken on `micro_batches` micro-batches holding `tokens` real tokens."""
        self.num_tokens += tokens
        self.batch_in_epoch += micro_batches
        self.global_step += 1
        self.step_losses.append(loss)

    def epoch_done(self, usable: int, epoch_bound: bool) -> None:
        """The epoch of `usable` micro-batches is over; a step that took micro-batches of the next one (GRPO's
        rounds, not `epoch_bound`) carries them over."""
        self.batch_in_epoch = self.batch_in_epoch - usable if not epoch_bound else 0
        self.epoch += 1

    def as_record(self) -> dict:
        """The fields a checkpoint's trainer_state.json holds."""
        return {"global_step": self.global_step, "epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch,
                "num_tokens": self.num_tokens, "log_history": self.log_history, "run_id": self.run_id}

    def restore(self, record: dict, epoch: int, batch_in_epoch: int) -> None:
        """A checkpoint's counters and history back (at this run's data position `epoch`, `batch_in_epoch`);
        the run id is decided by the resume (`saving`)."""
        self.global_step, self.epoch, self.batch_in_epoch = record["global_step"], epoch, batch_in_epoch
        self.num_tokens = record.get("num_tokens", 0)
        self.log_history = list(record.get("log_history", []))


def state_field(name: str, doc: str) -> property:
    """The trainer's attribute `name`: the field of its `train_state`."""
    return property(lambda self: getattr(self.train_state, name),
                    lambda self, value: setattr(self.train_state, name, value), doc=doc)
