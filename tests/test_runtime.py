"""Runtime policy: BLAS choice is reported, dtype policy, memory knobs map onto MLX, importing mlxrl sets
nothing else but depth-first evaluation on the CPU (the cache limit and the CLIs' re-exec come from
`runtime.setup`)."""

import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlxrl import runtime
from mlxrl.cpu import blas

CHILD = "import mlxrl.runtime; from mlxrl.cpu import blas; print(blas.BLAS_IN_USE)"


def _blas_line(choice):
    env = dict(os.environ, MLXRL_BLAS=choice)
    return subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True).stdout.strip()


@pytest.mark.skipif(sys.platform != "linux" or not blas._bundled_reference_blas(),
                    reason="only Linux wheels bundle a reference BLAS")
def test_blas_choice_is_applied_and_reported():
    assert _blas_line("none").startswith("reference")
    auto = _blas_line("auto")
    assert auto.startswith(("OpenBLAS", "MKL")), auto
    assert blas.BLAS_IN_USE in runtime.startup_line()


# a machine without Debian's OpenBLAS: blas.py loaded on its own (not through mlxrl, which would set the BLAS up
# at import), its Debian paths emptied, then `setup_blas` as `import mlxrl` runs it, then MLX's matmul
NO_DEBIAN_OPENBLAS = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("blas_alone", sys.argv[1])
blas = importlib.util.module_from_spec(spec)
spec.loader.exec_module(blas)
blas.OPENBLAS_PATHS = ()
print(blas.setup_blas())
import mlx.core as mx
a = mx.random.normal((256, 256))
mx.eval(a @ a)
maps = open("/proc/self/maps").read()
print("libmkl_core" in maps and "mkl_rt" in maps)
"""


@pytest.mark.skipif(sys.platform != "linux" or os.uname().machine != "x86_64" or not blas._bundled_reference_blas(),
                    reason="the mkl dependency is for Linux x86-64, whose MLX wheel bundles a reference BLAS")
def test_pip_alone_gives_mkl_where_debian_openblas_is_missing():
    """The package's own dependencies (no apt package) give MLX a fast BLAS: the `mkl` wheel is installed with
    mlxrl, `setup_blas` finds it without Debian's OpenBLAS, the start-up line names it, and MLX's matmul runs
    in it (MKL's kernel library is loaded by its first sgemm call)."""
    from importlib import metadata

    metadata.distribution("mkl")  # a dependency of mlxrl on Linux x86-64
    res = subprocess.run([sys.executable, "-c", NO_DEBIAN_OPENBLAS, blas.__file__], capture_output=True, text=True,
                         env={k: v for k, v in os.environ.items() if k != "MLXRL_BLAS"})
    assert res.returncode == 0, res.stderr[-2000:]
    line, in_mkl = res.stdout.split("\n")[:2]
    assert line.startswith("MKL (") and "libmkl_rt" in line, line
    assert in_mkl == "True", res.stdout


def test_commands_work_from_the_folder_holding_the_clone(tmp_path):
    """A clone keeps git's default folder name, the package's (`mlxrl/`): run from its parent folder, the current
    directory's `mlxrl/` (no __init__.py there) must not shadow the installed package as a namespace package
    (the editable install is a path entry, `pyproject.toml`'s package-dir)."""
    root = Path(__file__).resolve().parents[1]
    (tmp_path / "mlxrl").symlink_to(root, target_is_directory=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run([sys.executable, "-c", "import mlxrl; print(mlxrl.__file__, mlxrl.load_default)"],
                         cwd=tmp_path, capture_output=True, text=True, env=env)
    assert res.returncode == 0 and res.stdout.split()[0].endswith("__init__.py"), res.stdout + res.stderr
    res = subprocess.run([sys.executable, "-m", "mlxrl.plan"], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert res.returncode == 0 and "FITS" in res.stdout and "Traceback" not in res.stderr, res.stdout + res.stderr
    assert res.stderr.count("reference BLAS") == 0, res.stderr


def test_compute_dtype_policy(monkeypatch):
    monkeypatch.delenv("MLXRL_DTYPE", raising=False)  # tests/conftest.py pins float32 on a GPU
    expected = mx.bfloat16 if runtime.default_device_kind() == "gpu" else mx.float32
    assert runtime.compute_dtype() == expected
    assert runtime.compute_dtype("bf16") == mx.bfloat16
    with pytest.raises(ValueError, match="unknown dtype"):
        runtime.compute_dtype("int8")


def test_memory_limits_map_to_mlx():
    total = runtime.device_memory_bytes()
    before = mx.set_cache_limit(0)  # each setter returns the previous limit
    before_mem = mx.set_memory_limit(total)
    try:
        applied = runtime.set_memory_limits(memory_limit=0.5, cache_limit="256MB")
        assert applied["memory_limit"] == int(0.5 * total)
        assert applied["cache_limit"] == 256 << 20
        assert mx.set_cache_limit(before) == 256 << 20  # what we set is what MLX holds
    finally:
        mx.set_memory_limit(before_mem)


@pytest.mark.parametrize("flags,core", [({"avx512_bf16", "avx512f", "avx512vl", "avx2", "fma"}, "Cooperlake"),
                                         ({"avx512f", "avx512vl", "avx2", "fma"}, "SkylakeX"),
                                         ({"avx2", "fma"}, "Haswell"), ({"sse4_2"}, None)])
def test_openblas_coretype_follows_cpu_flags(flags, core):
    assert blas._openblas_coretype(flags) == core


@pytest.mark.skipif(sys.platform != "linux" or not blas._bundled_reference_blas(),
                    reason="only Linux wheels bundle a reference BLAS")
def test_openblas_coretype_is_set_unless_given():
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_CORETYPE"}
    child = "import os, mlxrl.runtime; print(os.environ.get('OPENBLAS_CORETYPE'))"
    run = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True).stdout.strip()
    assert run == str(blas._openblas_coretype(blas._cpu_flags()))
    env["OPENBLAS_CORETYPE"] = "Haswell"
    run = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True).stdout.strip()
    assert run == "Haswell"


@pytest.mark.skipif(sys.platform != "linux" or not blas._bundled_reference_blas() or (os.cpu_count() or 1) < 2,
                    reason="mlxrl loads OpenBLAS itself only over a Linux wheel's reference BLAS; one core: no workers")
def test_openblas_threads_sleep_after_a_call_unless_told_otherwise():
    """After a matmul, OpenBLAS's idle worker threads burn no CPU while the process waits (they would
    spin for ~0.1 s, on the cores the native kernels use next); a user's OPENBLAS_THREAD_TIMEOUT is kept
    (28, OpenBLAS's default: the spin shows)."""
    child = ("import os, time, mlxrl, mlx.core as mx\n"
             "print(os.environ['OPENBLAS_THREAD_TIMEOUT'])\n"
             "a = mx.random.normal((1024, 1024)); mx.eval(a)\n"
             "spent = []\n"
             "for _ in range(3):\n"
             "    mx.eval(a @ a); c = time.process_time(); time.sleep(0.3); spent.append(time.process_time() - c)\n"
             "print(min(spent))")
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}
    if "openblas" not in blas.BLAS_IN_USE.lower():
        pytest.skip("mlxrl did not load OpenBLAS here")

    def run(env):
        out = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True, check=True)
        timeout, idle_cpu = out.stdout.split()
        return timeout, float(idle_cpu)

    timeout, idle_cpu = run(env)
    assert timeout == "4" and idle_cpu < 0.02
    timeout, idle_cpu = run({**env, "OPENBLAS_THREAD_TIMEOUT": "28"})
    assert timeout == "28" and idle_cpu > 0.03


def test_import_sets_no_limit_and_setup_sets_the_cpu_cache():
    """`import mlxrl` leaves MLX's cache limit as `import mlx.core` does; `runtime.setup()` (what the
    trainers and the CLIs call) sets the CPU buffer cache, MLXRL_CACHE_LIMIT overriding it."""
    env = {k: v for k, v in os.environ.items() if k != "MLXRL_CACHE_LIMIT"}

    def child(code):
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        return out.stdout.split()

    plain = child("import mlx.core as mx; print(mx.set_cache_limit(0))")
    got = child("import mlxrl, mlx.core as mx; a = mx.set_cache_limit(0); mx.set_cache_limit(a); "
                "mlxrl.runtime.setup(); print(a, mx.set_cache_limit(0))")
    assert got[0] == plain[0]
    if runtime.default_device_kind() == "cpu":
        # malloc keeping freed memory (glibc) leaves MLX no cache to keep; without it, 256 MB
        kept = sys.platform.startswith("linux")
        assert int(got[1]) == (runtime.KEPT_CACHE_LIMIT if kept else runtime.CPU_CACHE_LIMIT) != int(plain[0])
        env["MLXRL_KEEP_FREED"] = "0"
        got = child("import mlxrl, mlx.core as mx; mlxrl.runtime.setup(); print(mx.set_cache_limit(0))")
        assert int(got[0]) == runtime.CPU_CACHE_LIMIT
        env["MLXRL_CACHE_LIMIT"] = "128MB"
        for keep in ("0", "1"):
            env["MLXRL_KEEP_FREED"] = keep
            got = child("import mlxrl, mlx.core as mx; mlxrl.runtime.setup(); print(mx.set_cache_limit(0))")
            assert int(got[0]) == 128 << 20


ORDER_CHILD = """
import os
import mlxrl
import mlx.core as mx
import numpy as np
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlxrl.models import build_model
from mlxrl.models.lora import apply_lora

mx.random.seed(0)
H, T = int(os.environ.get("WIDTH", 128)), int(os.environ.get("TOKENS", 1024))
model = build_model(dict(model_type="qwen3", vocab_size=256, hidden_size=H, intermediate_size=3 * H,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32))
apply_lora(model, r=4, alpha=8, dropout=0.0)
model.train()
model.language_model.gradient_checkpointing = True
ids = mx.array(np.random.default_rng(0).integers(0, 256, (1, T)), mx.int32)
w = mx.random.normal((1, T, H))
mx.eval(model.parameters(), w)
step = nn.value_and_grad(model, lambda m: (m(input_ids=ids, return_hidden=True) * w).sum())
base = mx.get_active_memory()
mx.reset_peak_memory()
loss, grads = step(model)
mx.eval(loss, grads)
grads = np.concatenate([np.array(v).ravel() for _, v in sorted(tree_flatten(grads))])
np.save(os.environ["GRADS_OUT"], grads)
print(os.environ["MLX_BFS_MAX_WIDTH"], mx.get_peak_memory() - base, loss.item())
"""


def _checkpointed_step(tmp_path, tag: str, **env) -> tuple[str, int, float, np.ndarray]:
    """ORDER_CHILD in a fresh process with `env` on top of this one's (None: the variable unset): MLX's
    evaluation width, its peak above the weights, the loss and the flat gradients."""
    run_env = {k: v for k, v in os.environ.items() if k not in env}
    run_env.update({k: v for k, v in env.items() if v is not None}, GRADS_OUT=str(tmp_path / f"{tag}.npy"))
    out = subprocess.run([sys.executable, "-c", ORDER_CHILD], env=run_env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    seen, peak, loss = out.stdout.split()
    return seen, int(peak), float(loss), np.load(tmp_path / f"{tag}.npy")


@pytest.mark.skipif(runtime.default_device_kind() != "cpu", reason="the CPU's evaluation order")
@pytest.mark.parametrize("native", ["1", "0"])
def test_import_evaluates_depth_first_on_the_cpu(native, tmp_path):
    """`import mlxrl` sets MLX_BFS_MAX_WIDTH=1 on the CPU (a value the user set stays): a checkpointed LoRA
    step's loss and gradients are bit-identical to MLX's breadth-first order (width 20) and its MLX peak
    above the weights is lower (measured 0.73x on the native path, 0.87x on the graph path)."""
    got = {width: _checkpointed_step(tmp_path, f"width{width}", MLX_BFS_MAX_WIDTH=width, MLXRL_NATIVE=native)
           for width in (None, "20")}
    assert got[None][0] == "1" and got["20"][0] == "20"
    assert got[None][2] == got["20"][2]
    np.testing.assert_array_equal(got[None][3], got["20"][3])
    assert got[None][1] < 0.92 * got["20"][1], (got[None][1], got["20"][1])


@pytest.mark.skipif(runtime.default_device_kind() != "cpu", reason="the CPU's evaluation queue")
def test_native_kernels_drain_the_queue_before_large_outputs(tmp_path):
    """MLX's CPU evaluation allocates each output when it is queued, up to ~100 operations ahead of the
    worker; the native kernels finish the queue before allocating an output of MLXRL_DRAIN_BYTES (default
    1 MB) or more. A checkpointed LoRA step with [2048, 256] activations: bit-identical loss and gradients,
    MLX peak above the weights lower than without the drain (measured 0.82x)."""
    from mlxrl.cpu import native

    if native.load() is None:
        pytest.skip("the native kernels are not built here")
    got = {drain: _checkpointed_step(tmp_path, f"drain{drain}", MLXRL_DRAIN_BYTES=drain, MLXRL_NATIVE="1",
                                     WIDTH="256", TOKENS="2048")
           for drain in (None, "0")}
    assert got[None][2] == got["0"][2]
    np.testing.assert_array_equal(got[None][3], got["0"][3])
    assert got[None][1] < 0.9 * got["0"][1], (got[None][1], got["0"][1])


KEEP_FREED_CHILD = """
import ctypes
import mlxrl, mlx.core as mx

class Info(ctypes.Structure):  # glibc's struct mallinfo2
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info

def mapped_and_heap():  # while a 64 MB MLX array is alive: malloc's mmapped bytes, its heap's bytes
    a = mx.zeros((64 << 20) // 4) + 1
    mx.eval(a)
    info = libc.mallinfo2()
    return info.hblkhd, info.arena

before = mapped_and_heap()
mlxrl.runtime.setup()
print(*before, *mapped_and_heap())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or runtime.default_device_kind() != "cpu",
                    reason="glibc's malloc on the CPU path")
@pytest.mark.parametrize("keep", ["1", "0"])
def test_setup_keeps_freed_memory_in_mallocs_heap(keep):
    """Before `runtime.setup()` glibc maps a 64 MB block with mmap (unmapped again on free); after it the
    block comes from malloc's heap, where freed memory is reused. MLXRL_KEEP_FREED=0 leaves malloc alone."""
    env = {**os.environ, "MLXRL_KEEP_FREED": keep}
    out = subprocess.run([sys.executable, "-c", KEEP_FREED_CHILD], env=env, capture_output=True, text=True)
    mapped0, heap0, mapped1, heap1 = map(int, out.stdout.split())
    assert mapped0 >= 64 << 20 and heap0 < 64 << 20
    if keep == "1":
        assert mapped1 < 64 << 20 <= heap1
    else:
        assert mapped1 >= 64 << 20 and heap1 < 64 << 20


ARENAS_CHILD = """
import ctypes, re, tempfile, threading
import mlxrl

libc = ctypes.CDLL("libc.so.6")
libc.fopen.restype = ctypes.c_void_p

def grow():  # a 1 MB block from a new thread: below the mmap threshold, so from an arena's heap
    block = bytearray(1 << 20)
    done.wait()

done = threading.Event()
threads = [threading.Thread(target=grow) for _ in range(4)]
for t in threads:
    t.start()
with tempfile.NamedTemporaryFile() as f:
    fp = libc.fopen(f.name.encode(), b"w")
    libc.malloc_info(0, ctypes.c_void_p(fp))
    libc.fclose(ctypes.c_void_p(fp))
    print(len(re.findall(r'<heap nr=', open(f.name).read())))
done.set()
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or runtime.default_device_kind() != "cpu",
                    reason="glibc's malloc on the CPU path")
@pytest.mark.parametrize("arena_max", [None, "4"])
def test_import_leaves_threads_one_malloc_arena(arena_max):
    """Threads started after `import mlxrl` allocate from malloc's main heap (one arena in malloc_info);
    a MALLOC_ARENA_MAX the user set is left alone (the threads get arenas of their own)."""
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    if arena_max:
        env["MALLOC_ARENA_MAX"] = arena_max
    out = subprocess.run([sys.executable, "-c", ARENAS_CHILD], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    heaps = int(out.stdout.split()[-1])
    assert heaps == 1 if arena_max is None else heaps > 1, heaps


TRIM_CHILD = """
import time
import mlxrl, mlx.core as mx
from mlxrl import runtime

def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon"):
            return int(line.split()[1]) << 10

runtime.setup()
hole, pin = mx.zeros((64 << 20) // 4) + 1, mx.zeros(1 << 18) + 1  # the hole below a live block
mx.eval(hole, pin)
del hole  # freed into malloc's heap, which keeps it
kept = anon()
with runtime.free_pages_returned(0.05):
    time.sleep(0.5)
    inside = anon()
mx.eval(pin)
print(kept, inside)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or runtime.default_device_kind() != "cpu",
                    reason="glibc's malloc on the CPU path")
@pytest.mark.parametrize("keep", ["1", "0"])
def test_free_pages_returned_while_training(keep):
    """Inside `runtime.free_pages_returned` a 64 MB range freed into malloc's kept heap stops being resident
    (the trimming thread hands its pages back); with MLXRL_KEEP_FREED=0 there is no kept heap: the block was
    unmapped on free, and nothing is left to return."""
    env = {**os.environ, "MLXRL_KEEP_FREED": keep}
    out = subprocess.run([sys.executable, "-c", TRIM_CHILD], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    kept, inside = map(int, out.stdout.split())
    if keep == "1":
        assert kept - inside >= 48 << 20, (kept, inside)
    else:
        assert abs(kept - inside) < 16 << 20, (kept, inside)


def test_huge_pages_env_sets_the_tunable_once():
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not sys.platform.startswith("linux") or not thp.exists() or "[never]" in thp.read_text():
        pytest.skip("no transparent huge pages here")
    env = blas.huge_pages_env({"PATH": "/bin"})
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1" and env["PATH"] == "/bin"
    other = blas.huge_pages_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    assert other["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    assert blas.huge_pages_env(env) is None  # already set: the re-executed process does not loop
    assert blas.huge_pages_env({"MLXRL_HUGE_PAGES": "0"}) is None


def test_reexec_only_for_python_m_mlxrl():
    """A CLI's `runtime.setup(cli=True)` under `python -m mlxrl...` re-executes the same command line with the
    tunable (the child here is a `-c` that prints it); importing mlxrl never does, nor does the setup
    under any other command line."""
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not sys.platform.startswith("linux") or not thp.exists() or "[never]" in thp.read_text():
        pytest.skip("no transparent huge pages here")
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "MLXRL_HUGE_PAGES")}
    show = "import os; print('tunables:', os.environ.get('GLIBC_TUNABLES'))"
    fake = f"import sys; sys.orig_argv = [sys.executable, '-c', {show!r}, '-m', 'mlxrl.sft']; "

    def run(code):
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)

    out = run(fake + "import mlxrl.runtime as r; r.setup(cli=True); print('not re-executed')")
    assert "tunables: glibc.malloc.hugetlb=1" in out.stdout and "not re-executed" not in out.stdout, out
    out = run(fake + "import mlxrl, mlxrl.runtime, os; print('tunables:', os.environ.get('GLIBC_TUNABLES'))")
    assert "tunables: None" in out.stdout, out
    out = run("import mlxrl.runtime as r, os; r.setup(cli=True); print('tunables:', os.environ.get('GLIBC_TUNABLES'))")
    assert "tunables: None" in out.stdout, out


def test_tf32_follows_torch_unless_asked(monkeypatch, tmp_path):
    """float32 on an NVIDIA GPU: full float32 matmuls unless --tf32 (torch's default; MLX's own is TF32).
    MLX reads MLX_ENABLE_TF32 at its first GPU matmul: the trainer sets it before it runs one."""
    monkeypatch.delenv("MLX_ENABLE_TF32", raising=False)
    assert runtime.apply_tf32() is False and os.environ["MLX_ENABLE_TF32"] == "0"
    monkeypatch.setenv("MLX_ENABLE_TF32", "1")  # the user's environment decides when the flag is not given
    assert runtime.apply_tf32(None) is True and os.environ["MLX_ENABLE_TF32"] == "1"
    assert runtime.apply_tf32(False) is False and os.environ["MLX_ENABLE_TF32"] == "0"
    from mlxrl.trainers.flags import build_parser, config_from_args
    from mlxrl.trainers.sft.config import SFTConfig

    parser = build_parser(SFTConfig, "sft", "")
    for argv, want in [(["--tf32", "true"], "1"), (["--tf32", "false"], "0"), ([], "0")]:
        monkeypatch.delenv("MLX_ENABLE_TF32", raising=False)
        args = config_from_args(SFTConfig, parser.parse_args(["--output_dir", str(tmp_path / "run"), *argv]))
        runtime.setup(tf32=args.tf32)
        assert os.environ["MLX_ENABLE_TF32"] == want, argv


def test_compile_note_only_for_a_compiled_step_on_cuda(monkeypatch):
    """The one line a trainer prints before a compiled step on MLX's CUDA backend (its first call builds
    the kernels with NVRTC): nothing on the CPU, nothing for an eager step, nothing on Metal."""
    if not mx.cuda.is_available():
        assert runtime.compile_note(True) == ""
    monkeypatch.setattr(runtime, "default_device_kind", lambda: "gpu")
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    note = runtime.compile_note(True)
    assert "CUDA" in note and "--compile false" in note
    assert runtime.compile_note(False) == ""
    monkeypatch.setattr(mx.cuda, "is_available", lambda: False)  # Metal
    assert runtime.compile_note(True) == ""
