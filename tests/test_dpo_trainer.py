"""DPOTrainer: step-0 loss and every metric against TRL 1.16's own DPOTrainer (torch, CPU, float32) on
the same tiny checkpoints and batch, for sigmoid, ipo and a weighted list of two loss types, text
(Qwen3, plain and conversational implicit-prompt) and vision (Qwen2-VL); the LoRA-off reference
equals a separately loaded frozen copy and holds no second copy in memory; precomputed reference
log-probs; padding-free == padded; trained parameters change; the demo's DPO raises held-out exact match and
preference accuracy, and its rewards/accuracies rise above 0.5; CLI errors.

    python -m pytest -x -q tests/test_dpo_trainer.py
"""

import shutil

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import tiny_checkpoints_module
from mlx.utils import tree_flatten

import mlxrl
from mlxrl.cli.dpo import main as dpo_main
from mlxrl.cli.dpo import preference_pairs, run_demo
from mlxrl.data.preference import extract_prompt
from mlxrl.models.lora import lora_layers
from mlxrl.trainers.dpo.config import DPOConfig
from mlxrl.trainers.dpo.trainer import DPOTrainer

hf_processor = tiny_checkpoints_module().hf_processor

TEXT_ROWS = [
    {"prompt": "The sky is", "chosen": " blue.", "rejected": " green today."},
    {"prompt": "One plus one is", "chosen": " two", "rejected": " three, or maybe four"},
    {"prompt": "Paris is the capital of", "chosen": " France.", "rejected": " Spain."},
    {"prompt": "Water boils at", "chosen": " 100 degrees Celsius at sea level.", "rejected": " 50 degrees."},
]
CONV_ROWS = [  # implicit prompt: the shared first message is the prompt
    {"chosen": [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "Four."}],
     "rejected": [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "Five, I think."}]},
    {"chosen": [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hi there!"}],
     "rejected": [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "No."}]},
    {"chosen": [{"role": "user", "content": "Name a colour"}, {"role": "assistant", "content": "Red."}],
     "rejected": [{"role": "user", "content": "Name a colour"}, {"role": "assistant", "content": "A dog."}]},
]
LOSSES = [(["sigmoid"], None), (["ipo"], None), (["sigmoid", "bco_pair"], [0.8, 0.2])]
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected", "logits/chosen", "logits/rejected", "entropy", "mean_token_accuracy")


def config(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path / "run"), max_length=256, gradient_checkpointing=False, compile=False,
                disable_tqdm=True, save_steps=0, logging_steps=1, per_device_train_batch_size=4, seed=0)
    base.update(kw)
    return DPOConfig(**base)


def vision_rows(n=3):
    from mlxrl.data.synthetic import make_vqa

    return preference_pairs(make_vqa(n, seed=4), seed=1)


@pytest.fixture(scope="module")
def ref_checkpoint(tiny_checkpoint, tmp_path_factory):
    """A perturbed copy of a tiny checkpoint: the reference, so that rewards are not all zero at step 0."""
    from safetensors.numpy import load_file, save_file

    made = {}

    def get(arch):
        if arch not in made:
            src = tiny_checkpoint(arch)
            out = tmp_path_factory.mktemp("ref") / arch
            shutil.copytree(src, out)
            rng = np.random.default_rng(7)
            w = load_file(str(src / "model.safetensors"))
            w = {k: (v + rng.normal(0, 0.03, v.shape)).astype(v.dtype) for k, v in w.items()}
            save_file(w, str(out / "model.safetensors"), metadata={"format": "pt"})
            made[arch] = out
        return made[arch]

    return get


# ------------------------------------------------------------------------------------- TRL parity

def trl_step0(arch, folder, ref_folder, rows, tmp_path):
    """TRL's loss and logged metrics for each of LOSSES on the whole `rows` as one batch."""
    import torch
    import transformers
    from datasets import Dataset
    from trl import DPOConfig as TRLConfig
    from trl import DPOTrainer as TRLTrainer

    cls = {"qwen3": transformers.Qwen3ForCausalLM, "qwen3_5_text": transformers.Qwen3_5ForCausalLM,
           "qwen3_moe": transformers.Qwen3MoeForCausalLM}.get(
        arch, transformers.Qwen2VLForConditionalGeneration)
    policy = cls.from_pretrained(str(folder), dtype=torch.float32)
    ref = cls.from_pretrained(str(ref_folder), dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained
    processing = hf_processor(folder) if arch.endswith("_vl") else tokenizer(str(folder))
    args = TRLConfig(output_dir=str(tmp_path / "trl"), bf16=False, gradient_checkpointing=False, report_to="none",
                     use_cpu=True, max_length=256, per_device_train_batch_size=len(rows))
    trainer = TRLTrainer(model=policy, ref_model=ref, args=args, train_dataset=Dataset.from_list(rows),
                         processing_class=processing)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(rows))])
    policy.train()
    out = []
    for types, weights in LOSSES:  # the loss settings are read per call: one trainer serves all three
        trainer.loss_types, trainer.loss_weights = types, weights or [1.0] * len(types)
        trainer._metrics["train"].clear()
        trainer._total_train_tokens = 0
        with torch.no_grad():
            loss = trainer.compute_loss(policy, dict(batch)).item()
        out.append((loss, {k: v[-1] for k, v in trainer._metrics["train"].items()}))
    return out


@pytest.mark.usefixtures("kernel_path")
@pytest.mark.parametrize("arch,data", [("qwen3", "text"), ("qwen3", "conversational"), ("qwen2_vl", "vision"),
                                       ("qwen3_5_text", "conversational"), ("qwen3_moe", "text")])
def test_step0_loss_and_metrics_match_trl(arch, data, tiny_checkpoint, ref_checkpoint, tmp_path):
    folder, ref_folder = tiny_checkpoint(arch), ref_checkpoint(arch)
    rows = {"text": TEXT_ROWS, "conversational": CONV_ROWS, "vision": vision_rows()}[data]
    expected = trl_step0(arch, folder, ref_folder, rows, tmp_path)

    model, processor = mlxrl.load(folder)
    ref_model, _ = mlxrl.load(ref_folder)
    trainer = DPOTrainer(model, processor, config(tmp_path), train_dataset=rows, ref_model=ref_model)
    batch = trainer.pair_batches(trainer.train_examples, 0, False, len(rows))[0]
    arrays = trainer.gradient_free_inputs(trainer.to_device(batch))
    if trainer.router_aux_coef:  # an MoE model: the engine's weight of the router loss for a one-batch step
        arrays["router_aux_scale"] = mx.array(trainer.router_aux_coef, dtype=mx.float32)
    for (types, weights), (want_loss, want) in zip(LOSSES, expected, strict=True):
        trainer.args.loss_type, trainer.args.loss_weights = types, weights
        loss, metrics = trainer.loss(trainer.model, arrays, mx.array(len(rows), dtype=mx.float32))
        got = {k: v.item() for k, v in metrics.items()}
        assert abs(loss.item() - want_loss) <= 1e-4 * max(1.0, abs(want_loss)), (types, loss.item(), want_loss)
        for k in METRICS + (("aux_loss",) if arch == "qwen3_moe" else ()):
            assert abs(got[k] - want[k]) <= 1e-4 * max(1.0, abs(want[k])), (types, k, got[k], want[k])
        assert batch["num_tokens"] == want["num_tokens"]
    assert abs(got["rewards/margins"]) > 1e-3  # the perturbed reference makes the comparison non-trivial


def test_extract_prompt_matches_trl():
    from trl.data_utils import extract_prompt as trl_extract

    cases = [{"chosen": "The sky is blue.", "rejected": "The sky is green."},
             {"chosen": "Same start then A", "rejected": "Same start then B"},
             CONV_ROWS[0]]
    for row in cases:
        want = trl_extract(row)
        assert extract_prompt(row["chosen"], row["rejected"]) == (want["prompt"], want["chosen"], want["rejected"])


# ------------------------------------------------------------------------------------- reference

@pytest.mark.usefixtures("kernel_path")
@pytest.mark.parametrize("use_dora", [False, True])
def test_lora_off_reference_equals_a_frozen_copy_without_a_second_copy(use_dora, tiny_checkpoint, tmp_path):
    folder = tiny_checkpoint("qwen3")
    model, processor = mlxrl.load(folder)
    weight_bytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    # small vocabulary tiles, so that a copy of the weights would stand out in the peak
    trainer = DPOTrainer(model, processor, config(tmp_path, use_peft=True, lora_r=4, use_dora=use_dora,
                                                  chunk_size=8192), train_dataset=TEXT_ROWS)
    assert trainer.ref_model is None
    mx.random.seed(3)
    for _, layer in lora_layers(model):  # adapters that change the output, as after some training
        layer.lora_b = mx.random.normal(layer.lora_b.shape) * 0.05
    mx.eval(model.parameters())
    batch = trainer.pair_batches(trainer.train_examples, 0, False, 4)[0]
    arrays = trainer.gradient_free_inputs(trainer.to_device(batch))  # the reference log-probs: adapters off
    mx.eval(arrays)
    mx.reset_peak_memory()
    active = mx.get_active_memory()
    chosen, rejected = trainer.reference_logps(arrays)
    extra_peak = mx.get_peak_memory() - active
    base, _ = mlxrl.load(folder)  # a separate frozen copy of the base weights
    want = trainer.sequence_logps(base, arrays)
    np.testing.assert_allclose(np.array(arrays["ref_chosen"]), np.array(want[:4]), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(np.array(arrays["ref_rejected"]), np.array(want[4:]), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(np.array(chosen), np.array(want[:4]), rtol=1e-5, atol=1e-4)
    policy = trainer.sequence_logps(model, arrays)
    assert float(mx.abs(policy - want).max()) > 1e-3  # the adapters are back on afterwards
    assert lora_layers(model)
    assert extra_peak < 0.2 * weight_bytes, (extra_peak, weight_bytes)  # no second copy of the weights
    assert rejected.shape == (4,)


def test_a_model_carrying_adapters_trains_them_against_itself_with_them_off(tiny_checkpoint, tmp_path):
    """A policy given with LoRA layers already on it and use_peft off (TRL: a PeftModel passed in): its adapters
    train and nothing else, and the reference is the policy with them off (no frozen copy, which could not even
    load the adapters' weights): its log-probs equal the base checkpoint's."""
    from mlxrl.models.lora import apply_lora

    folder = tiny_checkpoint("qwen3")
    model, processor = mlxrl.load(folder)
    apply_lora(model, r=4, alpha=8, dropout=0.0)
    mx.random.seed(4)
    for _, layer in lora_layers(model):
        layer.lora_b = mx.random.normal(layer.lora_b.shape) * 0.05
    trainer = DPOTrainer(model, processor, config(tmp_path), train_dataset=TEXT_ROWS)
    assert trainer.ref_model is None
    trained = [k for k, _ in tree_flatten(model.trainable_parameters())]
    assert trained and all(k.endswith(("lora_a", "lora_b")) for k in trained), trained
    arrays = trainer.gradient_free_inputs(trainer.to_device(trainer.pair_batches(trainer.train_examples, 0, False,
                                                                                 4)[0]))
    base, _ = mlxrl.load(folder)
    want = trainer.sequence_logps(base, arrays)
    np.testing.assert_allclose(np.array(arrays["ref_chosen"]), np.array(want[:4]), rtol=1e-5, atol=1e-4)
    assert float(mx.abs(trainer.sequence_logps(model, arrays) - want).max()) > 1e-3


def test_precomputed_reference_equals_on_the_fly(tiny_checkpoint, tmp_path):
    folder = tiny_checkpoint("qwen3")
    model, processor = mlxrl.load(folder)
    pre = DPOTrainer(model, processor, config(tmp_path, precompute_ref_log_probs=True,
                                              precompute_ref_batch_size=3), train_dataset=TEXT_ROWS)
    assert pre.ref_model is None  # full fine-tuning with precomputed log-probs keeps no reference
    model2, _ = mlxrl.load(folder)
    live = DPOTrainer(model2, processor, config(tmp_path), train_dataset=TEXT_ROWS)
    assert live.ref_model is not None  # full fine-tuning: a frozen copy, as TRL
    b_pre = pre.pair_batches(pre.train_examples, 0, False, 4)[0]
    b_live = live.gradient_free_inputs(live.to_device(live.pair_batches(live.train_examples, 0, False, 4)[0]))
    np.testing.assert_allclose(b_pre["ref_chosen"], np.array(b_live["ref_chosen"]), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(b_pre["ref_rejected"], np.array(b_live["ref_rejected"]), rtol=1e-5, atol=1e-4)


@pytest.mark.usefixtures("kernel_path")
@pytest.mark.parametrize("data", ["text", "vision"])
def test_padding_free_equals_padded(data, tiny_checkpoint, tmp_path):
    arch, rows = ("qwen3", TEXT_ROWS) if data == "text" else ("qwen2_vl", vision_rows())
    model, processor = mlxrl.load(tiny_checkpoint(arch))
    a = DPOTrainer(model, processor, config(tmp_path, use_peft=True, lora_r=4), train_dataset=rows)
    model, processor = mlxrl.load(tiny_checkpoint(arch))  # the same seed gives the same LoRA init
    b = DPOTrainer(model, processor, config(tmp_path, use_peft=True, lora_r=4, padding_free=True),
                   train_dataset=rows)
    results = []
    for t in (a, b):
        batch = t.pair_batches(t.train_examples, 0, False, len(rows))[0]
        arrays = t.gradient_free_inputs(t.to_device(batch))
        n = mx.array(len(rows), dtype=mx.float32)
        (loss, metrics), grads = nn.value_and_grad(t.model, t.loss)(t.model, arrays, n)
        results.append((batch["input_ids"].shape, loss.item(), metrics["logps/rejected"].item(),
                        dict(tree_flatten(grads))))
    (shape_a, loss_a, lr_a, g_a), (shape_b, loss_b, lr_b, g_b) = results
    assert shape_b[0] == 1 and shape_a[0] == 2 * len(rows)
    assert abs(loss_a - loss_b) <= 1e-5 and abs(lr_a - lr_b) <= 1e-4 * abs(lr_a)
    for k in g_a:
        scale = max(float(mx.abs(g_a[k]).max()), 1e-6)
        assert float(mx.abs(g_a[k] - g_b[k]).max()) / scale <= 1e-4, k


# ------------------------------------------------------------------------------------- training

def test_trained_parameters_change_and_reference_stays(tiny_checkpoint, tmp_path):
    model, processor = mlxrl.load(tiny_checkpoint("qwen3"))
    before = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
    trainer = DPOTrainer(model, processor, config(tmp_path, max_steps=2, learning_rate=1e-3), train_dataset=TEXT_ROWS)
    trainer.train()
    history = trainer.log_history
    after = dict(tree_flatten(model.parameters()))
    unchanged = [k for k, v in before.items() if np.array_equal(v, np.array(after[k]))]
    assert unchanged == [], unchanged
    for k, v in tree_flatten(trainer.ref_model.parameters()):
        assert np.array_equal(before[k], np.array(v)), k
    logged = [e for e in history if "rewards/margins" in e]
    assert len(logged) == 2 and logged[1]["rewards/margins"] > 0  # the same 4 pairs, scored after one update
    assert (tmp_path / "run" / "config.json").exists()  # the full model, in output_dir as TRL saves it


def test_demo_dpo_raises_held_out_exact_match_and_preference_accuracy(tmp_path):
    """The demo's promise in a shorter run (its brief SFT, fewer DPO steps and held-out rows): DPO raises
    held-out exact match and preference accuracy well clear of the noise, and rewards/accuracies rise."""
    args = DPOConfig(output_dir=str(tmp_path / "demo"))  # output_dir: tmp_path, not ./out
    out = run_demo(args, {"output_dir"}, n_test=48, overrides={"max_steps": 8, "logging_steps": 4})
    before, after = out["before"], out["after"]
    assert after["exact_match"] >= before["exact_match"] + 0.2, out
    assert after["preference"] >= before["preference"] + 0.05, out
    accs = [e["rewards/accuracies"] for e in out["history"]]
    assert max(accs[-2:]) > 0.5 and out["history"][-1]["rewards/margins"] > 0, out["history"]


def test_demo_rewards_accuracy_rises_with_the_users_loss_type(tmp_path):
    # a loss_type the user set keeps its own weights: here DPO's sigmoid term alone, on the demo's pairs
    args = DPOConfig(output_dir=str(tmp_path / "demo"), loss_type=["sigmoid"])
    out = run_demo(args, {"output_dir", "loss_type"}, sft_steps=0, n_test=8, n_pairs=8,
                   overrides={"max_steps": 6, "per_device_train_batch_size": 4, "logging_steps": 2,
                              "learning_rate": 1e-2})
    assert args.loss_type == ["sigmoid"] and args.loss_weights is None
    accs = [e["rewards/accuracies"] for e in out["history"]]
    assert max(accs[-2:]) > 0.5, out["history"]


def test_cli_errors_are_one_line(tmp_path, capsys):
    for argv, needle in [(["--dataset", str(tmp_path / "d.jsonl")], "--model is required"),
                         (["--sync_ref_model"], "sync_ref_model=True is not supported"),
                         (["--use_weighting", "true"], "use_weighting=True is not supported"),
                         (["--loss_type", "nope"], "unknown loss_type"),
                         (["--loss_type", "sigmoid", "ipo", "--loss_weights", "1"], "loss_weights has 1")]:
        code = dpo_main(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and needle in err[0], (argv, err)
