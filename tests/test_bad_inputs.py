"""Bad input is one line on stderr, a non-zero exit, never a traceback, and nothing on disk is lost.

The probe table of issue 18 as parametrised cases: flags, YAML configs, datasets, model references and
GRPO reward functions, each run through the real CLI `main()` in-process (argparse's SystemExit
caught) or, for rewards, through the trainer's API (one `MlxrlError`). Property tests (hypothesis)
feed malformed rows to each trainer's data layer: every row is accepted or refused with one
MlxrlError naming it, never another exception. `BAD_INPUTS` counts what the cases try.

    python -m pytest -q tests/test_bad_inputs.py
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

import mlxrl
from mlxrl.cli.dpo import main as dpo_main
from mlxrl.cli.grpo import main as grpo_main
from mlxrl.cli.sft import main as sft_main
from mlxrl.data import load_rows, tokenize_example
from mlxrl.data.formats import ROLES, DataError, check_prompt_rows
from mlxrl.data.preference import tokenize_preference
from mlxrl.errors import MlxrlError
from mlxrl.processing.processor import (
    QWEN3_VL_CHAT_TEMPLATE,
    QWEN_CHAT_TEMPLATE,
    ImageProcessor,
    Processor,
    build_qwen_tokenizer,
)
from mlxrl.trainers.flags import build_parser, config_from_args
from mlxrl.trainers.grpo.trainer import GRPOConfig, GRPOTrainer, RewardError
from mlxrl.trainers.sft.config import SFTConfig

MAINS = {"sft": sft_main, "dpo": dpo_main, "grpo": grpo_main}


# ----------------------------------------------------------------------------------------- harness

def _snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def workspace(tmp_path, monkeypatch):
    """A user's folder: a file of theirs, the data files the cases use and an (empty) model folder.
    The CLIs run in it (relative paths, the default output_dir)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLXRL_DEBUG", raising=False)
    (tmp_path / "notes.txt").write_text("the user's own file\n")
    (tmp_path / "model").mkdir()  # exists, so the reference check passes and the data is what fails
    for name, content in FILES.items():
        (tmp_path / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    (tmp_path / "nodata").mkdir()
    (tmp_path / "nodata" / "readme.txt").write_text("no rows here")
    return tmp_path


def run_main(main, argv, capsys) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as e:  # argparse
        code = e.code
    return code, capsys.readouterr().err


def assert_one_line(code, err, needles, where: Path | None = None, before=None):
    lines = err.strip().splitlines()
    assert code not in (0, None), (code, err)
    assert len(lines) == 1, err
    assert "Traceback" not in err and lines[0].startswith("error: "), err
    for n in needles:
        assert n in lines[0], (n, lines[0])
    if where is not None:
        after = _snapshot(where)
        assert {k: after.get(k) for k in before} == before, "a file of the user's changed or vanished"
        assert not (where / "out").exists(), "an output folder was written for a run that never started"


def _rows(*rows) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def _msg(role, content):
    return {"role": role, "content": content}


GOOD_SFT = {"messages": [_msg("user", "hi"), _msg("assistant", "hello")]}
GOOD_PAIR = {"prompt": [_msg("user", "q")], "chosen": [_msg("assistant", "a")], "rejected": [_msg("assistant", "b")]}
FILES = {
    "good.jsonl": _rows(GOOD_SFT, GOOD_SFT),
    "content_number.jsonl": _rows(GOOD_SFT, {"messages": [_msg("user", 5), _msg("assistant", "x")]}),
    "role_unknown.jsonl": _rows({"messages": [_msg("bot", "hi"), _msg("assistant", "x")]}),
    "role_number.jsonl": _rows({"messages": [_msg(3, "hi"), _msg("assistant", "x")]}),
    "role_missing.jsonl": _rows({"messages": [{"content": "hi"}, _msg("assistant", "x")]}),
    "role_sharegpt.jsonl": _rows({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "x"}]}),
    "assistant_null.jsonl": _rows({"messages": [_msg("user", "hi"), _msg("assistant", None)]}),
    "block_text_number.jsonl": _rows({"messages": [_msg("user", [{"type": "text", "text": 7}])]}),
    "block_video.jsonl": _rows({"messages": [_msg("user", [{"type": "video"}]), _msg("assistant", "x")]}),
    "block_string.jsonl": _rows({"messages": [_msg("user", ["plain"]), _msg("assistant", "x")]}),
    "messages_empty.jsonl": _rows({"messages": []}),
    "text_number.jsonl": _rows({"text": 12}),
    "mixed_pc.jsonl": _rows({"prompt": "q", "completion": [_msg("assistant", "a")]}),
    "no_columns.jsonl": _rows({"foo": 1}),
    "row_number.json": "[1, 2, 3]",
    "bad_line3.jsonl": _rows(GOOD_SFT, GOOD_SFT) + '{"messages": [\n',
    "bad_array.json": '[\n  {"text": "a"},\n  {"text": "b",}\n]\n',
    "empty.jsonl": "",
    "blank.jsonl": "\n\n  \n",
    "latin1.jsonl": b'{"text": "caf\xe9"}\n',
    "corrupt.parquet": b"PAR1 this is not parquet",
    "data.csv": "text\nhello\n",
    "pair_chosen_only.jsonl": _rows({"chosen": "a"}),
    "pair_kinds.jsonl": _rows({"chosen": "a", "rejected": [_msg("assistant", "b")]}),
    "pair_null.jsonl": _rows(GOOD_PAIR, {**GOOD_PAIR, "rejected": [_msg("assistant", None)]}),
    "pair_prompt_number.jsonl": _rows({"prompt": 5, "chosen": "a", "rejected": "b"}),
    "pair_same.jsonl": _rows({"chosen": [_msg("user", "q"), _msg("assistant", "a")],
                              "rejected": [_msg("user", "q"), _msg("assistant", "a")]}),
    "grpo_no_prompt.jsonl": _rows({"question": "q"}),
    "grpo_empty_prompt.jsonl": _rows({"prompt": "  ", "answer": "a"}),
    "grpo_prompt_number.jsonl": _rows({"prompt": 3, "answer": "a"}),
    "grpo_columns.jsonl": _rows({"prompt": "q", "answer": "a"}, {"prompt": "q"}),
    "grpo_image_str.jsonl": _rows({"prompt": "q", "images": ["x.png"], "answer": "a"}),
    "grpo_role.jsonl": _rows({"prompt": [_msg("robot", "q")], "answer": "a"}),
    "rewards_syntax.py": "def f(prompts, completions, completion_ids, **kw)\n    return [0.0]\n",
    "rewards_raises.py": "import no_such_module_for_rewards\n",
    "rewards_zero.py": "x = 1 / 0\n",
    "cfg_two.yaml": "learning_rate: 1e-4\nmax_steps: two\n",
    "cfg_indent.yaml": "learning_rate: 1e-4\n  max_steps: 2\n",
    "cfg_unclosed.yaml": "lora_target_modules: [q_proj, k_proj\n",
    "cfg_unknown.yaml": "learning_rate: 1e-4\nlearnin_rate: 1\n",
    "cfg_list.yaml": "- learning_rate\n- 1e-4\n",
    "cfg_float_steps.yaml": "max_steps: 2.5\n",
    "cfg_list_value.yaml": "learning_rate: [1, 2]\n",
    "cfg_null.yaml": "output_dir:\n",
    "cfg_bool.yaml": "use_peft: maybe\n",
    "cfg_yes.yaml": "save_strategy: yes\n",
    "cfg_negative.yaml": "learning_rate: -1e-3\n",
    "cfg_binary.yaml": b"\xff\xfe\x00bad",
    "cfg_tab.yaml": "learning_rate:\t1e-4\n\tmax_steps: 2\n",
}

# (id, trainer, argv, words the line must hold)
FLAG_CASES = [
    ("abbreviation", "sft", ["--learning_rat", "1e-4"], ["unrecognized arguments: --learning_rat", "--help"]),
    ("unknown flag", "sft", ["--no_such_flag"], ["--no_such_flag", "--help"]),
    ("not an int", "sft", ["--max_steps", "x"], ["--max_steps", "invalid int"]),
    ("not a bool", "sft", ["--use_peft", "maybe"], ["--use_peft", "true/false"]),
    ("negative lr", "sft", ["--learning_rate=-1e-3"], ["--learning_rate", ">= 0"]),
    ("nan lr", "sft", ["--learning_rate", "nan"], ["--learning_rate", "finite"]),
    ("inf lr", "sft", ["--learning_rate", "inf"], ["--learning_rate", "finite"]),
    ("lora_r 0", "sft", ["--lora_r", "0"], ["--lora_r 0", ">= 1"]),
    ("lora_alpha 0", "sft", ["--lora_alpha", "0"], ["--lora_alpha", "> 0"]),
    ("lora_dropout 1", "sft", ["--lora_dropout", "1"], ["--lora_dropout", "[0, 1)"]),
    ("grad accum 0", "sft", ["--gradient_accumulation_steps", "0"], ["--gradient_accumulation_steps 0", ">= 1"]),
    ("batch 0", "sft", ["--per_device_train_batch_size", "0"], ["--per_device_train_batch_size", ">= 1"]),
    ("max_length 0", "sft", ["--max_length", "0"], ["--max_length 0", ">= 1"]),
    ("warmup_ratio 2", "sft", ["--warmup_ratio", "2"], ["--warmup_ratio 2", "[0, 1]"]),
    ("warmup_steps -1", "sft", ["--warmup_steps", "-1"], ["--warmup_steps", ">= 0"]),
    ("epochs 0", "sft", ["--num_train_epochs", "0"], ["--num_train_epochs 0", "> 0"]),
    ("max_steps 0", "sft", ["--max_steps", "0"], ["--max_steps 0", "-1"]),
    ("max_steps -3", "sft", ["--max_steps", "-3"], ["--max_steps -3"]),
    ("beta1 1", "sft", ["--adam_beta1", "1"], ["--adam_beta1", "[0, 1)"]),
    ("beta2 negative", "sft", ["--adam_beta2", "-0.1"], ["--adam_beta2", "[0, 1)"]),
    ("epsilon negative", "sft", ["--adam_epsilon", "-1e-8"], ["--adam_epsilon", ">= 0"]),
    ("weight decay negative", "sft", ["--weight_decay", "-1"], ["--weight_decay", ">= 0"]),
    ("clip negative", "sft", ["--max_grad_norm", "-1"], ["--max_grad_norm", ">= 0"]),
    ("logging_steps 0", "sft", ["--logging_steps", "0"], ["--logging_steps", ">= 1"]),
    ("save_steps negative", "sft", ["--save_steps", "-5"], ["--save_steps", "0 for no periodic checkpoints"]),
    ("save_total_limit 0", "sft", ["--save_total_limit", "0"], ["--save_total_limit", ">= 1"]),
    ("seed negative", "sft", ["--seed", "-1"], ["--seed", "2**32"]),
    ("eval_split 1", "sft", ["--eval_split", "1"], ["--eval_split", "[0, 1)"]),
    ("chunk_size 0", "sft", ["--chunk_size", "0"], ["--chunk_size", ">= 1"]),
    ("checkpoint_segments 1", "sft", ["--checkpoint_segments", "1"], ["--checkpoint_segments 1", "at least 2"]),
    ("segments over the layers", "sft", ["--checkpoint_segments", "4", "--gradient_checkpointing", "true"],
     ["checkpoint_segments 4", "between 2 and 3", "4 decoder layers"]),
    ("segments without checkpointing", "sft", ["--checkpoint_segments", "2", "--gradient_checkpointing", "false"],
     ["--checkpoint_segments", "turn --gradient_checkpointing on"]),
    ("segments and keep_attention", "sft", ["--checkpoint_segments", "2", "--keep_attention", "true",
                                            "--gradient_checkpointing", "true"],
     ["--keep_attention", "use one of them"]),
    ("seq_buckets 0", "sft", ["--seq_buckets", "64", "0"], ["--seq_buckets", ">= 1"]),
    ("memory_limit lots", "sft", ["--memory_limit", "lots"], ["--memory_limit 'lots'", "12GB"]),
    ("cache_limit 1.5", "sft", ["--cache_limit", "1.5"], ["--cache_limit", "fraction"]),
    ("wired_limit negative", "sft", ["--wired_limit", "-1GB"], ["--wired_limit"]),
    ("dtype float8", "sft", ["--dtype", "float8"], ["--dtype 'float8'", "bfloat16"]),
    ("dtype float16", "sft", ["--dtype", "float16"], ["float16 cannot train", "bfloat16"]),
    ("scheduler typo", "sft", ["--lr_scheduler_type", "cosin"], ["--lr_scheduler_type", "did you mean cosine"]),
    ("eval without data", "sft", ["--eval_strategy", "steps"], ["--eval_strategy steps", "--eval_dataset"]),
    ("eval_dataset alone", "sft", ["--eval_dataset", "good.jsonl"], ["--eval_dataset needs --dataset"]),
    ("sft loss_type", "sft", ["--loss_type", "sigmoid"], ["--loss_type 'sigmoid'", "nll"]),
    ("packing strategy", "sft", ["--packing_strategy", "ffd"], ["--packing_strategy"]),
    ("optim", "sft", ["--optim", "paged_adamw_8bit"], ["optim 'paged_adamw_8bit'"]),
    ("deepspeed", "sft", ["--deepspeed", "ds.json"], ["--deepspeed='ds.json' is not supported", "mx.distributed"]),
    ("fp16", "sft", ["--fp16"], ["--fp16=True is not supported", "--bf16"]),
    ("bf16 against dtype", "sft", ["--bf16", "true", "--dtype", "float32"], ["bf16=True contradicts dtype"]),
    ("scheduler kwargs text", "sft", ["--lr_scheduler_kwargs", "min_lr=0.1"], ["lr_scheduler_kwargs", "JSON object"]),
    ("scheduler kwargs option", "sft", ["--lr_scheduler_type", "cosine", "--lr_scheduler_kwargs", '{"power": 2}'],
     ["'power' not an option of the cosine schedule"]),
    ("pad multiple 0", "sft", ["--pad_to_multiple_of", "0"], ["--pad_to_multiple_of '0'", "positive integer"]),
    ("best model without eval", "sft", ["--load_best_model_at_end"], ["--load_best_model_at_end needs --eval"]),
    ("neftune 0", "sft", ["--neftune_noise_alpha", "0"], ["--neftune_noise_alpha 0", "> 0"]),
    ("checkpointing kwargs", "sft", ["--gradient_checkpointing_kwargs", '{"preserve_rng_state": true}'],
     ["gradient_checkpointing_kwargs", "use_reentrant"]),
    ("dpo neftune", "dpo", ["--neftune_noise_alpha", "5"], ["--neftune_noise_alpha=5.0 is not supported", "SFT"]),
    ("dpo beta 0", "dpo", ["--beta", "0"], ["--beta 0", "> 0"]),
    ("dpo beta negative", "dpo", ["--beta", "-1"], ["--beta -1", "> 0"]),
    ("dpo label_smoothing", "dpo", ["--label_smoothing", "0.5"], ["--label_smoothing", "[0, 0.5)"]),
    ("dpo ld_alpha", "dpo", ["--ld_alpha", "2"], ["--ld_alpha", "[0, 1]"]),
    ("dpo discopop_tau", "dpo", ["--discopop_tau", "0"], ["--discopop_tau", "> 0"]),
    ("dpo sft_steps", "dpo", ["--sft_steps", "-1"], ["--sft_steps -1"]),
    ("dpo loss_weights nan", "dpo", ["--loss_weights", "nan"], ["--loss_weights", "finite"]),
    ("grpo epsilon 1", "grpo", ["--epsilon", "1"], ["--epsilon 1", "[0, 1)"]),
    ("grpo epsilon_high", "grpo", ["--epsilon_high", "-0.1"], ["--epsilon_high", ">= 0"]),
    ("grpo delta", "grpo", ["--delta", "0.5"], ["--delta 0.5", "> 1"]),
    ("grpo temperature 0", "grpo", ["--temperature", "0"], ["temperature must be > 0"]),
    ("grpo temperature nan", "grpo", ["--temperature", "nan"], ["--temperature", "finite"]),
    ("grpo one generation", "grpo", ["--num_generations", "1"], ["num_generations must be >= 2"]),
    ("grpo completion 0", "grpo", ["--max_completion_length", "0"], ["max_completion_length must be >= 1"]),
    ("grpo top_k", "grpo", ["--top_k", "-1"], ["top_k must be >= 0"]),
    ("grpo beta", "grpo", ["--beta", "-0.1"], ["beta must be >= 0"]),
    ("grpo reward_weights", "grpo", ["--reward_weights", "inf"], ["--reward_weights", "finite"]),
    ("grpo sapo", "grpo", ["--sapo_temperature_pos", "0"], ["--sapo_temperature_pos", "> 0"]),
    ("grpo steps_per_generation", "grpo", ["--steps_per_generation", "0"], ["--steps_per_generation", ">= 1"]),
]

YAML_CASES = [
    ("yaml bad int", "cfg_two.yaml", ["cfg_two.yaml line 2", "max_steps", "'two'"]),
    ("yaml indentation", "cfg_indent.yaml", ["cfg_indent.yaml line 2", "YAML syntax error"]),
    ("yaml unclosed", "cfg_unclosed.yaml", ["cfg_unclosed.yaml line 2", "YAML syntax error"]),
    ("yaml unknown field", "cfg_unknown.yaml", ["cfg_unknown.yaml line 2", "learnin_rate", "learning_rate?"]),
    ("yaml not a mapping", "cfg_list.yaml", ["cfg_list.yaml", "mapping"]),
    ("yaml fractional steps", "cfg_float_steps.yaml", ["line 1", "max_steps", "2.5"]),
    ("yaml list for a number", "cfg_list_value.yaml", ["line 1", "learning_rate", "one value"]),
    ("yaml null", "cfg_null.yaml", ["line 1", "output_dir", "required"]),
    ("yaml bad bool", "cfg_bool.yaml", ["line 1", "use_peft", "'maybe'"]),
    ("yaml yes for text", "cfg_yes.yaml", ["line 1", "save_strategy", "quote it"]),
    ("yaml out of range", "cfg_negative.yaml", ["--learning_rate -0.001", ">= 0"]),
    ("yaml not text", "cfg_binary.yaml", ["cfg_binary.yaml"]),
    ("yaml tab", "cfg_tab.yaml", ["cfg_tab.yaml line 1", "YAML syntax error"]),
    ("yaml missing", "no_such.yaml", ["cannot read --config no_such.yaml"]),
]

# (id, trainer, dataset, extra argv, words)
DATA_CASES = [
    ("content a number", "sft", "content_number.jsonl", [], ["row 1", "'messages' message 0", "content 5"]),
    ("unknown role", "sft", "role_unknown.jsonl", [], ["row 0", "role 'bot'", "user"]),
    ("numeric role", "sft", "role_number.jsonl", [], ["row 0", "role 3"]),
    ("missing role", "sft", "role_missing.jsonl", [], ["row 0", "no 'role'"]),
    ("sharegpt roles", "sft", "role_sharegpt.jsonl", [], ["row 0", "'human'", "user/assistant"]),
    ("null assistant", "sft", "assistant_null.jsonl", [], ["row 0", "message 1 (assistant)", "null"]),
    ("text block not text", "sft", "block_text_number.jsonl", [], ["row 0", "block 0", "string"]),
    ("video block", "sft", "block_video.jsonl", [], ["row 0", "'video'"]),
    ("bare string block", "sft", "block_string.jsonl", [], ["row 0", "block 0"]),
    ("empty messages", "sft", "messages_empty.jsonl", [], ["row 0", "non-empty"]),
    ("text not a string", "sft", "text_number.jsonl", [], ["row 0", "'text' must be a string"]),
    ("mixed prompt/completion", "sft", "mixed_pc.jsonl", [], ["row 0", "both"]),
    ("no known columns", "sft", "no_columns.jsonl", [], ["row 0", "'foo'"]),
    ("rows not objects", "sft", "row_number.json", [], ["row 0", "dict"]),
    ("jsonl bad line", "sft", "bad_line3.jsonl", [], ["bad_line3.jsonl", "line 3", "invalid JSON"]),
    ("json bad array", "sft", "bad_array.json", [], ["bad_array.json", "line 3", "invalid JSON"]),
    ("empty file", "sft", "empty.jsonl", [], ["empty.jsonl", "no rows"]),
    ("blank lines", "sft", "blank.jsonl", [], ["blank.jsonl", "no rows"]),
    ("not utf-8", "sft", "latin1.jsonl", [], ["latin1.jsonl", "line 1", "UTF-8"]),
    ("corrupt parquet", "sft", "corrupt.parquet", [], ["corrupt.parquet", "Parquet"]),
    ("csv", "sft", "data.csv", [], ["data.csv", "unsupported file type"]),
    ("missing file", "sft", "missing.jsonl", [], ["missing.jsonl", "no such file"]),
    ("folder without data", "sft", "nodata", [], ["nodata", "no .json"]),
    ("bad eval rows", "sft", "good.jsonl", ["--eval_dataset", "role_unknown.jsonl"],
     ["--eval_dataset role_unknown.jsonl", "row 0"]),
    ("pair missing rejected", "dpo", "pair_chosen_only.jsonl", [], ["row 0", "'rejected'"]),
    ("pair kinds differ", "dpo", "pair_kinds.jsonl", [], ["row 0", "both be strings or both"]),
    ("pair null content", "dpo", "pair_null.jsonl", [], ["row 1", "'rejected' message 0", "null"]),
    ("pair prompt number", "dpo", "pair_prompt_number.jsonl", [], ["row 0", "'prompt'"]),
    ("pair identical", "dpo", "pair_same.jsonl", [], ["row 0", "at least one message"]),
    ("grpo no prompt", "grpo", "grpo_no_prompt.jsonl", [], ["row 0", "'prompt'"]),
    ("grpo empty prompt", "grpo", "grpo_empty_prompt.jsonl", [], ["row 0", "empty"]),
    ("grpo prompt number", "grpo", "grpo_prompt_number.jsonl", [], ["row 0", "'prompt' is 3"]),
    ("grpo ragged columns", "grpo", "grpo_columns.jsonl", [], ["row 1", "'answer'"]),
    ("grpo images with text", "grpo", "grpo_image_str.jsonl", [], ["row 0", "conversational prompt"]),
    ("grpo unknown role", "grpo", "grpo_role.jsonl", [], ["row 0", "'robot'"]),
]

# --reward_funcs specs that fail before any model loads
REWARD_IMPORT_CASES = [
    ("reward syntax error", "rewards_syntax.py:f", ["rewards_syntax.py", "line 1", "syntax error"]),
    ("reward module import fails", "rewards_raises.py:f", ["rewards_raises.py", "no_such_module_for_rewards"]),
    ("reward module raises", "rewards_zero.py:f", ["rewards_zero.py", "ZeroDivisionError"]),
    ("reward file missing", "missing_rewards.py:f", ["missing_rewards.py", "no such file"]),
    ("reward module missing", "no_such_rewards_mod:f", ["cannot import 'no_such_rewards_mod'"]),
    ("reward function missing", "mlxrl.grpo:nothing", ["no callable 'nothing'"]),
    ("reward spec", "justaname", ["'justaname' is not module:function, and as a reward model: no such local path"]),
]


@pytest.mark.parametrize("trainer,argv,needles", [c[1:] for c in FLAG_CASES], ids=[c[0] for c in FLAG_CASES])
def test_flags(trainer, argv, needles, workspace, capsys):
    before = _snapshot(workspace)
    code, err = run_main(MAINS[trainer], argv, capsys)
    assert_one_line(code, err, needles, workspace, before)


@pytest.mark.parametrize("name,needles", [c[1:] for c in YAML_CASES], ids=[c[0] for c in YAML_CASES])
def test_yaml(name, needles, workspace, capsys):
    before = _snapshot(workspace)
    code, err = run_main(sft_main, ["--config", name], capsys)
    assert_one_line(code, err, needles, workspace, before)


@pytest.mark.parametrize("trainer,dataset,extra,needles", [c[1:] for c in DATA_CASES], ids=[c[0] for c in DATA_CASES])
def test_data(trainer, dataset, extra, needles, workspace, capsys):
    before = _snapshot(workspace)
    argv = ["--model", "model", "--dataset", dataset, *extra]
    if trainer == "grpo":
        argv += ["--reward_funcs", "mlxrl.grpo:colour_reward"]
    code, err = run_main(MAINS[trainer], argv, capsys)
    assert_one_line(code, err, needles, workspace, before)


@pytest.mark.parametrize("spec,needles", [c[1:] for c in REWARD_IMPORT_CASES], ids=[c[0] for c in REWARD_IMPORT_CASES])
def test_reward_imports(spec, needles, workspace, capsys):
    before = _snapshot(workspace)
    code, err = run_main(grpo_main, ["--model", "model", "--dataset", "good.jsonl", "--reward_funcs", spec], capsys)
    assert_one_line(code, err, needles, workspace, before)


def test_yaml_values_are_coerced_by_field_type(tmp_path):
    """What used to crash after the model loaded (PyYAML reads 1e-4 as a string) or was split into characters."""
    cfg = tmp_path / "ok.yaml"
    cfg.write_text('learning_rate: 1e-4\nmax_steps: "2"\nlora_target_modules: q_proj\nseq_buckets: "512"\n'
                   "eval_strategy: no\nuse_peft: yes\nreport_to: [none]\nnum_train_epochs: 2\nmemory_limit: 12GB\n")
    parser = build_parser(SFTConfig, "t", "")
    args = config_from_args(SFTConfig, parser.parse_args(["--config", str(cfg), "--max_steps", "3"]))
    assert args.learning_rate == 1e-4 and isinstance(args.learning_rate, float)
    assert args.max_steps == 3  # the flag overrides the file
    assert args.lora_target_modules == ["q_proj"] and args.seq_buckets == [512]
    assert args.eval_strategy == "no" and args.use_peft is True and args.report_to == "none"
    assert args.num_train_epochs == 2.0 and isinstance(args.num_train_epochs, float)
    args = config_from_args(SFTConfig, parser.parse_args(["--config", str(cfg)]))
    assert args.max_steps == 2 and isinstance(args.max_steps, int)


def test_output_dir_inside_a_folder_dataset_is_not_read(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text(_rows(GOOD_SFT, GOOD_SFT, GOOD_SFT))
    run = data / "out"  # an earlier run's output_dir, and a checkpoint and a saved model inside it
    (run / "checkpoint-2").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    (run / "checkpoint-2" / "trainer_state.json").write_text('{"global_step": 2}')
    (run / "final").mkdir()
    (run / "final" / "config.json").write_text('{"model_type": "qwen3"}')
    (data / ".hidden.jsonl").write_text(_rows({"text": "not data"}))
    assert load_rows(data) == [GOOD_SFT] * 3
    assert load_rows(data, exclude=[str(run)]) == [GOOD_SFT] * 3
    (data / "more").mkdir()
    (data / "more" / "extra.jsonl").write_text(_rows({"text": "more"}))
    assert load_rows(data) == [{"text": "more"}] + [GOOD_SFT] * 3  # files in path order: more/, train.jsonl
    assert load_rows(data, exclude=[str(data / "more")]) == [GOOD_SFT] * 3  # the run's output_dir, before it has files


# ------------------------------------------------------------------------------------------- models

@pytest.fixture
def broken_model(tiny_checkpoint, workspace, capsys):
    def make(edit):
        tiny_checkpoint("qwen3")
        capsys.readouterr()  # what building the checkpoint printed
        folder = workspace / "broken"
        if folder.exists():
            shutil.rmtree(folder)
        shutil.copytree(tiny_checkpoint("qwen3"), folder)
        path = folder / "config.json"
        edit(path, json.loads(path.read_text()))
        return folder
    return make


def _drop(*keys):
    def edit(path, cfg):
        for k in keys:
            cfg.pop(k, None)
        path.write_text(json.dumps(cfg))
    return edit


def _set(**values):
    def edit(path, cfg):
        cfg.update(values)
        path.write_text(json.dumps(cfg))
    return edit


MODEL_CASES = [
    ("config missing fields", _drop("hidden_size", "vocab_size"), ["config.json", "missing field(s) hidden_size"]),
    ("config wrong type", _set(hidden_size="64"), ["config.json", "qwen3"]),
    ("config unsupported type", _set(model_type="llama"), ["config.json", "unsupported model_type 'llama'"]),
    ("config not json", lambda p, c: p.write_text("{oops"), ["config.json", "not valid JSON"]),
    ("config a list", lambda p, c: p.write_text("[1, 2]"), ["config.json", "JSON object"]),
    ("rope type dynamic", _set(rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
     ["config.json", "rope type 'dynamic' is not supported yet", "yarn"]),
]


@pytest.mark.parametrize("edit,needles", [c[1:] for c in MODEL_CASES], ids=[c[0] for c in MODEL_CASES])
def test_model_configs(edit, needles, broken_model, workspace, capsys):
    folder = broken_model(edit)
    before = _snapshot(workspace)
    code, err = run_main(sft_main, ["--model", str(folder), "--dataset", "good.jsonl"], capsys)
    assert_one_line(code, err, needles, workspace, before)


def test_a_device_failure_while_building_is_not_blamed_on_the_config(broken_model, workspace, capsys, monkeypatch):
    """MLX's device failing while the model is built (as a CUDA error did on a GPU): one line saying so, not a
    damaged config.json."""
    import mlxrl.models as models

    class Fails:
        def __init__(self, config):
            raise RuntimeError("cudaMallocManaged(&data, size) failed: an illegal memory access was encountered")

    folder = broken_model(lambda path, cfg: None)
    monkeypatch.setattr(models, "model_class", lambda config: Fails)
    before = _snapshot(workspace)
    code, err = run_main(sft_main, ["--model", str(folder), "--dataset", "good.jsonl"], capsys)
    assert_one_line(code, err, ["building the qwen3 model failed on", "illegal memory access"], workspace, before)
    assert "config.json" not in err and "damaged" not in err, err


MODEL_REFERENCE_CASES = [
    ("never-published size", ["--model", "Qwen/Qwen3-VL-3B-Instruct"],
     ["Qwen3-VL comes in 2B/4B/8B/32B", "Qwen/Qwen3-VL-2B-Instruct", "Qwen/Qwen3-VL-4B-Instruct"]),
    ("never-published size with data", ["--model", "Qwen/Qwen2.5-VL-4B-Instruct", "--dataset", "role_unknown.jsonl"],
     ["Qwen2.5-VL comes in", "Qwen/Qwen2.5-VL-3B-Instruct"]),
    ("invalid hub id", ["--model", "Qwen/Qwen3 VL"], ["nor a valid Hub id"]),
    ("model is a file", ["--model", "notes.txt"], ["notes.txt is a file"]),
    ("no such folder", ["--model", "./nope"], ["no such local path: ./nope"]),
    ("not a model folder", ["--model", "nodata"], ["nodata has no config.json"]),
    ("not cached offline", ["--model", "someone/not-cached"], ["someone/not-cached", "HF_HUB_OFFLINE"]),
]


@pytest.mark.parametrize("argv,needles", [c[1:] for c in MODEL_REFERENCE_CASES],
                         ids=[c[0] for c in MODEL_REFERENCE_CASES])
def test_model_references(argv, needles, workspace, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(workspace / ".hf"))
    before = _snapshot(workspace)
    code, err = run_main(sft_main, argv, capsys)
    assert_one_line(code, err, needles, workspace, before)


def test_real_processes_exit_2_with_one_line(tmp_path):
    """The real process (argparse's exit and the trainer CLI's): status 2, one line, no usage dump."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(mlxrl.__file__).parents[1]),
                                                        os.environ.get("PYTHONPATH")]))}
    env.pop("MLXRL_DEBUG", None)
    for argv, needle in [(["mlxrl.sft", "--learning_rat", "1"], "unrecognized arguments: --learning_rat"),
                         (["mlxrl.sft", "--model", "Qwen/Qwen3-VL-3B-Instruct"], "nearest: Qwen/Qwen3-VL-2B")]:
        out = subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True, cwd=tmp_path, env=env)
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2 and len(lines) == 1 and needle in lines[0], out.stderr
    assert not (tmp_path / "out").exists()


def test_model_without_dataset_trains_it_on_the_embedded_task(tiny_checkpoint, tmp_path, capsys):
    """`--model` without `--dataset`: the model is checked first and then trained briefly on the embedded
    task; a text-only model gets its text variant (the tiny text checkpoint has no image processor)."""
    out = tmp_path / "smoke"
    code = sft_main(["--model", str(tiny_checkpoint("qwen3")), "--max_steps", "2", "--output_dir", str(out),
                     "--disable_tqdm"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "synthetic colour task in words" in printed and "held-out exact match after training" in printed
    assert (out / "adapter_config.json").exists() or any(out.rglob("adapter_config.json"))


# ------------------------------------------------------------------------------------------ rewards

TEXT_ROWS = [{"prompt": "The sky is", "topic": "sky"}, {"prompt": "One plus one is", "topic": "maths"}]


@pytest.fixture(scope="module")
def grpo_trainer(tiny_checkpoint, tmp_path_factory):
    model, processor = mlxrl.load(tiny_checkpoint("qwen3"))
    args = GRPOConfig(output_dir=str(tmp_path_factory.mktemp("grpo") / "run"), gradient_checkpointing=False,
                      compile=False, disable_tqdm=True, save_steps=0, per_device_train_batch_size=4,
                      num_generations=4, max_completion_length=3, seed=0)

    def fine(prompts, completions, completion_ids, **kwargs):
        return [float(len(c)) for c in completion_ids]

    return GRPOTrainer(model, processor, args, train_dataset=TEXT_ROWS, reward_funcs=[fine])


def _reward(body):
    def reward(prompts, completions, completion_ids, **kwargs):
        return body(len(prompts))
    return reward


def _raise(n):
    raise KeyError("answer")


REWARD_CASES = [
    ("raises", _raise, ["'reward' raised KeyError", "answer"]),
    ("returns a scalar", lambda n: 1.0, ["'reward' returned float 1.0", "list of 4 rewards"]),
    ("returns None", lambda n: None, ["'reward' returned NoneType", "list of 4"]),
    ("None for the whole batch", lambda n: [None] * n, ["returned None for every completion", "reward"]),
    ("strings", lambda n: ["1.0"] * n, ["'reward' returned str '1.0' for completion 0", "numbers"]),
    ("a dict", lambda n: {"a": 1.0}, ["'reward' returned dict"]),
    ("NaN", lambda n: [0.0, 1.0, float("nan")] + [0.0] * (n - 3), ["'reward' returned nan for completion 2", "None"]),
    ("inf", lambda n: [float("-inf")] * n, ["'reward' returned -inf for completion 0"]),
    ("wrong length", lambda n: [1.0] * (n - 1), ["'reward' returned 3 rewards for 4 completions"]),
    ("2-D array", lambda n: np.ones((n, 2)), ["'reward' returned an array of shape (4, 2)"]),
    ("list of lists", lambda n: [[1.0]] * n, ["'reward' returned list [1.0] for completion 0"]),
]


@pytest.mark.parametrize("body,needles", [c[1:] for c in REWARD_CASES], ids=[c[0] for c in REWARD_CASES])
def test_rewards(body, needles, grpo_trainer):
    trainer = grpo_trainer
    trainer.reward_funcs, trainer.reward_func_names = [_reward(body)], ["reward"]
    with pytest.raises(MlxrlError) as info:
        trainer.generate_round(0)
    message = str(info.value)
    assert "\n" not in message and isinstance(info.value, RewardError), message
    for n in needles:
        assert n in message, (n, message)


def test_reward_values_tolerated_as_trl_does(grpo_trainer):
    """None per completion (the reward does not apply), numpy scalars, bools, arrays and a function that applies
    to no completion of the round next to one that does: accepted, and nothing NaN is logged."""
    trainer = grpo_trainer

    def partial(prompts, completions, completion_ids, **kwargs):
        return [None if i % 2 else np.float32(i) for i in range(len(prompts))]

    def never(prompts, completions, completion_ids, **kwargs):
        return [None] * len(prompts)

    def flags(prompts, completions, completion_ids, **kwargs):
        return np.array([i % 3 == 0 for i in range(len(prompts))])

    trainer.reward_funcs, trainer.reward_func_names = [partial, never, flags], ["partial", "never", "flags"]
    _, metrics = trainer.generate_round(0)
    assert all(np.isfinite(v) for v in metrics.values()), metrics
    assert "rewards/never/mean" not in metrics and abs(metrics["rewards/partial/mean"] - 1.0) < 1e-6  # (0 + 2) / 2


def test_reward_signature_checked_before_training(grpo_trainer):
    def narrow(prompts, completions):
        return [0.0] * len(prompts)

    with pytest.raises(RewardError, match="reward function 'narrow' cannot be called as TRL calls it"):
        GRPOTrainer(grpo_trainer.model, grpo_trainer.processor, grpo_trainer.args, train_dataset=TEXT_ROWS,
                    reward_funcs=[narrow])


# ------------------------------------------------------------------------- property tests (hypothesis)

TEXT = Processor(build_qwen_tokenizer(), None, QWEN_CHAT_TEMPLATE)
VL = Processor(TEXT.tokenizer, ImageProcessor.from_dict(dict(min_pixels=32 * 32, max_pixels=64 * 64, patch_size=16)),
               QWEN3_VL_CHAT_TEMPLATE)
IMAGE = Image.new("RGB", (40, 36), (200, 30, 30))

# Rows near the valid formats (so the deep paths run: templates, images, truncation, masks) with every part
# sometimes malformed, and now and then a row of junk.
def mostly(good, bad, tenths: int = 8):
    """`good` in `tenths` of ten draws, else `bad`."""
    return st.integers(0, 9).flatmap(lambda k: good if k < tenths else bad)


scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.floats(allow_nan=True, width=32),
                    st.text(max_size=6))
texts = st.text(max_size=12)
role = mostly(st.sampled_from(ROLES), st.one_of(st.sampled_from(["bot", "human", "gpt", "", "USER"]), scalars))
text_block = st.fixed_dictionaries({"type": st.just("text"), "text": texts})
image_block = st.sampled_from([{"type": "image"}, {"image": None}])
bad_block = st.one_of(st.fixed_dictionaries({}, optional={"type": st.sampled_from(["text", "video", 3, None]),
                                                          "text": scalars}), scalars)
content = mostly(st.one_of(texts, st.lists(st.one_of(text_block, text_block, image_block), max_size=3)),
                 st.one_of(st.lists(st.one_of(text_block, image_block, bad_block), min_size=1, max_size=3), scalars))
tool_calls = st.lists(st.one_of(st.fixed_dictionaries({"function": st.fixed_dictionaries(
    {"name": st.one_of(texts, scalars),
     "arguments": st.one_of(texts, st.dictionaries(st.text(max_size=3), scalars, max_size=2))})}), scalars),
    min_size=1, max_size=2)
message = mostly(st.fixed_dictionaries({"role": role, "content": content}), st.one_of(
    st.fixed_dictionaries({"role": st.just("assistant"), "content": st.one_of(st.none(), texts),
                           "tool_calls": tool_calls}),
    st.fixed_dictionaries({"from": role, "value": content}),
    st.fixed_dictionaries({}, optional={"role": role, "content": content, "value": content}),
    scalars))
conversation = mostly(st.lists(message, min_size=1, max_size=4), st.one_of(st.lists(message, max_size=0), scalars),
                      tenths=9)
images = mostly(st.none(), st.one_of(
    st.lists(st.just(IMAGE), min_size=1, max_size=2), st.just(IMAGE),
    st.lists(st.one_of(st.just(IMAGE), st.just("no/such.png"), st.integers(0, 3), st.just({"bytes": b"not an image"}),
                       st.just({})), min_size=1, max_size=2)), tenths=6)
extras = {"tools": st.one_of(st.text(max_size=6), scalars, st.lists(st.dictionaries(st.text(max_size=3), scalars),
                                                                    max_size=2)),
          "chat_template_kwargs": st.one_of(scalars, st.dictionaries(
              st.sampled_from(["enable_thinking", "tokenize", "add_generation_prompt", "x"]), scalars, max_size=2))}
junk_row = st.one_of(scalars, st.dictionaries(st.sampled_from(["messages", "prompt", "completion", "text", "chosen",
                                                               "rejected", "images", "foo"]), scalars, max_size=3))


def _rows_of(*shapes):
    """Rows of the given {column: strategy} shapes (extra columns sometimes), or junk now and then."""
    rows = st.one_of(*[mostly(st.fixed_dictionaries({**shape, "images": images}),
                              st.fixed_dictionaries({**shape, "images": images}, optional=extras)) for shape in shapes])
    return mostly(rows, junk_row, tenths=9)


sft_rows = _rows_of({"messages": conversation}, {"conversations": conversation},
                    {"prompt": conversation, "completion": conversation},
                    {"prompt": mostly(texts, scalars), "completion": mostly(texts, scalars)},
                    {"text": mostly(texts, scalars)})
pair_rows = _rows_of({"prompt": conversation, "chosen": conversation, "rejected": conversation},
                     {"chosen": conversation, "rejected": conversation},
                     {"prompt": mostly(texts, scalars), "chosen": texts, "rejected": mostly(texts, scalars)},
                     {"chosen": mostly(texts, conversation), "rejected": mostly(texts, conversation)})
prompt_rows = _rows_of({"prompt": conversation, "answer": scalars}, {"prompt": mostly(texts, scalars)},
                       {"prompt": conversation})
PROPERTY = settings(max_examples=400, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _accepted_or_names_the_row(fn, index):
    try:
        return fn()
    except MlxrlError as e:
        message = str(e)
        assert f"row {index}" in message and "\n" not in message, message
        return None


@PROPERTY
@given(row=sft_rows, vl=st.booleans(), max_length=st.sampled_from([None, 8, 64]), index=st.integers(0, 99),
       assistant_only=st.booleans())
def test_property_sft_rows(row, vl, max_length, index, assistant_only):
    _accepted_or_names_the_row(lambda: tokenize_example(row, VL if vl else TEXT, index=index, max_length=max_length,
                                                        assistant_only_loss=assistant_only), index)


@PROPERTY
@given(row=pair_rows, vl=st.booleans(), max_length=st.sampled_from([None, 8, 64]), index=st.integers(0, 99))
def test_property_preference_rows(row, vl, max_length, index):
    _accepted_or_names_the_row(lambda: tokenize_preference(row, VL if vl else TEXT, index=index,
                                                           max_length=max_length), index)


@PROPERTY
@given(rows=st.lists(prompt_rows, min_size=1, max_size=3), vl=st.booleans())
def test_property_grpo_prompt_rows(rows, vl):
    """GRPO's data layer: the rows are checked up front (`check_prompt_rows`, a DataError naming the row) and
    every accepted row renders (the trainer's own `_render`)."""
    try:
        check_prompt_rows(rows)
    except DataError as e:
        assert "row " in str(e) and "\n" not in str(e), str(e)
        return
    trainer = SimpleNamespace(processor=VL if vl else TEXT, environments=None, toolbox=None)
    for i, row in enumerate(rows):
        _accepted_or_names_the_row(lambda row=row, i=i: GRPOTrainer._render(trainer, row, i), i)


# The probes tried above (README: "bad inputs tried").
BAD_INPUTS = (len(FLAG_CASES) + len(YAML_CASES) + len(DATA_CASES) + len(REWARD_IMPORT_CASES) + len(MODEL_CASES)
              + len(MODEL_REFERENCE_CASES) + len(REWARD_CASES) + 2 + 1)  # + processes, + narrow signature


@pytest.mark.parametrize("name", ["sft", "dpo", "grpo", "plan", "generate"])
def test_every_cli_prints_its_help(name, capsys):
    """argparse formats each flag's help with %: a stray percent sign in a config field's help made
    `--help` a traceback."""
    import importlib

    module = importlib.import_module(f"mlxrl.{name}" if name != "plan" else "mlxrl.cli.plan")
    with pytest.raises(SystemExit) as e:
        module.main(["--help"])
    assert e.value.code == 0 and "--" in capsys.readouterr().out
