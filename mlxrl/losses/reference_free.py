"""Reference-free preference losses, as trl.experimental (TRL 1.16) defines them: ORPO's odds-ratio loss and CPO's
family (sigmoid, hinge, ipo, simpo, AlphaPO's reward shape). Pure MLX functions of the policy's per-sequence
log-probs of the chosen and rejected answers ([B] each) and the chosen answers' NLL (a scalar), returning
(loss, metrics) with TRL's metric names. The caller decides what the log-probs are, as TRL's trainers do:

* ORPO: the mean log-prob per completion token of each answer; its NLL the token mean over the chosen rows'
  every token, prompt included (`ORPOTrainer.concatenated_forward`);
* CPO: token sums (sigmoid, hinge) or means (ipo, simpo); its NLL the token mean over the chosen completions,
  weighted by `cpo_alpha` (0: no NLL term, logged as 0).

    ORPO:  loss = nll - mean(beta * log sigmoid(log_odds)),
           log_odds = (c - r) - (log(1 - e^c) - log(1 - e^r))
    CPO:   loss = mean(l(c, r)) + cpo_alpha * nll, with d = c - r (or AlphaPO's transformed rewards'
           difference, r(p) = (1 - p^-alpha) / alpha):
             sigmoid  -(1 - ls) log s(beta d) - ls log s(-beta d)
             simpo    the same with d - simpo_gamma / beta
             hinge    relu(1 - beta d)
             ipo      (d - 1 / (2 beta))^2

Tests: pytest tests/test_reference_free_losses.py (against trl.experimental's own methods).
"""

from __future__ import annotations

import math

import mlx.core as mx

__all__ = ["CPO_LOSSES", "cpo_loss", "cpo_averages", "log1mexp", "orpo_loss"]

CPO_LOSSES = ("sigmoid", "hinge", "ipo", "simpo")


def _logsigmoid(x: mx.array) -> mx.array:
    return -mx.logaddexp(mx.zeros_like(x), -x)


def log1mexp(x: mx.array) -> mx.array:
    """log(1 - e^x) for x <= 0, branching at -log 2 where each form loses least (Maechler's rule, as TRL)."""
    return mx.where(x < -math.log(2.0), mx.log1p(-mx.exp(x)), mx.log(-mx.expm1(x)))


def _reward_metrics(chosen_rewards: mx.array, rejected_rewards: mx.array, chosen_logps: mx.array,
                    rejected_logps: mx.array, nll: mx.array) -> dict:
    cr, rr = mx.stop_gradient(chosen_rewards), mx.stop_gradient(rejected_rewards)
    return {"rewards/chosen": cr.mean(), "rewards/rejected": rr.mean(),
            "rewards/accuracies": (cr > rr).astype(mx.float32).mean(), "rewards/margins": (cr - rr).mean(),
            "logps/chosen": mx.stop_gradient(chosen_logps).mean(),
            "logps/rejected": mx.stop_gradient(rejected_logps).mean(), "nll_loss": mx.stop_gradient(nll)}


def orpo_loss(chosen_logps: mx.array, rejected_logps: mx.array, nll: mx.array, *, beta: float
              ) -> tuple[mx.array, dict]:
    """ORPO (Hong et al. 2024): the chosen answers' NLL minus beta times the mean log-sigmoid of the log odds
    ratio. chosen_logps / rejected_logps: mean completion log-probs per token [B]; nll: the chosen rows' mean
    token NLL. Metrics: rewards/* (beta x the mean log-probs), logps/*, nll_loss, log_odds_ratio (the mean
    log-sigmoid), log_odds_chosen (the mean log odds ratio)."""
    c, r = chosen_logps.astype(mx.float32), rejected_logps.astype(mx.float32)
    log_odds = (c - r) - (log1mexp(c) - log1mexp(r))
    ratio = _logsigmoid(log_odds)
    loss = nll - (beta * ratio).mean()
    metrics = _reward_metrics(beta * c, beta * r, c, r, nll)
    metrics["log_odds_ratio"] = mx.stop_gradient(ratio).mean()
    metrics["log_odds_chosen"] = mx.stop_gradient(log_odds).mean()
    return loss, metrics


def cpo_averages(loss_type: str) -> bool:
    """Whether CPO's loss type scores answers by their mean token log-prob (ipo, simpo) rather than the sum."""
    return loss_type in ("ipo", "simpo")


def cpo_loss(chosen_logps: mx.array, rejected_logps: mx.array, nll: mx.array, *, loss_type: str = "sigmoid",
             beta: float = 0.1, label_smoothing: float = 0.0, simpo_gamma: float = 0.5, cpo_alpha: float = 1.0,
             alpha: float = 0.0) -> tuple[mx.array, dict]:
    """CPO (Xu et al. 2024) and its variants (module docstring). chosen_logps / rejected_logps: [B], sums or
    means per `cpo_averages(loss_type)`; nll: the chosen completions' mean token NLL (ignored when cpo_alpha is
    0, and logged as 0 then, as TRL does). alpha != 0: AlphaPO's reward r = (1 - p^-alpha) / alpha of p =
    e^logp, for the loss and the logged rewards. Metrics: rewards/*, logps/*, nll_loss."""
    if loss_type not in CPO_LOSSES:
        raise ValueError(f"unknown CPO loss_type {loss_type!r}; valid: {', '.join(CPO_LOSSES)} (alphapo: simpo "
                         "with cpo_alpha 0)")
    c, r = chosen_logps.astype(mx.float32), rejected_logps.astype(mx.float32)
    if alpha != 0.0:
        rc, rr = (1 - mx.exp(-alpha * c)) / alpha, (1 - mx.exp(-alpha * r)) / alpha
    else:
        rc, rr = c, r
    d = rc - rr
    if loss_type in ("sigmoid", "simpo"):
        if loss_type == "simpo":
            d = d - simpo_gamma / beta
        losses = -_logsigmoid(beta * d) * (1 - label_smoothing) - _logsigmoid(-beta * d) * label_smoothing
    elif loss_type == "hinge":
        losses = mx.maximum(1 - beta * d, 0.0)
    else:  # ipo
        losses = (d - 1 / (2 * beta)) ** 2
    nll = nll if cpo_alpha != 0 else mx.zeros((), mx.float32)
    loss = losses.mean() + cpo_alpha * nll
    return loss, _reward_metrics(beta * rc, beta * rr, c, r, nll)
