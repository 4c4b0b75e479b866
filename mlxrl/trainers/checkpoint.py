"""Checkpoints: what a checkpoint belongs to, and the checks before a resume (the run folder around
them: `run_dir`).

A checkpoint is `output_dir/checkpoint-<step>/` with trainable.safetensors (the trained weights),
optimizer.safetensors (moments, master copies, step count), trainer_state.json (step, data
position, log history, the run's id and `mlxrl`: the record below) and, where the batch source
needs it, batch_source.safetensors (GRPO: the generation round being trained on). The record says what the
checkpoint belongs to: trainer kind, model type and config, full or LoRA (r, alpha, targets, DoRA),
the trainable parameters' names and shapes, dtype, master_weights and optimizer. A resume compares
it field by field with the run being started and refuses the first difference in one line that
names it and the flag that fixes it; the weights and optimizer files are also checked key by key
(that also covers checkpoints written before the record existed).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import mlx.core as mx

from ..atomic import write_file_atomically
from ..errors import MlxrlError

CHECKPOINT_PREFIX = "checkpoint-"
CHECKPOINT_FILES = ("trainable.safetensors", "optimizer.safetensors", "trainer_state.json", "batch_source.safetensors")
_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
# what the final LoRA save writes into output_dir (the adapter and the processor's files)
FINAL_FILES = ("adapter_model.safetensors", "adapter_config.json", "tokenizer.json", "tokenizer_config.json",
               "chat_template.jinja", "chat_template.json", "special_tokens_map.json", "added_tokens.json",
               "vocab.json", "merges.txt", "preprocessor_config.json", "processor_config.json")
# what the final save of a full fine-tuning run writes there too (with model-0000K-of-0000N.safetensors shards)
MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json")
# config keys that do not change the network (the dtype is checked on its own)
_IGNORED_CONFIG_KEYS = {"dtype", "torch_dtype", "transformers_version", "_name_or_path", "name_or_path", "use_cache",
                        "architectures", "auto_map", "_commit_hash", "output_attentions", "output_hidden_states"}
DTYPE_NAMES = {mx.float32: "float32", mx.bfloat16: "bfloat16", mx.float16: "float16"}


def checkpoint_step(path: Path) -> int | None:
    m = _CHECKPOINT_RE.match(Path(path).name)
    return int(m.group(1)) if m else None


def read_state(path: Path) -> dict | None:
    """trainer_state.json of an mlxrl checkpoint folder, or None."""
    try:
        state = json.loads((Path(path) / "trainer_state.json").read_text())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) and "global_step" in state and "batch_in_epoch" in state else None


def _count(minimum: int):
    return (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= minimum), f"a whole number >= {minimum}"


def _kind(kinds, words):
    return (lambda v: isinstance(v, kinds) and not isinstance(v, bool)), words


# trainer_state.json's fields: (test, what it must be, required); what a resume reads must pass before it is used
_STATE_FIELDS = {
    "global_step": (*_count(0), True), "epoch": (*_count(0), True), "batch_in_epoch": (*_count(0), True),
    "num_tokens": (*_count(0), False), "world_size": (*_count(1), False), "per_device_batch": (*_count(1), False),
    "log_history": (lambda v: isinstance(v, list) and all(isinstance(e, dict) for e in v), "a list of objects", False),
    "run_id": (*_kind(str, "a string"), False),
    "mlxrl": (*_kind(dict, "an object"), False),
    "data": (*_kind(dict, "an object"), False),
    "best_model_checkpoint": (lambda v: v is None or isinstance(v, str), "a checkpoint name or null", False),
    "best_metric": (lambda v: v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)), "a number",
                    False),
}
_RECORD_FIELDS = {
    "trainer": _kind(str, "a string"), "model_type": _kind(str, "a string"), "model_config": _kind(dict, "an object"),
    "adapter": (lambda v: v is None or isinstance(v, dict), "an object or null"),
    "trainable": (lambda v: isinstance(v, dict) and all(
        isinstance(s, list) and all(isinstance(n, int) for n in s) for s in v.values()), "parameter name -> shape"),
    "dtype": _kind(str, "a string"),
}


def check_state(state: dict, path: Path) -> None:
    """Every field of a checkpoint's trainer_state.json a resume reads, its type and range; one line naming
    the file and the first bad field."""
    where = f"--resume_from_checkpoint {path}: trainer_state.json"
    fix = "resume from another checkpoint (this file was edited or damaged)"
    for name, (test, words, required) in _STATE_FIELDS.items():
        if name not in state:
            if required:
                raise MlxrlError(f"{where} has no {name}: {fix}")
            continue
        if not test(state[name]):
            raise MlxrlError(f"{where} has {name} {json.dumps(state[name])[:40]}, which must be {words}: {fix}")
    if state.get("best_model_checkpoint") is not None and state.get("best_metric") is None:
        raise MlxrlError(f"{where} names best_model_checkpoint without best_metric: {fix}")
    for name, (test, words) in _RECORD_FIELDS.items():
        record = state.get("mlxrl") or {}
        if name in record and not test(record[name]):
            raise MlxrlError(f"{where} has mlxrl.{name} {json.dumps(record[name])[:40]}, which must be {words}: {fix}")


def list_checkpoints(output_dir: Path, run_id: str | None = None) -> list[Path]:
    """checkpoint-<int> folders of `output_dir` (of run `run_id` only, when given), oldest first."""
    try:
        names = os.listdir(output_dir)
    except OSError:
        return []
    found = []
    for name in names:
        step = checkpoint_step(Path(name))
        path = Path(output_dir) / name
        if step is None or not path.is_dir() or path.is_symlink():
            continue
        if run_id is not None:
            state = read_state(path)
            if state is None or state.get("run_id") != run_id:
                continue
        found.append((step, path))
    return [p for _, p in sorted(found)]


def is_our_checkpoint(path: Path) -> bool:
    entries = set(os.listdir(path))
    return "trainer_state.json" in entries and entries <= set(CHECKPOINT_FILES) and read_state(path) is not None


# ---------------------------------------------------------------------------------------------- the record

def run_record(trainer) -> dict:
    """What a checkpoint of `trainer`'s run belongs to (stored in trainer_state.json as `mlxrl`)."""
    model, args = trainer.model, trainer.args
    trainable = trainer.trainable_state()
    lora = getattr(model, "lora_config", None)
    adapter = None if not lora else {"r": lora["r"], "lora_alpha": lora["lora_alpha"],
                                     "target_modules": sorted(lora["target_modules"]),
                                     "use_dora": bool(lora["use_dora"])}
    low_precision = any(v.dtype != mx.float32 for v in trainable.values())
    return {"trainer": trainer.trainer_name, "model_type": model.config.get("model_type"),
            "model_config": json.loads(json.dumps(dict(model.config), default=str)),
            "adapter": adapter, "trainable": {k: list(v.shape) for k, v in sorted(trainable.items())},
            "dtype": DTYPE_NAMES.get(model.compute_dtype(), str(model.compute_dtype())),
            "master_weights": bool(args.master_weights) if low_precision else None, "optim": args.optim}


def _flat(config: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in config.items():
        if k in _IGNORED_CONFIG_KEYS:
            continue
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _adapter_words(a: dict | None) -> str:
    if a is None:
        return "fine-tunes the full model"
    return f"trains {'DoRA' if a['use_dora'] else 'LoRA'} adapters (r {a['r']}, alpha {a['lora_alpha']})"


def _optim_name(name: str | None) -> str:
    return "adamw_torch" if name == "adamw_torch_fused" else str(name)


def check_compatible(saved: dict, here: dict, path: Path) -> None:
    """Refuse, naming the first difference, a checkpoint that does not belong to this run."""
    where = f"--resume_from_checkpoint {path}"
    if saved.get("trainer") != here["trainer"]:
        raise MlxrlError(f"{where} is a {str(saved.get('trainer')).upper()} checkpoint and this is a "
                         f"{here['trainer'].upper()} run: resume it with python -m mlxrl.{saved.get('trainer')}, or "
                         "start this run from that run's saved model")
    if saved.get("model_type") != here["model_type"]:
        raise MlxrlError(f"{where} was trained on a {saved.get('model_type')} model and this run's model is "
                         f"{here['model_type']}: resume with the same --model")
    a, b = _flat(saved.get("model_config") or {}), _flat(here["model_config"])
    for key in sorted(set(a) | set(b)):
        if a.get(key) != b.get(key):
            raise MlxrlError(f"{where} was trained on a different {here['model_type']} model ({key} {a.get(key)} "
                             f"there, {b.get(key)} here): resume with the same --model")
    sa, ha = saved.get("adapter"), here["adapter"]
    if (sa is None) != (ha is None):
        fix = (f"add --use_peft true --lora_r {sa['r']} --lora_alpha {sa['lora_alpha']}" if sa else
               "drop --use_peft")
        raise MlxrlError(f"{where} {_adapter_words(sa)} and this run {_adapter_words(ha)}: {fix} to resume it")
    if sa is not None:
        for key, flag in (("r", "lora_r"), ("lora_alpha", "lora_alpha"), ("use_dora", "use_dora"),
                          ("target_modules", "lora_target_modules")):
            if sa.get(key) != ha[key]:
                value = " ".join(sa[key]) if isinstance(sa.get(key), list) else sa.get(key)
                raise MlxrlError(f"{where} has {flag} {sa.get(key)} and this run {ha[key]}: resume with "
                                 f"--{flag} {value}")
    check_shapes(saved.get("trainable") or {}, here["trainable"], where, "trains")
    if saved.get("dtype") != here["dtype"]:
        bf16 = "true" if saved.get("dtype") == "bfloat16" else "false"
        raise MlxrlError(f"{where} was trained in {saved.get('dtype')} and this run is {here['dtype']}: resume with "
                         f"--dtype {saved.get('dtype')} (and no --bf16), or --bf16 {bf16}")
    if saved.get("master_weights") != here["master_weights"]:
        raise MlxrlError(f"{where} was trained with master_weights {str(saved.get('master_weights')).lower()} and "
                         f"this run has {str(here['master_weights']).lower()}: resume with --master_weights "
                         f"{str(saved.get('master_weights')).lower()}")
    if _optim_name(saved.get("optim")) != _optim_name(here["optim"]):
        raise MlxrlError(f"{where} was trained with optim {saved.get('optim')} and this run uses {here['optim']}: "
                         f"resume with --optim {saved.get('optim')}")


def check_shapes(saved: dict, here: dict, where: str, verb: str) -> None:
    """`saved` / `here`: name -> shape (lists or tuples)."""
    extra = sorted(set(saved) - set(here))
    missing = sorted(set(here) - set(saved))
    if extra:
        raise MlxrlError(f"{where} {verb} {len(extra)} parameter(s) this run does not (e.g. {extra[0]}): resume with "
                         "the same --model, --use_peft and freeze settings")
    if missing:
        raise MlxrlError(f"{where} lacks {len(missing)} parameter(s) this run {verb} (e.g. {missing[0]}): resume "
                         "with the same --model, --use_peft and freeze settings")
    for k in sorted(here):
        if list(saved[k]) != list(here[k]):
            raise MlxrlError(f"{where} holds {k} with shape {tuple(saved[k])} and this run's is {tuple(here[k])}: "
                             "resume with the same --model and LoRA settings")


# ---------------------------------------------------------------------------------------------- reading

def _hf_trainer_checkpoint(path: Path) -> bool:
    hf = ("optimizer.pt", "scheduler.pt", "rng_state.pth", "training_args.bin", "model.safetensors",
          "adapter_model.safetensors", "pytorch_model.bin")
    return not (path / "trainable.safetensors").exists() and any((path / n).exists() for n in hf)


def load_file(path: Path, name: str, what: str) -> dict:
    f = path / name
    if not f.exists():
        raise MlxrlError(f"--resume_from_checkpoint {path} has no {name} ({what}): it is incomplete; resume from an "
                         "earlier checkpoint")
    try:
        return mx.load(str(f))
    except (RuntimeError, ValueError, OSError) as e:
        detail = str(e).split("]", 1)[-1].strip().splitlines()[0] if str(e) else type(e).__name__
        raise MlxrlError(f"--resume_from_checkpoint {path}: {name} is truncated or corrupt ({detail}); resume from "
                         "an earlier checkpoint") from None


def read_checkpoint(path: Path) -> tuple[dict, dict, dict]:
    """(trainer state, trainable weights, optimizer state) of an mlxrl checkpoint; one line otherwise."""
    path = Path(path)
    where = f"--resume_from_checkpoint {path}"
    if not path.exists():
        raise MlxrlError(f"{where}: no such folder")
    if not path.is_dir():
        raise MlxrlError(f"{where} is a file, not a checkpoint folder")
    if _hf_trainer_checkpoint(path):
        raise MlxrlError(f"{where} is a Hugging Face (Trainer or model) folder, not an mlxrl checkpoint: its optimizer "
                         "state cannot be resumed here; start a new run from its weights instead (--model)")
    if not (path / "trainer_state.json").exists():
        raise MlxrlError(f"{where}: not a checkpoint folder (no trainer_state.json); checkpoints are "
                         f"{CHECKPOINT_PREFIX}<step> folders in the output_dir")
    state = read_state(path)
    if state is None:
        raise MlxrlError(f"{where}: trainer_state.json is truncated or not an mlxrl trainer state; resume from an "
                         "earlier checkpoint")
    check_state(state, path)
    weights = load_file(path, "trainable.safetensors", "the trained weights")
    opt = load_file(path, "optimizer.safetensors", "the optimizer state an exact resume needs")
    return state, weights, opt


def check_optimizer_state(loaded: dict, expected: dict, path: Path) -> None:
    """The optimizer file's keys and shapes against the state this run's optimizer makes."""
    check_shapes({k: v.shape for k, v in loaded.items()}, {k: v.shape for k, v in expected.items()},
                  f"--resume_from_checkpoint {path} (optimizer.safetensors)", "holds")


def rewrite_metrics(output_dir: Path, history: list[dict]) -> None:
    """metrics.jsonl = the resumed checkpoint's log history (the steps after it are trained again)."""
    write_file_atomically(Path(output_dir) / "metrics.jsonl", "".join(json.dumps(e) + "\n" for e in history))
