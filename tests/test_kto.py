"""KTO against TRL 1.16's own KTOTrainer: whole runs on the same tiny checkpoint, rows and hyper-parameters (float32,
each side from the same weights): per-step loss, grad_norm, learning rate and every metric TRL logs (kl, rewards/*,
logps/*, logits/*, entropy, num_tokens), and the final weights tensor by tensor against the size of the update; both
loss types, unpaired rows and preference rows (unpaired as TRL unpairs them), strings and conversations, a micro-batch
holding one label (its other label's metrics absent, as TRL logs them). Then LoRA on both paths, precomputed
reference log-probs, and the refusals.

    python -m pytest -q tests/test_kto.py
"""

from __future__ import annotations

import warnings

import mlx.core as mx
import numpy as np
import pytest
from conftest import tiny_checkpoints_module
from safetensors.numpy import load_file
from test_trl_runs import assert_same_logs, assert_same_weights  # the SFT runs' comparisons

import mlxrl
from mlxrl import KTOConfig, KTOTrainer

trl = pytest.importorskip("trl")
warnings.filterwarnings("ignore")
hf_processor = tiny_checkpoints_module().hf_processor


def _conv(prompt, completion, label):
    return {"prompt": [{"role": "user", "content": prompt}],
            "completion": [{"role": "assistant", "content": completion}], "label": label}


UNPAIRED = [_conv("What colour is the sky?", "Blue.", True), _conv("Say hi", "Go away.", False),
            _conv("Two plus two?", "Four.", True), _conv("Name a fruit", "A chair.", False),
            _conv("Capital of France?", "Paris.", True), _conv("Opposite of hot?", "Purple, obviously.", False)]
PAIRS = [{"prompt": "Two plus two is", "chosen": " four.", "rejected": " five, I think."},
         {"prompt": "The sky is", "chosen": " blue.", "rejected": " made of cheese."},
         {"prompt": "Cats say", "chosen": " meow.", "rejected": " woof."},
         {"prompt": "A fruit:", "chosen": " apple", "rejected": " chair"}]
HYPER = dict(learning_rate=2e-3, max_steps=3, max_length=128, max_grad_norm=1.0, lr_scheduler_type="linear",
             weight_decay=0.0, seed=0)
KEYS = ("loss", "grad_norm", "learning_rate", "kl", "rewards/chosen", "rewards/rejected", "rewards/margins",
        "logps/chosen", "logps/rejected", "logits/chosen", "logits/rejected", "entropy", "num_tokens")


def trl_run(folder, tmp_path, rows, hyper, vision=False):
    import torch
    import transformers
    from datasets import Dataset

    cls = transformers.Qwen2VLForConditionalGeneration if vision else transformers.AutoModelForCausalLM
    hf = cls.from_pretrained(str(folder), dtype=torch.float32)
    ref = cls.from_pretrained(str(folder), dtype=torch.float32)
    processing = hf_processor(folder) if vision else transformers.AutoTokenizer.from_pretrained(str(folder))
    args = trl.KTOConfig(output_dir=str(tmp_path / "trl"), bf16=False, use_cpu=True, report_to=[], save_strategy="no",
                         logging_steps=1, dataloader_num_workers=0, gradient_checkpointing=False, **hyper)
    trainer = trl.KTOTrainer(model=hf, ref_model=ref, args=args, train_dataset=Dataset.from_list(rows),
                             processing_class=processing)
    trainer.train()
    hf.save_pretrained(str(tmp_path / "trl-model"))  # the checkpoint's own tensor names
    return load_file(str(tmp_path / "trl-model" / "model.safetensors")), [e for e in trainer.state.log_history
                                                                         if "loss" in e]


def ours_run(folder, tmp_path, rows, hyper, **kw):
    model, processor = mlxrl.load(folder)
    args = KTOConfig(output_dir=str(tmp_path / "ours"), compile=False, disable_tqdm=True, save_steps=0,
                     gradient_checkpointing=False, logging_steps=1, **hyper, **kw)
    trainer = KTOTrainer(model, processor, args, train_dataset=rows)
    trainer.train()
    return load_file(str(tmp_path / "ours" / "model.safetensors")), [e for e in trainer.log_history if "loss" in e]


@pytest.mark.parametrize("rows, extra", [
    ("unpaired", dict(per_device_train_batch_size=3, beta=0.2, desirable_weight=1.3)),
    ("unpaired", dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, beta=0.5,
                      undesirable_weight=0.7)),
    ("pairs", dict(per_device_train_batch_size=4, beta=0.3)),  # unpaired: every chosen, then every rejected
    ("unpaired", dict(per_device_train_batch_size=3, loss_type="apo_zero_unpaired", beta=0.2)),
])
def test_a_whole_run_ends_at_trls_weights(tiny_checkpoint, tmp_path, rows, extra):
    folder = tiny_checkpoint("qwen3")
    data = UNPAIRED if rows == "unpaired" else PAIRS
    hyper = {**HYPER, **extra}
    start = load_file(str(folder / "model.safetensors"))
    ours, ours_log = ours_run(folder, tmp_path, data, hyper)
    theirs, trl_log = trl_run(folder, tmp_path, data, hyper)
    assert_same_logs(ours_log, trl_log, HYPER["max_steps"], KEYS)
    assert_same_weights(start, ours, theirs)


def vision_rows(n=3):
    """Synthetic VQA rows as KTO rows: each image's right answer (desirable) and another (undesirable), alternating,
    and one text-only row (no image) among them."""
    from mlxrl.cli.paired import preference_pairs
    from mlxrl.data.synthetic import make_vqa

    rows = [{"prompt": p["prompt"], "completion": p[side], "label": side == "chosen", "images": p["images"]}
            for p in preference_pairs(make_vqa(n, seed=4), seed=1) for side in ("chosen", "rejected")]
    text = {**rows[0], "prompt": [{"role": "user", "content": [{"type": "text", "text": "Name a colour."}]}],
            "images": []}
    return rows[:3] + [text] + rows[3:]


@pytest.mark.parametrize("extra", [dict(per_device_train_batch_size=3, beta=0.3),
                                   dict(per_device_train_batch_size=2, loss_type="apo_zero_unpaired", beta=0.2)])
def test_a_vision_run_ends_at_trls_weights(tiny_checkpoint, tmp_path, extra):
    """Qwen2-VL on image rows (and one text row): TRL's vision collator, whose KL sequences keep their own prompt's
    images."""
    folder = tiny_checkpoint("qwen2_vl")
    hyper = {**HYPER, "max_steps": 2, "max_length": 512, **extra}
    rows = vision_rows()
    start = load_file(str(folder / "model.safetensors"))
    ours, ours_log = ours_run(folder, tmp_path, rows, hyper)
    theirs, trl_log = trl_run(folder, tmp_path, rows, hyper, vision=True)
    assert_same_logs(ours_log, trl_log, hyper["max_steps"], KEYS)
    assert_same_weights(start, ours, theirs)


def test_precomputed_reference_equals_on_the_fly(tiny_checkpoint, tmp_path):
    folder = tiny_checkpoint("qwen3")
    hyper = {**HYPER, "per_device_train_batch_size": 3}
    _, live = ours_run(folder, tmp_path / "a", UNPAIRED, hyper)
    _, pre = ours_run(folder, tmp_path / "b", UNPAIRED, hyper, precompute_ref_log_probs=True)
    for a, b in zip(live, pre, strict=True):
        for k in ("loss", "kl", "rewards/chosen", "rewards/rejected"):
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6), k


@pytest.mark.usefixtures("kernel_path")
def test_lora_training_raises_the_margin_and_moves_only_adapters(tiny_checkpoint, tmp_path):
    """Both paths: LoRA (the reference is the adapters switched off), compiled, padding-free."""
    from mlx.utils import tree_flatten

    model, processor = mlxrl.load(tiny_checkpoint("qwen3"))
    base = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
    args = KTOConfig(output_dir=str(tmp_path / "kto"), use_peft=True, lora_r=8, lora_alpha=16, learning_rate=2e-2,
                     max_steps=8, per_device_train_batch_size=6, logging_steps=1, save_steps=0, disable_tqdm=True,
                     padding_free=True, max_length=128, lr_scheduler_type="constant", warmup_steps=0, beta=0.5)
    trainer = KTOTrainer(model, processor, args, train_dataset=UNPAIRED)
    trainer.train()
    logged = [e for e in trainer.log_history if "loss" in e]
    assert logged[-1]["loss"] < logged[0]["loss"] and logged[-1]["rewards/margins"] > 0
    now = dict(tree_flatten(trainer.model.parameters()))
    for k, v in base.items():
        key = k if k in now else k.replace(".weight", ".linear.weight")
        assert np.array_equal(np.array(now[key]), v), k


def test_a_micro_batch_of_one_label_logs_what_trl_logs(tiny_checkpoint, tmp_path):
    """Batches of only desirable rows: rewards/rejected (and margins) are absent from their entries, not 0."""
    rows = [r for r in UNPAIRED if r["label"]] + [r for r in UNPAIRED if not r["label"]]
    _, log = ours_run(tiny_checkpoint("qwen3"), tmp_path, rows, {**HYPER, "per_device_train_batch_size": 3,
                                                                  "max_steps": 2})
    assert "rewards/chosen" in log[0] and "rewards/rejected" not in log[0] and "rewards/margins" not in log[0]
    assert "rewards/rejected" in log[1] and "rewards/chosen" not in log[1]


def test_the_configs_own_fields_have_trls_defaults():
    import dataclasses

    mine = {f.name: f for f in dataclasses.fields(KTOConfig)}
    for f in dataclasses.fields(trl.KTOConfig):
        if f.name in vars(trl.KTOConfig).get("__annotations__", {}):
            assert mine[f.name].default == f.default, f.name
    assert mine["train_sampling_strategy"].default == "sequential"


def test_bad_settings_and_rows_are_one_line_errors(tiny_checkpoint, tmp_path):
    folder = str(tiny_checkpoint("qwen3"))
    for kw, needle in [({"train_sampling_strategy": "random"}, "train_sampling_strategy='sequential'"),
                       ({"per_device_train_batch_size": 1}, "per_device_train_batch_size > 1"),
                       ({"sync_ref_model": True}, "sync_ref_model"), ({"loss_type": "sigmoid"}, "loss_type")]:
        with pytest.raises(ValueError, match=needle):
            KTOTrainer(model=folder, args=KTOConfig(output_dir=str(tmp_path), **kw), train_dataset=UNPAIRED)
    with pytest.raises(mlxrl.MlxrlError, match="row 1: 'label' must be true or false"):
        KTOTrainer(model=folder, args=KTOConfig(output_dir=str(tmp_path)),
                   train_dataset=[UNPAIRED[0], {**UNPAIRED[1], "label": "maybe"}])
    with pytest.raises(mlxrl.MlxrlError, match="needs 'prompt', 'completion' and 'label'"):
        KTOTrainer(model=folder, args=KTOConfig(output_dir=str(tmp_path)), train_dataset=[{"text": "hi"}])


def test_the_kl_term_carries_no_gradient():
    from mlxrl.losses.kto import kl_term, kto_loss

    def f(kl_logps):
        return kto_loss(mx.array([-3.0, -4.0]), mx.array([-3.5, -3.0]), mx.array([1.0, 0.0]),
                        kl_term(kl_logps, mx.array([-5.0, -5.0])))[0]

    assert float(mx.abs(mx.grad(f)(mx.array([-4.0, -4.5]))).sum()) == 0.0


@pytest.mark.parametrize("kind", ["kto", "orpo", "reward"])
def test_resume_reproduces_the_uninterrupted_run_and_another_trainer_is_refused(tiny_checkpoint, tmp_path, kind):
    from mlxrl import ORPOConfig, ORPOTrainer, RewardConfig, RewardTrainer

    folder = tiny_checkpoint("qwen3")
    pairs = [{"prompt": r["prompt"], "chosen": r["completion"], "rejected": [{"role": "assistant", "content": "No."}]}
             for r in UNPAIRED]  # KTO takes these too (unpaired)
    rows = UNPAIRED * 2 if kind == "kto" else pairs
    C, T = {"kto": (KTOConfig, KTOTrainer), "orpo": (ORPOConfig, ORPOTrainer),
            "reward": (RewardConfig, RewardTrainer)}[kind]

    def run(**kw):  # the reward model: LoRA with its fresh score head trained whole, both saved and restored
        model, processor = mlxrl.load(folder, **({"num_labels": 1} if kind == "reward" else {}))
        args = C(output_dir=str(tmp_path / "a"), per_device_train_batch_size=3, max_steps=4, use_peft=True,
                 learning_rate=1e-3, compile=False, disable_tqdm=True, logging_steps=1, max_length=128, **kw)
        trainer = T(model, processor, args, train_dataset=rows)
        trainer.train()
        return [e["loss"] for e in trainer.log_history if "loss" in e]

    full = run(save_steps=2)
    resumed = run(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-2"))
    assert resumed == full
    other = (ORPOConfig, ORPOTrainer) if kind == "kto" else (KTOConfig, KTOTrainer)
    model, processor = mlxrl.load(folder)
    with pytest.raises(mlxrl.MlxrlError, match="checkpoint and this is a"):
        other[1](model, processor, other[0](output_dir=str(tmp_path / "a"), per_device_train_batch_size=3,
                                            max_steps=4, use_peft=True, disable_tqdm=True,
                                            resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-2")),
                 train_dataset=pairs).train()

