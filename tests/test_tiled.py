"""Tiled MLP (`models.tiled`): the MLP over the sequence in tiles, its backward recomputing one tile at a time.

Against independent references: the untiled model (the same loss and gradients, LoRA and full fine-tuning,
with and without gradient checkpointing, eager and compiled), plain autodiff through the same tiles under
the same dropout keys (LoRA dropout on: the custom backward's masks are the forward's), and MLX's measured
peak of the untiled backward (the tiles hold less)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlxrl.models import build_model, dropout
from mlxrl.models.language import MLP, TextConfig
from mlxrl.models.lora import apply_lora
from mlxrl.models.tiled import tile_bounds, tiled
from mlxrl.trainers.sft.config import SFTConfig

CONFIG = dict(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True)


@pytest.mark.parametrize("n, tokens", [(10, 3), (12, 4), (4096, 1024), (4097, 1024), (5, 5), (1, 7)])
def test_tile_bounds_cover_the_positions_evenly(n, tokens):
    bounds = tile_bounds(n, tokens)
    assert bounds[0][0] == 0 and bounds[-1][1] == n and len(bounds) == -(-n // tokens)
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))
    sizes = [e - s for s, e in bounds]
    assert max(sizes) <= tokens and max(sizes) - min(sizes) <= 1 or len(sizes) == 1


def model_grads(tile: int, *, lora: bool = True, checkpointing: bool = True, compiled: bool = False,
                lora_dropout: float = 0.0, dtype=mx.float32, length: int = 24):
    mx.random.seed(0)
    model = build_model(CONFIG)
    if lora:
        apply_lora(model, r=4, alpha=8, dropout=lora_dropout)
        for _, p in tree_flatten(model.trainable_parameters()):  # lora_b starts at 0: give it values
            p[...] = mx.random.normal(p.shape) * 0.1
    model.set_dtype(dtype)
    model.train()
    lm = model.language_model
    lm.gradient_checkpointing = checkpointing
    lm.tile_mlp(tile)
    ids = mx.array(np.random.default_rng(0).integers(0, 64, (2, length)), mx.int32)
    w = mx.random.normal((2, length, 32))
    mx.random.seed(5)
    step = nn.value_and_grad(model, lambda m: (m(input_ids=ids, return_hidden=True).astype(mx.float32) * w).sum())
    if compiled:
        state = [model.state, mx.random.state]
        loss, grads = mx.compile(lambda: step(model), inputs=state, outputs=state)()
    else:
        loss, grads = step(model)
    return loss, dict(tree_flatten(grads))


@pytest.mark.parametrize("lora, checkpointing, compiled", [(True, True, False), (True, False, False),
                                                            (True, True, True), (False, True, False),
                                                            (False, False, True)])
def test_tiles_give_the_untiled_loss_and_gradients(kernel_path, lora, checkpointing, compiled):
    """2 rows of 24 positions in tiles of 10 (5 tiles of 9-10 positions, crossing the rows): the loss and every
    trained gradient (LoRA's, or all weights in full fine-tuning) are the untiled model's."""
    loss0, g0 = model_grads(0, lora=lora, checkpointing=checkpointing, compiled=compiled)
    loss1, g1 = model_grads(10, lora=lora, checkpointing=checkpointing, compiled=compiled)
    np.testing.assert_allclose(loss1.item(), loss0.item(), rtol=1e-5)
    assert g0.keys() == g1.keys() and any(".mlp." in k for k in g0)
    for name in g0:
        ref = np.array(g0[name])
        np.testing.assert_allclose(np.array(g1[name]), ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max() + 1e-6,
                                   err_msg=name)


def test_bf16_weights_keep_their_dtype_and_match(kernel_path):
    """Full fine-tuning in bfloat16: the MLP weights' gradients (summed over the tiles in float32) stay
    bfloat16 and match the untiled ones to bf16 precision."""
    loss0, g0 = model_grads(0, lora=False, dtype=mx.bfloat16)
    loss1, g1 = model_grads(8, lora=False, dtype=mx.bfloat16)
    np.testing.assert_allclose(loss1.item(), loss0.item(), rtol=2e-2)
    for name in g0:
        assert g1[name].dtype == mx.bfloat16, name
        a, b = np.array(g1[name].astype(mx.float32)), np.array(g0[name].astype(mx.float32))
        assert np.abs(a - b).max() <= 0.05 * np.abs(b).max() + 1e-3, name


def closed_over_arrays(fn, seen=None) -> list:
    """The arrays a function reaches through its closure cells (and those of the functions it closes over)."""
    seen = set() if seen is None else seen
    found = []
    for cell in getattr(fn, "__closure__", None) or ():
        v = cell.cell_contents
        if isinstance(v, mx.array):
            found.append(v)
        elif callable(v) and hasattr(v, "__closure__") and id(v) not in seen:
            seen.add(id(v))
            found += closed_over_arrays(v, seen)
    return found


def test_the_tiles_backward_differentiates_a_function_of_its_primals_only(monkeypatch):
    """Each tile's `mx.vjp` gets its dropout key as a primal instead of closing over it: `mx.vjp` walks
    every closed-over array's graph to its roots, and under checkpointing the key's graph is the whole
    forward above the layer (a real-depth step's trace grew with tiles x depth; `scripts/bench_trace.py`).
    Compiled, checkpointed, LoRA dropout on, as the trainers run it (the masks: the test below)."""
    calls = []
    vjp = mx.vjp

    def spy(fun, primals, cotangents):
        calls.append(closed_over_arrays(fun))
        return vjp(fun, primals, cotangents)

    monkeypatch.setattr(mx, "vjp", spy)
    model_grads(10, compiled=True, lora_dropout=0.3)
    assert len(calls) == 2 * 5 and not any(calls)  # 2 layers x 5 tiles, no array closed over


def test_dropout_masks_of_the_backward_are_the_forwards(kernel_path):
    """LoRA dropout 0.3 in the MLP: the tiled custom backward equals plain autodiff through the same tiles,
    each under the key the tiled call draws for it (so the recomputed tiles drop what the forward dropped)."""
    mx.random.seed(0)
    model = build_model(CONFIG)
    apply_lora(model, r=4, alpha=8, dropout=0.3)
    mlp = model.language_model.layers[0].mlp
    for _, p in tree_flatten(mlp.trainable_parameters()):
        p[...] = mx.random.normal(p.shape) * 0.1
    mlp.train()
    x, w = mx.random.normal((2, 15, 32)), mx.random.normal((2, 15, 32))
    key = mx.array([7, 11], mx.uint32)

    def tiled_loss(params, x):
        mlp.update(params)
        with dropout.scope(key):
            return (tiled(mlp, mlp.swiglu, x, 8) * w).sum()

    def reference_loss(params, x):  # the same tiles and keys, no custom backward
        mlp.update(params)
        flat = x.reshape(30, 32)
        with dropout.scope(key):
            keys = [dropout.next_key() for _ in tile_bounds(30, 8)]
        outs = []
        for k, (s, e) in zip(keys, tile_bounds(30, 8), strict=True):
            with dropout.scope(k):
                outs.append(mlp.swiglu(flat[s:e][None])[0])
        return (mx.concatenate(outs).reshape(2, 15, 32) * w).sum()

    params = mlp.trainable_parameters()
    (l1, (g1, dx1)) = mx.value_and_grad(tiled_loss, argnums=(0, 1))(params, x)
    (l0, (g0, dx0)) = mx.value_and_grad(reference_loss, argnums=(0, 1))(params, x)
    np.testing.assert_allclose(l1.item(), l0.item(), rtol=1e-5)
    np.testing.assert_allclose(np.array(dx1), np.array(dx0), rtol=1e-4, atol=1e-6)
    g1, g0 = dict(tree_flatten(g1)), dict(tree_flatten(g0))
    assert len(g0) == 6
    for name in g0:
        np.testing.assert_allclose(np.array(g1[name]), np.array(g0[name]), rtol=1e-4, atol=1e-6, err_msg=name)
    with dropout.scope(key):  # the masks are really drawn: without them the loss differs
        plain = (mlp.swiglu(x) * w).sum()
    mlp.eval()
    assert abs((mlp.swiglu(x) * w).sum().item() - l1.item()) > 1e-3 and abs(plain.item() - l1.item()) > 1e-3


def test_tiles_hold_less_than_the_whole_sequence(kernel_path):
    """One MLP (D 64, I 1024) over 4096 positions: the backward's peak with tiles of 512 positions is under
    half the untiled one (MLX's measured peak above the inputs), with the same input gradient."""
    mx.random.seed(0)
    cfg = TextConfig(hidden_size=64, num_hidden_layers=1, intermediate_size=1024, num_attention_heads=4,
                     vocab_size=8)
    mlp = MLP(cfg)
    x, w = mx.random.normal((1, 4096, 64)), mx.random.normal((1, 4096, 64))
    mx.eval(mlp.parameters(), x, w)
    peaks, grads = {}, {}
    for tile in (0, 512, 0, 512):  # twice each: the first call of each warms the allocator's cache
        mlp.tile_tokens = tile
        mx.clear_cache()
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        g = mx.grad(lambda x: (mlp(x) * w).sum())(x)
        mx.eval(g)
        peaks[tile], grads[tile] = mx.get_peak_memory() - base, g
    assert peaks[512] < 0.5 * peaks[0], peaks
    np.testing.assert_allclose(np.array(grads[512]), np.array(grads[0]), rtol=1e-4, atol=1e-5)


def test_the_flags_choose_the_tiles():
    a = SFTConfig(gradient_checkpointing=True)
    assert a.mlp_tile_tokens(1024) == 1024  # default: on with checkpointing, hidden-size tiles
    a.tiled_mlp_tokens = 256
    assert a.mlp_tile_tokens(1024) == 256
    a.gradient_checkpointing = False
    assert a.mlp_tile_tokens(1024) == 0
    a.tiled_mlp = True
    assert a.mlp_tile_tokens(1024) == 256
    a.gradient_checkpointing, a.tiled_mlp = True, False
    assert a.mlp_tile_tokens(1024) == 0
