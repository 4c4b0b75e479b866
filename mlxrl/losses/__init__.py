"""Pure loss functions: arrays in, (loss, metrics) out. They never see a model.

`head_logprobs` streams the LM head (no [tokens, vocab] logits); SFT, DPO and GRPO losses are
functions of the per-token log-probs it returns.
"""

from .dpo import DPO_LOSSES, dpo_loss
from .grpo import compute_advantages, group_advantages, grpo_loss
from .head import (
    IGNORE_INDEX,
    head_logprobs,
    streamed_head_backward,
    streamed_logprobs,
    streamed_value_and_grad,
)
from .sft import NoTrainableTokensError, check_has_labels, sft_loss

__all__ = [
    "DPO_LOSSES",
    "IGNORE_INDEX",
    "NoTrainableTokensError",
    "check_has_labels",
    "compute_advantages",
    "dpo_loss",
    "group_advantages",
    "grpo_loss",
    "head_logprobs",
    "sft_loss",
    "streamed_head_backward",
    "streamed_logprobs",
    "streamed_value_and_grad",
]
