"""Dataset files and folders -> rows: JSON, JSON Lines, Parquet, a folder of them (a run's own files
skipped), or a Hugging Face dataset; every problem one line naming the file and line."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

from ..hub import DataError, MlxrlError  # noqa: F401  (data.files.DataError)

__all__ = ["DataError", "Rows", "load_rows", "locate", "rows_fingerprint"]


_DATA_SUFFIXES = (".json", ".jsonl", ".parquet")


def _json_error(path: Path, e: json.JSONDecodeError, line: int | None = None) -> DataError:
    at = f"line {line if line is not None else e.lineno}" + ("" if line is not None else f" column {e.colno}")
    return DataError(f"{path}: {at}: invalid JSON ({e.msg}); fix or remove that line")


class Rows(list):
    """A dataset's rows, each with where it came from (`origins[i]`: "data.jsonl line 7"), so that an
    error about row i can name the file and line the user can open."""

    origins: list[str] = []


def locate(rows, message: str) -> str:
    """`message` about "row N: ..." of `rows`, with the file and line of that row put in front."""
    origins = getattr(rows, "origins", None)
    head, sep, rest = message.partition(": ")
    parts = head.split()
    if not origins or not sep or len(parts) != 2 or parts[0] != "row" or not parts[1].isdigit():
        return message
    n = int(parts[1])
    return f"{origins[n]} (row {n}): {rest}" if n < len(origins) else message


def _read_file(path: Path) -> Rows:
    """The rows of one .json (a list of rows, or one row per line), .jsonl or .parquet file, with their
    origins; errors name the file and the line."""
    rows, where = _read_rows(path)
    out = Rows(rows)
    out.origins = [f"{path} {w}" for w in where]
    return out


def _read_rows(path: Path) -> tuple[list, list[str]]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(path).to_pylist()
            return rows, [f"row {i}" for i in range(len(rows))]
        except Exception as e:  # pyarrow's errors (ArrowInvalid, OSError, ...) say what is wrong on their first line
            reason = (str(e).strip().splitlines() or [""])[0]
            raise DataError(f"{path}: cannot read it as Parquet ({type(e).__name__}: {reason})") from None
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        line = path.read_bytes()[:e.start].count(b"\n") + 1
        raise DataError(f"{path}: line {line}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise DataError(f"{path}: cannot read it ({e.strerror or e})") from None
    if path.suffix == ".json" and text.lstrip().startswith(("[", "{")):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            if text.lstrip().startswith("["):
                raise _json_error(path, e) from None
            data = None  # maybe one object per line (what datasets' to_json writes)
        if isinstance(data, list):
            return data, [f"element {i}" for i in range(len(data))]
        if isinstance(data, dict) and "\n" not in text.strip():
            return [data], ["line 1"]
    # .jsonl, and .json written as one object per line
    rows, where = [], []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise _json_error(path, e, n) from None
            where.append(f"line {n}")
    return rows, where


# Files that belong to a training run or a saved model, never data; a folder holding weights or one of
# mlxrl's own records is a saved model, adapter, checkpoint or run, and is not read as data either.
_RUN_FILES = ("metrics.jsonl", "trainer_state.json", "mlxrl_save.json", "mlxrl_run.json", "adapter_config.json",
              "config.json")
_RUN_RECORDS = ("mlxrl_save.json", "mlxrl_run.json")


def _holds_a_save(folder: Path) -> bool:
    try:
        names = os.listdir(folder)
    except OSError:
        return False
    return any(n.endswith(".safetensors") or n in _RUN_RECORDS for n in names)


def _data_files(folder: Path, exclude) -> tuple[list[Path], list[str]]:
    """(data files under `folder` in name order, what was skipped in words). Hidden entries are skipped
    silently; the `exclude` folders (the run's output_dir), folders that hold a saved model, adapter,
    checkpoint or run, and run files (metrics.jsonl, config.json, ...) are skipped and named."""
    skip = {Path(e).expanduser().resolve() for e in exclude if e}
    files, skipped = [], []
    for root, dirs, names in os.walk(folder):
        here = Path(root)
        if here != folder and (here.resolve() in skip or _holds_a_save(here)):
            why = "the run's output_dir" if here.resolve() in skip else "a saved model, checkpoint or run"
            skipped.append(f"{here.relative_to(folder)}/ ({why})")
            dirs[:] = []
            continue
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for n in sorted(names):
            if n.startswith(".") or Path(n).suffix not in _DATA_SUFFIXES:
                continue
            if n in _RUN_FILES:
                skipped.append(f"{(here / n).relative_to(folder)} (a run's or a model's file, not rows)")
            else:
                files.append(here / n)
    return sorted(files), skipped


def load_rows(dataset: str | os.PathLike, split: str = "train", exclude=()) -> list[dict]:
    """Rows of a local .json / .jsonl / .parquet file, a folder of them (sorted by name), or a Hub
    dataset (``datasets.load_dataset(name, split=split)``; images stay undecoded dicts).

    In a folder, the `exclude` folders (the run's output_dir), folders that hold a saved model or a run
    and a run's files are skipped, each named in a note on stderr. An empty dataset is an error."""
    path = Path(dataset).expanduser()
    if path.is_file():
        if path.suffix not in _DATA_SUFFIXES:
            raise DataError(f"dataset {str(path)!r}: unsupported file type {path.suffix!r} "
                            "(use .json, .jsonl or .parquet)")
        rows = _read_file(path)
    elif path.is_dir():
        files, skipped = _data_files(path, exclude)
        if not files:
            why = f" (skipped: {'; '.join(skipped)})" if skipped else ""
            raise DataError(f"dataset {str(path)!r}: folder has no .json, .jsonl or .parquet file of rows{why}")
        parts = [_read_file(f) for f in files]
        rows = Rows(row for part in parts for row in part)
        rows.origins = [w for part in parts for w in part.origins]
        if skipped:
            print(f"note: dataset {path}: read {len(rows)} rows from {len(files)} file(s); skipped "
                  f"{'; '.join(skipped)}", file=sys.stderr, flush=True)
    elif path.suffix in _DATA_SUFFIXES or str(dataset).startswith((".", "/", "~")):
        raise DataError(f"dataset {str(dataset)!r}: no such file or folder")
    else:
        try:
            import datasets

            ds = datasets.load_dataset(str(dataset), split=split)
            # to_list keeps Image columns as {"bytes", "path"} dicts: decoded later, one row at a time
            rows = ds.to_list()
        except Exception as e:  # the Hub's errors vary (offline, 404, gated): one line naming the dataset
            reason = (str(e).strip().splitlines() or [""])[0]
            raise DataError(f"dataset {str(dataset)!r} (split {split!r}): not a local path and cannot be loaded "
                            f"from the Hugging Face Hub ({type(e).__name__}: {reason})") from None
    if not rows:
        raise DataError(f"dataset {str(dataset)!r} has no rows (an empty file or split)")
    return rows


def rows_fingerprint(rows) -> str:
    """A digest of a dataset's rows, in order: what a checkpoint's data position refers to (a resume on
    other rows is refused). A `datasets.Dataset` brings its own fingerprint; a list of rows is hashed as
    JSON, images and byte strings by their content."""
    own = getattr(rows, "_fingerprint", None)
    if isinstance(own, str):
        return own
    digest = hashlib.sha256()
    for row in rows:
        digest.update(json.dumps(row, sort_keys=True, default=_content_digest).encode())
    return digest.hexdigest()[:16]


def _content_digest(value) -> str:
    """A JSON stand-in for a value json cannot write: PIL images and arrays by their pixels, bytes by content."""
    for attr in ("tobytes", "tostring"):
        if hasattr(value, attr):  # PIL images, numpy arrays
            meta = (getattr(value, "size", None), getattr(value, "mode", None), getattr(value, "shape", None))
            return f"{meta}:{hashlib.sha256(getattr(value, attr)()).hexdigest()}"
    if isinstance(value, (bytes, bytearray, memoryview)):
        return hashlib.sha256(bytes(value)).hexdigest()
    return f"<{type(value).__name__}>"
