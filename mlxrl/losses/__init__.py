"""Pure loss functions: arrays in, (loss, metrics) out. They never see a model.

`head_logprobs` streams the LM head (no [tokens, vocab] logits); SFT, DPO and GRPO losses are
functions of the per-token log-probs it returns. `fused_head_loss` does the head AND a
token-separable loss (SFT nll / dft, token-level GRPO) with its gradients in one row-chunked pass.
"""

from ..processing.tokens import IGNORE_INDEX
from .dpo import DPO_LOSSES, dpo_loss
from .fused_head import fused_head_grads, fused_head_loss, fused_value_and_grad
from .grpo import compute_advantages, group_advantages, grpo_loss
from .head import (
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
    "fused_head_grads",
    "fused_head_loss",
    "fused_value_and_grad",
    "group_advantages",
    "grpo_loss",
    "head_logprobs",
    "sft_loss",
    "streamed_head_backward",
    "streamed_logprobs",
    "streamed_value_and_grad",
]
