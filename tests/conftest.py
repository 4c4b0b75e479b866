"""Shared fixtures: tiny random checkpoints (built once per arch per session) and the Qwen tokenizer."""

import importlib.util
import os
import sys
from pathlib import Path

import pytest

from mlxrl import runtime  # (imports mlxrl: the fast BLAS before anything imports mlx.core)

ROOT = Path(__file__).resolve().parents[1]
# On a GPU float32 matmuls would run in TF32 (MLX's CUDA default, ~1e-3 relative error): the equivalence tests
# compare float32 against float32 references at 1e-4 to 1e-6, so they keep full float32, as torch's default
# and mlxrl's trainers do (`runtime.apply_tf32`; MLX_ENABLE_TF32 from the environment wins). Before any matmul.
runtime.apply_tf32()

import mlx.core as mx  # noqa: E402  (after mlxrl)

# On a GPU default device mlxrl computes in bf16 by default: the float32 equivalence tests pin float32 there
# (the bf16 lane, tests/test_mixed_precision.py, asks for bf16 itself), and the native CPU kernels never run.
ON_GPU = mx.default_device() == mx.gpu
if ON_GPU:
    os.environ.setdefault("MLXRL_DTYPE", "float32")


# CUDA errors that stick to the process: after one, every later CUDA call of that process fails too.
STICKY_DEVICE_ERRORS = ("an illegal memory access was encountered", "unspecified launch failure",
                        "misaligned address", "an illegal instruction was encountered")


@pytest.hookimpl(trylast=True)
def pytest_runtest_logreport(report):
    """Two things for runs on a lent GPU machine, where a run is often cut at its time limit before pytest's
    summary prints: with MLXRL_FAILURE_LOG set, each failure's report is appended to that file as it happens
    (the traceback survives the cut). And a test that failed with a sticky CUDA error ends its pytest-xdist
    worker once the report is sent (xdist's own hook sends it first): xdist starts a fresh worker for the tests
    left, so one fault fails one test instead of every later test of that worker. That is on with a GPU default
    device; MLXRL_TEST_STICKY=1 / 0 turns it on / off whatever the device (its test)."""
    if not report.failed:
        return
    # under xdist the controller gets each worker's report as it is sent: it alone writes, once per failure
    if os.environ.get("MLXRL_FAILURE_LOG") and not os.environ.get("PYTEST_XDIST_WORKER"):
        with open(os.environ["MLXRL_FAILURE_LOG"], "a") as f:
            f.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext[-6000:]}\n")
    sticky = os.environ.get("MLXRL_TEST_STICKY", "1" if ON_GPU else "0") == "1"
    if (sticky and os.environ.get("PYTEST_XDIST_WORKER")
            and any(e in report.longreprtext for e in STICKY_DEVICE_ERRORS)):
        print(f"\n{report.nodeid}: a sticky device error; this worker exits for a fresh one", file=sys.stderr)
        sys.stderr.flush()
        os._exit(70)


def skip_native_on_gpu(param: str) -> None:
    """A "native" parameter on a GPU default device, or with MLXRL_NATIVE=0 (the graph-path lane), would
    repeat the graph path: skipped."""
    if ON_GPU and param == "native":
        pytest.skip("the native CPU kernels run on CPU arrays only; the default device is a GPU")
    if param == "native" and os.environ.get("MLXRL_NATIVE") == "0":
        pytest.skip("MLXRL_NATIVE=0: the native kernels are off (the graph-path lane)")


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
    from mlxrl.processing.processor import build_qwen_tokenizer

    return build_qwen_tokenizer()


@pytest.fixture(params=["native", "graph"])
def kernel_path(request, monkeypatch):
    """Run a test on both code paths: "native" (float32 CPU arrays through mlxrl.native's kernels) and
    "graph" (MLX's own ops and mlxrl's MLX-graph head, attention and optimizer: what runs on Metal and
    CUDA; the same as MLXRL_NATIVE=0)."""
    skip_native_on_gpu(request.param)
    if request.param == "native" and os.environ.get("MLXRL_NATIVE") == "0":
        pytest.skip("MLXRL_NATIVE=0: the native kernels are off (the graph-path lane)")
    if request.param == "graph":
        from mlxrl.cpu import native

        monkeypatch.setattr(native, "load", lambda: None)
    return request.param
