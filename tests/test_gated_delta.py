"""The gated delta rule op (`mlxrl.models.gated_delta`) against independent references: a float64 NumPy
recurrence written here (values), torch autograd of transformers' `torch_chunk_gated_delta_rule` (gradients,
and its calling convention: the q scaling, the L2 normalisation, the key-head groups), documents run one by
one (packing), padded rows against unpadded ones, the float32 result (bf16 inputs), the step function,
mx.compile, and MLX's own autograd of the same chunked forward (peak memory).

Tests taking the `path` fixture run twice: "native" (float32 CPU arrays through the C++ kernel,
`mlxrl/cpu/native/gated_delta.cpp`) and "graph" (MLX's ops: what Metal, CUDA, bf16 and MLXRL_NATIVE=0 run);
the fixture checks that every call of the op took that path (bf16 calls the graph). The torch references are
computed once for both.

    pytest tests/test_gated_delta.py
"""

import mlxrl  # noqa: F401, I001  (first: the fast BLAS before mlx.core)
import functools

import mlx.core as mx
import numpy as np
import pytest
from conftest import skip_native_on_gpu

from mlxrl.cpu import native
from mlxrl.models import gated_delta, triangular
from mlxrl.models.gated_delta import gated_delta_rule, gated_delta_step, unit_lower_inverse

torch = pytest.importorskip("torch")
qwen3_5 = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")

LENGTHS = [1, 63, 64, 65, 130, 200]
# (Hk, Hv, dk, dv): equal heads and widths; key-head groups (Hv = 3 Hk) with dk != dv
WIDTHS = [(2, 2, 16, 16), (1, 3, 8, 12)]


@pytest.fixture
def path(kernel_path, monkeypatch):
    """The path under test ("native" or "graph", conftest's `kernel_path`); at the end, checks that the op's
    dispatch chose it for every float32 call (the native kernel really ran) and the graph for any other."""
    chosen = []
    real = gated_delta._path

    def spy(*arrays):
        chosen.append((all(x.dtype == mx.float32 for x in arrays), real(*arrays)))
        return chosen[-1][1]

    monkeypatch.setattr(gated_delta, "_path", spy)
    yield kernel_path
    assert chosen, "the op was not called through its dispatch"
    assert all(took == (kernel_path if f32 else "graph") for f32, took in chosen), chosen


def _rel(a, b, floor=1e-2) -> float:
    """max |a - b| / max |b|, the scale at least `floor` (a gradient that is zero in exact arithmetic, g's
    where the state it decays is zero, is rounding noise in the reference)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), floor))


def _data(seed, B, T, Hk, Hv, dk, dv, normalise=True):
    """float64 inputs: q, k unit vectors (as the L2 norm leaves them) unless normalise=False, g in [-1, -0.01],
    beta in (0, 1), an initial state, and random weights for the loss."""
    rng = np.random.default_rng(seed)
    q, k = rng.standard_normal((B, T, Hk, dk)), rng.standard_normal((B, T, Hk, dk))
    if normalise:
        q, k = q / np.linalg.norm(q, axis=-1, keepdims=True), k / np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((B, T, Hv, dv))
    g = -rng.uniform(0.01, 1.0, (B, T, Hv))
    beta = rng.uniform(0.0, 1.0, (B, T, Hv))
    s0 = 0.5 * rng.standard_normal((B, Hv, dk, dv))
    w_out, w_state = rng.standard_normal((B, T, Hv, dv)), rng.standard_normal((B, Hv, dk, dv))
    return q, k, v, g, beta, s0, w_out, w_state


def _recurrence(q, k, v, g, beta, s0, starts=None):
    """The gated delta rule token by token in float64 (q scaled by 1/sqrt(dk); value head h reads key head
    h // (Hv / Hk)); starts [B, T]: the state is zero before a document's first token."""
    Hk, dk = q.shape[-2:]
    Hv = v.shape[-2]
    q = np.repeat(q, Hv // Hk, axis=2) / np.sqrt(dk)
    k = np.repeat(k, Hv // Hk, axis=2)
    S = s0.copy()
    out = np.zeros(v.shape)
    for t in range(q.shape[1]):
        if starts is not None:
            S = np.where(starts[:, t, None, None, None], 0.0, S)
        S = S * np.exp(g[:, t])[..., None, None]
        delta = beta[:, t, :, None] * (v[:, t] - np.einsum("bhkv,bhk->bhv", S, k[:, t]))
        S = S + k[:, t, :, :, None] * delta[:, :, None, :]
        out[:, t] = np.einsum("bhkv,bhk->bhv", S, q[:, t])
    return out, S


def _mx(*xs, dtype=mx.float32):
    return [mx.array(np.asarray(x, np.float32)).astype(dtype) for x in xs]


def _mlx_grads(q, k, v, g, beta, s0, w_out, w_state, with_state=True, starts=None, l2=True, dtype=mx.float32,
               **kw):
    """(out, final, gradients of sum(out w_out) + sum(final w_state) w.r.t. q, k, v, g, beta, s0) as float32
    NumPy; the inputs in `dtype`."""
    W, WS = _mx(w_out, w_state)
    ds = None if starts is None else mx.array(starts)

    def loss(q, k, v, g, beta, s0):
        out, final = gated_delta_rule(q, k, v, g, beta, s0 if with_state else None, ds,
                                      use_qk_l2norm_in_kernel=l2, **kw)
        return (out.astype(mx.float32) * W).sum() + (final * WS).sum(), (out, final)

    ins = _mx(q, k, v, g, beta, s0, dtype=dtype)
    (_, (out, final)), grads = mx.value_and_grad(loss, argnums=list(range(6)))(*ins)
    return np.array(out.astype(mx.float32)), np.array(final), [np.array(x.astype(mx.float32)) for x in grads]


def _torch_grads(q, k, v, g, beta, s0, w_out, w_state, with_state=True):
    """The same loss through transformers' training path, under torch autograd."""
    ts = [torch.tensor(x, requires_grad=True) for x in (q, k, v, g, beta, s0)]
    out, final = qwen3_5.torch_chunk_gated_delta_rule(*ts[:5], initial_state=ts[5] if with_state else None,
                                                       output_final_state=True, use_qk_l2norm_in_kernel=True)
    ((out * torch.tensor(w_out)).sum() + (final * torch.tensor(w_state)).sum()).backward()
    return out.detach().numpy(), final.detach().numpy(), [t.grad.numpy() if t.grad is not None else None for t in ts]


@functools.cache
def _torch_case(T, widths, with_state):
    """The gradient test's data and torch's results for it, computed once for both paths."""
    data = _data(100 + T, 2, T, *widths, normalise=False)
    return data, _torch_grads(*data, with_state=with_state)


# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("T", LENGTHS)
@pytest.mark.parametrize("widths", WIDTHS)
@pytest.mark.parametrize("with_state", [False, True])
def test_values_match_float64_recurrence(T, widths, with_state, path):
    q, k, v, g, beta, s0, _, _ = _data(T, 2, T, *widths)
    s0 = s0 if with_state else np.zeros_like(s0)
    ref_out, ref_final = _recurrence(q, k, v, g, beta, s0)
    out, final = gated_delta_rule(*_mx(q, k, v, g, beta), _mx(s0)[0] if with_state else None)
    assert out.shape == v.shape and out.dtype == mx.float32
    assert final.shape == s0.shape and final.dtype == mx.float32
    assert _rel(out, ref_out) < 1e-5
    assert _rel(final, ref_final) < 1e-5


@pytest.mark.parametrize("T", LENGTHS)
@pytest.mark.parametrize("widths", WIDTHS)
@pytest.mark.parametrize("with_state", [False, True])
def test_gradients_match_transformers_under_torch_autograd(T, widths, with_state, path):
    # raw q and k: the L2 normalisation (use_qk_l2norm_in_kernel, as Qwen3.5 calls it) is differentiated too
    data, (t_out, t_final, t_grads) = _torch_case(T, widths, with_state)
    out, final, grads = _mlx_grads(*data, with_state=with_state)
    assert _rel(out, t_out) < 1e-5 and _rel(final, t_final) < 1e-5
    names = ["q", "k", "v", "g", "beta", "initial_state"]
    for name, ours, theirs in zip(names if with_state else names[:5], grads, t_grads, strict=False):
        assert ours.shape == theirs.shape
        assert _rel(ours, theirs) <= 1e-4, name


@pytest.mark.parametrize("group", [1, 2])
def test_every_grouping_of_chunks_on_the_graph_path_matches_transformers(group, monkeypatch):
    """The graph path runs `group_chunks` chunks side by side (the tests' shapes fit one group): one chunk at
    a time, and two (200 tokens: groups of 2 and 1, then the short last chunk), give transformers' values and
    gradients, an initial state and key-head groups included."""
    monkeypatch.setattr(gated_delta, "group_chunks", lambda *shape, **kw: group)
    monkeypatch.setattr(gated_delta, "_path", lambda *arrays: "graph")
    data, (t_out, t_final, t_grads) = _torch_case(200, WIDTHS[1], True)
    out, final, grads = _mlx_grads(*data)
    assert _rel(out, t_out) < 1e-5 and _rel(final, t_final) < 1e-5
    for ours, theirs in zip(grads, t_grads, strict=True):
        assert _rel(ours, theirs) <= 1e-4


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_groupings_agree_with_documents(dtype, monkeypatch):
    """Documents crossing chunk and group boundaries, an initial state, float32 and bf16 inputs: groups of one
    and of two chunks give the single group's values and gradients (the state, its cotangent and the results'
    pieces pass between groups)."""
    monkeypatch.setattr(gated_delta, "_path", lambda *arrays: "graph")
    (q, k, v, g, beta, s0, w_out, w_state), starts, _ = _packed(43)
    want = _mlx_grads(q, k, v, g, beta, s0, w_out, w_state, starts=starts, dtype=dtype)
    for group in (1, 2):
        monkeypatch.setattr(gated_delta, "group_chunks", lambda *shape, n=group, **kw: n)
        got = _mlx_grads(q, k, v, g, beta, s0, w_out, w_state, starts=starts, dtype=dtype)
        for a, b in zip([got[0], got[1], *got[2]], [want[0], want[1], *want[2]], strict=True):
            assert _rel(a, b) < (1e-2 if dtype == mx.bfloat16 else 1e-5), group


def test_group_chunks_follow_the_memory_budget():
    """Narrow or short sequences: every chunk in one group (the floor of the budget). Qwen3.5-0.8B's DeltaNet
    widths: groups grow with the length (the budget is a share of what the op holds anyway, which grows with
    it) and stop at the cap; a group's estimated working set stays within the budget."""
    gd = gated_delta
    assert gd.group_chunks(1, 2048, 2, 2, 16, 16) == 32
    assert gd.group_chunks(2, 200, 1, 3, 8, 12) == 3
    assert gd.group_chunks(1, 10, 2, 2, 16, 16) == 1  # no full chunk: the short one alone
    sizes = [gd.group_chunks(1, T, 16, 16, 128, 128) for T in (2048, 4096, 8192, 16384, 1 << 17)]
    assert sizes == sorted(sizes) and 1 < sizes[0] < sizes[2] < 2048 // 64
    w = gd.CHUNK_WORK
    per_chunk = 4 * 16 * (w["CC"] * 64 * 64 + w["CD"] * 64 * 128 + w["DD"] * 128 * 128)
    assert sizes[-1] * per_chunk <= gd.GROUP_BYTES[1] < (sizes[-1] + 1) * per_chunk


def _primitives(T, tmp_path, Hk=1, Hv=1, d=16):
    """The primitives of one value_and_grad of the op (graph path, l2 norm, an initial state, documents): the
    nodes of `mx.export_to_dot` of its unevaluated results."""
    q, k, v, g, beta, s0, w_out, _ = _mx(*_data(3, 1, T, Hk, Hv, d, d, normalise=False))
    starts = mx.array(np.arange(T)[None] % 700 == 300)

    def loss(q, k, v, g, beta, s0):
        out, final = gated_delta_rule(q, k, v, g, beta, s0, starts, use_qk_l2norm_in_kernel=True)
        return (out * w_out).sum() + final.sum()

    value, grads = mx.value_and_grad(loss, argnums=list(range(6)))(q, k, v, g, beta, s0)
    dot = tmp_path / f"graph_{T}.dot"
    mx.export_to_dot(str(dot), value, *grads)
    return dot.read_text().count("shape=rectangle")


def test_graph_path_primitives_per_chunk(tmp_path, monkeypatch):
    """The graph path's forward + backward adds few primitives per 64-token chunk: within a group only the
    state's passage loops over chunks (one multiply-add per chunk each way, the operands split beforehand),
    and at these widths every chunk is in one group. 1024 -> 2048 tokens: 16 more chunks."""
    monkeypatch.setattr(native, "load", lambda: None)
    assert gated_delta._path(*_mx(np.zeros((1, 4, 1, 16)), np.zeros((1, 4, 1, 16)), np.zeros((1, 4, 1, 16)),
                                  np.zeros((1, 4, 1)), np.zeros((1, 4, 1)), np.zeros((1, 1, 16, 16)))) == "graph"
    short, long = _primitives(1024, tmp_path), _primitives(2048, tmp_path)
    assert (long - short) / 16 <= 12, (short, long)


def test_scale_and_no_normalisation_follow_the_recurrence(path):
    q, k, v, g, beta, s0, _, _ = _data(7, 2, 70, 2, 4, 8, 8)
    ref_out, _ = _recurrence(q * 3.0, k, v, g, beta, s0)  # scale 3/sqrt(dk)
    out, _ = gated_delta_rule(*_mx(q, k, v, g, beta, s0), scale=3.0 / np.sqrt(8))
    assert _rel(out, ref_out) < 1e-5


@pytest.mark.parametrize("chunk", [16, 50])
def test_other_chunk_lengths_give_the_same_op(chunk, path):
    """Chunks of 16 and of 50 (not a multiple of the kernel's 16-float padding): the recurrence's values and
    chunk 64's gradients, with documents crossing the chunk boundaries."""
    (q, k, v, g, beta, s0, w_out, w_state), starts, _ = _packed(31)
    out, final, grads = _mlx_grads(q, k, v, g, beta, s0, w_out, w_state, starts=starts, l2=False, chunk=chunk)
    ref_out, ref_final = _recurrence(q, k, v, g, beta, s0, starts)
    assert _rel(out, ref_out) < 1e-5 and _rel(final, ref_final) < 1e-5
    _, _, want = _mlx_grads(q, k, v, g, beta, s0, w_out, w_state, starts=starts, l2=False)
    for a, b in zip(grads, want, strict=True):
        assert _rel(a, b) < 1e-4


def test_padded_rows_equal_the_unpadded_sequence(path):
    """Padding as Qwen3.5's layer feeds it (g = 0 and beta = 0 at padded positions, which neither decay nor
    write the state; left padding's q, k, v are zero there, the L2 norm of a zero vector included): the real
    positions' outputs and gradients and the final state are the unpadded row's."""
    T, pad = 100, 37
    q, k, v, g, beta, s0, w_out, w_state = _data(37, 2, T, 1, 2, 8, 8, normalise=False)
    real = np.ones((2, T), bool)
    real[0, :pad] = False  # row 0 left-padded, row 1 right-padded (its padded q, k, v: the convolution's tail)
    real[1, T - pad:] = False
    left = np.zeros((2, T, 1, 1), bool)
    left[0, :pad] = True
    q, k, v = (np.where(left, 0.0, x) for x in (q, k, v))
    g, beta, w_out = g * real[..., None], beta * real[..., None], w_out * real[..., None, None]
    out, final, grads = _mlx_grads(q, k, v, g, beta, s0, w_out, w_state)
    for row in range(2):
        keep = real[row]
        one = [x[row:row + 1, keep] for x in (q, k, v, g, beta)]
        r_out, r_final, r_grads = _mlx_grads(*one, s0[row:row + 1], w_out[row:row + 1, keep], w_state[row:row + 1])
        assert _rel(out[row, keep], r_out[0]) < 1e-5 and _rel(final[row], r_final[0]) < 1e-5
        for ours, alone in zip(grads[:5], r_grads, strict=False):
            assert np.isfinite(ours[row]).all()
            assert _rel(ours[row, keep], alone[0]) < 1e-4
        assert _rel(grads[5][row], r_grads[5][0]) < 1e-4


# ---------------------------------------------------------------------------------------------------------
# packed rows


def _packed(seed):
    """Two rows of documents (lengths crossing chunk boundaries; one of 64, one of a single token); row 0's
    first document continues the initial state, row 1 starts a document at position 0 (the state restarts)."""
    lengths = [[50, 90, 60], [64, 1, 135]]
    T = 200
    data = _data(seed, 2, T, 1, 2, 16, 8, normalise=False)
    starts = np.zeros((2, T), bool)
    for row, ls in enumerate(lengths):
        starts[row, np.cumsum([0] + ls[:-1])] = True
    starts[0, 0] = False
    return data, starts, lengths


def test_documents_equal_separate_runs_values_and_gradients(path):
    (q, k, v, g, beta, s0, w_out, w_state), starts, lengths = _packed(5)
    out, final, grads = _mlx_grads(q, k, v, g, beta, s0, w_out, w_state, starts=starts)
    for row, ls in enumerate(lengths):
        bounds = np.cumsum([0] + ls)
        for n, (s, e) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
            continues = row == 0 and n == 0
            last = n == len(ls) - 1
            one = [x[row:row + 1, s:e] for x in (q, k, v, g, beta)]
            s0_doc = s0[row:row + 1] if continues else np.zeros_like(s0[row:row + 1])
            w_final = w_state[row:row + 1] if last else np.zeros_like(w_state[row:row + 1])
            d_out, d_final, d_grads = _mlx_grads(*one, s0_doc, w_out[row:row + 1, s:e], w_final)
            assert _rel(out[row, s:e], d_out[0]) < 1e-5
            if last:
                assert _rel(final[row], d_final[0]) < 1e-5
            for name, ours, alone in zip(["q", "k", "v", "g", "beta"], grads, d_grads, strict=False):
                assert _rel(ours[row:row + 1, s:e], alone) < 1e-4, (row, n, name)
            if continues:
                assert _rel(grads[5][row], d_grads[5][0]) < 1e-4
    assert np.abs(grads[5][1]).max() == 0.0  # row 1 restarts at position 0: its initial state is unread
    # and the float64 recurrence with resets agrees on the values
    ref_out, ref_final = _recurrence(q / np.linalg.norm(q, axis=-1, keepdims=True),
                                     k / np.linalg.norm(k, axis=-1, keepdims=True), v, g, beta, s0, starts)
    assert _rel(out, ref_out) < 1e-5 and _rel(final, ref_final) < 1e-5


def test_reset_after_strong_decay_keeps_the_small_decays(path):
    """A document start after a run of strongly negative g in the same chunk: the next document's small decays
    must not be differences of large cumulative sums (as a reset written as g = -1e4 would make them)."""
    q, k, v, g, beta, _, _, _ = _data(9, 1, 64, 1, 1, 8, 8)
    g[:, :32], g[:, 32:] = -40.0, -0.003
    starts = np.zeros((1, 64), bool)
    starts[0, 32] = True
    zeros = np.zeros((1, 1, 8, 8))
    ref_out, ref_final = _recurrence(q, k, v, g, beta, zeros, starts)
    out, final = gated_delta_rule(*_mx(q, k, v, g, beta), doc_starts=mx.array(starts))
    assert _rel(out, ref_out) < 1e-5 and _rel(final, ref_final) < 1e-5


# ---------------------------------------------------------------------------------------------------------
# precision: against float64, next to transformers' float32


def _qwen_data(seed, B, T, documents):
    """float64 inputs with Qwen3.5's decays, g = -exp(A_log) softplus(a + dt_bias) with A_log = log U(0.01, 16)
    per head and a varying per token (g from about -1e-3 to -50 within one head: strong decays next to weak
    ones), key-head groups, an initial state; with documents, row 0 continues the state into two more documents
    and row 1 starts one at position 0 and one mid-row (the starts cross chunk boundaries)."""
    rng = np.random.default_rng(seed)
    Hk, Hv, dk, dv = 1, 3, 16, 8
    q, k = rng.standard_normal((B, T, Hk, dk)), rng.standard_normal((B, T, Hk, dk))
    v = rng.standard_normal((B, T, Hv, dv))
    A_log, dt_bias = np.log(rng.uniform(0.01, 16, Hv)), 1 + 0.5 * rng.standard_normal(Hv)
    g = -np.exp(A_log) * np.logaddexp(0.0, 2 * rng.standard_normal((B, T, Hv)) + dt_bias)
    beta = 1 / (1 + np.exp(-2 * rng.standard_normal((B, T, Hv))))
    s0 = 0.5 * rng.standard_normal((B, Hv, dk, dv))
    w_out, w_state = rng.standard_normal((B, T, Hv, dv)), rng.standard_normal((B, Hv, dk, dv))
    starts = None
    if documents:
        starts = np.zeros((B, T), bool)
        starts[0, [T // 3, T // 3 + 70]] = True
        starts[1, [0, T // 2]] = True
    return (q, k, v, g, beta, s0, w_out, w_state), starts


def _float64_grads(q, k, v, g, beta, s0, w_out, w_state, starts):
    """The gradients of `_mlx_grads`' loss (q, k L2-normalised in the op) in float64: torch autograd of the
    recurrence token by token, the state zeroed before each document's first token."""
    ts = [torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in (q, k, v, g, beta, s0)]
    Hk, dk = q.shape[-2:]
    rep = v.shape[-2] // Hk
    Q, K = (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in ts[:2])
    Q, K = (Q * dk ** -0.5).repeat_interleave(rep, 2), K.repeat_interleave(rep, 2)
    S, outs = ts[5], []
    for t in range(q.shape[1]):
        if starts is not None:
            S = S * torch.tensor(~starts[:, t], dtype=torch.float64)[:, None, None, None]
        S = S * torch.exp(ts[3][:, t])[..., None, None]
        delta = ts[4][:, t, :, None] * (ts[2][:, t] - torch.einsum("bhkv,bhk->bhv", S, K[:, t]))
        S = S + K[:, t, :, :, None] * delta[:, :, None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", S, Q[:, t]))
    ((torch.stack(outs, 1) * torch.tensor(w_out)).sum() + (S * torch.tensor(w_state)).sum()).backward()
    return [t.grad.numpy() for t in ts]


def _transformers_float32_grads(q, k, v, g, beta, s0, w_out, w_state, starts):
    """The same gradients from transformers' float32 training path (torch_chunk_gated_delta_rule under torch
    autograd), one call per document (it knows no documents): what float32 achieves there."""
    B, T = q.shape[:2]
    grads = [np.zeros_like(x) for x in (q, k, v, g, beta, s0)]
    for row in range(B):
        cuts = [] if starts is None else [int(t) for t in np.flatnonzero(starts[row]) if t > 0]
        bounds = [0, *cuts, T]
        for s, e in zip(bounds[:-1], bounds[1:], strict=True):
            continues = s == 0 and (starts is None or not starts[row, 0])
            ts = [torch.tensor(x[row:row + 1, s:e], dtype=torch.float32, requires_grad=True)
                  for x in (q, k, v, g, beta)]
            state = torch.tensor(s0[row:row + 1] * continues, dtype=torch.float32, requires_grad=True)
            out, final = qwen3_5.torch_chunk_gated_delta_rule(*ts, initial_state=state, output_final_state=True,
                                                               use_qk_l2norm_in_kernel=True)
            loss = (out * torch.tensor(w_out[row:row + 1, s:e], dtype=torch.float32)).sum()
            if e == T:
                loss = loss + (final * torch.tensor(w_state[row:row + 1], dtype=torch.float32)).sum()
            loss.backward()
            for n in range(5):
                grads[n][row, s:e] = ts[n].grad.numpy()[0]
            if continues:
                grads[5][row] = state.grad.numpy()[0]
    return grads


@functools.cache
def _precision_case(T, documents):
    data, starts = _qwen_data(200 + T, 2, T, documents)
    return data, starts, _float64_grads(*data, starts), _transformers_float32_grads(*data, starts)


def _norm_rel(a, b) -> float:
    return float(np.linalg.norm(np.ravel(a - b)) / np.linalg.norm(np.ravel(b)))


def _decay_errors(dg, want, g):
    """The decay gradient's errors against float64 `want`: per value head (the worst head's relative error
    over its tokens), and through A_log (each head's sum_t dg_t g_t: the chain rule of g = -exp(A_log) ...,
    relative to the largest head's)."""
    per_head = max(_norm_rel(dg[:, :, h], want[:, :, h]) for h in range(g.shape[-1]))
    a_log, a_log_want = (dg * g).sum((0, 1)), (want * g).sum((0, 1))
    return per_head, float(np.abs(a_log - a_log_want).max() / np.abs(a_log_want).max())


@pytest.mark.parametrize("T", [128, 150, 333])
@pytest.mark.parametrize("documents", [False, True])
def test_gradients_against_float64_at_least_as_exact_as_transformers_float32(T, documents, path):
    """Every gradient against float64 within 3x transformers' float32 error of it (plus a float32 floor), and
    the decay's (dg; through A_log) at float32's rounding floor, under a tenth of transformers' error: every
    log decay and every sum of dg's is formed from its own terms only (the module docstring, "Precision"),
    where transformers' autograd takes differences of cumulative sums, whose rounding is a large decay's while
    the true value can be a small one's. Lengths a multiple of the chunk and not, documents, an initial state,
    key-head groups."""
    data, starts, want, theirs = _precision_case(T, documents)
    _, _, ours = _mlx_grads(*data, starts=starts)
    for name, a, t, w in zip(["q", "k", "v", "g", "beta", "initial_state"], ours, theirs, want, strict=True):
        assert _norm_rel(a, w) <= 3 * _norm_rel(t, w) + 1e-6, name
    g = data[3]
    (ours_head, ours_a_log), (their_head, their_a_log) = (_decay_errors(x[3], want[3], g) for x in (ours, theirs))
    assert ours_head <= 0.1 * their_head, (ours_head, their_head)
    assert ours_a_log <= 0.1 * their_a_log + 1e-6, (ours_a_log, their_a_log)


# ---------------------------------------------------------------------------------------------------------
# dtypes, decoding, compile, the inverse


def test_bf16_inputs_close_to_float32_with_float32_state(path):
    """bf16 inputs take the graph path (the fixture checks it) and come close to the float32 op on `path`."""
    data = _data(11, 2, 130, 2, 4, 32, 16, normalise=False)
    out32, final32, grads32 = _mlx_grads(*data)
    W, WS = _mx(data[6], data[7])

    def loss(*xs):
        out, final = gated_delta_rule(*xs, use_qk_l2norm_in_kernel=True)
        return (out.astype(mx.float32) * W).sum() + (final * WS).sum(), (out, final)

    ins = _mx(*data[:6], dtype=mx.bfloat16)
    (_, (out, final)), grads = mx.value_and_grad(loss, argnums=list(range(6)))(*ins)
    assert out.dtype == mx.bfloat16 and final.dtype == mx.float32
    assert all(gr.dtype == mx.bfloat16 for gr in grads)
    assert _rel(out.astype(mx.float32), out32) < 2e-2 and _rel(final, final32) < 2e-2
    for ours, ref in zip(grads, grads32, strict=True):
        assert _rel(ours.astype(mx.float32), ref) < 2e-2


def test_step_equals_the_chunked_op_token_by_token(path):
    q, k, v, g, beta, s0, _, _ = _data(13, 2, 70, 1, 3, 8, 12, normalise=False)
    mq, mk, mv, mg, mb, ms = _mx(q, k, v, g, beta, s0)
    out, final = gated_delta_rule(mq, mk, mv, mg, mb, ms, use_qk_l2norm_in_kernel=True)
    state = ms
    for t in range(70):
        o, state = gated_delta_step(mq[:, t], mk[:, t], mv[:, t], mg[:, t], mb[:, t], state,
                                    use_qk_l2norm_in_kernel=True)
        assert o.shape == (2, 3, 12) and state.dtype == mx.float32
        assert _rel(o, out[:, t]) < 1e-5
    assert _rel(state, final) < 1e-5
    # the [B, 1, H, d] form (a sequence of one) too
    o, state1 = gated_delta_step(mq[:, :1], mk[:, :1], mv[:, :1], mg[:, :1], mb[:, :1], ms,
                                 use_qk_l2norm_in_kernel=True)
    one, final1 = gated_delta_rule(mq[:, :1], mk[:, :1], mv[:, :1], mg[:, :1], mb[:, :1], ms,
                                   use_qk_l2norm_in_kernel=True)
    assert o.shape == (2, 1, 3, 12) and _rel(o, one) < 1e-6 and _rel(state1, final1) < 1e-6


def test_under_compile(path):
    (q, k, v, g, beta, s0, w_out, w_state), starts, _ = _packed(17)
    W, WS, ds = *_mx(w_out, w_state), mx.array(starts)

    def loss(q, k, v, g, beta, s0):
        out, final = gated_delta_rule(q, k, v, g, beta, s0, ds, use_qk_l2norm_in_kernel=True)
        return (out * W).sum() + (final * WS).sum()

    ins = _mx(q, k, v, g, beta, s0)
    eager = mx.value_and_grad(loss, argnums=list(range(6)))(*ins)
    compiled = mx.compile(mx.value_and_grad(loss, argnums=list(range(6))))(*ins)
    assert _rel(compiled[0], eager[0]) < 1e-5
    for a, b in zip(compiled[1], eager[1], strict=True):
        assert _rel(a, b) < 1e-5


@pytest.mark.parametrize("method", ["lapack", "blocks"])
@pytest.mark.parametrize("c", [64, 37])
def test_unit_lower_inverse(method, c):
    rng = np.random.default_rng(c)
    k = rng.standard_normal((6, c, 8))
    k[3:] = k[3:, :1]  # identical keys, beta 1: (I + A) is the all-ones lower triangle, entries of A^n explode
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    beta = np.concatenate([rng.uniform(0, 1, (3, c, 1)), np.ones((3, c, 1))])
    a = np.tril(beta * (k @ k.transpose(0, 2, 1)), -1)
    ref = np.linalg.inv(np.eye(c) + a)
    assert np.abs(np.array(unit_lower_inverse(mx.array(a.astype(np.float32)), method)) - ref).max() < 1e-5


def test_block_inverse_path_gives_the_same_op(monkeypatch):
    monkeypatch.setattr(native, "load", lambda: None)  # the graph path's inverse (the native kernel has its own)
    data = _data(19, 2, 130, 1, 2, 8, 8, normalise=False)
    _, _, lapack = _mlx_grads(*data)
    monkeypatch.setattr(triangular, "INVERSE", "blocks")  # the path a GPU takes
    _, _, blocks = _mlx_grads(*data)
    for a, b in zip(blocks, lapack, strict=True):
        assert _rel(a, b) < 1e-5


def test_autograd_of_the_forward_is_the_same_computation(path):
    """custom_vjp=False (the memory comparison) differentiates the same forward: the same gradients."""
    (q, k, v, g, beta, s0, w_out, w_state), starts, _ = _packed(23)
    _, _, ours = _mlx_grads(q, k, v, g, beta, s0, w_out, w_state, starts=starts)
    _, _, autograd = _mlx_grads(q, k, v, g, beta, s0, w_out, w_state, starts=starts, custom_vjp=False)
    for a, b in zip(autograd, ours, strict=True):
        assert _rel(a, b) < 1e-5


@pytest.mark.parametrize("used", ["out", "final"])
def test_one_output_unused(used, path):
    """A loss of the output alone or of the final state alone: the other output's cotangent is absent."""
    q, k, v, g, beta, s0, w_out, w_state = _data(29, 1, 100, 2, 2, 8, 8)
    zero = np.zeros_like(w_state) if used == "out" else np.zeros_like(w_out)
    want = _mlx_grads(q, k, v, g, beta, s0, *((w_out, zero) if used == "out" else (zero, w_state)))[2]
    W = _mx(w_out if used == "out" else w_state)[0]

    def loss(*xs):
        out, final = gated_delta_rule(*xs, use_qk_l2norm_in_kernel=True)
        return ((out if used == "out" else final) * W).sum()

    grads = mx.grad(loss, argnums=list(range(6)))(*_mx(q, k, v, g, beta, s0))
    for a, b in zip(grads, want, strict=True):
        assert _rel(a, b) < 1e-6


def test_dispatch_takes_the_native_kernel_where_the_other_native_kernels_run(monkeypatch):
    """float32 CPU arrays with the module built: "native"; bf16 inputs or state, MLXRL_NATIVE=0, a module that
    cannot load, or a GPU default device: "graph"."""
    q, g, s = mx.zeros((1, 4, 2, 8)), mx.zeros((1, 4, 2)), mx.zeros((1, 2, 8, 8))
    built = mx.default_device() == mx.cpu and native.load() is not None  # not with MLXRL_NATIVE=0 set already
    assert gated_delta._path(q, q, q, g, g, s) == ("native" if built else "graph")
    bf = q.astype(mx.bfloat16)
    assert gated_delta._path(bf, bf, bf, g, g, s) == "graph"
    assert gated_delta._path(q, q, q, g, g, s.astype(mx.bfloat16)) == "graph"
    monkeypatch.setattr(native, "_state", {})  # load() again, as a fresh process would
    monkeypatch.setenv("MLXRL_NATIVE", "0")
    assert native.load() is None and gated_delta._path(q, q, q, g, g, s) == "graph"


def test_native_primitive_has_its_own_vjp():
    """The kernel's primitive differentiates by itself too (its VJP is the backward kernel), as the op does."""
    skip_native_on_gpu("native")
    kernels = native.load()
    if kernels is None:
        pytest.skip("no native CPU kernels (MLXRL_NATIVE=0 or no compiler)")
    q, k, v, g, beta, s0, w_out, w_state = _data(41, 2, 90, 1, 2, 8, 8, normalise=False)
    starts = np.zeros((2, 90), bool)
    starts[1, 70] = True
    _, _, want = _mlx_grads(q, k, v, g, beta, s0, w_out, w_state, starts=starts)
    W, WS, ds = *_mx(w_out, w_state), mx.array(starts)

    def loss(*xs):
        out, final, _ = kernels.gated_delta(*xs, ds, 64, 8 ** -0.5, True)
        return (out * W).sum() + (final * WS).sum()

    grads = mx.grad(loss, argnums=list(range(6)))(*_mx(q, k, v, g, beta, s0))
    for a, b in zip(grads, want, strict=True):
        assert _rel(a, b) < 1e-5


def test_shape_errors():
    q = mx.zeros((1, 8, 2, 4))
    with pytest.raises(ValueError, match="multiple of Hk"):
        gated_delta_rule(q, q, mx.zeros((1, 8, 3, 4)), mx.zeros((1, 8, 3)), mx.zeros((1, 8, 3)))
    with pytest.raises(ValueError, match="g"):
        gated_delta_rule(q, q, q, mx.zeros((1, 8)), mx.zeros((1, 8, 2)))
    with pytest.raises(ValueError, match="doc_starts"):
        gated_delta_rule(q, q, q, mx.zeros((1, 8, 2)), mx.zeros((1, 8, 2)), doc_starts=mx.zeros((1, 7), mx.bool_))


# ---------------------------------------------------------------------------------------------------------
# memory


def test_vjp_peak_memory_is_well_below_autograd_of_the_chunked_forward(path):
    """Forward + backward: ours keeps the inputs and one state per chunk, and its working set (one group of
    chunks on the graph path, one chunk per core natively) does not grow with the length; MLX's autograd of the
    same chunked forward (custom_vjp=False) keeps every chunk's intermediates."""
    B, H, d = 1, 4, 64

    def peak(T, custom_vjp):
        mx.random.seed(0)
        q, k, v, w = (mx.random.normal((B, T, H, d)) for _ in range(4))
        g, beta = -mx.random.uniform(0.01, 1.0, (B, T, H)), mx.random.uniform(0.0, 1.0, (B, T, H))
        mx.eval(q, k, v, w, g, beta)

        def loss(q, k, v, g, beta):
            out, _ = gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, custom_vjp=custom_vjp)
            return (out * w).sum()

        step = mx.value_and_grad(loss, argnums=list(range(5)))
        mx.eval(step(q, k, v, g, beta))  # warm: the same work, measured the second time
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        result = step(q, k, v, g, beta)
        mx.eval(result)
        used = mx.get_peak_memory() - base
        del result
        return used

    def work(T, custom_vjp=True):  # the peak beyond the 5 gradients, the output, its cotangent, T/64 states
        results = 4 * (3 * B * T * H * d + 2 * B * T * H + 2 * B * T * H * d + (T // 64) * B * H * d * d)
        return peak(T, custom_vjp) - results

    ours, naive = work(2048), work(2048, custom_vjp=False)
    assert ours < 0.5 * naive, (ours, naive)
    longer = work(4096)  # the working set: the same at twice the length
    assert longer < 1.2 * ours, (longer, ours)


def test_graph_path_peak_memory_near_what_the_op_must_hold(monkeypatch):
    """Qwen3.5's DeltaNet head widths (dk = dv = 128; 4 heads), 2048 tokens, on the graph path:
    the value_and_grad's peak is within 1.3x of what any path holds (its gradients, the output and its
    cotangent, one float32 state per chunk and head; the native kernel's peak is about that): the groups are
    sized so that their intermediates are a bounded share of it."""
    monkeypatch.setattr(native, "load", lambda: None)
    B, T, H, d = 1, 2048, 4, 128
    mx.random.seed(0)
    q, k, v, w = (mx.random.normal((B, T, H, d)) for _ in range(4))
    g, beta = -mx.random.uniform(0.01, 1.0, (B, T, H)), mx.random.uniform(0.0, 1.0, (B, T, H))
    mx.eval(q, k, v, w, g, beta)
    assert gated_delta._path(q, k, v, g, beta, mx.zeros((1,))) == "graph"

    def loss(q, k, v, g, beta):
        out, _ = gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
        return (out * w).sum()

    base = mx.get_active_memory()
    mx.reset_peak_memory()
    mx.eval(mx.value_and_grad(loss, argnums=list(range(5)))(q, k, v, g, beta))
    peak = mx.get_peak_memory() - base
    held = 4 * (5 * B * T * H * d + 2 * B * T * H + (T // 64) * B * H * d * d)
    assert peak < 1.3 * held, (peak / held, peak, held)
