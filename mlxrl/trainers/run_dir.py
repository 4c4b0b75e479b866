"""The run folder (output_dir): who may write it, what in it is ours, and what a run refuses.

One record of ownership, three parts:

- **The lock.** The output_dir folder is locked with `fcntl.flock` by the run that writes it, from
  the start of `train()` to its end. A second run into the same folder (another
  process, or another trainer of this one) is refused in one line naming the process holding it.
  The kernel drops the lock when the process ends, however it ends (kill -9 included): a lock is
  never stale.
- **The record.** `output_dir/mlxrl_run.json` (`{"saved_by": "mlxrl", "run_id": ..., "files": [...]}`)
  names the run that wrote the folder last and the loose files mlxrl wrote there (metrics.jsonl).
  Checkpoints carry their run's id in their own trainer_state.json and final saves their own
  `mlxrl_save.json`; everything else in the folder is the user's and is never deleted, replaced or
  appended to. `--resume_from_checkpoint last` continues the run that wrote last (not the highest
  step number, which may belong to a run abandoned by a resume from an earlier checkpoint).
- **Refused folders.** An empty `--output_dir`; the current folder or one above it (unless it already
  holds an mlxrl run); a folder that is or contains the model being trained or the dataset; a folder
  holding another run (unless resuming one of its checkpoints or overwriting it: then that run's
  checkpoints, metrics.jsonl and picture are deleted when training starts, so the folder never mixes two
  runs' steps; nothing else is touched).
- **The final save is replaced, never removed first.** Under `--overwrite_output_dir` the earlier run's
  final model or adapter stays loadable while the new run trains; the new final save replaces it file by
  file (`atomic.write_atomically(into=...)`, rolled forward if killed between its renames), and only then
  do the earlier run's merged folders that the new save did not write go (`remove_replaced`). A kill at
  any point leaves the earlier model or the new one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from ..atomic import (
    MARKER,
    check_listed,
    check_save_target,
    clean_stale,
    finish_interrupted,
    foreign_entries,
    read_marker,
    write_error_reason,
    write_file_atomically,
)
from ..errors import MlxrlError
from .checkpoint import FINAL_FILES, MODEL_FILES, is_our_checkpoint, list_checkpoints, read_state

try:
    import fcntl
except ImportError:  # not a POSIX system: no lock (MLX runs on macOS and Linux)
    fcntl = None

RECORD, METRICS = "mlxrl_run.json", "metrics.jsonl"
_LEFTOVER_RE = re.compile(r"^\.(checkpoint-\d+|metrics\.jsonl|model|merged-quantized|merged|adapter|mlxrl_save\.json|"
                          r"mlxrl_run\.json)\.(?:tmp|old)-")


# ---------------------------------------------------------------------------------------------- the record

def read_record(out: Path) -> dict | None:
    """`mlxrl_run.json` of `out` (None when there is none or it is not ours; a damaged file list refused)."""
    try:
        data = json.loads((Path(out) / RECORD).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("saved_by") != "mlxrl" or not isinstance(data.get("files"), list):
        return None
    check_listed(Path(out) / RECORD, data["files"])  # a name such as "../x" in it: refused, never deleted
    return data


def write_record(out: Path, run_id: str, files=(METRICS,)) -> None:
    """Name `run_id` the folder's current run; `files` join the loose files mlxrl wrote there."""
    old = read_record(out) or {"files": []}
    files = sorted(set(old["files"]) | set(files))
    record = {"saved_by": "mlxrl", "run_id": run_id, "pid": os.getpid(), "files": files}
    write_file_atomically(Path(out) / RECORD, json.dumps(record, indent=1) + "\n")


def metrics_is_ours(out: Path) -> bool:
    """Whether `out/metrics.jsonl` was written by mlxrl: the record lists it, or (a folder written before
    the record existed) no record is there but an mlxrl checkpoint or save is."""
    record = read_record(out)
    if record is not None:
        return METRICS in record["files"]
    return bool(list_checkpoints(out)) or read_marker(out) is not None


def newest_checkpoint(out: Path) -> Path | None:
    """The newest checkpoint of the run that wrote `out` last (the highest step where no record names one)."""
    states = {p: read_state(p) for p in list_checkpoints(out)}
    found = [p for p, state in states.items() if state is not None]
    run_id = (read_record(out) or {}).get("run_id")
    own = [p for p in found if run_id and states[p].get("run_id") == run_id]
    found = own or found
    return found[-1] if found else None


# ---------------------------------------------------------------------------------------------- the lock

class RunLock:
    """An exclusive `flock` on the output_dir folder itself (`acquire` refuses in one line when another run
    holds it). Locking the folder, not a file in it, leaves nothing behind and cannot go stale."""

    def __init__(self, out: Path):
        self.out = Path(out)
        self.fd = None

    def acquire(self) -> RunLock:
        if fcntl is None or self.fd is not None:
            return self
        try:
            fd = os.open(self.out, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        except OSError as e:
            raise MlxrlError(f"--output_dir {self.out}: cannot open it ({write_error_reason(e) or e}); choose "
                             "another --output_dir") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            try:
                pid = (read_record(self.out) or {}).get("pid")
            except MlxrlError:  # a damaged record: the lock is what this line is about
                pid = None
            who = f" (process {pid})" if isinstance(pid, int) else ""
            raise MlxrlError(f"--output_dir {self.out} is being written by another mlxrl run{who}: wait for it to "
                             "end, or choose another --output_dir") from None
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor drops the flock
            self.fd = None


def check_unlocked(out: Path) -> None:
    """Refuse now (before any work) a folder another run is writing; the lock itself is taken by `train()`."""
    if Path(out).is_dir():
        RunLock(out).acquire().release()


# ---------------------------------------------------------------------------------------------- the folder

def _resolved(path) -> Path:
    return Path(path).expanduser().resolve()


def _inside(child: Path, parent: Path) -> bool:
    return child == parent or parent in child.parents


def _is_dir(path) -> bool:
    try:
        return Path(str(path)).expanduser().is_dir()
    except (OSError, ValueError):  # a name no filesystem holds (too long, a NUL byte): not a folder
        return False


def check_target(out, *, model=None, data=()) -> None:
    """Refuse an output_dir that is empty, is the current folder or above it (unless it holds an mlxrl
    run already), or is or contains `model` (a local model folder) or one of `data` (dataset paths)."""
    if not str(out).strip():
        raise MlxrlError("--output_dir is empty: name the folder for the checkpoints, metrics.jsonl and the final "
                         "save (e.g. --output_dir out)")
    target = _resolved(out)
    cwd = Path.cwd().resolve()
    if _inside(cwd, target) and read_record(target) is None and not list_checkpoints(target):
        where = "the current folder" if target == cwd else "a folder above the current one"
        raise MlxrlError(f"--output_dir {out} is {where}: the checkpoints, metrics.jsonl and the final save would "
                         "land among your files; choose a new subfolder (e.g. --output_dir out)")
    if not isinstance(model, (str, os.PathLike)):  # a loaded model: the folder it came from, if any
        model = getattr(model, "name_or_path", None)
    if model and _is_dir(model) and _inside(_resolved(model), target):
        raise MlxrlError(f"--output_dir {out} holds the model being trained ({model}): its final save (and "
                         "--overwrite_output_dir) could replace it; choose another --output_dir")
    for path in data:
        if path and Path(str(path)).expanduser().exists() and _inside(_resolved(path), target):
            raise MlxrlError(f"--output_dir {out} holds the dataset {path}: choose another --output_dir (a run "
                             "writes checkpoints and metrics there)")


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
        raise MlxrlError(f"--output_dir {out} is not writable ({write_error_reason(e) or e}): choose another "
                         "--output_dir") from None


def other_run(out: Path) -> list[str]:
    """What in `out` belongs to an earlier run: checkpoint folders, metrics.jsonl, a final save."""
    found = [p.name for p in list_checkpoints(out)]
    if (out / METRICS).exists() and metrics_is_ours(out):
        found.append(METRICS)
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
    """A save killed between its renames rolled forward (its temp folder is one of the leftovers), then the
    leftovers of killed processes deleted."""
    finish_interrupted(out)
    removed = []
    for name in sorted({_LEFTOVER_RE.match(p.name).group(1) for p in leftovers(out)}):
        removed += clean_stale(out / name)
    return removed


def merged_folders(args) -> tuple[str, ...]:
    """The merged models the final save of a LoRA run writes into output_dir (--merge, --merge_quantized)."""
    return (("merged",) if getattr(args, "merge", False) else ()) + (
        ("merged-quantized",) if getattr(args, "merge_quantized", False) else ())


def resumes_here(out: Path, resume) -> bool:
    return resume is not None and (str(resume) == "last" or Path(resume).resolve().parent == Path(out).resolve())


def check_run_dir(out: Path, *, resume, overwrite: bool, lora: bool, merged: tuple[str, ...] = (),
                  other_run_ok: bool = False) -> list[str]:
    """Refuse an output_dir holding another run (unless resuming one of its checkpoints or
    overwriting; `other_run_ok`: not yet, `train(resume_from_checkpoint=...)` may still resume it), a
    metrics.jsonl mlxrl did not write, or files of the user's that the final save would replace. Returns
    the other run's entries (for `start_run` to delete when overwriting)."""
    out = Path(out)
    if (out / METRICS).exists() and not metrics_is_ours(out):
        raise MlxrlError(f"--output_dir {out} holds {METRICS}, which no mlxrl run wrote (its {RECORD} does not list "
                         "it): move it out or choose another --output_dir (nothing was changed)")
    found = other_run(out)
    here = resumes_here(out, resume)
    if found and not here and not overwrite and not other_run_ok:
        more = f" and {len(found) - 2} more" if len(found) > 2 else ""
        raise MlxrlError(f"--output_dir {out} holds another run ({', '.join(found[:2])}{more}): resume it with "
                         "--resume_from_checkpoint last, pass --overwrite_output_dir true to start over (its "
                         "checkpoints, metrics.jsonl and run.png are deleted when training starts, its final save "
                         "once the new one is in place; nothing else), or choose another --output_dir")
    marker = read_marker(out)
    ours = set(marker["files"]) if marker else set()
    names = FINAL_FILES + (() if lora else MODEL_FILES)
    mine = [n for n in names if (out / n).exists() and n not in ours]
    if not lora:
        mine += sorted(p.name for p in out.glob("model-*.safetensors") if p.name not in ours)
    if mine:
        raise MlxrlError(f"--output_dir {out} holds {mine[0]}, which mlxrl did not write and the final "
                         f"{'adapter' if lora else 'model'} save would replace: choose another --output_dir "
                         "(nothing was changed)")
    for name in merged if lora else ():
        check_save_target((out / name).resolve(), True, "")
    return [] if here else found


def start_run(out: Path, *, resume, overwrite: bool, lora: bool, merged: tuple[str, ...] = ()) -> None:
    """At the start of train() on the writing rank (the lock held): the checks of `check_run_dir`, our
    leftovers from a killed process removed, and with overwrite_output_dir the other run's checkpoints and
    loose files (metrics.jsonl, its picture) deleted (checkpoint folders holding anything but our files are
    left). Its final save stays until this run's replaces it (`remove_replaced`)."""
    out = Path(out)
    clean_leftovers(out)
    found = check_run_dir(out, resume=resume, overwrite=overwrite, lora=lora, merged=merged)
    if not found or not overwrite:
        return
    for path in list_checkpoints(out):
        if is_our_checkpoint(path):
            shutil.rmtree(path)
    record = read_record(out)
    for name in record["files"] if record else [METRICS] if METRICS in found else []:
        if not (out / name).is_dir() or (out / name).is_symlink():  # (the record lists files; a folder is not ours)
            (out / name).unlink(missing_ok=True)  # metrics.jsonl and the run's picture


SAVED_FOLDERS = ("model", "merged", "merged-quantized")  # the folders a final save of ours may hold


def remove_replaced(out: Path, written: tuple[str, ...] = ()) -> None:
    """After this run's final save is in place: the earlier saves' folders in `out` that it did not write
    (`written`: its merged folders) deleted, when they are ours (a marker, nothing else in them): an
    earlier run's --merge output, the model/ folder of older versions."""
    for name in SAVED_FOLDERS:
        if name not in written and (out / name).is_dir() and not (out / name).is_symlink() \
                and read_marker(out / name) is not None and not foreign_entries(out / name):
            shutil.rmtree(out / name)


def resolve_checkpoint(out: Path, spec) -> Path:
    """`last` -> the newest checkpoint of the run that wrote `out` last; anything else -> that path."""
    if str(spec) != "last":
        return Path(spec)
    found = newest_checkpoint(Path(out))
    if found is None:
        raise MlxrlError(f"--resume_from_checkpoint last: no checkpoint in {out}")
    return found
