"""A LoRA run's frozen MoE expert stacks kept in the checkpoint's bfloat16 under float32 compute
(`models.widened.WidenedExperts`), on the native CPU path and the graph path (`kernel_path`).

Against the same bfloat16 checkpoint read all in float32 ("wide"): the stacks load bfloat16, the logits, the
loss and every LoRA gradient (LoRA on the experts or not, per-layer checkpointed and compiled as the engine
runs a step) are the same bit for bit, since widening is exact and each product is the same float32 product;
less of MLX's peak in the LoRA step than with the stacks widened on load, by about what the bfloat16 stacks save
(the graph path: less up to about one layer's stacks in float32), and than with them widened untied (the
code before `WidenedExperts`); the merge widens an adapted stack (the float32 run's merged stack) and a save
writes the stacks without adapter in bfloat16; full fine-tuning of a kept stack is refused in one line.

    python -m pytest -q tests/test_widened_experts.py
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map

import mlxrl
from mlxrl.errors import MlxrlError
from mlxrl.models import build_model, widened
from mlxrl.models.lora import apply_lora, merged
from mlxrl.models.moe import Experts
from mlxrl.plan.layers import kept_saving
from mlxrl.trainers.sft.config import SFTConfig

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def bf16_checkpoint(tiny_checkpoint, tmp_path_factory):
    """``bf16_checkpoint(arch)``: the tiny checkpoint saved in bfloat16, as the Hub's are."""
    root, made = tmp_path_factory.mktemp("bf16_moe"), {}

    def get(arch: str):
        if arch not in made:
            model, processor = mlxrl.load(tiny_checkpoint(arch), dtype="bfloat16")
            made[arch] = mlxrl.save(model, processor, root / arch)
        return made[arch]

    return get


def stacks(model) -> dict[str, mx.array]:
    """The expert stacks by path (not the adapters' factors, which the stacks' names end too)."""
    return {k: v for k, v in tree_flatten(model.parameters())
            if k.endswith(("gate_up_proj", "down_proj")) and ".lora_" not in k}


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_vl_moe"])
def test_kept_stacks_are_bf16_and_give_the_float32_logits(bf16_checkpoint, arch, kernel_path):
    """qwen3_vl_moe's checkpoint holds its stacks transposed ([E, D, 2I]), and the VL model nests them."""
    folder = bf16_checkpoint(arch)
    wide, _ = mlxrl.load(folder, dtype="float32")
    kept, _ = mlxrl.load(folder, dtype="float32", keep_linear_dtype=True)
    assert stacks(kept) and all(v.dtype == mx.bfloat16 for v in stacks(kept).values())
    assert all(v.dtype == mx.float32 for v in stacks(wide).values())
    layers = [m for _, m in kept.named_modules() if isinstance(m, Experts)]
    assert layers and all(isinstance(m, widened.WidenedExperts) for m in layers)
    ids = mx.array(np.random.default_rng(0).integers(0, 2000, (2, 24)))
    got, want = kept(ids), wide(ids)
    assert got.dtype == mx.float32
    np.testing.assert_array_equal(np.array(got), np.array(want))  # widening is exact: the same products


def lora_step(model, targets, checkpointing: bool):
    """The loss (cross-entropy + 0.02 x the router's load-balancing loss) and every adapter gradient of one
    step, compiled as the engine compiles it (`mx.compile` over the model's state)."""
    apply_lora(model, r=4, alpha=8, dropout=0.0, target_parameters=targets)
    model.train()
    model.language_model.set_checkpointing(checkpointing)
    mx.eval(model.parameters())
    ids = mx.array(np.random.default_rng(1).integers(0, 2000, (2, 40)))

    def loss(ids):
        aux = []
        logits = model(ids, router_aux=aux)[:, :-1]
        labels = ids[:, 1:, None]
        ce = mx.mean(mx.logsumexp(logits, axis=-1) - mx.take_along_axis(logits, labels, -1)[..., 0])
        return ce + 0.02 * aux[0]

    grad = mx.compile(nn.value_and_grad(model, loss), inputs=[model.state], outputs=[model.state])
    value, grads = grad(ids)
    mx.eval(value, grads)
    return np.array(value), {k: np.array(v) for k, v in tree_flatten(grads)}


@pytest.mark.parametrize("targets,checkpointing", [(None, True), (["gate_up_proj"], False), ([], True)])
def test_lora_loss_and_gradients_over_kept_stacks_are_the_float32_run_s(bf16_checkpoint, kernel_path, targets,
                                                                          checkpointing):
    """LoRA on both expert parameters, on one (down_proj kept without adapter), on none (the kept stacks only
    a frozen base): the same loss and gradients, bit for bit."""
    mx.random.seed(0)  # the adapters' A
    wide, _ = mlxrl.load(bf16_checkpoint("qwen3_moe"), dtype="float32")
    want_loss, want = lora_step(wide, targets, checkpointing)
    mx.random.seed(0)
    kept, _ = mlxrl.load(bf16_checkpoint("qwen3_moe"), dtype="float32", keep_linear_dtype=True)
    got_loss, got = lora_step(kept, targets, checkpointing)
    assert all(v.dtype == mx.bfloat16 for v in stacks(kept).values())
    np.testing.assert_array_equal(got_loss, want_loss)
    assert got.keys() == want.keys() and any("lora" in k for k in got)
    assert any("experts.lora" in k for k in got) is (targets != [])
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


MOE = dict(model_type="qwen3_moe", vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
           num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_experts=16, num_experts_per_tok=2,
           moe_intermediate_size=128, norm_topk_prob=True, tie_word_embeddings=True)


def step_peak(kind: str):
    """MLX's peak over one compiled, checkpointed step (LoRA on the attention and the experts) of a 4-layer MoE
    model whose weights hold bfloat16 values: all float32 ("wide"), the linears and the embedding kept bfloat16
    and the expert stacks float32 ("linears": the stacks widened on load, as before they were kept), the stacks
    kept too ("kept"), or bfloat16 in plain `Experts` ("plain": `moe.gathered` widens them untied, as the code
    before `WidenedExperts` did). Returns (peak bytes, loss, gradients)."""
    mx.random.seed(0)
    model = build_model(MOE)
    model.update(tree_map(lambda v: v.astype(mx.bfloat16).astype(mx.float32), model.parameters()))
    if kind != "wide":
        weights = {k: v.astype(mx.bfloat16) for k, v in tree_flatten(model.parameters())
                   if k.endswith(("proj.weight", "embed_tokens.weight")) or (kind != "linears" and k in stacks(model))}
        widened.keep_linears(model, {k: v for k, v in weights.items() if kind == "kept" or k not in stacks(model)})
        model.load_weights(list(weights.items()), strict=False)
    mx.random.seed(1)
    apply_lora(model, r=4, alpha=8, dropout=0.0)
    model.language_model.set_checkpointing(True)
    mx.eval(model.parameters())
    ids = mx.array(np.random.default_rng(0).integers(0, 64, (1, 64)))

    def loss(ids):
        h = model(input_ids=ids, return_hidden=True)
        return (h.astype(mx.float32) ** 2).mean()

    grad = mx.compile(nn.value_and_grad(model, loss), inputs=[model.state], outputs=[model.state])
    mx.synchronize()
    mx.clear_cache()
    mx.reset_peak_memory()
    value, grads = grad(ids)
    mx.eval(value, grads)
    peak = mx.get_peak_memory()
    return peak, np.array(value), {k: np.array(v) for k, v in tree_flatten(grads)}


def test_kept_stacks_lower_the_lora_step_s_peak(kernel_path):
    """The 4 layers' stacks are 4 x 16 x (256 + 128) x 128 weights: bfloat16 saves 2 bytes each. The native
    kernel widens one expert's matrix at a time, so nearly all of that comes off the peak. The graph path widens
    a whole stack per call, and MLX's queue (each op's output allocated as the op is encoded, ahead of its run)
    holds some of a layer's recomputed and backward widenings at once, how many depending on how far the
    encoding runs ahead: up to about one layer's stacks in float32 less. Widened untied, `mx.compile` keeps the
    forward's widened stacks for the backward: above the float32 stacks' peak. The planner's term for what the
    kept weights save (`plan.layers.kept_saving`) against the measured difference."""
    wide_peak, _, _ = step_peak("wide")
    linears_peak, linears_loss, linears_grads = step_peak("linears")
    kept_peak, kept_loss, kept_grads = step_peak("kept")
    plain_peak, _, _ = step_peak("plain")
    np.testing.assert_array_equal(kept_loss, linears_loss)
    for k in linears_grads:
        np.testing.assert_array_equal(kept_grads[k], linears_grads[k], err_msg=k)
    layer = 16 * (256 + 128) * 128
    saved = 2 * 4 * layer
    least = 0.9 * saved if kernel_path == "native" else saved - 1.5 * 4 * layer
    assert least < linears_peak - kept_peak < 1.1 * saved, (linears_peak, kept_peak, saved)
    assert plain_peak > linears_peak > kept_peak, (plain_peak, linears_peak)  # untied: copies kept to the backward
    args = SFTConfig(use_peft=True, dtype="float32")
    planned = kept_saving(build_model(MOE), {"dtype": "bfloat16"}, args.keeps_checkpoint_dtype(mx.float32), 4)
    assert planned == pytest.approx(wide_peak - kept_peak, rel=0.25 if kernel_path == "native" else 0.5), \
        (planned, wide_peak - kept_peak)


def test_the_merge_widens_an_adapted_kept_stack_and_the_save_keeps_the_others(bf16_checkpoint, tmp_path):
    """LoRA on gate_up_proj only: merged, gate_up_proj is the float32 run's merged stack (widened, then W + scale
    B A, unrounded, as a kept linear merges) and down_proj stays the checkpoint's bfloat16; the save writes each
    expert's down_proj in bfloat16, and loads back as the merged model."""
    merges = []
    for keep in (False, True):
        model, processor = mlxrl.load(bf16_checkpoint("qwen3_moe"), dtype="float32", keep_linear_dtype=keep)
        mx.random.seed(0)
        apply_lora(model, r=4, alpha=8, dropout=0.0, target_parameters=["gate_up_proj"])
        for _, m in model.named_modules():  # a trained adapter: B not zero
            if hasattr(m, "lora_b") and isinstance(m.lora_b, dict):
                m.lora_b = {n: mx.random.normal(b.shape) * 0.01 for n, b in m.lora_b.items()}
        with merged(model) as plain:
            merges.append(stacks(plain))
            if keep:
                out = mlxrl.save(plain, processor, tmp_path / "merged")
                again, _ = mlxrl.load(out, dtype="float32", keep_linear_dtype=True)
                ids = mx.array([[3, 9, 27, 81, 243, 729]])
                np.testing.assert_array_equal(np.array(again(ids)), np.array(plain(ids)))
    wide, kept = merges
    for k, v in kept.items():
        assert v.dtype == (mx.float32 if k.endswith("gate_up_proj") else mx.bfloat16), k
        np.testing.assert_array_equal(np.array(v.astype(mx.float32)), np.array(wide[k]), err_msg=k)
    saved = {}
    for f in sorted((tmp_path / "merged").glob("*.safetensors")):
        saved.update(mx.load(str(f)))
    down = [k for k in saved if k.endswith("experts.0.down_proj.weight")]
    gate = [k for k in saved if k.endswith("experts.0.gate_proj.weight")]
    assert down and gate and all(saved[k].dtype == mx.bfloat16 for k in down)
    assert all(saved[k].dtype == mx.float32 for k in gate)


def test_training_a_kept_stack_is_refused(bf16_checkpoint):
    model, _ = mlxrl.load(bf16_checkpoint("qwen3_moe"), dtype="float32", keep_linear_dtype=True)
    model.freeze()
    path, layer = next((p, m) for p, m in model.named_modules() if isinstance(m, Experts))
    layer.unfreeze(keys=["down_proj"])
    with pytest.raises(MlxrlError, match=rf"{path}\.down_proj \(an expert stack\) is kept in bfloat16.*load the "
                                         "model without keep_linear_dtype"):
        widened.check_trainable_dtypes(model)
    layer.freeze()
    widened.check_trainable_dtypes(model)  # frozen: fine
