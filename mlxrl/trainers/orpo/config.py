"""ORPOConfig: trl.experimental.orpo's fields (TRL 1.16) on top of the paired trainers' `PairedConfig`, and their
checks."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import _f, check_config, refused
from ..paired.config import PairedConfig, check_decoder_only

__all__ = ["ORPOConfig", "check_orpo_config"]


@dataclass
class ORPOConfig(PairedConfig):
    """trl.experimental.orpo.ORPOConfig's fields (names and defaults); a field mlxrl does not support is refused
    in one line when set to anything but its default."""

    max_completion_length: int | None = _f(None, "no effect: TRL uses it for encoder-decoder models only "
                                                 "(Qwen models are decoder-only)")
    beta: float = _f(0.1, "lambda, the weight of the odds-ratio term against the chosen answers' NLL")
    padding_value: int | None = _f(None, "the token id that pads input_ids (default: the tokenizer's pad token)")
    generate_during_eval: bool = refused(False, "W&B / Comet sample tables. Use python -m mlxrl.generate "
                                                "on a checkpoint")
    is_encoder_decoder: bool | None = _f(None, "Qwen models are decoder-only: None or False")


def check_orpo_config(args: ORPOConfig) -> None:
    """One-line ValueErrors for unsupported or inconsistent settings."""
    check_config(args)  # types, ranges, choices and the refused TRL fields
    check_decoder_only(args)
