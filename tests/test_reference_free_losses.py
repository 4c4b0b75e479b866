"""ORPO's and CPO's losses (`mlxrl.losses.reference_free`) against trl.experimental's own methods
(`ORPOTrainer.odds_ratio_loss`, `CPOTrainer.cpo_loss`, called on their trainer's attributes): values, metrics and
the gradients with respect to both log-prob vectors (torch autograd on TRL's code, float64), every loss type,
AlphaPO's reward shape, label smoothing, and log-probs near 0 where log(1 - e^x) loses digits.

    python -m pytest -q tests/test_reference_free_losses.py
"""

from __future__ import annotations

import types
import warnings

import mlx.core as mx
import numpy as np
import pytest

from mlxrl.losses.reference_free import cpo_loss, log1mexp, orpo_loss

torch = pytest.importorskip("torch")
warnings.filterwarnings("ignore", message=".*trl.experimental.*")


def _trl(kind, **attrs):
    if kind == "orpo":
        from trl.experimental.orpo.orpo_trainer import ORPOTrainer as T
    else:
        from trl.experimental.cpo.cpo_trainer import CPOTrainer as T
    fake = types.SimpleNamespace(accelerator=types.SimpleNamespace(device="cpu"), **attrs)
    return T, fake


def _logps(seed, b=6, scale=3.0, near_zero=False):
    rng = np.random.default_rng(seed)
    c, r = -rng.exponential(scale, b), -rng.exponential(scale, b)
    if near_zero:  # mean log-probs of nearly certain answers: e^x ~ 1, where log(1 - e^x) cancels
        c[:2], r[:2] = [-1e-6, -3e-4], [-2e-5, -0.69]
    return c, r


def _theirs(fn, c, r):
    tc = torch.tensor(c, dtype=torch.float64, requires_grad=True)
    tr = torch.tensor(r, dtype=torch.float64, requires_grad=True)
    out = fn(tc, tr)
    return out, tc, tr


@pytest.mark.parametrize("beta", [0.1, 1.0])
@pytest.mark.parametrize("near_zero", [False, True])
def test_orpo_loss_equals_trls(beta, near_zero):
    T, fake = _trl("orpo", beta=beta)
    c, r = _logps(1, near_zero=near_zero)
    nll = 1.7
    (losses, chosen_rewards, rejected_rewards, ratio, log_odds), tc, tr = _theirs(
        lambda a, b: T.odds_ratio_loss(fake, a, b), c, r)
    want = nll - losses.mean()
    want.backward()

    def ours(a, b):
        return orpo_loss(a, b, mx.array(nll), beta=beta)[0]

    loss, metrics = orpo_loss(mx.array(c, mx.float32), mx.array(r, mx.float32), mx.array(nll), beta=beta)
    assert loss.item() == pytest.approx(want.item(), rel=1e-5, abs=1e-6)
    assert metrics["log_odds_ratio"].item() == pytest.approx(ratio.item(), rel=1e-5, abs=1e-6)
    assert metrics["log_odds_chosen"].item() == pytest.approx(log_odds.item(), rel=1e-4, abs=1e-5)
    assert metrics["rewards/chosen"].item() == pytest.approx(chosen_rewards.mean().item(), rel=1e-5)
    assert metrics["rewards/accuracies"].item() == pytest.approx((chosen_rewards > rejected_rewards).double().mean()
                                                                 .item())
    gc, gr = mx.grad(ours, argnums=(0, 1))(mx.array(c, mx.float32), mx.array(r, mx.float32))
    np.testing.assert_allclose(np.array(gc), tc.grad.numpy(), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(np.array(gr), tr.grad.numpy(), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("loss_type, label_smoothing, alpha", [
    ("sigmoid", 0.0, 0.0), ("sigmoid", 0.2, 0.0), ("hinge", 0.0, 0.0), ("ipo", 0.0, 0.0), ("simpo", 0.0, 0.0),
    ("simpo", 0.1, 0.0), ("simpo", 0.0, 0.3), ("sigmoid", 0.0, -0.5), ("hinge", 0.0, 0.2),
])
@pytest.mark.parametrize("cpo_alpha", [1.0, 0.0])
def test_cpo_loss_equals_trls(loss_type, label_smoothing, alpha, cpo_alpha):
    beta, gamma, nll = 0.7, 0.4, 2.3
    T, fake = _trl("cpo", beta=beta, label_smoothing=label_smoothing, loss_type=loss_type, simpo_gamma=gamma,
                   alpha=alpha)
    c, r = _logps(2, scale=0.8 if alpha else 3.0)
    (losses, chosen_rewards, rejected_rewards), tc, tr = _theirs(lambda a, b: T.cpo_loss(fake, a, b), c, r)
    want = losses.mean() + cpo_alpha * (nll if cpo_alpha else 0.0)
    want.backward()
    kw = dict(loss_type=loss_type, beta=beta, label_smoothing=label_smoothing, simpo_gamma=gamma,
              cpo_alpha=cpo_alpha, alpha=alpha)

    def ours(a, b):
        return cpo_loss(a, b, mx.array(nll), **kw)[0]

    loss, metrics = cpo_loss(mx.array(c, mx.float32), mx.array(r, mx.float32), mx.array(nll), **kw)
    assert loss.item() == pytest.approx(want.item(), rel=1e-5, abs=1e-6)
    assert metrics["nll_loss"].item() == pytest.approx(nll if cpo_alpha else 0.0)
    assert metrics["rewards/chosen"].item() == pytest.approx(chosen_rewards.mean().item(), rel=1e-5, abs=1e-6)
    assert metrics["rewards/margins"].item() == pytest.approx((chosen_rewards - rejected_rewards).mean().item(),
                                                              rel=1e-5, abs=1e-6)
    gc, gr = mx.grad(ours, argnums=(0, 1))(mx.array(c, mx.float32), mx.array(r, mx.float32))
    np.testing.assert_allclose(np.array(gc), tc.grad.numpy(), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(np.array(gr), tr.grad.numpy(), rtol=1e-4, atol=1e-6)


def test_log1mexp_keeps_its_digits_near_zero_and_far_below():
    x = np.array([-1e-7, -1e-4, -0.5, -0.6931, -0.7, -5.0, -40.0])
    # float64, each side of -log 2 in the form exact there (log(-expm1(x)) alone rounds e^-40 away)
    want = np.where(x < -np.log(2), np.log1p(-np.exp(x)), np.log(-np.expm1(x)))
    np.testing.assert_allclose(np.array(log1mexp(mx.array(x, mx.float32))), want, rtol=2e-6)


def test_unknown_cpo_loss_type_is_refused():
    with pytest.raises(ValueError, match="unknown CPO loss_type 'kto_pair'"):
        cpo_loss(mx.zeros(2), mx.zeros(2), mx.array(0.0), loss_type="kto_pair")
