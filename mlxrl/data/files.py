"""Dataset files and folders -> rows: JSON, JSON Lines, Parquet, a folder of them (a run's own files
skipped), or a Hugging Face dataset; every problem one line naming the file and line."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..hub import MlxrlError

__all__ = ["DataError", "load_rows"]


class DataError(MlxrlError, ValueError):
    """A bad dataset, file or row: one line naming the file and line, or the row."""


_DATA_SUFFIXES = (".json", ".jsonl", ".parquet")


def _json_error(path: Path, e: json.JSONDecodeError, line: int | None = None) -> DataError:
    at = f"line {line if line is not None else e.lineno}" + ("" if line is not None else f" column {e.colno}")
    return DataError(f"{path}: {at}: invalid JSON ({e.msg}); fix or remove that line")


def _read_file(path: Path) -> list[dict]:
    """The rows of one .json (a list of rows, or one row per line), .jsonl or .parquet file; errors name the
    file and the line."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            return pq.read_table(path).to_pylist()
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
            return data
        if isinstance(data, dict) and "\n" not in text.strip():
            return [data]
    # .jsonl, and .json written as one object per line
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise _json_error(path, e, n) from None
    return rows


# Files in a dataset folder that belong to a training run or a saved model, never data: an output_dir
# inside the dataset folder must not be read back as rows.
_RUN_MARKERS = ("metrics.jsonl", "trainer_state.json", "mlxrl_save.json", "adapter_config.json", "config.json")


def _data_files(folder: Path, exclude) -> list[Path]:
    """Data files under `folder` in name order, skipping hidden entries, the run files themselves, the
    `exclude` folders (the run's output_dir) and any subfolder that holds a run or a model (_RUN_MARKERS)."""
    skip = {Path(e).expanduser().resolve() for e in exclude if e}
    files = []
    for root, dirs, names in os.walk(folder):
        here = Path(root)
        if here.resolve() in skip or (here != folder and any((here / m).is_file() for m in _RUN_MARKERS)):
            dirs[:] = []
            continue
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        files += [here / n for n in names
                  if not n.startswith(".") and n not in _RUN_MARKERS and Path(n).suffix in _DATA_SUFFIXES]
    return sorted(files)


def load_rows(dataset: str | os.PathLike, split: str = "train", exclude=()) -> list[dict]:
    """Rows of a local .json / .jsonl / .parquet file, a folder of them (sorted by name), or a Hub
    dataset (``datasets.load_dataset(name, split=split)``; images stay undecoded dicts).

    In a folder, the `exclude` folders (the run's output_dir) and folders that hold a training run or a
    saved model are skipped. An empty dataset is an error."""
    path = Path(dataset).expanduser()
    if path.is_file():
        if path.suffix not in _DATA_SUFFIXES:
            raise DataError(f"dataset {str(path)!r}: unsupported file type {path.suffix!r} "
                            "(use .json, .jsonl or .parquet)")
        rows = _read_file(path)
    elif path.is_dir():
        files = _data_files(path, exclude)
        if not files:
            raise DataError(f"dataset {str(path)!r}: folder has no .json, .jsonl or .parquet file")
        rows = [row for f in files for row in _read_file(f)]
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
