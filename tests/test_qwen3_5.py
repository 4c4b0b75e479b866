"""Qwen3.5's decoder (`qwen3_5_text`) against transformers' `Qwen3_5ForCausalLM` (issue 50): the logits of a tiny
random checkpoint (every norm, decay and bias perturbed from its initial value) at lengths that are not
multiples of the delta rule's chunk, with left padding, and packed documents against each document alone;
the gradient of a loss through every parameter against torch autograd (float64); greedy decoding with the
recurrent cache against the full forward.

    python -m pytest -q tests/test_qwen3_5.py
"""

from __future__ import annotations

import importlib.util
import sys

import mlx.core as mx
import numpy as np
import pytest
import torch
from mlx.utils import tree_flatten, tree_unflatten

from mlxrl.models.qwen3_5.model import Model

transformers = pytest.importorskip("transformers")

CONFIG = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=8, linear_value_head_dim=12, rms_norm_eps=1e-6)


def _make_pair(config):
    """(transformers' model, ours) with the same random weights, float32."""
    torch.manual_seed(0)
    cfg = transformers.Qwen3_5TextConfig(**config)
    hf = transformers.Qwen3_5ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("norm.weight", "layernorm.weight", "dt_bias", "A_log")):
                p.add_(0.3 * torch.randn_like(p))  # away from the initial ones / zeros: a wrong offset shows
    ours = Model({**cfg.to_dict(), "model_type": "qwen3_5_text"})
    weights = ours.sanitize({k: mx.array(v.detach().numpy()) for k, v in hf.state_dict().items()})
    ours.load_weights(list(weights.items()), strict=True)
    ours.eval()
    return hf, ours


@pytest.fixture(scope="module")
def pair():
    return _make_pair(CONFIG)


@pytest.fixture(scope="module")
def float64_qwen3_5():
    """transformers' Qwen3.5 module computing in float64 throughout: its source with every float32 cast (the
    delta rule's inputs, A_log, the norms, the rotary angles) made a float64 one, loaded as a module of its own.
    `.double()` alone leaves those casts in float32, so its delta rule would run in float32."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as module

    with open(module.__file__) as f:
        source = f.read()
    source = (source.replace("torch.float32", "torch.float64").replace(".float()", ".double()")
              .replace("dtype=torch.float)", "dtype=torch.float64)"))
    name = module.__name__ + "_float64"
    spec = importlib.util.spec_from_loader(name, loader=None)
    float64 = importlib.util.module_from_spec(spec)
    float64.__package__, float64.__file__ = module.__package__, module.__file__
    sys.modules[name] = float64  # transformers' decorators look classes up by module
    exec(compile(source, module.__file__, "exec"), float64.__dict__)
    yield float64
    del sys.modules[name]


def _float64_model(float64_qwen3_5, hf):
    model = float64_qwen3_5.Qwen3_5ForCausalLM(hf.config).double().eval()
    model.load_state_dict({k: v.double() for k, v in hf.state_dict().items()})
    return model


def _torch_gradients(model, ids, targets):
    """The gradients of the mean cross-entropy over every token, float64 NumPy."""
    model.zero_grad()
    logits = model(input_ids=torch.tensor(ids)).logits
    torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                      torch.tensor(targets).reshape(-1)).backward()
    return {k: p.grad.numpy().astype(np.float64) for k, p in model.named_parameters()}


def _our_gradients(ours, ids, targets):
    def loss(params):
        ours.update(tree_unflatten(list(params.items())))
        out = ours(mx.array(ids))
        return mx.mean(mx.logsumexp(out, axis=-1) - mx.take_along_axis(out, mx.array(targets)[..., None], -1)[..., 0])

    params = dict(tree_flatten(ours.trainable_parameters()))
    return {k: np.array(g) for k, g in mx.grad(loss)(params).items()}


def _rel_err(g, w) -> float:
    return float(np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-12))


def hf_logits(hf, ids, **kw):
    with torch.no_grad():
        return hf(input_ids=torch.tensor(ids), **{k: torch.tensor(v) for k, v in kw.items()}).logits.numpy()


@pytest.mark.parametrize("length", [1, 5, 70, 130])
def test_logits_equal_transformers(pair, length, kernel_path):
    hf, ours = pair
    ids = np.random.default_rng(length).integers(0, CONFIG["vocab_size"], size=(2, length))
    np.testing.assert_allclose(np.array(ours(mx.array(ids))), hf_logits(hf, ids), atol=1e-4, rtol=1e-4)


def test_left_padding_equals_transformers(pair):
    hf, ours = pair
    rng = np.random.default_rng(1)
    ids = rng.integers(1, CONFIG["vocab_size"], size=(2, 80))
    mask = np.ones_like(ids)
    mask[0, :13] = 0
    ids[0, :13] = 0
    got = np.array(ours(mx.array(ids), attention_mask=mx.array(mask)))
    want = hf_logits(hf, ids, attention_mask=mask)
    np.testing.assert_allclose(got[mask > 0], want[mask > 0], atol=1e-4, rtol=1e-4)


def test_packed_documents_equal_each_document_alone(pair, kernel_path):
    _, ours = pair
    rng = np.random.default_rng(2)
    lengths = [37, 70, 23]
    docs = [rng.integers(0, CONFIG["vocab_size"], size=n) for n in lengths]
    packed = np.concatenate(docs)[None]
    segments = np.concatenate([np.full(n, i + 1) for i, n in enumerate(lengths)])[None]
    got = np.array(ours(mx.array(packed), segment_ids=mx.array(segments)))[0]
    start = 0
    for doc in docs:
        alone = np.array(ours(mx.array(doc[None])))[0]
        np.testing.assert_allclose(got[start:start + len(doc)], alone, atol=1e-4, rtol=1e-4)
        start += len(doc)


def test_gradients_through_every_parameter_equal_torch_autograd(pair, float64_qwen3_5, kernel_path):
    hf, ours = pair
    rng = np.random.default_rng(3)
    ids = rng.integers(0, CONFIG["vocab_size"], size=(2, 70))
    targets = rng.integers(0, CONFIG["vocab_size"], size=(2, 70))
    # the reference: transformers in float64; its float32 run measures how well float32 can do there
    want = _torch_gradients(_float64_model(float64_qwen3_5, hf), ids, targets)
    theirs = _torch_gradients(hf, ids, targets)
    grads = _our_gradients(ours, ids, targets)
    assert set(grads) == set(want)
    for k, g in grads.items():
        err, float32_err = _rel_err(g, want[k]), _rel_err(theirs[k], want[k])
        assert err <= max(1e-3, 1.5 * float32_err), (k, err, float32_err)


# linear, linear, full, linear, full: a linear layer between full ones, its cotangents through attention
CONFIG_5 = {**CONFIG, "num_hidden_layers": 5, "layer_types": ["linear_attention", "linear_attention", "full_attention",
                                                              "linear_attention", "full_attention"]}


@pytest.fixture(scope="module")
def pair_5():
    return _make_pair(CONFIG_5)


@pytest.mark.parametrize("length", [150, 333])
def test_decay_gradients_against_float64_transformers(pair_5, float64_qwen3_5, length, kernel_path):
    """Issue 66: A_log's, dt_bias' and in_proj_a's gradients (each a sum over tokens of the delta rule's dg,
    dg_t itself a sum over the chunk) against transformers in float64, at lengths that are not multiples of
    the chunk: at float32's floor (3e-6, where the model's other parameters land), under a tenth of
    transformers' own float32 error. The delta rule forms every log decay and every sum of dg's from its own
    terms (`models.gated_delta`, "Precision"); transformers' float32 takes differences of cumulative sums."""
    hf, ours = pair_5
    rng = np.random.default_rng(3)
    ids, targets = (rng.integers(0, CONFIG_5["vocab_size"], size=(2, length)) for _ in range(2))
    want = _torch_gradients(_float64_model(float64_qwen3_5, hf), ids, targets)
    theirs = _torch_gradients(hf, ids, targets)
    grads = _our_gradients(ours, ids, targets)
    names = [k for k in grads if k.endswith(("A_log", "dt_bias", "in_proj_a.weight"))]
    assert len(names) == 9
    for k in names:
        err, float32_err = _rel_err(grads[k], want[k]), _rel_err(theirs[k], want[k])
        assert err <= 0.1 * float32_err + 3e-6, (k, err, float32_err)


def test_greedy_decoding_with_the_recurrent_cache_equals_the_full_forward(pair):
    _, ours = pair
    ids = np.random.default_rng(4).integers(0, CONFIG["vocab_size"], size=(1, 67))
    full = np.array(ours(mx.array(ids)))[0]
    cache = ours.make_cache()
    prompt = np.array(ours(mx.array(ids[:, :60]), cache=cache))[0]
    np.testing.assert_allclose(prompt, full[:60], atol=1e-4, rtol=1e-4)
    for t in range(60, 67):
        step = np.array(ours(mx.array(ids[:, t:t + 1]), cache=cache))[0, 0]
        np.testing.assert_allclose(step, full[t], atol=1e-4, rtol=1e-4)


def test_batched_greedy_generation_equals_transformers_generate(pair):
    """Left-padded prompts of different lengths, each prompt's state shared by its samples: the tokens
    transformers' `generate` picks (its recurrent cache and its own padding handling)."""
    from mlxrl.generation.engine import generate

    hf, ours = pair
    rng = np.random.default_rng(5)
    ids = rng.integers(1, CONFIG["vocab_size"], size=(3, 23))
    mask = np.ones_like(ids)
    for row, pad in ((0, 7), (2, 15)):
        mask[row, :pad], ids[row, :pad] = 0, 0
    steps = 12
    with torch.no_grad():
        want = hf.generate(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), max_new_tokens=steps,
                           do_sample=False, pad_token_id=0, eos_token_id=None)[:, ids.shape[1]:].numpy()
    out = generate(ours, mx.array(ids), mx.array(mask), num_generations=2, max_tokens=steps, temperature=0.0,
                   stop_token_ids=[], pad_token_id=0)
    got = np.array(out.completion_ids)
    assert len({tuple(r) for r in want}) == 3, "the prompts should not all continue alike"
    np.testing.assert_array_equal(got, np.repeat(want, 2, axis=0))


@pytest.mark.parametrize("block_channels", [None, 5])
@pytest.mark.parametrize("L", [37, 2])
@pytest.mark.parametrize("documents", [False, True])
def test_fused_conv_vjp_equals_autograd_of_the_plain_convolution(documents, L, block_channels, kernel_path,
                                                                 monkeypatch):
    """The convolution + SiLU + split as one op with its own VJP (`text.conv_qkv`: on the native path the C++
    kernel, `cpu/native/causal_conv.cpp`, recomputing position by position; on the graph path `_conv_qkv`,
    recomputed from its input, the input's gradient summed from shifted windows of dc) against MLX's autograd
    of `causal_conv`, SiLU and the split: the outputs and every input's gradient (x, the weight, the K - 1
    inputs before x), with packed documents and a carried-in state, at a length of no special size and at one
    shorter than the kernel (the last K - 1 inputs then reach into the state); block_channels: the graph path's
    backward in blocks of 5 channels (CONV_BLOCK_BYTES made small: blocks that do not divide q's, k's or v's
    channels), else one block per part."""
    from mlxrl.models.qwen3_5 import text

    hk, dk, hv, dv, K, B = 2, 8, 3, 12, 4, 2
    if block_channels:
        if kernel_path == "native":
            pytest.skip("the graph path's blocks")
        monkeypatch.setattr(text, "CONV_BLOCK_BYTES", 4 * B * (L + K - 1) * block_channels)
    C = 2 * hk * dk + hv * dv
    rng = np.random.default_rng(5)
    x, weight, state = (mx.array(rng.normal(size=s).astype(np.float32)) for s in ((B, L, C), (C, 1, K), (B, K - 1, C)))
    cot = [mx.array(rng.normal(size=s).astype(np.float32)) for s in ((B, L, hk, dk), (B, L, hk, dk), (B, L, hv, dv),
                                                                     (B, K - 1, C))]
    starts = mx.array(np.isin(np.arange(L), [0, 1, 11, 25])[None].repeat(B, 0)) if documents else None

    def plain(x, weight, state):
        y, last = text.causal_conv(x, weight, starts, state)
        y = y * mx.sigmoid(y)
        return (y[..., :hk * dk].reshape(B, L, hk, dk), y[..., hk * dk:2 * hk * dk].reshape(B, L, hk, dk),
                y[..., 2 * hk * dk:].reshape(B, L, hv, dv), last)

    ran = []
    real = text._conv_qkv
    monkeypatch.setattr(text, "_conv_qkv", lambda *a: ran.append("graph") or real(*a))
    outs = []
    for f in (plain, lambda x, w, s: text.conv_qkv(x, w, s, starts, hk, dk, hv, dv)):
        def loss(x, w, s, f=f):
            return sum((o * c).sum() for o, c in zip(f(x, w, s), cot, strict=True))
        outs.append((f(x, weight, state), mx.grad(loss, argnums=(0, 1, 2))(x, weight, state)))
    assert bool(ran) == (kernel_path == "graph"), "the dispatch did not take the path under test"
    (want_y, want_g), (got_y, got_g) = outs
    for want, got in zip(want_y, got_y, strict=True):
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-6)
    for want, got in zip(want_g, got_g, strict=True):
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-5)
