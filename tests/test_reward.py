"""The reward model against the references: transformers' `*ForSequenceClassification` (our classifier's scores on
the same weights, folders each side loads from the other), TRL 1.16's own RewardTrainer (its `compute_loss` on fixed
scores with float64 gradients, its tokenisation id for id, whole runs: every logged value and the final weights),
and PEFT (`PeftModel` loading our adapter, the score head in its modules_to_save).

    python -m pytest -q tests/test_reward.py
"""

from __future__ import annotations

import json
import types
import warnings
from collections import defaultdict

import mlx.core as mx
import numpy as np
import pytest
from safetensors.numpy import load_file
from test_trl_runs import assert_same_logs, assert_same_weights  # the SFT runs' comparisons

import mlxrl
from mlxrl import RewardConfig, RewardTrainer
from mlxrl.errors import MlxrlError
from mlxrl.models import score as score_lib

trl = pytest.importorskip("trl")
torch = pytest.importorskip("torch")
warnings.filterwarnings("ignore")

PAD = 151643


def _conv(prompt, answer):
    return [{"role": "user", "content": prompt}], [{"role": "assistant", "content": answer}]


def _pair(prompt, good, bad, **extra):
    p, c = _conv(prompt, good)
    _, r = _conv(prompt, bad)
    return {"prompt": p, "chosen": c, "rejected": r, **extra}


CONVERSATIONS = [_pair("What colour is the sky?", "Blue.", "Green, surely."), _pair("Say hi", "Hi!", "Go away."),
                 _pair("Two plus two?", "Four.", "Five."), _pair("Name a fruit", "An apple.", "A chair."),
                 _pair("Capital of France?", "Paris.", "Berlin, I think."), _pair("Opposite of hot?", "Cold.", "Red.")]
STRINGS = [{"prompt": "Two plus two is", "chosen": " four.", "rejected": " five, I think.", "margin": 0.5},
           {"prompt": "The sky is", "chosen": " blue.", "rejected": " made of cheese.", "margin": 1.0},
           {"prompt": "Cats say", "chosen": " meow.", "rejected": " woof.", "margin": 0.0},
           {"prompt": "A fruit:", "chosen": " apple", "rejected": " a chair", "margin": 2.0}]
IMPLICIT = [{"chosen": "Q: hot or cold? A: cold", "rejected": "Q: hot or cold? A: purple"},
            {"chosen": "The sun rises in the east.", "rejected": "The sun rises in the north."},
            {"chosen": "Water is wet.", "rejected": "Water is dry and sandy."},
            {"chosen": "One, two, three.", "rejected": "One, two, seven."}]
HYPER = dict(learning_rate=2e-3, max_steps=3, max_length=128, max_grad_norm=1.0, lr_scheduler_type="linear",
             weight_decay=0.0, seed=0, train_sampling_strategy="sequential")  # TRL's random order is torch's
KEYS = ("loss", "grad_norm", "learning_rate", "min_reward", "mean_reward", "max_reward", "accuracy", "margin",
        "num_tokens")


@pytest.fixture(scope="module")
def classifier(tiny_checkpoint, tmp_path_factory):
    """A Qwen3 reward model folder written by transformers (the tiny checkpoint's decoder, a score head drawn
    with a large scale so that the rewards differ from the start), with the tokenizer."""
    import transformers

    causal = tiny_checkpoint("qwen3")
    folder = tmp_path_factory.mktemp("reward_model")
    torch.manual_seed(0)
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(str(causal), num_labels=1,
                                                                         dtype=torch.float32)
    torch.nn.init.normal_(hf.score.weight, std=0.5)
    hf.config.pad_token_id = PAD
    hf.save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(str(causal)).save_pretrained(folder)
    return folder


def hf_scores(folder, ids, **kw):
    import transformers

    hf = kw.pop("model", None) or transformers.AutoModelForSequenceClassification.from_pretrained(
        str(folder), dtype=torch.float32)
    mask = torch.tensor((np.asarray(ids) != PAD).astype(np.int64))
    with torch.no_grad():
        return hf(input_ids=torch.tensor(np.asarray(ids)), attention_mask=mask).logits.numpy()


ROWS = np.array([[5, 6, 7, 8, PAD, PAD], [9, 10, 11, 12, 13, 14], [PAD, PAD, 21, 22, 23, 24]])  # right, none, left
MASK = (ROWS != PAD).astype(np.int32)


# ---------------------------------------------------------------------------------------------- the classifier

@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "qwen3_5_text", "qwen3_5", "qwen3_moe"])
def test_the_classifier_scores_as_transformers_both_ways(tiny_checkpoint, tmp_path, arch):
    """A transformers classifier folder loads as ours with the same scores (right, left and no padding); our save
    loads in AutoModelForSequenceClassification as the same class with the same scores."""
    import transformers

    causal = tiny_checkpoint(arch)
    torch.manual_seed(1)
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(str(causal), num_labels=1,
                                                                         dtype=torch.float32)
    torch.nn.init.normal_(hf.score.weight, std=0.5)
    hf.config.get_text_config().pad_token_id = PAD
    hf.save_pretrained(tmp_path / "theirs")
    transformers.AutoTokenizer.from_pretrained(str(causal)).save_pretrained(tmp_path / "theirs")
    want = hf_scores(None, ROWS, model=hf)
    model, processor = mlxrl.load(tmp_path / "theirs")
    assert score_lib.is_classifier(model) and "lm_head" not in model
    got = np.array(score_lib.score(model, ROWS, attention_mask=MASK))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    mlxrl.save(model, processor, tmp_path / "ours")
    back = transformers.AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "ours"),
                                                                           dtype=torch.float32)
    assert type(back).__name__ == score_lib.CLASSIFIERS[arch]
    np.testing.assert_allclose(hf_scores(None, ROWS, model=back), want, rtol=1e-5, atol=1e-5)


def test_a_causal_folder_loads_as_a_classifier_with_a_fresh_head(tiny_checkpoint):
    model, _ = mlxrl.load(tiny_checkpoint("qwen3"), num_labels=1)
    assert model.score.weight.shape == (1, model.language_model.config.hidden_size) and "lm_head" not in model
    std = float(mx.std(model.score.weight))
    assert 0.005 < std < 0.05  # normal(0, initializer_range = 0.02), as transformers initialises it
    with pytest.raises(MlxrlError, match="no sequence classifier in transformers"):
        mlxrl.load(tiny_checkpoint("qwen2_vl"), num_labels=1)


def test_a_classifier_of_another_label_count_is_refused(classifier):
    with pytest.raises(MlxrlError, match="1 labels, not num_labels=2"):
        mlxrl.load(classifier, num_labels=2)


# ---------------------------------------------------------------------------------------------- the loss

def trl_loss(chosen, rejected, margin, coef):
    """TRL's own RewardTrainer.compute_loss on fixed scores: a stand-in model returning them as logits."""
    scores = torch.cat([chosen, rejected])[:, None]
    model = types.SimpleNamespace(training=True)
    fake = types.SimpleNamespace(
        model=model, args=types.SimpleNamespace(center_rewards_coefficient=coef), _metrics={"train": defaultdict(list)},
        _total_train_tokens=0, _tp_size=1,
        accelerator=types.SimpleNamespace(gather=lambda x: x, gather_for_metrics=lambda x: x))
    inputs = {"input_ids": torch.zeros(2 * len(chosen), 3, dtype=torch.long),
              "attention_mask": torch.ones(2 * len(chosen), 3, dtype=torch.long)}
    if margin is not None:
        inputs["margin"] = margin

    def forward(**_):
        return types.SimpleNamespace(logits=scores)

    loss = trl.RewardTrainer.compute_loss(fake, forward, inputs)
    return loss, {k: v[-1] for k, v in fake._metrics["train"].items() if k != "num_tokens"}


@pytest.mark.parametrize("margin, coef", [(False, None), (True, None), (False, 0.01), (True, 0.5)])
def test_the_loss_is_trls_with_float64_gradients(margin, coef):
    from mlxrl.losses.reward import bradley_terry_loss

    rng = np.random.default_rng(3)
    c, r = rng.normal(size=6) * 3, rng.normal(size=6) * 3
    r[0] = c[0]  # a tie: not an accurate pair
    m = rng.uniform(0, 2, size=6) if margin else None
    tc, tr = (torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in (c, r))
    want, metrics = trl_loss(tc, tr, None if m is None else torch.tensor(m), coef)
    want.backward()

    def ours(cc, rr):
        return bradley_terry_loss(cc, rr, None if m is None else mx.array(m, dtype=mx.float32), coef)[0]

    args = (mx.array(c, dtype=mx.float32), mx.array(r, dtype=mx.float32))
    loss, got = bradley_terry_loss(*args, None if m is None else mx.array(m, dtype=mx.float32), coef)
    assert float(loss) == pytest.approx(float(want), rel=1e-6)
    for k, v in metrics.items():
        assert float(got[k]) == pytest.approx(v, rel=1e-6, abs=1e-6), k
    gc, gr = mx.grad(ours, argnums=(0, 1))(*args)
    np.testing.assert_allclose(np.array(gc), tc.grad.numpy(), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.array(gr), tr.grad.numpy(), rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------------------------------------- the data

def trl_tokenised(classifier, rows, max_length=1024):
    import transformers
    from datasets import Dataset

    tok = transformers.AutoTokenizer.from_pretrained(str(classifier))
    args = types.SimpleNamespace(dataset_num_proc=None, max_length=max_length)
    out = trl.RewardTrainer._prepare_dataset(None, Dataset.from_list(rows), tok, args, "train")
    return [(list(e["chosen_ids"]), list(e["rejected_ids"])) for e in out]


@pytest.mark.parametrize("rows", ["conversations", "strings", "implicit", "tools"])
def test_rows_tokenise_as_trl(classifier, rows):
    from mlxrl.data.reward import tokenize_reward_rows

    tool = {"type": "function", "function": {"name": "add", "description": "Add two numbers",
                                             "parameters": {"type": "object", "properties": {}}}}
    data = {"conversations": CONVERSATIONS, "strings": STRINGS, "implicit": IMPLICIT,
            "tools": [{**r, "tools": json.dumps([tool])} for r in CONVERSATIONS[:3]]}[rows]
    _, processor = mlxrl.load(classifier)
    ours = [(e.chosen_ids.tolist(), e.rejected_ids.tolist()) for e in tokenize_reward_rows(data, processor)]
    assert ours == trl_tokenised(classifier, data)


def test_pairs_longer_than_max_length_are_dropped_as_trl(classifier, capsys):
    from mlxrl.data.reward import tokenize_reward_rows

    _, processor = mlxrl.load(classifier)
    longest = sorted(max(len(c), len(r)) for c, r in trl_tokenised(classifier, CONVERSATIONS))
    limit = longest[len(longest) // 2]  # about half the pairs fit
    ours = [(e.chosen_ids.tolist(), e.rejected_ids.tolist())
            for e in tokenize_reward_rows(CONVERSATIONS, processor, max_length=limit)]
    want = trl_tokenised(classifier, CONVERSATIONS, max_length=limit)
    assert ours == want and 0 < len(want) < len(CONVERSATIONS)
    assert "dropped" in capsys.readouterr().out


def test_the_scored_position_is_the_last_non_pad_token_padding_free_too(classifier):
    """The batch's score_at, right-padded and padding-free, picks the same hidden states: the same rewards."""
    from mlxrl.data.reward import make_reward_batches, tokenize_reward_rows

    model, processor = mlxrl.load(classifier)
    trainer = types.SimpleNamespace()
    examples = tokenize_reward_rows(STRINGS, processor)
    got = []
    for free in (False, True):
        batch = make_reward_batches(examples, 4, pad_token_id=PAD, shuffle=False, padding_free=free)[0]
        arrays = {k: mx.array(v) for k, v in batch.items() if isinstance(v, np.ndarray)}
        got.append(np.array(RewardTrainer.rewards(trainer, model, arrays)))
    seqs = [e.chosen_ids for e in examples] + [e.rejected_ids for e in examples]
    width = max(map(len, seqs))
    ids = np.array([np.pad(s, (0, width - len(s)), constant_values=PAD) for s in seqs])
    want = hf_scores(classifier, ids)[:, 0]
    np.testing.assert_allclose(got[0], want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got[1], want, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------- whole runs

def trl_run(folder, tmp_path, rows, hyper, peft_config=None, adapters=None):
    import transformers
    from datasets import Dataset

    hf = transformers.AutoModelForSequenceClassification.from_pretrained(str(folder), dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    args = trl.RewardConfig(output_dir=str(tmp_path / "trl"), bf16=False, use_cpu=True, report_to=[],
                            save_strategy="no", logging_steps=1, dataloader_num_workers=0,
                            gradient_checkpointing=False, **hyper)
    trainer = trl.RewardTrainer(model=hf, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok,
                                peft_config=peft_config)
    if adapters is not None:  # the same initial LoRA matrices as ours (each side draws A from its own RNG)
        params = dict(trainer.model.named_parameters())
        with torch.no_grad():
            for k, v in adapters.items():
                if ".lora_" in k:
                    params[k.replace(".weight", ".default.weight")].copy_(torch.tensor(np.asarray(v)))
    trainer.train()
    model = trainer.model.merge_and_unload() if peft_config is not None else trainer.model
    return ({k: v.detach().numpy().copy() for k, v in model.state_dict().items()},
            [e for e in trainer.state.log_history if "loss" in e])


def ours_run(folder, tmp_path, rows, hyper, **kw):
    model, processor = mlxrl.load(folder)
    args = RewardConfig(output_dir=str(tmp_path / "ours"), compile=False, disable_tqdm=True, save_steps=0,
                        gradient_checkpointing=False, logging_steps=1, **hyper, **kw)
    trainer = RewardTrainer(model, processor, args, train_dataset=rows)
    trainer.train()
    return trainer, [e for e in trainer.log_history if "loss" in e]


@pytest.mark.parametrize("rows, extra", [
    ("conversations", dict(per_device_train_batch_size=3)),
    ("strings", dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, center_rewards_coefficient=0.1)),
    ("implicit", dict(per_device_train_batch_size=4)),
])
def test_a_whole_run_ends_at_trls_weights(classifier, tmp_path, rows, extra):
    """Full fine-tuning: every step's loss, grad_norm, lr and metric, and the final weights (the score head's
    included) against TRL's RewardTrainer; the saved folder scores as our model in transformers."""
    data = {"conversations": CONVERSATIONS, "strings": STRINGS, "implicit": IMPLICIT}[rows]
    hyper = {**HYPER, **extra}
    start = load_file(str(classifier / "model.safetensors"))
    trainer, ours_log = ours_run(classifier, tmp_path, data, hyper)
    theirs, trl_log = trl_run(classifier, tmp_path, data, hyper)
    assert_same_logs(ours_log, trl_log, HYPER["max_steps"], KEYS)
    ours = load_file(str(tmp_path / "ours" / "model.safetensors"))
    assert_same_weights(start, ours, theirs)
    assert np.linalg.norm(ours["score.weight"] - theirs["score.weight"]) <= 2e-3 * np.linalg.norm(
        theirs["score.weight"] - start["score.weight"])
    got = np.array(score_lib.score(trainer.model, ROWS, attention_mask=MASK))
    np.testing.assert_allclose(hf_scores(tmp_path / "ours", ROWS), got, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def vision_classifier(tiny_checkpoint, tmp_path_factory):
    """A Qwen3.5 (vision-language) reward model folder: the tiny checkpoint with a score head drawn with a large
    scale, its pad token set, saved by mlxrl (transformers' Qwen3_5ForSequenceClassification loads it)."""
    causal = tiny_checkpoint("qwen3_5")
    model, processor = mlxrl.load(causal, num_labels=1)
    w = model.score.weight
    model.score.weight = (0.5 * mx.random.normal(w.shape, key=mx.random.key(0))).astype(w.dtype)
    score_lib.set_pad_token_id(model, processor.pad_token_id)
    return mlxrl.loading.save(model, processor, tmp_path_factory.mktemp("vision_reward") / "rm")


def vision_reward_rows(n=4):
    from mlxrl.cli.paired import preference_pairs
    from mlxrl.data.synthetic import make_vqa

    return preference_pairs(make_vqa(n, seed=4), seed=1)  # explicit prompt (with the image), conversations


def trl_vision_run(folder, tmp_path, rows, hyper, dtype=torch.float32):
    """TRL's RewardTrainer on transformers' Qwen3_5ForSequenceClassification with the images added: TRL collates
    text only, so each row is tokenised by transformers' processor (TRL's image placement,
    `prepare_multimodal_messages`) and the collator adds the pixel values, chosen rows' then rejected rows'."""
    import transformers
    from conftest import tiny_checkpoints_module
    from datasets import Dataset
    from trl.data_utils import prepare_multimodal_messages
    from trl.trainer.reward_trainer import DataCollatorForPreference

    hf = transformers.Qwen3_5ForSequenceClassification.from_pretrained(str(folder), dtype=dtype)
    proc = tiny_checkpoints_module().hf_processor(folder)
    data, pixels = [], []
    for i, row in enumerate(rows):
        ids = {}
        for side in ("chosen", "rejected"):
            text = proc.apply_chat_template(prepare_multimodal_messages(row["prompt"] + row[side],
                                                                        images=row["images"]), tokenize=False)
            enc = proc(text=[text], images=[row["images"]], return_tensors="pt", add_special_tokens=False)
            ids[f"{side}_ids"] = enc["input_ids"][0].tolist()
        pixels.append((enc["pixel_values"], enc["image_grid_thw"]))
        data.append({**ids, "row": i})
    base = DataCollatorForPreference(pad_token_id=proc.tokenizer.pad_token_id)

    def collate(examples):
        out = base([{k: e[k] for k in ("chosen_ids", "rejected_ids")} for e in examples])
        images = [pixels[e["row"]] for e in examples] * 2
        out["pixel_values"] = torch.cat([p for p, _ in images]).to(dtype)
        out["image_grid_thw"] = torch.cat([g for _, g in images])
        out["mm_token_type_ids"] = (out["input_ids"] == proc.image_token_id).long()  # the processor's: 1 = image
        return out

    args = trl.RewardConfig(output_dir=str(tmp_path / "trl"), bf16=False, use_cpu=True, report_to=[],
                            save_strategy="no", logging_steps=1, dataloader_num_workers=0,
                            gradient_checkpointing=False, remove_unused_columns=False, **hyper)  # keep "row"
    trainer = trl.RewardTrainer(model=hf, args=args, train_dataset=Dataset.from_list(data),
                                processing_class=proc.tokenizer, data_collator=collate)
    trainer.train()
    return {k: v.detach().numpy().copy() for k, v in hf.state_dict().items()}, [e for e in trainer.state.log_history
                                                                               if "loss" in e]


def test_a_vision_run_ends_at_the_references_weights(vision_classifier, tmp_path):
    """Beyond TRL (whose RewardTrainer collates text only): a Qwen3.5 reward model on image rows, against TRL's
    trainer driving transformers' classifier on the same rows tokenised by transformers' processor, in float64 (the
    truth) and float32 (the scale of float32's own error: Adam's first, sign-like step on this tiny Gated DeltaNet
    model spreads rounding by ~1e-3 into the second step). Every logged value and every tensor of the final
    weights, the vision tower's and the score head's included, no further from float64 than twice TRL's float32
    (float32's error of a step: the largest of TRL's float32 deviations; and within 2e-4 / 5e-3 of the update,
    whichever is larger)."""
    hyper = {**HYPER, "max_length": 512, "per_device_train_batch_size": 2, "max_steps": 2}
    rows = vision_reward_rows()
    start = load_file(str(vision_classifier / "model.safetensors"))
    _, ours_log = ours_run(vision_classifier, tmp_path, rows, hyper)
    ours = load_file(str(tmp_path / "ours" / "model.safetensors"))
    f32, log32 = trl_vision_run(vision_classifier, tmp_path / "f32", rows, hyper)
    f64, log64 = trl_vision_run(vision_classifier, tmp_path / "f64", rows, hyper, dtype=torch.float64)
    assert len(ours_log) == len(log64) == hyper["max_steps"]
    for mine, want, single in zip(ours_log, log64, log32, strict=True):
        keys = set(want) & set(KEYS)
        # float32's error at this step: the largest of TRL's float32 deviations, relative to max(|value|, 1)
        eps = max(abs(single[k] - want[k]) / max(abs(want[k]), 1.0) for k in keys)
        for key in keys:
            bound = max(2e-4 * abs(want[key]), 2e-5, 2 * eps * max(abs(want[key]), 1.0))
            assert abs(mine[key] - want[key]) <= bound, (key, mine[key], want[key], single[key])
    checked = 0
    for name, w0 in start.items():
        update = np.linalg.norm(f64[name] - w0)
        if update == 0:
            continue
        gap, gap32 = (np.linalg.norm(w[name].astype(np.float64) - f64[name]) for w in (ours, f32))
        assert gap <= max(5e-3 * update, 2 * gap32), (name, gap / update, gap32 / update)
        checked += 1
    assert checked == len(start)  # the vision tower and the score head trained too
    assert any(k.startswith("model.visual.") for k in start) and "score.weight" in start


def test_a_lora_run_with_the_head_trained_whole_is_trls_and_peft_loads_it(classifier, tmp_path):
    """LoRA with PEFT's SEQ_CLS task type: the adapters and the score head (modules_to_save) trained as TRL trains
    them (logs; merged weights), and PeftModel on transformers' classifier loads our adapter with our scores."""
    import peft
    import transformers

    from mlxrl.models.lora import peft_state

    hyper = {**HYPER, "per_device_train_batch_size": 3, "learning_rate": 1e-2}
    lora = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"])
    start = load_file(str(classifier / "model.safetensors"))
    model, processor = mlxrl.load(classifier)
    args = RewardConfig(output_dir=str(tmp_path / "ours"), compile=False, disable_tqdm=True, save_steps=0,
                        gradient_checkpointing=False, logging_steps=1, **hyper)
    trainer = RewardTrainer(model=model, processing_class=processor, args=args, train_dataset=CONVERSATIONS,
                            peft_config=peft.LoraConfig(task_type="SEQ_CLS", **lora))
    initial = {k: np.array(v) for k, v in peft_state(trainer.model).items()}
    trainer.train()
    ours_log = [e for e in trainer.log_history if "loss" in e]
    theirs, trl_log = trl_run(classifier, tmp_path, CONVERSATIONS, hyper,
                              peft_config=peft.LoraConfig(task_type="SEQ_CLS", **lora), adapters=initial)
    assert_same_logs(ours_log, trl_log, HYPER["max_steps"], KEYS)
    cfg = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())
    assert cfg["task_type"] == "SEQ_CLS" and cfg["modules_to_save"] == ["score"]
    base = transformers.AutoModelForSequenceClassification.from_pretrained(str(classifier), dtype=torch.float32)
    loaded = peft.PeftModel.from_pretrained(base, str(tmp_path / "ours"))
    want = np.array(score_lib.score(trainer.model, ROWS, attention_mask=MASK))
    np.testing.assert_allclose(hf_scores(None, ROWS, model=loaded), want, rtol=1e-4, atol=1e-4)
    merged = {k: v.detach().numpy() for k, v in loaded.merge_and_unload().state_dict().items()}
    moved = [k for k in start if np.linalg.norm(theirs[k] - start[k]) > 0]
    assert len(moved) == 2 * 3 + 1  # q, v and down in both layers, and the head
    for k in moved:
        gap = np.linalg.norm(merged[k].astype(np.float64) - theirs[k])
        assert gap <= 2e-3 * np.linalg.norm(theirs[k] - start[k]), (k, gap)
    # and back into mlxrl: the adapter with its head
    again, _ = mlxrl.load(classifier)
    from mlxrl.models.lora import load_adapter

    load_adapter(again, tmp_path / "ours")
    np.testing.assert_allclose(np.array(score_lib.score(again, ROWS, attention_mask=MASK)), want, rtol=1e-5, atol=1e-5)


@pytest.mark.usefixtures("kernel_path")
def test_lora_from_a_causal_folder_learns_on_both_paths(tiny_checkpoint, tmp_path):
    """A causal checkpoint given by path (TRL's model="..."): a fresh head, compiled, padding-free; the accuracy
    rises and only the adapters and the head move."""
    from mlx.utils import tree_flatten

    args = RewardConfig(output_dir=str(tmp_path / "rm"), use_peft=True, lora_r=8, lora_alpha=16, learning_rate=3e-2,
                        max_steps=25, per_device_train_batch_size=6, logging_steps=1, save_steps=0, disable_tqdm=True,
                        padding_free=True, max_length=128, lr_scheduler_type="constant", warmup_steps=0)
    trainer = RewardTrainer(model=str(tiny_checkpoint("qwen3")), args=args, train_dataset=CONVERSATIONS)
    base = {k: np.array(v) for k, v in tree_flatten(trainer.model.parameters()) if "lora" not in k}
    trainer.train()
    logged = [e for e in trainer.log_history if "loss" in e]
    assert logged[-1]["loss"] < logged[0]["loss"] and logged[-1]["accuracy"] == 1.0
    now = dict(tree_flatten(trainer.model.parameters()))
    for k, v in base.items():
        key = k if k in now else k.replace(".weight", ".linear.weight")
        assert np.array_equal(np.array(now[key]), v) != (k == "score.weight"), k


# ---------------------------------------------------------------------------------------------- refusals

def test_refusals_are_one_line(tiny_checkpoint, classifier, tmp_path):
    args = RewardConfig(output_dir=str(tmp_path / "x"), max_steps=1, disable_tqdm=True)
    causal, processor = mlxrl.load(tiny_checkpoint("qwen3"))
    with pytest.raises(MlxrlError, match="no sequence-classification head"):
        RewardTrainer(causal, processor, args, train_dataset=STRINGS)
    model, processor = mlxrl.load(classifier)
    with pytest.raises(MlxrlError, match="has images but the processor has no image processor"):
        RewardTrainer(model, processor, args, train_dataset=[{**STRINGS[0], "images": ["x.png"]}])
    with pytest.raises(MlxrlError, match="give every row a margin, or none"):
        RewardTrainer(model, processor, args, train_dataset=[STRINGS[0], IMPLICIT[0]])
    with pytest.raises(MlxrlError, match="pad_token '<nope>' is not in the tokenizer"):
        RewardTrainer(model, processor, RewardConfig(output_dir=str(tmp_path / "y"), pad_token="<nope>"),
                      train_dataset=STRINGS)
    with pytest.raises(ValueError, match="lora_modules_to_save"):
        RewardTrainer(model, processor, RewardConfig(output_dir=str(tmp_path / "z"), lora_modules_to_save=["mlp"]),
                      train_dataset=STRINGS)


def test_the_configs_own_fields_have_trls_defaults():
    import dataclasses

    mine = {f.name: f for f in dataclasses.fields(RewardConfig)}
    for f in dataclasses.fields(trl.RewardConfig):
        if f.name in vars(trl.RewardConfig).get("__annotations__", {}):
            assert mine[f.name].default == f.default, f.name
