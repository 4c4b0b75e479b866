"""Damaged or malformed files in a model or adapter folder, and a full disk while the tokenizer is written: each
is one line on stderr naming the file (and the field), exit status 2, never a traceback.

    python -m pytest -q tests/test_probes_files.py

- adapter_config.json with a null or string lora_alpha, a zero, negative or string r, a target_modules that is
  neither a list nor a string, a string use_dora or lora_dropout, or not an object
  (`python -m mlxrl.generate --adapter_path`): the file's path and the field;
- adapter_model.safetensors cut at half its bytes: "truncated or corrupt" and the file, and `load_adapter` does
  not call it an adapter of another model (`AdapterMismatchError` is for readable adapters that do not fit);
- tokenizer.json, tokenizer_config.json and preprocessor_config.json that are not JSON, not objects, or hold a
  field of the wrong kind or range (`python -m mlxrl --model`, `mlxrl.load`): the file and the field;
- tokenizers' Rust writer failing on a full disk (a bare `Exception`) while `python -m mlxrl --save` or the
  final save of `python -m mlxrl.sft` writes tokenizer.json: "no space left on device", nothing half-written.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import tokenization_utils_tokenizers

import mlxrl
from mlxrl import generate as G
from mlxrl.cli.main import main as mlxrl_main
from mlxrl.cli.sft import main as sft_main
from mlxrl.errors import ConfigError, MlxrlError
from mlxrl.models import lora


def error_line(rc, err: str) -> str:
    """The one `error:` line of a failed CLI run (the CLIs also print a startup line to stderr)."""
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, (rc, err)
    return lines[0]


def copy_of(tiny_checkpoint, arch: str, dst: Path) -> Path:
    shutil.copytree(tiny_checkpoint(arch), dst)
    return dst


# ------------------------------------------------------------------------------------------ the adapter

@pytest.fixture(scope="module")
def adapter(tiny_checkpoint, tmp_path_factory) -> Path:
    """A LoRA adapter (r 4) of the tiny qwen3 checkpoint, saved in PEFT's layout; copy it to damage it."""
    folder = tiny_checkpoint("qwen3")
    model, _ = mlxrl.load(folder)
    lora.apply_lora(model, r=4, alpha=8, dropout=0.0)
    return lora.save_adapter(model, tmp_path_factory.mktemp("adapter") / "lora", str(folder))


def generate_with(tiny_checkpoint, adapter_dir: Path, capsys) -> str:
    rc = G.main(["--model", str(tiny_checkpoint("qwen3")), "--adapter_path", str(adapter_dir), "--prompt", "hi",
                 "--max_new_tokens", "1"])
    return error_line(rc, capsys.readouterr().err)


ADAPTER_CASES = [  # (id, fields set in adapter_config.json (a list: the whole file), words of the error)
    ("lora_alpha null", {"lora_alpha": None}, "lora_alpha is null"),
    ("lora_alpha string", {"lora_alpha": "16"}, 'lora_alpha is "16"'),
    ("r zero", {"r": 0}, "r is 0, expected a positive integer"),
    ("r negative", {"r": -4}, "r is -4"),
    ("r string", {"r": "four"}, 'r is "four"'),
    ("target_modules number", {"target_modules": 3}, "target_modules is 3"),
    ("use_dora string", {"use_dora": "false"}, 'use_dora is "false", expected true or false'),
    ("lora_dropout string", {"lora_dropout": "x"}, 'lora_dropout is "x"'),
    ("not an object", [1, 2], "expected a JSON object, got a list"),
]


@pytest.mark.parametrize("fields,words", [c[1:] for c in ADAPTER_CASES], ids=[c[0] for c in ADAPTER_CASES])
def test_bad_adapter_config_names_the_file_and_field(tiny_checkpoint, adapter, tmp_path, capsys, fields, words):
    bad = Path(shutil.copytree(adapter, tmp_path / "adapter"))
    path = bad / lora.ADAPTER_CONFIG
    cfg = fields if isinstance(fields, list) else {**json.loads(path.read_text()), **fields}
    path.write_text(json.dumps(cfg))
    line = generate_with(tiny_checkpoint, bad, capsys)
    assert str(path) in line and words in line, line


def test_truncated_adapter_weights_are_called_truncated(tiny_checkpoint, adapter, tmp_path, capsys):
    bad = Path(shutil.copytree(adapter, tmp_path / "adapter"))
    weights = bad / lora.ADAPTER_WEIGHTS
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    line = generate_with(tiny_checkpoint, bad, capsys)
    assert "truncated or corrupt" in line and str(weights) in line, line
    model, _ = mlxrl.load(tiny_checkpoint("qwen3"))
    with pytest.raises(MlxrlError, match="truncated or corrupt") as caught:
        lora.load_adapter(model, bad)
    # the generate CLI words an AdapterMismatchError as "an adapter of another model?": a damaged file is not one
    assert not isinstance(caught.value, lora.AdapterMismatchError)
    assert not lora.lora_layers(model)


# ---------------------------------------------------------------------------- tokenizer and image files

def _json_edit(**fields):
    def edit(path: Path) -> None:
        path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))
    return edit


def _text(content: str):
    return lambda path: path.write_text(content)


PROCESSOR_CASES = [  # (id, arch, file, edit, words of the error)
    ("tokenizer.json empty object", "qwen3", "tokenizer.json", _text("{}"), "model is missing"),
    ("tokenizer.json not JSON", "qwen3", "tokenizer.json", _text("\n"), "not valid JSON (Expecting value: line 2"),
    ("tokenizer.json bad model", "qwen3", "tokenizer.json",
     _text('{"model": {"type": "BPE", "vocab": 3}, "added_tokens": []}'), "expected a map at line 1 column"),
    ("tokenizer_config.json not JSON", "qwen3", "tokenizer_config.json", _text("{"), "not valid JSON"),
    ("tokenizer_config.json a list", "qwen3", "tokenizer_config.json", _text("[]"), "expected a JSON object"),
    ("tokenizer_config.json eos number", "qwen3", "tokenizer_config.json", _json_edit(eos_token=5), "eos_token is 5"),
    ("preprocessor not JSON", "qwen3_vl", "preprocessor_config.json", _text("{"), "not valid JSON"),
    ("patch_size 0", "qwen3_vl", "preprocessor_config.json", _json_edit(patch_size=0), "patch_size is 0"),
    ("patch_size string", "qwen3_vl", "preprocessor_config.json", _json_edit(patch_size="16"), 'patch_size is "16"'),
    ("merge_size 0", "qwen3_vl", "preprocessor_config.json", _json_edit(merge_size=0), "merge_size is 0"),
    ("merge_size negative", "qwen3_vl", "preprocessor_config.json", _json_edit(merge_size=-2), "merge_size is -2"),
    ("temporal_patch_size 0", "qwen3_vl", "preprocessor_config.json", _json_edit(temporal_patch_size=0),
     "temporal_patch_size is 0"),
    ("min above max", "qwen3_vl", "preprocessor_config.json", _json_edit(min_pixels=200000, max_pixels=100000),
     "min_pixels 200000 is above max_pixels 100000"),
    ("image_std zero", "qwen3_vl", "preprocessor_config.json", _json_edit(image_std=[0, 0, 0]),
     "image_std is [0, 0, 0]"),
    ("another model's patch", "qwen3_vl", "preprocessor_config.json", _json_edit(patch_size=14),
     "vision_config.patch_size is 16"),
]


@pytest.mark.parametrize("arch,name,edit,words", [c[1:] for c in PROCESSOR_CASES],
                         ids=[c[0] for c in PROCESSOR_CASES])
def test_bad_processor_file_names_the_file_and_field(tiny_checkpoint, tmp_path, capsys, arch, name, edit, words):
    folder = copy_of(tiny_checkpoint, arch, tmp_path / arch)
    edit(folder / name)
    line = error_line(mlxrl_main(["--model", str(folder)]), capsys.readouterr().err)
    assert str(folder / name) in line and words in line, line


def test_load_refuses_a_bad_preprocessor_config_with_a_config_error(tiny_checkpoint, tmp_path):
    folder = copy_of(tiny_checkpoint, "qwen3_vl", tmp_path / "vl")
    _json_edit(size=3)(folder / "preprocessor_config.json")
    with pytest.raises(ConfigError, match=r"preprocessor_config.json: size is 3, expected an object"):
        mlxrl.load(folder)


# ------------------------------------------------------------------------------- a full disk, tokenizer.json

@pytest.fixture
def full_disk_at_tokenizer(monkeypatch):
    """The tokenizer's writer fails as tokenizers' Rust `save` does on a full disk: a half-written
    tokenizer.json, then a bare Exception with the OS's words."""
    def save(self, save_directory, *args, **kwargs):
        (Path(save_directory) / "tokenizer.json").write_text('{"version": "1.0", "trunc')
        raise Exception("No space left on device (os error 28)")

    monkeypatch.setattr(tokenization_utils_tokenizers.TokenizersBackend, "_save_pretrained", save)


def test_full_disk_while_saving_the_tokenizer_with_python_m_mlxrl(tiny_checkpoint, tmp_path, capsys,
                                                                  full_disk_at_tokenizer):
    out = tmp_path / "saved"
    line = error_line(mlxrl_main(["--model", str(tiny_checkpoint("qwen3")), "--save", str(out)]),
                      capsys.readouterr().err)
    assert "no space left on device" in line and str(out) in line, line
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == []  # no temp folder left


@pytest.mark.parametrize("use_peft,what", [("true", "the LoRA adapter"), ("false", "the model")])
def test_full_disk_while_saving_the_tokenizer_at_the_end_of_sft(tiny_checkpoint, tmp_path, capsys, monkeypatch,
                                                               full_disk_at_tokenizer, use_peft, what):
    monkeypatch.chdir(tmp_path)
    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}] * 4
    Path("rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rc = sft_main(["--model", str(tiny_checkpoint("qwen3")), "--dataset", "rows.jsonl", "--max_steps", "1",
                   "--output_dir", "run", "--use_peft", use_peft, "--disable_tqdm"])
    line = error_line(rc, capsys.readouterr().err)
    assert f"cannot write {what}" in line and "no space left on device" in line, line
    assert not list(Path("run").rglob("tokenizer.json"))  # the half-written file went with the temp folder
