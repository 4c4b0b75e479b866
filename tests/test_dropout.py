"""LoRA dropout under gradient checkpointing: the recomputed layer drops what the forward dropped.

Against independent references: the same model without checkpointing (the gradient must not depend on
it, as in PyTorch, whose checkpoint restores the RNG state), MLX's own `nn.Dropout` statistics (kept
fraction, scale), and MLX's `nn.utils.checkpoint` + `nn.Dropout`, which this replaces because its
gradient came from a different mask than its loss. keep_attention (the recompute reuses the forward's
FlashAttention output) against the recomputed attention and no checkpointing.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlxrl.models import build_model
from mlxrl.models.dropout import Dropout, keyed
from mlxrl.models.lora import apply_lora

CONFIG = dict(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True)


def lora_grads(checkpointing: bool, seed: int = 3, keep_attention: bool = False, length: int = 12,
               compiled: bool = False):
    mx.random.seed(0)
    model = build_model(CONFIG)
    apply_lora(model, r=4, alpha=8, dropout=0.3)
    for _, p in tree_flatten(model.trainable_parameters()):  # lora_b starts at 0: give it values
        p[...] = mx.random.normal(p.shape) * 0.1
    model.train()
    model.language_model.gradient_checkpointing = checkpointing
    model.language_model.keep_attention = keep_attention
    ids = mx.array(np.random.default_rng(0).integers(0, 64, (2, length)), mx.int32)
    w = mx.random.normal((2, length, 32))
    mx.random.seed(seed)
    step = nn.value_and_grad(model, lambda m: (m(input_ids=ids, return_hidden=True) * w).sum())
    if compiled:  # as the trainers: the random state is compiled state too (the dropout keys)
        state = [model.state, mx.random.state]
        compiled_step = mx.compile(lambda: step(model), inputs=state, outputs=state)
        loss, grads = compiled_step()
    else:
        loss, grads = step(model)
    return loss, dict(tree_flatten(grads))


def test_checkpointing_keeps_the_dropout_masks(kernel_path):
    """With LoRA dropout 0.3 the loss and every LoRA gradient are the same with and without gradient
    checkpointing (the same seed), and another seed changes them (the masks are really drawn)."""
    loss_off, off = lora_grads(False)
    loss_on, on = lora_grads(True)
    np.testing.assert_allclose(loss_on.item(), loss_off.item(), rtol=1e-5)
    assert off.keys() == on.keys() and len(off) == 2 * 7 * 2
    for name in off:
        np.testing.assert_allclose(np.array(on[name]), np.array(off[name]), rtol=1e-4, atol=1e-6, err_msg=name)
    loss_other, _ = lora_grads(True, seed=4)
    assert abs(loss_other.item() - loss_on.item()) > 1e-3


def test_keep_attention_replays_the_forwards_attention(kernel_path, monkeypatch):
    """keep_attention: the checkpointed layers' recomputation reuses the forward's FlashAttention output
    (the kernel's forward runs once per layer, not twice) and the loss and every LoRA gradient are those
    of recomputing it and of no checkpointing (40 tokens: the causal rows take the kernel). On the graph
    path (no kernel) the attention is recomputed, with the same results."""
    from mlxrl.cpu import fastmath

    loss_off, off = lora_grads(False, length=40)
    calls = []
    real = fastmath.kernels_for

    class Counting:  # the native module with its FlashAttention forward counted
        def __init__(self, k):
            self._k = k

        def __getattr__(self, name):
            return getattr(self._k, name)

        def flash_attention(self, *a, **kw):
            calls.append(1)
            return self._k.flash_attention(*a, **kw)

    monkeypatch.setattr(fastmath, "kernels_for", lambda x: None if real(x) is None else Counting(real(x)))
    results = {}
    for keep, compiled in ((False, False), (True, False), (True, True)):
        calls.clear()
        results[keep, compiled] = lora_grads(True, keep_attention=keep, length=40, compiled=compiled)
        results[keep, compiled] += (len(calls),)
    layers = CONFIG["num_hidden_layers"]
    if real(mx.zeros((1,))) is not None:  # the kernel runs (not the graph path, nor MLXRL_NATIVE=0)
        assert results[False, False][2] == 2 * layers and results[True, False][2] == results[True, True][2] == layers
    else:
        assert all(r[2] == 0 for r in results.values())
    for loss, grads, _ in results.values():
        np.testing.assert_allclose(loss.item(), loss_off.item(), rtol=1e-5)
        for name in off:
            np.testing.assert_allclose(np.array(grads[name]), np.array(off[name]), rtol=1e-4, atol=1e-6, err_msg=name)


def test_trainer_keep_attention(tiny_checkpoint, tmp_path, kernel_path):
    """SFT with keep_attention trains the same steps as without it (LoRA dropout 0.3, checkpointing on,
    rows above the kernel's 16 queries); where the kernel does not run the flag says it does nothing."""
    import warnings

    import mlxrl
    from mlxrl.cpu import fastmath
    from mlxrl.trainers.sft.config import SFTConfig
    from mlxrl.trainers.sft.trainer import SFTTrainer

    rows = [{"prompt": f"Count the words of sentence {i}, one by one, slowly and carefully:",
             "completion": " one two three four five six seven eight nine ten"} for i in range(4)]
    runs = {}
    for keep in (False, True):
        model, processor = mlxrl.load(tiny_checkpoint("qwen3"), dtype="float32")
        args = SFTConfig(output_dir=str(tmp_path / f"keep{keep}"), use_peft=True, lora_r=4, lora_dropout=0.3,
                         max_steps=2, per_device_train_batch_size=2, learning_rate=1e-2, logging_steps=1,
                         save_strategy="no", disable_tqdm=True, gradient_checkpointing=True, keep_attention=keep)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer = SFTTrainer(model, processor, args, train_dataset=rows)
        noted = any("keep_attention has no effect" in str(w.message) for w in caught)
        assert noted == (keep and fastmath.kernels_for(mx.zeros((1,))) is None)
        trainer.train()
        runs[keep] = ([e["loss"] for e in trainer.log_history if "loss" in e],
                      dict(tree_flatten(model.trainable_parameters())))
    (loss_off, p_off), (loss_on, p_on) = runs[False], runs[True]
    assert len(loss_off) == 2
    np.testing.assert_allclose(loss_on, loss_off, rtol=1e-5)
    for name in p_off:
        np.testing.assert_allclose(np.array(p_on[name]), np.array(p_off[name]), rtol=1e-4, atol=1e-6, err_msg=name)


def test_mlx_checkpoint_redraws_the_mask():
    """Why: MLX's checkpoint recomputes nn.Dropout with a new mask, so its gradient is not its loss's."""
    x, w = mx.ones((1, 64)), mx.arange(64).astype(mx.float32)
    drop = nn.Dropout(0.5)

    def grad(fn):
        mx.random.seed(0)
        return np.array(mx.grad(lambda x: (fn(x) * w).sum())(x))

    plain = grad(drop)
    assert not np.array_equal(grad(mx.checkpoint(drop)), plain)
    ours = Dropout(0.5)
    np.testing.assert_array_equal(grad(keyed(ours, ours, checkpoint=True)), grad(keyed(ours, ours)))


@pytest.mark.parametrize("p", [0.05, 0.5])
def test_dropout_statistics_and_eval_mode(kernel_path, p):
    """Kept fraction 1 - p (within 5 sigma on 1M draws), kept values scaled by 1 / (1 - p) as nn.Dropout,
    the VJP through the same mask, the identity in eval mode."""
    x = mx.random.normal((1000, 1000))
    drop = Dropout(p)
    (y,), (g,) = mx.vjp(drop, [x], [mx.ones_like(x)])
    kept = np.array(y != 0)
    sigma = np.sqrt(p * (1 - p) / kept.size)
    assert abs(kept.mean() - (1 - p)) < 5 * sigma
    np.testing.assert_allclose(np.array(y)[kept], np.array(x)[kept] / (1 - p), rtol=1e-6)
    np.testing.assert_array_equal(np.array(g) != 0, kept)
    drop.eval()
    assert drop(x) is x


@pytest.mark.parametrize("base", ["float32", "bfloat16", "4bit"])
def test_lora_layer_is_mlx_lms(kernel_path, base):
    """Our LoRA layer (the adapter product added inside the matmul when dtypes agree) gives mlx-lm's
    `LoRALinear` output and gradients (input, A, B) on the same weights and dropout masks: a float32 base
    (the addmm path), a bfloat16 base (float32 adapters: mlx-lm's formula) and a 4-bit base."""
    from mlx_lm.tuner.lora import LoRALinear as MlxLmLoRALinear

    from mlxrl.models.lora import LoRALinear

    mx.random.seed(1)
    linear = nn.Linear(64, 48, bias=False)
    if base == "bfloat16":
        linear.set_dtype(mx.bfloat16)
    elif base == "4bit":
        linear = nn.QuantizedLinear.from_linear(linear, group_size=32, bits=4)
    x = mx.random.normal((2, 5, 64)).astype(mx.bfloat16 if base == "bfloat16" else mx.float32)
    a, b = mx.random.normal((64, 4)) * 0.2, mx.random.normal((4, 48)) * 0.2
    results = []
    for cls in (LoRALinear, MlxLmLoRALinear):
        layer = cls.from_base(linear, r=4, dropout=0.3, scale=2.5)
        assert type(layer) is cls
        layer.dropout = Dropout(0.3)
        layer.lora_a, layer.lora_b = a, b

        def f(x, a, b, layer=layer):
            layer.lora_a, layer.lora_b = a, b
            out = layer(x)
            return (out.astype(mx.float32) * mx.cos(mx.arange(out.size).reshape(out.shape))).sum(), out

        mx.random.seed(7)  # the same dropout masks for both layers
        _, grads = mx.value_and_grad(lambda *t: f(*t)[0], argnums=(0, 1, 2))(x, a, b)
        mx.random.seed(7)
        results.append((f(x, a, b)[1], grads))
    (ours, g_ours), (ref, g_ref) = results
    assert ours.dtype == ref.dtype == x.dtype
    tol = dict(rtol=2e-2, atol=2e-2) if base == "bfloat16" else dict(rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.array(ours.astype(mx.float32)), np.array(ref.astype(mx.float32)), **tol)
    for name, g1, g2 in zip(("x", "A", "B"), g_ours, g_ref, strict=True):
        np.testing.assert_allclose(np.array(g1.astype(mx.float32)), np.array(g2.astype(mx.float32)), **tol,
                                   err_msg=name)
    assert float(mx.abs(g_ours[2]).max()) > 0.1  # B's gradient is not trivially zero


@pytest.mark.parametrize("shape,r,p", [((3, 37, 96), 16, 0.3), ((50, 1000), 8, 0.05), ((1, 5, 7), 3, 0.5)])
def test_fused_lora_down_is_dropout_then_matmul(kernel_path, shape, r, p):
    """`Dropout.matmul(x, A)` (on the native path one kernel, no dropped copy of x) is `Dropout(x) @ A` with
    the same key: the same output, input gradient and A gradient; eval mode is `x @ A`."""
    mx.random.seed(0)
    x, a = mx.random.normal(shape), mx.random.normal((shape[-1], r)) * 0.1
    w = mx.cos(mx.arange(x.size // shape[-1] * r)).reshape(*shape[:-1], r)
    drop = Dropout(p)
    drop.train()

    def run(fused):
        def f(x, a):
            return ((drop.matmul(x, a) if fused else drop(x) @ a) * w).sum()

        mx.random.seed(5)
        loss, grads = mx.value_and_grad(f, argnums=(0, 1))(x, a)
        return loss, grads

    (l1, (dx1, da1)), (l2, (dx2, da2)) = run(True), run(False)
    np.testing.assert_allclose(l1.item(), l2.item(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.array(dx1), np.array(dx2), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.array(da1), np.array(da2), rtol=1e-4, atol=1e-5)
    dropped = float((np.array(dx2) == 0).mean())
    assert abs(dropped - p) < 0.15  # the masks are really drawn: about p of x's gradient is zero
    drop.eval()
    np.testing.assert_allclose(np.array(drop.matmul(x, a)), np.array(x @ a), rtol=1e-6, atol=1e-6)
