"""Model id -> local folder (a local path, the Hugging Face cache offline, or the Hub); what goes wrong on
the way is one clear line (`mlxrl.errors.MlxrlError`)."""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path

from .errors import MlxrlError

WEIGHT_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken"]

# Published Qwen checkpoints of the families we support, for "did you mean" suggestions.
KNOWN_REPOS = {
    "Qwen3-VL": ["2B", "4B", "8B", "32B"],
    "Qwen2.5-VL": ["3B", "7B", "32B", "72B"],
    "Qwen2-VL": ["2B", "7B", "72B"],
    "Qwen3": ["0.6B", "1.7B", "4B", "8B", "14B", "32B"],
    "Qwen2.5": ["0.5B", "1.5B", "3B", "7B", "14B", "32B", "72B"],
}


def _looks_like_path(name: str) -> bool:
    # Hub ids are exactly "owner/name"; anything else is meant as a folder.
    return name.startswith(("/", ".", "~")) or name.count("/") != 1


def suggest_repo(repo_id: str) -> str | None:
    """For `Qwen/Qwen3-VL-3B-Instruct`: 'Qwen3-VL comes in 2B/4B/8B/32B; nearest: Qwen/Qwen3-VL-2B-Instruct or
    Qwen/Qwen3-VL-4B-Instruct'."""
    name = repo_id.split("/", 1)[-1]
    for family in sorted(KNOWN_REPOS, key=len, reverse=True):
        m = re.match(rf"^{re.escape(family)}-([\d.]+)B(.*)$", name, re.IGNORECASE)
        if not m:
            continue
        sizes = KNOWN_REPOS[family]
        size, tail = float(m.group(1)), m.group(2)
        if f"{m.group(1)}B" in sizes:
            return None  # the size exists; the suffix is what is wrong
        gap = min(abs(float(s[:-1]) - size) for s in sizes)
        nearest = [s for s in sizes if abs(float(s[:-1]) - size) == gap]  # both neighbours when equally near
        return f"{family} comes in {'/'.join(sizes)}; nearest: " + " or ".join(
            f"Qwen/{family}-{s}{tail}" for s in nearest)
    candidates = [f"Qwen/{f}-{s}-Instruct" for f, ss in KNOWN_REPOS.items() for s in ss]
    close = difflib.get_close_matches(repo_id, candidates, n=1, cutoff=0.6)
    return f"did you mean {close[0]}?" if close else None


def check_model_reference(id_or_path: str | os.PathLike) -> None:
    """What can be said about a model reference without reading it or the network: a path must exist
    and be a folder, a Hub id must be well formed and not a size the family was never published in."""
    name = str(id_or_path)
    path = Path(name).expanduser()
    if path.is_dir():
        return
    if path.exists():
        raise MlxrlError(f"{name} is a file; pass the folder that holds config.json and *.safetensors")
    if _looks_like_path(name):
        raise MlxrlError(
            f"no such local path: {name} (pass an existing folder or a Hub id like Qwen/Qwen3-VL-2B-Instruct)"
        )
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        raise MlxrlError(f"{name!r} is neither a local folder nor a valid Hub id (owner/name: letters, digits, "
                         "'-', '_' and '.'; e.g. Qwen/Qwen3-VL-2B-Instruct)") from None
    hint = suggest_repo(name)
    if hint and " comes in " in hint and not _cached(name):  # a size this family was never published in
        raise MlxrlError(f"no model {name} on the Hugging Face Hub: {hint}")


def _cached(name: str, revision: str | None = None) -> Path | None:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(name, revision=revision, allow_patterns=WEIGHT_PATTERNS, local_files_only=True))
    except Exception:  # not cached (LocalEntryNotFoundError, OSError, ...)
        return None


def resolve_model_path(id_or_path: str | os.PathLike, revision: str | None = None) -> Path:
    """A local folder holding config.json and weights for `id_or_path`.

    Local folders are used as they are. A Hub id is looked up in the Hugging Face cache first
    (no network), then downloaded when the Hub is reachable and HF_HUB_OFFLINE is not set.
    """
    name = str(id_or_path)
    check_model_reference(name)
    path = Path(name).expanduser()
    if path.is_dir():
        return path

    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    cached = _cached(name, revision)
    if cached is not None:
        return cached
    hint = suggest_repo(name)
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")
    if offline:
        raise MlxrlError(
            f"{name} is not in the Hugging Face cache and HF_HUB_OFFLINE is set: "
            f"download it on a machine with network (hf download {name}) or pass a local folder"
            + (f" ({hint})" if hint else "")
        )
    try:
        return Path(snapshot_download(name, revision=revision, allow_patterns=WEIGHT_PATTERNS))
    except GatedRepoError:
        raise MlxrlError(f"{name} is gated: accept its licence on huggingface.co and log in (hf auth login)") from None
    except RepositoryNotFoundError:
        raise MlxrlError(f"no model {name} on the Hugging Face Hub" + (f": {hint}" if hint else "")) from None
    except RevisionNotFoundError:
        raise MlxrlError(f"{name} has no revision {revision!r}") from None
    except Exception as e:  # connection errors come in many classes (httpx, OSError, hub errors)
        raise MlxrlError(
            f"cannot reach the Hugging Face Hub and {name} is not in the cache ({type(e).__name__}): "
            "connect, or pass a local folder" + (f" ({hint})" if hint else "")
        ) from None


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint folder (sharded via its index, or single)."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        import json

        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            raise MlxrlError(f"{index} is not a valid safetensors index ({e}); re-download the checkpoint") from None
        files = [folder / f for f in dict.fromkeys(weight_map.values())]
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise MlxrlError(
                f"{folder} is missing shards listed in its index: {', '.join(missing[:3])}; re-download it"
            )
        return files
    files = sorted(folder.glob("*.safetensors"))
    files = [f for f in files if not f.name.startswith("adapter")]
    if not files:
        raise MlxrlError(f"{folder} has no *.safetensors weights (PyTorch .bin checkpoints are not supported)")
    return files
