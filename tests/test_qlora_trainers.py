"""DPO and GRPO over a 4-bit base through the Python API (`load_in_4bit=True`): the trainer quantizes the
frozen base before adding LoRA, the reference is the same model with its adapters off (no second copy),
GRPO generates on the quantized model, only the adapters move and DPO's preference metric improves.

    python -m pytest -q tests/test_qlora_trainers.py
"""

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

import mlxrl
from mlxrl.models import quantize as quantize_lib
from mlxrl.trainers.dpo.config import DPOConfig
from mlxrl.trainers.dpo.trainer import DPOTrainer
from mlxrl.trainers.grpo.trainer import GRPOConfig, GRPOTrainer

COMMON = dict(use_peft=True, load_in_4bit=True, lora_r=8, lora_alpha=16, compile=False, disable_tqdm=True,
              logging_steps=1, save_steps=0, gradient_checkpointing=False, seed=0)


def _frozen(model):
    return {k: np.array(v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating) else v)
            for k, v in tree_flatten(model.parameters()) if "lora_" not in k}


def _adapters(model):
    return {k: np.array(v) for k, v in tree_flatten(model.trainable_parameters())}


def test_dpo_over_a_4bit_base_learns_the_preference(tiny_checkpoint, tmp_path):
    model, processor = mlxrl.load(tiny_checkpoint("qwen3"), dtype="float32")
    rows = [{"prompt": f"Pick {i}:", "chosen": " yes", "rejected": " no"} for i in range(8)]
    args = DPOConfig(output_dir=str(tmp_path / "dpo"), learning_rate=5e-3, max_steps=12,
                     per_device_train_batch_size=4, max_length=32, **COMMON)
    trainer = DPOTrainer(model, processor, args, train_dataset=rows)
    assert trainer.ref_model is None  # the reference is the policy with its adapters off
    layers = quantize_lib.quantized_layers(model)
    assert layers and all(m.bits == 4 for _, m in layers)
    base, adapters = _frozen(model), _adapters(model)
    trainer.train()
    history = [h for h in trainer.log_history if "loss" in h]
    assert history[-1]["rewards/margins"] > history[0]["rewards/margins"] + 1.0  # measured 0 -> 2.2
    assert history[-1]["loss"] < history[0]["loss"]
    after = _frozen(model)
    assert all(np.array_equal(base[k], after[k]) for k in base)  # the quantized base never moves
    assert any(not np.array_equal(v, _adapters(model)[k]) for k, v in adapters.items())


def test_grpo_over_a_4bit_base_generates_on_the_quantized_model(tiny_checkpoint, tmp_path):
    model, processor = mlxrl.load(tiny_checkpoint("qwen3"), dtype="float32")
    seen = []

    def reward(prompts, completions, completion_ids, **kwargs):
        seen.append(bool(quantize_lib.quantized_layers(model)))  # generation ran on the quantized base
        return [float(sum(ids) % 7) for ids in completion_ids]

    rows = [{"prompt": f"Say something {i}:"} for i in range(4)]
    args = GRPOConfig(output_dir=str(tmp_path / "grpo"), learning_rate=5e-3, max_steps=2, num_generations=4,
                      per_device_train_batch_size=4, max_completion_length=6, beta=0.04, **COMMON)
    trainer = GRPOTrainer(model, processor, args, train_dataset=rows, reward_funcs=reward)
    base, adapters = _frozen(model), _adapters(model)
    trainer.train()
    history = [h for h in trainer.log_history if "loss" in h]
    assert seen and all(seen) and len(history) == 2
    assert all(np.isfinite([h["loss"], h["kl"]]).all() for h in history)
    after = _frozen(model)
    assert all(np.array_equal(base[k], after[k]) for k in base)
    assert any(not np.array_equal(v, _adapters(model)[k]) for k, v in adapters.items())


@pytest.mark.parametrize("name", ["kto", "orpo", "cpo", "reward", "rloo"])
def test_the_other_trainers_over_a_4bit_base(tiny_checkpoint, tmp_path, name):
    """KTO, ORPO, CPO, the reward model (its float score head trained whole beside the adapters) and RLOO: the base
    quantized to 4 bits before LoRA, never moving; the adapters move; the preference trainers' loss falls."""
    from mlxrl import registry

    model, processor = mlxrl.load(tiny_checkpoint("qwen3"), dtype="float32",
                                  **({"num_labels": 1} if name == "reward" else {}))
    if name == "rloo":
        rows = [{"prompt": f"Say {i}"} for i in range(8)]
        extra = dict(reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions])
        fields = dict(num_generations=4, per_device_train_batch_size=4, max_completion_length=4, max_steps=2)
    else:
        rows = [{"prompt": f"Pick {i}:", "chosen": " yes", "rejected": " no"} for i in range(8)]
        extra = {}
        fields = dict(per_device_train_batch_size=4, max_length=32, max_steps=8, learning_rate=5e-3)
    args = registry.config_class(name)(output_dir=str(tmp_path / name), **fields, **COMMON)
    trainer = registry.trainer_class(name)(model, processor, args, train_dataset=rows, **extra)
    layers = quantize_lib.quantized_layers(model)
    assert layers and all(m.bits == 4 for _, m in layers)
    base, adapters = _frozen(model), _adapters(model)
    trainer.train()
    after = _frozen(model)
    moved = {k for k in base if not np.array_equal(base[k], after[k])}
    assert moved <= ({"score.weight"} if name == "reward" else set()), sorted(moved)
    assert any(not np.array_equal(v, _adapters(model)[k]) for k, v in adapters.items())
    history = [h for h in trainer.log_history if "loss" in h]
    if name != "rloo":
        assert history[-1]["loss"] < history[0]["loss"], [h["loss"] for h in history]
