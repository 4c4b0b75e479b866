"""DPO-family preference losses (TRL 1.16 `DPOConfig.loss_type` variants) as pure MLX functions.

Every variant takes the summed completion log-probs of the policy and of the reference model for
the chosen and rejected answers, four float arrays of shape [B], plus the hyper-parameters it
needs, and returns per-pair losses [B] in float32. Notation used in the docstrings:

    c  = policy_chosen   - ref_chosen        (chosen log-ratio)
    r  = policy_rejected - ref_rejected      (rejected log-ratio)
    d  = c - r                               (DPO margin, "delta score")
    ls = label_smoothing,  b = beta,  s(x) = sigmoid(x),  logs(x) = log sigmoid(x)

`dpo_loss` combines one or more variants the way TRL's `DPOTrainer` does,

    loss = sum_k  w_k * mean_b(loss_k[b] * pair_weights[b])

and returns TRL's metrics (rewards/*, logps/*). Semantics follow TRL 1.16:

* `ipo` and `sigmoid_norm` divide each log-ratio by its completion length (tokens scored, min 1):
  pass `chosen_token_counts` / `rejected_token_counts`; the log-probs stay token *sums*.
* `sft` is the token-level mean NLL over all chosen tokens of the batch, -sum_b pc_b / sum_b n_b
  (not a mean of per-sequence means), broadcast to [B] so it averages like the others.
* `sigmoid` with `label_smoothing` > 0 is conservative DPO (cDPO), as TRL < 1.0 did. TRL 1.16
  silently ignores `label_smoothing` for sigmoid (it only feeds robust, exo_pair, aot,
  aot_unpaired); we do not drop a flag the user set. With label_smoothing = 0 both agree.
* `bco_pair` has no running reward mean (TRL 1.16 dropped it): -logs(b c) - logs(-b r).
* `aot_pair` (older TRL name) is an alias of `aot_unpaired`.
* LD-DPO (`ld_alpha`) is applied by the caller when summing token log-probs; pass the unweighted
  chosen sum as `sft_chosen_logps` then, because TRL's sft term uses the raw token log-probs.

Tests: pytest tests/test_dpo_losses.py
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Callable, Sequence

import mlx.core as mx

Array = mx.array


def _logsigmoid(x: Array) -> Array:
    return -mx.logaddexp(mx.zeros_like(x), -x)  # stable for large |x|


def _ratios(pc: Array, pr: Array, rc: Array, rr: Array) -> tuple[Array, Array]:
    return pc - rc, pr - rr


def _per_token(x: Array, counts: Array) -> Array:
    return x / mx.maximum(counts.astype(mx.float32), 1.0)


# ---------------------------------------------------------------------------------------------
# One function per loss_type. Signature: (pc, pr, rc, rr, *, hyper-parameters) -> losses [B].
# ---------------------------------------------------------------------------------------------


def sigmoid_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, *, beta=0.1, label_smoothing=0.0):
    """DPO (Rafailov et al. 2023); with label_smoothing > 0 the conservative cDPO form.

    loss = -(1 - ls) logs(b d) - ls logs(-b d)
    """
    c, r = _ratios(policy_chosen, policy_rejected, ref_chosen, ref_rejected)
    logits = beta * (c - r)
    loss = -_logsigmoid(logits)
    if label_smoothing:
        loss = (1 - label_smoothing) * loss - label_smoothing * _logsigmoid(-logits)
    return loss


def hinge_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, *, beta=0.1):
    """SLiC hinge loss.

    loss = max(0, 1 - b d)
    """
    c, r = _ratios(policy_chosen, policy_rejected, ref_chosen, ref_rejected)
    return mx.maximum(1 - beta * (c - r), 0.0)


def ipo_loss(
    policy_chosen, policy_rejected, ref_chosen, ref_rejected, *, beta=0.1, chosen_token_counts, rejected_token_counts
):
    """IPO (Azar et al. 2023, Eq. 17), length-normalised as in TRL; beta plays the paper's tau.

        loss = (c / n_c - r / n_r - 1 / (2 b))^2,   n = max(completion tokens, 1)

    The log-probs are token sums; the counts are the completion tokens scored in each sequence.
    """
    c, r = _ratios(policy_chosen, policy_rejected, ref_chosen, ref_rejected)
    delta = _per_token(c, chosen_token_counts) - _per_token(r, rejected_token_counts)
    return (delta - 1 / (2 * beta)) ** 2


def sigmoid_norm_loss(
    policy_chosen, policy_rejected, ref_chosen, ref_rejected, *, beta=0.1, chosen_token_counts, rejected_token_counts
):
    """DPO on per-token (length-normalised) log-ratios.

    loss = -logs(b (c / n_c - r / n_r)),   n = max(completion tokens, 1)
    """
    c, r = _ratios(policy_chosen, policy_rejected, ref_chosen, ref_rejected)
    delta = _per_token(c, chosen_token_counts) - _per_token(r, rejected_token_counts)
    return -_logsigmoid(beta * delta)


def robust_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, *, beta=0.1, label_smoothing=0.0):
    """Robust DPO (Chowdhury et al. 2024); ls is the label-flip probability, in [0, 0.5).

    loss = (-(1 - ls) logs(b d) + ls logs(-b d)) / (1 - 2 ls)
    """
    c, r = _ratios(policy_chosen, policy_rejected, ref_chosen, ref_rejected)
    logits = beta * (c - r)
    clean = -(1 - label_smoothing) * _logsigmoid(logits)
    flipped = -label_smoothing * _logsigmoid(-logits)
    return (clean - flipped) / (1 - 2 * label_smoothing)


def exo_pair_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, *, beta=0.1, label_smoothing):
    """EXO-pref (Ji et al. 2024, Eq. 16): KL(q || p) with q = softmax over {chosen, rejected} of
    b * log-ratio and the smoothed target p = (1 - eps, eps), eps = label_smoothing > 0.

        loss = s(b d) (logs(b d) - log(1 - eps)) + s(-b d) (logs(-b d) - log eps)
    """
    if not label_smoothing > 0:
        raise ValueError(f"exo_pair needs label_smoothing > 0 (the paper recommends 1e-3), got {label_smoothing}")
    c, r = _ratios(policy_chosen, policy_rejected, ref_chosen, ref_rejected)
    logits = beta * (c - r)
    win = mx.sigmoid(logits) * (_logsigmoid(logits) - math.log1p(-label_smoothing))
    lose = mx.sigmoid(-logits) * (_logsigmoid(-logits) - math.log(label_smoothing))
    return win + lose


def nca_pair_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, *, beta=0.1):
    """NCA (Chen et al. 2024), pairwise.

    loss = -logs(b c) - 0.5 logs(-b c) - 0.5 logs(-b r)
    """
    c, r = _ratios(policy_chosen, policy_rejected, ref_chosen, ref_rejected)
    return -_logsigmoid(beta * c) - 0.5 * _logsigmoid(-beta * c) - 0.5 * _logsigmoid(-beta * r)


def bco_pair_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, *, beta=0.1):
    """BCO on pairs (Jung et al. 2024), TRL 1.16 form without a running reward-mean shift.

    loss = -logs(b c) - logs(-b r)
    """
    c, r = _ratios(policy_chosen, policy_rejected, ref_chosen, ref_rejected)
    return -_logsigmoid(beta * c) - _logsigmoid(-beta * r)


def sppo_hard_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, *, beta=0.1):
    """SPPO (Wu et al. 2024) with hard win probabilities (1 for chosen, 0 for rejected).

    loss = (c - 1 / (2 b))^2 + (r + 1 / (2 b))^2
    """
    c, r = _ratios(policy_chosen, policy_rejected, ref_chosen, ref_rejected)
    return (c - 0.5 / beta) ** 2 + (r + 0.5 / beta) ** 2


def _smoothed_logistic(delta: Array, beta: float, label_smoothing: float) -> Array:
    return -_logsigmoid(beta * delta) * (1 - label_smoothing) - _logsigmoid(-beta * delta) * label_smoothing


def aot_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, *, beta=0.1, label_smoothing=0.0):
    """AOT, paired (Melnyk et al. 2024): sorted policy margins against sorted reference margins.

        delta = sort_B(pc - pr) - sort_B(rc - rr)
        loss  = -(1 - ls) logs(b delta) - ls logs(-b delta)

    The sort runs over the batch, so loss[b] is not tied to pair b (and per-pair weights make no sense).
    """
    delta = mx.sort(policy_chosen - policy_rejected, axis=0) - mx.sort(ref_chosen - ref_rejected, axis=0)
    return _smoothed_logistic(delta, beta, label_smoothing)


def aot_unpaired_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, *, beta=0.1, label_smoothing=0.0):
    """AOT, unpaired (older TRL: `aot_pair`): sorted chosen log-ratios against sorted rejected ones.

    delta = sort_B(c) - sort_B(r)
    loss  = -(1 - ls) logs(b delta) - ls logs(-b delta)
    """
    c, r = _ratios(policy_chosen, policy_rejected, ref_chosen, ref_rejected)
    delta = mx.sort(c, axis=0) - mx.sort(r, axis=0)
    return _smoothed_logistic(delta, beta, label_smoothing)


def apo_zero_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, *, beta=0.1):
    """APO-zero (D'Oosterlinck et al. 2024, Eq. 7): raise chosen, lower rejected likelihood.

    loss = (1 - s(b c)) + s(b r)
    """
    c, r = _ratios(policy_chosen, policy_rejected, ref_chosen, ref_rejected)
    return (1 - mx.sigmoid(beta * c)) + mx.sigmoid(beta * r)


def apo_down_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, *, beta=0.1):
    """APO-down (D'Oosterlinck et al. 2024, Eq. 8): lower chosen, lower rejected more.

    loss = s(b c) + (1 - s(b (c - r)))
    """
    c, r = _ratios(policy_chosen, policy_rejected, ref_chosen, ref_rejected)
    return mx.sigmoid(beta * c) + (1 - mx.sigmoid(beta * (c - r)))


def discopop_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, *, beta=0.1, discopop_tau=0.05):
    """DiscoPOP / log-ratio modulated loss (Chris Lu et al. 2024, Eq. 5), x = b d.

    loss = -logs(x) (1 - s(x / tau)) + exp(-x) s(x / tau)
    """
    c, r = _ratios(policy_chosen, policy_rejected, ref_chosen, ref_rejected)
    logits = beta * (c - r)
    mix = mx.sigmoid(logits / discopop_tau)
    return -_logsigmoid(logits) * (1 - mix) + mx.exp(-logits) * mix


def sft_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, *, chosen_token_counts):
    """NLL of the chosen completions, averaged over all chosen tokens of the batch (as TRL).

        loss[b] = -sum_b' pc_b' / max(sum_b' n_b', 1)      (the same value for every b)

    policy_chosen holds token sums; chosen_token_counts the completion tokens of each chosen answer.
    """
    del policy_rejected, ref_chosen, ref_rejected
    total = mx.maximum(chosen_token_counts.astype(mx.float32).sum(), 1.0)
    return mx.broadcast_to(-policy_chosen.sum() / total, policy_chosen.shape)


DPO_LOSSES: dict[str, Callable[..., Array]] = {
    "sigmoid": sigmoid_loss,
    "hinge": hinge_loss,
    "ipo": ipo_loss,
    "exo_pair": exo_pair_loss,
    "nca_pair": nca_pair_loss,
    "robust": robust_loss,
    "bco_pair": bco_pair_loss,
    "sppo_hard": sppo_hard_loss,
    "aot": aot_loss,
    "aot_unpaired": aot_unpaired_loss,
    "aot_pair": aot_unpaired_loss,
    "apo_zero": apo_zero_loss,
    "apo_down": apo_down_loss,
    "discopop": discopop_loss,
    "sft": sft_loss,
    "sigmoid_norm": sigmoid_norm_loss,
}

# Losses of the chosen-rejected score difference: the only ones with an f-divergence form (TRL's set).
F_DIVERGENCE_LOSSES = frozenset({"sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop", "sft"})
F_DIVERGENCES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")
# TRL 1.16 applies label_smoothing to robust / exo_pair / aot* only: its `sigmoid` is plain DPO.
_SORTING = frozenset({"aot", "aot_unpaired", "aot_pair"})
_COUNTED = {"ipo": ("chosen", "rejected"), "sigmoid_norm": ("chosen", "rejected"), "sft": ("chosen",)}


def f_divergence_scores(logratios: Array, f_divergence_type: str = "reverse_kl", alpha: float = 0.5) -> Array:
    """f'(t) at t = pi / pi_ref = exp(logratio): the score f-DPO (Wang et al. 2023) puts in place of the log-ratio.

    reverse_kl: log t     forward_kl: 1 - 1/t     js_divergence: log 2 + logs(log t)
    alpha_divergence: (t^(alpha-1) - 1) / (alpha - 1), exponent clamped at 80 (log t when alpha = 1)
    """
    if f_divergence_type == "reverse_kl":
        return logratios
    if f_divergence_type == "forward_kl":
        return 1 - mx.exp(-logratios)
    if f_divergence_type == "js_divergence":
        return math.log(2) + _logsigmoid(logratios)
    if f_divergence_type == "alpha_divergence":
        if abs(alpha - 1.0) < 1e-6:
            return logratios
        return (mx.exp(mx.minimum((alpha - 1.0) * logratios, 80.0)) - 1.0) / (alpha - 1.0)
    raise ValueError(f"unknown f_divergence_type {f_divergence_type!r}; valid: {', '.join(F_DIVERGENCES)}")


def _check_vector(name: str, x, shape: tuple[int, ...]) -> Array:
    x = mx.array(x) if not isinstance(x, mx.array) else x
    if x.shape != shape:
        raise ValueError(f"{name} must have shape {shape} like policy_chosen, got {x.shape}")
    return x.astype(mx.float32)


def _kwargs_for(name: str, fn: Callable, hyper: dict) -> dict:
    params = inspect.signature(fn).parameters
    wanted = [k for k, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    return {k: hyper[k] for k in wanted}


def dpo_loss(
    policy_chosen: Array,
    policy_rejected: Array,
    ref_chosen: Array,
    ref_rejected: Array,
    *,
    loss_type: str | Sequence[str] = "sigmoid",
    loss_weights: Sequence[float] | None = None,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    discopop_tau: float = 0.05,
    f_divergence_type: str = "reverse_kl",
    f_alpha_divergence_coef: float = 0.5,
    chosen_token_counts: Array | None = None,
    rejected_token_counts: Array | None = None,
    sft_chosen_logps: Array | None = None,
    pair_weights: Array | None = None,
) -> tuple[Array, dict[str, Array]]:
    """TRL's DPO objective over one batch of pairs: a weighted sum of per-variant batch means.

        loss = sum_k  w_k * mean_b(L_k(pc, pr, rc, rr)[b] * pair_weights[b])

    Args: summed completion log-probs [B] (policy / reference, chosen / rejected); `loss_type` one
    name of `DPO_LOSSES` or a list (MPO-style mixes); `loss_weights` one float per loss type
    (default all 1). `chosen_token_counts` / `rejected_token_counts` [B]: completion tokens per
    answer, needed by ipo, sigmoid_norm (both) and sft (chosen). With `f_divergence_type` other
    than reverse_kl each log-ratio is replaced by `f_divergence_scores(...)` (only for
    `F_DIVERGENCE_LOSSES`). `sft_chosen_logps`: unweighted chosen sums for the sft term when the
    caller applied LD-DPO weighting to policy_chosen. `pair_weights` [B]: WPO-style weights
    (gradient stopped; not allowed with aot*).

    Returns (loss scalar float32, metrics): rewards/chosen = mean(b c), rewards/rejected = mean(b r),
    rewards/accuracies = mean(b c > b r), rewards/margins = mean(b (c - r)),
    logps/chosen = mean(pc), logps/rejected = mean(pr); all float32 scalars, gradient stopped.
    """
    types = [loss_type] if isinstance(loss_type, str) else list(loss_type)
    if not types:
        raise ValueError("loss_type must name at least one loss")
    unknown = [t for t in types if t not in DPO_LOSSES]
    if unknown:
        raise ValueError(f"unknown DPO loss_type {unknown}; valid: {', '.join(DPO_LOSSES)}")
    weights = [1.0] * len(types) if loss_weights is None else [float(w) for w in loss_weights]
    if len(weights) != len(types):
        raise ValueError(f"loss_weights has {len(weights)} weights for {len(types)} loss types {types}")

    if not isinstance(policy_chosen, mx.array) or policy_chosen.ndim != 1:
        raise ValueError(f"policy_chosen must be a 1-D [B] mx.array, got {getattr(policy_chosen, 'shape', None)}")
    shape = policy_chosen.shape
    pc = policy_chosen.astype(mx.float32)
    pr = _check_vector("policy_rejected", policy_rejected, shape)
    rc = _check_vector("ref_chosen", ref_chosen, shape)
    rr = _check_vector("ref_rejected", ref_rejected, shape)
    counts = {"chosen": chosen_token_counts, "rejected": rejected_token_counts}
    for t in types:
        for side in _COUNTED.get(t, ()):
            if counts[side] is None:
                raise ValueError(f"loss_type {t!r} needs {side}_token_counts (completion tokens per answer)")
    counts = {k: None if v is None else _check_vector(f"{k}_token_counts", v, shape) for k, v in counts.items()}
    if pair_weights is not None:
        if _SORTING & set(types):
            raise ValueError("pair_weights (WPO) cannot be used with aot losses: they sort the batch")
        pair_weights = mx.stop_gradient(_check_vector("pair_weights", pair_weights, shape))
    if f_divergence_type != "reverse_kl" and not set(types) <= F_DIVERGENCE_LOSSES:
        raise ValueError(
            f"f_divergence_type={f_divergence_type!r} supports only {sorted(F_DIVERGENCE_LOSSES)}, got {types}"
        )
    if "robust" in types and not 0.0 <= label_smoothing < 0.5:
        warnings.warn(f"robust DPO expects label_smoothing in [0, 0.5), got {label_smoothing}", stacklevel=2)
    if "exo_pair" in types and not label_smoothing > 0:
        raise ValueError(f"exo_pair needs label_smoothing > 0 (the paper recommends 1e-3), got {label_smoothing}")

    chosen_ratio, rejected_ratio = pc - rc, pr - rr
    if f_divergence_type == "reverse_kl":
        scored = (pc, pr, rc, rr)
    else:  # the score-difference losses see f'(t) as the "policy" side and a zero reference
        zeros = mx.zeros_like(pc)
        scored = (
            f_divergence_scores(chosen_ratio, f_divergence_type, f_alpha_divergence_coef),
            f_divergence_scores(rejected_ratio, f_divergence_type, f_alpha_divergence_coef),
            zeros,
            zeros,
        )
    raw = (pc if sft_chosen_logps is None else _check_vector("sft_chosen_logps", sft_chosen_logps, shape), pr, rc, rr)
    hyper = {
        "beta": beta,
        "label_smoothing": label_smoothing,
        "discopop_tau": discopop_tau,
        "chosen_token_counts": counts["chosen"],
        "rejected_token_counts": counts["rejected"],
    }

    loss = mx.array(0.0, dtype=mx.float32)
    for name, weight in zip(types, weights, strict=True):
        fn = DPO_LOSSES[name]
        per_pair = fn(*(raw if name == "sft" else scored), **_kwargs_for(name, fn, hyper))  # [B]
        if pair_weights is not None:
            per_pair = per_pair * pair_weights
        loss = loss + weight * per_pair.mean()

    chosen_rewards = beta * mx.stop_gradient(chosen_ratio)
    rejected_rewards = beta * mx.stop_gradient(rejected_ratio)
    metrics = {
        "rewards/chosen": chosen_rewards.mean(),
        "rewards/rejected": rejected_rewards.mean(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).astype(mx.float32).mean(),
        "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
        "logps/chosen": mx.stop_gradient(pc).mean(),
        "logps/rejected": mx.stop_gradient(pr).mean(),
    }
    return loss.astype(mx.float32), metrics
