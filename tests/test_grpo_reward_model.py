"""A reward model as one of GRPO's reward functions, against TRL 1.16's own GRPOTrainer: the rewards its
`_calculate_rewards` gives a reward model folder (a transformers sequence classifier, its tokenizer, TRL's chat
rendering and right padding) mixed with a function, conversational and plain prompts; the folder, a Hub-style id
and a model mlxrl loaded as entries; the weighted reward and the per-function logs of a generation round.

    python -m pytest -q tests/test_grpo_reward_model.py
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from test_reward import classifier  # noqa: F401  (the reward model folder transformers wrote)

import mlxrl
from mlxrl import GRPOConfig, GRPOTrainer
from mlxrl.trainers.grpo.rewards import RewardModel

trl = pytest.importorskip("trl")
torch = pytest.importorskip("torch")
warnings.filterwarnings("ignore")

PROMPTS = ["The sky is", "One plus one is"]
COMPLETIONS = [" blue.", " a colour that changes at dusk", " two", " eleven, or maybe three"]


def chars(prompts, completions, **kwargs):
    return [float(len(c if isinstance(c, str) else c[0]["content"])) for c in completions]


def _texts(conversational):
    prompts = [p for p in PROMPTS for _ in range(2)]
    if conversational:
        return ([[{"role": "user", "content": p}] for p in prompts],
                [[{"role": "assistant", "content": c}] for c in COMPLETIONS])
    return prompts, list(COMPLETIONS)


def trl_rewards(folder, policy, prompts, completions, tmp_path):
    """TRL's GRPOTrainer built on the reward model folder and `chars`, its own _calculate_rewards."""
    from datasets import Dataset

    args = trl.GRPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=4, num_generations=2,
                          max_completion_length=8, report_to="none", use_cpu=True, bf16=False)
    trainer = trl.GRPOTrainer(model=str(policy), reward_funcs=[str(folder), chars], args=args,
                              train_dataset=Dataset.from_list([{"prompt": p} for p in PROMPTS]))
    inputs = [{"prompt": p} for p in prompts]
    ids = [[1, 2]] * len(prompts)
    return trainer._calculate_rewards(inputs, prompts, completions, ids).numpy(), trainer.reward_func_names


@pytest.mark.parametrize("conversational", [True, False])
def test_a_reward_model_folder_scores_as_trls_grpo(classifier, tiny_checkpoint, tmp_path, conversational):  # noqa: F811
    policy = tiny_checkpoint("qwen3")
    prompts, completions = _texts(conversational)
    want, trl_names = trl_rewards(classifier, policy, prompts, completions, tmp_path)
    model, processor = mlxrl.load(policy)
    args = GRPOConfig(output_dir=str(tmp_path / "ours"), per_device_train_batch_size=4, num_generations=2,
                      max_completion_length=8, disable_tqdm=True, compile=False)
    rows = [{"prompt": p} for p in PROMPTS]
    trainer = GRPOTrainer(model, processor, args, train_dataset=rows, reward_funcs=[str(classifier), chars])
    assert trainer.reward_func_names == trl_names
    got = trainer.score(prompts, completions, [[1, 2]] * len(prompts), {})
    assert np.abs(got - want).max() < 1e-4 * max(1.0, np.abs(want).max()), (got, want)
    assert np.ptp(got[:, 0]) > 1e-3  # the completions' scores differ: the padding and the positions matter

    loaded, _ = mlxrl.load(classifier, num_labels=1)  # a model mlxrl loaded, its tokenizer read from its folder
    again = GRPOTrainer(model, processor, args, train_dataset=rows, reward_funcs=loaded)
    assert np.abs(again.score(prompts, completions, [[1, 2]] * len(prompts), {})[:, 0] - want[:, 0]).max() < 1e-4


def test_batched_scoring_is_the_whole_batchs(classifier):  # noqa: F811
    model, processor = mlxrl.load(classifier, num_labels=1)
    prompts, completions = _texts(True)
    whole = RewardModel(model, processor, batch_size=64)(prompts, completions)
    ones = RewardModel(model, processor, batch_size=1)(prompts, completions)
    assert np.abs(np.array(whole) - np.array(ones)).max() < 1e-5


def test_a_generation_round_weights_and_logs_the_reward_model(classifier, tiny_checkpoint, tmp_path):  # noqa: F811
    model, processor = mlxrl.load(tiny_checkpoint("qwen3"))
    seen = {}

    def spy(prompts, completions, **kwargs):
        seen.update(prompts=prompts, completions=completions)
        return chars(prompts, completions)

    args = GRPOConfig(output_dir=str(tmp_path / "run"), per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=6, disable_tqdm=True, compile=False, gradient_checkpointing=False,
                      save_steps=0, seed=0, reward_weights=[2.0, -0.5])
    trainer = GRPOTrainer(model, processor, args, train_dataset=[{"prompt": p} for p in PROMPTS * 2],
                          reward_funcs=[str(classifier), spy])
    _, metrics = trainer.generate_round(0)
    rm, rm_processor = mlxrl.load(classifier, num_labels=1)
    scores = np.array(RewardModel(rm, rm_processor)(seen["prompts"], seen["completions"]))
    name = classifier.name
    assert abs(metrics[f"rewards/{name}/mean"] - scores.mean()) < 1e-4
    total = 2.0 * scores - 0.5 * np.array(chars(seen["prompts"], seen["completions"]))
    assert abs(metrics["reward"] - total.mean()) < 1e-3


def test_a_reward_model_entry_that_is_not_a_classifier_is_one_line(tiny_checkpoint, tmp_path):
    from mlxrl.errors import MlxrlError

    model, processor = mlxrl.load(tiny_checkpoint("qwen3"))
    args = GRPOConfig(output_dir=str(tmp_path / "x"), per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=6)
    with pytest.raises(MlxrlError, match="must be a sequence classifier"):
        RewardModel(model, processor)
    with pytest.raises(MlxrlError, match="is not module:function, and as a reward model: no such local path"):
        GRPOTrainer(model, processor, args, train_dataset=[{"prompt": "a"}] * 4,
                    reward_funcs=[str(tmp_path / "missing_reward_model")])


def test_a_lora_reward_runs_adapter_folder_scores_as_peft(tiny_checkpoint, tmp_path):
    """A LoRA reward run's output (a PEFT SEQ_CLS adapter, the head in modules_to_save) as a reward_funcs entry:
    its rewards are those of transformers' classifier with PEFT loading the adapter."""
    import transformers
    from peft import PeftModel

    from mlxrl import RewardConfig, RewardTrainer
    from mlxrl.trainers.grpo.rewards import reward_entry

    base = tiny_checkpoint("qwen3")
    pairs = [{"prompt": [{"role": "user", "content": p}], "chosen": [{"role": "assistant", "content": "Yes."}],
              "rejected": [{"role": "assistant", "content": "No, never."}]} for p in PROMPTS * 2]
    out = tmp_path / "rm"
    RewardTrainer(str(base), args=RewardConfig(output_dir=str(out), max_steps=2, use_peft=True, learning_rate=1e-2,
                                               compile=False, disable_tqdm=True, save_strategy="no",
                                               per_device_train_batch_size=2),
                  train_dataset=pairs).train()
    assert (out / "adapter_config.json").exists()
    prompts, completions = _texts(True)
    ours = np.array(reward_entry(str(out))(prompts, completions))

    tok = transformers.AutoTokenizer.from_pretrained(str(base))
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(str(base), num_labels=1,
                                                                         dtype=torch.float32)
    hf.config.pad_token_id = tok.pad_token_id
    hf = PeftModel.from_pretrained(hf, str(out)).eval()
    texts = [tok.apply_chat_template(p + c, tokenize=False) for p, c in zip(prompts, completions, strict=True)]
    enc = tok(texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False)
    with torch.no_grad():
        want = hf(**enc).logits[:, 0].numpy()
    assert np.abs(ours - want).max() < 1e-4 * max(1.0, np.abs(want).max()), (ours, want)
