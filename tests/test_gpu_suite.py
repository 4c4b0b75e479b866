"""The suite's own behaviour on a GPU: a sticky CUDA error ends its pytest-xdist worker (tests/conftest.py's
`pytest_runtest_logreport`), so the tests after it run in a fresh process."""

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
    pids = tmp_path / "pids"
    env = dict(os.environ, MLXRL_TEST_STICKY=sticky, PIDS=str(pids))
    out = subprocess.run([sys.executable, "-m", "pytest", "-n", "1", "-p", "no:cacheprovider", "-o", "addopts=",
                          "test_faults.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    ran = dict(line.split() for line in pids.read_text().splitlines())
    assert sorted(ran) == ["a", "b", "c", "d"], out.stdout + out.stderr
    assert "2 passed" in out.stdout, out.stdout
    if sticky == "1":  # a's worker exited after a's report; b, c and d ran in one fresh worker
        assert ran["a"] != ran["b"] == ran["c"] == ran["d"], ran
        assert "a sticky device error" in out.stdout + out.stderr
    else:  # one worker ran them all
        assert ran["a"] == ran["b"] == ran["c"] == ran["d"], ran
