"""Dataset files and folders -> rows: JSON, JSON Lines, Parquet, a folder of them (a run's own files
skipped), or a Hugging Face dataset; every problem one line naming the file and line.

A folder whose file names say which split they are (mlx-lm's train.jsonl / valid.jsonl / test.jsonl,
or any name `datasets`' local loader reads as a split: train-00000-of-00002.parquet, validation.jsonl,
data/test/part-0.jsonl, my_dev.json, ...) is read split by split, never merged: `folder_splits` sorts
its files by `datasets.data_files`' rules and `load_rows(folder, split)` reads one split. A folder
whose files name no split but train is one training set, every file read (sorted by name)."""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import re
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from ..errors import DataError, MlxrlError  # noqa: F401  (data.files.DataError)

__all__ = ["DataError", "Rows", "Splits", "folder_splits", "hub_split_names", "load_rows", "locate", "naming_rows",
           "origins_of", "rows_fingerprint", "split_named"]




_DATA_SUFFIXES = (".json", ".jsonl", ".parquet")


def _json_error(path: Path, e: json.JSONDecodeError, line: int | None = None) -> DataError:
    at = f"line {line if line is not None else e.lineno}" + ("" if line is not None else f" column {e.colno}")
    return DataError(f"{path}: {at}: invalid JSON ({e.msg}); fix or remove that line")


class Rows(list):
    """A dataset's rows, each with where it came from (`origins[i]`: "data.jsonl line 7"), so that an
    error about row i can name the file and line the user can open."""

    origins: list[str] = []


def origins_of(rows) -> list[str] | None:
    """Where each row of `rows` came from (`Rows.origins`); None for rows that do not say (a plain list)."""
    return getattr(rows, "origins", None) or None


def locate(rows, message: str) -> str:
    """`message` about "row N: ..." of `rows`, with the file and line of that row put in front."""
    return _locate(origins_of(rows), message)


@contextmanager
def naming_rows(origins):
    """Inside it, a `DataError` about "row N: ..." names the file and line of row N (`origins[N]`, from
    `origins_of`): what a trainer wraps around its work on one dataset (tokenising it, reading its images,
    packing, rendering prompts, evaluating), so that a bad row found after the upfront checks is named as
    they name it. The innermost wrap decides (an evaluation row is never named by a training file's line);
    with no origins the message stays as it is."""
    try:
        yield
    except DataError as e:
        if not getattr(e, "rows_named", False):
            e.rows_named = True
            message = str(e)
            if len(e.args) == 1 and (named := _locate(origins, message)) != message:
                e.args = (named,)
        raise


def _locate(origins, message: str) -> str:
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


# ------------------------------------------------------------------------------------------ splits

# datasets.data_files.SPLIT_KEYWORDS: a file or folder name holding one of these words, delimited by one of
# NON_WORDS_CHARS ("-._ " or a digit) or the name's ends, belongs to that split
SPLIT_KEYWORDS = {"train": ("train", "training"), "validation": ("validation", "valid", "dev", "val"),
                  "test": ("test", "testing", "eval", "evaluation")}
_SEP = "[-._ 0-9]"
_NAME_PATTERNS = ("{kw}" + _SEP + "*", "*" + _SEP + "{kw}" + _SEP + "*")  # datasets' **/{kw}[sep]*, **/*[sep]{kw}[sep]*
_DIR_PATTERNS = ("{kw}", "{kw}" + _SEP + "*", "*" + _SEP + "{kw}", "*" + _SEP + "{kw}" + _SEP + "*")
# datasets' SPLIT_PATTERN_SHARDED, data/{split}-00000-of-00001*.*: any split name, files directly in data/
_SHARDED = re.compile(r"^(?P<split>.+)-[0-9]{5}-of-[0-9]{5}.*\..*$")


@dataclass
class Splits:
    """A local folder's data files by split (`folder_splits`)."""

    folder: Path
    files: dict[str, list[Path]]                        # split -> its files, in name order
    outside: list[Path] = field(default_factory=list)   # data files in no split: not read (as datasets skips them)
    skipped: list[str] = field(default_factory=list)    # what `_data_files` skipped, in words

    def names(self, split: str) -> str:
        return ", ".join(str(f.relative_to(self.folder)) for f in self.files[split])


def _named(names, split: str, patterns) -> bool:
    return any(fnmatch.fnmatchcase(n, p.format(kw=kw)) for n in names for kw in SPLIT_KEYWORDS[split]
               for p in patterns)


def _classify(rel: list[PurePosixPath]) -> dict[str, list[int]]:
    """split -> indices of `rel` (paths relative to the folder), by the rule `datasets`' local loader follows
    (`data_files.get_data_patterns`): sharded names data/<split>-NNNNN-of-NNNNN.* first, else split words in
    folder names, else in file names, the first rule that finds a split deciding; {} when none does."""
    sharded: dict[str, list[int]] = {}
    for i, p in enumerate(rel):
        m = _SHARDED.match(p.name) if len(p.parts) == 2 and p.parts[0] == "data" else None
        if m:
            sharded.setdefault(m.group("split"), []).append(i)
    if sharded:
        return sharded
    for where, patterns in ((lambda p: p.parts[:-1], _DIR_PATTERNS), (lambda p: (p.name,), _NAME_PATTERNS)):
        found = {split: [i for i, p in enumerate(rel) if _named(where(p), split, patterns)] for split in SPLIT_KEYWORDS}
        found = {split: idx for split, idx in found.items() if idx}
        if found:
            return found
    return {}


def _folder_splits(folder: Path, exclude) -> tuple[Splits, list[Path]]:
    """(the folder's files by split, every data file): a folder with no split but train gets files {}."""
    files, skipped = _data_files(folder, exclude)
    rel = [PurePosixPath(f.relative_to(folder).as_posix()) for f in files]
    found = _classify(rel)
    if set(found) <= {"train"}:
        return Splits(folder, {}, [], skipped), files
    owner: dict[int, str] = {}
    for split, idx in found.items():
        for i in idx:
            if i in owner:  # datasets would read it into both: one file never feeds two splits here
                raise DataError(f"dataset {str(folder)!r}: {rel[i]} is named as two splits ({owner[i]} and {split}); "
                                "rename it so that its name holds one split word")
            owner[i] = split
    by_split = {split: [files[i] for i in idx] for split, idx in found.items()}
    outside = [f for i, f in enumerate(files) if i not in owner]
    return Splits(folder, by_split, outside, skipped), files


def folder_splits(dataset, exclude=()) -> Splits | None:
    """The split files of a local folder whose file names name splits other than train (mlx-lm's
    train.jsonl / valid.jsonl / test.jsonl, datasets' naming); None for a file, a Hub name, or a folder
    whose files are one training set. A file named as two splits is an error (never read twice)."""
    path = Path(dataset).expanduser()
    if not path.is_dir():
        return None
    splits, _ = _folder_splits(path, exclude)
    return splits if splits.files else None


def _canonical(name: str) -> str:
    """datasets' split for one of its keywords ("valid" -> "validation"); any other name as it is."""
    return next((split for split, words in SPLIT_KEYWORDS.items() if name in words), name)


def split_named(name: str, available) -> str | None:
    """The split of `available` that `name` means: itself, or one named by a keyword of the same split
    (mlx-lm's "valid" is datasets' "validation", and the other way round); None if none."""
    available = list(available)
    if name in available:
        return name
    return next((a for a in available if _canonical(a) == _canonical(name)), None)


def hub_split_names(dataset: str) -> list[str]:
    """The split names of a Hub dataset (``datasets.get_dataset_split_names``); one line if it cannot be read."""
    try:
        import datasets

        return list(datasets.get_dataset_split_names(str(dataset)))
    except Exception as e:  # the Hub's errors vary (offline, 404, gated): one line naming the dataset
        reason = (str(e).strip().splitlines() or [""])[0]
        raise DataError(f"dataset {str(dataset)!r}: not a local path and its splits cannot be read from the Hugging "
                        f"Face Hub ({type(e).__name__}: {reason})") from None


def _read_files(files: list[Path]) -> Rows:
    parts = [_read_file(f) for f in files]
    rows = Rows(row for part in parts for row in part)
    rows.origins = [w for part in parts for w in part.origins]
    return rows


def _split_files(path: Path, split: str, exclude) -> tuple[list[Path], list[str]]:
    """(the files of `split` in folder `path`, what was not read, in words)."""
    splits, files = _folder_splits(path, exclude)
    if not splits.files:
        if split_named(split, ["train"]) != "train":
            raise DataError(f"dataset {str(path)!r}: no {split!r} split: no file name in it names a split (as "
                            "mlx-lm's train.jsonl / valid.jsonl / test.jsonl do), so its files are one training set")
        return files, splits.skipped
    name = split_named(split, splits.files)
    if name is None:
        have = "; ".join(f"{s} ({splits.names(s)})" for s in splits.files)
        hint = " (a split slice like train[:80%] applies to Hub datasets)" if "[" in split else ""
        if splits.outside and split_named(split, ["train"]) == "train":
            hint += (f"; its other files ({', '.join(str(f.relative_to(path)) for f in splits.outside[:3])}"
                     f"{', ...' if len(splits.outside) > 3 else ''}) are in no split: name the training file "
                     "train.jsonl (mlx-lm's name), or pass one file")
        raise DataError(f"dataset {str(path)!r}: no {split!r} split; its splits: {have}{hint}")
    outside = [f"{f.relative_to(path)} (in no split)" for f in splits.outside]
    return splits.files[name], splits.skipped + outside


def load_rows(dataset: str | os.PathLike, split: str = "train", exclude=(), note: bool = True) -> list[dict]:
    """Rows of a local .json / .jsonl / .parquet file (the train split), a folder of them, or a Hub dataset
    (``datasets.load_dataset(name, split=split)``; images stay undecoded dicts).

    A folder whose files name splits (`folder_splits`) gives `split`'s files ("valid" and "validation"
    both name mlx-lm's valid.jsonl); any other folder gives all its files, sorted by name, and only the
    train split. In a folder, the `exclude` folders (the run's output_dir), folders that hold a saved model
    or a run, a run's files and files in no split are not read, each named in a note on stderr (`note`).
    An empty dataset is an error."""
    path = Path(dataset).expanduser()
    if path.is_file():
        if path.suffix not in _DATA_SUFFIXES:
            raise DataError(f"dataset {str(path)!r}: unsupported file type {path.suffix!r} "
                            "(use .json, .jsonl or .parquet)")
        if split_named(split, ["train"]) != "train":
            raise DataError(f"dataset {str(path)!r} is one file, read as the train split: it has no {split!r} split")
        rows = _read_file(path)
    elif path.is_dir():
        files, skipped = _split_files(path, split, exclude)
        if not files:
            why = f" (skipped: {'; '.join(skipped)})" if skipped else ""
            raise DataError(f"dataset {str(path)!r}: folder has no .json, .jsonl or .parquet file of rows{why}")
        rows = _read_files(files)
        if skipped and note:
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
