"""`python -m mlxrl.plan` refuses bad input in one line on stderr ("error: ..." naming the flag, the
--config file or the config.json field and what it accepts) with exit status 2, never a traceback, as the
trainers' CLIs do: bad config-field flags and YAML files, a damaged config.json in --model, --steps below 1,
and out-of-range or ignored image / prompt flags. Accepted edge values still plan.

    python3 -m pytest tests/test_probes_plan.py -q
"""

import json
import subprocess
import sys

import pytest

import mlxrl  # noqa: F401  (fast BLAS first)
from mlxrl import plan
from mlxrl.cli.plan import main as plan_main
from mlxrl.errors import MlxrlError
from mlxrl.loading import DEFAULT_CONFIG

# a small text model (the planner reads config.json only: no weights)
SMALL = {"model_type": "qwen3", "vocab_size": 1024, "hidden_size": 256, "intermediate_size": 768,
         "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}


def _run(argv, capsys) -> tuple[int, str]:
    try:
        code = plan_main(argv)
    except SystemExit as e:  # argparse
        code = e.code
    return code, capsys.readouterr().err


def _refused(argv, capsys, *needles) -> str:
    """`argv` exits 2 with one "error: ..." line on stderr that holds every needle."""
    code, err = _run(argv, capsys)
    lines = err.strip().splitlines()
    assert code == 2, (code, err)
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


# ------------------------------------------------------------------ 1. config fields: flags and --config YAML

FLAG_CASES = [
    (["--learning_rate", "-1"], ["--learning_rate -1", ">= 0"]),
    (["--max_length", "0"], ["--max_length 0", ">= 1"]),
    (["--lora_r", "0"], ["--lora_r 0", ">= 1"]),
    (["--trainer", "dpo", "--beta", "nan"], ["--beta"]),
    # the trainers' own checks (check_grpo_config / check_dpo_config), as their CLIs run them
    (["--trainer", "grpo", "--num_generations", "0"], ["num_generations", ">= 2"]),
    (["--trainer", "grpo", "--per_device_train_batch_size", "3"], ["divisible by num_generations"]),
    (["--trainer", "dpo", "--loss_type", "foo"], ["unknown loss_type", "sigmoid"]),
]


@pytest.mark.parametrize("argv,needles", FLAG_CASES, ids=[" ".join(c[0]) for c in FLAG_CASES])
def test_a_bad_config_flag_is_one_line(argv, needles, capsys):
    _refused(argv, capsys, *needles)


YAML_CASES = [
    ("unknown key", "learning_rat: 0.1\n", ["line 1", "unknown field 'learning_rat'", "learning_rate"]),
    ("wrong type", "learning_rate: fast\n", ["line 1", "learning_rate", "a number"]),
    ("a list value", "max_length: [1, 2]\n", ["max_length", "one value"]),
    ("not a mapping", "- learning_rate\n- 0.1\n", ["expected a mapping"]),
    ("out of range", "max_length: 0\n", ["max_length 0", ">= 1"]),
    ("syntax error", "max_length: [1\n", ["YAML syntax error"]),
]


@pytest.mark.parametrize("text,needles", [c[1:] for c in YAML_CASES], ids=[c[0] for c in YAML_CASES])
def test_a_bad_yaml_config_is_one_line(text, needles, tmp_path, capsys):
    path = tmp_path / "plan.yaml"
    path.write_text(text)
    line = _refused(["--config", str(path)], capsys, *needles)
    assert "--config" in line or "--max_length" in line, line  # the file, or the flag of the field it set


def test_a_missing_yaml_config_is_one_line(tmp_path, capsys):
    _refused(["--config", str(tmp_path / "absent.yaml")], capsys, "cannot read --config", "absent.yaml")


def test_a_bad_trainer_is_one_line(capsys):
    _refused(["--trainer", "ppo"], capsys, "--trainer", "invalid choice", "sft")


def test_mlxrl_debug_shows_the_traceback(monkeypatch):
    monkeypatch.setenv("MLXRL_DEBUG", "1")
    with pytest.raises(MlxrlError, match="--lora_r 0"):
        plan_main(["--lora_r", "0"])


def test_the_module_exits_2_with_one_line():
    """The real entry point (`python -m mlxrl.plan`): status 2, one line, no traceback."""
    out = subprocess.run([sys.executable, "-m", "mlxrl.plan", "--learning_rate", "-1"], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == ["error: --learning_rate -1: must be >= 0 (torch's AdamW refuses a "
                                               "negative learning rate)"], out.stderr


# ------------------------------------------------------------------ 2. a damaged config.json in --model

def _default_config() -> dict:
    cfg = json.loads(open(DEFAULT_CONFIG).read())
    cfg.pop("preprocessor_config", None)
    return cfg


def _with(base: dict, path: str, value) -> dict:
    """`base` with the field at `path` ("text_config.hidden_size") set to `value` (or removed: ...)."""
    cfg = json.loads(json.dumps(base))
    *parents, key = path.split(".")
    node = cfg
    for p in parents:
        node = node[p]
    if value is ...:
        node.pop(key)
    else:
        node[key] = value
    return cfg


VL = _default_config()
CONFIG_CASES = [  # (id, text of config.json, needles)
    ("not json", "hello", ["not valid JSON"]),
    ("truncated", json.dumps(SMALL)[:40], ["not valid JSON"]),
    ("a list", "[1, 2]", ["expected a JSON object", "array"]),
    ("a string", '"qwen3"', ["expected a JSON object", "string"]),
    ("no model_type", json.dumps(_with(SMALL, "model_type", ...)), ["no model_type"]),
    ("unsupported model_type", json.dumps(_with(SMALL, "model_type", "llama")), ["unsupported model_type 'llama'"]),
    ("hidden_size a string", json.dumps(_with(SMALL, "hidden_size", "big")), ["hidden_size", "positive integer",
                                                                              "'big'"]),
    ("hidden_size zero", json.dumps(_with(SMALL, "hidden_size", 0)), ["hidden_size", "positive integer", "got 0"]),
    ("hidden_size negative", json.dumps(_with(SMALL, "hidden_size", -4)), ["hidden_size", "got -4"]),
    ("hidden_size true", json.dumps(_with(SMALL, "hidden_size", True)), ["hidden_size", "got True"]),
    ("hidden_size fractional", json.dumps(_with(SMALL, "hidden_size", 1.5)), ["hidden_size", "got 1.5"]),
    ("vocab_size missing", json.dumps(_with(SMALL, "vocab_size", ...)), ["missing field vocab_size"]),
    ("layers null", json.dumps(_with(SMALL, "num_hidden_layers", None)), ["num_hidden_layers", "got None"]),
    ("head_dim zero", json.dumps(_with(SMALL, "head_dim", 0)), ["head_dim", "got 0"]),
    ("heads not a multiple of kv heads", json.dumps(_with(SMALL, "num_key_value_heads", 3)),
     ["num_attention_heads 4", "num_key_value_heads 3"]),
    ("tie_word_embeddings a string", json.dumps(_with(SMALL, "tie_word_embeddings", "yes")),
     ["tie_word_embeddings", "true or false"]),
    ("quantization bits a string", json.dumps(dict(SMALL, quantization={"bits": "four", "group_size": 64})),
     ["quantization.bits", "'four'"]),
    ("VL nested hidden_size", json.dumps(_with(VL, "text_config.hidden_size", "big")),
     ["text_config.hidden_size", "'big'"]),
    ("VL text_config a list", json.dumps(_with(VL, "text_config", [1])), ["text_config", "JSON object"]),
    ("VL vision_config missing", json.dumps(_with(VL, "vision_config", ...)), ["missing field vision_config"]),
    ("VL vision depth zero", json.dumps(_with(VL, "vision_config.depth", 0)), ["vision_config.depth", "got 0"]),
    ("VL vision patch_size a string", json.dumps(_with(VL, "vision_config.patch_size", "16")),
     ["vision_config.patch_size", "'16'"]),
]


@pytest.mark.parametrize("text,needles", [c[1:] for c in CONFIG_CASES], ids=[c[0] for c in CONFIG_CASES])
def test_a_damaged_config_json_is_one_line_naming_the_file(text, needles, tmp_path, capsys):
    (tmp_path / "config.json").write_text(text)
    _refused(["--model", str(tmp_path)], capsys, str(tmp_path / "config.json"), *needles)


def test_a_config_json_that_is_a_folder_is_one_line(tmp_path, capsys):
    (tmp_path / "config.json").mkdir()
    _refused(["--model", str(tmp_path)], capsys, "cannot read", "config.json")


def test_predict_refuses_a_damaged_config_json_by_name(tmp_path):
    """The API (`plan.predict(folder, ...)`, `plan.load_config`) names the file too, not a ZeroDivisionError."""
    from mlxrl.trainers.sft.config import SFTConfig

    (tmp_path / "config.json").write_text(json.dumps(_with(SMALL, "num_attention_heads", 0)))
    with pytest.raises(MlxrlError, match=r"config\.json: num_attention_heads must be a positive integer"):
        plan.predict(str(tmp_path), SFTConfig())


# ------------------------------------------------------------------ 3. --steps

@pytest.mark.parametrize("steps", ["0", "-1"])
def test_measure_with_steps_below_one_is_one_line(steps, capsys):
    _refused(["--measure", "--steps", steps], capsys, f"--steps {steps}", ">= 1")


def test_measure_runs_on_random_weights(capsys):
    """--measure builds a model from config.json alone (no folder, no name_or_path): the trainer's output_dir
    check once took the model object for a path ("File name too long")."""
    code, err = _run(["--measure", "--steps", "1"], capsys)
    assert code == 0 and "error" not in err, err


def test_sweep_without_measure_is_one_line(capsys):
    _refused(["--sweep"], capsys, "--sweep needs --measure")


# ------------------------------------------------------------------ 4. image and prompt flags

SHAPE_CASES = [
    (["--images", "-1", "--image_size", "448"], ["--images -1", ">= 0"]),
    (["--images", "1", "--image_size", "0"], ["--image_size 0", ">= 1"]),
    (["--images", "1", "--image_size", "-5"], ["--image_size -5", ">= 1"]),
    (["--images", "1"], ["--images 1 needs --image_size"]),
    (["--image_size", "448"], ["--image_size 448 needs --images"]),
    (["--images", "1", "--image_size", "8"], ["--image_size 8", ">= 32", "patch_size"]),  # no image token
    (["--trainer", "grpo", "--prompt_length", "0"], ["--prompt_length 0", ">= 1"]),
    (["--trainer", "grpo", "--prompt_length", "-3"], ["--prompt_length -3", ">= 1"]),
    (["--trainer", "dpo", "--prompt_length", "-3"], ["--prompt_length -3", ">= 0"]),
    (["--trainer", "dpo", "--max_length", "256", "--prompt_length", "256"],
     ["--prompt_length 256", "less than --max_length 256"]),
    (["--prompt_length", "64"], ["--prompt_length", "dpo and grpo"]),  # SFT would ignore it
]


@pytest.mark.parametrize("argv,needles", SHAPE_CASES, ids=[" ".join(c[0]) for c in SHAPE_CASES])
def test_a_bad_image_or_prompt_flag_is_one_line(argv, needles, capsys):
    _refused(argv, capsys, *needles)


def test_images_for_a_text_only_model_is_one_line(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(SMALL))
    _refused(["--model", str(tmp_path), "--images", "1", "--image_size", "448"], capsys, "--images 1",
             "text-only", "qwen3")


def test_the_edge_values_still_plan(tmp_path, capsys):
    """--images 0 (no image), DPO's --prompt_length 0 (every token scored) and the smallest image that
    makes a token are accepted; the folder's good config.json plans."""
    (tmp_path / "config.json").write_text(json.dumps(SMALL))
    for argv in (["--images", "0", "--model", str(tmp_path), "--max_length", "64"],
                 ["--trainer", "dpo", "--prompt_length", "0", "--model", str(tmp_path), "--max_length", "64"],
                 ["--images", "1", "--image_size", "32", "--max_length", "64"]):
        code, err = _run(argv, capsys)
        assert code == 0 and not err.strip(), (argv, code, err)
