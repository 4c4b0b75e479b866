"""RLOO (REINFORCE leave-one-out, Ahmadian et al. 2024) as TRL 1.16's RLOOTrainer computes it: the advantages of
a generation round and the sequence-level clipped loss of a micro-batch. Pure MLX array functions, float32.

Advantages (`rloo_advantages`), over the whole round (every process's groups), completions of a prompt
contiguous in groups of G:

    r_i  = nansum_k w_k R_ik                    (NaN when every function returned None: unscorable)
    r_i  = clip(r_i, *reward_clip_range)        (when given)
    r_i  = r_i - beta * KL_i,  KL_i = sum_t (logp_old - logp_ref)   (the first-order estimate, summed per sequence:
                                                 TRL's, not GRPO's k3; it can be negative)
    A_i  = r_i - (sum_{j != i, scorable} r_j) / (n_scorable - 1)    (the leave-one-out baseline)
    A    = (A - nanmean(A)) / (nanstd(A) + 1e-4) over the round      (normalize_advantages)
    A_i  = 0 where NaN (unscorable, or a group with one scorable completion)

Loss (`rloo_loss`), per sequence with s = sum_t logp over the completion's tokens:

    ratio = exp(s - s_old);   l = -min(ratio A, clip(ratio, 1 - epsilon, 1 + epsilon_high) A);   loss = mean(l)

Metrics, TRL's names: reward / reward_std (the weighted reward before clipping and KL), frac_reward_zero_std (groups
whose penalised rewards have zero std), rewards/<name>/mean|std; entropy; clip_ratio/low_mean, low_min, high_mean,
high_max, region_mean (over sequences).

Tests: pytest tests/test_rloo.py (against TRL's own code on fixed rewards and log-probs)
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from .advantages import ADVANTAGE_EPS, _group_std, _nanmean, _nanstd, _nansum, combine_rewards

__all__ = ["rloo_advantages", "rloo_loss"]


def rloo_advantages(
    rewards_per_func: mx.array,
    num_generations: int,
    *,
    reward_weights: Sequence[float] | None = None,
    kl: mx.array | None = None,
    beta: float = 0.0,
    reward_clip_range: Sequence[float] | None = None,
    normalize_advantages: bool = False,
    reward_names: Sequence[str] | None = None,
) -> tuple[mx.array, dict[str, mx.array]]:
    """The round's advantages [N] and reward metrics (module docstring). rewards_per_func [N, F] (NaN: None);
    kl [N] each sequence's summed log-ratio to the reference (used when beta != 0)."""
    rewards_per_func = rewards_per_func.astype(mx.float32)
    raw = combine_rewards(rewards_per_func, reward_weights)
    nan = mx.isnan(raw)
    rewards = raw
    if reward_clip_range:
        lo, hi = (float(v) for v in reward_clip_range)
        rewards = mx.where(nan, float("nan"), mx.clip(rewards, lo, hi))
    if beta != 0.0:
        if kl is None:
            raise ValueError("beta != 0 needs each sequence's KL to the reference")
        rewards = rewards - beta * kl.astype(mx.float32)
    g = int(num_generations)
    grouped = rewards.reshape(-1, g)
    if g > 1:
        count = (~mx.isnan(grouped)).sum(axis=1, keepdims=True).astype(mx.float32)
        baselines = (_nansum(grouped, axis=1)[:, None] - grouped) / (count - 1)
        advantages = rewards - baselines.reshape(-1)
    else:
        advantages = mx.zeros_like(rewards)
    if normalize_advantages:
        advantages = (advantages - _nanmean(advantages)) / (_nanstd(advantages) + ADVANTAGE_EPS)
    advantages = mx.nan_to_num(advantages, nan=0.0)
    std = _group_std(rewards, g)
    metrics = {"reward": _nanmean(raw), "reward_std": _nanstd(raw),
               "frac_reward_zero_std": mx.isclose(std, mx.zeros_like(std)).astype(mx.float32).mean()}
    names = list(reward_names) if reward_names is not None else [str(k) for k in range(rewards_per_func.shape[1])]
    for k, name in enumerate(names):
        metrics[f"rewards/{name}/mean"] = _nanmean(rewards_per_func[:, k])
        metrics[f"rewards/{name}/std"] = _nanstd(rewards_per_func[:, k])
    return advantages, metrics


def rloo_loss(
    logps: mx.array,
    old_logps: mx.array | None,
    advantages: mx.array,
    completion_mask: mx.array,
    *,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    entropy: mx.array | None = None,
) -> tuple[mx.array, dict[str, mx.array]]:
    """One micro-batch's loss (module docstring): logps / old_logps / completion_mask / entropy [B, T] per token
    (old_logps None: the detached current ones, ratio 1), advantages [B]."""
    mask = completion_mask.astype(mx.float32)
    seq = (logps.astype(mx.float32) * mask).sum(axis=1)
    old = mx.stop_gradient(seq) if old_logps is None else (old_logps.astype(mx.float32) * mask).sum(axis=1)
    adv = advantages.astype(mx.float32).reshape(-1)
    low, high = 1.0 - epsilon, 1.0 + (epsilon if epsilon_high is None else epsilon_high)
    ratio = mx.exp(seq - old)
    per_seq = -mx.minimum(ratio * adv, mx.clip(ratio, low, high) * adv)
    loss = per_seq.mean()
    r = mx.stop_gradient(ratio)
    is_low = ((r < low) & (adv < 0)).astype(mx.float32)
    is_high = ((r > high) & (adv > 0)).astype(mx.float32)
    metrics = {"clip_ratio/low_mean": is_low.mean(), "clip_ratio/low_min": is_low.min(),
               "clip_ratio/high_mean": is_high.mean(), "clip_ratio/high_max": is_high.max(),
               "clip_ratio/region_mean": mx.maximum(is_low, is_high).mean()}
    if entropy is not None:
        metrics["entropy"] = (mx.stop_gradient(entropy).astype(mx.float32) * mask).sum() / mx.maximum(mask.sum(), 1.0)
    return loss, metrics
