"""SFT nll / dft against TRL's formula written in torch, the accumulation normaliser, metrics, and
the all-labels-ignored guard."""

import mlx.core as mx
import numpy as np
import pytest
import torch

from mlxrl.losses.sft import NoTrainableTokensError, check_has_labels, sft_loss


def trl_reference(logits, labels, loss_type, num_items=None):
    """TRL 1.16 SFTTrainer.compute_loss: per-token -logp (zero on ignored), DFT weights by the
    detached probability, sum / num_items_in_batch (or the batch's count)."""
    logits = logits.clone().requires_grad_(True)
    logp_all = torch.log_softmax(logits, -1)
    mask = labels != -100
    logp = torch.gather(logp_all, -1, labels.clamp(min=0)[:, None])[:, 0] * mask
    per_token = -logp
    if loss_type == "dft":
        per_token = per_token * logp.exp().detach()
    n = mask.sum() if num_items is None else num_items
    loss = per_token.sum() / torch.as_tensor(n).clamp(min=1)
    loss.backward()
    return loss.item(), logits.grad.numpy(), logp.detach().numpy()


@pytest.mark.parametrize("loss_type", ["nll", "dft"])
@pytest.mark.parametrize("num_items", [None, 40])
def test_loss_and_grad_match_trl_formula(loss_type, num_items):
    rng = np.random.default_rng(0)
    n, v = 23, 50
    logits = rng.normal(size=(n, v)).astype(np.float32) * 2
    labels = rng.integers(0, v, n)
    labels[::3] = -100
    ref_loss, ref_grad, ref_logp = trl_reference(torch.tensor(logits), torch.tensor(labels), loss_type, num_items)

    t = mx.array(labels)

    def f(z):
        logp = mx.take_along_axis(z - mx.logsumexp(z, -1, keepdims=True), mx.maximum(t, 0)[:, None], -1)[:, 0]
        logp = mx.where(t != -100, logp, 0)
        return sft_loss(logp, t, loss_type=loss_type, num_items=num_items)[0]

    loss, grad = mx.value_and_grad(f)(mx.array(logits))
    assert abs(loss.item() - ref_loss) <= 1e-5 * max(1, abs(ref_loss))
    np.testing.assert_allclose(np.array(grad), ref_grad, atol=1e-6)


def test_micro_batches_add_up_to_the_whole_batch():
    rng = np.random.default_rng(1)
    logp = mx.array(-rng.random(40).astype(np.float32))
    t = mx.array(np.where(rng.random(40) < 0.3, -100, 1))
    whole, _ = sft_loss(logp, t)
    n = int((np.array(t) != -100).sum())
    parts = sum(sft_loss(logp[s:s + 10], t[s:s + 10], num_items=n)[0].item() for s in range(0, 40, 10))
    assert abs(parts - whole.item()) <= 1e-6


def test_metrics():
    logp = mx.array([-0.1, -2.0, -0.5, -3.0])
    t = mx.array([5, 7, -100, 2])
    argmax = mx.array([5, 1, 4, 2])
    ent = mx.array([1.0, 2.0, 9.0, 3.0])
    _, m = sft_loss(logp, t, entropy=ent, argmax=argmax)
    assert m["mean_token_accuracy"].item() == pytest.approx(2 / 3)
    assert m["entropy"].item() == pytest.approx(2.0)


def test_all_labels_ignored_names_the_examples():
    labels = np.full((2, 5), -100)
    with pytest.raises(NoTrainableTokensError, match=r"example\(s\) 17, 42.*silent 0"):
        check_has_labels(labels, example_ids=[17, 42])
    labels[1, 3] = 4
    check_has_labels(labels)  # one trainable token is enough
    with pytest.raises(ValueError, match="unknown SFT loss_type 'ce'"):
        sft_loss(mx.zeros(3), mx.zeros(3, dtype=mx.int32), loss_type="ce")
