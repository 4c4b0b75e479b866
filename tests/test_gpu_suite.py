"""The suite's own behaviour on a GPU (tests/conftest.py's `pytest_runtest_logreport`): a sticky CUDA error ends
its pytest-xdist worker, so the tests after it run in a fresh process; each failure's report is written to
MLXRL_FAILURE_LOG as it happens."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("xdist")
ROOT = Path(__file__).resolve().parents[1]

CONFTEST = f"""
import importlib.util
spec = importlib.util.spec_from_file_location("mlxrl_tests_conftest", {str(ROOT / "tests" / "conftest.py")!r})
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
pytest_runtest_logreport = module.pytest_runtest_logreport
"""

TESTS = """
import os

def record(name):
    with open(os.environ["PIDS"], "a") as f:
        f.write(f"{name} {os.getpid()}\\n")

def test_a_fault():
    record("a")
    raise RuntimeError("cudaGetLastError() failed: an illegal memory access was encountered")

def test_b():
    record("b")

def test_c_other_failure():
    record("c")
    raise AssertionError("a plain failure: the worker goes on")

def test_d():
    record("d")
"""


@pytest.mark.parametrize("sticky", ["1", "0"])
def test_a_sticky_device_error_ends_the_worker_and_the_rest_run(tmp_path, sticky):
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_faults.py").write_text(TESTS)
    pids, failures = tmp_path / "pids", tmp_path / "failures.log"
    # the child is a pytest session of its own: not a worker of the xdist run this test may be in
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    env.update(MLXRL_TEST_STICKY=sticky, PIDS=str(pids), MLXRL_FAILURE_LOG=str(failures))
    out = subprocess.run([sys.executable, "-m", "pytest", "-n", "1", "-p", "no:cacheprovider", "-o", "addopts=",
                          "test_faults.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    ran = dict(line.split() for line in pids.read_text().splitlines())
    assert sorted(ran) == ["a", "b", "c", "d"], out.stdout + out.stderr
    assert "2 passed" in out.stdout, out.stdout
    log = failures.read_text()  # both failures (a twice where its worker exited: xdist reports the crash too),
    # each with its node id and its error; the passes not
    assert sorted({line.split()[1] for line in log.splitlines() if line.startswith("=== ")}) == [
        "test_faults.py::test_a_fault", "test_faults.py::test_c_other_failure"], log
    assert "an illegal memory access" in log and "a plain failure" in log and "test_b" not in log, log
    if sticky == "1":  # a's worker exited after a's report; b, c and d ran in one fresh worker
        assert ran["a"] != ran["b"] == ran["c"] == ran["d"], ran
        assert "a sticky device error" in out.stdout + out.stderr
    else:  # one worker ran them all
        assert ran["a"] == ran["b"] == ran["c"] == ran["d"], ran
