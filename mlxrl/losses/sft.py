"""SFT losses on per-token log-probs (from `head_logprobs` / `streamed_logprobs`), as TRL defines them.

    nll:  L = -sum_i m_i logp_i / n
    dft:  L = -sum_i m_i sg(p_i) logp_i / n        (Dynamic Fine-Tuning, arXiv 2508.05629; p_i = exp(logp_i))

m_i is 1 for tokens whose label is not -100, and n is the number of such tokens in the WHOLE
accumulated batch (TRL's `num_items_in_batch`), so micro-batch losses add up to the mean over all
trained tokens, however the batch is split.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..processing.tokens import IGNORE_INDEX


class NoTrainableTokensError(ValueError):
    """Every label of a batch is -100: the loss would silently be 0 and nothing would be learned."""


def check_has_labels(labels, example_ids=None) -> None:
    """Raise a one-line error naming the examples when no label of the batch is trainable.

    labels: [B, L] (or [N]) with -100 for ignored positions. example_ids: names for the rows
    (dataset indices); defaults to the row numbers.
    """
    lab = np.asarray(labels)
    if (lab != IGNORE_INDEX).any():
        return
    rows = lab.reshape(lab.shape[0], -1) if lab.ndim > 1 else lab.reshape(1, -1)
    ids = list(example_ids) if example_ids is not None else list(range(rows.shape[0]))
    shown = ", ".join(str(i) for i in ids[:8]) + (", ..." if len(ids) > 8 else "")
    raise NoTrainableTokensError(
        f"every label is -100 in the batch of example(s) {shown}: nothing to train on (the loss would be a "
        "silent 0); check max_length truncation, completion_only_loss / assistant_only_loss, or drop these rows"
    )


def _normalizer(mask: mx.array, num_items) -> mx.array:
    n = mask.sum() if num_items is None else mx.array(num_items, dtype=mx.float32)
    return mx.maximum(n.astype(mx.float32), 1.0)


def nll_loss(logps: mx.array, mask: mx.array, num_items=None) -> mx.array:
    """-sum(mask * logp) / n."""
    return -(logps * mask).sum() / _normalizer(mask, num_items)


def dft_loss(logps: mx.array, mask: mx.array, num_items=None) -> mx.array:
    """-sum(mask * stop_gradient(exp(logp)) * logp) / n."""
    weight = mx.stop_gradient(mx.exp(logps))
    return -(logps * weight * mask).sum() / _normalizer(mask, num_items)


SFT_LOSSES = {"nll": nll_loss, "dft": dft_loss}


def sft_loss(logps, targets, *, loss_type="nll", num_items=None, entropy=None, argmax=None):
    """(loss, metrics) for per-token log-probs `logps [N]` of `targets [N]` (-100 = ignored).

    num_items: trained tokens in the whole accumulated batch (default: this batch's count).
    entropy / argmax [N] (from the same stream) give TRL's `entropy` and `mean_token_accuracy`,
    averaged over this batch's trained tokens.
    """
    if loss_type not in SFT_LOSSES:
        raise ValueError(f"unknown SFT loss_type {loss_type!r}: use one of {', '.join(SFT_LOSSES)}")
    mask = (targets != IGNORE_INDEX).astype(mx.float32)
    loss = SFT_LOSSES[loss_type](logps.astype(mx.float32), mask, num_items)
    return loss, token_metrics(targets, entropy, argmax)


def token_metrics(targets, entropy=None, argmax=None) -> dict:
    """TRL's `entropy` and `mean_token_accuracy`, averaged over the batch's trained tokens (those given)."""
    mask = (targets != IGNORE_INDEX).astype(mx.float32)
    n = mx.maximum(mask.sum(), 1.0)
    metrics = {}
    if entropy is not None:
        metrics["entropy"] = mx.stop_gradient((entropy * mask).sum() / n)
    if argmax is not None:
        metrics["mean_token_accuracy"] = ((argmax == targets).astype(mx.float32) * mask).sum() / n
    return metrics
