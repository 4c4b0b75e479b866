"""KTO's losses (TRL 1.16 `KTOConfig.loss_type`: `kto`, `apo_zero_unpaired`) as a pure MLX function.

Each example is one completion with a label (desirable or not); r = its summed completion log-prob under the
policy minus the reference's, and z = the KL term: the mean over the micro-batch of the same log-ratio on the
mismatched (prompt, completion) pairs, clamped at 0 and without a gradient (TRL computes it under no_grad):

    kto                desirable 1 - s(beta (r - z)),   undesirable 1 - s(beta (z - r))
    apo_zero_unpaired  desirable 1 - s(beta r),         undesirable s(beta r)

each weighted by desirable_weight / undesirable_weight; the loss is their mean over the micro-batch's examples.
Metrics (TRL's): kl, rewards/chosen|rejected (beta r summed over that label's examples / their count),
logps/chosen|rejected, rewards/margins; a metric of a label the micro-batch does not hold is NaN, which the
engine's log leaves out of its mean, as TRL appends nothing then.

Tests: pytest tests/test_kto.py
"""

from __future__ import annotations

import mlx.core as mx

__all__ = ["KTO_LOSSES", "kto_loss", "kl_term"]

KTO_LOSSES = ("kto", "apo_zero_unpaired")


def kl_term(kl_logps: mx.array, ref_kl_logps: mx.array) -> mx.array:
    """z: the mean log-ratio of the mismatched pairs, clamped at 0, no gradient."""
    return mx.maximum(mx.stop_gradient(kl_logps - ref_kl_logps).mean(), 0.0)


def kto_loss(logps: mx.array, ref_logps: mx.array, labels: mx.array, kl: mx.array | None = None, *,
             loss_type: str = "kto", beta: float = 0.1, desirable_weight: float = 1.0,
             undesirable_weight: float = 1.0) -> tuple[mx.array, dict]:
    """logps / ref_logps: summed completion log-probs [B]; labels: 1 desirable, 0 not [B]; kl: `kl_term` (kto
    only). Returns (the mean loss, metrics)."""
    if loss_type not in KTO_LOSSES:
        raise ValueError(f"unknown KTO loss_type {loss_type!r}; valid: {', '.join(KTO_LOSSES)}")
    r = logps.astype(mx.float32) - ref_logps.astype(mx.float32)
    y = labels.astype(mx.float32)
    if loss_type == "kto":
        z = mx.zeros((), mx.float32) if kl is None else kl
        good, bad = 1 - mx.sigmoid(beta * (r - z)), 1 - mx.sigmoid(beta * (z - r))
    else:
        z = mx.zeros((), mx.float32)
        good, bad = 1 - mx.sigmoid(beta * r), mx.sigmoid(beta * r)
    losses = y * desirable_weight * good + (1 - y) * undesirable_weight * bad
    rewards = mx.stop_gradient(beta * r)
    lp = mx.stop_gradient(logps.astype(mx.float32))
    n_good, n_bad = y.sum(), (1 - y).sum()
    nan = mx.array(float("nan"), mx.float32)

    def mean_of(x, w, n):
        return mx.where(n > 0, (x * w).sum() / mx.maximum(n, 1.0), nan)

    metrics = {"kl": z, "rewards/chosen": mean_of(rewards, y, n_good),
               "rewards/rejected": mean_of(rewards, 1 - y, n_bad), "logps/chosen": mean_of(lp, y, n_good),
               "logps/rejected": mean_of(lp, 1 - y, n_bad)}
    metrics["rewards/margins"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
    return losses.mean(), metrics
