"""mlx-lm's LoRA command line (`mlx_lm.lora`, mlx-lm 0.32) for `python -m mlxrl.sft`.

    python -m mlxrl.sft --model Qwen/Qwen3-0.6B --train --data data/ --iters 600 --batch-size 4 --adapter-path ad
    python -m mlxrl.sft -c lora_config.yaml       # mlx-lm's YAML keys: data, iters, lora_parameters, lr_schedule, ...

**Which run.** A command that uses one of mlx-lm's flags below, or a `-c/--config` file holding one of
mlx-lm's keys that is not an SFTConfig field (`data`, `iters`, `batch_size`, `adapter_path`, `lora_parameters`,
...), is mlx-lm's run: mlx-lm's defaults (its CONFIG_DEFAULTS: 1000 iterations of batch 4 at a constant
learning rate of 1e-5, LoRA rank 8 scale 20 dropout 0, seed 0, reports every 10 steps, validation every 200,
a save every 100, sequences up to 2048 tokens, no gradient checkpointing, Adam without weight decay or
gradient clipping) replace TRL's for every setting the user does not give, and rows are read as mlx-lm reads
them (below). A file whose keys are all SFTConfig fields (`learning_rate`, `seed` and `report_to` are both)
is ours. Our own flags still apply: each level is CLI > YAML > the run's defaults, and one field given by
both spellings on the command line (`--iters 5 --max_steps 7`) is refused. An mlx-lm YAML may also hold
SFTConfig fields for what mlx-lm has no key for.

**Flags and keys** (flag / YAML key -> what it sets):

    --model / model                     --model (mlx-lm's default Qwen/Qwen3-0.6b)
    --data / data                       --dataset: a folder of train.jsonl (trained), valid.jsonl (the evaluation
                                        set) and test.jsonl (read only with --test), a file, or a Hub dataset (its
                                        train / valid / test splits); default mlx-community/WikiSQL
    --train / train                     accepted: training is what python -m mlxrl.sft does
    --test / test                       after training, "Test loss X, Test ppl Y." on the test split
    --test-batches / test_batches       the first N x batch-size test rows (-1: all)
    --iters / iters                     --max_steps
    --batch-size / batch_size           --per_device_train_batch_size (and the evaluation batch size)
    --learning-rate / learning_rate     --learning_rate, constant (--lr_scheduler_type constant)
    --fine-tune-type / fine_tune_type   lora: --use_peft; dora: --use_peft --use_dora; full: the whole model
                                        but the token embeddings (--freeze_embeddings; mlx-lm also keeps the final
                                        norm and an untied LM head frozen)
    --num-layers / num_layers           -1 or at least the model's layer count (see below)
    lora_parameters                     rank -> --lora_r, scale -> --lora_alpha = scale x rank (PEFT's alpha:
                                        the update is scaled by alpha / r, mlx-lm's scale), dropout ->
                                        --lora_dropout, keys (e.g. self_attn.q_proj) -> --lora_target_modules
                                        by their last name (q_proj)
    --steps-per-report / steps_per_report   --logging_steps
    --steps-per-eval / steps_per_eval   --eval_steps, with --eval_strategy steps and --eval_on_start when there
                                        is validation data (mlx-lm validates at iteration 1 and every N)
    --val-batches / val_batches         the first N x batch-size validation rows (mlx-lm draws N random
                                        batches each time; -1: all)
    --save-every / save_every           --save_steps (resumable checkpoint-N/ folders)
    --adapter-path / adapter_path       --output_dir (default adapters). mlxrl writes PEFT's layout there:
                                        adapter_model.safetensors + adapter_config.json (mlx-lm writes
                                        adapters.safetensors + its own adapter_config.json); mlxrl's generate and
                                        chat load it, as does PEFT
    --max-seq-length / max_seq_length   --max_length (truncating the end, as mlx-lm)
    --grad-checkpoint / grad_checkpoint --gradient_checkpointing
    --mask-prompt / mask_prompt         train only the completion / the last message (--completion_only_loss)
    --seed / seed                       --seed (mlx-lm's default 0)
    --optimizer / optimizer             adam: --optim adamw_torch --weight_decay 0; adamw: the same with
                                        weight decay 0.01 (MLX's AdamW default); optimizer_config's betas, eps
                                        and weight_decay map to --adam_beta1/2, --adam_epsilon, --weight_decay
    lr_schedule                         cosine_decay [lr, steps, end] -> cosine (cosine_with_min_lr when end > 0),
                                        linear_schedule [lr, end, steps] -> linear (polynomial, power 1, when
                                        it ends above 0), warmup -> --warmup_steps; steps >= iters - warmup
    --report-to / report_to             --report_to wandb
    prompt_feature, completion_feature, chat_feature, text_feature    the rows' column names

**Rows, as mlx-lm reads them.** {"prompt", "completion"} strings are a user and an assistant message under
the chat template (TRL would join them as plain text); {"messages"} is trained whole, or with --mask-prompt
its last message only (the rest is the prompt); {"text"} is trained whole (--mask-prompt refuses it, as
mlx-lm does). "tools" is passed to the chat template as mlx-lm does.

**Refused in one line** (mlxrl cannot do them): --num-layers N below the model's layer count (mlxrl's LoRA
adapts every decoder layer; without --num-layers, mlx-lm's default 16 on a deeper model adapts every layer
with a note), --resume-adapter-file (resume an mlxrl run with --resume_from_checkpoint), --test without
--train (testing saved adapters alone), --grad-accumulation-steps other than 1 (mlx-lm counts micro-batches
as iterations; use --gradient_accumulation_steps, which counts optimizer steps), --clear-cache-threshold
(use --cache_limit), --project-name (set WANDB_PROJECT), --report-to swanlab, --optimizer muon / sgd /
adafactor (MLX's Adafactor with a relative step), optimizer_config keys other than betas / eps /
weight_decay / bias_correction true, other lr_schedule shapes, lora_parameters' alpha (mlx-lm's key is
scale), a scale x rank that is not a whole number (--lora_alpha is an integer), hf_dataset (use --dataset
NAME --dataset_split SPLIT), --trust-remote-code.

**Differences that remain** (documented, not refusable): the optimizer is torch's AdamW, whose moments are
bias-corrected (MLX's Adam and AdamW are not, by default); mlx-lm's batches group rows of similar length and
drop the rows that do not fill a batch (mlxrl drops the last partial batch, --dataloader_drop_last);
mlx-lm also validates at the last iteration; its report lines differ from mlxrl's metrics lines.
"""

from __future__ import annotations

import argparse
import dataclasses

from ...errors import ConfigError
from .keys import _FIELD_NAMES, _refuse_unsupported, _translate
from .rows import (  # noqa: F401  (the package's API)
    apply_validation,
    as_mlx_lm_reads,
    check_num_layers,
    converter,
    describe,
    first_batches,
    report_test,
    test_loss,
)
from .spec import (  # noqa: F401  (the package's API)
    DEFAULTS,
    FEATURES,
    FLAGS,
    KINDS,
    MODE,
    OPTIONAL,
    SHARED,
    Flag,
    Run,
    _size,
    add_flags,
    dest,
)


def collect(ns, cls) -> Run | None:
    """The mlx-lm run that `ns` asks for (its flags, or an -c file with its keys), or None: the command is
    ours. Every value is checked, each refusal one line naming the flag or the file and line."""
    from ...trainers.flags import read_yaml_mapping

    flags = {k: getattr(ns, dest(k)) for k in FLAGS if hasattr(ns, dest(k))}
    given = {k: FLAGS[k].flag for k in flags}
    yaml_keys, own_yaml = {}, None
    if getattr(ns, "config", None):
        data, lines = read_yaml_mapping(ns.config)
        fields = {f.name for f in dataclasses.fields(cls)}
        if any(k in KINDS and k not in fields for k in data):
            yaml_keys, own_yaml = _read_yaml(data, lines, ns.config, cls)
            given.update({k: f"--config {ns.config} line {lines.get(k, '?')}: {k}" for k in yaml_keys
                          if k not in flags})
    if not flags and not yaml_keys:
        return None
    run = Run({**DEFAULTS, **FEATURES, **yaml_keys, **flags}, given)
    _refuse_unsupported(run)
    defaults, _ = _translate(DEFAULTS, run)
    yaml_fields, yaml_implied = _translate(yaml_keys, run)
    flag_fields, flag_implied = _translate(flags, run)
    from ...trainers.flags import Spelled

    yaml = None
    if yaml_keys:
        for name in sorted(set(own_yaml) & set(yaml_fields)):
            raise ConfigError(f"--config {ns.config}: {name} and mlx-lm's key {_key_of(name, yaml_keys)} both set "
                              f"{name}: give one of them")
        yaml = {**yaml_implied, **yaml_fields, **own_yaml}
    labels = _labels(ns, run, own_yaml or {}, [*yaml_keys, *flags])
    run.spelled = Spelled(defaults={**MODE, **defaults}, yaml=yaml, flags=flag_fields, implied=flag_implied,
                          labels=labels)
    _point_at_data(ns, run)
    return run


def _labels(ns, run: Run, own_yaml: dict, given_keys) -> dict:
    """field -> how the user knows it: the flag or YAML line they wrote, else (a default of mlx-lm's run the
    user did not override with our spelling) mlx-lm's flag, so that "--output_dir adapters holds another run"
    reads "--adapter-path adapters ..."."""
    labels = {name: FLAGS[key].flag for key in DEFAULTS if key in FLAGS for name in _FIELD_NAMES.get(key, ())
              if not hasattr(ns, name) and name not in own_yaml}
    labels.update({name: run.label(key) for key in given_keys for name in _FIELD_NAMES.get(key, ())})
    return labels


def _key_of(name: str, keys) -> str:
    return next((k for k in keys if name in _FIELD_NAMES.get(k, ())), "?")


def _read_yaml(data: dict, lines: dict, path: str, cls) -> tuple[dict, dict]:
    """(mlx-lm's keys of an mlx-lm YAML file, coerced; the SFTConfig fields it also holds)."""
    from ...trainers.flags import fields_from_yaml

    keys, own = {}, {}
    for key, value in data.items():
        if key in KINDS:
            keys[key] = _coerce(key, value, f"--config {path} line {lines.get(key, '?')}: {key}")
        else:
            own[key] = value
    return keys, fields_from_yaml(own, lines, path, cls, others=list(KINDS))


def _coerce(key: str, value, where: str):
    """A YAML value as mlx-lm's key `key` takes it; one line naming `where` otherwise."""
    from ...trainers.flags import BadValue, scalar

    kind = KINDS[key]
    if value is None and (key in OPTIONAL or kind == "any"):
        return None
    if kind == "any":
        return value
    if kind == "mapping":
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return value
    if kind == "size":
        try:
            return value if isinstance(value, int) and not isinstance(value, bool) else _size(str(value))
        except argparse.ArgumentTypeError as e:
            raise ConfigError(f"{where}: {e}") from None
    try:
        out = scalar(kind, value)
    except BadValue as e:
        raise ConfigError(f"{where}: {e}") from None
    choices = FLAGS[key].choices if key in FLAGS else ()
    if choices and out not in choices:
        raise ConfigError(f"{where}: {out!r} is not one of {', '.join(choices)}")
    return out


def _point_at_data(ns, run: Run) -> None:
    """--model / --dataset from mlx-lm's settings where ours are not given (--data and --dataset both: refused)."""
    if "data" in run.given and run.given["data"] == "--data" and getattr(ns, "dataset", None):
        raise ConfigError("--data and --dataset name the same thing: give one of them")
    if getattr(ns, "dataset", None) is None:
        ns.dataset = run.settings["data"]
    if getattr(ns, "model", None) is None:
        ns.model = run.settings["model"]
