"""SFTTrainer on the shared engine: step-0 loss against transformers' causal-LM loss (what TRL's
nll is), trained / frozen parameters, packed == unpacked, exact resume, merged LoRA save loaded by
transformers, CLI errors."""

import json
import os

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
import torch
import transformers
from conftest import skip_native_on_gpu
from mlx.utils import tree_flatten

import mlxrl
from mlxrl.cli.sft import main as sft_main
from mlxrl.data.batches import patch_bucket
from mlxrl.data.synthetic import make_vqa
from mlxrl.models.lora import lora_layers
from mlxrl.optim import optimizers as optim_lib
from mlxrl.trainers import engine as engine_lib
from mlxrl.trainers.sft.config import SFTConfig
from mlxrl.trainers.sft.trainer import SFTTrainer

TEXT_ROWS = [
    {"messages": [{"role": "user", "content": "What is two plus two?"}, {"role": "assistant", "content": "Four."}]},
    {"prompt": "The capital of France is", "completion": " Paris."},
    {"text": "A short document about MLX and training loops on one machine."},
    {"messages": [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hi there, friend!"}]},
]


def config(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path / "run"), max_length=256, gradient_checkpointing=False, compile=False,
                disable_tqdm=True, save_steps=0, logging_steps=1, per_device_train_batch_size=4, learning_rate=1e-2,
                seed=0)
    base.update(kw)
    return SFTConfig(**base)


def grads_and_loss(trainer, batch):
    arrays = trainer.to_device(batch)
    (loss, _), grads = nn.value_and_grad(trainer.model, trainer.loss)(
        trainer.model, arrays, mx.array(batch["trained_tokens"], dtype=mx.float32))
    return loss.item(), dict(tree_flatten(grads))


HF_CLASS = {"qwen3": "Qwen3ForCausalLM", "qwen3_vl": "Qwen3VLForConditionalGeneration",
            "qwen3_5_text": "Qwen3_5ForCausalLM"}


@pytest.mark.usefixtures("kernel_path")
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_vl", "qwen3_5_text"])
def test_step0_loss_matches_transformers(arch, tiny_checkpoint, tmp_path):
    """TRL's nll is sum(-log p) over trained tokens / their count: transformers' causal-LM loss
    with the same labels (shifted inside) and num_items_in_batch."""
    folder = tiny_checkpoint(arch)
    model, processor = mlxrl.load(folder)
    rows = make_vqa(4, seed=3) if arch == "qwen3_vl" else TEXT_ROWS
    trainer = SFTTrainer(model, processor, config(tmp_path), train_dataset=rows)
    batch = trainer._batches_of(trainer.train_examples, 0, False, 4)[0]
    loss, _ = grads_and_loss(trainer, batch)

    ref = getattr(transformers, HF_CLASS[arch])
    hf = ref.from_pretrained(str(folder), dtype=torch.float32).eval()
    from mlxrl.data import make_batches

    raw = make_batches(trainer.train_examples, 4, max_length=256, pad_token_id=processor.pad_token_id, shuffle=False)[0]
    inputs = {"input_ids": torch.tensor(raw.input_ids).long(), "labels": torch.tensor(raw.labels).long(),
              "attention_mask": torch.tensor(raw.attention_mask).long()}
    if raw.pixel_values is not None:
        inputs.update(pixel_values=torch.tensor(raw.pixel_values),
                      image_grid_thw=torch.tensor(raw.image_grid_thw).long(),
                      mm_token_type_ids=(inputs["input_ids"] == processor.image_token_id).long())
    with torch.no_grad():
        expected = hf(**inputs).loss.item()
    assert abs(loss - expected) <= 1e-4 * max(1.0, abs(expected)), (loss, expected)


def test_trained_and_frozen_parameters(tmp_path):
    model, processor = mlxrl.load_default()
    before = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
    rows = make_vqa(8, seed=1)
    SFTTrainer(model, processor, config(tmp_path, max_steps=2, freeze_vision_tower=True), train_dataset=rows).train()
    after = dict(tree_flatten(model.parameters()))
    for k, v in before.items():
        changed = not np.array_equal(v, np.array(after[k]))
        assert changed != k.startswith("model.visual."), k  # vision frozen, everything else trained

    model, processor = mlxrl.load_default()
    SFTTrainer(model, processor, config(tmp_path / "full", max_steps=2), train_dataset=rows).train()
    after = dict(tree_flatten(model.parameters()))
    unchanged = [k for k, v in before.items() if np.array_equal(v, np.array(after[k]))]
    assert unchanged == [], unchanged  # vision tower included


@pytest.mark.parametrize("arch", ["qwen3_vl", "qwen3_5_text"])
def test_lora_trains_only_adapters_and_merged_save_loads_in_transformers(tiny_checkpoint, tmp_path, arch):
    folder = tiny_checkpoint(arch)
    model, processor = mlxrl.load(folder)
    base = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
    args = config(tmp_path, max_steps=3, use_peft=True, lora_r=4, lora_alpha=8, lora_dropout=0.0, merge=True)
    rows = make_vqa(6, seed=2) if arch == "qwen3_vl" else TEXT_ROWS
    SFTTrainer(model, processor, args, train_dataset=rows).train()
    assert {k for k, _ in tree_flatten(model.parameters())} == set(base)  # merged: plain weights again
    assert lora_layers(model) == []
    out = tmp_path / "run"
    peft_cfg = json.loads((out / "adapter_config.json").read_text())
    assert peft_cfg["r"] == 4 and (out / "adapter_model.safetensors").exists()
    changed = [k for k, v in tree_flatten(model.parameters()) if not np.array_equal(base[k], np.array(v))]
    assert changed and all(k.split(".")[-2] in peft_cfg["target_modules"] for k in changed)
    hf = getattr(transformers, HF_CLASS[arch]).from_pretrained(str(out / "merged"), dtype=torch.float32)
    ids = processor(text=["<|im_start|>user\nhello<|im_end|>\n"])
    with torch.no_grad():
        expected = hf(input_ids=torch.tensor(np.array(ids["input_ids"])).long()).logits.numpy()
    np.testing.assert_allclose(np.array(model(input_ids=ids["input_ids"])), expected, atol=1e-4)


@pytest.mark.usefixtures("kernel_path")
@pytest.mark.parametrize("mode", ["packing", "padding_free"])
@pytest.mark.parametrize("data", ["text", "vlm", "qwen3_5_text"])
def test_packed_batches_equal_unpacked(mode, data, tiny_checkpoint, tmp_path):
    """Packed / padding-free rows give the unpacked batch's loss and gradients; for Qwen3.5 the Gated DeltaNet's
    convolution and state restart at each document."""
    if data != "vlm":
        model, processor = mlxrl.load(tiny_checkpoint("qwen3" if data == "text" else data))
        rows = TEXT_ROWS
    else:
        model, processor = mlxrl.load_default()
        rows = make_vqa(4, seed=5)
    plain = SFTTrainer(model, processor, config(tmp_path), train_dataset=rows)
    packed = SFTTrainer(model, processor, config(tmp_path, **{mode: True}), train_dataset=rows)
    b_plain = plain._batches_of(plain.train_examples, 0, False, len(rows))
    b_packed = packed._batches_of(packed.train_examples, 0, False, len(rows))
    assert len(b_plain) == len(b_packed) == 1 and "segment_ids" in b_packed[0]
    assert b_packed[0]["input_ids"].shape[0] < len(rows) or mode == "padding_free"
    loss_a, grads_a = grads_and_loss(plain, b_plain[0])
    loss_b, grads_b = grads_and_loss(packed, b_packed[0])
    assert abs(loss_a - loss_b) <= 1e-5 * max(1, abs(loss_a))
    for k in grads_a:
        scale = max(float(mx.abs(grads_a[k]).max()), 1e-6)
        assert float(mx.abs(grads_a[k] - grads_b[k]).max()) / scale <= 1e-4, k


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_patch_bucket_padding_changes_nothing(arch, tiny_checkpoint, tmp_path):
    """With compile on, a batch's image patches are padded to a bucket by a dummy image: same loss
    and gradients as the unpadded batch, and different image sizes share one padded shape."""
    model, processor = mlxrl.load(tiny_checkpoint(arch))
    rows = make_vqa(3, seed=2, sides=(64, 160))
    plain = SFTTrainer(model, processor, config(tmp_path), train_dataset=rows)
    bucketed = SFTTrainer(model, processor, config(tmp_path, compile=True), train_dataset=rows)
    b_plain = plain._batches_of(plain.train_examples, 0, False, 3)[0]
    b_pad = bucketed.bucket_images(bucketed._batches_of(bucketed.train_examples, 0, False, 3)[0])
    n = len(b_plain["pixel_values"])
    assert len(b_pad["pixel_values"]) == patch_bucket(n) > n and len(b_pad["image_grid_thw"]) == 4
    b_pad = {**b_pad, "rows": b_plain["rows"], "targets": b_plain["targets"]}  # same rows (no row bucket)
    loss_a, grads_a = grads_and_loss(plain, b_plain)
    loss_b, grads_b = grads_and_loss(plain, b_pad)
    assert abs(loss_a - loss_b) <= 1e-5 * max(1, abs(loss_a))
    for k in grads_a:
        scale = max(float(mx.abs(grads_a[k]).max()), 1e-6)
        assert float(mx.abs(grads_a[k] - grads_b[k]).max()) / scale <= 1e-4, k
    for p in range(4, 4096, 4):  # room for the dummy, at most a quarter wasted
        assert p + 4 <= patch_bucket(p) <= max(16, 1.25 * (p + 4)) and patch_bucket(p) % 4 == 0
    assert len({patch_bucket(p) for p in range(4, 4096, 4)}) <= 4 * 12  # four sizes per doubling


def step_both(ours, theirs, tp, w0, rng, steps):
    """`steps` optimizer steps on both sides with the same random gradients, the clip scale (what
    clipping sets) alternating 1 / 0.5; returns our parameters."""
    params = {k: mx.array(v) for k, v in w0.items()}
    for step in range(steps):
        g = {k: rng.normal(size=v.shape).astype(np.float32) for k, v in w0.items()}
        scale = 0.5 if step % 2 else 1.0
        for k in tp:
            tp[k].grad = torch.tensor(g[k] * scale)
        theirs.step()
        ours.grad_scale = mx.array(scale)
        params = ours.apply_gradients({k: mx.array(v) for k, v in g.items()}, params)
        mx.eval(params, ours.state)
    return params


def test_adafactor_matches_transformers():
    """optim="adafactor": transformers' Adafactor as the HF Trainer builds it (scale_parameter=False,
    relative_step=False), with weight decay and the clip scale applied to the gradients."""
    from transformers.optimization import Adafactor

    rng = np.random.default_rng(0)
    w0 = {"w": rng.normal(size=(6, 5)).astype(np.float32), "b": rng.normal(size=(5,)).astype(np.float32)}
    tp = {k: torch.nn.Parameter(torch.tensor(v)) for k, v in w0.items()}
    theirs = Adafactor(list(tp.values()), lr=1e-2, scale_parameter=False, relative_step=False, weight_decay=0.1)
    ours = SFTConfig(optim="adafactor", learning_rate=1e-2, weight_decay=0.1,
                     lr_scheduler_type="constant").make_optimizer(10)
    params = step_both(ours, theirs, tp, w0, rng, 4)
    for k in tp:
        np.testing.assert_allclose(np.array(params[k]), tp[k].detach().numpy(), atol=1e-6, err_msg=k)
    assert "exp_avg_sq_row" in ours.state["w"] and "exp_avg" not in ours.state["w"]  # factored, no m
    with pytest.raises(ValueError, match="optim 'paged_adamw_8bit' is not supported"):
        optim_lib.check_optim("paged_adamw_8bit")


@pytest.mark.parametrize("kernel", ["native", "compiled"])
def test_adamw_matches_torch(kernel, monkeypatch):
    """optim="adamw_torch" (FusedAdamW, both its native CPU kernel and its compiled MLX kernel) against
    torch.optim.AdamW with weight decay, on a warm-up schedule, with the clip scale on the gradients."""
    from mlxrl.cpu import native

    if kernel == "compiled":
        monkeypatch.setattr(native, "load", lambda: None)
    else:
        skip_native_on_gpu(kernel)
        if os.environ.get("MLXRL_NATIVE") == "0":
            pytest.skip("MLXRL_NATIVE=0: the graph path only")
        assert native.load() is not None
    rng = np.random.default_rng(0)
    w0 = {"w": rng.normal(size=(64, 300)).astype(np.float32), "b": rng.normal(size=(7,)).astype(np.float32)}
    tp = {k: torch.nn.Parameter(torch.tensor(v)) for k, v in w0.items()}
    theirs = torch.optim.AdamW(list(tp.values()), lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    ours = SFTConfig(learning_rate=1e-2, adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-6,
                     weight_decay=0.1, lr_scheduler_type="constant").make_optimizer(10)
    params = step_both(ours, theirs, tp, w0, rng, 5)
    for k in tp:
        np.testing.assert_allclose(np.array(params[k]), tp[k].detach().numpy(), atol=2e-6, err_msg=k)
        np.testing.assert_allclose(np.array(ours.state[k]["v"]), theirs.state[tp[k]]["exp_avg_sq"].numpy(),
                                   rtol=1e-5, err_msg=k)


@pytest.mark.parametrize("path,dtype", [("native", "float32"), ("graph", "float32"), ("graph", "bfloat16")])
def test_adamw_updates_in_place(path, dtype, monkeypatch):
    """After the first step (which creates m and v, and a bf16 parameter's float32 master copy), the
    AdamW step writes the new weights, master and moments into the old ones' buffers: the peak above
    weights + state + gradients stays under 0.25x the trainable bytes (native CPU kernel, and the
    compiled kernels of the graph path: Metal, CUDA, bf16). A bf16 gradient is cast inside the kernels
    (no float32 copy of it). The reference is MLX's optim.AdamW, which allocates new arrays; a caller's
    own reference keeps the old weight intact."""
    from mlxrl.cpu import native

    if path == "graph":
        monkeypatch.setattr(native, "load", lambda: None)
    else:
        skip_native_on_gpu(path)
        if native.load() is None:
            pytest.skip("no native kernels")
    import mlx.optimizers as optim

    n = 1 << 20  # 1M elements per array
    dt = getattr(mx, dtype)

    def peak_of_second_step(opt):
        params = {"a": mx.random.normal((n,)).astype(dt), "b": mx.random.normal((n,)).astype(dt)}
        grads = {k: mx.random.normal((n,)).astype(dt) for k in params}
        mx.eval(params, grads)
        for _ in range(2):
            base = mx.get_active_memory()
            mx.reset_peak_memory()
            params = opt.apply_gradients(grads, params)
            mx.eval(params, opt.state)
        assert all(p.dtype == dt for p in params.values())
        return mx.get_peak_memory() - base

    trainable = 2 * n * dt.size
    ours = peak_of_second_step(optim_lib.FusedAdamW(learning_rate=1e-3))
    theirs = peak_of_second_step(optim.AdamW(learning_rate=1e-3))
    assert ours <= 0.25 * trainable, ours / trainable
    assert theirs > 1.5 * trainable, theirs / trainable  # MLX's update allocates: the measurement can tell

    w = mx.random.normal((n,))
    g = mx.random.normal((n,))
    mx.eval(w, g)
    before = np.array(w)
    opt = optim_lib.FusedAdamW(learning_rate=1e-1)
    new = opt.apply_gradients({"w": g}, {"w": w})
    mx.eval(new, opt.state)
    np.testing.assert_array_equal(np.array(w), before)  # still held here: not donated, not overwritten
    assert not np.allclose(np.array(new["w"]), before)


@pytest.mark.usefixtures("kernel_path")
@pytest.mark.parametrize("optim", ["adamw_torch", "adafactor"])
def test_resume_reproduces_the_uninterrupted_run(optim, tiny_checkpoint, tmp_path):
    rows = TEXT_ROWS * 4
    folder = tiny_checkpoint("qwen3")

    def run(out, **kw):
        model, processor = mlxrl.load(folder)
        args = config(tmp_path, output_dir=str(tmp_path / out), per_device_train_batch_size=2, max_steps=6,
                      use_peft=True, lora_dropout=0.1, learning_rate=1e-3, optim=optim, **kw)
        trainer = SFTTrainer(model, processor, args, train_dataset=rows)
        trainer.train()
        return [e["loss"] for e in trainer.log_history if "loss" in e]

    full = run("a", save_steps=3)
    resumed = run("a", resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-3"))
    assert resumed[3:] == full[3:]
    assert resumed[:3] == full[:3]  # the history comes back with the checkpoint


def test_checkpoint_rotation_and_atomicity(tiny_checkpoint, tmp_path):
    model, processor = mlxrl.load(tiny_checkpoint("qwen3"))
    args = config(tmp_path, per_device_train_batch_size=1, max_steps=4, save_steps=1, save_total_limit=2,
                  use_peft=True)
    SFTTrainer(model, processor, args, train_dataset=TEXT_ROWS).train()
    names = sorted(p.name for p in (tmp_path / "run").iterdir() if p.name.startswith(engine_lib.CHECKPOINT_PREFIX))
    assert names == ["checkpoint-3", "checkpoint-4"]
    assert not any(p.name.startswith(".") for p in (tmp_path / "run").iterdir())  # no temp folders left


def test_cli_errors_are_one_line(tmp_path, capsys):
    code = sft_main(["--model", str(tmp_path / "nope"), "--dataset", str(tmp_path / "d.jsonl")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "no such local path" in err[0]
    # --model without --dataset: the model is checked first (then trained on the embedded task)
    code = sft_main(["--model", str(tmp_path / "nope")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "no such local path" in err[0]


def test_all_ignored_batch_names_rows(tiny_checkpoint, tmp_path):
    model, processor = mlxrl.load(tiny_checkpoint("qwen3"))
    rows = [{"prompt": "only a prompt " * 30, "completion": " end"}]
    with pytest.raises(ValueError, match=r"example\(s\) 0"):
        SFTTrainer(model, processor, config(tmp_path, max_length=16), train_dataset=rows).train()


@pytest.mark.usefixtures("kernel_path")
@pytest.mark.parametrize("mode", ["fused", "two_phase"])
@pytest.mark.parametrize("loss_type", ["nll", "dft"])
def test_head_modes_give_the_same_step(mode, loss_type, tiny_checkpoint, tmp_path):
    """The fused head (default) and the two-phase step equal the general vocab-tiled head."""
    model, processor = mlxrl.load(tiny_checkpoint("qwen3"))
    a = SFTTrainer(model, processor, config(tmp_path, head_mode="differentiable", loss_type=loss_type),
                   train_dataset=TEXT_ROWS)
    b = SFTTrainer(model, processor, config(tmp_path, head_mode=mode, loss_type=loss_type), train_dataset=TEXT_ROWS)
    batch = a._batches_of(a.train_examples, 0, False, 4)[0]
    n = mx.array(batch["trained_tokens"], dtype=mx.float32)
    loss_a, metrics_a, grads_a = a.step_function()(a.to_device(batch), n)
    loss_b, metrics_b, grads_b = b.step_function()(b.to_device(batch), n)
    assert abs(loss_a.item() - loss_b.item()) <= 1e-5 * max(1, abs(loss_a.item()))
    assert abs(metrics_a["mean_token_accuracy"].item() - metrics_b["mean_token_accuracy"].item()) < 1e-6
    assert abs(metrics_a["entropy"].item() - metrics_b["entropy"].item()) <= 1e-5 * max(1, metrics_a["entropy"].item())
    ga, gb = dict(tree_flatten(grads_a)), dict(tree_flatten(grads_b))
    assert ga.keys() == gb.keys()
    for k in ga:
        scale = max(float(mx.abs(ga[k]).max()), 1e-6)
        assert float(mx.abs(ga[k] - gb[k]).max()) / scale <= 1e-4, k


def test_demo_learns_through_compiled_steps(tmp_path):
    """`python -m mlxrl.sft` (the embedded default, the whole run): >= 90% held-out exact match through
    compiled steps on few batch shapes (it used to turn compile off: 30 shapes, 0 compiled)."""
    from mlxrl.cli.sft import run_demo

    out = run_demo(SFTConfig(output_dir=str(tmp_path / "demo"), disable_tqdm=True), {"output_dir", "disable_tqdm"})
    assert out["after"] >= 0.9 and out["compiled_steps"] >= 1 and out["batch_shapes"] <= 5, out



@pytest.mark.parametrize("compile_step", [True, False])
def test_the_trainer_prints_the_compile_note(tmp_path, monkeypatch, capsys, compile_step):
    """The trainer asks `runtime.compile_note` whether its steps compile and prints what it says."""
    from mlxrl import runtime

    monkeypatch.setattr(runtime, "compile_note", lambda compiled: f"NOTE compiled={compiled}")
    model, processor = mlxrl.load_default()
    SFTTrainer(model, processor, config(tmp_path, max_steps=1, compile=compile_step),
               train_dataset=make_vqa(4, seed=0)).train()
    assert f"NOTE compiled={compile_step}" in capsys.readouterr().out


def test_fewer_batches_than_accumulation_steps_is_one_short_step(tmp_path):
    """An epoch of fewer micro-batches than gradient_accumulation_steps is one optimizer step on them
    (transformers' ragged last step); an epoch of no batch at all is one error (it once looped forever)."""
    model, processor = mlxrl.load_default()
    args = SFTConfig(output_dir=str(tmp_path / "run"), per_device_train_batch_size=8, gradient_accumulation_steps=4,
                     num_train_epochs=1, disable_tqdm=True)
    trainer = SFTTrainer(model, processor, args, train_dataset=make_vqa(8, seed=0))
    assert trainer.train().global_step == 1
    args = SFTConfig(output_dir=str(tmp_path / "none"), per_device_train_batch_size=16, dataloader_drop_last=True,
                     num_train_epochs=1, disable_tqdm=True)
    trainer = SFTTrainer(model, processor, args, train_dataset=make_vqa(8, seed=0))
    with pytest.raises(ValueError, match="the training data makes no batch"):
        trainer.train()
