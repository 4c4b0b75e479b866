"""Every field of TRL 1.16's SFTConfig, DPOConfig and GRPOConfig (TrainingArguments' included) is a field of
ours: working, or refused in one line with why. The TrainingArguments and SFT fields mlxrl implements are
checked against what they must do: bf16 / activation_checkpointing resolved, eos_token and chat_template_path
in the tokenised rows, shuffle_dataset, eval_packing, pad_to_multiple_of (the same loss), dataloader_drop_last,
data_seed, logging_first_step, eval_on_start, use_cpu."""

import dataclasses
import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
import trl
from mlx.utils import tree_flatten

import mlxrl
from mlxrl import DPOConfig, GRPOConfig, SFTConfig
from mlxrl.cli.sft import main as sft_main
from mlxrl.data.preference import make_preference_batches
from mlxrl.trainers import flags
from mlxrl.trainers.config import ConfigError, check_config
from mlxrl.trainers.sft.trainer import SFTTrainer
from mlxrl.trainers.trl_fields import ELSEWHERE

TEXT_ROWS = [{"text": f"Document number {i} about training loops on one machine."} for i in range(7)]


def _default(f):
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else dataclasses.MISSING


def _experimental(name):
    import importlib
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return getattr(importlib.import_module(f"trl.experimental.{name.lower()}"), f"{name}Config")


@pytest.mark.parametrize("ours, theirs", [(SFTConfig, trl.SFTConfig), (DPOConfig, trl.DPOConfig),
                                          (GRPOConfig, trl.GRPOConfig), (mlxrl.KTOConfig, trl.KTOConfig),
                                          (mlxrl.ORPOConfig, _experimental("ORPO")),
                                          (mlxrl.CPOConfig, _experimental("CPO")),
                                          (mlxrl.RewardConfig, trl.RewardConfig),
                                          (mlxrl.RLOOConfig, trl.RLOOConfig)])
def test_every_trl_field_is_ours(ours, theirs):
    mine = {f.name: f for f in dataclasses.fields(ours)}
    missing = [f.name for f in dataclasses.fields(theirs) if f.name not in mine]
    assert not missing, f"TRL fields without a field here (implement, or refuse in trl_fields / the config): {missing}"
    for f in dataclasses.fields(theirs):
        if f.name in ELSEWHERE:  # refused unless TRL's default: the defaults must agree
            want, have = _default(f), _default(mine[f.name])
            want = getattr(want, "value", want)  # transformers' enums
            assert have == want or (want in ([], ()) and have is None), (f.name, have, want)


@pytest.mark.parametrize("name, value", [("deepspeed", "ds.json"), ("push_to_hub", True), ("ddp_timeout", 60),
                                         ("label_smoothing_factor", 0.1), ("fsdp_config", {"min_num_params": 1}),
                                         ("include_for_metrics", ["inputs"]), ("fp16", True)])
def test_a_field_of_no_use_here_is_refused_with_why(name, value):
    cfg = SFTConfig(**{name: value})
    with pytest.raises(ConfigError, match=rf"^{name}=.* is not supported by mlxrl's SFTTrainer: \w"):
        check_config(cfg)
    check_config(SFTConfig(**{name: _default(next(f for f in dataclasses.fields(SFTConfig) if f.name == name))}))


def test_cli_and_yaml_read_trl_fields(tmp_path, capsys):
    code = sft_main(["--output_dir", str(tmp_path / "o"), "--deepspeed", "ds.json"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--deepspeed='ds.json' is not supported" in err[0]
    (tmp_path / "c.yaml").write_text("fsdp_config:\n  min_num_params: 1\n")
    code = sft_main(["--output_dir", str(tmp_path / "o"), "--config", str(tmp_path / "c.yaml")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "fsdp_config" in err[0] and "mx.distributed" in err[0]
    (tmp_path / "ok.yaml").write_text("gradient_checkpointing_kwargs:\n  use_reentrant: false\ndeepspeed: null\n"
                                      "bf16: false\nactivation_checkpointing: false\n")
    ns = flags.build_parser(SFTConfig, "sft", "").parse_args(["--config", str(tmp_path / "ok.yaml")])
    cfg = flags.config_from_args(SFTConfig, ns)
    assert cfg.gradient_checkpointing_kwargs == {"use_reentrant": False} and cfg.dtype == "float32"
    assert cfg.gradient_checkpointing is False
    help_text = flags.build_parser(SFTConfig, "sft", "").format_help()
    assert "--bf16" in help_text and "--eos_token" in help_text and "--deepspeed" not in help_text


def test_bf16_and_activation_checkpointing_resolve():
    assert SFTConfig(bf16=True).dtype == "bfloat16" and SFTConfig(bf16=False).dtype == "float32"
    assert SFTConfig().dtype is None and SFTConfig(bf16=True, dtype="bf16").dtype == "bfloat16"
    with pytest.raises(ConfigError, match="bf16=True contradicts dtype='float32'"):
        SFTConfig(bf16=True, dtype="float32")
    assert SFTConfig(activation_checkpointing=False).gradient_checkpointing is False
    assert DPOConfig(activation_checkpointing=True, gradient_checkpointing=False).gradient_checkpointing is True
    assert GRPOConfig(bf16=True).dtype == "bfloat16"
    with pytest.raises(ConfigError, match="use_reentrant"):
        check_config(SFTConfig(activation_checkpointing_kwargs='{"preserve_rng_state": true}'))
    with pytest.raises(ConfigError, match="JSON object"):
        check_config(SFTConfig(gradient_checkpointing_kwargs="use_reentrant=False"))


def test_bf16_must_match_the_model_given(tiny_checkpoint, tmp_path):
    model, processor = mlxrl.load(tiny_checkpoint("qwen3"), dtype="float32")
    with pytest.raises(ConfigError, match="bf16=True, but the model computes in float32"):
        SFTTrainer(model, processor, SFTConfig(output_dir=str(tmp_path / "o"), bf16=True), train_dataset=TEXT_ROWS)
    SFTTrainer(model, processor, SFTConfig(output_dir=str(tmp_path / "o"), bf16=False), train_dataset=TEXT_ROWS)


def _trainer(tiny_checkpoint, tmp_path, rows=TEXT_ROWS, arch="qwen3", **kw):
    model, processor = mlxrl.load(tiny_checkpoint(arch))  # a fresh processor: eos / template change it
    base = dict(output_dir=str(tmp_path / "run"), max_length=64, gradient_checkpointing=False, compile=False,
                disable_tqdm=True, save_steps=0, logging_steps=10, per_device_train_batch_size=2, seed=0)
    return SFTTrainer(model, processor, SFTConfig(**{**base, **kw}), train_dataset=rows)


def test_eos_token_ends_texts_and_is_saved(tiny_checkpoint, tmp_path):
    plain = _trainer(tiny_checkpoint, tmp_path)
    tok = plain.processor.tokenizer
    t = _trainer(tiny_checkpoint, tmp_path, eos_token="<|endoftext|>")
    for e_plain, e, row in zip(plain.train_examples, t.train_examples, TEXT_ROWS, strict=True):
        assert list(e.input_ids) == tok(row["text"] + "<|endoftext|>", add_special_tokens=False)["input_ids"]
        assert e_plain.input_ids[-1] == tok.convert_tokens_to_ids("<|im_end|>") != e.input_ids[-1]
    assert t.processor.eos_token_id == tok.convert_tokens_to_ids("<|endoftext|>")
    t.processor.save_pretrained(tmp_path / "saved")
    assert json.loads((tmp_path / "saved" / "tokenizer_config.json").read_text())["eos_token"] == "<|endoftext|>"
    with pytest.raises(ConfigError, match="not in the tokenizer's vocabulary"):
        _trainer(tiny_checkpoint, tmp_path, eos_token="<|nope|>")


def test_chat_template_path_file_and_folder(tiny_checkpoint, tmp_path):
    rows = [{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}]
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}<|endoftext|>{% endfor %}"
    (tmp_path / "t.jinja").write_text(template)
    t = _trainer(tiny_checkpoint, tmp_path, rows, chat_template_path=str(tmp_path / "t.jinja"))
    tok = t.processor.tokenizer
    want = tok("[user] Hi<|endoftext|>[assistant] Hello<|endoftext|>", add_special_tokens=False)["input_ids"]
    assert list(t.train_examples[0].input_ids) == want
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "eos_token": "<|endoftext|>"}))
    t = _trainer(tiny_checkpoint, tmp_path, rows, chat_template_path=str(folder))
    assert list(t.train_examples[0].input_ids) == want and t.processor.tokenizer.eos_token == "<|endoftext|>"
    t = _trainer(tiny_checkpoint, tmp_path, rows, chat_template_path=str(folder), eos_token="<|im_end|>")
    assert t.processor.tokenizer.eos_token == "<|im_end|>"  # eos_token wins over the folder's
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": template, "added_tokens_decoder": {"200000": {"content": "<|new_turn|>"}}}))
    with pytest.raises(ConfigError, match=r"lacks \(<\|new_turn\|>\).*does not resize"):
        _trainer(tiny_checkpoint, tmp_path, rows, chat_template_path=str(folder))
    with pytest.raises(ConfigError, match="not a .jinja"):
        _trainer(tiny_checkpoint, tmp_path, rows, chat_template_path=str(tmp_path / "none.txt"))


def test_shuffle_dataset_data_seed_and_drop_last(tiny_checkpoint, tmp_path):
    plain = _trainer(tiny_checkpoint, tmp_path)
    shuffled = _trainer(tiny_checkpoint, tmp_path, shuffle_dataset=True)
    order = np.random.default_rng(0).permutation(len(TEXT_ROWS))
    assert [list(e.input_ids) for e in shuffled.train_examples] == \
        [list(plain.train_examples[i].input_ids) for i in order]
    assert list(order) != list(range(len(TEXT_ROWS)))

    def first_ids(t):
        return [list(b()["example_ids"]) for b in t.make_batches(0)]

    same = _trainer(tiny_checkpoint, tmp_path, data_seed=0)
    other = _trainer(tiny_checkpoint, tmp_path, data_seed=1, seed=0)
    assert first_ids(same) == first_ids(plain) != first_ids(other)
    assert [len(b) for b in first_ids(plain)] == [2, 2, 2, 1]
    assert [len(b) for b in first_ids(_trainer(tiny_checkpoint, tmp_path, dataloader_drop_last=True))] == [2, 2, 2]


def test_dpo_drop_last(tiny_checkpoint):
    from mlxrl.data.preference import tokenize_preference

    _, processor = mlxrl.load(tiny_checkpoint("qwen3"))
    rows = [{"prompt": f"Q{i}?", "chosen": " yes", "rejected": " no"} for i in range(5)]
    examples = [tokenize_preference(r, processor, index=i, max_length=32) for i, r in enumerate(rows)]
    kw = dict(max_length=32, pad_token_id=processor.pad_token_id, shuffle=False)
    assert [int(b["num_pairs"]) for b in make_preference_batches(examples, 2, **kw)] == [2, 2, 1]
    assert [int(b["num_pairs"]) for b in make_preference_batches(examples, 2, drop_last=True, **kw)] == [2, 2]


def test_eval_packing_and_pad_to_multiple_of(tiny_checkpoint, tmp_path):
    t = _trainer(tiny_checkpoint, tmp_path, eval_packing=True, per_device_eval_batch_size=2)
    t.eval_examples = t.train_examples
    packed = [b() for b in t._batches_of(t.eval_examples, 0, False, 2, lazy=True, train=False)]
    unpacked = [b() for b in t._batches_of(t.eval_examples, 0, False, 2, lazy=True)]
    assert "segment_ids" in packed[0] and "segment_ids" not in unpacked[0] and len(packed) < len(unpacked)

    padded = _trainer(tiny_checkpoint, tmp_path, pad_to_multiple_of="48")
    a = t._batches_of(t.train_examples, 0, False, 2)
    b = padded._batches_of(padded.train_examples, 0, False, 2)
    for x, y in zip(a, b, strict=True):
        assert y["input_ids"].shape[1] % 48 == 0 and y["input_ids"].shape[1] > x["input_ids"].shape[1]
        assert x["num_tokens"] == y["num_tokens"]
        losses = []
        for batch in (x, y):
            (loss, _), _ = nn.value_and_grad(t.model, t.loss)(t.model, t.to_device(batch),
                                                               mx.array(batch["trained_tokens"], mx.float32))
            losses.append(loss.item())
        assert abs(losses[0] - losses[1]) <= 1e-5 * abs(losses[0])


def test_logging_first_step_and_eval_on_start(tiny_checkpoint, tmp_path):
    t = _trainer(tiny_checkpoint, tmp_path, max_steps=3, logging_steps=2, logging_first_step=True,
                 eval_on_start=True, learning_rate=1e-3)
    t.eval_examples = t.train_examples[:2]
    t.train()
    history = t.log_history
    assert [e["step"] for e in history if "loss" in e] == [1, 2, 3]
    assert "eval_loss" in history[0] and history[0]["step"] == 0
    t = _trainer(tiny_checkpoint, tmp_path / "b", max_steps=1, eval_on_start=True)
    with pytest.raises(ValueError, match="eval_on_start True needs evaluation data"):
        t.train()


def test_use_cpu_sets_the_default_device_before_the_model_loads(monkeypatch):
    calls = []
    monkeypatch.setattr(mx, "set_default_device", lambda d: calls.append(d))
    flags.config_from_args(SFTConfig, flags.build_parser(SFTConfig, "sft", "").parse_args(["--use_cpu"]))
    assert calls == [mx.cpu]
    flags.config_from_args(SFTConfig, flags.build_parser(SFTConfig, "sft", "").parse_args([]))
    assert calls == [mx.cpu]


def test_neftune_noise_matches_transformers_hook():
    """The noise's scale and law against transformers' own NEFTune hook on the same shape."""
    import torch
    from transformers.integrations.neftune import neftune_post_forward_hook

    from mlxrl.models.dropout import embedding_noise

    alpha, (B, L, D) = 5.0, (2, 96, 64)
    emb = torch.nn.Embedding(10, D)
    emb.neftune_noise_alpha = alpha
    x = torch.zeros(B, L, D)
    theirs = neftune_post_forward_hook(emb.train(), None, x).numpy()
    scale = mx.array(alpha / np.sqrt(L * D), mx.float32)
    ours = np.asarray(embedding_noise(mx.zeros((B, L, D)), scale, training=True))
    for noise in (theirs, ours):
        bound = np.abs(noise).max()
        assert alpha / np.sqrt(L * D) * 0.99 <= bound <= alpha / np.sqrt(L * D) * (1 + 1e-6)
        assert abs(noise.mean()) < 0.02 * bound and abs(noise.std() / bound - 1 / np.sqrt(3)) < 0.01
    assert np.array_equal(np.asarray(embedding_noise(mx.ones((1, 3, D)), scale, training=False)), np.ones((1, 3, D)))


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_vl"])
def test_neftune_in_training_only(arch, tiny_checkpoint, tmp_path):
    from mlxrl.data.synthetic import make_vqa

    rows = TEXT_ROWS if arch == "qwen3" else make_vqa(3, seed=1, sides=(64, 96))
    plain = _trainer(tiny_checkpoint, tmp_path, rows, arch=arch, max_length=256)
    noisy = _trainer(tiny_checkpoint, tmp_path, rows, arch=arch, max_length=256, neftune_noise_alpha=15.0)
    b_plain, b_noisy = plain._batches_of(plain.train_examples, 0, False, 3)[0], \
        noisy._batches_of(noisy.train_examples, 0, False, 3)[0]
    longest = int(np.asarray(b_plain["input_ids"] != plain.processor.pad_token_id).sum(1).max())
    width = plain.model.language_model.config.hidden_size
    assert np.isclose(float(b_noisy["neftune_scale"]), 15.0 / np.sqrt(longest * width))

    def loss(trainer, batch):
        (value, _), grads = nn.value_and_grad(trainer.model, trainer.loss)(
            trainer.model, trainer.to_device(batch), mx.array(batch["trained_tokens"], mx.float32))
        return value.item(), grads

    noisy.model.update(plain.model.parameters())
    base, _ = loss(plain, b_plain)
    mx.random.seed(0)
    first, grads = loss(noisy, b_noisy)
    mx.random.seed(1)
    second, _ = loss(noisy, b_noisy)
    assert base != first != second and abs(first - base) < 0.1 * abs(base)  # noise, small, drawn per step
    assert all(bool(mx.isfinite(g).all()) for _, g in tree_flatten(grads))
    noisy.model.eval()
    assert abs(loss(noisy, b_noisy)[0] - base) <= 1e-6 * abs(base)  # evaluation: no noise
    with pytest.raises(ConfigError, match="neftune_noise_alpha=5.0 is not supported by mlxrl's DPOTrainer"):
        check_config(DPOConfig(neftune_noise_alpha=5.0))


@pytest.mark.parametrize("greater", [True, False])
def test_load_best_model_at_end(greater, tiny_checkpoint, tmp_path):
    t = _trainer(tiny_checkpoint, tmp_path, max_steps=6, learning_rate=3e-3, eval_strategy="steps", eval_steps=2,
                 save_steps=2, save_total_limit=1, load_best_model_at_end=True, greater_is_better=greater)
    t.eval_examples = t.train_examples[:3]
    t.train()
    history = t.log_history
    evals = [(e["step"], e["eval_loss"]) for e in history if "eval_loss" in e]
    assert [s for s, _ in evals] == [2, 4, 6] and len({v for _, v in evals}) == 3
    best_step = (max if greater else min)(evals, key=lambda e: e[1])[0]
    kept = sorted(p.name for p in (tmp_path / "run").glob("checkpoint-*"))
    assert kept == sorted({f"checkpoint-{best_step}", "checkpoint-6"})  # the best survives save_total_limit=1
    saved = mx.load(str(tmp_path / "run" / f"checkpoint-{best_step}" / "trainable.safetensors"))
    now = dict(tree_flatten(t.model.trainable_parameters()))
    assert all(mx.array_equal(now[k], v).item() for k, v in saved.items())  # (bf16 has no numpy form)
    state = json.loads((tmp_path / "run" / "checkpoint-6" / "trainer_state.json").read_text())
    assert state["best_model_checkpoint"] == f"checkpoint-{best_step}"
    if best_step != 6:
        last = mx.load(str(tmp_path / "run" / "checkpoint-6" / "trainable.safetensors"))
        assert any(not mx.array_equal(now[k], v).item() for k, v in last.items())


def test_load_best_model_at_end_checks(tiny_checkpoint, tmp_path):
    with pytest.raises(ConfigError, match="needs eval_strategy and save_strategy to be the same"):
        check_config(SFTConfig(load_best_model_at_end=True))
    with pytest.raises(ConfigError, match=r"save_steps \(3\) to be a multiple of eval_steps \(2\)"):
        check_config(SFTConfig(load_best_model_at_end=True, eval_strategy="steps", eval_steps=2, save_steps=3))
    t = _trainer(tiny_checkpoint, tmp_path, max_steps=2, eval_strategy="steps", eval_steps=2, save_steps=2,
                 load_best_model_at_end=True, metric_for_best_model="accuracy")
    t.eval_examples = t.train_examples[:2]
    with pytest.raises(mlxrl.MlxrlError, match="metric_for_best_model 'accuracy' is not an evaluation metric"):
        t.train()


def test_dpo_pad_to_multiple_of_changes_nothing_but_the_width(tiny_checkpoint, tmp_path):
    from mlxrl.trainers.dpo.trainer import DPOTrainer

    rows = [{"prompt": f"Question {i}?", "chosen": " a fine answer" * (i + 1), "rejected": " no"} for i in range(4)]
    losses = []
    for m in ("auto", "48"):
        model, processor = mlxrl.load(tiny_checkpoint("qwen3"))
        t = DPOTrainer(model, processor, DPOConfig(output_dir=str(tmp_path / m), max_length=128, compile=False,
                                                   gradient_checkpointing=False, disable_tqdm=True, save_steps=0,
                                                   pad_to_multiple_of=m), train_dataset=rows)
        batch = t.pair_batches(t.train_examples, 0, False, 4)[0]
        assert m == "auto" or batch["input_ids"].shape[1] % 48 == 0
        arrays = t.gradient_free_inputs(t.to_device(batch))
        losses.append(t.loss(t.model, arrays, mx.array(float(batch["num_pairs"])))[0].item())
    assert abs(losses[0] - losses[1]) <= 1e-5 * abs(losses[0])
