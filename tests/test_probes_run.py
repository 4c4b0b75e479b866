"""The run folder's promises (issue 48, an outside tester's probes): what a resume, an overwrite, a second
run and a damaged checkpoint may and may not do to what a user has. Each case reproduces a probe that lost
or corrupted data (or ended in a traceback) before the run folder had a lock, a record and a run identity;
every CLI case runs the real `main()` in-process with a tiny model.

    python -m pytest -q tests/test_probes_run.py
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mlxrl.cli.sft import main as sft_main
from mlxrl.data import load_rows
from mlxrl.trainers.run_dir import RECORD, resolve_checkpoint

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
ROWS = [{"messages": [{"role": "user", "content": f"Say {i} words"},
                      {"role": "assistant", "content": " ".join(WORDS[i % 5: i % 5 + 2 + i % 4])}]} for i in range(12)]


def listing(folder: Path) -> dict:
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else None) for p in sorted(folder.rglob("*"))}


def one_line_error(capsys) -> str:
    err = [x for x in capsys.readouterr().err.strip().splitlines() if not x.startswith("note: ")]
    assert len(err) == 1 and err[0].startswith("error: ") and "Traceback" not in err[0], err
    return err[0]


def write_rows(path: Path, rows=ROWS) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def sft(tiny_checkpoint, tmp_path):
    """sft(*flags, model=..., data=...) -> exit code of `python -m mlxrl.sft` on the tiny Qwen3 and 12 rows."""
    data = write_rows(tmp_path / "rows.jsonl")
    qwen3 = tiny_checkpoint("qwen3")  # built here, not inside a test whose stderr is read

    def run(*flags, model=None, dataset=None):
        return sft_main(["--model", str(model or qwen3), "--dataset", str(dataset or data),
                         "--max_length", "64", "--disable_tqdm", "true", "--compile", "false",
                         "--gradient_checkpointing", "false", "--per_device_train_batch_size", "2",
                         "--logging_steps", "1", *map(str, flags)])

    return run


def steps_and_runs(out: Path) -> dict:
    """checkpoint name -> the run id in its trainer_state.json."""
    return {p.name: json.loads((p / "trainer_state.json").read_text())["run_id"]
            for p in sorted(out.glob("checkpoint-*"))}


# ------------------------------------------------------------------------------------------ data loss

def test_resuming_an_earlier_checkpoint_keeps_the_new_runs_checkpoints(sft, tmp_path, capsys):
    out = tmp_path / "o"
    assert sft("--use_peft", "true", "--save_steps", 1, "--max_steps", 6, "--output_dir", out) == 0
    first = steps_and_runs(out)
    assert sft("--use_peft", "true", "--save_steps", 1, "--max_steps", 4, "--output_dir", out,
               "--resume_from_checkpoint", out / "checkpoint-2", "--save_total_limit", 2) == 0
    after = steps_and_runs(out)
    new_id = after["checkpoint-4"]
    # rotation kept this run's two newest; the abandoned run's checkpoints it did not replace are untouched
    assert after["checkpoint-3"] == new_id and new_id != first["checkpoint-2"]
    assert {k for k, v in after.items() if v == new_id} == {"checkpoint-3", "checkpoint-4"}
    assert {k: v for k, v in after.items() if v != new_id} == {k: first[k] for k in ("checkpoint-1", "checkpoint-2",
                                                                                    "checkpoint-5", "checkpoint-6")}
    assert resolve_checkpoint(out, "last").name == "checkpoint-4"  # `last` continues this run, not the old one
    assert "an earlier checkpoint of a run that went on to checkpoint-6" in capsys.readouterr().out
    assert sft("--use_peft", "true", "--save_steps", 1, "--max_steps", 5, "--output_dir", out,
               "--resume_from_checkpoint", "last") == 0
    assert "resumed from" in capsys.readouterr().out and steps_and_runs(out)["checkpoint-5"] == new_id


def test_output_dir_holding_the_model_is_refused(sft, tmp_path, capsys):
    out = tmp_path / "o"
    assert sft("--output_dir", out, "--max_steps", 1, "--save_steps", 0) == 0
    saved = listing(out)
    capsys.readouterr()
    for extra in ((), ("--overwrite_output_dir", "true")):
        assert sft("--output_dir", out, "--max_steps", 1, *extra, model=out) == 2  # the model's own folder
        assert "holds the model being trained" in one_line_error(capsys)
    assert sft("--output_dir", out.parent, "--max_steps", 1, model=out) == 2  # a folder above it
    assert "holds the model being trained" in one_line_error(capsys)
    assert listing(out) == saved


def test_a_second_run_into_a_locked_output_dir_is_refused(sft, tmp_path, capsys):
    out = tmp_path / "o"
    out.mkdir()
    # another process holds the folder's lock, as a running mlxrl run does
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys, time\n"
                               f"fd = os.open({str(out)!r}, os.O_RDONLY)\nfcntl.flock(fd, fcntl.LOCK_EX)\n"
                               "print('locked', flush=True)\ntime.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert sft("--output_dir", out, "--max_steps", 1, "--use_peft", "true") == 2
        assert "is being written by another mlxrl run" in one_line_error(capsys)
        assert os.listdir(out) == []
    finally:
        holder.kill()
        holder.wait()
    t0 = time.time()
    assert sft("--output_dir", out, "--max_steps", 1, "--use_peft", "true") == 0  # the lock died with its process
    assert time.time() - t0 < 120


def test_two_trainers_in_one_process_cannot_write_one_folder(tiny_checkpoint, tmp_path):
    import mlxrl
    from mlxrl.errors import MlxrlError
    from mlxrl.trainers.run_dir import RunLock
    from mlxrl.trainers.sft.config import SFTConfig
    from mlxrl.trainers.sft.trainer import SFTTrainer

    out = tmp_path / "o"
    out.mkdir()
    model, processor = mlxrl.load(tiny_checkpoint("qwen3"))
    args = SFTConfig(output_dir=str(out), max_steps=1, max_length=64, compile=False, disable_tqdm=True,
                     gradient_checkpointing=False, use_peft=True)
    trainer = SFTTrainer(model, processor, args, train_dataset=ROWS)
    lock = RunLock(out).acquire()  # as the first trainer's train() holds it
    try:
        with pytest.raises(MlxrlError, match="being written by another mlxrl run"):
            trainer.train()
    finally:
        lock.release()
    trainer.train()
    assert json.loads((out / RECORD).read_text())["run_id"] == trainer.run_id


def test_dataset_subfolders_are_read_or_named(tmp_path, capsys):
    data = tmp_path / "data"
    (data / "more").mkdir(parents=True)
    write_rows(data / "a.jsonl")
    write_rows(data / "more" / "b.jsonl")
    (data / "more" / "config.json").write_text('{"note": "describes the data"}')  # a dataset's own config file
    assert len(load_rows(data)) == 24  # every row, not 12
    assert "more/config.json" in capsys.readouterr().err
    (data / "model").mkdir()
    (data / "model" / "model.safetensors").write_bytes(b"")
    (data / "model" / "tokenizer.json").write_text("{}")
    assert len(load_rows(data)) == 24
    assert "skipped" in (err := capsys.readouterr().err) and "model/ (a saved model" in err


def test_overwrite_never_deletes_a_metrics_file_mlxrl_did_not_write(sft, tmp_path, capsys):
    out = tmp_path / "o"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"my": "own results"}\n')
    for extra in ((), ("--overwrite_output_dir", "true")):
        assert sft("--output_dir", out, "--max_steps", 1, "--use_peft", "true", *extra) == 2
        assert "metrics.jsonl, which no mlxrl run wrote" in one_line_error(capsys)
    assert (out / "metrics.jsonl").read_text() == '{"my": "own results"}\n'
    other = tmp_path / "p"  # one of ours is deleted by an overwrite, as promised
    assert sft("--output_dir", other, "--max_steps", 2, "--use_peft", "true") == 0
    assert sft("--output_dir", other, "--max_steps", 1, "--use_peft", "true", "--overwrite_output_dir", "true") == 0
    assert len((other / "metrics.jsonl").read_text().splitlines()) == 1


@pytest.mark.parametrize("entry", ["../victim.txt", "", 5])
@pytest.mark.parametrize("record", [RECORD, "mlxrl_save.json"])
def test_a_record_listing_anything_but_a_plain_name_is_refused(sft, tmp_path, capsys, record, entry):
    """mlxrl_run.json's and mlxrl_save.json's lists name what an overwrite deletes: a path out of the folder, the
    folder itself ("") or a number is one line naming the record and the entry, and nothing is deleted."""
    out = tmp_path / "o"
    out.mkdir()
    (tmp_path / "victim.txt").write_text("mine")
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    run = {"saved_by": "mlxrl", "run_id": "x", "pid": 1, "files": ["metrics.jsonl"]}
    if record == RECORD:
        run["files"].append(entry)
    else:  # an earlier run's final adapter save
        (out / "adapter_config.json").write_text("{}")
        (out / record).write_text(json.dumps({"saved_by": "mlxrl", "kind": "adapter",
                                              "files": ["adapter_config.json", entry]}))
    (out / RECORD).write_text(json.dumps(run))
    before = listing(tmp_path)
    assert sft("--output_dir", out, "--max_steps", 1, "--use_peft", "true", "--overwrite_output_dir", "true") == 2
    line = one_line_error(capsys)
    assert f"{out / record} is damaged: its \"files\" list holds {json.dumps(entry)}" in line, line
    assert f"delete {out / record}" in line, line
    assert listing(tmp_path) == before


@pytest.mark.parametrize("field,value,words", [
    ("batch_in_epoch", -5, "batch_in_epoch -5, which must be a whole number >= 0"),
    ("log_history", "oops", "log_history \"oops\", which must be a list of objects"),
    ("global_step", "3", "global_step \"3\", which must be a whole number"),
    ("epoch", None, "epoch null, which must be a whole number"),
    ("mlxrl.model_config", "x", "mlxrl.model_config \"x\", which must be an object"),
    ("batch_in_epoch", 500, "data position \\(batch 500 of epoch 0\\) is past the end"),
])
def test_a_damaged_trainer_state_is_one_line(sft, tmp_path, capsys, field, value, words):
    import re

    out = tmp_path / "o"
    assert sft("--output_dir", out, "--max_steps", 2, "--save_steps", 2, "--use_peft", "true") == 0
    state_file = out / "checkpoint-2" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    where = state["mlxrl"] if field.startswith("mlxrl.") else state
    where[field.split(".")[-1]] = value
    state_file.write_text(json.dumps(state))
    metrics = (out / "metrics.jsonl").read_bytes()
    capsys.readouterr()
    assert sft("--output_dir", out, "--max_steps", 3, "--use_peft", "true", "--resume_from_checkpoint", "last") == 2
    line = one_line_error(capsys)
    assert re.search(words, line) and "trainer_state.json" in line, line
    assert (out / "metrics.jsonl").read_bytes() == metrics  # nothing rewritten


def test_resuming_on_other_data_or_another_order_is_refused(sft, tmp_path, capsys):
    out = tmp_path / "o"
    base = ("--output_dir", out, "--use_peft", "true", "--save_steps", 2)
    assert sft(*base, "--max_steps", 2) == 0
    other = write_rows(tmp_path / "other.jsonl", ROWS[::-1])
    capsys.readouterr()
    assert sft(*base, "--max_steps", 3, "--resume_from_checkpoint", "last", dataset=other) == 2
    assert "trained on other rows than this run's dataset" in one_line_error(capsys)
    assert sft(*base, "--max_steps", 3, "--resume_from_checkpoint", "last", "--seed", 7) == 2
    assert "data order seed 42 and this run's is 7: resume with --seed 42" in one_line_error(capsys)
    # TrainingArguments' ignore_data_skip: the new rows from their first batch
    assert sft(*base, "--max_steps", 3, "--resume_from_checkpoint", "last", "--ignore_data_skip", "true",
               dataset=other) == 0
    state = json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["global_step"] == 2 and state["epoch"] == 0


def test_empty_output_dir_and_the_current_folder_are_refused(sft, tmp_path, capsys, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("mine")
    monkeypatch.chdir(work)
    for out, words in (("", "--output_dir is empty"), (".", "is the current folder"),
                       ("..", "a folder above the current one")):
        assert sft("--output_dir", out, "--max_steps", 1, "--use_peft", "true") == 2
        assert words in one_line_error(capsys)
    assert sorted(os.listdir(work)) == ["notes.txt"]


def test_output_dir_equal_to_the_dataset_folder_is_one_clear_line(sft, tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    write_rows(data / "rows.jsonl")
    assert sft("--output_dir", data, "--max_steps", 1, "--use_peft", "true", dataset=data) == 2
    assert "holds the dataset" in one_line_error(capsys)
    assert sorted(os.listdir(data)) == ["rows.jsonl"]


# ------------------------------------------------------------------------------------------ unclear messages

def test_step_fractions_as_training_arguments_read_them(sft, tmp_path):
    from transformers import TrainingArguments

    out = tmp_path / "o"
    assert sft("--output_dir", out, "--use_peft", "true", "--max_steps", 4, "--save_steps", 0.5,
               "--logging_steps", 0.5) == 0
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [2, 4]
    # the same reading as transformers' (a float in (0, 1) is accepted, 1.5 is not)
    assert TrainingArguments(output_dir=str(tmp_path / "t"), save_steps=0.5).save_steps == 0.5
    assert sft("--output_dir", tmp_path / "p", "--max_steps", 4, "--save_steps", 1.5) == 2


def test_eval_steps_fraction_evaluates_at_that_fraction_of_the_steps(sft, tmp_path):
    """--eval_steps 0.5 of 4 steps: evaluations at steps 2 and 4 (transformers' reading), while every step logs."""
    out = tmp_path / "o"
    assert sft("--output_dir", out, "--use_peft", "true", "--max_steps", 4, "--eval_strategy", "steps",
               "--eval_steps", 0.5, "--eval_split", 0.25, "--logging_steps", 1, "--save_steps", 0) == 0
    entries = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in entries if "eval_loss" in e] == [2, 4]
    assert [e["step"] for e in entries if "loss" in e] == [1, 2, 3, 4]


def test_merge_without_lora_and_the_bf16_resume_hint(sft, tmp_path, capsys):
    assert sft("--output_dir", tmp_path / "o", "--max_steps", 1, "--merge", "true") == 2
    assert "--merge saves the LoRA adapters merged" in one_line_error(capsys)
    out = tmp_path / "f"
    assert sft("--output_dir", out, "--max_steps", 2, "--save_steps", 1, "--use_peft", "true") == 0
    capsys.readouterr()
    resume = ("--output_dir", out, "--max_steps", 3, "--use_peft", "true", "--resume_from_checkpoint", "last")
    assert sft(*resume, "--bf16", "true") == 2
    line = one_line_error(capsys)
    assert "trained in float32" in line and "--bf16 false" in line
    assert sft(*resume, "--bf16", "false") == 0  # the hint works as given


def test_a_bad_row_is_named_by_file_and_line(sft, tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    write_rows(data / "a.jsonl", ROWS[:3])
    (data / "b.jsonl").write_text("\n" + json.dumps(ROWS[0]) + "\n\n" + json.dumps({"messages": [
        {"role": "bot", "content": "hi"}]}) + "\n")
    assert sft("--output_dir", tmp_path / "o", "--max_steps", 1, dataset=data) == 2
    line = one_line_error(capsys)
    assert f"{data / 'b.jsonl'} line 4 (row 4)" in line and "role 'bot'" in line, line


def vl_row(image) -> dict:
    return {"images": [str(image)], "messages": [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "colour?"}]},
        {"role": "assistant", "content": "red"}]}


def test_a_bad_row_found_while_tokenising_is_named_by_file_and_line(sft, tiny_checkpoint, tmp_path, capsys):
    """The upfront check passes (the row is well formed); its image is read when the rows are tokenised."""
    from PIL import Image

    Image.new("RGB", (32, 32), "red").save(ok := tmp_path / "ok.png")
    model = tiny_checkpoint("qwen3_vl")
    capsys.readouterr()  # (building it prints)
    data = tmp_path / "vldata"
    data.mkdir()
    rows = [vl_row(tmp_path / "missing.png" if i == 3 else ok) for i in range(6)]
    (data / "a.jsonl").write_text("\n" + "".join(json.dumps(r) + "\n" for r in rows))  # row 3 on line 5
    assert sft("--output_dir", tmp_path / "o", "--max_steps", 1, "--use_peft", "true", dataset=data, model=model) == 2
    line = one_line_error(capsys)
    assert f"{data / 'a.jsonl'} line 5 (row 3): cannot read image 0" in line and "no such file" in line, line


def test_a_bad_row_found_in_training_or_evaluation_is_named_by_its_own_file(tiny_checkpoint, tmp_path):
    """An image gone after tokenising is found when a batch reads its pixels: an evaluation row is named by the
    evaluation file's line (never the training file's), a training row by the training file's."""
    from PIL import Image

    import mlxrl
    from mlxrl.errors import DataError
    from mlxrl.trainers.sft.config import SFTConfig
    from mlxrl.trainers.sft.trainer import SFTTrainer

    for name in ("ok", "gone"):
        Image.new("RGB", (32, 32), "red").save(tmp_path / f"{name}.png")
    train = write_rows(tmp_path / "t.jsonl", [vl_row(tmp_path / "ok.png") for _ in range(4)])
    evaluation = write_rows(tmp_path / "e.jsonl", [vl_row(tmp_path / f"{n}.png") for n in ("ok", "gone", "ok")])
    model, processor = mlxrl.load(tiny_checkpoint("qwen3_vl"))
    args = SFTConfig(output_dir=str(tmp_path / "o"), max_steps=1, max_length=128, compile=False, disable_tqdm=True,
                     gradient_checkpointing=False, use_peft=True, eval_on_start=True, logging_steps=1,
                     per_device_train_batch_size=2, per_device_eval_batch_size=2)
    trainer = SFTTrainer(model, processor, args, train_dataset=load_rows(train), eval_dataset=load_rows(evaluation))
    (tmp_path / "gone.png").unlink()
    with pytest.raises(DataError, match=f"^{evaluation} line 2 \\(row 1\\): cannot read image 0"):
        trainer.train()
    model, processor = mlxrl.load(tiny_checkpoint("qwen3_vl"))  # (the first trainer's LoRA is on the other)
    trainer = SFTTrainer(model, processor, dataclasses.replace(args, eval_on_start=False),
                         train_dataset=load_rows(train))
    (tmp_path / "ok.png").unlink()
    with pytest.raises(DataError, match=f"^{train} line (\\d) \\(row (\\d)\\): cannot read image 0") as caught:
        trainer.train()
    line, row = map(int, re.match(f"^{train} line (\\d) \\(row (\\d)\\)", str(caught.value)).groups())
    assert line == row + 1


def test_ctrl_c_held_down_through_the_shutdown_is_quiet(tiny_checkpoint, tmp_path):
    """Ctrl-C, then more Ctrl-C while the process saves and shuts down: exit 130 with the checkpoint, and no
    "Exception ignored in atexit callback ... KeyboardInterrupt" or other traceback on the way out."""
    import signal

    data = write_rows(tmp_path / "rows.jsonl")
    out = tmp_path / "o"
    proc = subprocess.Popen([sys.executable, "-m", "mlxrl.sft", "--model", str(tiny_checkpoint("qwen3")),
                             "--dataset", str(data), "--output_dir", str(out), "--use_peft", "true", "--max_steps",
                             "100000", "--logging_steps", "1", "--disable_tqdm", "true", "--compile", "false",
                             "--gradient_checkpointing", "false", "--max_length", "64"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:
            if line.startswith('{"step": 2'):
                break
        deadline = time.time() + 60
        while proc.poll() is None and time.time() < deadline:
            proc.send_signal(signal.SIGINT)
            time.sleep(0.01)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130, err[-2000:]
    assert "Exception ignored" not in err and "Traceback" not in err, err[-2000:]
    assert list(out.glob("checkpoint-*"))
