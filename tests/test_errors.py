"""Errors a user will hit when loading: one clear line on stderr and exit status 2, no traceback."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from mlxrl.cli.main import main
from mlxrl.hub import suggest_repo


def run_cli(capsys, *args, env=None):
    old = dict(os.environ)
    os.environ.update(env or {})
    try:
        code = main(list(args))
    finally:
        os.environ.clear()
        os.environ.update(old)
    err = capsys.readouterr().err.strip()
    return code, err


def assert_one_line(code, err, *needles):
    assert code == 2
    assert len(err.splitlines()) == 1, err
    assert err.startswith("error: ")
    for n in needles:
        assert n in err, err


@pytest.fixture
def copy_of(tiny_checkpoint, tmp_path, capsys):
    def make(arch):
        dst = tmp_path / arch
        shutil.copytree(tiny_checkpoint(arch), dst)
        capsys.readouterr()  # drop what building the checkpoint printed
        return dst

    return make


def test_no_such_local_path(capsys, tmp_path):
    code, err = run_cli(capsys, "--model", str(tmp_path / "missing"))
    assert_one_line(code, err, "no such local path", "missing")


def test_hub_unreachable_and_not_cached(capsys, tmp_path):
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    code, err = run_cli(capsys, "--model", "someone/not-cached-model", env=env)
    assert_one_line(code, err, "not in the Hugging Face cache", "someone/not-cached-model")
    # network attempt (no Hub reachable here, or no such repo where it is)
    code, err = run_cli(capsys, "--model", "someone/not-cached-model", env={"HF_HOME": str(tmp_path / "hf")})
    assert code == 2 and len(err.splitlines()) == 1
    assert "not in the cache" in err or "no model someone/not-cached-model" in err


def test_repo_that_does_not_exist_suggests_nearest(capsys):
    code, err = run_cli(capsys, "--model", "Qwen/Qwen3-VL-3B-Instruct")
    assert_one_line(code, err, "Qwen3-VL comes in 2B/4B/8B/32B", "Qwen/Qwen3-VL-4B-Instruct")
    assert "Qwen2.5-VL comes in 3B/7B/32B/72B" in suggest_repo("Qwen/Qwen2.5-VL-4B-Instruct")
    assert suggest_repo("Qwen/Qwen3-VL-8B-Instruct") is None


def test_unsupported_model_type(capsys, copy_of):
    folder = copy_of("qwen3")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["model_type"] = "llama"
    (folder / "config.json").write_text(json.dumps(cfg))
    code, err = run_cli(capsys, "--model", str(folder))
    assert_one_line(code, err, "unsupported model_type 'llama'", "qwen3_vl")


def test_truncated_safetensors(capsys, copy_of):
    folder = copy_of("qwen3")
    f = folder / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    code, err = run_cli(capsys, "--model", str(folder))
    assert_one_line(code, err, "truncated or corrupt", "model.safetensors")
    f.write_bytes(b"not a safetensors file at all")
    code, err = run_cli(capsys, "--model", str(folder))
    assert_one_line(code, err, "truncated or corrupt")


def test_missing_tokenizer_files(capsys, copy_of):
    folder = copy_of("qwen3")
    (folder / "tokenizer.json").unlink()
    code, err = run_cli(capsys, "--model", str(folder))
    assert_one_line(code, err, "tokenizer.json", str(folder))


def test_cli_exit_status_without_traceback(tmp_path):
    """The real process: status 2 and one line, nothing else on stderr."""
    out = subprocess.run([sys.executable, "-m", "mlxrl", "--model", str(tmp_path / "nope")],
                         capture_output=True, text=True)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [f"error: no such local path: {tmp_path / 'nope'} "
                                                "(pass an existing folder or a Hub id like Qwen/Qwen3-VL-2B-Instruct)"]
