"""KTOConfig: TRL 1.16's Kahneman-Tversky optimisation fields on top of the paired trainers' `PairedConfig`, and their
checks."""

from __future__ import annotations

from dataclasses import dataclass

from ...losses.kto import KTO_LOSSES
from ..config import _f, check_config, refused
from ..paired.config import PairedConfig

__all__ = ["KTOConfig", "check_kto_config"]


@dataclass
class KTOConfig(PairedConfig):
    """TRL 1.16's KTOConfig fields (names and defaults); a field mlxrl does not support is refused in one line
    when set to anything but its default."""

    train_sampling_strategy: str = _f("sequential", "sequential (TRL's KTO default: the KL term pairs each example "
                                                    "with its neighbour) | random")
    ref_model: str | None = _f(None, "(mlxrl) path or Hub id of a separate frozen reference model")
    precompute_ref_log_probs: bool = _f(False, "compute the reference log-probs of the whole dataset before "
                                               "training (no reference kept in memory)")
    precompute_ref_batch_size: int | None = _f(None, "examples per batch when precomputing (default: the train / "
                                                     "eval batch size)")
    loss_type: str = _f("kto", "kto (with the KL term) | apo_zero_unpaired", choices=KTO_LOSSES)
    beta: float = _f(0.1, "deviation from the reference model")
    desirable_weight: float = _f(1.0, "weight of the desirable examples' losses")
    undesirable_weight: float = _f(1.0, "weight of the undesirable examples' losses")
    activation_offloading: bool = refused(False, "MLX has unified memory; use gradient_checkpointing")
    sync_ref_model: bool = refused(False, "TR-DPO reference syncing is not implemented (use a fixed reference)")
    ref_model_mixup_alpha: float = refused(0.6, "it only applies with sync_ref_model, which is not implemented")
    ref_model_sync_steps: int = refused(512, "it only applies with sync_ref_model, which is not implemented")


def check_kto_config(args: KTOConfig) -> None:
    """One-line ValueErrors (TRL's checks plus ours)."""
    check_config(args)  # types, ranges, choices and the refused TRL fields
    if args.beta <= 0:
        raise ValueError(f"beta must be > 0, got {args.beta}")
    if args.loss_type == "kto":
        if args.train_sampling_strategy != "sequential":
            raise ValueError("loss_type 'kto' estimates its KL term from each example's neighbours in a fixed order "
                             "(TRL's rule): set train_sampling_strategy='sequential' (--train_sampling_strategy "
                             "sequential), or use loss_type apo_zero_unpaired")
        if args.per_device_train_batch_size <= 1:
            raise ValueError("loss_type 'kto' needs per_device_train_batch_size > 1: with one example the KL term's "
                             "mismatched completion is its own (TRL refuses it too)")
