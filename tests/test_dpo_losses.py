"""DPO loss variants against TRL 1.16's own `DPOTrainer._compute_loss`, run on a stand-in trainer.

TRL has no standalone loss callable: its losses live inside `_compute_loss`, which reads a few
trainer attributes and calls `model(...)` for per-token log-probs. `_trl_loss` gives it a
namespace with those attributes and a fake model that returns fixed per-token log-probs (zero
outside the completion mask), with `precompute_ref_logps=True` so the reference sums come from the
inputs. Gradients are taken w.r.t. those per-token log-probs; d loss / d token = d loss / d sum.

    pytest tests/test_dpo_losses.py
"""

import inspect
from collections import defaultdict
from types import SimpleNamespace

import numpy as np
import pytest

# isort: off
import mlxrl  # noqa: F401  (fast BLAS before mlx.core)
import mlx.core as mx

# isort: on
from mlxrl.losses.dpo import DPO_LOSSES, dpo_loss, f_divergence_scores, sigmoid_loss

torch = pytest.importorskip("torch")
dpo_trainer = pytest.importorskip("trl.trainer.dpo_trainer")

B, T = 6, 10
RTOL, ATOL = 1e-5, 1e-5
TRL_TYPES = [t for t in DPO_LOSSES if t != "aot_pair"]  # aot_pair is our alias of aot_unpaired
TRL_NAME = {"aot_pair": "aot_unpaired"}


def _batch(seed=0):
    """Per-token policy log-probs [2B, T] (rows: B chosen then B rejected), shift mask, ref sums."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, T + 1, size=2 * B)
    mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.float32)  # [2B, T]
    per_token = (-rng.uniform(0.05, 2.5, size=(2 * B, T)) * mask).astype(np.float32)
    sums = per_token.sum(1)
    ref = (sums + rng.normal(0.0, 4.0, size=2 * B)).astype(np.float32)
    lssp = (-rng.uniform(0.5, 3.0, size=(2 * B, T))).astype(np.float32)  # log sum_v p_v^2, for WPO
    return SimpleNamespace(per_token=per_token, mask=mask, ref=ref, lssp=lssp, lengths=lengths)


def _trl_loss(
    b,
    loss_type,
    loss_weights=None,
    beta=0.1,
    label_smoothing=0.0,
    discopop_tau=0.05,
    f_divergence_type="reverse_kl",
    f_alpha=0.5,
    use_weighting=False,
    ld_alpha=None,
    rows=None,
):
    """(loss, grad w.r.t. per-token log-probs [2B', T], logged metrics) from TRL's `_compute_loss`."""
    rows = np.arange(B) if rows is None else np.asarray(rows)
    idx = np.concatenate([rows, rows + B])
    per_token = torch.tensor(b.per_token[idx], requires_grad=True)
    mask = torch.tensor(b.mask[idx])
    n = len(idx)
    completion_mask = torch.cat([torch.zeros(n, 1), mask], dim=1).long()  # position 0 is the prompt

    def model(**kwargs):
        return SimpleNamespace(
            log_probs=per_token * mask,
            entropy=torch.zeros(n, T),
            mean_logits=torch.zeros(n, T),
            is_top1=torch.zeros(n, T, dtype=torch.bool),
            log_sum_sq_probs=torch.tensor(b.lssp[idx]),
        )

    types = [loss_type] if isinstance(loss_type, str) else list(loss_type)
    trainer = SimpleNamespace(
        model=SimpleNamespace(training=True),
        aux_loss_enabled=False,
        precompute_ref_logps=True,
        accelerator=SimpleNamespace(device="cpu", gather_for_metrics=lambda x: x, gather=lambda x: x),
        ld_alpha=ld_alpha,
        f_divergence_type=f_divergence_type,
        f_alpha_divergence_coef=f_alpha,
        loss_types=[TRL_NAME.get(t, t) for t in types],
        loss_weights=loss_weights or [1.0] * len(types),
        beta=beta,
        label_smoothing=label_smoothing,
        use_weighting=use_weighting,
        args=SimpleNamespace(discopop_tau=discopop_tau),
        _metrics={"train": defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
    )
    inputs = {
        "input_ids": torch.zeros(n, T + 1, dtype=torch.long),
        "attention_mask": torch.ones(n, T + 1),
        "completion_mask": completion_mask,
        "ref_chosen_logps": torch.tensor(b.ref[rows]),
        "ref_rejected_logps": torch.tensor(b.ref[rows + B]),
    }
    loss = dpo_trainer.DPOTrainer._compute_loss(trainer, model, inputs, False)
    loss.backward()
    metrics = {k: v[0] for k, v in trainer._metrics["train"].items()}
    return loss.item(), per_token.grad.numpy(), metrics


def _ours(b, rows=None, **kw):
    """(loss, grad w.r.t. per-token log-probs [2B', T], metrics) from mlxrl's dpo_loss on the same batch."""
    rows = np.arange(B) if rows is None else np.asarray(rows)
    idx = np.concatenate([rows, rows + B])
    sums = (b.per_token[idx] * b.mask[idx]).sum(1)
    counts = b.mask[idx].sum(1)
    k = len(rows)
    kw.setdefault("chosen_token_counts", mx.array(counts[:k]))
    kw.setdefault("rejected_token_counts", mx.array(counts[k:]))
    rc, rr = mx.array(b.ref[rows]), mx.array(b.ref[rows + B])

    def f(pc, pr):
        return dpo_loss(pc, pr, rc, rr, **kw)

    (loss, metrics), (gc, gr) = mx.value_and_grad(f, argnums=(0, 1))(mx.array(sums[:k]), mx.array(sums[k:]))
    grad = np.concatenate([np.array(gc), np.array(gr)])[:, None] * b.mask[idx]
    return loss.item(), grad, {key: v.item() for key, v in metrics.items()}


def _hyper(loss_type):
    ls = {"robust": 0.2, "exo_pair": 1e-3, "aot": 0.1, "aot_unpaired": 0.1, "aot_pair": 0.1}.get(loss_type, 0.0)
    return {"beta": 0.1, "label_smoothing": ls}


@pytest.mark.parametrize("loss_type", list(DPO_LOSSES))
def test_variant_matches_trl_loss_and_grad(loss_type):
    b = _batch(1)
    hyper = _hyper(loss_type)
    ref_loss, ref_grad, _ = _trl_loss(b, loss_type, **hyper)
    loss, grad, _ = _ours(b, loss_type=loss_type, **hyper)
    np.testing.assert_allclose(loss, ref_loss, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(grad, ref_grad, rtol=RTOL, atol=1e-6)


@pytest.mark.parametrize("loss_type", [t for t in DPO_LOSSES if t not in ("aot", "aot_unpaired", "aot_pair", "sft")])
def test_per_pair_losses_match_trl_on_single_pairs(loss_type):
    """The registry function's [B] output, pair by pair, equals TRL's loss on a batch of that one pair."""
    b = _batch(2)
    hyper = _hyper(loss_type)
    sums = (b.per_token * b.mask).sum(1)
    counts = b.mask.sum(1)
    fn = DPO_LOSSES[loss_type]
    kwargs = {**hyper, "chosen_token_counts": mx.array(counts[:B]), "rejected_token_counts": mx.array(counts[B:])}
    kwargs = {k: v for k, v in kwargs.items() if k in inspect.signature(fn).parameters}
    if loss_type == "sigmoid":
        kwargs.pop("label_smoothing")  # TRL's sigmoid is plain DPO; cDPO is tested separately
    per_pair = fn(mx.array(sums[:B]), mx.array(sums[B:]), mx.array(b.ref[:B]), mx.array(b.ref[B:]), **kwargs)
    assert per_pair.shape == (B,) and per_pair.dtype == mx.float32
    expected = [_trl_loss(b, loss_type, rows=[i], **_hyper(loss_type))[0] for i in range(B)]
    np.testing.assert_allclose(np.array(per_pair), expected, rtol=RTOL, atol=ATOL)


def test_sft_is_token_mean_nll_over_the_batch():
    b = _batch(3)
    sums = (b.per_token * b.mask).sum(1)
    counts = b.mask.sum(1)
    out = DPO_LOSSES["sft"](
        mx.array(sums[:B]),
        mx.array(sums[B:]),
        mx.array(b.ref[:B]),
        mx.array(b.ref[B:]),
        chosen_token_counts=mx.array(counts[:B]),
    )
    expected = -b.per_token[:B][b.mask[:B] > 0].mean()
    np.testing.assert_allclose(np.array(out), np.full(B, expected), rtol=RTOL)


def test_weighted_combination_is_weighted_sum_and_matches_trl():
    b = _batch(4)
    types, weights = ["sigmoid", "bco_pair", "sft", "ipo"], [0.8, 0.2, 1.0, 0.5]
    combined, grad, _ = _ours(b, loss_type=types, loss_weights=weights)
    parts = [_ours(b, loss_type=t)[0] for t in types]
    np.testing.assert_allclose(combined, sum(w * p for w, p in zip(weights, parts, strict=True)), rtol=RTOL)
    ref_loss, ref_grad, _ = _trl_loss(b, types, loss_weights=weights)
    np.testing.assert_allclose(combined, ref_loss, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(grad, ref_grad, rtol=RTOL, atol=1e-6)
    default, _, _ = _ours(b, loss_type=types[:2])
    np.testing.assert_allclose(default, parts[0] + parts[1], rtol=RTOL)


def test_metrics_hand_computed_and_trl():
    b = _batch(5)
    beta = 0.25
    _, _, metrics = _ours(b, loss_type="hinge", beta=beta)
    sums = (b.per_token * b.mask).sum(1)
    chosen = beta * (sums[:B] - b.ref[:B])
    rejected = beta * (sums[B:] - b.ref[B:])
    expected = {
        "rewards/chosen": chosen.mean(),
        "rewards/rejected": rejected.mean(),
        "rewards/accuracies": (chosen > rejected).mean(),
        "rewards/margins": (chosen - rejected).mean(),
        "logps/chosen": sums[:B].mean(),
        "logps/rejected": sums[B:].mean(),
    }
    assert set(metrics) == set(expected)
    assert 0.0 < expected["rewards/accuracies"] < 1.0  # the batch exercises both outcomes
    _, _, trl_metrics = _trl_loss(b, "hinge", beta=beta)
    for key, value in expected.items():
        np.testing.assert_allclose(metrics[key], value, rtol=RTOL, atol=1e-6, err_msg=key)
        np.testing.assert_allclose(metrics[key], trl_metrics[key], rtol=RTOL, atol=1e-6, err_msg=key)
    pc = mx.array(sums[:B])
    _, m = dpo_loss(pc, mx.array(sums[B:]), mx.array(b.ref[:B]), mx.array(b.ref[B:]))
    assert all(v.dtype == mx.float32 and v.shape == () for v in m.values())


@pytest.mark.parametrize("f_div", ["forward_kl", "js_divergence", "alpha_divergence"])
def test_f_divergence_matches_trl(f_div):
    b = _batch(6)
    types, weights = ["sigmoid", "ipo", "discopop", "sft"], [1.0, 0.3, 0.5, 0.2]
    kw = {"loss_type": types, "loss_weights": weights, "f_divergence_type": f_div}
    loss, grad, _ = _ours(b, **kw, f_alpha_divergence_coef=0.3)
    ref_loss, ref_grad, _ = _trl_loss(b, types, loss_weights=weights, f_divergence_type=f_div, f_alpha=0.3)
    np.testing.assert_allclose(loss, ref_loss, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-4, atol=1e-6)
    x = mx.array([-2.0, 0.5])
    np.testing.assert_allclose(np.array(f_divergence_scores(x, "alpha_divergence", 1.0)), [-2.0, 0.5])


def test_wpo_pair_weights_match_trl():
    b = _batch(7)
    per_seq = np.exp(((b.per_token - b.lssp) * b.mask).sum(1) / np.maximum(b.mask.sum(1), 1))
    weights = mx.array(per_seq[:B] * per_seq[B:])
    for types in (["sigmoid"], ["ipo", "discopop"]):  # TRL 1.16 fails with sft or hinge here
        loss, grad, _ = _ours(b, loss_type=types, pair_weights=weights)
        ref_loss, ref_grad, _ = _trl_loss(b, types, use_weighting=True)
        np.testing.assert_allclose(loss, ref_loss, rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(grad, ref_grad, rtol=RTOL, atol=1e-6)


def test_ld_alpha_with_raw_sft_logps_matches_trl():
    """LD-DPO weights the tokens past the shorter answer by alpha; TRL's sft term still uses raw log-probs."""
    b, alpha = _batch(8), 0.4
    pos = np.cumsum(b.mask, axis=1)
    lens = b.mask.sum(1)
    shared = np.tile(np.minimum(lens[:B], lens[B:]), 2)[:, None]
    weight = ((pos > 0) & (pos <= shared)) + alpha * (pos > shared)
    ld_sums = (b.per_token * b.mask * weight).sum(1)
    raw = (b.per_token * b.mask).sum(1)
    types = ["sigmoid", "sft"]
    loss, _ = dpo_loss(
        mx.array(ld_sums[:B]),
        mx.array(ld_sums[B:]),
        mx.array(b.ref[:B]),
        mx.array(b.ref[B:]),
        loss_type=types,
        chosen_token_counts=mx.array(lens[:B]),
        sft_chosen_logps=mx.array(raw[:B]),
    )
    ref_loss, _, _ = _trl_loss(b, types, ld_alpha=alpha)
    np.testing.assert_allclose(loss.item(), ref_loss, rtol=RTOL, atol=ATOL)


def test_sigmoid_with_label_smoothing_is_cdpo():
    """TRL 1.16 silently ignores label_smoothing for sigmoid; we apply it (cDPO), so the loss differs
    from TRL's exactly when label_smoothing > 0 and equals the cDPO formula."""
    b = _batch(9)
    loss, _, _ = _ours(b, loss_type="sigmoid", label_smoothing=0.3)
    ref_loss, _, _ = _trl_loss(b, "sigmoid", label_smoothing=0.3)
    assert abs(loss - ref_loss) > 1e-4
    rng = np.random.default_rng(0)
    pc, pr, rc, rr = (rng.normal(-20, 5, size=B).astype(np.float32) for _ in range(4))
    ours = sigmoid_loss(*(mx.array(x) for x in (pc, pr, rc, rr)), beta=0.2, label_smoothing=0.3)
    logits = 0.2 * ((torch.tensor(pc) - torch.tensor(rc)) - (torch.tensor(pr) - torch.tensor(rr)))
    cdpo = -0.7 * torch.nn.functional.logsigmoid(logits) - 0.3 * torch.nn.functional.logsigmoid(-logits)
    np.testing.assert_allclose(np.array(ours), cdpo.numpy(), rtol=RTOL, atol=ATOL)


def test_compiles_and_accepts_bfloat16_inputs():
    b = _batch(10)
    sums = (b.per_token * b.mask).sum(1)
    args = [mx.array(x) for x in (sums[:B], sums[B:], b.ref[:B], b.ref[B:])]
    eager = dpo_loss(*args, loss_type=["sigmoid", "aot"])[0]
    compiled = mx.compile(lambda *a: dpo_loss(*a, loss_type=["sigmoid", "aot"])[0])(*args)
    np.testing.assert_allclose(compiled.item(), eager.item(), rtol=1e-6)
    low = dpo_loss(*(a.astype(mx.bfloat16) for a in args))[0]
    assert low.dtype == mx.float32


def test_errors_are_clear():
    v = mx.zeros((3,))
    with pytest.raises(ValueError, match="unknown DPO loss_type.*sigmoid.*hinge"):
        dpo_loss(v, v, v, v, loss_type="dpo")
    with pytest.raises(ValueError, match="loss_weights has 1 weights for 2 loss types"):
        dpo_loss(v, v, v, v, loss_type=["sigmoid", "hinge"], loss_weights=[1.0])
    with pytest.raises(ValueError, match=r"ref_rejected must have shape \(3,\)"):
        dpo_loss(v, v, v, mx.zeros((4,)))
    with pytest.raises(ValueError, match="1-D"):
        dpo_loss(mx.zeros((3, 1)), v, v, v)
    with pytest.raises(ValueError, match="needs rejected_token_counts"):
        dpo_loss(v, v, v, v, loss_type="ipo", chosen_token_counts=v)
    with pytest.raises(ValueError, match="needs chosen_token_counts"):
        dpo_loss(v, v, v, v, loss_type="sft")
    with pytest.raises(ValueError, match="label_smoothing > 0"):
        dpo_loss(v, v, v, v, loss_type="exo_pair")
    with pytest.raises(ValueError, match="cannot be used with aot"):
        dpo_loss(v, v, v, v, loss_type="aot", pair_weights=v)
    with pytest.raises(ValueError, match="supports only"):
        dpo_loss(v, v, v, v, loss_type="bco_pair", f_divergence_type="forward_kl")
    with pytest.raises(ValueError, match="unknown f_divergence_type"):
        dpo_loss(v, v, v, v, f_divergence_type="tv")
    with pytest.warns(UserWarning, match="robust"):
        dpo_loss(v, v, v, v, loss_type="robust", label_smoothing=0.6)
