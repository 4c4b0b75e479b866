"""`head_logprobs` (differentiable) and the two-phase streamed step against the naive full-logits
computation: values and gradients w.r.t. hidden and weight, <= 1e-5 relative, float32."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlxrl.losses.head import (
    head_logprobs,
    streamed_head_backward,
    streamed_logprobs,
    streamed_value_and_grad,
)

RTOL = 1e-5


def naive(hidden, weight, targets, temperature):
    z = (hidden @ weight.T) / temperature
    logp_all = z - mx.logsumexp(z, -1, keepdims=True)
    keep = targets != -100
    logp = mx.take_along_axis(logp_all, mx.maximum(targets, 0)[:, None], -1)[:, 0]
    ent = -(mx.exp(logp_all) * logp_all).sum(-1)
    return mx.where(keep, logp, 0), mx.where(keep, ent, 0), mx.where(keep, mx.argmax(z, -1).astype(mx.int32), -1)


def close(a, b):
    a, b = np.array(a, dtype=np.float64), np.array(b, dtype=np.float64)
    scale = max(np.abs(b).max(), 1e-6)
    assert np.abs(a - b).max() / scale <= RTOL, np.abs(a - b).max() / scale


CASES = [
    # N, D, V, chunk (vocab columns per tile), temperature, ignored
    (37, 16, 1001, 128, 1.0, "some"),  # V not a multiple of the chunk; N odd
    (64, 24, 515, 100, 0.7, "some"),  # temperature != 1
    (33, 16, 300, 64, 1.3, "all_but_one"),
    (20, 8, 257, None, 1.0, "none"),  # default chunking
]


def make(n, d, v, ignored, seed=0):
    mx.random.seed(seed)
    h = mx.random.normal((n, d))
    w = mx.random.normal((v, d)) * 0.3
    t = mx.random.randint(0, v, (n,))
    if ignored == "some":
        t = mx.where(mx.arange(n) % 4 == 1, -100, t)
    elif ignored == "all_but_one":
        t = mx.where(mx.arange(n) == n // 2, t, -100)
    g = mx.random.normal((n,))
    e = mx.random.normal((n,))
    return h, w, t, g, e


@pytest.mark.parametrize("n,d,v,chunk,temp,ignored", CASES)
def test_differentiable_matches_naive(n, d, v, chunk, temp, ignored):
    h, w, t, g, e = make(n, d, v, ignored)

    def objective(fn):
        def f(h, w):
            lp, ent = fn(h, w)
            return (lp * g).sum() + (ent * e).sum()
        return f

    ours = objective(lambda h, w: head_logprobs(h, w, t, temperature=temp, chunk_size=chunk, return_entropy=True))
    ref = objective(lambda h, w: naive(h, w, t, temp)[:2])
    v1, (gh1, gw1) = mx.value_and_grad(ours, argnums=(0, 1))(h, w)
    v2, (gh2, gw2) = mx.value_and_grad(ref, argnums=(0, 1))(h, w)
    close(v1, v2)
    close(gh1, gh2)
    close(gw1, gw2)
    lp, am = head_logprobs(h, w, t, temperature=temp, chunk_size=chunk, return_argmax=True)
    ref_lp, _, ref_am = naive(h, w, t, temp)
    close(lp, ref_lp)
    np.testing.assert_array_equal(np.array(am), np.array(ref_am))


@pytest.mark.parametrize("n,d,v,chunk,temp,ignored", CASES)
def test_two_phase_matches_naive(n, d, v, chunk, temp, ignored):
    h, w, t, g, e = make(n, d, v, ignored, seed=1)
    lp, ent, lse, am = streamed_logprobs(h, w, t, temperature=temp, chunk_size=chunk, with_entropy=True)
    ref_lp, ref_ent, ref_am = naive(h, w, t, temp)
    close(lp, ref_lp)
    close(ent, ref_ent)
    np.testing.assert_array_equal(np.array(am), np.array(ref_am))
    dh, dw = streamed_head_backward(h, w, t, lse, ent, g, e, temperature=temp, chunk_size=chunk)

    def ref(h, w):
        a, b, _ = naive(h, w, t, temp)
        return (a * g).sum() + (b * e).sum()

    gh, gw = mx.grad(ref, argnums=(0, 1))(h, w)
    close(dh, gh)
    close(dw, gw)


def test_ignored_rows_are_not_scored():
    h, w, t, *_ = make(16, 8, 300, "some")
    h_poisoned = mx.where((t == -100)[:, None], mx.nan, h)  # a scored ignored row would turn NaN
    lp = head_logprobs(h_poisoned, w, t)
    assert not np.isnan(np.array(lp)).any()
    assert not np.isnan(np.array(streamed_logprobs(h_poisoned, w, t)[0])).any()


class TiedLM(nn.Module):
    """Embedding -> one linear -> tied head: the head weight is also the embedding."""

    def __init__(self, v, d):
        super().__init__()
        self.embed = nn.Embedding(v, d)
        self.proj = nn.Linear(d, d)

    def trunk(self, ids):
        return mx.tanh(self.proj(self.embed(ids)))


def test_two_phase_step_with_tied_weights_matches_full_gradient():
    mx.random.seed(3)
    v, d, n = 400, 16, 29
    model = TiedLM(v, d)
    ids = mx.random.randint(0, v, (n,))
    targets = mx.where(mx.arange(n) % 3 == 0, -100, mx.random.randint(0, v, (n,)))
    mask = (targets != -100).astype(mx.float32)

    def loss_fn(lp, ent):
        return -(lp * mask).sum() / mask.sum(), ent.sum()

    def trunk(p):
        model.update(p)
        return model.trunk(ids)

    params = model.trainable_parameters()
    loss, _, grads, _ = streamed_value_and_grad(trunk, params, targets, loss_fn,
                                                head_weight=lambda p: p["embed"]["weight"], chunk_size=96)

    def full(p):
        model.update(p)
        z = model.trunk(ids) @ p["embed"]["weight"].T
        lp = mx.take_along_axis(z - mx.logsumexp(z, -1, keepdims=True), mx.maximum(targets, 0)[:, None], -1)[:, 0]
        return -(lp * mask).sum() / mask.sum()

    ref_loss, ref_grads = mx.value_and_grad(full)(params)
    close(loss, ref_loss)
    ours, ref = dict(tree_flatten(grads)), dict(tree_flatten(ref_grads))
    assert ours.keys() == ref.keys()
    for k in ref:
        close(ours[k], ref[k])
