"""GRPO family losses and group-relative advantages, as pure MLX array functions (TRL 1.16 semantics).

Arrays in, ``(value, metrics)`` out; metrics are lazy ``mx.array`` scalars under TRL's names, evaluated by the
engine once per step. All math is float32. Nothing here calls ``.item()``, so ``grpo_loss`` can sit inside
``mx.compile``.

Notation: ``B`` completions in the micro-batch (``B = prompts * G``), ``T`` completion length, ``m`` the
completion mask, ``A`` advantages, ``logp`` / ``logp_old`` / ``logp_ref`` per-token log-probs of the sampled
tokens under the policy, the policy that sampled (or was current at generation time), and the reference.

Run the tests: ``pytest tests/test_grpo_losses.py``.
"""

from __future__ import annotations

import math

import mlx.core as mx

from .advantages import (  # noqa: F401  (part of losses.grpo's API)
    ADVANTAGE_EPS,
    combine_rewards,
    compute_advantages,
    group_advantages,
    nanmax,
    nanmin,
    rewards_to_array,
)

# Loss types whose micro-batch loss is a token SUM divided by a caller-supplied token count (`normalizer`).
# The engine should pass the active-token count of the whole accumulation window and SUM micro-batch losses.
# Every other loss type is a per-micro-batch mean that the engine AVERAGES over accumulation steps
# (TRL divides those by `gradient_accumulation_steps`).
TOKEN_SUM_LOSS_TYPES = frozenset({"dapo", "cispo", "vespo"})
# Loss types whose per-token loss depends on the whole sequence's log-probs (not token-separable: no fused head)
SEQUENCE_COUPLED_LOSS_TYPES = frozenset({"vespo"})


# ------------------------------------------------------------------------------------------ policy-loss pieces


def token_log_importance_weights(log_ratio: mx.array, mask: mx.array) -> mx.array:
    """log w_t = logp_t - logp_old_t, one weight per token: ``[B, T]``."""
    return log_ratio


def sequence_log_importance_weights(log_ratio: mx.array, mask: mx.array) -> mx.array:
    """GSPO: log w = sum_t m_t (logp_t - logp_old_t) / max(sum_t m_t, 1), one weight per sequence: ``[B, 1]``."""
    return (log_ratio * mask).sum(-1, keepdims=True) / mx.maximum(mask.sum(-1, keepdims=True), 1.0)


IMPORTANCE_SAMPLING_LEVELS = {"token": token_log_importance_weights, "sequence": sequence_log_importance_weights}


def k3_kl(logps: mx.array, ref_logps: mx.array) -> mx.array:
    """Per-token k3 estimator of KL(pi || pi_ref): exp(logp_ref - logp) - (logp_ref - logp) - 1  (>= 0)."""
    d = ref_logps - logps
    return mx.exp(d) - d - 1.0


def clipped_surrogate(coef_1, advantages, logps, *, epsilon_low, epsilon_high, delta=None, **_):
    """PPO clipped surrogate (grpo / bnpo / dr_grpo / dapo / luspo).

        r'   = min(r, delta)   if delta is set (INTELLECT-2 two-sided clip), else r
        loss = -min(r' A, clip(r, 1 - eps_low, 1 + eps_high) A)

    Returns the per-token loss and r' (TRL computes the clip metrics from the delta-clamped ratio).
    """
    coef_2 = mx.clip(coef_1, 1.0 - epsilon_low, 1.0 + epsilon_high)
    if delta is not None:
        coef_1 = mx.minimum(coef_1, delta)
    return -mx.minimum(coef_1 * advantages, coef_2 * advantages), coef_1


def cispo_surrogate(coef_1, advantages, logps, *, epsilon_high, **_):
    """CISPO (MiniMax-M1): loss = -sg(min(r, eps_high)) A logp. Note eps_high is the absolute cap on r, not 1 + eps."""
    return -mx.stop_gradient(mx.minimum(coef_1, epsilon_high)) * advantages * logps, coef_1


def sapo_surrogate(coef_1, advantages, logps, *, sapo_temperature_pos=1.0, sapo_temperature_neg=1.05, **_):
    """SAPO soft gate: loss = -sigmoid(tau (r - 1)) * 4 / tau * A, tau = tau_pos if A > 0 else tau_neg."""
    tau = mx.where(advantages > 0, sapo_temperature_pos, sapo_temperature_neg)
    return -mx.sigmoid(tau * (coef_1 - 1.0)) * 4.0 / tau * advantages, coef_1


VESPO_LOG_MIN = math.log(1e-8)  # TRL's (the original implementation's) lower clamp of log w


def vespo_surrogate(coef_1, advantages, logps, *, log_ratio, mask, vespo_k_pos=2.0, vespo_lambda_pos=3.0,
                    vespo_k_neg=3.0, vespo_lambda_neg=2.0, **_):
    """VESPO (variational sequence-level soft policy optimisation): a smooth, asymmetric Gamma weight of the
    sequence's importance ratio w = exp(sum_t m_t clip(logp_t - logp_old_t, -20, 20)), log w clipped to
    [log 1e-8, 20], instead of clipping:

        phi(w) = exp(lambda + k log w - lambda w)     (phi(1) = 1; k, lambda: the _pos pair for A >= 0, else _neg)
        loss   = -sg(phi) A logp                       per token

    Returns the per-token loss and phi [B, 1] (its metric)."""
    seq = (mx.clip(log_ratio, -20.0, 20.0) * mask).sum(-1, keepdims=True)
    log_w = mx.clip(seq, VESPO_LOG_MIN, 20.0)
    pos = advantages >= 0
    k = mx.where(pos, vespo_k_pos, vespo_k_neg)
    lam = mx.maximum(mx.where(pos, vespo_lambda_pos, vespo_lambda_neg), 1e-4)
    phi = mx.exp(lam + k * log_w - lam * mx.exp(log_w))
    phi = mx.stop_gradient(mx.nan_to_num(phi, nan=0.0, posinf=0.0, neginf=0.0))
    return -phi * advantages * logps, phi


# ------------------------------------------------------------------------------------------------ aggregations


def grpo_aggregate(per_token_loss, mask, **_):
    """grpo / sapo: mean over each sequence's tokens, then over sequences: mean_i [sum_t m l / max(sum_t m, 1)]."""
    return ((per_token_loss * mask).sum(-1) / mx.maximum(mask.sum(-1), 1.0)).mean()


def bnpo_aggregate(per_token_loss, mask, **_):
    """bnpo: sum_it m l / max(sum_it m, 1) over the local micro-batch."""
    return (per_token_loss * mask).sum() / mx.maximum(mask.sum(), 1.0)


def dr_grpo_aggregate(per_token_loss, mask, *, max_completion_length=None, **_):
    """dr_grpo: sum_it m l / (B * max_completion_length); the constant defaults to the padded length T."""
    length = mask.shape[1] if max_completion_length is None else max_completion_length
    return (per_token_loss * mask).sum() / (mask.shape[0] * length)


def token_sum_aggregate(per_token_loss, mask, *, normalizer=None, **_):
    """dapo / cispo: sum_it m l / N, N = active tokens of the global accumulated batch (default: this micro-batch)."""
    if normalizer is None:
        normalizer = mx.maximum(mask.sum(), 1.0)
    return (per_token_loss * mask).sum() / normalizer


def luspo_aggregate(per_token_loss, mask, **_):
    """luspo: each sequence's token sum, averaged over sequences: mean_i sum_t m l (length-scaled GSPO)."""
    return (per_token_loss * mask).sum(-1).mean()


# loss_type -> (per-token surrogate, aggregation, clip-metric family)
LOSS_TYPES = {
    "grpo": (clipped_surrogate, grpo_aggregate, "clip"),
    "bnpo": (clipped_surrogate, bnpo_aggregate, "clip"),
    "dr_grpo": (clipped_surrogate, dr_grpo_aggregate, "clip"),
    "dapo": (clipped_surrogate, token_sum_aggregate, "clip"),
    "luspo": (clipped_surrogate, luspo_aggregate, "clip"),
    "cispo": (cispo_surrogate, token_sum_aggregate, "cispo"),
    "sapo": (sapo_surrogate, grpo_aggregate, None),
    "vespo": (vespo_surrogate, token_sum_aggregate, "vespo"),
}


# ------------------------------------------------------------------------------------------------------ metrics


def _global_masked_mean(x: mx.array, mask: mx.array) -> mx.array:
    """TRL's logged mean: over active tokens, or over sequences for a sequence-level ``[B, 1]`` quantity."""
    if x.shape[1] == 1:
        return x.sum() / max(x.shape[0], 1)
    return (x * mask).sum() / mx.maximum(mask.sum(), 1.0)


def _masked_seq_mean(x: mx.array, mask: mx.array) -> mx.array:  # [B]; NaN for an empty row (skipped by nanmin/max)
    if x.shape[1] == 1:
        return x[:, 0]
    return (x * mask).sum(-1) / mask.sum(-1)


def _clip_metrics(ratio, advantages, mask, *, epsilon_low, epsilon_high, **_):
    low = ((ratio < 1.0 - epsilon_low) & (advantages < 0)).astype(mx.float32)
    high = ((ratio > 1.0 + epsilon_high) & (advantages > 0)).astype(mx.float32)
    region = mx.maximum(low, high)
    return {
        "clip_ratio/low_mean": _global_masked_mean(low, mask),
        "clip_ratio/high_mean": _global_masked_mean(high, mask),
        "clip_ratio/region_mean": _global_masked_mean(region, mask),
        "clip_ratio/low_min": nanmin(_masked_seq_mean(low, mask)),
        "clip_ratio/high_max": nanmax(_masked_seq_mean(high, mask)),
    }


def _cispo_metrics(ratio, advantages, mask, *, epsilon_high, **_):
    clipped = ((ratio > epsilon_high) & (advantages > 0)).astype(mx.float32)
    return {"cispo_clip_ratio": _global_masked_mean(clipped, mask)}


def _vespo_metrics(phi, advantages, mask, **_):
    return {"vespo/phi_seq_mean": _global_masked_mean(phi, mask)}


_CLIP_METRICS = {"clip": _clip_metrics, "cispo": _cispo_metrics, "vespo": _vespo_metrics, None: lambda *a, **k: {}}


# --------------------------------------------------------------------------------------------------- the loss


def _loss_type(loss_type: str):
    """(surrogate, aggregation, clip-metric family) of a loss type, or a ValueError naming the choices."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {sorted(LOSS_TYPES)}, got {loss_type!r}")
    return LOSS_TYPES[loss_type]


def _clip_args(epsilon, epsilon_high, delta, sapo_temperature_pos, sapo_temperature_neg, **vespo) -> dict:
    return {"epsilon_low": epsilon, "epsilon_high": epsilon if epsilon_high is None else epsilon_high,
            "delta": delta, "sapo_temperature_pos": sapo_temperature_pos,
            "sapo_temperature_neg": sapo_temperature_neg, **vespo}


def _per_token(log_w, logps, ref_logps, advantages, surrogate, clip, beta, use_bias_correction_kl, log_ratio=None,
               mask=None):
    """Per-token loss (surrogate + beta * KL), the ratio for the clip metrics (phi for vespo), and the KL (or
    None). log_ratio / mask: the per-token log-ratio and the mask, for vespo's sequence weight."""
    coef_1 = mx.exp(log_w)
    per_token_loss, ratio = surrogate(coef_1, advantages, logps, log_ratio=log_ratio, mask=mask, **clip)
    kl = None
    if beta != 0.0:
        kl = k3_kl(logps, ref_logps.astype(mx.float32))
        if use_bias_correction_kl:
            kl = kl * coef_1
        per_token_loss = per_token_loss + beta * kl
    return per_token_loss, ratio, kl


def grpo_loss(
    logps: mx.array,
    old_logps: mx.array | None,
    ref_logps: mx.array | None,
    advantages: mx.array,
    completion_mask: mx.array,
    *,
    loss_type: str = "dapo",
    beta: float = 0.0,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    delta: float | None = None,
    importance_sampling_level: str = "token",
    max_completion_length: int | None = None,
    normalizer: mx.array | float | None = None,
    use_bias_correction_kl: bool = True,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    vespo_k_pos: float = 2.0,
    vespo_lambda_pos: float = 3.0,
    vespo_k_neg: float = 3.0,
    vespo_lambda_neg: float = 2.0,
    entropy: mx.array | None = None,
) -> tuple[mx.array, dict[str, mx.array]]:
    """GRPO-family policy loss for one micro-batch (TRL 1.16 ``GRPOTrainer._compute_loss``).

    Shapes: ``logps``, ``old_logps``, ``ref_logps``, ``completion_mask``, ``entropy`` ``[B, T]``; ``advantages``
    ``[B]`` (or ``[B, T]``). ``old_logps=None`` means on-policy: ``logp_old = stop_gradient(logp)``, so r = 1 with
    gradient A * grad(logp) (what TRL does when num_iterations == 1 and generation is aligned with the step).

        log r = logp - logp_old                       per token  [B, T]       importance_sampling_level="token"
              = masked mean of it over the sequence   broadcast  [B, 1]       "sequence" (GSPO)
        l     = surrogate(r, A, logp)                 per loss_type (clipped / cispo / sapo / vespo's Gamma weight of
                                                      the sequence's ratio, `vespo_surrogate`)
        KL    = exp(logp_ref - logp) - (logp_ref - logp) - 1,  times r if use_bias_correction_kl (TRL default)
        l     = l + beta * KL                         when beta != 0
        loss  = aggregate(l, m)                       grpo/sapo: per-sequence mean, then mean; bnpo: token mean;
                                                      dr_grpo: sum / (B * max_completion_length);
                                                      dapo/cispo/vespo: sum / normalizer; luspo: per-sequence
                                                      sum, mean

    ``epsilon_high`` defaults to ``epsilon``; for cispo it is the absolute cap on r (TRL recommends 5.0).
    ``normalizer`` (dapo/cispo only): the active-token count of the whole accumulation window, so that summing
    micro-batch losses gives TRL's loss; TRL uses ``num_items_in_batch / num_processes * grad_accum /
    steps_per_generation``. Default: this micro-batch's ``max(sum m, 1)``. The other loss types are micro-batch
    means; the engine divides them by the number of accumulation steps (TRL does the same).

    Metrics (TRL's names): ``kl`` (beta != 0), ``entropy`` (when given), ``clip_ratio/low_mean``,
    ``clip_ratio/high_mean``, ``clip_ratio/region_mean``, ``clip_ratio/low_min``, ``clip_ratio/high_max``
    (clipped types), ``cispo_clip_ratio`` (cispo), ``vespo/phi_seq_mean`` (vespo). Means are over active tokens,
    or over sequences for sequence-level ratios; low = r < 1 - eps_low with A < 0, high = r' > 1 + eps_high with
    A > 0 (r' is the delta-clamped ratio, as TRL).
    """
    surrogate, aggregate, metric_family = _loss_type(loss_type)
    if importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(f"importance_sampling_level must be 'token' or 'sequence', got {importance_sampling_level!r}")
    if normalizer is not None and loss_type not in TOKEN_SUM_LOSS_TYPES:
        raise ValueError(f"normalizer applies to {sorted(TOKEN_SUM_LOSS_TYPES)} only, not {loss_type!r}")
    if beta != 0.0 and ref_logps is None:
        raise ValueError("beta != 0 needs ref_logps")
    clip = _clip_args(epsilon, epsilon_high, delta, sapo_temperature_pos, sapo_temperature_neg,
                      vespo_k_pos=vespo_k_pos, vespo_lambda_pos=vespo_lambda_pos, vespo_k_neg=vespo_k_neg,
                      vespo_lambda_neg=vespo_lambda_neg)

    logps = logps.astype(mx.float32)
    mask = completion_mask.astype(mx.float32)
    old_logps = mx.stop_gradient(logps) if old_logps is None else old_logps.astype(mx.float32)
    advantages = advantages.astype(mx.float32)
    if advantages.ndim == 1:
        advantages = advantages[:, None]  # [B, 1]

    log_ratio = logps - old_logps
    log_w = IMPORTANCE_SAMPLING_LEVELS[importance_sampling_level](log_ratio, mask)  # [B, T] or [B, 1]
    per_token_loss, ratio, kl = _per_token(log_w, logps, ref_logps, advantages, surrogate, clip, beta,
                                           use_bias_correction_kl, log_ratio=log_ratio, mask=mask)

    metrics = {}
    if beta != 0.0:
        metrics["kl"] = _global_masked_mean(kl, mask)
    if entropy is not None:
        metrics["entropy"] = _global_masked_mean(entropy.astype(mx.float32), mask)
    metrics.update(_CLIP_METRICS[metric_family](ratio, advantages, mask, **clip))

    loss = aggregate(per_token_loss, mask, max_completion_length=max_completion_length, normalizer=normalizer)
    return loss, metrics


# ------------------------------------------------------------------- the token-separable form (fused LM head)


def grpo_token_loss(
    loss_type: str = "dapo",
    *,
    beta: float = 0.0,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    delta: float | None = None,
    on_policy: bool = False,
    use_bias_correction_kl: bool = True,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
):
    """Token-level GRPO's per-token loss as an elementwise callable `l(logp, old_logp, ref_logp, advantage)`,
    for `fused_head_loss(..., loss_type=l, token_weights=grpo_token_weights(...), token_args=(old, ref, A))`.

    With importance_sampling_level="token" every loss type is `sum_it w_it l(logp_it)` with weights that do
    not depend on logp (`grpo_token_weights`): the gradient w.r.t. each token's logp is known from that token
    alone, which is what lets the fused head do loss and gradients in one pass. on_policy: old = sg(logp)
    (`old_logp` is then ignored); `ref_logp` is ignored when beta == 0. Equals `grpo_loss` (tested).
    """
    if loss_type in SEQUENCE_COUPLED_LOSS_TYPES:
        raise ValueError(f"loss_type {loss_type!r} weighs each token by its whole sequence's ratio: it has no "
                         "token-separable form (use grpo_loss)")
    surrogate = _loss_type(loss_type)[0]
    clip = _clip_args(epsilon, epsilon_high, delta, sapo_temperature_pos, sapo_temperature_neg)

    def token_loss(logp, old_logp, ref_logp, advantage):
        old = mx.stop_gradient(logp) if on_policy else old_logp
        return _per_token(logp - old, logp, ref_logp, advantage, surrogate, clip, beta, use_bias_correction_kl)[0]

    return token_loss


def grpo_token_weights(
    completion_mask: mx.array,
    loss_type: str = "dapo",
    *,
    max_completion_length: int | None = None,
    normalizer: mx.array | float | None = None,
) -> mx.array:
    """Weights w [B, T] with `aggregate(l, mask) == sum(w * l)` for every per-token loss l: each loss type's
    aggregation is linear in l, so w is its gradient (taken at l = 0, from the aggregation itself)."""
    aggregate = _loss_type(loss_type)[1]
    mask = completion_mask.astype(mx.float32)
    return mx.grad(lambda lt: aggregate(lt, mask, max_completion_length=max_completion_length,
                                        normalizer=normalizer))(mx.zeros_like(mask))


def uses_fused_head(head_mode: str, importance_sampling_level: str, loss_type: str | None = None) -> bool:
    """Whether GRPO trains through the fused row-chunked head: head_mode "fused", or "auto" with
    token-level importance sampling and a token-separable loss type (a sequence-level ratio, or vespo's
    sequence weight, couples a sequence's tokens, which the row-chunked head cannot see together). Shared
    by the trainer and the memory planner."""
    return head_mode == "fused" or (head_mode == "auto" and importance_sampling_level == "token"
                                    and loss_type not in SEQUENCE_COUPLED_LOSS_TYPES)
