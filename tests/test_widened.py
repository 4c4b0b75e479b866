"""A LoRA run's frozen base kept in the checkpoint's bfloat16 under float32 compute (`models.widened`).

Against the naive computation, the same bfloat16 checkpoint read all in float32: the same logits, the same
losses and adapters after training (widening is exact), less of MLX's peak memory in a compiled,
checkpointed step (and more without the widening's tie to its call's input: the test can fail); the CLI's
rule; full fine-tuning of a kept weight refused in one line."""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map
from PIL import Image

import mlxrl
from mlxrl.errors import MlxrlError
from mlxrl.models import build_model, widened
from mlxrl.models.lora import apply_lora, merged
from mlxrl.plan.layers import kept_saving
from mlxrl.trainers.sft.config import SFTConfig
from mlxrl.trainers.sft.trainer import SFTTrainer


@pytest.fixture(scope="module")
def bf16_checkpoint(tiny_checkpoint, tmp_path_factory):
    """``bf16_checkpoint(arch)``: the tiny checkpoint saved in bfloat16, as the Hub's are."""
    root, made = tmp_path_factory.mktemp("bf16"), {}

    def get(arch: str):
        if arch not in made:
            model, processor = mlxrl.load(tiny_checkpoint(arch), dtype="bfloat16")
            made[arch] = mlxrl.save(model, processor, root / arch)
        return made[arch]

    return get


def dtypes(model):
    return {k: v.dtype for k, v in tree_flatten(model.parameters())}


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_vl"])
def test_kept_linears_are_bf16_and_give_the_float32_logits(bf16_checkpoint, arch):
    folder = bf16_checkpoint(arch)
    wide, processor = mlxrl.load(folder, dtype="float32")
    kept, _ = mlxrl.load(folder, dtype="float32", keep_linear_dtype=True)
    narrow = {k for k, d in dtypes(kept).items() if d == mx.bfloat16}
    linears = {f"{p}.weight" for p, m in wide.named_modules()
               if isinstance(m, nn.Linear) or p.endswith("embed_tokens")}  # the embedding and the head too
    assert narrow and narrow == linears and any(k.endswith("embed_tokens.weight") for k in narrow)
    assert all(dtypes(wide)[k] == mx.float32 for k in dtypes(wide))
    inputs = {"input_ids": mx.array([[1, 5, 7, 9, 11, 3, 2, 8]])}
    if arch == "qwen3_vl":  # an image: the vision tower's kept linears run too
        image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8))
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
        batch = processor(text=[processor.apply_chat_template(messages, add_generation_prompt=True)], images=[image])
        inputs = {k: mx.array(np.asarray(batch[k])) for k in ("input_ids", "pixel_values", "image_grid_thw")}
    a, b = wide(**inputs), kept(**inputs)
    assert b.dtype == mx.float32
    np.testing.assert_array_equal(np.array(a), np.array(b))  # widening is exact: the same products


HEADS = ("embed_tokens.weight", "lm_head.weight")


def sft(folder, tmp_path, name, keep: bool, **kw):
    model, processor = mlxrl.load(folder, dtype="float32", keep_linear_dtype=keep)
    rows = [{"messages": [{"role": "user", "content": f"Say {w} twice."},
                          {"role": "assistant", "content": f"{w} {w}"}]} for w in ("red", "blue", "green", "gold")]
    args = SFTConfig(output_dir=str(tmp_path / name), max_steps=3, per_device_train_batch_size=2, logging_steps=1,
                     save_steps=0, disable_tqdm=True, seed=0, learning_rate=1e-3, max_length=64, **kw)
    trainer = SFTTrainer(model, processor, args, train_dataset=rows)
    before = dtypes(model)
    assert (mx.bfloat16 in before.values()) is keep
    trainer.train()
    losses = [e["loss"] for e in trainer.log_history if "loss" in e]
    assert dtypes(model) == before  # nothing changed dtype
    adapters = {k: np.array(v) for k, v in tree_flatten(model.trainable_parameters())}
    if not args.use_peft:
        return losses, adapters
    with merged(model) as plain:  # the merged weights, as --merge saves them
        # the embedding and the head have no adapter: the merge leaves them kept (bfloat16), compared widened
        adapters.update({f"merged {k}": np.array(v.astype(mx.float32) if k.endswith(HEADS) else v)
                         for k, v in tree_flatten(plain.parameters())})
    return losses, adapters


@pytest.mark.parametrize("checkpointing", [True, False])
def test_lora_training_over_a_kept_base_is_the_float32_run(bf16_checkpoint, tmp_path, checkpointing):
    folder = bf16_checkpoint("qwen3")
    kw = dict(use_peft=True, lora_r=4, lora_alpha=8, lora_dropout=0.1, gradient_checkpointing=checkpointing)
    losses, adapters = sft(folder, tmp_path, "wide", False, **kw)
    kept_losses, kept_adapters = sft(folder, tmp_path, "kept", True, **kw)
    np.testing.assert_allclose(kept_losses, losses, rtol=1e-6)
    assert adapters.keys() == kept_adapters.keys() and adapters
    for k in adapters:
        assert kept_adapters[k].dtype == adapters[k].dtype == np.float32, k  # the merge too: float32, unrounded
        # atol: the kept head's d_hidden sums the vocabulary a widened block at a time (rounding apart), which
        # Adam's first steps enlarge where a gradient is near zero (1 element in 256 by 4e-7)
        np.testing.assert_allclose(kept_adapters[k], adapters[k], rtol=1e-5, atol=2e-6, err_msg=k)


def test_full_fine_tuning_of_a_kept_base_is_refused(bf16_checkpoint, tmp_path):
    with pytest.raises(MlxrlError, match="kept in bfloat16.*load the model without keep_linear_dtype"):
        sft(bf16_checkpoint("qwen3"), tmp_path, "full", True)


WIDE = dict(model_type="qwen3", vocab_size=64, hidden_size=256, intermediate_size=1024, num_hidden_layers=6,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True)


def step_peak(kind: str):
    """MLX's peak over one compiled, checkpointed LoRA step of a 6-layer model whose linears are float32
    ("wide"), bfloat16 widened per call ("kept"), or bfloat16 in plain `nn.Linear`s ("plain": the widening
    depends on the weight alone). Returns (peak bytes, loss, adapter gradients)."""
    mx.random.seed(0)
    model = build_model(WIDE)
    model.update(tree_map(lambda v: v.astype(mx.bfloat16).astype(mx.float32), model.parameters()))  # bf16 values
    if kind != "wide":
        weights = {k: v.astype(mx.bfloat16) for k, v in tree_flatten(model.parameters()) if k.endswith("proj.weight")}
        if kind == "kept":
            widened.keep_linears(model, weights)
        model.load_weights(list(weights.items()), strict=False)
    apply_lora(model, r=4, alpha=8, dropout=0.0)
    model.language_model.gradient_checkpointing = True
    mx.eval(model.parameters())
    ids = mx.array(np.random.default_rng(0).integers(0, 64, (1, 96)))

    def loss(ids):
        h = model(input_ids=ids, return_hidden=True)
        return (h.astype(mx.float32) ** 2).mean()

    grad = mx.compile(nn.value_and_grad(model, loss), inputs=[model.state], outputs=[model.state])  # as the engine
    mx.synchronize()
    mx.clear_cache()
    mx.reset_peak_memory()
    value, grads = grad(ids)
    mx.eval(value, grads)
    return mx.get_peak_memory(), float(value), {k: np.array(v) for k, v in tree_flatten(grads)}


def test_a_kept_base_lowers_the_compiled_checkpointed_peak():
    wide_peak, wide_loss, wide_grads = step_peak("wide")
    kept_peak, kept_loss, kept_grads = step_peak("kept")
    plain_peak, _, _ = step_peak("plain")
    assert kept_loss == pytest.approx(wide_loss, rel=1e-6)
    for k in wide_grads:
        np.testing.assert_allclose(kept_grads[k], wide_grads[k], rtol=1e-4, atol=1e-8, err_msg=k)
    # the decoder's linears: 6 layers x 983,040 weights; bfloat16 saves 2 bytes each, one layer's float32
    # copy at a time is widened back
    linears = 6 * (2 * 256 * 256 + 2 * 256 * 128 + 3 * 256 * 1024)
    assert kept_peak < wide_peak - 0.5 * 2 * linears, (kept_peak, wide_peak)
    assert plain_peak > kept_peak + 2 * linears / 6, (plain_peak, kept_peak)  # untied: copies kept to backward
    # the planner's term for it, against the measured difference
    args = SFTConfig(use_peft=True, dtype="float32")
    planned = kept_saving(build_model(WIDE), {"dtype": "bfloat16"}, args.keeps_checkpoint_dtype(mx.float32), 4)
    assert planned == pytest.approx(wide_peak - kept_peak, rel=0.25)
    assert kept_saving(build_model(WIDE), {"dtype": "float32"}, args.keeps_checkpoint_dtype(mx.float32), 4) == 0
    assert kept_saving(build_model(WIDE), {"dtype": "bfloat16"},
                       SFTConfig(dtype="float32").keeps_checkpoint_dtype(mx.float32), 4) == 0


def test_the_cli_keeps_a_lora_runs_base_only(bf16_checkpoint, tmp_path, monkeypatch):
    from mlxrl.cli.sft import main as sft_main

    seen = []
    real = mlxrl.load

    def spy(*a, **kw):
        seen.append(kw.get("keep_linear_dtype", False))
        return real(*a, **kw)

    monkeypatch.setattr(mlxrl, "load", spy)
    data = tmp_path / "rows.jsonl"
    data.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                                        {"role": "assistant", "content": w}]})
                              for w in ("yes", "no")))
    base = ["--model", str(bf16_checkpoint("qwen3")), "--dataset", str(data), "--max_steps", "1",
            "--per_device_train_batch_size", "2", "--disable_tqdm", "true", "--save_steps", "0", "--dtype", "float32"]
    for extra, want in [(["--use_peft", "true"], True), (["--use_peft", "true", "--keep_frozen_dtype", "false"], False),
                        ([], False), (["--use_peft", "true", "--load_in_8bit", "true"], False),
                        (["--use_peft", "true", "--use_dora", "true"], False)]:
        out = tmp_path / f"out{len(seen)}"
        assert sft_main([*base, "--output_dir", str(out), *extra]) == 0
        assert seen[-1] is want, extra


def test_dpo_with_lora_over_a_kept_base_is_the_float32_run(bf16_checkpoint, tmp_path):
    from mlxrl.trainers.dpo.config import DPOConfig
    from mlxrl.trainers.dpo.trainer import DPOTrainer

    rows = [{"prompt": "The sky is", "chosen": " blue.", "rejected": " green today."},
            {"prompt": "One plus one is", "chosen": " two", "rejected": " three, or maybe four"}]
    runs = []
    for keep in (False, True):
        model, processor = mlxrl.load(bf16_checkpoint("qwen3"), dtype="float32", keep_linear_dtype=keep)
        args = DPOConfig(output_dir=str(tmp_path / f"dpo{keep}"), max_steps=2, per_device_train_batch_size=2,
                         logging_steps=1, save_steps=0, disable_tqdm=True, seed=0, learning_rate=1e-3,
                         use_peft=True, lora_r=4, lora_alpha=8)
        trainer = DPOTrainer(model, processor, args, train_dataset=rows)
        trainer.train()
        history = trainer.log_history
        runs.append([(e["loss"], e["logps/chosen"]) for e in history if "loss" in e])
    np.testing.assert_allclose(runs[1], runs[0], rtol=1e-5)


def test_every_way_into_a_run_loads_in_the_dtype_its_config_decides(bf16_checkpoint, tmp_path, monkeypatch):
    """The run's dtype name is resolved once by its config (`TrainConfig.compute_dtype`) and the model loads in
    it (`trainers.model_setup.load_for_training`): a LoRA run keeps the bfloat16 checkpoint's frozen linears,
    full fine-tuning widens them, bf16=True loads in bfloat16; and `python -m mlxrl.sft --model` without a
    dataset (the LoRA smoke run) loads as a LoRA run with a dataset does."""
    from mlxrl.cli import sft as cli_sft
    from mlxrl.trainers import model_setup

    monkeypatch.delenv("MLXRL_DTYPE", raising=False)
    folder = bf16_checkpoint("qwen3")
    proj = "model.layers.0.self_attn.q_proj.weight"
    for args, compute, linear in [(SFTConfig(use_peft=True), mx.float32, mx.bfloat16),
                                  (SFTConfig(), mx.float32, mx.float32),
                                  (SFTConfig(bf16=True), mx.bfloat16, mx.bfloat16)]:
        assert args.compute_dtype() == compute
        model, _ = model_setup.load_for_training(str(folder), args)
        assert model.compute_dtype() == compute and dtypes(model)[proj] == linear

    loaded, real = [], model_setup.load_for_training
    monkeypatch.setattr(model_setup, "load_for_training", lambda *a, **k: loaded.append(real(*a, **k)) or loaded[-1])
    args = SFTConfig(output_dir=str(tmp_path / "smoke"), max_steps=1, disable_tqdm=True)
    cli_sft.run_demo(args, {"output_dir", "max_steps", "disable_tqdm"}, model_path=str(folder))
    base = [d for k, d in dtypes(loaded[0][0]).items() if "layers.0.self_attn.q_proj" in k and "lora" not in k]
    assert args.use_peft and base == [mx.bfloat16]
