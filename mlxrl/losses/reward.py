"""The reward model's loss, as TRL 1.16's RewardTrainer computes it: Bradley-Terry over each pair's scalar scores.

    loss = -mean(log sigmoid(c - r - margin)) + center_rewards_coefficient * mean((c + r)^2)

c, r [B]: the scores of the chosen and rejected sequences; margin [B] the rows' optional `margin` column (0
without it); the centring term (Eisenstein et al. 2023, Eq. 2) only when the coefficient is set. Metrics (TRL's
names): min_reward / mean_reward / max_reward over the 2B scores, accuracy (the fraction of pairs with c > r,
ties counting as wrong) and margin (mean c - r; the column's margin is not subtracted, as TRL logs it).

Tests: pytest tests/test_reward.py (against `trl.RewardTrainer.compute_loss` itself, and float64 gradients).
"""

from __future__ import annotations

import mlx.core as mx

__all__ = ["bradley_terry_loss"]


def bradley_terry_loss(chosen: mx.array, rejected: mx.array, margin: mx.array | None = None,
                       center_rewards_coefficient: float | None = None) -> tuple[mx.array, dict]:
    """(loss, metrics) of chosen / rejected scores [B] (float32: the caller casts), `margin` [B] or None."""
    diff = chosen - rejected
    shifted = diff if margin is None else diff - margin
    loss = mx.logaddexp(mx.zeros_like(shifted), -shifted).mean()  # -log sigmoid, stable for either sign
    if center_rewards_coefficient is not None:
        loss = loss + center_rewards_coefficient * mx.mean((chosen + rejected) ** 2)
    both = mx.stop_gradient(mx.concatenate([chosen, rejected]))
    d = mx.stop_gradient(diff)
    metrics = {"min_reward": both.min(), "mean_reward": both.mean(), "max_reward": both.max(),
               "accuracy": (d > 0).astype(mx.float32).mean(), "margin": d.mean()}
    return loss, metrics
