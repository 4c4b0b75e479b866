"""DPOConfig: TRL 1.16's direct preference optimisation fields on top of the paired trainers' `PairedConfig`, and
their checks."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ...losses.dpo import DPO_LOSSES, F_DIVERGENCE_LOSSES, F_DIVERGENCES
from ..config import _f, check_config, refused
from ..paired.config import PairedConfig

__all__ = ["DPOConfig", "check_dpo_config"]


@dataclass
class DPOConfig(PairedConfig):
    """TRL 1.16's DPOConfig fields (names and defaults). Fields TRL has that mlxrl does not support
    raise a ValueError when set to anything but their default (`refused`, checked by `config.check_config`)."""

    # model
    ref_model: str | None = _f(None, "(mlxrl) path or Hub id of a separate frozen reference model")
    # data
    truncation_mode: str = _f("keep_start", "keep_start | keep_end (deprecated in TRL; text only)")
    precompute_ref_log_probs: bool = _f(False, "compute the reference log-probs of the whole dataset before "
                                               "training (no reference kept in memory)")
    precompute_ref_batch_size: int | None = _f(None, "pairs per batch when precomputing (default: the train / "
                                                     "eval batch size)")
    # loss
    # `| None` only so that flags.build_parser gives the flag nargs="+" (it reads lists through Optional)
    loss_type: list[str] | None = dataclasses.field(
        default_factory=lambda: ["sigmoid"],
        metadata={"help": "the DPO losses, summed with loss_weights. One or more of "
                          f"{', '.join(DPO_LOSSES)} (default: sigmoid)"})
    loss_weights: list[float] | None = _f(None, "one weight per loss_type (default 1 each)")
    ld_alpha: float | None = _f(None, "LD-DPO: weight of completion tokens past the shorter answer's length")
    f_divergence_type: str = _f("reverse_kl", f"f-DPO regulariser: {' | '.join(F_DIVERGENCES)}")
    f_alpha_divergence_coef: float = _f(0.5, "alpha of alpha_divergence")
    label_smoothing: float = _f(0.0, "robust / exo_pair / aot label smoothing (sigmoid: cDPO, see docs/dpo.md)")
    beta: float = _f(0.1, "deviation from the reference (IPO: tau)")
    use_weighting: bool = refused(False, "WPO weighting needs sum(p^2) per token, which the streamed head does "
                                         "not compute yet")
    discopop_tau: float = _f(0.05, "DiscoPOP temperature")
    activation_offloading: bool = refused(False, "MLX has unified memory; use gradient_checkpointing")
    sync_ref_model: bool = refused(False, "TR-DPO reference syncing is not implemented (use a fixed reference)")
    ref_model_mixup_alpha: float = refused(0.6, "it only applies with sync_ref_model (TR-DPO), which is not "
                                                "implemented")
    ref_model_sync_steps: int = refused(512, "it only applies with sync_ref_model (TR-DPO), which is not implemented")
    pad_token: str | None = refused(None, "deprecated in TRL; the processor's pad token is used")

    def __post_init__(self):
        super().__post_init__()
        if self.loss_type is None:
            self.loss_type = ["sigmoid"]
        if isinstance(self.loss_type, str):
            self.loss_type = [self.loss_type]
        if self.loss_weights is not None and len(self.loss_weights) != len(self.loss_type):
            raise ValueError(f"loss_weights has {len(self.loss_weights)} weights for {len(self.loss_type)} loss types "
                             f"{self.loss_type}")


def check_dpo_config(args: DPOConfig) -> None:
    """One-line ValueErrors for unsupported or inconsistent settings (TRL's checks plus ours)."""
    check_config(args)  # types, ranges, choices and the refused TRL fields
    unknown = [t for t in args.loss_type if t not in DPO_LOSSES]
    if unknown or not args.loss_type:
        raise ValueError(f"unknown loss_type {unknown}; valid: {', '.join(DPO_LOSSES)}")
    if args.f_divergence_type not in F_DIVERGENCES:
        raise ValueError(f"f_divergence_type {args.f_divergence_type!r}: use one of {', '.join(F_DIVERGENCES)}")
    if args.f_divergence_type != "reverse_kl" and not set(args.loss_type) <= F_DIVERGENCE_LOSSES:
        raise ValueError(f"f_divergence_type={args.f_divergence_type!r} supports only loss types "
                         f"{sorted(F_DIVERGENCE_LOSSES)}, got {args.loss_type}")
    if "exo_pair" in args.loss_type and not args.label_smoothing > 0:
        raise ValueError("loss_type exo_pair needs label_smoothing > 0 (the EXO paper recommends 1e-3)")
    if args.ld_alpha is not None and not 0.0 <= args.ld_alpha <= 1.0:
        raise ValueError(f"ld_alpha must be in [0, 1], got {args.ld_alpha}")
    if args.truncation_mode not in ("keep_start", "keep_end"):
        raise ValueError(f"truncation_mode must be keep_start or keep_end, got {args.truncation_mode!r}")
    if args.beta <= 0:
        raise ValueError(f"beta must be > 0, got {args.beta}")
