"""Checkpoints and the run folder: what a checkpoint belongs to, the checks before a resume, and
one run per output_dir (the Hugging Face scripts' rule).

A checkpoint is `output_dir/checkpoint-<step>/` with trainable.safetensors (the trained weights),
optimizer.safetensors (moments, master copies, step count), trainer_state.json (step, data
position, log history, the run's id and `mlxrl`: the record below) and, where the batch source
needs it, batch_source.safetensors (GRPO: the generation round being trained on). The record says what the
checkpoint belongs to: trainer kind, model type and config, full or LoRA (r, alpha, targets, DoRA),
the trainable parameters' names and shapes, dtype, master_weights and optimizer. A resume compares
it field by field with the run being started and refuses the first difference in one line that
names it and the flag that fixes it; the weights and optimizer files are also checked key by key
(that also covers checkpoints written before the record existed).

The run folder. An output_dir holding another run (checkpoint-N folders, metrics.jsonl, a final
adapter) is refused unless the run resumes one of its checkpoints or `overwrite_output_dir` is set;
overwriting deletes only that run's checkpoints and metrics.jsonl, and the final save later replaces
only files mlxrl wrote (`mlxrl.atomic`). Nothing else in the folder is touched.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import mlx.core as mx

from ..atomic import MARKER, check_save_target, clean_stale, read_marker, write_file_atomically
from ..hub import MlxrlError

CHECKPOINT_PREFIX = "checkpoint-"
CHECKPOINT_FILES = ("trainable.safetensors", "optimizer.safetensors", "trainer_state.json", "batch_source.safetensors")
_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
_LEFTOVER_RE = re.compile(r"^\.(checkpoint-\d+|metrics\.jsonl|model|merged-quantized|merged|adapter|mlxrl_save\.json)"
                          r"\.(?:tmp|old)-")
# what the final LoRA save writes into output_dir (the adapter and the processor's files)
FINAL_FILES = ("adapter_model.safetensors", "adapter_config.json", "tokenizer.json", "tokenizer_config.json",
               "chat_template.jinja", "chat_template.json", "special_tokens_map.json", "added_tokens.json",
               "vocab.json", "merges.txt", "preprocessor_config.json", "processor_config.json")
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
    return {"trainer": trainer.planner_kind, "model_type": model.config.get("model_type"),
            "model_config": json.loads(json.dumps(dict(model.config), default=str)),
            "adapter": adapter, "trainable": {k: list(v.shape) for k, v in sorted(trainable.items())},
            "dtype": DTYPE_NAMES.get(model.lm_head_weight().dtype, str(model.lm_head_weight().dtype)),
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
        raise MlxrlError(f"{where} was trained in {saved.get('dtype')} and this run is {here['dtype']}: resume with "
                         f"--dtype {saved.get('dtype')}")
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
    weights = load_file(path, "trainable.safetensors", "the trained weights")
    opt = load_file(path, "optimizer.safetensors", "the optimizer state an exact resume needs")
    return state, weights, opt


def check_optimizer_state(loaded: dict, expected: dict, path: Path) -> None:
    """The optimizer file's keys and shapes against the state this run's optimizer makes."""
    check_shapes({k: v.shape for k, v in loaded.items()}, {k: v.shape for k, v in expected.items()},
                  f"--resume_from_checkpoint {path} (optimizer.safetensors)", "holds")


def resolve_checkpoint(output_dir: Path, spec) -> Path:
    """`last` -> the newest checkpoint in output_dir; anything else -> that path."""
    if str(spec) != "last":
        return Path(spec)
    found = [p for p in list_checkpoints(output_dir) if (p / "trainer_state.json").exists()]
    if not found:
        raise MlxrlError(f"--resume_from_checkpoint last: no checkpoint in {output_dir}")
    return found[-1]


def rewrite_metrics(output_dir: Path, history: list[dict]) -> None:
    """metrics.jsonl = the resumed checkpoint's log history (the steps after it are trained again)."""
    write_file_atomically(Path(output_dir) / "metrics.jsonl", "".join(json.dumps(e) + "\n" for e in history))


# ---------------------------------------------------------------------------------------------- the run folder

def check_output_dir(out: Path) -> None:
    """A usable output_dir: created if missing, a folder, writable. One line otherwise."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise MlxrlError(f"--output_dir {out} is a file, not a folder: choose another --output_dir (the file was left "
                         "as it is)")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".mlxrl-write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        from ..atomic import write_error_reason

        raise MlxrlError(f"--output_dir {out} is not writable ({write_error_reason(e) or e}): choose another "
                         "--output_dir") from None


def other_run(out: Path) -> list[str]:
    """What in `out` belongs to an earlier run: checkpoint folders, metrics.jsonl, a final save."""
    found = [p.name for p in list_checkpoints(out)]
    if (out / "metrics.jsonl").exists():
        found.append("metrics.jsonl")
    marker = read_marker(out)
    if marker:
        found.append(f"a saved {marker.get('kind', 'model')} ({MARKER})")
    if (out / "model").is_dir() and read_marker(out / "model"):
        found.append("model/")
    return found


def leftovers(out: Path) -> list[Path]:
    """Our temp folders/files in `out` from a killed process (removed by `clean_leftovers`)."""
    try:
        return [out / n for n in os.listdir(out) if _LEFTOVER_RE.match(n)]
    except OSError:
        return []


def clean_leftovers(out: Path) -> list[Path]:
    removed = []
    for name in sorted({_LEFTOVER_RE.match(p.name).group(1) for p in leftovers(out)}):
        removed += clean_stale(out / name)
    return removed


def merged_folders(args) -> tuple[str, ...]:
    """The merged models the final save of a LoRA run writes into output_dir (--merge, --merge_quantized)."""
    return (("merged",) if getattr(args, "merge", False) else ()) + (
        ("merged-quantized",) if getattr(args, "merge_quantized", False) else ())


def check_run_dir(out: Path, *, resume, overwrite: bool, lora: bool, merged: tuple[str, ...] = ()) -> list[str]:
    """Refuse an output_dir holding another run (unless resuming one of its checkpoints or
    overwriting) or files of the user's that the final save would replace. Returns the other run's
    entries (for `start_run` to delete when overwriting)."""
    out = Path(out)
    found = other_run(out)
    resuming_here = resume is not None and (str(resume) == "last" or
                                            Path(resume).resolve().parent == out.resolve())
    if found and not resuming_here and not overwrite:
        more = f" and {len(found) - 2} more" if len(found) > 2 else ""
        raise MlxrlError(f"--output_dir {out} holds another run ({', '.join(found[:2])}{more}): resume it with "
                         "--resume_from_checkpoint last, pass --overwrite_output_dir true to start over (its "
                         "checkpoints and metrics.jsonl are deleted, nothing else), or choose another --output_dir")
    if lora:
        marker = read_marker(out)
        ours = set(marker["files"]) if marker else set()
        for name in FINAL_FILES:
            if (out / name).exists() and name not in ours:
                raise MlxrlError(f"--output_dir {out} holds {name}, which mlxrl did not write and the final adapter "
                                 "save would replace: choose another --output_dir (nothing was changed)")
        for name in merged:
            check_save_target((out / name).resolve(), True, "")
    else:
        check_save_target((out / "model").resolve(), True, "")
    return [] if resuming_here else found


def start_run(out: Path, *, resume, overwrite: bool, lora: bool, merged: tuple[str, ...] = ()) -> None:
    """At the start of train() on the writing rank: the checks of `check_run_dir`, our leftovers from
    a killed process removed, and with overwrite_output_dir the other run's checkpoints and
    metrics.jsonl deleted (checkpoint folders holding anything but our three files are left)."""
    out = Path(out)
    clean_leftovers(out)
    found = check_run_dir(out, resume=resume, overwrite=overwrite, lora=lora, merged=merged)
    if not found or not overwrite:
        return
    for path in list_checkpoints(out):
        if is_our_checkpoint(path):
            shutil.rmtree(path)
    (out / "metrics.jsonl").unlink(missing_ok=True)
