"""Nothing a user has is lost (issue 18): saving never deletes or hides what mlxrl did not write,
checkpoints refuse a run they do not belong to, one run per output_dir, writes are atomic (a full
disk keeps the previous version loadable), and SIGTERM, Ctrl-C during the final save and an error
mid-run each leave a checkpoint (or a finished save) that resumes to exactly the uninterrupted
run's weights. Tiny models, few steps; CLI and signal cases run in subprocesses.

    python -m pytest -q tests/test_data_loss.py
"""

import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from PIL import Image

import mlxrl
from mlxrl import atomic
from mlxrl.cli.main import main as mlxrl_main
from mlxrl.data.synthetic import make_vqa
from mlxrl.errors import MlxrlError
from mlxrl.models import lora as lora_lib
from mlxrl.trainers import engine as engine_lib
from mlxrl.trainers.sft.config import SFTConfig
from mlxrl.trainers.sft.trainer import SFTTrainer

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
ROWS = [{"messages": [{"role": "user", "content": f"Say {i} words"},
                      {"role": "assistant", "content": " ".join(WORDS[i % 5: i % 5 + 2 + i % 4])}]} for i in range(12)]


def config(out, **kw):
    base = dict(output_dir=str(out), max_length=64, gradient_checkpointing=False, compile=False, disable_tqdm=True,
                save_steps=0, logging_steps=1, per_device_train_batch_size=2, learning_rate=1e-3, seed=0)
    base.update(kw)
    return SFTConfig(**base)


def listing(folder: Path) -> dict:
    """Every path under `folder` (relative) -> its bytes (files) or None (folders)."""
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else None) for p in sorted(folder.rglob("*"))}


def params(model) -> dict:
    return {k: np.array(v) for k, v in tree_flatten(model.parameters())}


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "Traceback" not in err[0], err
    return err[0]


# ------------------------------------------------------------------------------------------ mlxrl.save / --save

def test_save_refuses_folders_and_files_it_did_not_write(tmp_path, capsys):
    project = tmp_path / "project"
    (project / "src").mkdir(parents=True)
    (project / "src" / "main.py").write_text("print('mine')\n")
    (project / "data.csv").write_text("a,b\n1,2\n")
    before = listing(tmp_path)
    assert mlxrl_main(["--save", str(project)]) == 2
    assert "not a folder mlxrl saved" in one_line_error(capsys)
    assert mlxrl_main(["--save", str(project), "--overwrite"]) == 2  # --overwrite replaces saves of ours only
    one_line_error(capsys)
    afile = tmp_path / "notes.txt"
    afile.write_text("keep me")
    before = listing(tmp_path)
    assert mlxrl_main(["--save", str(afile), "--overwrite"]) == 2
    assert "is not a folder" in one_line_error(capsys)
    assert listing(tmp_path) == before  # nothing deleted, nothing renamed aside (no .notes.txt.old-*)


def test_save_over_an_earlier_save_of_ours(tmp_path, capsys):
    out = tmp_path / "saved"
    old_mask = os.umask(0o027)
    try:
        assert mlxrl_main(["--save", str(out)]) == 0
    finally:
        os.umask(old_mask)
    assert (out.stat().st_mode & 0o777) == 0o750  # the umask's mode (mkdtemp would give 0700)
    marker = json.loads((out / atomic.MARKER).read_text())
    assert marker["saved_by"] == "mlxrl" and set(marker["files"]) == set(os.listdir(out)) - {atomic.MARKER}
    assert mlxrl_main(["--save", str(out)]) == 2  # an earlier save: only with --overwrite
    assert "--overwrite" in one_line_error(capsys)

    model, processor = mlxrl.load_default(seed=1)  # different weights replace the earlier save
    mlxrl.save(model, processor, out, overwrite=True)
    loaded, _ = mlxrl.load(out)
    want, got = params(model), params(loaded)
    assert want.keys() == got.keys() and all(np.array_equal(want[k], got[k]) for k in want)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["saved"]  # no temp or old folder left beside it

    (out / "README.md").write_text("my notes on this model")  # a file of the user's in a save of ours
    with pytest.raises(MlxrlError, match="README.md.*did not write"):
        mlxrl.save(model, processor, out, overwrite=True)
    assert (out / "README.md").read_text() == "my notes on this model"


def _fail_on(monkeypatch, name_part: str, partial: bool = True):
    """mx.save_safetensors raises ENOSPC (after writing a truncated file) for files whose path contains
    `name_part`, as a full disk does midway."""
    real = mx.save_safetensors

    def save(path, arrays, *a, **kw):
        if name_part in str(path):
            if partial:
                Path(path).write_bytes(b"\0" * 100)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, arrays, *a, **kw)

    monkeypatch.setattr(mx, "save_safetensors", save)


def test_full_disk_during_a_model_save_keeps_the_previous_one(tmp_path, monkeypatch):
    out = tmp_path / "saved"
    model, processor = mlxrl.load_default(seed=0)
    mlxrl.save(model, processor, out)
    before = listing(out)
    other, _ = mlxrl.load_default(seed=1)
    _fail_on(monkeypatch, "model.safetensors")
    with pytest.raises(MlxrlError, match="no space left on device.*previous version .* is unchanged"):
        mlxrl.save(other, processor, out, overwrite=True)
    assert listing(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["saved"]
    monkeypatch.undo()
    loaded, _ = mlxrl.load(out)
    want = params(model)
    assert all(np.array_equal(v, want[k]) for k, v in params(loaded).items())


# ------------------------------------------------------------------------------------------ the adapter and checkpoints

def test_full_disk_during_adapter_and_checkpoint_saves(tiny_checkpoint, tmp_path, monkeypatch):
    folder = tiny_checkpoint("qwen3")
    out = tmp_path / "run"
    model, processor = mlxrl.load(folder)
    trainer = SFTTrainer(model, processor, config(out, use_peft=True, lora_r=4, max_steps=2, save_steps=2),
                         train_dataset=ROWS)
    trainer.train()
    adapter = {n: (out / n).read_bytes() for n in ("adapter_model.safetensors", "adapter_config.json")}
    ckpt = listing(out / "checkpoint-2")
    for _, layer in lora_lib.lora_layers(model):  # new weights a failed save must not half-write
        layer.lora_b = layer.lora_b + 1.0

    _fail_on(monkeypatch, "adapter_model")
    with pytest.raises(MlxrlError, match="cannot write the LoRA adapter.*no space left"):
        trainer.save_final()
    assert {n: (out / n).read_bytes() for n in adapter} == adapter
    _fail_on(monkeypatch, "trainable.safetensors")
    with pytest.raises(MlxrlError, match="cannot write checkpoint checkpoint-2.*no space left"):
        trainer.save_checkpoint()
    monkeypatch.undo()
    assert listing(out / "checkpoint-2") == ckpt
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]  # no temp folder left

    fresh, _ = mlxrl.load(folder)
    lora_lib.load_adapter(fresh, out)  # the previous adapter still loads, with the weights it had
    saved = mx.load(str(out / "adapter_model.safetensors"))
    assert saved and all(np.isfinite(np.array(v)).all() for v in saved.values())


def test_a_failed_final_save_keeps_the_weights_as_a_checkpoint(tiny_checkpoint, tmp_path, monkeypatch):
    folder = tiny_checkpoint("qwen3")
    model, processor = mlxrl.load(folder)
    reference = SFTTrainer(model, processor, config(tmp_path / "ref", use_peft=True, lora_r=4, max_steps=3),
                           train_dataset=ROWS)
    reference.train()
    want = reference.trainable_state()

    model, processor = mlxrl.load(folder)
    _fail_on(monkeypatch, "adapter_model")
    with pytest.raises(MlxrlError, match="no space left"):
        SFTTrainer(model, processor, config(tmp_path / "run", use_peft=True, lora_r=4, max_steps=3),
                   train_dataset=ROWS).train()
    monkeypatch.undo()
    saved = mx.load(str(tmp_path / "run" / "checkpoint-3" / "trainable.safetensors"))
    assert saved.keys() == want.keys() and all(np.array_equal(np.array(saved[k]), np.array(want[k])) for k in want)


def _checkpoint_of(trainer) -> Path:
    """A checkpoint of `trainer`'s run at step 0 (no training needed to test what it belongs to)."""
    trainer.optimizer = trainer.args.make_optimizer(1)
    trainer.optimizer.init(trainer.model.trainable_parameters())
    return trainer.save_checkpoint()


def _resume(model, processor, ckpt, rows=ROWS, **kw):
    args = config(Path(ckpt).parent.parent / f"resume-{len(os.listdir(Path(ckpt).parent.parent))}", max_steps=2,
                  resume_from_checkpoint=str(ckpt), **kw)
    SFTTrainer(model, processor, args, train_dataset=rows).train()


def test_resume_refuses_a_checkpoint_of_another_run(tiny_checkpoint, tmp_path):
    folder = tiny_checkpoint("qwen3")
    model, processor = mlxrl.load(folder)
    r16 = _checkpoint_of(SFTTrainer(model, processor, config(tmp_path / "r16", use_peft=True, lora_r=16),
                                    train_dataset=ROWS))
    with pytest.raises(MlxrlError, match=r"trains LoRA adapters \(r 16.*fine-tunes the full model.*--lora_r 16"):
        _resume(*mlxrl.load(folder), r16)
    with pytest.raises(MlxrlError, match="has lora_r 16 and this run 8: resume with --lora_r 16"):
        _resume(*mlxrl.load(folder), r16, use_peft=True, lora_r=8)
    with pytest.raises(MlxrlError, match="lora_alpha 32 and this run 64"):
        _resume(*mlxrl.load(folder), r16, use_peft=True, lora_r=16, lora_alpha=64)

    vl, vl_processor = mlxrl.load_default()  # the VL demo's model
    vl_ckpt = _checkpoint_of(SFTTrainer(vl, vl_processor, config(tmp_path / "vl"), train_dataset=make_vqa(4)))
    with pytest.raises(MlxrlError, match="trained on a qwen3_vl model and this run's model is qwen3"):
        _resume(*mlxrl.load(folder), vl_ckpt)
    with pytest.raises(MlxrlError, match="trained in float32 and this run is bfloat16: resume with --dtype float32"):
        _resume(*mlxrl.load_default(dtype="bfloat16"), vl_ckpt, rows=make_vqa(4))

    bf16, bf16_processor = mlxrl.load_default(dtype="bfloat16")
    master = _checkpoint_of(SFTTrainer(bf16, bf16_processor, config(tmp_path / "bf16"), train_dataset=make_vqa(4)))
    with pytest.raises(MlxrlError, match="master_weights true and this run has false"):
        _resume(*mlxrl.load_default(dtype="bfloat16"), master, rows=make_vqa(4), master_weights=False)
    with pytest.raises(MlxrlError, match="optim adamw_torch and this run uses adafactor"):
        _resume(*mlxrl.load_default(dtype="bfloat16"), master, rows=make_vqa(4), optim="adafactor")


def test_resume_refuses_broken_and_foreign_checkpoints_in_one_line(tiny_checkpoint, tmp_path, capsys):
    from mlxrl.cli.sft import main as sft_main

    folder = tiny_checkpoint("qwen3")
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    model, processor = mlxrl.load(folder)
    good = _checkpoint_of(SFTTrainer(model, processor, config(tmp_path / "a", use_peft=True), train_dataset=ROWS))
    truncated, no_opt, hf = tmp_path / "truncated", tmp_path / "no_opt", tmp_path / "hf"
    for dst in (truncated, no_opt):
        shutil.copytree(good, dst)
    blob = (truncated / "trainable.safetensors").read_bytes()
    (truncated / "trainable.safetensors").write_bytes(blob[: len(blob) // 2])
    (no_opt / "optimizer.safetensors").unlink()
    hf.mkdir()  # what transformers' Trainer writes
    for name in ("adapter_model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json"):
        (hf / name).write_bytes(b"{}")
    for ckpt, message in ((truncated, "trainable.safetensors is truncated or corrupt"),
                          (no_opt, "has no optimizer.safetensors"), (hf, "Hugging Face .*not an mlxrl checkpoint"),
                          (tmp_path / "missing", "no such folder")):
        code = sft_main(["--model", str(folder), "--dataset", str(data), "--output_dir", str(tmp_path / "out"),
                         "--use_peft", "true", "--max_steps", "2", "--resume_from_checkpoint", str(ckpt)])
        line = one_line_error(capsys)
        assert code == 2 and re.search(message, line), line


# ------------------------------------------------------------------------------------------ one run per output_dir

def test_a_second_run_in_one_output_dir(tiny_checkpoint, tmp_path):
    folder = tiny_checkpoint("qwen3")
    out = tmp_path / "run"

    def run(**kw):
        model, processor = mlxrl.load(folder)
        trainer = SFTTrainer(model, processor, config(out, use_peft=True, lora_r=4, **kw), train_dataset=ROWS)
        trainer.train()
        return trainer.log_history

    run(max_steps=3, save_steps=1)
    first = listing(out)
    with pytest.raises(MlxrlError, match="holds another run .*--overwrite_output_dir"):
        run(max_steps=2)
    assert listing(out) == first

    (out / "notes.txt").write_text("mine")
    (out / "checkpoint-99").mkdir()  # not a checkpoint of ours: never pruned or deleted
    (out / "checkpoint-99" / "model.bin").write_text("someone else's")
    stale = [out / ".checkpoint-5.tmp-abcd1234", out / ".checkpoint-6.tmp-999999999-0123abcd"]  # from a killed run
    alive = out / f".checkpoint-7.tmp-{os.getppid()}-0123abcd"  # a running process's: kept
    for p in [*stale, alive]:
        p.mkdir()

    model, processor = mlxrl.load(folder)
    args = config(out, use_peft=True, lora_r=4, max_steps=4, save_steps=1, save_total_limit=2,
                  overwrite_output_dir=True)
    SFTTrainer(model, processor, args, train_dataset=ROWS).train()
    names = sorted(p.name for p in out.iterdir())
    assert "notes.txt" in names and (out / "checkpoint-99" / "model.bin").read_text() == "someone else's"
    assert [n for n in names if n.startswith("checkpoint-")] == ["checkpoint-3", "checkpoint-4", "checkpoint-99"]
    assert not any(p.exists() for p in stale) and alive.exists()
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]  # the first run's metrics are gone, not mixed in
    assert json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())["global_step"] == 4


def test_cli_second_run_refused_then_overwritten(tiny_checkpoint, tmp_path, capsys):
    from mlxrl.cli.sft import main as sft_main

    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    out = tmp_path / "out"
    argv = ["--model", str(tiny_checkpoint("qwen3")), "--dataset", str(data), "--output_dir", str(out),
            "--use_peft", "true", "--max_steps", "2", "--save_steps", "1", "--disable_tqdm", "true",
            "--compile", "false", "--gradient_checkpointing", "false", "--max_length", "64"]
    assert sft_main(argv) == 0
    capsys.readouterr()
    first = listing(out)
    assert sft_main(argv) == 2
    assert "holds another run (checkpoint-1, checkpoint-2" in one_line_error(capsys)
    assert listing(out) == first
    (out / "keep.md").write_text("mine")
    assert sft_main([*argv, "--max_steps", "1", "--overwrite_output_dir", "true"]) == 0
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1"]
    assert (out / "keep.md").read_text() == "mine" and len((out / "metrics.jsonl").read_text().splitlines()) == 1


def test_resume_cuts_metrics_back_and_last_picks_this_run(tiny_checkpoint, tmp_path):
    folder = tiny_checkpoint("qwen3")
    out = tmp_path / "run"

    def run(**kw):
        model, processor = mlxrl.load(folder)
        args = config(out, use_peft=True, lora_r=4, lora_dropout=0.1, max_steps=6, **kw)
        trainer = SFTTrainer(model, processor, args, train_dataset=ROWS)
        trainer.train()
        return trainer.log_history

    full = run(save_steps=3)
    full_lines = (out / "metrics.jsonl").read_text().splitlines()
    resumed = run(resume_from_checkpoint=str(out / "checkpoint-3"))
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2, 3, 4, 5, 6]  # not 1..6, 4..6
    assert lines[:3] == full_lines[:3]
    assert [e["loss"] for e in resumed if "loss" in e] == [e["loss"] for e in full if "loss" in e]


def test_output_dir_and_flags_errors_are_one_line(tiny_checkpoint, tmp_path, capsys):
    from mlxrl.cli.sft import main as sft_main

    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    base = ["--model", str(tiny_checkpoint("qwen3")), "--dataset", str(data), "--max_steps", "1"]
    afile = tmp_path / "afile"
    afile.write_text("keep")
    assert sft_main([*base, "--output_dir", str(afile)]) == 2
    assert "is a file, not a folder" in one_line_error(capsys) and afile.read_text() == "keep"
    assert sft_main([*base, "--output_dir", str(afile / "sub")]) == 2
    assert "not writable" in one_line_error(capsys)
    assert sft_main([*base, "--output_dir", str(tmp_path / "o"), "--eval_strategy", "steps"]) == 2
    assert "needs evaluation data" in one_line_error(capsys)
    assert mlxrl_main(["--dtype", "float8"]) == 2
    assert "unknown dtype 'float8'" in one_line_error(capsys)


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare to mount a small tmpfs")
def test_a_real_full_disk_and_a_read_only_output_dir(tmp_path):
    """On a small tmpfs (a private mount namespace): the second save of a model does not fit next to the
    first (MLX's "Unable to write N bytes"): one line, the first save loads unchanged. A read-only
    output_dir is one line too."""
    script = tmp_path / "disk.py"
    script.write_text(f"""
import os, sys, numpy as np, mlxrl
from mlx.utils import tree_flatten
from mlxrl.hub import MlxrlError
from mlxrl.sft import main as sft_main
disk = {str(tmp_path / "disk")!r}
model, processor = mlxrl.load_default(seed=0)
mlxrl.save(model, processor, disk + "/saved")
other, _ = mlxrl.load_default(seed=1)
try:
    mlxrl.save(other, processor, disk + "/saved", overwrite=True)
    print("SAVED")
except MlxrlError as e:
    print("ERROR", e)
loaded, _ = mlxrl.load(disk + "/saved")
a, b = dict(tree_flatten(model.parameters())), dict(tree_flatten(loaded.parameters()))
print("SAME", all(np.array_equal(np.array(a[k]), np.array(b[k])) for k in a))
print("ENTRIES", sorted(os.listdir(disk)))
sys.exit(sft_main(["--output_dir", {str(tmp_path / "ro")!r}, "--max_steps", "1"]))
""")
    (tmp_path / "disk").mkdir()
    (tmp_path / "ro").mkdir()
    # the embedded model's save is ~94 MB: 150 MB holds one, not two
    cmd = (f"mount -t tmpfs -o size=150m tmpfs {tmp_path / 'disk'} && mount -t tmpfs -o ro,size=1m tmpfs "
           f"{tmp_path / 'ro'} && exec {sys.executable} {script}")
    res = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", cmd], capture_output=True,
                         text=True, timeout=300)
    if "mount:" in res.stderr or "unshare:" in res.stderr:
        pytest.skip(f"cannot mount here: {res.stderr.strip()[:200]}")
    out = res.stdout
    assert "ERROR cannot write the model" in out and "Unable to write" in out, out + res.stderr[-2000:]
    assert "SAME True" in out and "ENTRIES ['saved']" in out, out
    err = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(err) == 1 and "not writable (read-only file system)" in err[0], res.stderr


# ------------------------------------------------------------------------------------------ interruptions

def sft_cli(folder, data, out, *extra, vl=False):
    args = ["--model", str(folder), "--dataset", str(data), "--output_dir", str(out), "--use_peft", "true",
            "--lora_r", "4", "--lora_dropout", "0.1", "--max_steps", "5", "--per_device_train_batch_size",
            "1" if vl else "2", "--learning_rate", "1e-3", "--compile", "false", "--gradient_checkpointing",
            "false", "--disable_tqdm", "true", "--logging_steps", "1", "--save_steps", "0", "--seed", "3",
            "--max_length", "128"]
    return [*args, *extra]


def run_cli(script_or_module, argv, timeout=300):
    cmd = [sys.executable, *(["-m", script_or_module] if "." in script_or_module and not
                             script_or_module.endswith(".py") else [script_or_module]), *argv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"}, preexec_fn=_default_signals)


def _default_signals():
    """The CLI child starts with Ctrl-C and SIGTERM at their defaults, as from a terminal: a suite run as a
    background job (`pytest &`) inherits SIGINT ignored, which the trainers rightly leave ignored."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def adapter(out: Path) -> dict:
    return {k: np.array(v) for k, v in mx.load(str(out / "adapter_model.safetensors")).items()}


def assert_same(a: dict, b: dict):
    assert a.keys() == b.keys() and a
    for k in a:
        assert np.array_equal(a[k], b[k]), k


PATCH = """
import os, signal, sys
from mlxrl.models import lora
from mlxrl.trainers import engine
case = os.environ["CASE"]
if case == "sigterm":
    update = engine.Trainer._update
    def update_then_term(self, grads):
        if self.global_step == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # arrives inside step 3's update
        return update(self, grads)
    engine.Trainer._update = update_then_term
elif case == "sigint-final":
    save_adapter = lora.save_adapter
    def interrupted_save(*a, **k):
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while the final adapter is written
        return save_adapter(*a, **k)
    lora.save_adapter = interrupted_save
from mlxrl.sft import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def text_run(tiny_checkpoint, tmp_path_factory):
    """(model folder, data file, the uninterrupted run's final adapter)."""
    root = tmp_path_factory.mktemp("text_run")
    folder = tiny_checkpoint("qwen3")
    data = root / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    res = run_cli("mlxrl.sft", sft_cli(folder, data, root / "full"))
    assert res.returncode == 0, res.stderr[-2000:]
    (root / "patch.py").write_text(PATCH)
    return folder, data, adapter(root / "full"), root / "patch.py"


def test_sigterm_saves_a_checkpoint_that_resumes_exactly(text_run, tmp_path):
    folder, data, want, patch = text_run
    out = tmp_path / "run"
    os.environ["CASE"] = "sigterm"
    try:
        res = run_cli(str(patch), sft_cli(folder, data, out))
    finally:
        del os.environ["CASE"]
    assert res.returncode == 130, res.stdout[-2000:] + res.stderr[-2000:]
    assert f"terminated (SIGTERM): saved resumable checkpoint {out / 'checkpoint-3'}" in res.stdout, res.stdout
    assert "Traceback" not in res.stderr and not (out / "adapter_model.safetensors").exists()
    res = run_cli("mlxrl.sft", sft_cli(folder, data, out, "--resume_from_checkpoint", "last"))
    assert res.returncode == 0 and "resumed from" in res.stdout, res.stderr[-2000:]
    assert_same(adapter(out), want)
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5]


def test_ctrl_c_during_the_final_save_completes_it(text_run, tmp_path):
    folder, data, want, patch = text_run
    out = tmp_path / "run"
    os.environ["CASE"] = "sigint-final"
    try:
        res = run_cli(str(patch), sft_cli(folder, data, out))
    finally:
        del os.environ["CASE"]
    assert res.returncode == 130, res.stdout[-2000:] + res.stderr[-2000:]
    assert "SIGINT during the final save: the save completed" in res.stdout, res.stdout
    assert_same(adapter(out), want)
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]


def _png(path: Path, colour, truncated=False):
    Image.new("RGB", (48, 48), colour).save(path)
    if truncated:
        blob = path.read_bytes()
        path.write_bytes(blob[: len(blob) // 2])


def test_a_bad_image_mid_run_keeps_the_finished_steps(tiny_checkpoint, tmp_path):
    folder = tiny_checkpoint("qwen3_vl")
    colours = ["red", "green", "blue", "yellow", "purple", "orange"]
    rows = []
    for i, c in enumerate(colours):
        _png(tmp_path / f"{i}.png", c)
        rows.append({"images": [str(tmp_path / f"{i}.png")],
                     "messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colour?"}]},
                                  {"role": "assistant", "content": c}]})
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = run_cli("mlxrl.sft", sft_cli(folder, data, tmp_path / "full", vl=True))
    assert res.returncode == 0, res.stderr[-2000:]
    want = adapter(tmp_path / "full")

    third = int(np.random.default_rng([3, 0]).permutation(len(rows))[2])  # the row of step 3 (seed 3, batch 1)
    _png(tmp_path / f"{third}.png", colours[third], truncated=True)
    out = tmp_path / "run"
    res = run_cli("mlxrl.sft", sft_cli(folder, data, out, vl=True))
    err = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(err) == 1, res.stderr[-2000:]
    assert f"{data} line {third + 1} (row {third}): cannot read image" in err[0], res.stderr[-2000:]  # file and line
    assert re.search(rf"stopped by an error at step 3 \(\w+\): saved resumable checkpoint {out / 'checkpoint-2'}",
                     res.stdout), res.stdout[-2000:]

    _png(tmp_path / f"{third}.png", colours[third])  # the user repairs the image and resumes
    res = run_cli("mlxrl.sft", sft_cli(folder, data, out, "--resume_from_checkpoint", "last", vl=True))
    assert res.returncode == 0, res.stderr[-2000:]
    assert_same(adapter(out), want)


def test_grpo_sigterm_mid_generation_cycle_resumes_exactly(tiny_checkpoint, tmp_path, monkeypatch):
    """GRPO runs its own loop (generation rounds) over the engine's step: SIGTERM during an update stops
    after it with a checkpoint, and the resumed run (regenerating the round it was in) ends with the
    uninterrupted run's weights."""
    from mlxrl.trainers.grpo.trainer import GRPOConfig, GRPOTrainer

    folder = tiny_checkpoint("qwen3")
    prompts = [{"prompt": p} for p in ("The sky is", "One plus one is", "Paris is the capital of", "Water boils at")]

    def reward(prompts, completions, completion_ids, **kwargs):
        return [float(sum(ids) % 7) for ids in completion_ids]

    def run(out, **kw):
        model, processor = mlxrl.load(folder)
        args = GRPOConfig(output_dir=str(tmp_path / out), gradient_checkpointing=False, compile=False,
                          disable_tqdm=True, save_steps=0, logging_steps=1, per_device_train_batch_size=4,
                          num_generations=4, max_completion_length=6, seed=0, use_peft=True, lora_r=4,
                          learning_rate=1e-2, max_steps=4, steps_per_generation=2, **kw)
        trainer = GRPOTrainer(model, processor, args, train_dataset=prompts, reward_funcs=reward)
        return trainer, trainer.train

    trainer, train = run("full")
    train()
    want = {k: np.array(v) for k, v in trainer.trainable_state().items()}

    trainer, train = run("run")
    update = trainer._update

    def update_then_term(grads):
        if trainer.global_step == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # inside step 3's update, the middle of a generation round
        return update(grads)

    monkeypatch.setattr(trainer, "_update", update_then_term)
    with pytest.raises(engine_lib.TrainingInterrupted):
        train()
    assert signal.getsignal(signal.SIGTERM) is not trainer.signals._on_signal  # handlers restored
    trainer, train = run("run", resume_from_checkpoint="last")
    train()
    assert trainer.log_history[2]["step"] == 3  # the interrupted step's log entry came back with the checkpoint
    got = {k: np.array(v) for k, v in trainer.trainable_state().items()}
    assert_same(got, want)


# ------------------------------------------------------------------- --overwrite_output_dir replaces, never loses

KILL_PATCH = """
import os, signal, sys
import mlxrl  # first: the BLAS it loads before mlx.core (the uninterrupted run's numerics)
import mlx.core as mx
point = os.environ["KILL_AT"]
def die():
    os.kill(os.getpid(), signal.SIGKILL)
if point == "start":  # the run has taken the folder over (its record names it) and cleared the old steps
    from mlxrl.trainers import run_dir
    write_record = run_dir.write_record
    def record_then_die(*a, **k):
        write_record(*a, **k)
        die()
    run_dir.write_record = record_then_die
elif point == "mid-run":  # inside the second optimizer step
    from mlxrl.trainers import engine
    update = engine.Trainer._update
    def update_then_die(self, grads):
        if self.global_step == 1:
            die()
        return update(self, grads)
    engine.Trainer._update = update_then_die
elif point == "first-tensor":  # the final save has written its first tensor file (aside)
    save = mx.save_safetensors
    def save_then_die(*a, **k):
        save(*a, **k)
        die()
    mx.save_safetensors = save_then_die
elif point == "renames":  # the final save's first file renamed into the folder, the others not yet
    replace = os.replace
    def replace_then_die(src, dst, *a, **k):
        replace(src, dst, *a, **k)
        if os.path.basename(os.path.dirname(os.fspath(src))).startswith((".model.tmp-", ".adapter.tmp-")):
            die()
    os.replace = replace_then_die
from mlxrl.sft import main
sys.exit(main(sys.argv[1:]))
"""


def _weights(folder: Path) -> dict:
    model, _ = mlxrl.load(folder)  # loads only a complete save (a partial one is rolled forward or refused)
    return params(model)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "adapter"])
def test_overwrite_keeps_the_old_model_until_the_new_one_is_in_place(text_run, tmp_path, lora):
    """A folder holding a finished run; a new run into it with --overwrite_output_dir, killed (kill -9) when it
    has taken the folder over, mid-run, inside its final save (its first tensor written aside) and between the
    final save's renames: each leaves the old model (or, from the renames on, the new one) loadable, the user's
    file untouched; run again, it replaces the old model."""
    folder, data, _, _ = text_run
    peft = ["--use_peft", "true"] if lora else ["--use_peft", "false"]
    old_dir = tmp_path / "old"
    assert run_cli("mlxrl.sft", sft_cli(folder, data, old_dir, *peft, "--max_steps", "2")).returncode == 0
    (old_dir / "notes.txt").write_text("mine")

    def loaded(out):  # through the loaders, which roll a save killed between its renames forward
        if not lora:
            return _weights(out)
        return {k: np.array(v) for k, v in lora_lib._read_adapter(out)[1].items()}

    old = loaded(old_dir)
    again = [*peft, "--max_steps", "3", "--learning_rate", "5e-3", "--overwrite_output_dir", "true"]
    new_dir = tmp_path / "new"
    shutil.copytree(old_dir, new_dir)
    assert run_cli("mlxrl.sft", sft_cli(folder, data, new_dir, *again)).returncode == 0
    new = loaded(new_dir)
    assert any(not np.array_equal(old[k], new[k]) for k in old)
    (patch := tmp_path / "kill.py").write_text(KILL_PATCH)
    # the start and mid-run points are the same for an adapter (the run's start is the adapter's too)
    points = [("first-tensor", old), ("renames", new)] if lora else [
        ("start", old), ("mid-run", old), ("first-tensor", old), ("renames", new)]
    for point, want in points:
        out = tmp_path / point
        shutil.copytree(old_dir, out)
        os.environ["KILL_AT"] = point
        try:
            res = run_cli(str(patch), sft_cli(folder, data, out, *again))
        finally:
            del os.environ["KILL_AT"]
        assert res.returncode == -signal.SIGKILL, (point, res.stdout[-1500:], res.stderr[-1500:])
        assert (out / "notes.txt").read_text() == "mine"
        got = loaded(out)
        assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want), point
        if point in ("start", "mid-run"):
            continue
        res = run_cli("mlxrl.sft", sft_cli(folder, data, out, *again))  # run again: the new model replaces it
        assert res.returncode == 0, (point, res.stderr[-1500:])
        assert_same(loaded(out), new)
        assert not [p.name for p in out.iterdir() if ".tmp-" in p.name or ".old-" in p.name], point
