"""The hooks a trainer implements on the engine, written down: `engine.Trainer` calls these on its subclass
and nothing else, and a trainer overrides nothing else (`tests/test_architecture.py` holds it to that).

A trainer supplies a loss and where its batches come from; the engine owns the loop, the optimizer,
checkpoints, signals, data parallelism and reporting. The engine's own defaults are in `engine.Trainer`.
"""

from __future__ import annotations

from typing import Protocol

import mlx.core as mx


class TrainerHooks(Protocol):
    # the trainer's identity, declared once by each trainer (the engine has none): its command (python -m
    # mlxrl.NAME), the trainer a checkpoint records (a resume by another trainer is refused) and the memory
    # planner's model of it ("sft", "dpo" or "grpo")
    trainer_name: str
    metric_names: tuple[str, ...]  # the trainer's own metrics, logged as TRL names them

    def loss(self, model, batch: dict, normalizer: mx.array) -> tuple[mx.array, dict]:
        """The pure loss of one prepared micro-batch: (loss, metrics), normalised by `normalizer` (the
        accumulated global batch's share, see `batch_tokens`)."""

    def make_batches(self, epoch: int) -> list[dict]:
        """A dataset's micro-batches of `epoch` (SFT, DPO); the default source reads them."""

    def make_source(self):
        """Another batch source (`sources`: GRPO's generation rounds); default: the dataset of
        `make_batches`."""

    def batch_tokens(self, batch: dict) -> tuple[int, float]:
        """(real tokens, this micro-batch's share of the loss normaliser)."""

    def gradient_free_inputs(self, arrays: dict) -> dict:
        """Inputs computed without a gradient before the step (DPO's reference log-probs)."""

    def step_function(self):
        """(batch, normalizer) -> (loss, metrics, grads): the step compiled per batch shape (default:
        `nn.value_and_grad` of `loss`; SFT's two-phase head differentiates its own way)."""

    @property
    def compilable(self) -> bool:
        """Whether `step_function` can be traced by `mx.compile`."""

    def evaluation_metrics(self) -> dict:
        """The evaluation set's metrics, un-prefixed (`evaluate()` adds eval_)."""

    def plan_shape(self) -> tuple[dict, str]:
        """(the planner's extra arguments, the shape its prediction assumes, in words)."""
