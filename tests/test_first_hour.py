"""What a new user meets in the first hour (issue 49): the result where TRL puts it (the final model or
adapter in output_dir itself, beside checkpoint-N), a rerun that never leaves two runs mixed in one
folder, a save interrupted between its renames refused on load, the one line before the slow first
steps and a time left from steady steps only, the run's picture, and TRL's dict of named evaluation
sets.

    python -m pytest -q tests/test_first_hour.py
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from PIL import Image

import mlxrl
from mlxrl import SFTConfig, SFTTrainer
from mlxrl.atomic import MARKER
from mlxrl.cli.sft import main as sft_main
from mlxrl.errors import MlxrlError
from mlxrl.trainers import plot
from mlxrl.trainers.progress import SteadyEta, eta_text

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
ROWS = [{"messages": [{"role": "user", "content": f"Say {i} words"},
                      {"role": "assistant", "content": " ".join(WORDS[i % 5: i % 5 + 2 + i % 4])}]} for i in range(12)]


@pytest.fixture
def sft(tiny_checkpoint, tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))

    def run(*flags):
        return sft_main(["--model", str(tiny_checkpoint("qwen3")), "--dataset", str(data), "--max_length", "64",
                         "--disable_tqdm", "true", "--compile", "false", "--gradient_checkpointing", "false",
                         "--per_device_train_batch_size", "2", "--logging_steps", "1", *map(str, flags)])

    return run


def top(folder) -> set[str]:
    return {p.name for p in folder.iterdir()}


def test_the_final_model_is_in_output_dir_and_transformers_loads_it(sft, tiny_checkpoint, tmp_path, capsys):
    import torch
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    assert sft("--output_dir", out, "--max_steps", 2, "--save_steps", 1, "--save_total_limit", 5) == 0
    assert {"config.json", "model.safetensors", "tokenizer.json", "checkpoint-1", "checkpoint-2", "metrics.jsonl",
            "run.png", MARKER} <= top(out)
    assert not (out / "model").exists()
    ours, _ = mlxrl.load(out)
    torch_model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    tokens = [[1, 5, 9, 14, 3]]
    with torch.no_grad():
        want = torch_model(torch.tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(np.array(ours(mx.array(tokens))), want, atol=2e-4, rtol=2e-4)
    before = dict(tree_flatten(mlxrl.load(tiny_checkpoint("qwen3"))[0].parameters()))
    assert any(not np.array_equal(np.array(v), np.array(before[k])) for k, v in tree_flatten(ours.parameters()))
    # generate finds the result from the run's folder
    from mlxrl.generation.refs import resolve
    assert resolve(out) == ("model", out)


def test_a_rerun_never_leaves_two_runs_mixed(sft, tmp_path):
    out = tmp_path / "out"
    assert sft("--output_dir", out, "--max_steps", 2, "--save_steps", 1, "--use_peft", "true") == 0
    assert {"adapter_model.safetensors", "adapter_config.json", "checkpoint-2"} <= top(out)
    first_metrics = (out / "metrics.jsonl").read_text()
    # full fine-tuning into the same folder, starting over: no adapter, no checkpoint of the first run is left
    assert sft("--output_dir", out, "--max_steps", 1, "--save_steps", 0, "--overwrite_output_dir", "true") == 0
    names = top(out)
    assert "adapter_model.safetensors" not in names and "adapter_config.json" not in names
    assert not any(n.startswith("checkpoint-") for n in names) and "model.safetensors" in names
    assert (out / "metrics.jsonl").read_text() != first_metrics
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 1
    # and back to LoRA: the full model's weights and config go
    assert sft("--output_dir", out, "--max_steps", 1, "--save_steps", 0, "--overwrite_output_dir", "true",
               "--use_peft", "true") == 0
    names = top(out)
    assert "model.safetensors" not in names and "config.json" not in names and "adapter_model.safetensors" in names
    assert json.loads((out / MARKER).read_text())["kind"] == "adapter"


def test_a_users_file_where_the_final_model_goes_is_refused_before_training(sft, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text('{"mine": true}')
    assert sft("--output_dir", out, "--max_steps", 1) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "holds config.json, which mlxrl did not write" in err
    assert top(out) == {"config.json"} and (out / "config.json").read_text() == '{"mine": true}'


def test_saving_into_a_folder_replaces_the_previous_save_whole(tmp_path):
    model, processor = mlxrl.load_default(seed=0)
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    mlxrl.save(model, processor, out, into=True, max_shard_size=200_000)
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 1 and (out / "model.safetensors.index.json").exists()
    mlxrl.save(model, processor, out, into=True)  # one file now: the shards of the first save are gone
    assert not list(out.glob("model-*.safetensors")) and not (out / "model.safetensors.index.json").exists()
    assert (out / "notes.txt").read_text() == "mine"
    reloaded, _ = mlxrl.load(out)
    want, got = dict(tree_flatten(model.parameters())), dict(tree_flatten(reloaded.parameters()))
    assert want.keys() == got.keys()
    for k in want:
        np.testing.assert_array_equal(np.array(got[k]), np.array(want[k]), err_msg=k)
    # a save killed between its renames: its marker says partial, and loading it is one clear line
    marker = json.loads((out / MARKER).read_text())
    (out / MARKER).write_text(json.dumps({**marker, "partial": True}))
    with pytest.raises(MlxrlError, match="was interrupted"):
        mlxrl.load(out)


def test_the_eta_counts_steady_steps_only():
    now = [0.0]
    eta = SteadyEta(total=10, done=0, clock=lambda: now[0])
    eta.start()
    now[0] = 30.0  # the first step compiles: 30 s
    eta.step(fresh=True)
    assert eta.seconds_left() is None
    for _ in range(3):  # steady steps of 2 s
        now[0] += 2.0
        eta.step(fresh=False)
    now[0] += 25.0  # a new batch shape compiles again
    eta.step(fresh=True)
    assert eta.seconds_left() == pytest.approx(2.0 * 5)
    assert eta_text(3725) == "1h02m" and eta_text(75) == "1m15s" and eta_text(9) == "9s"


def test_the_first_steps_are_announced_and_the_bar_shows_our_eta(sft, tmp_path, capsys):
    out = tmp_path / "out"
    assert sft("--output_dir", out, "--max_steps", 3, "--save_steps", 0, "--disable_tqdm", "false") == 0
    captured = capsys.readouterr()
    assert sum("the first steps are slow" in line for line in captured.out.splitlines()) == 1
    assert "eta " in captured.err and "remaining" not in captured.err


def test_the_runs_picture_is_what_metrics_jsonl_holds(sft, tmp_path):
    out = tmp_path / "out"
    assert sft("--output_dir", out, "--max_steps", 4, "--save_steps", 2, "--eval_dataset", tmp_path / "rows.jsonl",
               "--eval_strategy", "steps", "--eval_steps", 2) == 0
    with Image.open(out / "run.png") as image:
        assert image.format == "PNG" and image.size[0] > image.size[1] > 100
    history = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    drawn = plot.series(history)
    assert drawn["loss"] == ([1, 2, 3, 4], [e["loss"] for e in history if "loss" in e])
    assert drawn["eval_loss"][0] == [2, 4] and "learning_rate" in drawn
    assert plot.draw([], tmp_path / "empty.png") is False and not (tmp_path / "empty.png").exists()


def test_a_png_mlxrl_did_not_draw_is_left_alone(sft, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "run.png").write_bytes(b"mine")
    assert sft("--output_dir", out, "--max_steps", 1) == 0
    assert (out / "run.png").read_bytes() == b"mine"
    assert "is not mlxrl's" in capsys.readouterr().out


def test_eval_dataset_as_a_dict_of_named_sets(tiny_checkpoint, tmp_path):
    args = SFTConfig(output_dir=str(tmp_path / "out"), max_length=64, max_steps=2, per_device_train_batch_size=4,
                     disable_tqdm=True, compile=False, gradient_checkpointing=False, save_strategy="no",
                     eval_strategy="steps", eval_steps=2, logging_steps=1)
    sets = {"short": ROWS[:4], "long": ROWS[4:]}
    trainer = SFTTrainer(model=str(tiny_checkpoint("qwen3")), args=args, train_dataset=ROWS, eval_dataset=sets)
    trainer.train()
    logged = {k for e in trainer.state.log_history for k in e}
    assert {"eval_short_loss", "eval_long_loss", "eval_short_runtime"} <= logged
    metrics = trainer.evaluate()
    # each named set's loss is the loss of that set evaluated alone
    for name, rows in sets.items():
        alone = trainer.evaluate(eval_dataset=rows)
        assert metrics[f"eval_{name}_loss"] == pytest.approx(alone["eval_loss"], rel=1e-6)
    assert abs(metrics["eval_short_loss"] - metrics["eval_long_loss"]) > 1e-4  # two sets, two losses
    assert set(trainer.evaluate(eval_dataset={"x": ROWS[:2]}, metric_key_prefix="test")) == {"test_x_loss",
                                                                                             "test_x_runtime"}
