"""CPOConfig: trl.experimental.cpo's fields (TRL 1.16: CPO, SimPO, AlphaPO) on top of the paired trainers'
`PairedConfig`, and their checks."""

from __future__ import annotations

from dataclasses import dataclass

from ...losses.reference_free import CPO_LOSSES
from ..config import _f, check_config, refused
from ..paired.config import PairedConfig, check_decoder_only

__all__ = ["CPOConfig", "check_cpo_config"]


@dataclass
class CPOConfig(PairedConfig):
    """trl.experimental.cpo.CPOConfig's fields (names and defaults); a field mlxrl does not support is refused in
    one line when set to anything but its default. loss_type="alphapo" becomes simpo with cpo_alpha 0, as TRL's
    __post_init__ does."""

    max_completion_length: int | None = _f(None, "no effect: TRL uses it for encoder-decoder models only "
                                                 "(Qwen models are decoder-only)")
    beta: float = _f(0.1, "the temperature of the preference term (IPO: tau)")
    label_smoothing: float = _f(0.0, "sigmoid / simpo: the assumed probability that a pair's labels are flipped")
    loss_type: str = _f("sigmoid", "sigmoid (CPO) | hinge | ipo | simpo | alphapo. SimPO scores mean log-probs "
                                   "with the margin simpo_gamma; alphapo is simpo with cpo_alpha 0",
                        choices=(*CPO_LOSSES, "alphapo"))
    cpo_alpha: float = _f(1.0, "weight of the chosen answers' NLL (the BC regulariser); 0: none (SimPO)")
    simpo_gamma: float = _f(0.5, "SimPO's target reward margin (loss_type simpo)")
    alpha: float = _f(0.0, "AlphaPO's reward shape: 0 the log-prob, else r = (1 - p^-alpha) / alpha")
    generate_during_eval: bool = refused(False, "W&B / Comet sample tables. Use python -m mlxrl.generate "
                                                "on a checkpoint")
    is_encoder_decoder: bool | None = _f(None, "Qwen models are decoder-only: None or False")

    def __post_init__(self):
        if self.loss_type == "alphapo":
            self.loss_type, self.cpo_alpha = "simpo", 0.0
        super().__post_init__()


def check_cpo_config(args: CPOConfig) -> None:
    """One-line ValueErrors for unsupported or inconsistent settings (TRL warns where a setting is ignored: a
    flag the user set is not dropped here, it is refused)."""
    check_config(args)  # types, ranges, choices and the refused TRL fields
    check_decoder_only(args)
    if args.loss_type in ("hinge", "ipo") and args.label_smoothing > 0:
        raise ValueError(f"label_smoothing={args.label_smoothing} with loss_type={args.loss_type!r}: that loss has "
                         "no label smoothing (TRL ignores it with a warning); leave label_smoothing at 0 or use "
                         "sigmoid / simpo")
