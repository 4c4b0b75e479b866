"""mlx-lm's LoRA command line for `python -m mlxrl.sft` (issue 49): a folder of split files is read split by split
(never merged: validation rows are evaluated and never trained, test rows never trained), --dataset_split picks a
split, mlx-lm's flags, YAML keys and defaults map onto SFTConfig (compared with mlx-lm's own parser, defaults and
row tokenisation), and what cannot be honoured is one line. CLI runs are in-process on the tiny Qwen3.

    python -m pytest -q tests/test_mlx_lm_cli.py
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from mlxrl.cli import common as cli_lib
from mlxrl.cli import mlx_lm_args
from mlxrl.cli.sft import configure, main, make_parser
from mlxrl.data import load_rows
from mlxrl.data.files import folder_splits
from mlxrl.trainers.sft import trainer as sft_trainer

FAST = ["--max-seq-length", "64", "--compile", "false", "--disable_tqdm", "true"]


def chat(tag: str, i: int) -> dict:
    return {"messages": [{"role": "user", "content": f"{tag} question {i}"},
                         {"role": "assistant", "content": f"{tag} answer {i}"}]}


def write(path: Path, rows) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def mlx_data(tmp_path) -> Path:
    """mlx-lm's data folder: 8 train rows, 4 valid rows, 4 test rows, each row saying which file it is in."""
    folder = tmp_path / "data"
    write(folder / "train.jsonl", [chat("train", i) for i in range(8)])
    write(folder / "valid.jsonl", [chat("valid", i) for i in range(4)])
    write(folder / "test.jsonl", [chat("test", i) for i in range(4)])
    return folder


@pytest.fixture
def seen(monkeypatch):
    """The rows every SFTTrainer of the test was given: [{"train": rows, "eval": rows or None, "trainer": t}]."""
    calls = []
    original = sft_trainer.SFTTrainer.__init__

    def record(self, *args, **kwargs):  # the CLI passes the rows by keyword
        original(self, *args, **kwargs)
        train, evaluation = kwargs["train_dataset"], kwargs.get("eval_dataset")
        calls.append({"train": list(train), "eval": None if evaluation is None else list(evaluation), "trainer": self})

    monkeypatch.setattr(sft_trainer.SFTTrainer, "__init__", record)
    return calls


def tags(rows) -> set:
    """Which files rows came from ("train", "valid", "test"), by the words in them."""
    return {json.dumps(r).split('"content": "')[1].split()[0] for r in rows}


def one_line_error(capsys) -> str:
    err = [x for x in capsys.readouterr().err.strip().splitlines() if not x.startswith("note: ")]
    assert len(err) == 1 and err[0].startswith("error: ") and "Traceback" not in err[0], err
    return err[0]


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def configured(*argv):
    ns = make_parser().parse_args([str(a) for a in argv])
    args, run = configure(ns)
    return ns, args, run


# ------------------------------------------------------------------------------------------ the reference


def test_flags_and_defaults_are_mlx_lms():
    """Our table of mlx-lm's flags and defaults is mlx-lm's own (mlx_lm.lora's parser and CONFIG_DEFAULTS):
    a new or renamed flag in mlx-lm fails here."""
    from mlx_lm import lora

    theirs = {a.dest: a for a in lora.build_parser()._actions if a.dest != "help"}
    assert set(theirs) == set(mlx_lm_args.FLAGS) | set(mlx_lm_args.SHARED)
    for key, spec in mlx_lm_args.FLAGS.items():
        assert spec.flag in theirs[key].option_strings, key
        assert tuple(theirs[key].choices or ()) == spec.choices, key
    assert "-c" in theirs["config"].option_strings
    defaults = {k: v for k, v in lora.CONFIG_DEFAULTS.items() if k != "config"}
    assert mlx_lm_args.DEFAULTS == defaults
    ours = {a.dest for a in make_parser()._actions}
    assert {mlx_lm_args.dest(k) for k in mlx_lm_args.FLAGS} <= ours


def test_rows_tokenise_as_mlx_lm_does(tiny_checkpoint):
    """Chat, completion and text rows, with and without --mask-prompt: the tokens and the trained positions
    are those of mlx-lm's own datasets (ChatDataset, CompletionsDataset, TextDataset) and loss mask."""
    from mlx_lm.tuner.datasets import create_dataset

    import mlxrl
    from mlxrl.data import tokenize_example

    _, processor = mlxrl.load(tiny_checkpoint("qwen3"))
    rows = [{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
                          {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "And?"},
                          {"role": "assistant", "content": "Bye now"}]},
            {"prompt": "What is 2+2?", "completion": "4"},
            {"text": "Plain words to model."}]
    for row in rows:
        for mask in (False, True) if "text" not in row else (False,):
            config = type("C", (), {"mask_prompt": mask})()
            tokens, offset = create_dataset([row], processor.tokenizer, config).process(row)
            ours = mlx_lm_args.as_mlx_lm_reads(row, 0, mask, dict(mlx_lm_args.FEATURES))
            ex = tokenize_example(ours, processor, index=0, max_length=None, completion_only_loss=mask,
                                  assistant_only_loss=False)
            assert ex.input_ids.tolist() == list(tokens), (row, mask)
            # mlx-lm's default_loss trains the targets at token positions offset .. len - 1 (position 0 is
            # never a target)
            trained = [t for t in range(1, len(tokens)) if ex.labels[t] != -100]
            assert trained == list(range(max(offset, 1), len(tokens))), (row, mask)


def test_split_files_follow_datasets_rules(tmp_path):
    """Which file is which split: the rule `datasets`' local folder loader follows (get_data_patterns, then
    the files each pattern resolves to), for mlx-lm's names, sharded names, folder names and file names."""
    from datasets.data_files import DataFilesDict, get_data_patterns

    layouts = {
        "mlx_lm": ["train.jsonl", "valid.jsonl", "test.jsonl"],
        "sharded": ["data/train-00000-of-00002.parquet", "data/train-00001-of-00002.parquet",
                    "data/validation-00000-of-00001.parquet", "data/test-00000-of-00001.parquet"],
        "folders": ["train/a.jsonl", "train/b.jsonl", "dev/c.json", "notes/d.jsonl"],
        "names": ["my_train.jsonl", "dev-1.jsonl", "eval.json", "attestation.jsonl", "contest.jsonl"],
        "train_only": ["train.jsonl", "extra.jsonl"],
        "none": ["a.jsonl", "b.jsonl"],
    }
    for name, files in layouts.items():
        folder = tmp_path / name
        for f in files:
            write(folder / f, [{"text": f}])
        theirs = {str(split): sorted(Path(p).relative_to(folder).as_posix() for p in paths) for split, paths in
                  DataFilesDict.from_local_or_remote(get_data_patterns(str(folder)), base_path=str(folder)).items()}
        ours = folder_splits(folder)
        if set(theirs) == {"train"}:  # no split but train: one training set, every file read (today's behaviour)
            assert ours is None, name
            assert sorted(r["text"] for r in load_rows(folder)) == sorted(files)
        else:
            assert {s: sorted(f.relative_to(folder).as_posix() for f in fs) for s, fs in ours.files.items()} == theirs
    assert sorted(f.name for f in folder_splits(tmp_path / "names").outside) == ["attestation.jsonl",
                                                                               "contest.jsonl"]


def test_load_rows_reads_one_split(mlx_data, tmp_path, capsys):
    assert tags(load_rows(mlx_data)) == {"train"} and len(load_rows(mlx_data)) == 8
    for name in ("validation", "valid", "val", "dev"):  # datasets' keywords for the validation split
        assert tags(load_rows(mlx_data, split=name)) == {"valid"}
    assert tags(load_rows(mlx_data, split="test")) == {"test"}
    write(mlx_data / "notes.jsonl", [{"text": "not a split"}])
    write(mlx_data / "run" / "metrics.jsonl", [{"loss": 1.0}])
    assert tags(load_rows(mlx_data, exclude=[str(mlx_data / "run")])) == {"train"}
    err = capsys.readouterr().err
    assert "notes.jsonl (in no split)" in err and "run/ (the run's output_dir)" in err
    with pytest.raises(cli_lib.MlxrlError, match=r"no 'train\[:80%\]' split.*its splits: train \(train.jsonl\)"):
        load_rows(mlx_data, split="train[:80%]")
    unsplit = tmp_path / "plain"
    write(unsplit / "a.jsonl", [{"text": "a"}])
    with pytest.raises(cli_lib.MlxrlError, match="no 'validation' split: no file name in it names a split"):
        load_rows(unsplit, split="validation")
    with pytest.raises(cli_lib.MlxrlError, match="is one file, read as the train split"):
        load_rows(unsplit / "a.jsonl", split="test")
    write(mlx_data / "train_val.jsonl", [{"text": "both"}])
    with pytest.raises(cli_lib.MlxrlError, match="train_val.jsonl is named as two splits"):
        load_rows(mlx_data)


# ------------------------------------------------------------------------------------------ runs


def test_mlx_lm_command_runs_unchanged(tiny_checkpoint, mlx_data, tmp_path, seen, capsys):
    """mlx-lm's README command on its data folder: train.jsonl trains, valid.jsonl is evaluated (at the start
    and every --steps-per-eval) and never trained, test.jsonl gives mlx-lm's test line after training and is
    never trained; adapters land in --adapter-path with mlx-lm's LoRA scale."""
    out = tmp_path / "adapters"
    argv = ["--model", str(tiny_checkpoint("qwen3")), "--train", "--data", str(mlx_data), "--iters", "4",
            "--batch-size", "2", "--adapter-path", str(out), "--steps-per-report", "2", "--steps-per-eval", "2",
            "--test", *FAST]
    assert main(argv) == 0
    [call] = seen
    assert tags(call["train"]) == {"train"} and len(call["train"]) == 8
    assert tags(call["eval"]) == {"valid"} and len(call["eval"]) == 4
    trainer = call["trainer"]
    assert len(trainer.train_examples) == 8 and len(trainer.eval_examples) == 4
    a = trainer.args
    assert (a.max_steps, a.per_device_train_batch_size, a.learning_rate, a.lr_scheduler_type, a.seed) == \
        (4, 2, 1e-5, "constant", 0)
    assert (a.use_peft, a.lora_r, a.lora_alpha / a.lora_r, a.lora_dropout) == (True, 8, 20.0, 0.0)
    assert (a.gradient_checkpointing, a.max_grad_norm, a.completion_only_loss, a.max_length) == (False, 0, False, 64)
    evals = [m["step"] for m in metrics(out) if "eval_loss" in m]
    assert evals == [0, 2, 4]  # mlx-lm validates at iteration 1 and every --steps-per-eval
    printed = capsys.readouterr()
    test_line = printed.out.strip().splitlines()[-1]
    loss, ppl = (float(x.split()[-1].rstrip(".")) for x in test_line.split(", "))
    assert test_line.startswith("Test loss ") and math.isclose(ppl, math.exp(loss), rel_tol=1e-3)
    assert "test: test.jsonl (a test loss after training)" in printed.err
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["lora_alpha"] / cfg["r"] == mlx_lm_args.DEFAULTS["lora_parameters"]["scale"]
    assert (out / "adapter_model.safetensors").is_file()
    import mlxrl
    from mlxrl.models.lora import load_adapter, lora_layers

    model, _ = mlxrl.load(tiny_checkpoint("qwen3"))
    load_adapter(model, out)
    assert {m.scale for _, m in lora_layers(model)} == {20.0}  # mlx-lm's scale, applied as it applies it
    assert main(argv) == 2  # mlx-lm would overwrite; mlxrl refuses, naming the flag the user wrote
    assert f"--adapter-path {out} holds another run" in one_line_error(capsys)


def test_valid_rows_are_evaluated_never_trained_with_our_flags(tiny_checkpoint, mlx_data, tmp_path, seen, capsys):
    """TRL's spelling on mlx-lm's folder: the validation split is the evaluation set, the test split is never
    read (a broken test.jsonl does not matter), and --dataset_split picks the split that trains."""
    (mlx_data / "test.jsonl").write_text("{not json\n")
    out = tmp_path / "o"
    base = ["--model", str(tiny_checkpoint("qwen3")), "--dataset", str(mlx_data), "--max_length", "64",
            "--compile", "false", "--disable_tqdm", "true", "--gradient_checkpointing", "false",
            "--per_device_train_batch_size", "2", "--use_peft", "true", "--save_steps", "0"]
    assert main([*base, "--output_dir", str(out), "--max_steps", "2", "--eval_strategy", "steps",
                 "--eval_steps", "1"]) == 0
    assert tags(seen[0]["train"]) == {"train"} and tags(seen[0]["eval"]) == {"valid"}
    assert [m["step"] for m in metrics(out) if "eval_loss" in m] == [1, 2]
    assert "test: test.jsonl (not read)" in capsys.readouterr().err
    assert main([*base, "--output_dir", str(tmp_path / "v"), "--max_steps", "1", "--dataset_split", "validation"]) == 0
    assert tags(seen[1]["train"]) == {"valid"} and seen[1]["eval"] is None  # the trained split is never evaluated


def test_val_batches_and_mask_prompt(tiny_checkpoint, mlx_data, tmp_path, seen):
    """--val-batches N evaluates the first N x batch-size validation rows; --mask-prompt trains the last
    message only (its rows become prompt / completion)."""
    assert main(["--model", str(tiny_checkpoint("qwen3")), "--data", str(mlx_data), "--iters", "1", "--batch-size", "2",
                 "--val-batches", "1", "--mask-prompt", "--adapter-path", str(tmp_path / "a"), *FAST]) == 0
    [call] = seen
    assert [r["prompt"][0]["content"] for r in call["eval"]] == ["valid question 0", "valid question 1"]
    assert all(r["completion"][0]["role"] == "assistant" for r in call["train"])
    assert call["trainer"].args.completion_only_loss is True


# ------------------------------------------------------------------------------------------ YAML and flags


def test_mlx_lm_yaml_maps_onto_sft_config(tmp_path, mlx_data):
    cfg = tmp_path / "lora.yaml"
    cfg.write_text(f"model: some/model\ndata: {mlx_data}\ntrain: true\niters: 12\nbatch_size: 2\nadapter_path: "
                   f"{tmp_path / 'ad'}\nfine_tune_type: dora\nsteps_per_report: 3\n"
                   "steps_per_eval: 6\nsave_every: 4\nmax_seq_length: 128\ngrad_checkpoint: true\nmask_prompt: true\n"
                   "seed: 7\noptimizer: adamw\noptimizer_config:\n  adamw:\n    weight_decay: 0.05\n"
                   "    betas: [0.8, 0.95]\nlora_parameters:\n  rank: 4\n  scale: 2.5\n  dropout: 0.1\n"
                   "  keys: [self_attn.q_proj, self_attn.v_proj]\nlr_schedule:\n  name: cosine_decay\n"
                   "  arguments: [2e-4, 10, 1e-6]\n  warmup: 2\nneftune_noise_alpha: 5\n")
    ns, a, run = configured("-c", cfg)
    assert run is not None and ns.model == "some/model" and ns.dataset == str(mlx_data)
    assert (a.max_steps, a.per_device_train_batch_size, a.per_device_eval_batch_size) == (12, 2, 2)
    assert (a.output_dir, a.use_peft, a.use_dora) == (str(tmp_path / "ad"), True, True)
    assert (a.logging_steps, a.eval_steps, a.save_steps, a.max_length) == (3, 6, 4, 128)
    assert (a.gradient_checkpointing, a.completion_only_loss, a.seed) == (True, True, 7)
    assert (a.optim, a.weight_decay, a.adam_beta1, a.adam_beta2) == ("adamw_torch", 0.05, 0.8, 0.95)
    assert (a.lora_r, a.lora_alpha, a.lora_dropout, a.lora_target_modules) == (4, 10, 0.1, ["q_proj", "v_proj"])
    assert (a.learning_rate, a.lr_scheduler_type, a.warmup_steps) == (2e-4, "cosine_with_min_lr", 2)
    assert json.loads(a.lr_scheduler_kwargs) == {"min_lr": 1e-6}
    assert a.neftune_noise_alpha == 5  # an SFTConfig field in mlx-lm's file
    assert configured("-c", cfg, "--iters", 5)[1].max_steps == 5  # flags > YAML, either spelling
    assert configured("-c", cfg, "--max_steps", 5)[1].max_steps == 5
    ours = tmp_path / "ours.yaml"
    ours.write_text("learning_rate: 1e-4\nseed: 3\n")  # only SFTConfig fields: our YAML, TRL's defaults
    _, a, run = configured("--config", ours)
    assert run is None and (a.learning_rate, a.seed, a.max_steps, a.lr_scheduler_type) == (1e-4, 3, -1, "linear")
    _, a, run = configured("--config", ours, "--batch-size", 2)  # mlx-lm's flag: mlx-lm's run, our YAML on top
    assert run is not None and (a.learning_rate, a.seed, a.max_steps, a.per_device_train_batch_size) == \
        (1e-4, 3, 1000, 2)


@pytest.mark.parametrize("schedule", [
    {"name": "cosine_decay", "arguments": [1e-3, 20]},
    {"name": "cosine_decay", "arguments": [1e-3, 50, 1e-5]},       # longer than the run: a partial cosine
    {"name": "linear_schedule", "arguments": [1e-3, 0.0, 20]},
    {"name": "linear_schedule", "arguments": [1e-3, 1e-4, 35]},
    {"name": "cosine_decay", "arguments": [1e-3, 16], "warmup": 4},
])
def test_lr_schedule_follows_mlx(schedule, tmp_path):
    """lr_schedule as transformers' schedule: MLX's rates (mlx_lm.tuner.utils.build_schedule) step for step,
    the step after the warmup excepted (MLX holds the peak there one step longer)."""
    import mlx.core as mx
    from mlx_lm.tuner.utils import build_schedule


    cfg = tmp_path / "s.yaml"
    cfg.write_text(json.dumps({"iters": 20, "lr_schedule": schedule}))  # JSON is YAML
    _, args, _ = configured("-c", cfg, "--data", tmp_path)
    ours, theirs = args.lr_schedule(20), build_schedule(schedule)
    warmup = schedule.get("warmup", 0)
    for step in range(20):
        at = step - 1 if warmup and step > warmup else step
        assert math.isclose(ours(mx.array(at)).item(), theirs(mx.array(step)).item(), rel_tol=1e-4, abs_tol=1e-9), step


@pytest.mark.parametrize("argv, yaml, words", [
    (["--iters", "5", "--max_steps", "7"], None, "--iters and --max_steps both set max_steps"),
    (["--data", "{data}", "--dataset", "{data}"], None, "--data and --dataset"),
    (["--iters", "0"], None, "--iters 0: must be >= 1"),
    (["--learning-rate", "-1"], None, "--learning-rate -1: must be >= 0"),
    (["--resume-adapter-file", "a.safetensors"], None, "--resume_from_checkpoint"),
    (["--grad-accumulation-steps", "4"], None, "--gradient_accumulation_steps"),
    (["--clear-cache-threshold", "1GB"], None, "--cache_limit"),
    (["--optimizer", "sgd"], None, "--optimizer sgd is not supported"),
    (["--report-to", "swanlab"], None, "swanlab"),
    (["--project-name", "p"], None, "WANDB_PROJECT"),
    (["--test"], None, "--test without --train"),
    (["--trust-remote-code"], None, "--trust-remote-code=True is not supported"),
    (["--val-batches", "0"], None, "--val-batches 0: must be >= 1, or -1"),
    ([], "lora_parameters: {rank: 8, alpha: 16, dropout: 0}", "mlx-lm's LoRA key is scale"),
    ([], "lora_parameters: {rank: 8, scale: 0.3, dropout: 0}", "lora_alpha 2.4"),
    ([], "iters: 3\nmax_steps: 4", "max_steps and mlx-lm's key iters both set max_steps"),
    ([], "iters: 3\nlearning_rat: 1", "unknown field 'learning_rat' (did you mean learning_rate?)"),
    ([], "iters: 10\nlr_schedule: {name: cosine_decay, arguments: [1e-4, 5]}", "last iters - warmup = 10"),
    ([], "iters: 10\nlr_schedule: {name: exponential_decay, arguments: [1e-4, 0.9]}", "mlxrl maps cosine_decay"),
    ([], "iters: 3\nhf_dataset: {path: x}", "--dataset_split"),
    ([], "learning_rate: 1e-4\nlr_schedule: {name: cosine_decay, arguments: [1e-4, 1000]}", "unused with lr_sched"),
    ([], "iters: 3\noptimizer_config: {adam: {bias_correction: false}}", "always corrects"),
    (["--test", "--train"], "data: {plain}", "has no test split"),
])
def test_what_mlxrl_cannot_honour_is_one_line(argv, yaml, words, tmp_path, mlx_data, tiny_checkpoint, capsys):
    plain = tmp_path / "plain"
    write(plain / "rows.jsonl", [chat("train", i) for i in range(4)])
    argv = [a.replace("{data}", str(mlx_data)) for a in argv]
    if yaml is not None:
        (tmp_path / "c.yaml").write_text(yaml.replace("{plain}", str(plain)) + "\n")
        argv += ["-c", str(tmp_path / "c.yaml")]
    if not any(a in argv for a in ("--data", "--dataset")) and "data:" not in (yaml or ""):
        argv += ["--data", str(mlx_data)]
    assert main(["--model", str(tiny_checkpoint("qwen3")), *argv, "--adapter-path", str(tmp_path / "o"), *FAST]) == 2
    assert words in one_line_error(capsys)
    assert not (tmp_path / "o").exists()  # refused before anything was written


def test_num_layers_below_the_models_is_refused(tiny_checkpoint, mlx_data, tmp_path, capsys):
    """mlxrl's LoRA adapts every layer: --num-layers 1 of the tiny model's 2 is one line; -1 and the default
    (16, at least the tiny model's layers) run."""
    assert main(["--model", str(tiny_checkpoint("qwen3")), "--data", str(mlx_data), "--num-layers", "1",
                 "--adapter-path", str(tmp_path / "o"), *FAST]) == 2
    assert "--num-layers 1: mlxrl trains every one of this model's 2 decoder layers" in one_line_error(capsys)


def test_mlx_lm_default_num_layers_on_a_deeper_model_is_noted(mlx_data, tmp_path, capsys):
    """Without --num-layers, mlx-lm's default 16 on a 28-layer model: every layer is trained, and said so."""
    from types import SimpleNamespace

    deep = SimpleNamespace(language_model=SimpleNamespace(layers=[None] * 28))
    _, _, run = configured("--data", mlx_data, "--adapter-path", tmp_path / "o")
    mlx_lm_args.check_num_layers(run, deep)
    assert "default --num-layers 16 trains the last 16 of this model's 28 layers" in capsys.readouterr().err
    for flag in ("-1", "28", "40"):
        mlx_lm_args.check_num_layers(configured("--data", mlx_data, "--num-layers", flag)[2], deep)
    assert capsys.readouterr().err == ""
    with pytest.raises(cli_lib.MlxrlError, match="--num-layers 16: mlxrl trains every one of this model's 28"):
        mlx_lm_args.check_num_layers(configured("--data", mlx_data, "--num-layers", "16")[2], deep)


def test_eval_dataset_folder_gives_its_validation_split(mlx_data, tmp_path):
    ns, args, _ = configured("--dataset", tmp_path / "rows.jsonl", "--eval_dataset", mlx_data,
                             "--output_dir", tmp_path / "o")
    assert cli_lib.data_sources(ns, args).evaluation == (str(mlx_data), "validation")


def test_text_rows_cannot_mask_the_prompt(tiny_checkpoint, tmp_path, capsys):
    folder = tmp_path / "d"
    write(folder / "train.jsonl", [{"text": "one"}, {"text": "two"}])
    write(folder / "valid.jsonl", [{"text": "three"}])
    assert main(["--model", str(tiny_checkpoint("qwen3")), "--data", str(folder), "--mask-prompt",
                 "--adapter-path", str(tmp_path / "o"), *FAST]) == 2
    assert "train.jsonl line 1 (row 0): --mask-prompt cannot mask a text row" in one_line_error(capsys)


def test_eval_split_with_a_validation_split_is_refused(tiny_checkpoint, mlx_data, tmp_path, capsys):
    assert main(["--model", str(tiny_checkpoint("qwen3")), "--dataset", str(mlx_data), "--eval_split", "0.25",
                 "--output_dir", str(tmp_path / "o")]) == 2
    assert "--eval_split holds out training rows, but the validation split" in one_line_error(capsys)


def test_hub_data_uses_its_valid_and_test_splits(monkeypatch, tmp_path):
    """mlx-lm's --data NAME reads the Hub dataset's train / valid / test splits (no network: datasets faked)."""
    import datasets

    monkeypatch.setattr(datasets, "get_dataset_split_names", lambda name: ["train", "valid", "test"])
    ns, args, run = configured("--data", "org/set", "--test", "--train", "--adapter-path", tmp_path / "o")
    sources = cli_lib.data_sources(ns, args, test=True, hub_splits=True)
    assert (sources.train, sources.evaluation, sources.test) == (("org/set", "train"), ("org/set", "valid"),
                                                                 ("org/set", "test"))
    ns, args, run = configured("--dataset", "org/set", "--output_dir", tmp_path / "o")
    assert run is None and cli_lib.data_sources(ns, args).evaluation is None  # TRL's spelling: the train split only
