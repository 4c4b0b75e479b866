"""Shared fixtures: tiny random checkpoints (built once per arch per session) and the Qwen tokenizer."""

import importlib.util
from pathlib import Path

import pytest

import mlxrl  # noqa: F401  (loads the fast BLAS before any test module imports mlx.core)

ROOT = Path(__file__).resolve().parents[1]


def tiny_checkpoints_module():
    spec = importlib.util.spec_from_file_location("tiny_checkpoints", ROOT / "scripts" / "tiny_checkpoints.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """``tiny_checkpoint(arch) -> Path`` for arch in qwen2_vl, qwen2_5_vl, qwen3_vl, qwen2, qwen3.

    Each arch is built on first use and shared by the whole session; treat the folder as read-only
    (copy it to modify it).
    """
    builder = tiny_checkpoints_module()
    root = tmp_path_factory.mktemp("tiny_checkpoints")
    built: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in built:
            built[arch] = builder.build(arch, root)
        return built[arch]

    return get


@pytest.fixture(scope="session")
def tokenizer():
    """The offline Qwen2/3(-VL) tokenizer (a transformers Qwen2Tokenizer); shared, do not mutate."""
    from mlxrl.processing import build_qwen_tokenizer

    return build_qwen_tokenizer()


@pytest.fixture(params=["native", "graph"])
def kernel_path(request, monkeypatch):
    """Run a test on both code paths: "native" (float32 CPU arrays through mlxrl.native's kernels) and
    "graph" (MLX's own ops and mlxrl's MLX-graph head, attention and optimizer: what runs on Metal and
    CUDA; the same as MLXRL_NATIVE=0)."""
    if request.param == "graph":
        from mlxrl.cpu import native

        monkeypatch.setattr(native, "load", lambda: None)
    return request.param
