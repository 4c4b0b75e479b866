"""report_to: W&B and TensorBoard receive the logged metrics (fake tracker modules stand in for the
real packages, which are optional); unknown trackers and missing packages are one-line errors."""

import importlib.machinery
import sys
import types

import pytest

import mlxrl
from mlxrl.trainers.reporting import Reporter
from mlxrl.trainers.sft.config import SFTConfig
from mlxrl.trainers.sft.trainer import SFTTrainer

ROWS = [{"messages": [{"role": "user", "content": f"Say {w}"}, {"role": "assistant", "content": w}]}
        for w in ("hi", "yes", "no", "ok")]


@pytest.fixture
def fake_trackers(monkeypatch):
    calls = {"wandb": [], "tb": [], "init": None, "closed": []}

    class Run:
        def log(self, data, step):
            calls["wandb"].append((step, dict(data)))

        def finish(self):
            calls["closed"].append("wandb")

    wandb = types.ModuleType("wandb")
    wandb.__spec__ = importlib.machinery.ModuleSpec("wandb", None)  # others probe find_spec("wandb")
    wandb.init = lambda **kw: calls.__setitem__("init", kw) or Run()

    class SummaryWriter:
        def __init__(self, log_dir):
            calls["log_dir"] = log_dir

        def add_scalar(self, key, value, step):
            calls["tb"].append((step, key, value))

        def flush(self):
            pass

        def close(self):
            calls["closed"].append("tb")

    tb = types.ModuleType("torch.utils.tensorboard")
    tb.SummaryWriter = SummaryWriter
    tb.__spec__ = importlib.machinery.ModuleSpec("torch.utils.tensorboard", None)
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", tb)
    return calls


def test_trainer_sends_metrics_to_both_trackers(fake_trackers, tiny_checkpoint, tmp_path):
    model, processor = mlxrl.load(tiny_checkpoint("qwen3"))
    args = SFTConfig(output_dir=str(tmp_path), max_steps=2, logging_steps=1, per_device_train_batch_size=2,
                     compile=False, disable_tqdm=True, save_steps=0, gradient_checkpointing=False,
                     report_to="wandb,tensorboard", run_name="probe")
    trainer = SFTTrainer(model, processor, args, train_dataset=ROWS)
    trainer.train()
    history = trainer.log_history
    logged = [e for e in history if "loss" in e]
    assert fake_trackers["init"]["name"] == "probe" and fake_trackers["init"]["config"]["learning_rate"] == 2e-5
    assert [(s, d["train/loss"]) for s, d in fake_trackers["wandb"]] == [(e["step"], e["loss"]) for e in logged]
    tb_loss = [(s, v) for s, k, v in fake_trackers["tb"] if k == "train/loss"]
    assert tb_loss == [(e["step"], e["loss"]) for e in logged]
    assert fake_trackers["log_dir"] == str(tmp_path / "runs")
    assert sorted(fake_trackers["closed"]) == ["tb", "wandb"]


def test_eval_keys_and_bad_names(fake_trackers, tmp_path):
    rep = Reporter(SFTConfig(output_dir=str(tmp_path), report_to="wandb"), tmp_path)
    rep.log({"step": 3, "eval_loss": 1.5, "epoch": 0.5, "note": "x"})
    assert fake_trackers["wandb"] == [(3, {"eval/loss": 1.5, "train/epoch": 0.5})]
    with pytest.raises(ValueError, match="unknown tracker"):
        Reporter(SFTConfig(output_dir=str(tmp_path), report_to="mlflow"), tmp_path)


def test_missing_package_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    with pytest.raises(ValueError, match="pip install wandb"):
        Reporter(SFTConfig(output_dir=str(tmp_path), report_to="wandb"), tmp_path)
