"""Writing folders so that nothing a user has is lost: the one helper every save goes through.

    write_atomically(final, write, what="the model", kind="model")      # a whole folder
    write_atomically(out, write, what="the LoRA adapter", kind="adapter", into="adapter")  # files into out

How a write works. `write(tmp)` fills a fresh folder `.NAME.tmp-PID-XXXXXXXX` made next to the
destination (same filesystem, created with `os.mkdir`, so it has the umask's mode, not mkdtemp's
0700); every file in it is flushed to disk (fsync), then it is put in place by renames:

- a new folder: one `rename(tmp, final)`;
- replacing a folder: one atomic exchange of the two names (`renameat2(RENAME_EXCHANGE)` on Linux,
  `renamex_np(RENAME_SWAP)` on macOS), after which the temp name holds the old version and is
  deleted. Where the filesystem cannot exchange, the old folder is first renamed to
  `.NAME.old-PID-XXXXXXXX`; a process killed between the two renames leaves it there, and the next
  write to NAME renames it back before anything else;
- `into=`: files into a folder that also holds other things (a run's output_dir holds checkpoints and
  metrics.jsonl next to the final model or adapter): each file is renamed into place on its own, the
  previous save's files that the new one does not write are deleted, and the folder's marker says
  "partial" until the last rename, naming the temp folder and the new files: a save killed between two
  renames is rolled forward by the next write or load of the folder (`finish_interrupted`), so a kill at
  any point leaves the previous save or the new one.

A write that fails (a full disk, a read-only folder, an exception) deletes the temp folder and leaves
the previous version as it was: no byte of the destination is touched before the new version is
complete on disk. Disk errors (ENOSPC, EROFS, EACCES, MLX's "Unable to write N bytes") become one
`MlxrlError` line naming what was being written and where. Temp folders of a killed process are
recognised by name and by their PID (no longer running) and deleted by the next write to the same
destination; nothing else is ever deleted.

How a save of ours is recognised. A saved model or adapter folder holds `mlxrl_save.json`
(`{"saved_by": "mlxrl", "kind": ..., "files": [...]}`), listing every entry mlxrl wrote there.
Only a folder whose entries are all listed may be replaced (and only when the caller asks to
overwrite); an entry that is not listed is the user's and makes the save refuse, naming it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import json
import os
import re
import secrets
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

from .errors import MlxrlError

MARKER = "mlxrl_save.json"

_REASONS = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
            errno.EROFS: "read-only file system", errno.EACCES: "permission denied",
            errno.EPERM: "operation not permitted", errno.EIO: "input/output error",
            errno.ENOTDIR: "a part of the path is a file, not a folder", errno.EFBIG: "file too large",
            errno.ENAMETOOLONG: "file name too long"}


def write_error_reason(e: BaseException) -> str | None:
    """The cause of a failed write in words, or None when `e` is not a filesystem error."""
    if isinstance(e, OSError) and e.errno in _REASONS:
        return _REASONS[e.errno]
    if isinstance(e, OSError):
        return f"{e.strerror or type(e).__name__}" if e.errno else None
    if isinstance(e, RuntimeError):  # MLX's writers: "[write] Unable to write N bytes to file."
        msg = str(e).split("]", 1)[-1].strip().rstrip(".")
        if "Unable to write" in msg:
            return f"the disk is full or not writable ({msg})"
        if "Failed to open file" in msg:
            return f"cannot create the file ({msg})"
    if type(e) is Exception:  # tokenizers' Rust writer raises a bare Exception with the OS's words
        msg = str(e)
        for code, words in _REASONS.items():
            if os.strerror(code) in msg:
                return words
    return None


# ---------------------------------------------------------------------------------------------- markers

def read_marker(folder: Path) -> dict | None:
    """The `mlxrl_save.json` of `folder` (None when there is none or it is not ours; a damaged file list is
    refused, `check_listed`)."""
    path = Path(folder) / MARKER
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("saved_by") != "mlxrl" or not isinstance(data.get("files"), list):
        return None
    check_listed(path, data["files"])
    return data


def check_listed(path: Path, files: list) -> None:
    """Refuse, in one line, a record of ours (`path`: a `mlxrl_save.json`, a run's `mlxrl_run.json`) whose
    "files" list holds anything but plain names of entries beside it: mlxrl deletes and replaces what such a
    list names, so an entry like "../x", "a/b", "", "." or a number is never acted on."""
    for name in files:
        if not (isinstance(name, str) and name not in ("", ".", "..") and "\0" not in name
                and not any(sep and sep in name for sep in ("/", os.sep, os.altsep))):
            raise MlxrlError(f"{path} is damaged: its \"files\" list holds {json.dumps(name)}, which is not the "
                             f"name of a file in {Path(path).parent} (mlxrl deletes and replaces only what that list "
                             f"names; nothing was touched): delete {path} (the files it listed are then treated as "
                             "yours and left alone) or correct the list")


def _marker_text(kind: str, files, partial: bool = False, **extra) -> str:
    data = {"saved_by": "mlxrl", "kind": kind, "files": sorted(set(files))}
    if partial:
        data["partial"] = True
    return json.dumps({**data, **extra}, indent=1) + "\n"


def foreign_entries(folder: Path) -> list[str]:
    """Entries of `folder` that mlxrl's marker there does not list (all of them without a marker)."""
    marker = read_marker(folder)
    ours = set(marker["files"]) | {MARKER} if marker else set()
    return sorted(name for name in os.listdir(folder) if name not in ours)


def check_save_target(final: Path, overwrite: bool, how_to_overwrite: str) -> None:
    """Refuse, in one line, a destination we must not replace: a file, a non-empty folder that is
    not an earlier mlxrl save, a save of ours holding files we did not write, or (without
    `overwrite`) any earlier save. Nothing is written or moved."""
    final = Path(final)
    if final.is_symlink() or (final.exists() and not final.is_dir()):
        raise MlxrlError(f"{final} exists and is not a folder: choose another path (it was left as it is)")
    if not final.exists():
        return
    try:
        entries = os.listdir(final)
    except OSError as e:
        raise MlxrlError(f"cannot read {final}: {write_error_reason(e) or e}") from None
    if not entries:
        return
    marker = read_marker(final)
    if marker is None:
        raise MlxrlError(f"{final} is not empty and is not a folder mlxrl saved (no {MARKER}): choose a new or "
                         "empty folder; nothing was written")
    foreign = foreign_entries(final)
    if foreign:
        more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
        raise MlxrlError(f"{final} holds {foreign[0]}{more}, which mlxrl did not write: move it out or choose "
                         "another folder; nothing was written")
    if not overwrite:
        raise MlxrlError(f"{final} holds an earlier mlxrl save: pass {how_to_overwrite} to replace it, or choose "
                         "another folder")


# ---------------------------------------------------------------------------------------------- temp folders

def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _temp_pattern(name: str, kind: str) -> re.Pattern:
    # ours: .NAME.tmp-PID-HEX8; mkdtemp's .NAME.tmp-XXXXXXXX from earlier versions (no PID: always stale)
    return re.compile(rf"^\.{re.escape(name)}\.{kind}-(?:(\d+)-[0-9a-f]{{8}}|[A-Za-z0-9_]{{8}})$")


def new_temp_dir(final: Path) -> Path:
    """A fresh, empty `.NAME.tmp-PID-XXXXXXXX` folder next to `final` (mode from the umask)."""
    while True:
        tmp = final.parent / f".{final.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            os.mkdir(tmp)
            return tmp
        except FileExistsError:
            continue


def clean_stale(final: Path) -> list[Path]:
    """Delete the temp folders of `final` left by processes that no longer run, and put back an old
    version a killed replacement had moved aside (when `final` itself is missing). Returns what was
    deleted. Only names this module makes are considered."""
    parent = final.parent
    if not parent.is_dir():
        return []
    tmp_re, old_re = _temp_pattern(final.name, "tmp"), _temp_pattern(final.name, "old")
    removed = []
    for entry in sorted(os.listdir(parent)):
        for pattern, is_old in ((tmp_re, False), (old_re, True)):
            m = pattern.match(entry)
            if not m or (m.group(1) and _pid_alive(int(m.group(1)))):
                continue
            path = parent / entry
            if is_old and not final.exists():
                os.replace(path, final)  # the replacement was killed between its two renames
            else:
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)
                removed.append(path)
    return removed


def _fsync(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.EBADF, errno.ENOTSUP):  # some filesystems cannot sync folders
            raise
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """Flush every file under `root` and the folders themselves to disk."""
    for folder, _, files in os.walk(root):
        for f in files:
            _fsync(Path(folder) / f)
        _fsync(Path(folder))


_EXCHANGE = None


def _exchange_fn():
    """renameat2(RENAME_EXCHANGE) (Linux) or renamex_np(RENAME_SWAP) (macOS), else None."""
    global _EXCHANGE
    if _EXCHANGE is None:
        _EXCHANGE = False
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
            if sys.platform.startswith("linux") and hasattr(libc, "renameat2"):
                fn = libc.renameat2
                fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
                _EXCHANGE = lambda a, b: fn(-100, a, -100, b, 2)  # AT_FDCWD, RENAME_EXCHANGE
            elif sys.platform == "darwin" and hasattr(libc, "renamex_np"):
                fn = libc.renamex_np
                fn.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_uint]
                _EXCHANGE = lambda a, b: fn(a, b, 2)  # RENAME_SWAP
        except OSError:
            _EXCHANGE = False
    return _EXCHANGE


def _exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths atomically; False where the OS or filesystem cannot."""
    fn = _exchange_fn()
    if not fn:
        return False
    if fn(os.fsencode(a), os.fsencode(b)) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EXDEV, errno.EPERM):
        return False
    raise OSError(err, os.strerror(err), str(b))


def replace_dir_atomically(tmp: Path, final: Path) -> None:
    """Put the fully written folder `tmp` at `final` (replacing a folder there) by renames, after
    flushing it to disk. The old `final` is deleted only once the new one is in place."""
    tmp, final = Path(tmp), Path(final)
    fsync_tree(tmp)
    if final.is_dir() and not final.is_symlink():
        if _exchange(tmp, final):
            shutil.rmtree(tmp, ignore_errors=True)  # tmp now holds the old version
        else:
            old = final.parent / f".{final.name}.old-{os.getpid()}-{secrets.token_hex(4)}"
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
    elif final.exists() or final.is_symlink():
        raise MlxrlError(f"{final} exists and is not a folder: choose another path (it was left as it is)")
    else:
        os.replace(tmp, final)
    _fsync(final.parent)


def _move_files_into(tmp: Path, folder: Path, kind: str) -> None:
    """Rename each file of `tmp` into `folder`, replacing the previous save there (the files its marker
    lists; those the new save does not write are deleted, so two saves never mix). The marker is
    rewritten first, listing the old and the new files, `"partial": true`, the temp folder and the new
    files, and again at the end: a kill between two renames leaves only files the marker claims, and a
    folder that says it is partial, which `finish_interrupted` completes."""
    fsync_tree(tmp)
    names = sorted(os.listdir(tmp))
    marker = read_marker(folder)
    ours = set(marker["files"]) if marker else set()
    clash = [n for n in names if (folder / n).exists() and n not in ours]
    if clash:
        raise MlxrlError(f"{folder / clash[0]} exists and mlxrl did not write it: move it out or choose another "
                         "folder; nothing was replaced")

    _put_marker(folder, kind, ours | set(names), pending=(tmp.name, names))
    for n in names:
        os.replace(tmp / n, folder / n)
    os.rmdir(tmp)
    _finish_moves(folder, kind, ours, names)


def _put_marker(folder: Path, kind: str, files, pending: tuple[str, list] | None = None) -> None:
    """Replace `folder`'s marker by renaming; `pending` (the temp folder's name, the new save's files) makes it
    the partial marker of a save between its renames."""
    extra = {} if pending is None else {"pending": pending[0], "new": sorted(pending[1])}
    marker_tmp = folder / f".{MARKER}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    marker_tmp.write_text(_marker_text(kind, files, partial=pending is not None, **extra))
    _fsync(marker_tmp)
    os.replace(marker_tmp, folder / MARKER)


def _finish_moves(folder: Path, kind: str, ours, names) -> None:
    """The end of a save into `folder` once all its files are in place: the previous save's files it does
    not write (stale shards) deleted, then the marker listing only the new files."""
    for n in sorted(set(ours) - set(names)):
        remove_entry(folder / n)
    _fsync(folder)
    _put_marker(folder, kind, names)
    _fsync(folder)


def finish_interrupted(folder: Path) -> bool:
    """Complete a save into `folder` that was killed between its renames, and say whether it did.

    Such a save's marker says partial, names its temp folder (`pending`, inside `folder`) and lists its files
    (`new`): every one of them was complete on disk (flushed) before the first rename, so the save is rolled
    forward: the files still in the temp folder are renamed into place, the previous save's others deleted,
    the marker rewritten. Left alone (False): no such marker, a temp folder whose process still runs (a save
    in progress), or a new file missing from both places (then the folder stays partial and is refused)."""
    folder = Path(folder)
    marker = read_marker(folder)
    pending, new = (marker or {}).get("pending"), (marker or {}).get("new")
    if not (marker and marker.get("partial") and isinstance(pending, str) and isinstance(new, list)):
        return False
    check_listed(folder / MARKER, [pending, *new])
    m = re.match(r"^\..+\.tmp-(\d+)-[0-9a-f]{8}$", pending)
    if not m or (int(m.group(1)) != os.getpid() and _pid_alive(int(m.group(1)))):
        return False
    src = folder / pending
    if src.is_dir() and not src.is_symlink():
        for n in os.listdir(src):
            if n in new:
                os.replace(src / n, folder / n)
        shutil.rmtree(src, ignore_errors=True)
    if not all((folder / n).exists() or (folder / n).is_symlink() for n in new):
        return False
    _finish_moves(folder, marker.get("kind", "files"), marker["files"], new)
    return True


def remove_entry(path: Path) -> None:
    """Delete a file or a folder (a link as a file) that a marker of ours lists; gone already is fine."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def check_complete(folder: Path, what: str = "") -> None:
    """Refuse, in one line, a folder whose save was interrupted between its renames (its marker says
    partial) and cannot be rolled forward (`finish_interrupted`): its files may come from two saves."""
    marker = read_marker(folder)
    if marker and marker.get("partial"):
        try:
            if finish_interrupted(folder):
                return
        except OSError:  # a folder we may not write: refused as it is
            pass
        marker = read_marker(folder)
    if marker and marker.get("partial"):
        raise MlxrlError(f"{what or folder}: the save into {folder} was interrupted (its {MARKER} says partial), so "
                         "its files may mix two saves: load its newest checkpoint-N instead, or save again")


def write_atomically(final: Path | str, write: Callable[[Path], None], *, what: str, kind: str | None = None,
                     into: str | None = None) -> Path:
    """Write `final` through a temp folder (see the module docstring) and return it.

    write: fills the temp folder it is given.
    what: words for errors ("the model", "checkpoint-40").
    kind: with it, `mlxrl_save.json` (kind, and the files written) is added: the folder is a save of ours.
    into: write files INTO the existing folder `final` (the temp folder is `final/.INTO.tmp-...`)
        instead of replacing `final` as a whole.
    """
    final = Path(final)
    anchor = final / into if into else final
    existed = (final / MARKER).exists() if into else final.exists()
    try:
        anchor.parent.mkdir(parents=True, exist_ok=True)
        if into:  # a killed save's files are in its temp folder: put in place before stale temps go
            finish_interrupted(final)
        clean_stale(anchor)
        if into:
            clean_stale(final / MARKER)
        tmp = new_temp_dir(anchor)
    except OSError as e:
        raise MlxrlError(f"cannot write {what} to {anchor.parent}: {write_error_reason(e) or e}; choose another "
                         "folder") from None
    try:
        write(tmp)
        if into:
            _move_files_into(tmp, final, kind or "files")
        else:
            if kind:
                (tmp / MARKER).write_text(_marker_text(kind, os.listdir(tmp)))
            replace_dir_atomically(tmp, final)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        reason = write_error_reason(e)
        if reason is None:
            raise
        kept = f"the previous version in {final} is unchanged" if existed else "nothing was written"
        raise MlxrlError(f"cannot write {what} to {final}: {reason}; free space or choose another folder ({kept})"
                         ) from None
    return final


def write_file_atomically(path: Path, text: str) -> None:
    """Replace one small text file (metrics.jsonl after a resume) by writing aside and renaming."""
    path = Path(path)
    clean_stale(path)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        tmp.write_text(text)
        _fsync(tmp)
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        reason = write_error_reason(e)
        if reason is None:
            raise
        raise MlxrlError(f"cannot write {path}: {reason}; free space or choose another folder") from None
