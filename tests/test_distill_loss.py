"""The streamed generalized JSD (`mlxrl.losses.distill.generalized_jsd`, TRL 1.16's DistillationTrainer loss) against
the naive computation over whole [tokens, vocab] logits and against TRL's own `ChunkedDivergenceFunction`: the
per-token divergence, the student's entropy and the gradients of the student's hidden states and head, for forward
KL, reverse KL and the JSD, at two temperatures, across chunk boundaries; its peak memory flat in the number of
tokens at Qwen's vocabularies.

    python -m pytest -q tests/test_distill_loss.py
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import mlxrl  # noqa: F401  (the fast BLAS first)
from mlxrl.losses.distill import generalized_jsd

torch = pytest.importorskip("torch")
N, DS, DT, V = 37, 16, 24, 1000


def _inputs(seed=0):
    g = np.random.default_rng(seed)
    return (g.normal(size=(N, DS)).astype(np.float32), (0.3 * g.normal(size=(V, DS))).astype(np.float32),
            g.normal(size=(N, DT)).astype(np.float32), (0.3 * g.normal(size=(V, DT))).astype(np.float32),
            g.random(N).astype(np.float32))


def naive(hs, ws, ht, wt, beta, temperature):
    zs, zt = (hs @ ws.T) / temperature, (ht @ wt.T) / temperature
    log_ps, log_pt = zs - mx.logsumexp(zs, -1, keepdims=True), zt - mx.logsumexp(zt, -1, keepdims=True)
    ps, pt = mx.exp(log_ps), mx.exp(log_pt)
    if beta == 0.0:
        return (pt * (log_pt - log_ps)).sum(-1)
    if beta == 1.0:
        return (ps * (log_ps - log_pt)).sum(-1)
    log_m = mx.log((1 - beta) * ps + beta * pt)
    return beta * (pt * (log_pt - log_m)).sum(-1) + (1 - beta) * (ps * (log_ps - log_m)).sum(-1)


@pytest.mark.parametrize("beta", [0.0, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_values_and_gradients_equal_the_naive_computation_and_trls(beta, temperature):
    from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

    hs, ws, ht, wt, w = _inputs()
    args = [mx.array(x) for x in (hs, ws, ht, wt)]

    def ours(a, b):  # chunks of 8 rows: five chunks, the last one short
        d, _ = generalized_jsd(a, b, args[2], args[3], beta=beta, temperature=temperature, chunk_rows=8)
        return (d * mx.array(w)).sum()

    def plain(a, b):
        return (naive(a, b, args[2], args[3], beta, temperature) * mx.array(w)).sum()

    (v, (g_h, g_w)), (v0, (g_h0, g_w0)) = (mx.value_and_grad(f, argnums=(0, 1))(*args[:2]) for f in (ours, plain))
    assert v.item() == pytest.approx(v0.item(), rel=1e-5, abs=1e-6)
    np.testing.assert_allclose(np.array(g_h), np.array(g_h0), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(np.array(g_w), np.array(g_w0), rtol=1e-4, atol=1e-6)

    t = [torch.tensor(x, requires_grad=i < 2) for i, x in enumerate((hs, ws, ht, wt))]
    div, ent = ChunkedDivergenceFunction.apply(t[0], t[1], None, t[2], t[3], None, beta, temperature)
    (div * torch.tensor(w)).sum().backward()
    d, h = generalized_jsd(*args, beta=beta, temperature=temperature, chunk_rows=8)
    np.testing.assert_allclose(np.array(d), div.detach().numpy(), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(np.array(h), ent.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.array(g_h), t[0].grad.numpy(), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(np.array(g_w), t[1].grad.numpy(), rtol=1e-4, atol=1e-6)


def test_the_teacher_gets_no_gradient_and_a_frozen_head_none_either():
    hs, ws, ht, wt, _ = (mx.array(x) for x in _inputs(1))
    grads = mx.grad(lambda *a: generalized_jsd(*a, beta=0.5)[0].sum(), argnums=(2, 3))(hs, ws, ht, wt)
    assert all(float(mx.abs(g).max()) == 0.0 for g in grads)
    frozen = mx.grad(lambda a, b: generalized_jsd(a, b, ht, wt, weight_grad=False)[0].sum(), argnums=1)(hs, ws)
    assert float(mx.abs(frozen).max()) == 0.0
    with pytest.raises(ValueError, match="vocabulary"):
        generalized_jsd(hs, ws, ht, wt[:10])


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_float32_at_a_real_vocabulary_is_as_exact_as_torchs(beta):
    """V = 151936, near-uniform distributions (an untrained model's): the student's gradients no further from
    float64 than twice torch's float32. A logsumexp in one MLX CPU reduction (a row's values added one after
    another) missed by ~10x (5.6e-6 against torch's 6.8e-7, beta 0)."""
    g = np.random.default_rng(0)
    n, d, v = 24, 64, 151936
    hs, ht = (g.normal(size=(n, d)).astype(np.float32) for _ in range(2))
    ws, wt = ((0.02 * g.normal(size=(v, d))).astype(np.float32) for _ in range(2))

    def ours(a, b):
        return generalized_jsd(a, b, mx.array(ht), mx.array(wt), beta=beta, temperature=0.7)[0].sum()

    grads = mx.grad(ours, argnums=(0, 1))(mx.array(hs), mx.array(ws))

    def reference(dtype):
        a, w = (torch.tensor(x, dtype=dtype, requires_grad=True) for x in (hs, ws))
        zs, zt = a @ w.T / 0.7, torch.tensor(ht, dtype=dtype) @ torch.tensor(wt, dtype=dtype).T / 0.7
        ls, lt = torch.log_softmax(zs, -1), torch.log_softmax(zt, -1)
        ps, pt = ls.exp(), lt.exp()
        if beta == 0.0:  # the generalized JSD's endpoints are the KLs (the mixture formula vanishes there)
            loss = (pt * (lt - ls)).sum()
        elif beta == 1.0:
            loss = (ps * (ls - lt)).sum()
        else:
            lm = torch.log((1 - beta) * ps + beta * pt)
            loss = beta * (pt * (lt - lm)).sum() + (1 - beta) * (ps * (ls - lm)).sum()
        loss.backward()
        return a.grad.double().numpy(), w.grad.double().numpy()

    exact, single = reference(torch.float64), reference(torch.float32)
    for ours_g, f64, f32 in zip(grads, exact, single, strict=True):
        gap, gap32 = (np.linalg.norm(np.asarray(x, np.float64) - f64) / np.linalg.norm(f64) for x in (ours_g, f32))
        assert gap <= max(2 * gap32, 1e-6), (gap, gap32)


def test_bfloat16_inputs_give_float32_sums_and_bfloat16_gradients():
    """A bf16 run's hidden states and heads (the graph path on a GPU): the divergence and entropy come out float32
    from float32 logits, equal to the float32 computation on the same bf16-rounded inputs; the gradients keep the
    inputs' dtype, within bf16's rounding of the float32 ones."""
    hs, ws, ht, wt, w = _inputs(2)
    b16 = [mx.array(x).astype(mx.bfloat16) for x in (hs, ws, ht, wt)]
    f32 = [x.astype(mx.float32) for x in b16]

    def loss(args):
        return lambda a, b: (generalized_jsd(a, b, args[2], args[3], beta=0.5, chunk_rows=8)[0] * mx.array(w)).sum()

    d16, h16 = generalized_jsd(*b16, beta=0.5, chunk_rows=8)
    d32, h32 = generalized_jsd(*f32, beta=0.5, chunk_rows=8)
    assert d16.dtype == h16.dtype == mx.float32
    np.testing.assert_allclose(np.array(d16), np.array(d32), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.array(h16), np.array(h32), rtol=1e-5, atol=1e-6)
    g16 = mx.grad(loss(b16), argnums=(0, 1))(*b16[:2])
    g32 = mx.grad(loss(f32), argnums=(0, 1))(*f32[:2])
    for a, b in zip(g16, g32, strict=True):
        assert a.dtype == mx.bfloat16
        scale = float(mx.abs(b).max())
        assert float(mx.abs(a.astype(mx.float32) - b).max()) <= 1e-2 * scale


@pytest.mark.parametrize("vocab", [151936, 248320])
def test_peak_memory_is_flat_in_the_tokens(vocab):
    """value_and_grad at 128 and 512 tokens (a trained head): the peak above the inputs grows by no more than the
    inputs' own gradients, where one [tokens, V] float32 logit array alone is 78-127 MB at 128 tokens."""
    d = 32
    peaks = []
    for n in (128, 512):
        key = mx.random.key(n)
        hs, ht = mx.random.normal((n, d), key=key), mx.random.normal((n, d), key=key)
        ws, wt = 0.05 * mx.random.normal((vocab, d), key=key), 0.05 * mx.random.normal((vocab, d), key=key)
        mx.eval(hs, ht, ws, wt)
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        out = mx.value_and_grad(lambda a, b, ht=ht, wt=wt: generalized_jsd(a, b, ht, wt, beta=0.5)[0].sum(),
                                argnums=(0, 1))(hs, ws)
        mx.eval(out)
        peaks.append(mx.get_peak_memory() - base)
        del out
    logits = 4 * 512 * vocab
    assert peaks[1] <= 1.15 * peaks[0], [p / 1e6 for p in peaks]
    assert peaks[1] < logits, (peaks[1] / 1e6, logits / 1e6)
