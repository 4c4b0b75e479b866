"""TRL's scripts with only the import changed (issue 49): TRL's quick-start shapes (a model id string,
`peft_config=LoraConfig(...)`, `processing_class=tokenizer`, DPO, GRPO with a reward function) run on mlxrl's
trainers, and what they read back is TRL's (`TrainOutput`, `trainer.state`, `save_model`,
`train(resume_from_checkpoint=True)`); what mlxrl cannot do is one line.

    python -m pytest -q tests/test_trl_api.py
"""

from __future__ import annotations

import json

import pytest
from datasets import Dataset
from transformers import AutoTokenizer, TrainerState
from transformers.trainer_utils import TrainOutput

from mlxrl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer  # was: from trl import ...
from mlxrl.errors import MlxrlError

ROWS = [{"messages": [{"role": "user", "content": f"Count to {i}"},
                      {"role": "assistant", "content": " ".join(str(k) for k in range(1, i + 2))}]} for i in range(8)]
PAIRS = [{"prompt": [{"role": "user", "content": f"Pick {i}"}], "chosen": [{"role": "assistant", "content": "yes"}],
          "rejected": [{"role": "assistant", "content": "no no"}]} for i in range(8)]
QUICK = dict(max_steps=2, logging_steps=1, per_device_train_batch_size=4, disable_tqdm=True, compile=False,
             gradient_checkpointing=False, save_strategy="no")


def test_sft_quick_start_with_a_model_id(tiny_checkpoint, tmp_path):
    trainer = SFTTrainer(model=str(tiny_checkpoint("qwen3")), train_dataset=Dataset.from_list(ROWS),
                         args=SFTConfig(output_dir=str(tmp_path / "out"), max_length=64, **QUICK))
    result = trainer.train()
    assert isinstance(result, TrainOutput) and result.global_step == 2
    assert set(result.metrics) >= {"train_runtime", "train_samples_per_second", "train_steps_per_second",
                                   "train_loss", "epoch"}
    steps = [e for e in trainer.state.log_history if "loss" in e]
    assert [e["step"] for e in steps] == [1, 2]
    assert result.training_loss == pytest.approx(sum(e["loss"] for e in steps) / 2, rel=1e-5)
    assert isinstance(trainer.state, TrainerState) and trainer.state.global_step == 2 and trainer.state.max_steps == 2


def test_sft_with_lora_config_tokenizer_save_model_and_resume(tiny_checkpoint, tmp_path):
    from peft import LoraConfig

    folder = tiny_checkpoint("qwen3")
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    out = tmp_path / "out"
    args = SFTConfig(output_dir=str(out), max_length=64, **{**QUICK, "save_strategy": "steps", "save_steps": 1})
    peft_config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = SFTTrainer(model=str(folder), args=args, train_dataset=Dataset.from_list(ROWS),
                         processing_class=tokenizer, peft_config=peft_config)
    assert trainer.args.use_peft and trainer.args.lora_r == 4 and trainer.args.lora_alpha == 8
    trainer.train()
    trainer.save_model()
    saved = json.loads((out / "adapter_config.json").read_text())
    assert saved["r"] == 4 and saved["lora_alpha"] == 8
    trainer.save_model(str(tmp_path / "elsewhere"))
    assert (tmp_path / "elsewhere" / "adapter_model.safetensors").exists()

    again = SFTTrainer(model=str(folder), args=SFTConfig(output_dir=str(out), max_length=64,
                                                         **{**QUICK, "max_steps": 3}),
                       train_dataset=Dataset.from_list(ROWS), processing_class=tokenizer, peft_config=peft_config)
    result = again.train(resume_from_checkpoint=True)  # the newest checkpoint of output_dir
    assert result.global_step == 3 and [e["step"] for e in again.state.log_history if "loss" in e] == [1, 2, 3]


def test_trl_positional_order_and_formatting_func(tiny_checkpoint, tmp_path):
    rows = [{"question": f"Count to {i}", "answer": " ".join(str(k) for k in range(i + 1))} for i in range(8)]
    trainer = SFTTrainer(str(tiny_checkpoint("qwen3")), SFTConfig(output_dir=str(tmp_path / "o"), max_length=64,
                                                                  **QUICK),
                         train_dataset=rows, formatting_func=lambda r: f"Q: {r['question']}\nA: {r['answer']}")
    assert trainer.train().global_step == 2


def test_dpo_grpo_and_rloo_quick_starts(tiny_checkpoint, tmp_path):
    folder = str(tiny_checkpoint("qwen3"))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    dpo = DPOTrainer(model=folder, args=DPOConfig(output_dir=str(tmp_path / "dpo"), max_length=64, **QUICK),
                     train_dataset=Dataset.from_list(PAIRS), processing_class=tokenizer)
    assert dpo.train().global_step == 2 and any("rewards/margins" in e for e in dpo.state.log_history)

    def reward_len(completions, **kwargs):
        return [-abs(20 - len(c)) for c in completions]

    prompts = Dataset.from_list([{"prompt": f"Say something about {w}"} for w in "abcdefgh"])
    grpo = GRPOTrainer(model=folder, reward_funcs=reward_len, train_dataset=prompts,
                       args=GRPOConfig(output_dir=str(tmp_path / "grpo"), num_generations=4, max_completion_length=8,
                                       **QUICK))
    assert grpo.train().global_step == 2 and any("reward" in e for e in grpo.state.log_history)

    from mlxrl import RLOOConfig, RLOOTrainer  # was: from trl import RLOOConfig, RLOOTrainer

    rloo = RLOOTrainer(model=folder, reward_funcs=reward_len, train_dataset=prompts,
                       args=RLOOConfig(output_dir=str(tmp_path / "rloo"), max_completion_length=8, **QUICK))
    assert rloo.train().global_step == 2 and any("kl" in e for e in rloo.state.log_history)


def test_kto_orpo_cpo_quick_starts_with_peft_config(tiny_checkpoint, tmp_path):
    """TRL's quick starts with the import changed (`from trl import KTOConfig, KTOTrainer`; ORPO / CPO from
    trl.experimental): a model id, processing_class, peft_config, a datasets.Dataset of preference rows (KTO unpairs
    them)."""
    from peft import LoraConfig

    from mlxrl import CPOConfig, CPOTrainer, KTOConfig, KTOTrainer, ORPOConfig, ORPOTrainer

    folder = str(tiny_checkpoint("qwen3"))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    for name, config, trainer, metric in [("kto", KTOConfig, KTOTrainer, "kl"),
                                           ("orpo", ORPOConfig, ORPOTrainer, "log_odds_ratio"),
                                           ("cpo", CPOConfig, CPOTrainer, "nll_loss")]:
        t = trainer(model=folder, args=config(output_dir=str(tmp_path / name), max_length=64, **QUICK),
                    train_dataset=Dataset.from_list(PAIRS), processing_class=tokenizer,
                    peft_config=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM"))
        assert t.train().global_step == 2 and any(metric in e for e in t.state.log_history), name
        assert (tmp_path / name / "adapter_model.safetensors").exists(), name


def test_reward_quick_start_then_grpo_with_the_reward_model_folder(tiny_checkpoint, tmp_path):
    """TRL's RewardTrainer quick start (`from trl import RewardConfig, RewardTrainer`: a causal model id becomes a
    sequence classifier), then TRL's GRPO with the saved reward model folder in reward_funcs beside a function,
    reward_weights applied, each logged under its own name."""
    from mlxrl import RewardConfig, RewardTrainer

    folder = str(tiny_checkpoint("qwen3"))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    out = tmp_path / "reward_model"
    reward = RewardTrainer(model=folder, args=RewardConfig(output_dir=str(out), max_length=64, **QUICK),
                           train_dataset=Dataset.from_list(PAIRS), processing_class=tokenizer)
    assert reward.train().global_step == 2 and any("accuracy" in e for e in reward.state.log_history)
    reward.save_model()
    saved = json.loads((out / "config.json").read_text())
    assert saved["architectures"] == ["Qwen3ForSequenceClassification"] and len(saved["id2label"]) == 1

    def reward_len(completions, **kwargs):
        return [-abs(20 - len(c)) for c in completions]

    prompts = Dataset.from_list([{"prompt": f"Say something about {w}"} for w in "abcdefgh"])
    grpo = GRPOTrainer(model=folder, reward_funcs=[str(out), reward_len], train_dataset=prompts,
                       args=GRPOConfig(output_dir=str(tmp_path / "grpo"), num_generations=4, max_completion_length=8,
                                       reward_weights=[1.0, 0.1], **QUICK))
    assert grpo.train().global_step == 2
    logged = [e for e in grpo.state.log_history if "reward" in e]
    assert logged and all({"rewards/reward_model/mean", "rewards/reward_len/mean"} <= set(e) for e in logged)
    e = logged[0]
    assert e["reward"] == pytest.approx(e["rewards/reward_model/mean"] + 0.1 * e["rewards/reward_len/mean"],
                                        rel=1e-4, abs=1e-5)


def test_what_mlxrl_cannot_do_is_one_line(tiny_checkpoint, tmp_path):
    import torch

    folder = str(tiny_checkpoint("qwen3"))
    args = SFTConfig(output_dir=str(tmp_path / "o"), **QUICK)
    with pytest.raises(MlxrlError, match=r"DPOTrainer\(compute_metrics=...\) is not supported"):
        DPOTrainer(model=folder, args=DPOConfig(output_dir=str(tmp_path / "d"), **QUICK), train_dataset=PAIRS,
                   compute_metrics=lambda p: {})
    with pytest.raises(MlxrlError, match=r"data_collator=...\) is not supported"):
        SFTTrainer(model=folder, args=args, train_dataset=ROWS, data_collator=lambda rows: rows)
    with pytest.raises(MlxrlError, match="a PyTorch model"):
        SFTTrainer(model=torch.nn.Linear(2, 2), args=args, train_dataset=ROWS)
    from peft import LoraConfig

    with pytest.raises(MlxrlError, match="peft_config.use_rslora"):
        SFTTrainer(model=folder, args=args, train_dataset=ROWS, peft_config=LoraConfig(r=4, use_rslora=True))
    with pytest.raises(TypeError, match="unexpected keyword argument 'no_such_thing'"):
        SFTTrainer(model=folder, args=args, train_dataset=ROWS, no_such_thing=1)


@pytest.mark.parametrize("command", ["sft", "dpo", "grpo", "rloo", "generate", "chat", "plan"])
def test_one_console_command(command):
    """`mlxrl CMD ...` (the console script) and `python -m mlxrl CMD ...` are `python -m mlxrl.CMD ...`."""
    import subprocess
    import sys

    want = subprocess.run([sys.executable, "-m", f"mlxrl.{command}", "--help"], capture_output=True, text=True)
    console = subprocess.run([sys.executable, "-c", "import sys; sys.argv = ['mlxrl', *sys.argv[1:]]; "
                              "from mlxrl.cli.main import console; console()", command, "--help"],
                             capture_output=True, text=True)
    module = subprocess.run([sys.executable, "-m", "mlxrl", command, "--help"], capture_output=True, text=True)
    assert want.returncode == console.returncode == module.returncode == 0, (console.stderr, module.stderr)
    assert want.stdout.split("options:")[-1] == console.stdout.split("options:")[-1] == \
        module.stdout.split("options:")[-1]


def _all_training(model) -> bool:
    return all(m.training for _, m in model.named_modules())


@pytest.mark.parametrize("kind", ["sft", "dpo", "grpo"])
def test_a_failed_evaluation_or_generation_leaves_the_model_training(tiny_checkpoint, tmp_path, kind):
    """Dropout stays on for the run: an evaluate() (or GRPO's generation) that raises puts the model back in
    training mode, and train() starts in training mode whatever a script left the model in."""
    folder = str(tiny_checkpoint("qwen3"))
    common = dict(output_dir=str(tmp_path / kind), use_peft=True, lora_r=4, lora_dropout=0.1, **QUICK)
    if kind == "sft":
        trainer = SFTTrainer(model=folder, train_dataset=Dataset.from_list(ROWS), eval_dataset=Dataset.from_list(ROWS),
                             args=SFTConfig(max_length=64, **common))
    elif kind == "dpo":
        trainer = DPOTrainer(model=folder, train_dataset=Dataset.from_list(PAIRS),
                             eval_dataset=Dataset.from_list(PAIRS), args=DPOConfig(max_length=64, **common))
    else:
        trainer = GRPOTrainer(model=folder, reward_funcs=lambda completions, **kw: [1.0] * len(completions),
                              train_dataset=Dataset.from_list([{"prompt": f"Say {i}"} for i in range(8)]),
                              args=GRPOConfig(num_generations=2, max_completion_length=4, **common))
    assert _all_training(trainer.model)

    def boom(*a, **k):
        raise RuntimeError("boom")

    if kind == "grpo":
        trainer.processor = type("Broken", (), {"__call__": boom, "__getattr__": lambda s, n: boom})()
        with pytest.raises(RuntimeError, match="boom"):
            trainer._generate(0)
    else:
        trainer.loss = boom
        with pytest.raises(RuntimeError, match="boom"):
            trainer.evaluate()
    assert _all_training(trainer.model)
    trainer.model.eval()
    if kind != "grpo":
        del trainer.loss  # the trainer's own loss again
        trainer.train()
        assert trainer.state.global_step == 2 and _all_training(trainer.model)


def test_each_trainer_declares_its_identity_and_a_resume_by_another_is_refused(tiny_checkpoint, tmp_path):
    """The engine has no default identity (a trainer that forgot it would resume SFT's checkpoints and get SFT's
    memory plan); each trainer declares its own, its checkpoints record it, and another trainer refuses them."""
    from mlxrl.trainers import engine

    names = [cls.__dict__.get("trainer_name") for cls in (SFTTrainer, DPOTrainer, GRPOTrainer)]
    assert names == ["sft", "dpo", "grpo"]
    assert "trainer_name" not in vars(engine.Trainer)

    class Nameless(engine.Trainer):
        def loss(self, model, batch, normalizer): ...

    with pytest.raises(TypeError, match="declares no trainer_name"):
        Nameless(None, None, SFTConfig(output_dir=str(tmp_path / "x")))
    folder = str(tiny_checkpoint("qwen3"))
    out = tmp_path / "out"
    quick = {**QUICK, "save_strategy": "steps", "save_steps": 1, "max_steps": 1}
    SFTTrainer(model=folder, train_dataset=Dataset.from_list(ROWS),
               args=SFTConfig(output_dir=str(out), max_length=64, use_peft=True, **quick)).train()
    state = json.loads((out / "checkpoint-1" / "trainer_state.json").read_text())
    assert state["mlxrl"]["trainer"] == "sft"
    dpo = DPOTrainer(model=folder, train_dataset=Dataset.from_list(PAIRS),
                     args=DPOConfig(output_dir=str(out), max_length=64, use_peft=True, **quick))
    with pytest.raises(MlxrlError, match="is a SFT checkpoint and this is a DPO run"):
        dpo.train(resume_from_checkpoint=str(out / "checkpoint-1"))
