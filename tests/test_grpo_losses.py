"""GRPO losses and advantages vs TRL 1.16.

The loss reference is TRL's own ``GRPOTrainer._compute_loss`` called on a stub trainer whose model forward returns
fixed log-probs (no model, no accelerate state). The advantage reference is written here with plain loops in numpy.

    pytest tests/test_grpo_losses.py
"""

from collections import defaultdict
from types import SimpleNamespace

import numpy as np
import pytest

# isort: off
import mlxrl  # noqa: F401  (fast BLAS before mlx.core)
import mlx.core as mx

# isort: on
from mlxrl.losses.grpo import (
    TOKEN_SUM_LOSS_TYPES,
    combine_rewards,
    compute_advantages,
    group_advantages,
    grpo_loss,
    grpo_token_loss,
    grpo_token_weights,
    k3_kl,
    rewards_to_array,
)

torch = pytest.importorskip("torch")
GRPOTrainer = pytest.importorskip("trl.trainer.grpo_trainer").GRPOTrainer

B, T = 6, 7
LENGTHS = [7, 5, 3, 1, 0, 6]  # ragged, with one fully masked completion (e.g. mask_truncated_completions)


def _inputs(seed=0):
    g = np.random.default_rng(seed)
    logps = -np.abs(g.normal(size=(B, T))) - 0.05
    old = logps + 0.5 * g.normal(size=(B, T))  # ratios spread well past the clip range
    ref = logps + 0.3 * g.normal(size=(B, T))
    adv = g.normal(size=(B,))
    mask = (np.arange(T)[None, :] < np.array(LENGTHS)[:, None]).astype(np.int64)
    entropy = np.abs(g.normal(size=(B, T)))
    f32 = dict(logps=logps, old=old, ref=ref, adv=adv, entropy=entropy)
    return {"mask": mask, **{k: v.astype(np.float32) for k, v in f32.items()}}


# vespo's Gamma weight: off TRL's defaults, so that the fields' plumbing is tested
VESPO = dict(vespo_k_pos=1.5, vespo_lambda_pos=2.5, vespo_k_neg=2.0, vespo_lambda_neg=1.5)


class _Accelerator:
    num_processes = 1

    def reduce(self, x, reduction="sum"):
        return x

    def gather(self, x):
        return x


def trl_loss(
    x,
    *,
    loss_type,
    beta,
    epsilon,
    epsilon_high,
    delta,
    level,
    max_completion_length=16,
    on_policy=False,
    use_bias_correction_kl=True,
    num_items_in_batch=None,
    grad_accum=1,
    steps_per_gen=1,
):
    """TRL's loss, metrics and d loss / d logps for the same inputs."""
    logps = torch.tensor(x["logps"], requires_grad=True)
    stub = SimpleNamespace(
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level=level,
        beta=beta,
        loss_type=loss_type,
        epsilon_low=epsilon,
        epsilon_high=epsilon_high,
        use_vllm=False,
        vllm_importance_sampling_correction=False,
        model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=grad_accum,
        max_completion_length=max_completion_length,
        accelerator=_Accelerator(),
        _entropy_bonus_enabled=False,
        aux_loss_enabled=False,
        _metrics=defaultdict(lambda: defaultdict(list)),
        args=SimpleNamespace(
            delta=delta,
            use_bias_correction_kl=use_bias_correction_kl,
            steps_per_generation=steps_per_gen,
            sapo_temperature_pos=1.0,
            sapo_temperature_neg=1.05,
            **VESPO,
        ),
        get_gamma_weights=GRPOTrainer.get_gamma_weights,
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, torch.tensor(x["entropy"]), None),
    )
    mask = torch.tensor(x["mask"])
    n_items = mask.sum() if num_items_in_batch is None else torch.tensor(float(num_items_in_batch))
    inputs = {
        "prompt_ids": torch.zeros(B, 2, dtype=torch.long),
        "prompt_mask": torch.ones(B, 2, dtype=torch.long),
        "completion_ids": torch.zeros(B, T, dtype=torch.long),
        "completion_mask": mask,
        "advantages": torch.tensor(x["adv"]),
        "num_items_in_batch": n_items,
        "ref_per_token_logps": torch.tensor(x["ref"]),
    }
    if not on_policy:
        inputs["old_per_token_logps"] = torch.tensor(x["old"])
    loss = GRPOTrainer._compute_loss(stub, None, inputs)
    loss.backward()  # populates logps.grad
    metrics = {k: float(np.mean(v)) for k, v in stub._metrics["train"].items()}
    return loss.item(), metrics, logps.grad.numpy()


def ours(x, *, on_policy=False, **kw):
    old = None if on_policy else mx.array(x["old"])
    args = (mx.array(x["ref"]), mx.array(x["adv"]), mx.array(x["mask"]))

    def f(logps):
        return grpo_loss(logps, old, *args, entropy=mx.array(x["entropy"]), **VESPO, **kw)

    (loss, metrics), grad = mx.value_and_grad(f)(mx.array(x["logps"]))
    return loss.item(), {k: v.item() for k, v in metrics.items()}, np.array(grad)


def _assert_same(mine, theirs, grad_atol=1e-5):
    (loss, metrics, grad), (t_loss, t_metrics, t_grad) = mine, theirs
    assert abs(loss - t_loss) <= 1e-5, (loss, t_loss)
    assert metrics.keys() == t_metrics.keys(), (sorted(metrics), sorted(t_metrics))
    for k in metrics:
        np.testing.assert_allclose(metrics[k], t_metrics[k], atol=1e-6, rtol=1e-6, err_msg=k)
    np.testing.assert_allclose(grad, t_grad, atol=grad_atol, rtol=1e-5)


LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "luspo", "sapo", "vespo"]
TOKEN_SEPARABLE = [t for t in LOSS_TYPES if t != "vespo"]


def _eps_high(loss_type):
    return 1.2 if loss_type == "cispo" else 0.28  # cispo's eps_high is an absolute cap on the ratio


@pytest.mark.parametrize("delta", [None, 1.5])
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_loss_metrics_and_grad_match_trl(loss_type, level, beta, delta):
    x = _inputs()
    common = dict(loss_type=loss_type, beta=beta, delta=delta)
    theirs = trl_loss(x, epsilon=0.2, epsilon_high=_eps_high(loss_type), level=level, **common)
    mine = ours(
        x,
        epsilon=0.2,
        epsilon_high=_eps_high(loss_type),
        importance_sampling_level=level,
        max_completion_length=16,
        **common,
    )
    _assert_same(mine, theirs)


@pytest.mark.parametrize("on_policy", [False, True])
@pytest.mark.parametrize("beta,delta", [(0.0, None), (0.04, 1.5)])
@pytest.mark.parametrize("loss_type", TOKEN_SEPARABLE)
def test_token_separable_form_matches_trl(loss_type, beta, delta, on_policy):
    """What the fused head computes: sum(w * l(logp, old, ref, A)) with w = grpo_token_weights and l =
    grpo_token_loss applied elementwise; loss and d loss / d logp against TRL's _compute_loss."""
    x = _inputs(7)
    kw = dict(loss_type=loss_type, beta=beta, epsilon=0.2, epsilon_high=_eps_high(loss_type), delta=delta)
    normalizer = 37.0 if loss_type in TOKEN_SUM_LOSS_TYPES else None
    extra = dict(num_items_in_batch=37) if normalizer else {}
    t_loss, _, t_grad = trl_loss(x, level="token", on_policy=on_policy, **kw, **extra)
    l_fn = grpo_token_loss(on_policy=on_policy, **kw)
    w = grpo_token_weights(mx.array(x["mask"]), loss_type, max_completion_length=16, normalizer=normalizer)
    adv = mx.broadcast_to(mx.array(x["adv"])[:, None], (B, T))
    old = mx.zeros((B, T)) if on_policy else mx.array(x["old"])

    def f(lp):
        return (w * l_fn(lp, old, mx.array(x["ref"]), adv)).sum()

    loss, grad = mx.value_and_grad(f)(mx.array(x["logps"]))
    assert abs(loss.item() - t_loss) <= 1e-5 * max(1.0, abs(t_loss)), (loss.item(), t_loss)
    np.testing.assert_allclose(np.array(grad), t_grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "loss_type,level,beta",
    [("dapo", "token", 0.04), ("grpo", "sequence", 0.04), ("cispo", "token", 0.0), ("bnpo", "sequence", 0.0)],
)
def test_on_policy_matches_trl(loss_type, level, beta):
    """old_logps=None: TRL uses logps.detach(), r == 1 but its gradient flows."""
    x = _inputs(1)
    theirs = trl_loss(
        x,
        loss_type=loss_type,
        beta=beta,
        epsilon=0.2,
        epsilon_high=_eps_high(loss_type),
        delta=None,
        level=level,
        on_policy=True,
    )
    mine = ours(
        x,
        on_policy=True,
        loss_type=loss_type,
        beta=beta,
        epsilon=0.2,
        epsilon_high=_eps_high(loss_type),
        importance_sampling_level=level,
    )
    _assert_same(mine, theirs)
    assert mine[1]["clip_ratio/region_mean" if loss_type != "cispo" else "cispo_clip_ratio"] == 0.0


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_edge_cases_match_trl(level):
    """delta below 1 + eps_high (TRL counts high clips on the delta-clamped ratio), and every scored token
    low-clipped (clip_ratio/low_min skips the empty completion rather than counting it as 0)."""
    x = _inputs(6)
    kw = dict(loss_type="dapo", beta=0.0, epsilon=0.2, epsilon_high=0.28)
    _assert_same(ours(x, importance_sampling_level=level, delta=1.1, **kw), trl_loss(x, level=level, delta=1.1, **kw))
    x = dict(x, old=x["logps"] + 1.0, adv=-np.abs(x["adv"]) - 0.1)
    mine = ours(x, importance_sampling_level=level, delta=None, **kw)
    _assert_same(mine, trl_loss(x, level=level, delta=None, **kw))
    # token level: the empty row's seq mean is NaN and skipped; sequence level: its ratio is exp(0) = 1, unclipped
    assert mine[1]["clip_ratio/low_min"] == (1.0 if level == "token" else 0.0)


def test_kl_without_bias_correction_matches_trl():
    x = _inputs(2)
    kw = dict(loss_type="dapo", beta=0.1, epsilon=0.2, delta=None)
    theirs = trl_loss(x, epsilon_high=0.28, level="token", use_bias_correction_kl=False, **kw)
    mine = ours(x, epsilon_high=0.28, importance_sampling_level="token", use_bias_correction_kl=False, **kw)
    _assert_same(mine, theirs)


@pytest.mark.parametrize("loss_type", sorted(TOKEN_SUM_LOSS_TYPES))
def test_global_normalizer_matches_trl_accumulation(loss_type):
    """dapo/cispo divide by the generation batch's token count (x grad_accum / steps_per_generation)."""
    x = _inputs(3)
    kw = dict(loss_type=loss_type, beta=0.0, epsilon=0.2, epsilon_high=_eps_high(loss_type), delta=None)
    theirs = trl_loss(x, level="token", num_items_in_batch=50, grad_accum=4, steps_per_gen=8, **kw)
    mine = ours(x, importance_sampling_level="token", normalizer=50 * 4 / 8, **kw)
    _assert_same(mine, theirs)


def test_mean_losses_are_divided_by_grad_accum_in_trl():
    """For the per-micro-batch means TRL divides by grad_accum itself; grpo_loss leaves that to the engine."""
    x = _inputs(4)
    kw = dict(loss_type="grpo", beta=0.0, epsilon=0.2, epsilon_high=0.28, delta=None)
    t_loss = trl_loss(x, level="token", grad_accum=4, **kw)[0]
    loss = ours(x, importance_sampling_level="token", **kw)[0]
    assert abs(loss / 4 - t_loss) <= 1e-6
    with pytest.raises(ValueError, match="normalizer"):
        grpo_loss(mx.zeros((1, 2)), None, None, mx.ones((1,)), mx.ones((1, 2)), loss_type="grpo", normalizer=2.0)


def test_hand_computed_values():
    """r = 1.5 on both tokens, A = 1, eps_high = 0.28: loss per token = -1.28; the mask drops the third token."""
    logps = mx.array([[np.log(1.5), np.log(1.5), -3.0]])
    loss, m = grpo_loss(logps, mx.zeros((1, 3)), None, mx.array([1.0]), mx.array([[1, 1, 0]]), epsilon_high=0.28)
    assert abs(loss.item() + 1.28) < 1e-6
    assert m["clip_ratio/high_mean"].item() == 1.0 and m["clip_ratio/low_mean"].item() == 0.0
    # delta caps the unclipped branch: r' = min(1.5, 1.1), A < 0 -> loss = -min(-1.1, -1.2) = 1.2
    loss, _ = grpo_loss(logps, mx.zeros((1, 3)), None, mx.array([-1.0]), mx.array([[1, 1, 0]]), delta=1.1)
    assert abs(loss.item() - 1.2) < 1e-6
    kl = k3_kl(mx.array([0.0]), mx.array([np.log(2.0)]))  # 2 - ln 2 - 1
    assert abs(kl.item() - (1.0 - np.log(2.0))) < 1e-6


def test_compiles():
    x = _inputs(5)
    args = [mx.array(x[k]) for k in ("logps", "old", "ref", "adv", "mask")]
    f = mx.compile(lambda *a: grpo_loss(*a, loss_type="dapo", beta=0.04, importance_sampling_level="sequence"))
    loss, metrics = f(*args)
    ref_loss, ref_metrics = grpo_loss(*args, beta=0.04, importance_sampling_level="sequence")
    assert abs(loss.item() - ref_loss.item()) < 1e-6 and metrics.keys() == ref_metrics.keys()


# ---------------------------------------------------------------------------------------------------- advantages


def _std1(values):
    v = [u for u in values if not np.isnan(u)]
    return float("nan") if len(v) < 2 else float(np.std(v, ddof=1))


def _mean(values):
    v = [u for u in values if not np.isnan(u)]
    return float("nan") if not v else sum(v) / len(v)


def _ref_combine(rpf, weights):
    out = []
    for row in rpf:
        valid = [(w, r) for w, r in zip(weights, row, strict=True) if not np.isnan(r)]
        out.append(sum(w * r for w, r in valid) if valid else float("nan"))
    return np.array(out)


def ref_advantages(rpf, G, weights, scale):
    """Written from TRL's description: group mean baseline, Bessel std (group or batch), + 1e-4, NaN -> 0."""
    rewards = _ref_combine(rpf, weights)
    adv, stds = np.zeros(len(rewards)), np.zeros(len(rewards))
    for start in range(0, len(rewards), G):
        grp = list(rewards[start : start + G])
        for i in range(start, start + G):
            stds[i] = _std1(rewards) if scale == "batch" else _std1(grp)
            a = rewards[i] - _mean(grp)
            if scale != "none":
                a = a / (stds[i] + 1e-4)
            adv[i] = 0.0 if np.isnan(a) else a
    metrics = {
        "reward": _mean(rewards),
        "reward_std": _std1(rewards),
        "frac_reward_zero_std": float(np.mean([abs(s) <= 1e-8 for s in stds])),
    }
    return adv, metrics


def ref_normalize_then_sum(rpf, G, weights):
    n, f = rpf.shape
    normed = np.full((n, f), np.nan)
    for start in range(0, n, G):
        for k in range(f):
            col = list(rpf[start : start + G, k])
            normed[start : start + G, k] = (rpf[start : start + G, k] - _mean(col)) / (_std1(col) + 1e-4)
    summed = np.array([sum(w * v for w, v in zip(weights, row, strict=True) if not np.isnan(v)) for row in normed])
    summed[np.isnan(rpf).all(1)] = np.nan  # only rows no function scored; a scored row of NaN z-scores sums to 0
    s = _std1(summed)
    adv = np.nan_to_num((summed - _mean(summed)) / (s + 1e-4), nan=0.0)
    rewards = _ref_combine(rpf, weights)
    return adv, {"reward": _mean(rewards), "reward_std": _std1(rewards), "frac_reward_zero_std": float(abs(s) <= 1e-8)}


G = 4
NAN = float("nan")
# 4 groups x 4 completions, 2 reward functions (None -> NaN):
# group 0 ordinary; group 1 zero std (all rewards equal); group 2 one completion unscorable (both None) and one
# with only the second function; group 3 has a single scored completion (std NaN -> advantages 0 when scaling).
# fmt: off
RPF = np.array([
    [1.0, 0.5], [0.0, 0.2], [2.0, 1.0], [0.5, 0.0],
    [1.0, 1.0], [1.0, 1.0], [1.0, 1.0], [1.0, 1.0],
    [0.3, 0.1], [NAN, NAN], [NAN, 0.7], [1.5, 0.2],
    [NAN, NAN], [0.8, NAN], [NAN, NAN], [NAN, NAN],
], dtype=np.float32)
# fmt: on


@pytest.mark.parametrize("weights", [None, [1.0, 0.5]])
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_match_reference(scale, weights):
    w = [1.0, 1.0] if weights is None else weights
    ref_adv, ref_metrics = ref_advantages(RPF.astype(np.float64), G, w, scale)
    adv, metrics = compute_advantages(
        mx.array(RPF), G, reward_weights=weights, scale_rewards=scale, reward_names=["acc", "fmt"]
    )
    np.testing.assert_allclose(np.array(adv), ref_adv, atol=1e-5, rtol=1e-5)
    for k, v in ref_metrics.items():
        np.testing.assert_allclose(metrics[k].item(), v, atol=1e-6, err_msg=k)
    for k, name in enumerate(["acc", "fmt"]):
        np.testing.assert_allclose(metrics[f"rewards/{name}/mean"].item(), _mean(RPF[:, k]), atol=1e-6)
        np.testing.assert_allclose(metrics[f"rewards/{name}/std"].item(), _std1(RPF[:, k]), atol=1e-6)
    assert np.all(np.array(adv)[[9, 12, 14, 15]] == 0.0)  # unscorable completions get no signal
    if scale != "batch":
        assert np.all(np.array(adv)[4:8] == 0.0)  # the zero-std group


def test_group_advantages_single_function():
    rewards = mx.array([1.0, 0.0, 1.0, 1.0, 3.0, 3.0])
    adv, m = group_advantages(rewards, 2, "group")
    s = np.std([1.0, 0.0], ddof=1)
    np.testing.assert_allclose(np.array(adv), [0.5 / (s + 1e-4), -0.5 / (s + 1e-4), 0, 0, 0, 0], rtol=1e-6)
    assert abs(m["frac_reward_zero_std"].item() - 4 / 6) < 1e-7


def test_normalize_then_sum_matches_reference():
    ref_adv, ref_metrics = ref_normalize_then_sum(RPF.astype(np.float64), G, [1.0, 0.5])
    adv, metrics = compute_advantages(
        mx.array(RPF), G, reward_weights=[1.0, 0.5], multi_objective_aggregation="normalize_then_sum"
    )
    np.testing.assert_allclose(np.array(adv), ref_adv, atol=1e-4, rtol=1e-5)
    for k, v in ref_metrics.items():
        np.testing.assert_allclose(metrics[k].item(), v, atol=1e-6, err_msg=k)


def test_rewards_to_array_and_combine():
    arr = rewards_to_array([[1.0, None, None], [2.0, 3.0, None]])  # 2 functions, 3 completions
    assert arr.shape == (3, 2)
    out = np.array(combine_rewards(arr, [0.5, 2.0]))
    np.testing.assert_allclose(out[:2], [4.5, 6.0])
    assert np.isnan(out[2])
