"""GRPO's group-relative advantages (TRL 1.16 semantics): rewards per function (None = NaN, skipped)
combined with weights, normalised per group or over the batch, or each function normalised before the
sum (GDPO); NaN-aware statistics for the metrics. Pure MLX array functions, float32.

Run the tests: ``pytest tests/test_grpo_losses.py``.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

ADVANTAGE_EPS = 1e-4  # TRL: advantages / (std + 1e-4)


# ----------------------------------------------------------------------------------------------- NaN-aware stats


def _nanmean(x: mx.array, axis=None, keepdims: bool = False) -> mx.array:
    valid = ~mx.isnan(x)
    total = mx.where(valid, x, 0.0).sum(axis=axis, keepdims=keepdims)
    return total / valid.sum(axis=axis, keepdims=keepdims).astype(mx.float32)


def _nanstd(x: mx.array, axis=None, keepdims: bool = False) -> mx.array:
    """Bessel-corrected std over non-NaN values; NaN where fewer than two values are present (as TRL's nanstd)."""
    mean = _nanmean(x, axis=axis, keepdims=True)
    var = _nanmean((x - mean) ** 2, axis=axis, keepdims=keepdims)
    count = (~mx.isnan(x)).sum(axis=axis, keepdims=keepdims).astype(mx.float32)
    correction = mx.where(count > 1, count / mx.maximum(count - 1, 1.0), float("nan"))
    return mx.sqrt(var * correction)


def _nansum(x: mx.array, axis=None) -> mx.array:
    return mx.where(mx.isnan(x), 0.0, x).sum(axis=axis)


def nanmin(x: mx.array) -> mx.array:
    nan = mx.isnan(x)
    return mx.where(nan.all(), float("nan"), mx.where(nan, float("inf"), x).min())


def nanmax(x: mx.array) -> mx.array:
    nan = mx.isnan(x)
    return mx.where(nan.all(), float("nan"), mx.where(nan, -float("inf"), x).max())


# ------------------------------------------------------------------------------------------------------ rewards


def rewards_to_array(per_func_rewards: Sequence[Sequence[float | None]]) -> mx.array:
    """Reward functions' outputs, one list per function (``None`` = could not score) -> ``[N, F]``, NaN for None."""
    cols = [[float("nan") if r is None else float(r) for r in rewards] for rewards in per_func_rewards]
    return mx.array(cols, dtype=mx.float32).T


def combine_rewards(rewards_per_func: mx.array, reward_weights: Sequence[float] | mx.array | None = None) -> mx.array:
    """Weighted sum over reward functions, ignoring NaN (unscored) entries.

        r_i = nansum_k w_k * R_ik,   r_i = NaN when every R_ik is NaN (the completion is unscorable)

    ``rewards_per_func`` ``[N, F]``; ``reward_weights`` ``[F]`` (default all 1.0). Returns ``[N]``.
    """
    rewards_per_func = rewards_per_func.astype(mx.float32)
    w = mx.ones((rewards_per_func.shape[1],)) if reward_weights is None else mx.array(reward_weights, dtype=mx.float32)
    unscorable = mx.isnan(rewards_per_func).all(axis=1)
    return mx.where(unscorable, float("nan"), _nansum(rewards_per_func * w, axis=1))


def _group_std(rewards: mx.array, num_generations: int) -> mx.array:  # [N], each group's std repeated
    if num_generations <= 1:
        return mx.zeros_like(rewards)
    std = _nanstd(rewards.reshape(-1, num_generations), axis=1, keepdims=True)
    return mx.broadcast_to(std, (std.shape[0], num_generations)).reshape(-1)


def _batch_std(rewards: mx.array, num_generations: int) -> mx.array:  # [N], the batch std repeated
    if rewards.size <= 1:
        return mx.zeros_like(rewards)
    return mx.broadcast_to(_nanstd(rewards), rewards.shape)


# scale_rewards -> (std used for the zero-std statistic, whether advantages are divided by it).
# "none" still computes the group std: TRL logs frac_reward_zero_std from it.
_SCALE_REWARDS = {"group": (_group_std, True), "batch": (_batch_std, True), "none": (_group_std, False)}


def _reward_metrics(rewards: mx.array, std: mx.array) -> dict[str, mx.array]:
    return {
        "reward": _nanmean(rewards),
        "reward_std": _nanstd(rewards),
        "frac_reward_zero_std": mx.isclose(std, mx.zeros_like(std)).astype(mx.float32).mean(),
    }


def group_advantages(
    rewards: mx.array, num_generations: int, scale_rewards: str = "group"
) -> tuple[mx.array, dict[str, mx.array]]:
    """Group-relative advantages (TRL's ``multi_objective_aggregation="sum_then_normalize"``).

    ``rewards`` ``[N = prompts * G]``, the G completions of a prompt contiguous; NaN = unscorable.

        mu_g   = nanmean of the group's rewards
        A_i    = r_i - mu_g                                 scale_rewards="none"
        A_i    = (r_i - mu_g) / (sigma + 1e-4)              sigma = group std ("group") or batch std ("batch")
        A_i    = 0 where A_i is NaN (unscorable completions, or a group with < 2 scored completions when scaling)

    sigma is Bessel-corrected over non-NaN values. Metrics: ``reward`` (nanmean), ``reward_std`` (nanstd over the
    batch), ``frac_reward_zero_std`` (fraction of completions whose sigma is ~0: group sigma for "group"/"none",
    the batch sigma for "batch").
    """
    if scale_rewards not in _SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {sorted(_SCALE_REWARDS)}, got {scale_rewards!r}")
    std_fn, divide = _SCALE_REWARDS[scale_rewards]
    rewards = rewards.astype(mx.float32).reshape(-1)
    grouped = rewards.reshape(-1, num_generations)  # [prompts, G]
    advantages = (grouped - _nanmean(grouped, axis=1, keepdims=True)).reshape(-1)
    std = std_fn(rewards, num_generations)
    if divide:
        advantages = advantages / (std + ADVANTAGE_EPS)
    return mx.nan_to_num(advantages, nan=0.0), _reward_metrics(rewards, std)


def _sum_then_normalize(rewards_per_func, num_generations, reward_weights, scale_rewards):
    return group_advantages(combine_rewards(rewards_per_func, reward_weights), num_generations, scale_rewards)


def _normalize_then_sum(rewards_per_func, num_generations, reward_weights, scale_rewards):
    """GDPO: normalise each reward function within its group, weighted-sum, then normalise over the batch.

    ``scale_rewards`` is not used (TRL ignores it here too); the logged reward is the raw weighted sum.
    """
    n, f = rewards_per_func.shape
    grouped = rewards_per_func.astype(mx.float32).reshape(-1, num_generations, f)
    mean_k = _nanmean(grouped, axis=1, keepdims=True)
    std_k = _nanstd(grouped, axis=1, keepdims=True) if num_generations > 1 else mx.zeros_like(mean_k)
    normalized = ((grouped - mean_k) / (std_k + ADVANTAGE_EPS)).reshape(n, f)
    w = mx.ones((f,)) if reward_weights is None else mx.array(reward_weights, dtype=mx.float32)
    # A scored row whose normalised values are all NaN (its group had < 2 scores) sums to 0, not NaN.
    summed = mx.where(mx.isnan(rewards_per_func).all(axis=1), float("nan"), _nansum(normalized * w, axis=1))
    std = _batch_std(summed, num_generations)
    advantages = mx.nan_to_num((summed - _nanmean(summed)) / (std + ADVANTAGE_EPS), nan=0.0)
    return advantages, _reward_metrics(combine_rewards(rewards_per_func, reward_weights), std)


_MULTI_OBJECTIVE = {"sum_then_normalize": _sum_then_normalize, "normalize_then_sum": _normalize_then_sum}


def compute_advantages(
    rewards_per_func: mx.array,
    num_generations: int,
    *,
    reward_weights: Sequence[float] | None = None,
    scale_rewards: str = "group",
    multi_objective_aggregation: str = "sum_then_normalize",
    reward_names: Sequence[str] | None = None,
) -> tuple[mx.array, dict[str, mx.array]]:
    """Advantages from several reward functions, as TRL's ``_generate_and_score_completions``.

    ``rewards_per_func`` ``[N, F]`` (NaN = that function returned None). Returns ``advantages [N]`` and the
    metrics ``reward``, ``reward_std``, ``frac_reward_zero_std`` and ``rewards/{name}/mean|std`` per function
    (nanmean / nanstd of its raw column).
    """
    if multi_objective_aggregation not in _MULTI_OBJECTIVE:
        raise ValueError(f"multi_objective_aggregation must be one of {sorted(_MULTI_OBJECTIVE)}")
    rewards_per_func = rewards_per_func.astype(mx.float32)
    names = list(reward_names) if reward_names is not None else [str(k) for k in range(rewards_per_func.shape[1])]
    if len(names) != rewards_per_func.shape[1]:
        raise ValueError(f"{len(names)} reward names for {rewards_per_func.shape[1]} reward functions")
    aggregate = _MULTI_OBJECTIVE[multi_objective_aggregation]
    advantages, metrics = aggregate(rewards_per_func, num_generations, reward_weights, scale_rewards)
    for k, name in enumerate(names):
        metrics[f"rewards/{name}/mean"] = _nanmean(rewards_per_func[:, k])
        metrics[f"rewards/{name}/std"] = _nanstd(rewards_per_func[:, k])
    return advantages, metrics
