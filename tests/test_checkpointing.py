"""Nested segment checkpointing (`models.checkpointing`, `checkpoint_segments`) against the per-layer
checkpointing it nests around and against no checkpointing: the same loss and gradients (the per-layer ones
bit for bit, LoRA dropout on: the same masks), eager and compiled, through Qwen3-VL's deepstack features and
GRPO's prompt-shared forward; its memory saving against the naive count of the layer inputs it no longer
keeps; its refusals."""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

import mlxrl
from mlxrl.errors import ConfigError
from mlxrl.models import build_model
from mlxrl.models.checkpointing import best_segments, kept_inputs, recomputed_layers, segment_size
from mlxrl.models.lora import apply_lora

CONFIG = dict(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=5,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True)


def lora_model(config: dict, dropout: float = 0.3):
    """A LoRA model whose every trainable parameter has values (lora_b starts at 0)."""
    mx.random.seed(0)
    model = build_model(config)
    apply_lora(model, r=4, alpha=8, dropout=dropout)
    model.load_weights([(k, mx.random.normal(v.shape) * 0.1) for k, v in tree_flatten(model.trainable_parameters())],
                       strict=False)
    model.train()
    return model


def step(model, segments: int | None, seed: int = 3, length: int = 24, compiled: bool = False):
    """Loss and gradients of a weighted sum of the hidden states; segments None: no checkpointing."""
    model.language_model.set_checkpointing(segments is not None, False, segments or 0)
    width = model.language_model.config.hidden_size
    ids = mx.array(np.random.default_rng(0).integers(0, 64, (2, length)), mx.int32)
    w = mx.array(np.random.default_rng(1).standard_normal((2, length, width)).astype(np.float32))
    mx.random.seed(seed)
    fn = nn.value_and_grad(model, lambda m: (m(input_ids=ids, return_hidden=True) * w).sum())
    if compiled:  # as the trainers: the random state is compiled state too (the dropout keys)
        state = [model.state, mx.random.state]
        loss, grads = mx.compile(lambda: fn(model), inputs=state, outputs=state)()
    else:
        loss, grads = fn(model)
    mx.eval(loss, grads)
    return loss.item(), dict(tree_flatten(grads))


def assert_same(a: dict, b: dict, exact: bool = True):
    assert a.keys() == b.keys() and a
    for k in a:
        if exact:
            assert mx.array_equal(a[k], b[k]).item(), k
        else:
            np.testing.assert_allclose(np.array(a[k]), np.array(b[k]), rtol=1e-4, atol=1e-6, err_msg=k)


def test_counts():
    """The layer inputs kept: every layer's per layer; each segment's plus one segment's layers'."""
    assert [segment_size(28, s) for s in (2, 5, 6, 27)] == [14, 6, 5, 2]
    assert [kept_inputs(28, s) for s in (0, 1, 2, 5, 6, 27)] == [28, 28, 15, 10, 10, 15]
    # the last segment runs per layer: every layer of the others runs one more forward
    assert [recomputed_layers(28, s) for s in (0, 2, 4, 5, 6)] == [0, 14, 21, 24, 25]
    # the fewest inputs kept, then the fewest layers recomputed; none where nothing is saved
    assert [best_segments(n) for n in (2, 3, 4, 9, 28, 36)] == [0, 0, 2, 3, 4, 6]
    assert all(kept_inputs(28, s) >= kept_inputs(28, 4) for s in range(2, 28))


@pytest.mark.usefixtures("kernel_path")
@pytest.mark.parametrize("segments", [2, 3, 4])
def test_segments_equal_per_layer(segments):
    """Loss and every LoRA gradient (dropout 0.3) equal per-layer checkpointing's bit for bit, and no
    checkpointing's to rounding; another seed changes them (the masks are drawn)."""
    model = lora_model(CONFIG)
    loss_layer, per_layer = step(model, 0)
    loss_seg, seg = step(model, segments)
    assert loss_seg == loss_layer
    assert_same(seg, per_layer)
    loss_off, off = step(model, None)
    np.testing.assert_allclose(loss_seg, loss_off, rtol=1e-5)
    assert_same(seg, off, exact=False)
    assert abs(step(model, segments, seed=4)[0] - loss_seg) > 1e-3


@pytest.mark.usefixtures("kernel_path")
def test_segments_compiled():
    """Compiled as the trainers compile their step, the segments give the eager per-layer gradients."""
    model = lora_model(CONFIG)
    loss, eager = step(model, 0)
    loss_c, compiled = step(model, 2, compiled=True)
    np.testing.assert_allclose(loss_c, loss, rtol=1e-5)
    assert_same(compiled, eager, exact=False)


@pytest.mark.usefixtures("kernel_path")
def test_segments_save_the_layer_inputs():
    """MLX's peak drops by the layer inputs no longer kept: (L - kept_inputs) x [T, D] float32, the naive
    count (12 layers in 3 segments of 4: 6 inputs kept instead of 12)."""
    config = dict(CONFIG, hidden_size=512, intermediate_size=1024, num_hidden_layers=12, head_dim=64, vocab_size=256)
    model = lora_model(config, dropout=0.0)
    T = 768
    ids = mx.array(np.random.default_rng(0).integers(0, 256, (1, T)), mx.int32)
    w = mx.random.normal((1, T, 512))
    mx.eval(model.parameters(), w)
    peaks = {}
    for segments in (0, 3, 0, 3):  # twice each: the first call of a shape may allocate more
        model.language_model.set_checkpointing(True, False, segments)
        fn = nn.value_and_grad(model, lambda m: (m(input_ids=ids, return_hidden=True) * w).sum())
        mx.clear_cache()
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        loss, grads = fn(model)
        mx.eval(loss, grads)
        peaks[segments] = mx.get_peak_memory() - base
        del loss, grads
    expected = (12 - kept_inputs(12, 3)) * T * 512 * 4
    assert kept_inputs(12, 3) == 6
    saved = peaks[0] - peaks[3]
    assert 0.8 * expected <= saved <= 1.25 * expected, (saved, expected, peaks)


def deeper(folder, layers: int) -> dict:
    """The tiny checkpoint's config with `layers` decoder layers."""
    config = json.loads((folder / "config.json").read_text())
    config.get("text_config", config)["num_hidden_layers"] = layers
    return config


@pytest.mark.usefixtures("kernel_path")
def test_segments_vl_deepstack_and_shared_prompt(tiny_checkpoint):
    """Qwen3-VL (its deepstack features added after the first layers, inside the first segment) with two
    images: the plain forward and GRPO's prompt-shared forward give the per-layer gradients, the vision
    tower's included."""
    from test_generation import completions, grads_of, prompts

    from mlxrl.generation.shared_prompt import shared_prompt_logprobs

    folder = tiny_checkpoint("qwen3_vl")
    _, processor = mlxrl.load(folder, dtype="float32")
    model = lora_model(deeper(folder, 5), dropout=0.2)
    model.unfreeze()
    batch = prompts(processor, True)
    n, C = batch["input_ids"].shape[0] * 2, 4
    comp_ids, comp_mask = completions(n, C, 3)
    weights = mx.array(np.random.default_rng(4).standard_normal((n, C)).astype(np.float32))
    imgs = {k: batch[k] for k in ("pixel_values", "image_grid_thw")}
    results = {}
    for segments in (0, 2, 3):
        model.language_model.set_checkpointing(True, False, segments)
        mx.random.seed(7)
        _, _, shared = grads_of(model, shared_prompt_logprobs, batch, comp_ids, comp_mask, weights)
        mx.random.seed(7)
        hidden = nn.value_and_grad(model, lambda m: model(input_ids=batch["input_ids"], attention_mask=batch[
            "attention_mask"], return_hidden=True, **imgs).sum())(model)[1]
        results[segments] = (shared, dict(tree_flatten(hidden)))
    for segments in (2, 3):
        for got, want in zip(results[segments], results[0], strict=True):
            assert_same(got, want)
    vision = [k for k in results[0][0] if k.startswith(("visual.", "model.visual."))]
    assert vision and max(mx.abs(results[0][0][k]).max().item() for k in vision) > 0


def test_refusals():
    """One-line errors: one segment (saves nothing), as many segments as layers, no gradient checkpointing,
    keep_attention alongside; the config refuses the first before any model loads."""
    from mlxrl.trainers.config import check_config
    from mlxrl.trainers.sft.config import SFTConfig

    with pytest.raises(ConfigError, match="checkpoint_segments 1: must be 0"):
        check_config(SFTConfig(output_dir="out", checkpoint_segments=1), flags=True)
    with pytest.raises(ConfigError, match="--checkpoint_segments nests .* turn --gradient_checkpointing on"):
        check_config(SFTConfig(output_dir="out", checkpoint_segments=2, gradient_checkpointing=False), flags=True)
    lm = build_model(CONFIG).language_model
    for kw, match in ((dict(on=True, segments=5), "between 2 and 4 for this model's 5 decoder layers"),
                      (dict(on=False, segments=2), "turn gradient_checkpointing on"),
                      (dict(on=True, keep_attention=True, segments=2), "use one of them")):
        with pytest.raises(ConfigError, match=match):
            lm.set_checkpointing(**kw)


def test_trainer_segments(tiny_checkpoint, tmp_path):
    """SFT with checkpoint_segments trains the default run's steps (LoRA dropout 0.3): the same losses and
    adapters."""
    from mlxrl.trainers.sft.config import SFTConfig
    from mlxrl.trainers.sft.trainer import SFTTrainer

    folder = tiny_checkpoint("qwen3")
    _, processor = mlxrl.load(folder, dtype="float32")
    rows = [{"prompt": f"Count the words of sentence {i}, one by one:", "completion": " one two three four five"}
            for i in range(4)]
    runs = {}
    for segments in (0, 2):
        mx.random.seed(0)
        model = build_model(deeper(folder, 4))
        args = SFTConfig(output_dir=str(tmp_path / f"s{segments}"), use_peft=True, lora_r=4, lora_dropout=0.3,
                         max_steps=2, per_device_train_batch_size=2, learning_rate=1e-2, logging_steps=1,
                         save_strategy="no", disable_tqdm=True, checkpoint_segments=segments)
        trainer = SFTTrainer(model, processor, args, train_dataset=rows)
        trainer.train()
        assert model.language_model.checkpoint_segments == segments
        runs[segments] = ([e["loss"] for e in trainer.log_history if "loss" in e],
                          dict(tree_flatten(model.trainable_parameters())))
    assert len(runs[0][0]) == 2
    np.testing.assert_allclose(runs[2][0], runs[0][0], rtol=1e-6)
    assert_same(runs[2][1], runs[0][1], exact=False)
