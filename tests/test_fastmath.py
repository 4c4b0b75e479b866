"""mlxrl.fastmath and the native CPU kernels (mlxrl.native).

- exp, on both paths (native kernel; MLX ops where the module is absent), is as accurate as mx.exp
  against a float64 reference (both ~4e-6 relative: the same Cephes polynomial), underflows to
  exactly 0 where mx.exp does, overflows to inf, keeps NaN.
- sigmoid, SiLU and softmax equal float64 references, including rows with -inf and non-contiguous
  inputs; their gradients (VJP) and JVPs equal MLX's own ops', under mx.compile too.
- exp_shift and logsumexp equal their naive forms, rows of all -inf included.
- The native module builds here (g++ is part of the project's setup), and a failed build leaves a
  warning and MLX's ops, not an error.
"""

import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from conftest import skip_native_on_gpu

from mlxrl.cpu import fastmath, native


@pytest.fixture(params=["native", "mlx-ops"])
def path(request, monkeypatch):
    skip_native_on_gpu(request.param)
    if request.param == "mlx-ops":
        monkeypatch.setattr(native, "load", lambda: None)
    return request.param


def test_native_module_builds_here():
    assert sys.platform.startswith("linux")
    assert native.load() is not None, "the native kernels should build on the project's Linux setup"


def test_exp_matches_float64_reference(path):
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.uniform(-87, 88, 200_000), rng.normal(0, 3, 100_000),
                        np.linspace(-0.5, 0.5, 1001), [0.0, 1.0, -1.0, 88.0, -87.0]]).astype(np.float32)
    ref = np.exp(x.astype(np.float64))
    mlx_rel = (np.abs(np.array(mx.exp(mx.array(x))) - ref) / ref).max()
    for fn in (fastmath.exp, lambda a: fastmath.exp_shift(a, mx.array(0.0))):
        rel = (np.abs(np.array(fn(mx.array(x))) - ref) / ref).max()  # normal results only (no denormals)
        assert rel <= mlx_rel * 1.05 and rel < 5e-6, (rel, mlx_rel)


def test_exp_underflow_inf_and_nan(path):
    x = mx.array([-88.5, -100.0, -np.inf, np.nan, -1e30, 88.8, 1e30, np.inf], dtype=mx.float32)
    tiny = np.finfo(np.float32).tiny  # CUDA's exp keeps subnormals (exp(-100) = 3.7e-44); the CPU flushes them
    for got in (np.array(fastmath.exp(x)), np.array(fastmath.exp_shift(x, mx.array(0.0)))):
        assert ((got[[0, 1, 2, 4]] >= 0) & (got[[0, 1, 2, 4]] < tiny)).all() and np.isnan(got[3])
    assert np.isposinf(np.array(fastmath.exp(x))[5:]).all()
    if path == "native":  # the MLX-ops fallback of exp_shift saturates at exp(88): the sampler's z - max <= 0
        assert np.isposinf(np.array(fastmath.exp_shift(x, mx.array(0.0)))[5:]).all()
    assert (np.array(mx.exp(x))[[0, 1, 2, 4]] < tiny).all()  # what mx.exp gives there too


def test_sigmoid_silu_softmax_values(path):
    rng = np.random.default_rng(1)
    x = rng.normal(0, 6, (37, 1031)).astype(np.float32)
    x[3, 5] = -np.inf
    x[4, :] = np.linspace(-120, 120, 1031)
    x64 = x.astype(np.float64)
    finite = np.isfinite(x)
    with np.errstate(invalid="ignore", over="ignore"):
        sig = 1 / (1 + np.exp(-x64))
    np.testing.assert_allclose(np.array(fastmath.sigmoid(mx.array(x))), sig, rtol=5e-6, atol=1e-37)
    with np.errstate(invalid="ignore"):
        silu = x64 * sig
    np.testing.assert_allclose(np.array(fastmath.silu(mx.array(x)))[finite], silu[finite],
                               rtol=5e-6, atol=1e-30)
    e = np.exp(x64 - x64.max(-1, keepdims=True))
    np.testing.assert_allclose(np.array(fastmath.softmax(mx.array(x))), e / e.sum(-1, keepdims=True),
                               rtol=1e-5, atol=1e-12)
    # along another axis, and a non-contiguous (transposed) input
    e0 = np.exp(x64 - x64.max(0, keepdims=True))
    np.testing.assert_allclose(np.array(fastmath.softmax(mx.array(x), axis=0)), e0 / e0.sum(0, keepdims=True),
                               rtol=1e-5, atol=1e-12)
    xt = mx.array(x).T
    np.testing.assert_allclose(np.array(fastmath.softmax(xt)), np.array(mx.softmax(xt, axis=-1, precise=True)),
                               rtol=1e-5, atol=1e-12)
    # an all -inf row gives NaN, as mx.softmax does
    assert np.isnan(np.array(fastmath.softmax(mx.full((2, 5), -np.inf)))).all()


@pytest.mark.parametrize("compiled", [False, True])
def test_gradients_and_jvps_equal_mlx_ops(path, compiled):
    rng = np.random.default_rng(2)
    x = mx.array(rng.normal(0, 3, (4, 6, 257)).astype(np.float32))
    w = mx.array(rng.normal(0, 1, (4, 6, 257)).astype(np.float32))
    pairs = [(fastmath.exp, mx.exp), (fastmath.sigmoid, mx.sigmoid),
             (fastmath.silu, lambda a: a * mx.sigmoid(a)),
             (fastmath.softmax, lambda a: mx.softmax(a, axis=-1, precise=True)),
             (lambda a: fastmath.softmax(a, axis=1), lambda a: mx.softmax(a, axis=1, precise=True))]
    for ours, theirs in pairs:
        def loss(fn):
            f = lambda a: (fn(a * 0.5) * w).sum()  # noqa: B023
            return mx.compile(mx.value_and_grad(f)) if compiled else mx.value_and_grad(f)
        (v1, g1), (v2, g2) = loss(ours)(x), loss(theirs)(x)
        np.testing.assert_allclose(v1.item(), v2.item(), rtol=2e-5)
        np.testing.assert_allclose(np.array(g1), np.array(g2), rtol=2e-5, atol=2e-6)
        (_,), (t1,) = mx.jvp(ours, [x], [w])
        (_,), (t2,) = mx.jvp(theirs, [x], [w])
        np.testing.assert_allclose(np.array(t1), np.array(t2), rtol=2e-5, atol=2e-6)


def test_exp_shift_and_logsumexp_equal_naive(path):
    rng = np.random.default_rng(1)
    z = rng.normal(0, 4, (6, 3001)).astype(np.float32)
    z[2, :] = -np.inf  # a fully masked row
    z[3, ::2] = -np.inf
    m = np.where(np.isfinite(z.max(1, keepdims=True)), z.max(1, keepdims=True), 0)
    ref = np.exp(z.astype(np.float64) - m)
    np.testing.assert_allclose(np.array(fastmath.exp_shift(mx.array(z), mx.array(m))), ref, rtol=5e-6, atol=1e-37)
    got = np.array(fastmath.logsumexp(mx.array(z), axis=-1))
    ref = np.array(mx.logsumexp(mx.array(z), axis=-1))
    assert got[2] == -np.inf and ref[2] == -np.inf
    np.testing.assert_allclose(np.delete(got, 2), np.delete(ref, 2), rtol=1e-6)
    np.testing.assert_allclose(np.array(fastmath.logsumexp(mx.array(z), keepdims=True))[:, 0], got)


def test_failed_build_warns_and_falls_back(tmp_path):
    code = ("import warnings, mlx.core as mx\nfrom mlxrl.cpu import fastmath, native\n"
            "with warnings.catch_warnings(record=True) as w:\n    warnings.simplefilter('always')\n"
            "    assert native.load() is None\n    assert native.load() is None\n"
            "print(len(w), str(w[0].message))\n"
            "print(fastmath.softmax(mx.array([0.0, 0.0])).tolist())\n")
    env = dict(os.environ, CXX=str(tmp_path / "no-such-compiler"), MLXRL_NATIVE_CACHE=str(tmp_path / "cache"))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    count, message = out.splitlines()[0].split(" ", 1)
    assert count == "1" and "no C++ compiler" in message and "MLXRL_NATIVE=0" in message
    assert out.splitlines()[1] == "[0.5, 0.5]"


@pytest.mark.parametrize("mask_kind", [None, "causal", "bool", "additive", "per-head"])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 2)])
@pytest.mark.parametrize("shape", [(5, 9, 16), (70, 75, 24), (130, 130, 8)])
def test_attention_equals_mlx_sdpa(path, mask_kind, heads, shape):
    """Values and gradients of q, k, v against mx.fast.scaled_dot_product_attention, grouped-query
    heads, queries shorter than keys (a cache offset). On the native path, no mask and "causal" with
    at least FLASH_MIN_QUERIES queries take the FlashAttention kernel: blocks of queries that end
    mid-way, a head_dim that is not a multiple of 16 (24, 8), up to 3 query heads per kv-head;
    (5, 9, 16) the scores path."""
    rng = np.random.default_rng(3)
    (hq, hkv), B, (L, S, D) = heads, 2, shape
    q, k, v = (mx.array(rng.normal(0, 1, shape).astype(np.float32))
               for shape in [(B, hq, L, D), (B, hkv, S, D), (B, hkv, S, D)])
    keep = rng.random((B, 1, L, S)) > 0.3
    keep[..., -1] = True
    mask = {None: None, "causal": "causal", "bool": mx.array(keep),
            "additive": mx.array(np.where(keep, 0.0, -1e9).astype(np.float32)),
            "per-head": mx.array(rng.random((B, hq, L, S)) > 0.2)}[mask_kind]
    w = mx.array(rng.normal(0, 1, (B, hq, L, D)).astype(np.float32))

    def run(fn):
        f = lambda q, k, v: (fn(q, k, v, scale=D**-0.5, mask=mask) * w).sum()
        return mx.value_and_grad(f, argnums=(0, 1, 2))(q, k, v)

    (v1, g1), (v2, g2) = run(fastmath.scaled_dot_product_attention), run(mx.fast.scaled_dot_product_attention)
    np.testing.assert_allclose(v1.item(), v2.item(), rtol=1e-5, atol=1e-5)
    for a, b in zip(g1, g2, strict=True):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", [(4, 2), (3, 3)])
@pytest.mark.parametrize("long", [False, True])
def test_flash_attention_lse_and_key_windows_equal_masked_reference(causal, heads, long):
    """The native kernel's output and log-sum-exp with per-row key windows (`fastmath.flash_attention`,
    what the prompt-shared forward uses) against the same computed with MLX's ops: scores, the window
    and causal mask, softmax. Values and the gradients of q, k, v from cotangents on both outputs (the
    lse's enters the kernel's backward); windows cut mid-block, one covers everything, one leaves the
    first queries of a causal row without keys (output 0, lse -inf, no gradient). `long`: keys over
    several of the backward's key chunks, a window starting in a later chunk."""
    skip_native_on_gpu("native")
    if native.load() is None:
        pytest.skip("native kernels not built")
    rng = np.random.default_rng(11)
    (hq, hkv), B, L, D = heads, 3, (300 if long else 37), 40
    S = L if causal else (560 if long else 53)
    q, k, v = (mx.array(rng.normal(0, 1, sh).astype(np.float32))
               for sh in [(B, hq, L, D), (B, hkv, S, D), (B, hkv, S, D)])
    bounds = mx.array([[261 if long else 5, S - 3], [0, S], [19, 30]], dtype=mx.int32)
    wo = mx.array(rng.normal(0, 1, (B, hq, L, D)).astype(np.float32))
    wl = mx.array(rng.normal(0, 1, (B, hq, L)).astype(np.float32))
    j = mx.arange(S)[None, None, None]
    see = (j >= bounds[:, 0, None, None, None]) & (j < bounds[:, 1, None, None, None])
    if causal:
        see = see & (j <= mx.arange(L)[None, None, :, None] + S - L)
    empty = ~see.any(axis=-1)  # [B, 1, L]
    scale = D**-0.5

    def reference(q, k, v):
        s = (q * scale) @ mx.repeat(k, hq // hkv, axis=1).swapaxes(-1, -2)
        m = mx.stop_gradient(mx.where(see, s, -mx.inf).max(axis=-1, keepdims=True))
        m = mx.where(mx.isfinite(m), m, 0.0)
        e = mx.where(see, mx.exp(s - m), 0.0)
        total = e.sum(axis=-1, keepdims=True)
        safe = mx.where(total > 0, total, 1.0)
        out = (e / safe) @ mx.repeat(v, hq // hkv, axis=1)
        lse = mx.where(total > 0, m + mx.log(safe), -mx.inf)[..., 0]
        return out, lse

    def ours(q, k, v):
        return fastmath.flash_attention(q, k, v, scale=scale, causal=causal, bounds=bounds)

    def loss(fn):
        def f(q, k, v):
            out, lse = fn(q, k, v)
            return (out * wo).sum() + (mx.where(empty, 0.0, lse) * wl).sum()
        return mx.value_and_grad(f, argnums=(0, 1, 2))(q, k, v)

    (o1, l1), (o2, l2) = ours(q, k, v), reference(q, k, v)
    np.testing.assert_allclose(np.array(o1), np.array(o2), rtol=1e-4, atol=1e-5)
    finite = ~np.array(mx.broadcast_to(empty, l2.shape))
    np.testing.assert_allclose(np.array(l1)[finite], np.array(l2)[finite], rtol=1e-5, atol=1e-5)
    assert bool(empty.any()) == causal and np.isneginf(np.array(l1)[~finite]).all()
    assert not np.array(o1)[~finite].any()
    (v1, g1), (v2, g2) = loss(ours), loss(reference)
    np.testing.assert_allclose(v1.item(), v2.item(), rtol=1e-5, atol=1e-4)
    for a, b in zip(g1, g2, strict=True):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-4, atol=1e-5)


def test_flash_attention_keeps_no_score_array():
    """The native causal attention's forward + backward peak above its inputs stays below half of one
    [Hq, L, L] float32 score square, where the same computation through materialised scores (a boolean
    causal mask: the scores path) holds more than two such squares."""
    skip_native_on_gpu("native")
    if native.load() is None:
        pytest.skip("no native kernels")
    rng = np.random.default_rng(0)
    B, hq, hkv, L, D = 1, 8, 4, 1024, 64
    q, k, v, w = (mx.array(rng.normal(0, 1, s).astype(np.float32))
                  for s in [(B, hq, L, D), (B, hkv, L, D), (B, hkv, L, D), (B, hq, L, D)])
    square = hq * L * L * 4
    causal = mx.array(np.tril(np.ones((L, L), dtype=bool)))

    def peak(mask):
        f = lambda q, k, v: (fastmath.scaled_dot_product_attention(q, k, v, scale=D**-0.5, mask=mask) * w).sum()
        mx.eval(q, k, v, w)
        mx.clear_cache()
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        mx.eval(mx.grad(f, argnums=(0, 1, 2))(q, k, v))
        return mx.get_peak_memory() - base

    flash, scores = peak("causal"), peak(causal)
    assert flash < 0.5 * square, (flash, square)
    assert scores > 2 * square, (scores, square)


def test_softmax_second_order_equals_mlx(path):
    """The VJP of the softmax's VJP (SoftmaxGrad's own VJP, both arguments) against MLX's softmax."""
    rng = np.random.default_rng(5)
    x = mx.array(rng.normal(0, 3, (2, 3, 4, 9)).astype(np.float32))
    g = mx.array(rng.normal(0, 1, (2, 3, 4, 9)).astype(np.float32))

    def second(fn):  # d/dx of <vjp(fn)(x, g), g>
        return mx.grad(lambda y: (mx.vjp(fn, [y], [g])[1][0] * g).sum())(x)

    ref = second(lambda a: mx.softmax(a, axis=-1, precise=True))
    np.testing.assert_allclose(np.array(second(fastmath.softmax)), np.array(ref), rtol=1e-4, atol=1e-5)


def test_sum_squares_equals_float64(path):
    rtol = 2e-6 if path == "native" else 1e-3  # native accumulates in double; MLX sums in float32 (2.5e-4 off at 600k)
    rng = np.random.default_rng(4)
    for shape in [(0,), (3,), (1000, 37), (600_001,)]:
        x = rng.normal(0, 2, shape).astype(np.float32)
        got = fastmath.sum_squares(mx.array(x))
        assert got.dtype == mx.float32 and got.shape == ()
        np.testing.assert_allclose(got.item(), (x.astype(np.float64) ** 2).sum(), rtol=rtol)
    x = mx.array(rng.normal(0, 1, (300, 400)).astype(np.float32)).T  # non-contiguous
    np.testing.assert_allclose(fastmath.sum_squares(x).item(), (np.array(x).astype(np.float64) ** 2).sum(), rtol=rtol)


def _torch_decoder_ops():
    """The decoder's RMSNorm, rotary embedding and SwiGLU product in float64 torch (the reference)."""
    import torch

    def rms_norm(x, w, eps):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    def rotary(x, cos, sin):
        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin

    def silu_mul(g, u):
        return torch.nn.functional.silu(g) * u

    return torch, rms_norm, rotary, silu_mul


def test_layer_norm_and_gelu_gradients_equal_float64_torch(path):
    """LayerNorm (weight and bias: the vision towers') and GELU's tanh form: values and the gradients of
    every input, under a non-uniform cotangent, equal float64 torch autograd, eagerly and compiled, with
    the input a temporary whose buffer the kernel may take."""
    import torch

    rng = np.random.default_rng(11)
    arrays = {"x": rng.normal(0.5, 2, (3, 7, 48)), "w": rng.normal(1, 0.3, (48,)), "b": rng.normal(0, 0.5, (48,)),
              "h": np.concatenate([rng.normal(0, 3, (6, 200)), np.full((1, 200), 12.0)])}
    weights = {"ln": rng.normal(0, 1, (3, 7, 48)), "gelu": rng.normal(0, 1, (7, 200))}
    eps = 1e-6

    def loss(a):
        ln = fastmath.layer_norm(a["x"] * 1.0, a["w"], a["b"], eps)
        gelu = fastmath.gelu_approx(a["h"] * 1.0)
        return (ln * mx.array(weights["ln"].astype(np.float32))).sum() + \
            (gelu * mx.array(weights["gelu"].astype(np.float32))).sum()

    t = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in arrays.items()}
    t_ln = torch.nn.functional.layer_norm(t["x"], (48,), t["w"], t["b"], eps)
    t_gelu = torch.nn.functional.gelu(t["h"], approximate="tanh")
    t_loss = (t_ln * torch.tensor(weights["ln"])).sum() + (t_gelu * torch.tensor(weights["gelu"])).sum()
    t_loss.backward()
    a = {k: mx.array(v.astype(np.float32)) for k, v in arrays.items()}
    np.testing.assert_allclose(np.array(fastmath.layer_norm(a["x"], a["w"], a["b"], eps)), t_ln.detach().numpy(),
                               rtol=1e-5, atol=1e-5)
    for compiled in (False, True):
        fn = mx.value_and_grad(loss)
        value, grads = (mx.compile(fn) if compiled else fn)(a)
        np.testing.assert_allclose(value.item(), t_loss.item(), rtol=1e-5, atol=1e-3)
        for k in arrays:
            np.testing.assert_allclose(np.array(grads[k]), t[k].grad.numpy(), rtol=1e-4, atol=1e-4, err_msg=k)
    # the x gradient alone (the kernel without the weight / bias sums), and the JVP
    gx = mx.grad(lambda x: (fastmath.layer_norm(x, a["w"], a["b"], eps) * mx.array(weights["ln"])).sum())(a["x"])
    np.testing.assert_allclose(np.array(gx), t["x"].grad.numpy(), rtol=1e-4, atol=1e-4)
    tangent = mx.array(rng.normal(0, 1, (7, 200)).astype(np.float32))
    _, (jvp,) = mx.jvp(fastmath.gelu_approx, [a["h"]], [tangent])
    _, (ref_jvp,) = mx.jvp(lambda h: h * mx.sigmoid(1.5957691216057308 * (h + 0.044715 * h**3)), [a["h"]], [tangent])
    np.testing.assert_allclose(np.array(jvp), np.array(ref_jvp), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("compiled", [False, True])
def test_decoder_ops_and_gradients_equal_float64_torch(path, compiled):
    """RMSNorm, rotary (x a transposed view, cos / sin broadcast over heads, halves that differ) and
    silu(g) u: values and the gradients of every input equal float64 torch autograd, on both paths."""
    torch, t_rms, t_rot, t_silu = _torch_decoder_ops()
    rng = np.random.default_rng(5)
    B, L, H, D = 2, 9, 3, 16
    arrays = {
        "x": rng.normal(0, 2, (B, L, 40)), "w": rng.normal(1, 0.3, (40,)),
        "q": rng.normal(0, 1, (B, L, H, D)), "cos": rng.normal(0, 1, (B, 1, L, D)),
        "sin": rng.normal(0, 1, (B, 1, L, D)), "g": rng.normal(0, 3, (B, L, 40)), "u": rng.normal(0, 1, (B, L, 40)),
    }
    weights = {"rms": rng.normal(0, 1, (B, L, 40)), "rot": rng.normal(0, 1, (B, H, L, D)),
               "silu": rng.normal(0, 1, (B, L, 40))}
    eps = 1e-5

    def ours(a):
        rms = fastmath.rms_norm(a["x"], a["w"], eps)
        rot = fastmath.rotary(a["q"].transpose(0, 2, 1, 3), a["cos"], a["sin"])
        silu = fastmath.silu_mul(a["g"], a["u"])
        return [rms, rot, silu]

    def loss(a):
        outs = ours(a)
        return sum((o * mx.array(weights[k].astype(np.float32))).sum() for o, k in zip(outs, weights, strict=True))

    a = {k: mx.array(v.astype(np.float32)) for k, v in arrays.items()}
    grad_fn = mx.value_and_grad(loss)
    value, grads = (mx.compile(grad_fn) if compiled else grad_fn)(a)
    outs = ours(a)

    t = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in arrays.items()}
    t_outs = [t_rms(t["x"], t["w"], eps), t_rot(t["q"].transpose(1, 2), t["cos"], t["sin"]), t_silu(t["g"], t["u"])]
    t_loss = sum((o * torch.tensor(weights[k])).sum() for o, k in zip(t_outs, weights, strict=True))
    t_loss.backward()
    for o, r in zip(outs, t_outs, strict=True):
        np.testing.assert_allclose(np.array(o), r.detach().numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(value.item(), t_loss.item(), rtol=1e-4, atol=1e-3)
    for k in arrays:
        np.testing.assert_allclose(np.array(grads[k]), t[k].grad.numpy(), rtol=1e-4, atol=1e-4, err_msg=k)


def test_decoder_ops_route_to_native_only_in_float32():
    """bfloat16 (the graph path's dtype) takes MLX's ops, in its own dtype; float32 CPU the kernels."""
    x = mx.ones((2, 3, 8))
    w = mx.ones((8,))
    y = fastmath.rms_norm(x.astype(mx.bfloat16), w.astype(mx.bfloat16), 1e-6)
    assert y.dtype == mx.bfloat16
    np.testing.assert_allclose(np.array(y.astype(mx.float32)), np.array(fastmath.rms_norm(x, w, 1e-6)), rtol=1e-2)
    assert fastmath.silu_mul(x.astype(mx.bfloat16), x.astype(mx.bfloat16)).dtype == mx.bfloat16
    q = mx.ones((1, 2, 3, 8), dtype=mx.bfloat16)
    assert fastmath.rotary(q, mx.ones((1, 1, 3, 8)), mx.zeros((1, 1, 3, 8))).dtype == mx.bfloat16


@pytest.mark.parametrize("compiled", [False, True])
def test_decoder_ops_correct_when_buffers_are_donated(path, compiled):
    """Inputs and cotangents that are temporaries (used once) give their buffers to the kernels'
    outputs, which are then written in place; values and gradients still equal float64 torch."""
    torch, t_rms, t_rot, t_silu = _torch_decoder_ops()
    rng = np.random.default_rng(7)
    x = rng.normal(0, 1, (2, 3, 5, 16))
    cos, sin = rng.normal(0, 1, (2, 1, 5, 16)), rng.normal(0, 1, (2, 1, 5, 16))
    w, g = rng.normal(1, 0.2, (16,)), rng.normal(0, 2, (2, 3, 5, 16))
    weight = rng.normal(0, 1, (2, 3, 5, 16))
    m = {k: mx.array(v.astype(np.float32)) for k, v in dict(cos=cos, sin=sin, w=w, g=g, weight=weight).items()}
    ops = {
        "rotary": (lambda a: fastmath.rotary(a * 2.0, m["cos"], m["sin"]), lambda a: t_rot(a * 2.0, cos_t, sin_t)),
        "rms_norm": (lambda a: fastmath.rms_norm(a * 2.0, m["w"], 1e-6), lambda a: t_rms(a * 2.0, w_t, 1e-6)),
        "silu_mul": (lambda a: fastmath.silu_mul(a * 2.0, m["g"] * 1.0), lambda a: t_silu(a * 2.0, g_t)),
    }
    cos_t, sin_t, w_t, g_t = (torch.tensor(v) for v in (cos, sin, w, g))
    for name, (ours, ref) in ops.items():
        fn = mx.value_and_grad(lambda a: (ours(a) * m["weight"]).sum())  # noqa: B023
        value, grad = (mx.compile(fn) if compiled else fn)(mx.array(x.astype(np.float32)))
        xt = torch.tensor(x, requires_grad=True)
        t_value = (ref(xt) * torch.tensor(weight)).sum()
        t_value.backward()
        np.testing.assert_allclose(value.item(), t_value.item(), rtol=1e-4, atol=1e-3, err_msg=name)
        np.testing.assert_allclose(np.array(grad), xt.grad.numpy(), rtol=1e-4, atol=1e-4, err_msg=name)


def test_gelu_approx_equals_float64_torch_formula(path):
    """`fastmath.gelu_approx` (native: x sigmoid(2 sqrt(2/pi) (x + 0.044715 x^3))) is torch's
    gelu(approximate="tanh") computed in float64 (value and gradient), as `nn.gelu_approx` is."""
    import mlx.nn as nn
    import torch

    rng = np.random.default_rng(3)
    x = np.concatenate([rng.normal(0, 3, 20_000), [-30.0, -10.0, 0.0, 10.0, 30.0]]).astype(np.float32)
    t = torch.tensor(x.astype(np.float64), requires_grad=True)
    ref = torch.nn.functional.gelu(t, approximate="tanh")
    ref.sum().backward()
    got = fastmath.gelu_approx(mx.array(x))
    grad = mx.grad(lambda a: fastmath.gelu_approx(a).sum())(mx.array(x))
    np.testing.assert_allclose(np.array(got), ref.detach().numpy(), rtol=1e-5, atol=2e-6)
    np.testing.assert_allclose(np.array(grad), t.grad.numpy(), rtol=1e-4, atol=2e-6)
    mlx_ref = np.array(nn.gelu_approx(mx.array(x)))
    err, mlx_err = (np.abs(a - ref.detach().numpy()).max() for a in (np.array(got), mlx_ref))
    assert err <= max(1e-6, 2 * mlx_err), (err, mlx_err)
