"""The graph path's tiled attention (`mlxrl.models.attention`) against the naive one (the whole scores in float32):
values, the log-sum-exp, every gradient, for the masks the decoders build (causal, left and right padding,
packed documents, queries continuing a cache), grouped-query heads, head dims 64-256, query blocks that do
and do not divide the length, bf16, mx.compile; the structured mask against the dense one; its memory (no
[L, S] array alive) against the dense path's; a model's logits and gradients with every attention tiled.

    pytest tests/test_attention.py
"""

import mlxrl  # noqa: F401, I001  (first: the fast BLAS before mlx.core)

import mlx.core as mx
import numpy as np
import pytest

from mlxrl.models import attention as attn
from mlxrl.models.attention import AttentionMask, naive_attention, tiled_attention
from mlxrl.models.language import attention_mask_for


def _inputs(B, Hq, Hkv, L, S, D, seed=0, dtype=mx.float32):
    rng = np.random.default_rng(seed)
    q, k, v = (mx.array(rng.normal(size=s).astype(np.float32)).astype(dtype)
               for s in ((B, Hq, L, D), (B, Hkv, S, D), (B, Hkv, S, D)))
    return q, k, v


def _masks(B, L, S):
    """The decoders' masks for L queries continuing S - L cached keys: (name, mask)."""
    off = S - L
    left = np.ones((B, S), bool)
    left[0, :off + 7] = False  # row 0 left-padded (its first queries see nothing but themselves)
    right = np.ones((B, S), bool)
    right[-1, S - 5:] = False  # the last row right-padded
    docs = np.concatenate([np.full((B, (L + 1) // 3), 1), np.full((B, L - (L + 1) // 3), 2)], axis=1)
    docs[-1, -4:] = 0  # padding after the documents
    out = [("none", None), ("causal", "causal"), ("left padding", AttentionMask(L, S, mx.array(left))),
           ("right padding", AttentionMask(L, S, mx.array(right)))]
    if off == 0:
        out += [("documents", attention_mask_for(L, None, mx.array(docs.astype(np.int32)))),
                ("documents and padding", attention_mask_for(L, mx.array((docs > 0).astype(np.int32)),
                                                             mx.array(docs.astype(np.int32))))]
    return out


def _loss(fn, cot):
    def f(q, k, v):
        out, lse = fn(q, k, v)
        return (out.astype(mx.float32) * cot).sum() + mx.sin(lse).sum()
    return f


def _rel(a, b):
    a, b = np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32))
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-6))


@pytest.mark.parametrize("shape", [(2, 4, 2, 70, 70, 64), (1, 6, 1, 48, 80, 128), (2, 2, 2, 37, 37, 256),
                                   (1, 8, 2, 96, 96, 96)], ids=lambda s: "B{}-Hq{}-Hkv{}-L{}-S{}-D{}".format(*s))
@pytest.mark.parametrize("rows", [16, 32, 1024])
def test_tiled_equals_naive_values_lse_and_gradients(shape, rows):
    B, Hq, Hkv, L, S, D = shape
    q, k, v = _inputs(B, Hq, Hkv, L, S, D)
    cot = mx.array(np.random.default_rng(1).normal(size=(B, Hq, L, D)).astype(np.float32))
    scale = D ** -0.5
    for name, mask in _masks(B, L, S):
        if mask is None and L != S:
            continue
        tiled = _loss(lambda q, k, v, mask=mask: tiled_attention(q, k, v, scale=scale, mask=mask, rows=rows), cot)
        naive = _loss(lambda q, k, v, mask=mask: naive_attention(q, k, v, scale=scale, mask=mask), cot)
        got, want = tiled_attention(q, k, v, scale=scale, mask=mask, rows=rows), naive_attention(q, k, v, scale=scale,
                                                                                                  mask=mask)
        assert _rel(got[0], want[0]) < 2e-6 and _rel(got[1], want[1]) < 2e-6, name
        g_got = mx.grad(tiled, argnums=(0, 1, 2))(q, k, v)
        g_want = mx.grad(naive, argnums=(0, 1, 2))(q, k, v)
        for which, a, b in zip("qkv", g_got, g_want, strict=True):
            assert _rel(a, b) < 1e-5, (name, which, _rel(a, b))


def test_structured_mask_is_the_dense_mask_it_replaces():
    """`attention_mask_for`'s structure, made dense, is the boolean mask written out by hand: causal, padding,
    documents, every query seeing itself; and a block of it is that array's block."""
    B, L = 2, 23
    pad = np.ones((B, L), np.int32)
    pad[0, :5] = 0
    seg = np.concatenate([np.full((B, 9), 1), np.full((B, L - 9), 2)], axis=1).astype(np.int32)
    q = np.arange(L)[:, None]
    k = np.arange(L)[None]
    want = (q >= k)[None, None] & pad.astype(bool)[:, None, None, :] & (seg[:, None, :, None] == seg[:, None, None, :])
    want |= (q == k)[None, None]
    mask = attention_mask_for(L, mx.array(pad), mx.array(seg))
    assert np.array_equal(np.array(mask.dense()), want)
    assert np.array_equal(np.array(mask.block(7, 15, 15)), want[:, :, 7:15, :15])
    assert attention_mask_for(L) == "causal" and attention_mask_for(1) is None


def test_bf16_within_rounding_of_float32():
    """bf16 inputs: scores in bf16 from the matmul, softmax statistics in float32; within bf16's rounding of
    the float32 result (the fused path's own error on the same inputs, times 2)."""
    q, k, v = _inputs(1, 4, 2, 64, 64, 64, dtype=mx.bfloat16)
    mask = AttentionMask(64, 64, mx.array(np.r_[np.zeros(6), np.ones(58)][None].astype(bool)))
    ref = naive_attention(q.astype(mx.float32), k.astype(mx.float32), v.astype(mx.float32), scale=0.125,
                          mask=mask)[0]
    got = tiled_attention(q, k, v, scale=0.125, mask=mask, rows=16)[0]
    fused = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask.dense())
    assert got.dtype == mx.bfloat16
    assert _rel(got, ref) <= 2 * max(_rel(fused, ref), 4e-3), (_rel(got, ref), _rel(fused, ref))
    dq = mx.grad(lambda q: tiled_attention(q, k, v, scale=0.125, mask=mask, rows=16)[0].astype(mx.float32).sum())(q)
    dq_ref = mx.grad(lambda q: naive_attention(q, k.astype(mx.float32), v.astype(mx.float32), scale=0.125,
                                               mask=mask)[0].sum())(q.astype(mx.float32))
    assert dq.dtype == mx.bfloat16 and _rel(dq, dq_ref) < 3e-2


def test_under_compile():
    q, k, v = _inputs(1, 4, 2, 80, 80, 64)
    mask = attention_mask_for(80, mx.array(np.r_[np.zeros(3), np.ones(77)][None].astype(np.int32)))

    def f(q, k, v, valid):
        m = AttentionMask(80, 80, valid)
        return mx.grad(lambda q: tiled_attention(q, k, v, scale=0.125, mask=m, rows=16)[0].sum())(q)

    eager = f(q, k, v, mask.key_valid)
    assert _rel(mx.compile(f)(q, k, v, mask.key_valid), eager) < 1e-6


@pytest.fixture
def graph_path(monkeypatch):
    from mlxrl.cpu import native

    monkeypatch.setattr(native, "load", lambda: None)


def test_the_door_takes_the_tiled_path_past_the_tile(graph_path, monkeypatch):
    """On the graph path the door (`attention`) runs the fused kernel for short shapes and the tiled op once
    the whole scores would pass TILE_BYTES; both equal the naive attention."""
    q, k, v = _inputs(1, 4, 2, 64, 64, 32)
    mask = attention_mask_for(64, mx.array(np.r_[np.zeros(5), np.ones(59)][None].astype(np.int32)))
    taken = []
    real = attn._path
    monkeypatch.setattr(attn, "_path", lambda *a: taken.append(real(*a)) or taken[-1])
    want = naive_attention(q, k, v, scale=0.2, mask=mask)[0]
    assert _rel(attn.attention(q, k, v, scale=0.2, mask=mask), want) < 2e-6
    monkeypatch.setattr(attn, "TILE_BYTES", 1024)
    assert _rel(attn.attention(q, k, v, scale=0.2, mask=mask), want) < 2e-6
    assert taken == ["fused", "tiled"]


def _peak(fn, *args) -> int:
    mx.eval(*args)
    mx.synchronize()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    mx.eval(fn(*args))
    return mx.get_peak_memory() - base


def test_tiled_memory_holds_no_length_squared_array(graph_path, monkeypatch):
    """value_and_grad of a padded causal attention (8 heads of 64) at L = 2048 and 4096: the tiled path's peak
    grows at most linearly with L and stays under 0.3 of one [B, H, L, L] float32 array (512 MB at 4096),
    where the dense path (the mask, the scores, the probabilities and their gradient) holds several and grows
    by ~4x. Fails if a [B, H, L, L] array is alive."""
    monkeypatch.setattr(attn, "TILE_BYTES", 8 * 2**20)  # blocks of 128 queries at 2048 keys

    def peaks(L, D=64, H=8):
        q, k, v = _inputs(1, H, H, L, L, D)
        valid = mx.array(np.r_[np.zeros(100), np.ones(L - 100)][None].astype(bool))

        def step(tiled):
            def f(q, k, v):
                m = AttentionMask(L, L, valid)
                if tiled:
                    return tiled_attention(q, k, v, scale=0.125, mask=m)[0].sum()
                return mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=m.dense()).sum()
            return lambda q, k, v: mx.value_and_grad(f, argnums=(0, 1, 2))(q, k, v)

        return _peak(step(True), q, k, v), _peak(step(False), q, k, v), H * L * L * 4

    (t1, f1, _), (t2, f2, scores) = peaks(2048), peaks(4096)
    assert t2 < 0.3 * scores and t2 < 2.2 * t1, (t1 / 1e6, t2 / 1e6, scores / 1e6)
    assert f2 > 2 * scores and f2 > 3.5 * f1, (f1 / 1e6, f2 / 1e6)  # what the tiled path saves


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5_text"])
def test_a_model_with_every_attention_tiled_equals_the_fused_path(tiny_checkpoint, graph_path, monkeypatch, arch):
    """A padded batch and a packed one through a model on the graph path: with TILE_BYTES 0 every attention of
    16 or more queries is tiled; logits and every parameter's gradient equal the fused path's."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    model, _ = mlxrl.load(tiny_checkpoint(arch))
    rng = np.random.default_rng(0)
    ids = mx.array(rng.integers(0, 1000, size=(2, 40)).astype(np.int32))
    pad = np.ones((2, 40), np.int32)
    pad[0, :9] = 0
    seg = np.concatenate([np.full((2, 15), 1), np.full((2, 21), 2), np.zeros((2, 4))], axis=1).astype(np.int32)
    cases = [dict(attention_mask=mx.array(pad)), dict(segment_ids=mx.array(seg), attention_mask=mx.array(seg > 0))]

    def run(kw):
        def loss(m):
            return (m(ids, **kw).astype(mx.float32) * mx.array(pad if "segment_ids" not in kw else seg > 0)[..., None]
                    ).mean()
        value, grads = nn.value_and_grad(model, loss)(model)
        return model(ids, **kw), value, dict(tree_flatten(grads))

    for kw in cases:
        logits, value, grads = run(kw)
        monkeypatch.setattr(attn, "TILE_BYTES", 0)
        taken = []
        monkeypatch.setattr(attn, "_path", lambda *a, taken=taken, real=attn._path: taken.append(real(*a)) or taken[-1])
        t_logits, t_value, t_grads = run(kw)
        monkeypatch.undo()
        from mlxrl.cpu import native

        monkeypatch.setattr(native, "load", lambda: None)
        assert taken and set(taken) == {"tiled"}, taken
        valid = np.array(kw["attention_mask"]).astype(bool)
        assert np.abs(np.array(t_logits) - np.array(logits))[valid].max() < 1e-4
        assert abs(float(t_value) - float(value)) < 1e-5
        for name, g in grads.items():
            assert _rel(t_grads[name], g) < 1e-4, name
