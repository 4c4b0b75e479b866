"""ORPO and CPO (SimPO, AlphaPO) against trl.experimental's own trainers (TRL 1.16): the same tiny checkpoint, rows and
hyper-parameters, each side trained from the same weights; per-step loss, grad_norm, learning rate and every
metric both log (logits/* aside: TRL's is a mean over its padded logits tensor, padding included), and the final
weights tensor by tensor against the size of the update (||W_ours - W_trl|| / ||W_trl - W_0|| <= 2e-3). The
tokenisation of trl.experimental (an EOS after the chat template's closing newline) is checked id for id, and the
trainers run on both paths, LoRA and bf16 on the graph path.

    python -m pytest -q tests/test_reference_free_trainers.py
"""

from __future__ import annotations

import types
import warnings

import numpy as np
import pytest
from safetensors.numpy import load_file
from test_trl_runs import assert_as_close_to_float64  # the weight comparison against float64

import mlxrl
from mlxrl import CPOConfig, CPOTrainer, ORPOConfig, ORPOTrainer

trl = pytest.importorskip("trl")
warnings.filterwarnings("ignore", message=".*trl.experimental.*")

ROWS = [
    {"prompt": [{"role": "user", "content": "What colour is the sky?"}],
     "chosen": [{"role": "assistant", "content": "Blue."}],
     "rejected": [{"role": "assistant", "content": "Green, of course."}]},
    {"chosen": [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hello there!"}],
     "rejected": [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "No."}]},
    {"prompt": [{"role": "user", "content": "Two plus two?"}],
     "chosen": [{"role": "assistant", "content": "Four."}],
     "rejected": [{"role": "assistant", "content": "Five, I think."}]},
    {"prompt": [{"role": "user", "content": "Name a fruit"}],
     "chosen": [{"role": "assistant", "content": "An apple."}],
     "rejected": [{"role": "assistant", "content": "A chair."}]},
]
TEXT_ROWS = [{"prompt": "Two plus two is", "chosen": " four.", "rejected": " five, I think."},
             {"prompt": "The sky is", "chosen": " blue.", "rejected": " made of cheese."},
             {"prompt": "Cats say", "chosen": " meow.", "rejected": " woof."},
             {"prompt": "A fruit:", "chosen": " apple", "rejected": " chair"}]
HYPER = dict(learning_rate=2e-3, max_steps=3, per_device_train_batch_size=len(ROWS), max_length=128,
             max_grad_norm=1.0, lr_scheduler_type="linear", weight_decay=0.0, seed=0)
SHARED = ("loss", "grad_norm", "learning_rate", "rewards/chosen", "rewards/rejected", "rewards/accuracies",
          "rewards/margins", "logps/chosen", "logps/rejected", "nll_loss")
ORPO_ONLY = ("log_odds_ratio", "log_odds_chosen")


def trl_classes(kind):
    if kind == "orpo":
        from trl.experimental.orpo import ORPOConfig as C
        from trl.experimental.orpo import ORPOTrainer as T
    else:
        from trl.experimental.cpo import CPOConfig as C
        from trl.experimental.cpo import CPOTrainer as T
    return C, T


def trl_run(kind, folder, tmp_path, rows, extra, dtype=None):
    import torch
    import transformers
    from datasets import Dataset

    C, T = trl_classes(kind)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype or torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    args = C(output_dir=str(tmp_path / "trl"), bf16=False, use_cpu=True, report_to=[], save_strategy="no",
             logging_steps=1, dataloader_num_workers=0, gradient_checkpointing=False, **HYPER, **extra)
    trainer = T(model=hf, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok)
    trainer.train()
    weights = {k: v.detach().numpy().copy() for k, v in hf.state_dict().items()}
    return weights, [e for e in trainer.state.log_history if "loss" in e]


def ours_run(kind, folder, tmp_path, rows, extra):
    model, processor = mlxrl.load(folder)
    C, T = (ORPOConfig, ORPOTrainer) if kind == "orpo" else (CPOConfig, CPOTrainer)
    args = C(output_dir=str(tmp_path / "ours"), compile=False, disable_tqdm=True, save_steps=0,
             gradient_checkpointing=False, logging_steps=1, **HYPER, **extra)
    trainer = T(model, processor, args, train_dataset=rows)
    trainer.train()
    return load_file(str(tmp_path / "ours" / "model.safetensors")), [e for e in trainer.log_history if "loss" in e]


@pytest.mark.parametrize("kind, extra", [
    ("orpo", {"beta": 0.2}),
    ("orpo", {"beta": 0.5, "rows": "text"}),
    ("cpo", {"loss_type": "sigmoid", "beta": 0.2, "label_smoothing": 0.1}),
    ("cpo", {"loss_type": "simpo", "beta": 2.0, "simpo_gamma": 0.4, "cpo_alpha": 0.5}),
    ("cpo", {"loss_type": "ipo", "beta": 0.5}),
    ("cpo", {"loss_type": "hinge", "beta": 0.3}),
    ("cpo", {"loss_type": "alphapo", "beta": 2.5, "alpha": 0.25}),
])
def test_a_whole_run_ends_at_trls_weights(tiny_checkpoint, tmp_path, kind, extra):
    folder = tiny_checkpoint("qwen3")
    rows = TEXT_ROWS if extra.pop("rows", None) == "text" else ROWS
    start = load_file(str(folder / "model.safetensors"))
    ours, ours_log = ours_run(kind, folder, tmp_path, rows, extra)
    theirs, trl_log = trl_run(kind, folder, tmp_path, rows, extra)
    assert len(ours_log) == len(trl_log) == HYPER["max_steps"]
    for mine, want in zip(ours_log, trl_log, strict=True):
        for key in SHARED + (ORPO_ONLY if kind == "orpo" else ()):
            assert mine[key] == pytest.approx(want[key], rel=2e-4, abs=2e-5), (key, mine[key], want[key])
    import torch

    theirs64, _ = trl_run(kind, folder, tmp_path / "f64", rows, extra, dtype=torch.float64)
    assert_as_close_to_float64(start, ours, theirs, theirs64)


def test_rows_are_tokenised_as_trl_experimental_tokenises_them(tiny_checkpoint):
    """Every pair's ids and completion masks equal trl.experimental's tokenize_row (after its prompt extraction and
    chat template), the EOS it appends after the template's closing newline included."""
    import transformers
    from trl.data_utils import maybe_apply_chat_template, maybe_extract_prompt
    from trl.experimental.orpo.orpo_trainer import ORPOTrainer as TRLTrainer

    from mlxrl.data.preference import tokenize_preference

    folder = tiny_checkpoint("qwen3")
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    _, processor = mlxrl.load(folder)
    fake = types.SimpleNamespace(processing_class=tok, is_encoder_decoder=False, max_length=1024)
    fake.build_tokenized_answer = types.MethodType(TRLTrainer.build_tokenized_answer, fake)
    for i, row in enumerate(ROWS + TEXT_ROWS):
        want = TRLTrainer.tokenize_row(fake, maybe_apply_chat_template(maybe_extract_prompt(dict(row)), tok))
        have = tokenize_preference(dict(row), processor, index=i, append_eos=True)
        for side in ("chosen", "rejected"):
            ids, mask = getattr(have, f"{side}_ids"), getattr(have, f"{side}_mask")
            assert list(ids) == want[f"{side}_input_ids"]
            assert [int(t) if m else -100 for t, m in zip(ids, mask, strict=True)] == want[f"{side}_labels"]
        assert have.chosen_ids[-1] == tok.eos_token_id


@pytest.mark.usefixtures("kernel_path")
@pytest.mark.parametrize("kind", ["orpo", "cpo"])
def test_lora_training_lowers_the_loss_and_moves_only_adapters(tiny_checkpoint, tmp_path, kind):
    """Both paths: LoRA, compiled, padding-free; the loss falls on its rows and the base stays."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    model, processor = mlxrl.load(tiny_checkpoint("qwen3"))
    base = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
    C, T = (ORPOConfig, ORPOTrainer) if kind == "orpo" else (CPOConfig, CPOTrainer)
    args = C(output_dir=str(tmp_path / kind), use_peft=True, lora_r=8, lora_alpha=16, learning_rate=2e-2,
             max_steps=8, per_device_train_batch_size=4, logging_steps=1, save_steps=0, disable_tqdm=True,
             padding_free=True, max_length=128, lr_scheduler_type="constant", warmup_steps=0)
    trainer = T(model, processor, args, train_dataset=ROWS)
    trainer.train()
    losses = [e["loss"] for e in trainer.log_history if "loss" in e]
    assert losses[-1] < losses[0]
    assert trainer.log_history[-2]["rewards/accuracies"] >= 0.75
    now = dict(tree_flatten(trainer.model.parameters()))
    for k, v in base.items():
        key = k if k in now else k.replace(".weight", ".linear.weight")
        assert np.array_equal(np.array(now[key]), v), k
    assert mx.any(mx.array([("lora_b" in k) and bool(mx.any(v != 0)) for k, v in now.items()])).item()


def test_bf16_on_the_graph_path_matches_float32(tiny_checkpoint, tmp_path, monkeypatch):
    """bf16 compute keeps the loss within bf16's rounding of the float32 loss (step 0, the same rows)."""
    import mlx.core as mx

    monkeypatch.setenv("MLXRL_NATIVE", "0")
    values = {}
    for dtype in ("float32", "bfloat16"):
        model, processor = mlxrl.load(tiny_checkpoint("qwen3"), dtype=getattr(mx, dtype))
        args = ORPOConfig(output_dir=str(tmp_path / dtype), max_length=128, compile=False, dtype=dtype,
                          gradient_checkpointing=False, disable_tqdm=True, save_steps=0)
        t = ORPOTrainer(model, processor, args, train_dataset=ROWS)
        batch = t.to_device(t.pair_batches(t.train_examples, 0, False, 4)[0])
        loss, metrics = t.loss(t.model, batch, mx.array(4.0))
        values[dtype] = (loss.item(), metrics["nll_loss"].item())
    (l32, n32), (l16, n16) = values["float32"], values["bfloat16"]
    # a bf16 forward rounds each activation to 8 bits of mantissa: a few parts in a thousand of the loss
    assert l16 == pytest.approx(l32, rel=3e-2) and n16 == pytest.approx(n32, rel=3e-2)


def test_bad_settings_are_one_line_errors(tiny_checkpoint, tmp_path):
    folder = tiny_checkpoint("qwen3")
    with pytest.raises(ValueError, match="label_smoothing=0.1 with loss_type='hinge'"):
        CPOTrainer(model=str(folder), args=CPOConfig(output_dir=str(tmp_path), loss_type="hinge",
                                                     label_smoothing=0.1), train_dataset=ROWS)
    with pytest.raises(ValueError, match="decoder-only"):
        ORPOTrainer(model=str(folder), args=ORPOConfig(output_dir=str(tmp_path), is_encoder_decoder=True),
                    train_dataset=ROWS)
    with pytest.raises(ValueError, match="generate_during_eval"):
        ORPOTrainer(model=str(folder), args=ORPOConfig(output_dir=str(tmp_path), generate_during_eval=True),
                    train_dataset=ROWS)
    with pytest.raises(ValueError, match="beta"):
        CPOTrainer(model=str(folder), args=CPOConfig(output_dir=str(tmp_path), beta=0.0), train_dataset=ROWS)


@pytest.mark.parametrize("kind", ["orpo", "cpo"])
def test_the_configs_own_fields_have_trls_defaults(kind):
    import dataclasses

    theirs, _ = trl_classes(kind)
    ours = ORPOConfig if kind == "orpo" else CPOConfig
    own = {f.name: f for f in dataclasses.fields(theirs) if f.name in vars(theirs).get("__annotations__", {})}
    mine = {f.name: f for f in dataclasses.fields(ours)}
    assert {"beta", "max_length", "disable_dropout"} <= set(own)
    for name, f in own.items():
        assert mine[name].default == f.default, name


@pytest.mark.parametrize("kind", ["orpo", "cpo"])
def test_the_demo_raises_held_out_preference_accuracy(tmp_path, kind):
    """The demo's promise in a shorter run (its brief SFT, fewer steps and held-out rows)."""
    from mlxrl.cli import cpo, orpo

    module, cls = (orpo, ORPOConfig) if kind == "orpo" else (cpo, CPOConfig)
    out = module.run_demo(cls(output_dir=str(tmp_path / "demo")), {"output_dir"}, n_test=48,
                          overrides={"max_steps": 8, "logging_steps": 4})
    before, after = out["before"], out["after"]
    assert after["preference"] >= before["preference"] + 0.05, out
    assert after["exact_match"] >= before["exact_match"], out
    assert out["history"][-1]["rewards/margins"] > 0, out["history"]
