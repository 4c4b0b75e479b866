"""`head_logprobs` (differentiable) and the two-phase streamed step against the naive full-logits
computation: values and gradients w.r.t. hidden and weight, <= 1e-5 relative, float32."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import skip_native_on_gpu
from mlx.utils import tree_flatten

from mlxrl.cpu import fastmath
from mlxrl.losses import fused_head
from mlxrl.losses.fused_head import fused_head_grads, fused_head_loss, fused_value_and_grad
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


# ---------------------------------------------------------------- fused row-chunked loss + grads
FUSED_CASES = [
    # N, D, V, rows per chunk, temperature, ignored
    (37, 16, 1001, 8, 1.0, "some"),  # N not a multiple of the chunk
    (64, 24, 515, 16, 0.7, "some"),  # temperature != 1
    (33, 16, 300, 5, 1.3, "all_but_one"),
    (20, 8, 257, None, 1.0, "none"),  # default chunking
]


def _grpo_token_loss(lp, old, adv):  # TRL's clipped surrogate per token (epsilon 0.2 / 0.28)
    ratio = mx.exp(lp - old)
    return -mx.minimum(ratio * adv, mx.clip(ratio, 0.8, 1.28) * adv)


def _naive_loss(loss_type, t, num_items, temp, extra):
    def f(h, w):
        lp, _, _ = naive(h, w, t, temp)
        mask = (t != -100).astype(mx.float32)
        if loss_type == "nll":
            per = -lp
        elif loss_type == "dft":
            per = -mx.stop_gradient(mx.exp(lp)) * lp
        else:
            per = _grpo_token_loss(lp, *extra[:2]) * extra[2]
        n = mask.sum() if loss_type != "grpo" else 1.0
        return (per * mask).sum() / (num_items or n)
    return f


@pytest.fixture(params=["native", "mlx-ops"])
def head_path(request, monkeypatch):
    """The fused head on both paths: the native CPU kernel (nll / dft on float32 CPU arrays) and
    the MLX graph of row chunks (everywhere else, and every callable loss)."""
    skip_native_on_gpu(request.param)
    if request.param == "mlx-ops":
        monkeypatch.setattr(fused_head, "_NATIVE_MODES", {})
    else:
        assert fastmath.kernels_for(mx.zeros((1,))) is not None, "the native kernels should build here"
    return request.param


@pytest.mark.parametrize("loss_type", ["nll", "dft", "grpo"])
@pytest.mark.parametrize("n,d,v,rows,temp,ignored", FUSED_CASES)
def test_fused_matches_naive(n, d, v, rows, temp, ignored, loss_type, head_path):
    h, w, t, g, e = make(n, d, v, ignored, seed=2)
    num_items = 50 if loss_type == "nll" else None
    kw = dict(temperature=temp, chunk_rows=rows)
    extra = ()
    if loss_type == "grpo":  # a per-token callable with its own args and weights
        old = naive(h, w, t, temp)[0] + 0.3 * g
        extra = (old, e, mx.abs(g) / n)
        kw.update(loss_type=_grpo_token_loss, token_args=extra[:2], token_weights=extra[2])
    else:
        kw.update(loss_type=loss_type, num_items=num_items)
    ref_v, (ref_gh, ref_gw) = mx.value_and_grad(_naive_loss(loss_type, t, num_items, temp, extra), argnums=(0, 1))(h, w)
    ref_lp, ref_ent, ref_am = naive(h, w, t, temp)

    for skip in (True, False):  # differentiable, with and without dropping ignored rows first
        def ours(h, w):
            loss, lp, ent, am = fused_head_loss(h, w, t, skip_ignored=skip, **kw)  # noqa: B023
            return 3.0 * loss, (lp, ent, am)  # the VJP scales by the cotangent
        (val, (lp, ent, am)), (gh, gw) = mx.value_and_grad(ours, argnums=(0, 1))(h, w)
        close(val, 3.0 * ref_v)
        close(gh, 3.0 * ref_gh)
        close(gw, 3.0 * ref_gw)
        close(lp, ref_lp)
        close(ent, ref_ent)
        np.testing.assert_array_equal(np.array(am), np.array(ref_am))

    loss, (lp, ent, am), dh, dw = fused_head_grads(h, w, t, **kw)  # eager twin
    close(loss, ref_v)
    close(dh, ref_gh)
    close(dw, ref_gw)
    close(lp, ref_lp)
    close(ent, ref_ent)
    np.testing.assert_array_equal(np.array(am), np.array(ref_am))


def test_fused_ignored_rows_are_not_scored(head_path):
    h, w, t, *_ = make(16, 8, 300, "some")
    h_poisoned = mx.where((t == -100)[:, None], mx.nan, h)
    loss, lp, _, _ = fused_head_loss(h_poisoned, w, t)
    assert np.isfinite(loss.item()) and not np.isnan(np.array(lp)).any()
    assert np.isfinite(fused_head_grads(h_poisoned, w, t)[0].item())


def test_fused_step_with_tied_weights_matches_full_gradient(head_path):
    mx.random.seed(4)
    v, d, n = 400, 16, 29
    model = TiedLM(v, d)
    ids = mx.random.randint(0, v, (n,))
    targets = mx.where(mx.arange(n) % 3 == 0, -100, mx.random.randint(0, v, (n,)))
    mask = (targets != -100).astype(mx.float32)

    def trunk(p):
        model.update(p)
        return model.trunk(ids)

    params = model.trainable_parameters()
    loss, grads, _ = fused_value_and_grad(trunk, params, targets, head_weight=lambda p: p["embed"]["weight"],
                                          loss_type="dft", chunk_rows=7, temperature=0.9)

    def full(p):
        model.update(p)
        z = model.trunk(ids) @ p["embed"]["weight"].T / 0.9
        lp = mx.take_along_axis(z - mx.logsumexp(z, -1, keepdims=True), mx.maximum(targets, 0)[:, None], -1)[:, 0]
        return -(mx.stop_gradient(mx.exp(lp)) * lp * mask).sum() / mask.sum()

    ref_loss, ref_grads = mx.value_and_grad(full)(params)
    close(loss, ref_loss)
    ours, ref = dict(tree_flatten(grads)), dict(tree_flatten(ref_grads))
    assert ours.keys() == ref.keys()
    for k in ref:
        close(ours[k], ref[k])


def test_fused_under_compile_with_unselected_rows(head_path):
    """The trainers' path: mx.compile (targets not concrete), skip_ignored=False, num_items an array."""
    h, w, t, *_ = make(20, 8, 50, "some", seed=5)

    def f(h, w, t, n):
        return fused_head_loss(h, w, t, skip_ignored=False, num_items=n, chunk_rows=6)[0]

    n = mx.array(13.0)
    v1, (gh1, gw1) = mx.compile(mx.value_and_grad(f, argnums=(0, 1)))(h, w, t, n)
    v2, (gh2, gw2) = mx.value_and_grad(_naive_loss("nll", t, 13.0, 1.0, ()), argnums=(0, 1))(h, w)
    close(v1, v2)
    close(gh1, gh2)
    close(gw1, gw2)


def _head_peak(h, w, t, wrt=(0, 1), **kw):
    """Peak memory above the inputs of a compiled value_and_grad of the fused head's loss."""
    f = mx.compile(mx.value_and_grad(lambda hh, ww: fused_head_loss(hh, ww, t, skip_ignored=False, **kw)[0],
                                     argnums=wrt))
    mx.eval(f(h, w))  # compile and warm up
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    mx.eval(f(h, w))
    return mx.get_peak_memory() - base


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_fused_head_holds_one_weight_gradient(head_path, dtype):
    """Trainable head: peak above the inputs <= 2 float32 [V, D] (the gradient + its pieces on the graph
    path, one buffer natively) plus a few tiles, whatever the dtype, and flat in N. The MLX graph
    that accumulated d_weight with addmm across row chunks held 5 [V, D] (a new one per chunk)."""
    if dtype == mx.bfloat16 and head_path == "native":
        pytest.skip("the native kernel takes float32 only")
    d, v, rows = 512, 32768, 32  # d_weight 64 MB in float32; tiles: 4 MB per row chunk, 16 MB per vocab tile
    dw32 = v * d * 4
    peaks = []
    for n in (256, 1024):  # 8 and 32 row chunks
        h, w, t, *_ = make(n, d, v, "some", seed=7)
        peaks.append(_head_peak(h.astype(dtype), (w * 0.1).astype(dtype), t, chunk_rows=rows, chunk_size=512))
    assert max(peaks) < 2 * dw32 + 48 * 2**20, [p / dw32 for p in peaks]  # + tiles and [N, D] arrays
    assert abs(peaks[1] - peaks[0]) < 0.5 * dw32, [p / dw32 for p in peaks]  # flat in N: no [V, D] per chunk


def test_frozen_bf16_head_is_as_lean_as_float32(head_path):
    """A frozen head (LoRA): no float32 [V, D] copy of a bf16 weight (the vocab-tiled path casts one
    tile at a time), so bf16 holds no more than float32 does; the values match the float32 head."""
    n, d, v = 512, 512, 32768
    h, w, t, *_ = make(n, d, v, "none", seed=8)
    w = w * 0.1
    hb, wb = h.astype(mx.bfloat16), w.astype(mx.bfloat16)
    kw = dict(wrt=0, weight_grad=False, chunk_rows=32, chunk_size=512)
    peak32 = _head_peak(hb.astype(mx.float32), wb.astype(mx.float32), t, **kw)
    peak16 = _head_peak(hb, wb, t, **kw)
    assert peak16 <= max(peak32, 24 * 2**20) + 2 * 2**20, (peak16 / 2**20, peak32 / 2**20)
    assert peak16 < 0.5 * v * d * 4  # far below the float32 copy of the weight it used to make
    for loss_type in ("nll", "dft", _grpo_token_loss):
        kw = dict(loss_type=loss_type, weight_grad=False, temperature=0.8)
        if callable(loss_type):
            old = naive(hb.astype(mx.float32), wb.astype(mx.float32), t, 0.8)[0] + 0.1
            kw.update(token_args=(old, old - 0.2), token_weights=mx.ones((n,)) / n)
        outs = []
        for x, y in ((hb, wb), (hb.astype(mx.float32), wb.astype(mx.float32))):
            (loss, (lp, ent, am)), gh = mx.value_and_grad(
                lambda xx, yy=y: (lambda r: (r[0], r[1:]))(fused_head_loss(xx, yy, t, **kw)))(x)  # noqa: B023
            outs.append((loss, lp, ent, am, gh.astype(mx.float32)))
        (l16, lp16, e16, a16, g16), (l32, lp32, e32, a32, g32) = outs
        for a, b in ((l16, l32), (lp16, lp32), (e16, e32)):  # float32 math on the same bf16 values
            np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-4, atol=1e-4)
        np.testing.assert_array_equal(np.array(a16), np.array(a32))
        np.testing.assert_allclose(np.array(g16), np.array(g32), rtol=1e-2, atol=2e-2 * np.abs(np.array(g32)).max())


@pytest.mark.parametrize("loss_type", ["nll", "dft"])
def test_frozen_head_matches_naive_across_vocab_blocks(loss_type, head_path):
    """A frozen head (no weight gradient: LoRA's), which the native kernel runs in one pass over vocabulary
    blocks of 2048 rows with an online softmax: V 5000 is two full blocks and a partial one, and the rows
    whose logits rise by far more than the rescale margin from one block to the next (and those whose
    logits fall) must give the naive head's loss, d_hidden, log-probs, entropy and argmax, over several row
    chunks and with the temperature."""
    n, d, v, temp = 37, 16, 5000, 0.7
    h, w, t, *_ = make(n, d, v, "some", seed=11)
    rows, cols = mx.arange(n), mx.arange(v)
    lift = mx.where(cols >= 4096, 6.0, mx.where(cols >= 2048, 3.0, 0.0))  # later blocks' logits rise...
    w = mx.concatenate([(lift + 0.1 * w[:, 0])[:, None], w[:, 1:]], axis=1)
    sign = mx.where(rows % 3 == 0, 10.0, mx.where(rows % 3 == 1, -10.0, 0.0))  # ...by 30-60 for a third of rows
    h = mx.concatenate([sign[:, None], h[:, 1:]], axis=1)
    t = mx.where(rows % 5 == 2, 100, mx.where(rows % 5 == 3, 4500, t))  # targets in the first and last blocks
    ref_v, ref_gh = mx.value_and_grad(lambda x: _naive_loss(loss_type, t, None, temp, ())(x, w))(h)
    ref_lp, ref_ent, ref_am = naive(h, w, t, temp)
    for chunk_rows in (3, None):  # 3: seven rows per chunk of the one-pass kernel
        kw = dict(loss_type=loss_type, weight_grad=False, temperature=temp, chunk_rows=chunk_rows)
        (loss, (lp, ent, am)), gh = mx.value_and_grad(
            lambda x: (lambda r: (r[0], r[1:]))(fused_head_loss(x, w, t, **kw)))(h)  # noqa: B023
        close(loss, ref_v)
        close(gh, ref_gh)
        close(lp, ref_lp)
        close(ent, ref_ent)
        np.testing.assert_array_equal(np.array(am), np.array(ref_am))


def test_kept_bf16_head_under_float32_compute(head_path, monkeypatch):
    """A frozen head kept in bfloat16 under float32 compute (`models.widened`): the native kernel widens it a
    block of rows at a time (`kWidenRows` 2048; V 5000 is two full blocks and a partial one) and the graph
    path runs the vocab-tiled head; both give the float32 head's values and d_hidden (the same bfloat16
    values widened), and neither holds a float32 copy of the weight."""
    calls = []
    kernels = fastmath.kernels_for(mx.zeros((1,)))
    if head_path == "native":  # the kernel itself runs the bf16 weight (nll / dft), not the vocab-tiled head
        real = kernels.fused_head

        class Spy:
            def __getattr__(self, name):
                return getattr(kernels, name)

            def fused_head(self, h, w, *a):
                calls.append(w.dtype)
                return real(h, w, *a)

        monkeypatch.setattr(fastmath, "kernels_for", lambda x: Spy() if x.dtype == mx.float32 else None)
    n, d, v = 96, 40, 5000
    h, w, t, *_ = make(n, d, v, "some", seed=9)
    wb = w.astype(mx.bfloat16)
    for loss_type in ("nll", "dft", _grpo_token_loss):
        kw = dict(loss_type=loss_type, weight_grad=False, temperature=0.7, chunk_rows=40)
        if callable(loss_type):
            old = naive(h, wb.astype(mx.float32), t, 0.7)[0] + 0.1
            kw.update(token_args=(old, old - 0.2), token_weights=mx.ones((n,)) / n)
        outs = []
        for weight in (wb, wb.astype(mx.float32)):
            (loss, (lp, ent, am)), gh = mx.value_and_grad(
                lambda x, y=weight: (lambda r: (r[0], r[1:]))(fused_head_loss(x, y, t, **kw)))(h)  # noqa: B023
            outs.append((loss, lp, ent, am, gh))
        (l16, lp16, e16, a16, g16), (l32, lp32, e32, a32, g32) = outs
        for a, b in ((l16, l32), (lp16, lp32), (e16, e32), (g16, g32)):
            np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(np.array(a16), np.array(a32))
    if head_path == "native":
        assert mx.bfloat16 in calls, calls
    else:
        assert not calls
    d, v = 256, 32768  # the weight: 16 MB in bfloat16, 32 MB widened; one row chunk's tile 4 MB
    h, w, t, *_ = make(256, d, v, "none", seed=10)
    peak = _head_peak(h, (w * 0.1).astype(mx.bfloat16), t, wrt=0, weight_grad=False, chunk_rows=32, chunk_size=512)
    assert peak < 0.5 * v * d * 4, peak / 2**20
