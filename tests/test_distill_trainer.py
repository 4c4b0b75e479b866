"""DistillationTrainer against TRL 1.16's own DistillationTrainer: whole runs on the same tiny student and teacher
(a Qwen2 teacher for a Qwen3 student: another architecture, one vocabulary) where TRL trains on the completions
mlxrl sampled (sampling cannot be matched across frameworks, so TRL's generation is replaced by ours, round by
round, and its in-round shuffle, which changes no gradient, by the identity): every logged value (loss, grad_norm,
entropy, completion lengths, num_tokens) against TRL's float32 run, and the final weights against its float64 run
(its divergence kernel, which projects into float32 tiles, replaced there by the plain computation), for beta
0 / 0.5 / 1, temperature, gradient accumulation; image prompts reaching both models; the config's fields and
defaults against TRL's, the teacher's loading options and the refusals.

    python -m pytest -q tests/test_distill_trainer.py
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from safetensors.numpy import load_file
from test_trl_runs import assert_same_logs, train_recording_rounds, trl_train_on_rounds

import mlxrl
from mlxrl import DistillationConfig, DistillationTrainer

trl = pytest.importorskip("trl")
torch = pytest.importorskip("torch")
warnings.filterwarnings("ignore")

# prompts of one token count each (no left padding: torch's default positions then agree with ours)
PROMPTS = [{"prompt": "The sky is"}, {"prompt": "Cats say"}, {"prompt": "Fire is"}, {"prompt": "Snow is"}]


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    from conftest import tiny_checkpoints_module

    return tiny_checkpoints_module().build("qwen2", tmp_path_factory.mktemp("teacher"), seed=7)


def ours_run(folder, teacher, tmp_path, hyper):
    model, processor = mlxrl.load(folder)
    args = DistillationConfig(output_dir=str(tmp_path / "ours"), disable_tqdm=True, save_steps=0, logging_steps=1,
                              gradient_checkpointing=False, shuffle_dataset=False, **hyper)
    trainer = DistillationTrainer(model, processor, args, train_dataset=PROMPTS, teacher_model=str(teacher))
    return train_recording_rounds(trainer, tmp_path / "ours")


def naive_divergence(hs, ws, bs, ht, wt, bt, beta, temperature, *scales):
    """TRL's ChunkedDivergenceFunction written plainly in torch over whole [tokens, V] logits, in the inputs' dtype:
    the float64 reference (TRL's kernel projects into float32 tiles whatever its inputs are)."""
    zs, zt = hs @ ws.T / temperature, ht @ wt.T / temperature
    log_ps, log_pt = torch.log_softmax(zs, -1), torch.log_softmax(zt, -1)
    ps, pt = log_ps.exp(), log_pt.exp()
    if beta == 0.0:
        d = (pt * (log_pt - log_ps)).sum(-1)
    elif beta == 1.0:
        d = (ps * (log_ps - log_pt)).sum(-1)
    else:
        log_m = torch.log((1 - beta) * ps + beta * pt)
        d = beta * (pt * (log_pt - log_m)).sum(-1) + (1 - beta) * (ps * (log_ps - log_m)).sum(-1)
    return d, -(ps * log_ps).sum(-1).detach()


def trl_run(folder, teacher, tmp_path, hyper, rounds, monkeypatch, dtype=None):
    """TRL's DistillationTrainer with its generation replaced by the completions mlxrl sampled in the same round;
    in float64, its divergence kernel replaced by the plain computation in float64."""
    import transformers
    from datasets import Dataset
    from trl.trainer import distillation_trainer

    monkeypatch.setattr(distillation_trainer, "shuffle_sequence_dict", lambda batch: batch)
    dtype = dtype or torch.float32
    if dtype == torch.float64:
        monkeypatch.setattr(distillation_trainer.ChunkedDivergenceFunction, "apply", naive_divergence)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype)
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    args = trl.DistillationConfig(output_dir=str(tmp_path / "trl"), bf16=False, use_cpu=True, report_to=[],
                                  save_strategy="no", logging_steps=1, dataloader_num_workers=0,
                                  gradient_checkpointing=False, shuffle_dataset=False, **hyper)
    teacher_hf = transformers.AutoModelForCausalLM.from_pretrained(str(teacher), dtype=dtype)
    trainer = trl.DistillationTrainer(model=hf, teacher_model=teacher_hf, args=args,
                                      train_dataset=Dataset.from_list(PROMPTS), processing_class=tok)
    return trl_train_on_rounds(trainer, hf, rounds)


KEYS = ("loss", "grad_norm", "learning_rate", "entropy", "completions/mean_length", "completions/min_length",
        "completions/max_length", "completions/clipped_ratio", "completions/mean_terminated_length", "num_tokens")


@pytest.mark.parametrize("extra", [
    dict(beta=1.0),
    dict(beta=0.0, temperature=0.7),
    dict(beta=0.5, gradient_accumulation_steps=2, per_device_train_batch_size=2),
])
def test_a_whole_run_on_the_same_completions_ends_at_trls_weights(tiny_checkpoint, teacher, tmp_path, extra,
                                                                  monkeypatch):
    folder = tiny_checkpoint("qwen3")
    hyper = dict(learning_rate=2e-3, max_steps=2, per_device_train_batch_size=4, max_completion_length=6,
                 max_grad_norm=1.0, lr_scheduler_type="linear", weight_decay=0.0, seed=0)
    hyper.update(extra)
    start = load_file(str(folder / "model.safetensors"))
    ours, ours_log, rounds = ours_run(folder, teacher, tmp_path, hyper)
    f32, log32 = trl_run(folder, teacher, tmp_path / "f32", hyper, rounds, monkeypatch)
    f64, _ = trl_run(folder, teacher, tmp_path / "f64", hyper, rounds, monkeypatch, dtype=torch.float64)
    assert len(rounds) == hyper["max_steps"]
    assert_same_logs(ours_log, log32, hyper["max_steps"], KEYS)
    # the planner counts the teacher's weights: the second step's peak (the optimizer's state made) within 15%
    last = ours_log[-1]
    assert abs(last["predicted_peak_memory_gb"] - last["peak_memory_gb"]) <= 0.15 * last["peak_memory_gb"], last
    # the weights: no further from float64 than 1e-3 of the update or twice TRL's float32 (Adam's first steps scale
    # near-zero gradients' rounding up to whole steps; measured: ours at most 7.7e-4 of the update, TRL's 1.5e-3)
    checked = 0
    for name, w0 in start.items():
        update = np.linalg.norm(f64[name] - w0)
        gap, gap32 = (np.linalg.norm(w[name].astype(np.float64) - f64[name]) for w in (ours, f32))
        assert gap <= max(1e-3 * update, 2 * gap32), (name, gap / update, gap32 / update)
        checked += 1
    assert checked == len(start)


# ----------------------------------------------------------------------------------------------- images, LoRA

def naive_loss(student, teacher, mb, beta, temperature):
    """The micro-batch's summed divergence the plain way: each row's prompt (padding removed) and completion through
    each model's whole forward (the images with it), [tokens, V] logits, the divergence at every completion token."""
    import mlx.core as mx

    total = 0.0
    for r in range(mb["completion_ids"].shape[0]):
        p = mb["prompt_ids"][r][mb["prompt_mask"][r] > 0]
        c = mb["completion_ids"][r][mb["completion_mask"][r] > 0]
        ids = mx.array(np.concatenate([p, c])[None].astype(np.int32))
        kw = {}
        if "pixel_values" in mb:  # one image per row (the synthetic questions'): row r's patches are image r's
            sizes = np.prod(mb["image_grid_thw"], axis=1)
            start = int(sizes[:r].sum())
            kw = {"pixel_values": mx.array(mb["pixel_values"][start:start + int(sizes[r])]),
                  "image_grid_thw": mx.array(mb["image_grid_thw"][r:r + 1])}
        zs, zt = (np.array(m(ids, **kw)[0, len(p) - 1:-1]).astype(np.float64) / temperature
                  for m in (student, teacher))
        ls, lt = (z - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)) - z.max(-1, keepdims=True)
                  for z in (zs, zt))
        ps, pt = np.exp(ls), np.exp(lt)
        lm = np.log((1 - beta) * ps + beta * pt)
        total += float((beta * (pt * (lt - lm)).sum(-1) + (1 - beta) * (ps * (ls - lm)).sum(-1)).sum())
    return total


@pytest.mark.usefixtures("kernel_path")
def test_vision_prompts_with_lora_reach_both_models(tiny_checkpoint, tmp_path_factory, tmp_path):
    """Qwen2-VL student and teacher (another seed), image prompts, LoRA, compiled: the first step's logged loss is the
    divergence of both models' whole forwards over the prompts with their images, as a token mean over the round,
    and the adapters move. It fails when either model's forward loses the images."""
    from conftest import tiny_checkpoints_module
    from mlx.utils import tree_flatten

    from mlxrl.cli.grpo import prompt_rows
    from mlxrl.data.synthetic import make_vqa

    teacher_folder = tiny_checkpoints_module().build("qwen2_vl", tmp_path_factory.mktemp("vl_teacher"), seed=7)
    model, processor = mlxrl.load(tiny_checkpoint("qwen2_vl"))
    args = DistillationConfig(output_dir=str(tmp_path / "o"), disable_tqdm=True, save_steps=0, logging_steps=1,
                              gradient_checkpointing=False, learning_rate=1e-2, max_steps=2, use_peft=True, lora_r=4,
                              lora_dropout=0.0, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                              max_completion_length=4, beta=0.5)
    rows = [{k: v for k, v in r.items() if k != "answer"} for r in prompt_rows(make_vqa(8, seed=3))]
    trainer = DistillationTrainer(model, processor, args, train_dataset=rows, teacher_model=str(teacher_folder))
    rounds, generate_round = [], trainer.generate_round

    def recorded(index):
        micro, metrics = generate_round(index)
        if not rounds:  # the first round, scored by the weights that generated it (before the first step)
            rounds.append(sum(naive_loss(model, trainer.teacher_model, mb, 0.5, 1.0) for mb in micro)
                          / sum(float(mb["completion_mask"].sum()) for mb in micro))
        return micro, metrics

    trainer.generate_round = recorded
    before = {k: np.array(v) for k, v in tree_flatten(model.trainable_parameters()) if k.endswith("lora_b")}
    trainer.train()
    logged = [e for e in trainer.log_history if "loss" in e]
    assert logged[0]["loss"] == pytest.approx(rounds[0], rel=2e-4)
    after = dict(tree_flatten(model.trainable_parameters()))
    assert all(not np.array_equal(np.array(after[k]), v) for k, v in before.items())


# ----------------------------------------------------------------------------------------------- the config

def test_the_configs_fields_have_trls_defaults(tmp_path):
    import dataclasses

    mine = {f.name: f for f in dataclasses.fields(DistillationConfig)}
    theirs = [f for f in dataclasses.fields(trl.DistillationConfig)
              if f.name in vars(trl.DistillationConfig).get("__annotations__", {})]
    assert len(theirs) > 30
    for f in theirs:
        assert f.name in mine, f.name
        default = mine[f.name].default
        assert default == f.default or (f.name == "max_tool_calling_iterations" and default is None), f.name


def test_bad_settings_and_teachers_are_one_line_errors(tiny_checkpoint, teacher, tmp_path):

    folder = str(tiny_checkpoint("qwen3"))

    def make(teacher_model=str(teacher), **kw):
        return DistillationTrainer(model=folder, teacher_model=teacher_model,
                                   args=DistillationConfig(output_dir=str(tmp_path), **kw), train_dataset=PROMPTS)

    for kw, needle in [({"beta": 1.5}, "beta"), ({"temperature": 0.0}, "temperature"),
                       ({"teacher_model_init_kwargs": {"device_map": "auto"}}, "device_map"),
                       ({"teacher_model_init_kwargs": '{"dtype": "float16"}'}, "float16"),
                       ({"use_vllm": True}, "use_vllm"), ({"max_tool_calling_iterations": 3}, "tool")]:
        with pytest.raises(ValueError, match=needle):
            make(**kw)
    with pytest.raises(ValueError, match="needs a teacher"):
        make(teacher_model=None)
    with pytest.raises(ValueError, match="conversational prompts"):  # tools are described by the chat template
        DistillationTrainer(model=folder, teacher_model=str(teacher), tools=[len],
                            args=DistillationConfig(output_dir=str(tmp_path)), train_dataset=PROMPTS)
    chats = [{"prompt": [{"role": "user", "content": p["prompt"]}]} for p in PROMPTS]
    with pytest.raises(ValueError, match="cannot be described"):  # a tool needs type hints and a docstring
        DistillationTrainer(model=folder, teacher_model=str(teacher), tools=[len],
                            args=DistillationConfig(output_dir=str(tmp_path)), train_dataset=chats)
    model, processor = mlxrl.load(folder)
    with pytest.raises(ValueError, match="same object"):
        DistillationTrainer(model, processor, DistillationConfig(output_dir=str(tmp_path)), train_dataset=PROMPTS,
                            teacher_model=model)
    small, _ = mlxrl.load(folder)
    small.lm_head.weight = small.lm_head.weight[:1000]
    with pytest.raises(ValueError, match="vocabulary"):
        DistillationTrainer(model, processor, DistillationConfig(output_dir=str(tmp_path)), train_dataset=PROMPTS,
                            teacher_model=small)


def test_a_4bit_teacher_from_its_folder_and_trls_positional_order(tiny_checkpoint, teacher, tmp_path):
    """TRL's (model, teacher_model, args) positional order; teacher_model_name_or_path with
    teacher_model_init_kwargs' quantization_config: the teacher loads 4-bit and the run trains."""
    import mlx.nn as nn

    args = DistillationConfig(output_dir=str(tmp_path / "o"), disable_tqdm=True, save_steps=0, max_steps=1,
                              per_device_train_batch_size=4, max_completion_length=4,
                              teacher_model_name_or_path=str(teacher),
                              teacher_model_init_kwargs={"quantization_config": {"load_in_4bit": True}})
    trainer = DistillationTrainer(str(tiny_checkpoint("qwen3")), None, args, train_dataset=PROMPTS)
    assert any(isinstance(m, nn.QuantizedLinear) for _, m in trainer.teacher_model.named_modules())
    # the planner's teacher row (`mlxrl plan --trainer distill`) counts what loaded, float and quantized
    from mlx.utils import tree_flatten

    from mlxrl.plan.config_json import load_config
    from mlxrl.plan.model import frozen_weight_bytes

    cfg = load_config(str(teacher))
    for model, quantize in ((trainer.teacher_model, (4, 64)), (mlxrl.load(str(teacher))[0], None)):
        loaded = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
        assert frozen_weight_bytes(cfg, 4, quantize) == pytest.approx(loaded, rel=0.01), quantize
    trainer.train()
    assert np.isfinite(trainer.log_history[-1]["train_loss"])


def test_the_command_line_trains_from_files_and_refuses_a_missing_teacher(tiny_checkpoint, teacher, tmp_path,
                                                                         capsys):
    """`python -m mlxrl.distill --model ... --teacher_model_name_or_path ... --dataset prompts.jsonl`: a run saved;
    without the teacher, one line and status 2."""
    import json

    from mlxrl.cli.distill import main

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in PROMPTS))
    common = ["--model", str(tiny_checkpoint("qwen3")), "--dataset", str(data), "--max_steps", "1",
              "--per_device_train_batch_size", "4", "--max_completion_length", "4", "--disable_tqdm", "true",
              "--save_steps", "0"]
    assert main([*common, "--output_dir", str(tmp_path / "none")]) == 2
    assert "--teacher_model_name_or_path is required" in capsys.readouterr().err
    out = tmp_path / "o"
    assert main([*common, "--teacher_model_name_or_path", str(teacher), "--output_dir", str(out)]) == 0
    assert (out / "model.safetensors").exists()


def test_the_embedded_demo_runs_short(tmp_path):
    """The embedded default end to end, shortened: a teacher and a student made, distilled, scored."""
    from mlxrl.cli.distill import run_demo

    args = DistillationConfig(output_dir=str(tmp_path / "demo"))
    out = run_demo(args, {"output_dir"}, overrides={"max_steps": 2, "per_device_train_batch_size": 4},
                   teacher_steps=2, student_steps=1, n_test=8)
    assert len(out["history"]) >= 1 and 0.0 <= out["after"] <= 1.0
