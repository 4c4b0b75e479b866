"""PairedConfig: the fields every chosen / rejected trainer's config shares (DPO, ORPO, CPO), on top of the shared
`TrainConfig`, with TRL's names and defaults."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import TrainConfig, _f, refused

__all__ = ["PairedConfig", "check_decoder_only"]


@dataclass
class PairedConfig(TrainConfig):
    learning_rate: float = _f(1e-6, "peak learning rate of AdamW (TRL's preference trainers' default)")
    head_mode: str = _f("differentiable", "(mlxrl) preference losses drive the streamed head differentiably. Its "
                                          "per-token gradients depend on whole sequences", choices=("differentiable",))
    disable_dropout: bool = _f(True, "disable dropout (LoRA dropout included) in the model")
    dataset_num_proc: int | None = refused(None, "tokenisation runs in-process")
    max_length: int | None = _f(1024, "truncate each prompt+completion sequence to this many tokens")
    padding_free: bool = _f(False, "concatenate the 2B sequences of a batch into one row without padding. "
                                   "TRL 1.16 falls back to padding; mlxrl does it")
    pad_to_multiple_of: str | None = _f("auto", "pad every row's length up to a multiple of this (on top of "
                                                "seq_buckets). 'auto' or unset: no extra padding")
    eval_split: float = _f(0.0, "(mlxrl) hold out this fraction of the training set for evaluation")


def check_decoder_only(args) -> None:
    """trl.experimental's `is_encoder_decoder`: None (detected) or False; Qwen models are decoder-only."""
    if getattr(args, "is_encoder_decoder", None):
        raise ValueError("is_encoder_decoder=True: the Qwen models mlxrl trains are decoder-only; leave it unset")
