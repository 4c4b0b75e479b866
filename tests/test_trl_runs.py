"""Whole runs against TRL 1.16: the same tiny checkpoint, rows and hyper-parameters trained by TRL's own
SFTTrainer (transformers' Trainer: its parameter groups, its AdamW, its schedule) and by ours, each from the
same weights; the final weights compared tensor by tensor against the size of the update
(||W_ours - W_trl|| / ||W_trl - W_0|| <= 2e-3), so a difference in what is decayed or trained shows.

    python -m pytest -q tests/test_trl_runs.py
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file

import mlxrl
from mlxrl.trainers.sft.config import SFTConfig
from mlxrl.trainers.sft.trainer import SFTTrainer

trl = pytest.importorskip("trl")

ROWS = [
    {"messages": [{"role": "user", "content": "What is two plus two?"}, {"role": "assistant", "content": "Four."}]},
    {"messages": [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hi there, friend!"}]},
    {"messages": [{"role": "user", "content": "Colour of the sky?"}, {"role": "assistant", "content": "Blue."}]},
    {"messages": [{"role": "user", "content": "Name a fruit"}, {"role": "assistant", "content": "An apple."}]},
]
HYPER = dict(learning_rate=3e-3, weight_decay=0.1, max_steps=3, per_device_train_batch_size=len(ROWS),
             max_length=128, max_grad_norm=1.0, lr_scheduler_type="linear", seed=0)


def trl_run(folder, tokenizer, tmp_path, rows, hyper) -> tuple[dict[str, np.ndarray], list[dict]]:
    from datasets import Dataset

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    args = trl.SFTConfig(output_dir=str(tmp_path / "trl"), bf16=False, use_cpu=True, report_to=[],
                         save_strategy="no", logging_steps=1, dataloader_num_workers=0, gradient_checkpointing=False,
                         **hyper)
    trainer = trl.SFTTrainer(model=hf, args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer)
    trainer.train()
    weights = {k: v.detach().numpy().copy() for k, v in hf.state_dict().items()}
    return weights, [e for e in trainer.state.log_history if "loss" in e]


def ours_run(folder, tmp_path, rows, hyper):
    model, processor = mlxrl.load(folder)
    args = SFTConfig(output_dir=str(tmp_path / "ours"), compile=False, disable_tqdm=True, save_steps=0,
                     gradient_checkpointing=False, logging_steps=1, **hyper)
    trainer = SFTTrainer(model, processor, args, train_dataset=rows)
    trainer.train()
    history = trainer.log_history
    weights = load_file(str(tmp_path / "ours" / "model.safetensors"))
    return weights, [e for e in history if "loss" in e], processor


def both_runs(folder, tmp_path, rows, hyper):
    ours, ours_log, processor = ours_run(folder, tmp_path, rows, hyper)
    tok = processor.tokenizer
    tok.chat_template = processor.chat_template
    theirs, trl_log = trl_run(folder, tok, tmp_path, rows, hyper)
    return ours, ours_log, theirs, trl_log


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])  # Qwen2: q/k/v biases; Qwen3: q/k norms
def test_full_fine_tuning_with_weight_decay_ends_at_trls_weights(tiny_checkpoint, tmp_path, arch):
    folder = tiny_checkpoint(arch)
    start = load_file(str(folder / "model.safetensors"))
    ours, _, theirs, _ = both_runs(folder, tmp_path, ROWS, HYPER)
    assert_same_weights(start, ours, theirs)


def test_a_ragged_last_accumulation_step_is_trained_as_trl_trains_it(tiny_checkpoint, tmp_path):
    """8 rows, batch 3, accumulation 2: 3 micro-batches an epoch, so 2 optimizer steps, the second on the
    leftover micro-batch (transformers' Trainer); 2 epochs: 4 steps, the schedule over 4."""
    folder = tiny_checkpoint("qwen3")
    rows = ROWS + [{"messages": [{"role": "user", "content": m["messages"][0]["content"] + " Again?"},
                                 m["messages"][1]]} for m in ROWS]
    hyper = {**HYPER, "max_steps": -1, "num_train_epochs": 2, "per_device_train_batch_size": 3,
             "gradient_accumulation_steps": 2, "train_sampling_strategy": "sequential"}
    start = load_file(str(folder / "model.safetensors"))
    ours, ours_log, theirs, trl_log = both_runs(folder, tmp_path, rows, hyper)
    assert len(ours_log) == len(trl_log) == 4
    for a, b in zip(ours_log, trl_log, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * abs(b["loss"]), (a, b)
        assert abs(a["learning_rate"] - b["learning_rate"]) < 1e-9, (a, b)
    assert_same_weights(start, ours, theirs)


def per_expert(weights: dict) -> dict:
    """transformers' in-memory fused experts (`experts.gate_up_proj` [E, 2I, D], `experts.down_proj`) as the
    per-expert tensors its save_pretrained and ours write."""
    out = {}
    for k, v in weights.items():
        if k.endswith("experts.gate_up_proj"):
            gate, up = np.split(v, 2, axis=1)
            out.update({k.replace("gate_up_proj", f"{e}.gate_proj.weight"): gate[e] for e in range(len(v))})
            out.update({k.replace("gate_up_proj", f"{e}.up_proj.weight"): up[e] for e in range(len(v))})
        elif k.endswith("experts.down_proj"):
            out.update({k.replace("down_proj", f"{e}.down_proj.weight"): v[e] for e in range(len(v))})
        else:
            out[k] = v
    return out


def test_moe_full_fine_tuning_with_the_router_loss_ends_at_trls_weights(tiny_checkpoint, tmp_path):
    """Qwen3-MoE: TRL adds the model config's router_aux_loss_coef x the load-balancing loss to each micro-batch's
    loss and logs it as aux_loss; 2 micro-batches per step (its 1 / accumulation share), weight decay, the router
    trained through both terms."""
    folder = tiny_checkpoint("qwen3_moe")
    start = load_file(str(folder / "model.safetensors"))
    hyper = {**HYPER, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2,
             "train_sampling_strategy": "sequential"}  # the aux loss is a mean per micro-batch: the same pairs
    ours, ours_log, theirs, trl_log = both_runs(folder, tmp_path, ROWS, hyper)
    assert len(ours_log) == len(trl_log) == 3
    for a, b in zip(ours_log, trl_log, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * abs(b["loss"]), (a, b)
        assert abs(a["aux_loss"] - b["aux_loss"]) <= 1e-4 * abs(b["aux_loss"]), (a, b)
    theirs = per_expert(theirs)
    assert any(".experts.7.down_proj" in k for k in ours) and set(ours) == set(theirs)
    assert_same_weights(start, ours, theirs)


def assert_same_logs(ours_log, trl_log, steps, keys):
    """Every value TRL logs among `keys` in each of our step's entries, within float32 rounding."""
    assert len(ours_log) == len(trl_log) == steps
    for mine, want in zip(ours_log, trl_log, strict=True):
        assert set(want) & set(keys) <= set(mine), (sorted(want), sorted(mine))
        for key in set(want) & set(keys):
            assert mine[key] == pytest.approx(want[key], rel=2e-4, abs=2e-5), (key, mine[key], want[key])


def train_recording_rounds(trainer, out) -> tuple[dict, list, list]:
    """A rollout trainer's run with each generation round's completions recorded (token ids, padding removed, in
    the round's order: what TRL's `_generate_single_turn` is replaced by): (final weights, logged steps, rounds)."""
    rounds, generate_round = [], trainer.generate_round

    def recorded(index):
        micro, metrics = generate_round(index)
        rounds.append([ids[m > 0].tolist() for mb in micro
                       for ids, m in zip(mb["completion_ids"], mb["completion_mask"], strict=True)])
        return micro, metrics

    trainer.generate_round = recorded
    trainer.train()
    return load_file(str(out / "model.safetensors")), [e for e in trainer.log_history if "loss" in e], rounds


def trl_train_on_rounds(trainer, hf, rounds) -> tuple[dict, list]:
    """A TRL rollout trainer's run with its generation replaced by `rounds` (`train_recording_rounds`), one a
    round: (final weights, logged steps)."""
    queue = list(rounds)
    trainer._generate_single_turn = lambda prompt_ids, *a, **k: queue.pop(0)
    trainer.train()
    assert not queue
    return {k: v.detach().numpy().copy() for k, v in hf.state_dict().items()}, \
        [e for e in trainer.state.log_history if "loss" in e]


def assert_same_weights(start, ours, theirs):
    exempt = [k for k in start if k.endswith(".bias") or "norm" in k]
    assert exempt  # what transformers leaves undecayed is in this model
    checked = 0
    for name, w0 in start.items():
        if name not in theirs:
            continue  # a tied head
        update = np.linalg.norm(theirs[name] - w0)
        if update == 0:
            continue
        gap = np.linalg.norm(ours[name].astype(np.float64) - theirs[name])
        # a key bias moves every key of a position alike: its gradient is near zero and mostly rounding, which
        # Adam scales up to a full step; its tolerance is looser (the others agree to ~1e-5 of the update)
        tolerance = 2e-2 if name.endswith("k_proj.bias") else 2e-3
        assert gap <= tolerance * update, (name, gap / update)
        checked += 1
    assert checked >= len(start) // 2


def assert_as_close_to_float64(start, ours, theirs32, theirs64, tolerance=2e-3):
    """Each trained tensor no further from the reference's float64 run than `tolerance` of its update or twice the
    reference's own float32 run. Adam divides a gradient by its own root mean square, so an element whose gradient
    is near zero (below Adam's eps) takes a step set by its rounding: one such element of a CPO simpo run's up_proj
    (8192 elements) differed by 1.7e-3 (an lr-sized step) while the rest agreed to 1e-4 of the update. Up to one
    element in a thousand may differ by at most twice the tensor's largest step; the rest are held to the bound."""
    checked = 0
    for name, w0 in start.items():
        if name not in theirs64:
            continue  # a tied head
        step = theirs64[name] - w0
        update = np.linalg.norm(step)
        if update == 0:
            continue
        diff = np.abs(ours[name].astype(np.float64) - theirs64[name]).ravel()
        gap32 = np.linalg.norm(theirs32[name] - theirs64[name])
        outliers = np.argsort(diff)[::-1][:max(1, diff.size // 1000)]
        outliers = outliers[diff[outliers] <= 2 * np.abs(step).max()]
        rest = np.delete(diff, outliers)
        assert np.linalg.norm(rest) <= max(tolerance * update, 2 * gap32), (name, np.linalg.norm(diff) / update,
                                                                          gap32 / update)
        checked += 1
    assert checked >= len(start) // 2


def test_max_length_none_means_no_truncation(tiny_checkpoint, tmp_path):
    """SFTConfig(max_length=None), TRL's spelling of "no truncation": accepted, and the longest row trained whole."""
    from mlxrl.errors import MlxrlError

    model, processor = mlxrl.load(tiny_checkpoint("qwen3"))
    long_row = {"messages": [{"role": "user", "content": "word " * 1100}, {"role": "assistant", "content": "ok"}]}
    args = SFTConfig(output_dir=str(tmp_path / "o"), max_length=None, max_steps=1, compile=False, disable_tqdm=True,
                     use_peft=True, per_device_train_batch_size=5)
    trainer = SFTTrainer(model, processor, args, train_dataset=[*ROWS, long_row])
    assert max(len(e) for e in trainer.train_examples) > 1100  # not cut to the default 1024
    trainer.train()
    with pytest.raises(MlxrlError, match="packing fills rows of max_length tokens"):
        SFTTrainer(model, processor, SFTConfig(output_dir=str(tmp_path / "p"), max_length=None, packing=True),
                   train_dataset=ROWS)


def token_accuracy(pred):
    """A TRL user's compute_metrics: next-token accuracy over the trained labels (logits reduced to ids)."""
    ids, labels = pred.predictions, pred.label_ids
    ids, labels = ids[:, :-1], labels[:, 1:]
    mask = labels != -100
    return {"token_accuracy": float((ids[mask] == labels[mask]).mean()), "scored": int(mask.sum()),
            "id_sum": int(ids[mask].sum())}  # which token each position predicts: the accuracy of a random model is 0


def argmax_logits(logits, labels):
    assert isinstance(logits, torch.Tensor) and logits.ndim == 3  # transformers passes its tensors
    return logits.argmax(dim=-1)


def test_compute_metrics_and_preprocess_logits_for_metrics_as_trl_evaluates(tiny_checkpoint, tmp_path):
    from datasets import Dataset

    folder = tiny_checkpoint("qwen3")
    model, processor = mlxrl.load(folder)
    ours = SFTTrainer(model=model, processing_class=processor, train_dataset=ROWS, eval_dataset=ROWS,
                      compute_metrics=token_accuracy, preprocess_logits_for_metrics=argmax_logits,
                      args=SFTConfig(output_dir=str(tmp_path / "ours"), compile=False, disable_tqdm=True,
                                     per_device_eval_batch_size=3, max_length=128))
    got = ours.evaluate()
    tok = processor.tokenizer
    tok.chat_template = processor.chat_template
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    theirs = trl.SFTTrainer(model=hf, processing_class=tok, train_dataset=Dataset.from_list(ROWS),
                            eval_dataset=Dataset.from_list(ROWS), compute_metrics=token_accuracy,
                            preprocess_logits_for_metrics=argmax_logits,
                            args=trl.SFTConfig(output_dir=str(tmp_path / "trl"), bf16=False, use_cpu=True,
                                               report_to=[], per_device_eval_batch_size=3, max_length=128))
    want = theirs.evaluate()
    assert got["eval_scored"] == want["eval_scored"] > 0 and got["eval_id_sum"] == want["eval_id_sum"]
    assert got["eval_token_accuracy"] == pytest.approx(want["eval_token_accuracy"], abs=1e-9)
    assert got["eval_loss"] == pytest.approx(want["eval_loss"], rel=1e-5)
