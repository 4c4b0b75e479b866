"""Runtime policy: fast BLAS on Linux, compute dtype, memory limits.

Imported first by ``mlxrl/__init__.py`` so that an optimised BLAS is loaded before
``mlx.core``. MLX's Linux CPU wheel bundles a reference BLAS (~6 GFLOP/s fp32);
loading OpenBLAS or MKL with ``RTLD_GLOBAL`` first makes MLX's ``sgemm`` resolve to
it (~30x faster).

OpenBLAS picks its kernels from the CPU model and falls back to its slowest generic x86-64
kernel ("Prescott") on CPUs newer than the build knows: Debian's 0.3.21 on an Emerald Rapids VM
ran fp32 sgemm at ~60 GFLOP/s instead of ~290. Unless ``OPENBLAS_CORETYPE`` is already set, it
is set from the CPU's flags (``/proc/cpuinfo``) before OpenBLAS loads.

Large buffers: glibc's malloc serves every block over 32 MB with a fresh mmap, so each new
[rows, vocab] tile or attention-score block is faulted in 4 KB page by page; with transparent huge
pages in "madvise" mode (Debian's default) `GLIBC_TUNABLES=glibc.malloc.hugetlb=1` makes malloc ask
for huge pages. That tunable is read only at process start, so `python -m mlxrl.<cli>` re-executes
itself once with it set (`reexec_with_huge_pages`, before anything heavy is imported). Measured with
`scripts/bench_sft.py --models small` (two runs, idle): our SFT step 32.8 -> 27.9 s, TRL's 15.9 ->
15.5 s, peak RSS unchanged (7.65 / 7.64 GB). Python API users set the variable themselves.

Environment:
  MLXRL_HUGE_PAGES=0                                        (no re-exec; default on where THP is not "never")
  OPENBLAS_CORETYPE=...                                     (default: chosen from the CPU flags)
  MLXRL_BLAS=auto|openblas|mkl|none|/path/to/libblas.so   (default auto)
  MLXRL_DTYPE=float32|bfloat16|float16                      (default: float32 on CPU, bf16 on GPU)
"""

from __future__ import annotations

import ctypes
import glob
import math
import os
import sys
from pathlib import Path

OPENBLAS_PATHS = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
)

BLAS_IN_USE = "system"  # what the startup line reports
REFERENCE_CHOICES = ("none", "off", "0", "reference")  # MLXRL_BLAS values that keep MLX's bundled BLAS


HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb=1"


def huge_pages_env(environ=None) -> dict | None:
    """A copy of `environ` with glibc's malloc asked for transparent huge pages, or None where that
    is already set, turned off (MLXRL_HUGE_PAGES=0), not Linux, or THP is "never"."""
    env = dict(os.environ if environ is None else environ)
    tunables = env.get("GLIBC_TUNABLES", "")
    if not sys.platform.startswith("linux") or env.get("MLXRL_HUGE_PAGES", "1") == "0" \
            or "glibc.malloc.hugetlb" in tunables:
        return None
    try:
        if "[never]" in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text():
            return None
    except OSError:
        return None
    env["GLIBC_TUNABLES"] = f"{tunables}:{HUGE_PAGES_TUNABLE}" if tunables else HUGE_PAGES_TUNABLE
    return env


def reexec_with_huge_pages() -> None:
    """Re-execute `python -m mlxrl...` with `huge_pages_env()` (see the module docstring). Only when
    the package is being imported for `-m mlxrl...` (sys.argv[0] is "-m" then), so importing mlxrl
    from a program or a test never replaces the process. The new process sees the tunable set and
    does not re-execute again."""
    orig = getattr(sys, "orig_argv", [])
    if not sys.argv or sys.argv[0] != "-m" or "-m" not in orig[:-1]:
        return
    module = orig[orig.index("-m") + 1]
    if module != "mlxrl" and not module.startswith("mlxrl."):
        return
    env = huge_pages_env()
    if env is None:
        return
    for stream in (sys.stdout, sys.stderr):  # None when closed
        if stream is not None:
            stream.flush()
    os.execve(sys.executable, [sys.executable, *orig[1:]], env)


reexec_with_huge_pages()


def _bundled_reference_blas() -> bool:
    """True when the installed MLX CPU wheel ships its own (reference) libblas.

    Looked up through the installed distribution, not `import mlx`, so that a folder named `mlx`
    in the working directory cannot hide it."""
    from importlib import metadata

    for dist in ("mlx-cpu", "mlx"):
        try:
            root = Path(metadata.distribution(dist).locate_file(""))
        except metadata.PackageNotFoundError:
            continue
        if glob.glob(str(root / "mlx_cpu.libs" / "libblas*")):
            return True
    return False


def _mkl_paths() -> list[str]:
    prefix = Path(sys.prefix)
    found = glob.glob(str(prefix / "lib" / "libmkl_rt.so*"))
    return found + ["libmkl_rt.so.2", "libmkl_rt.so"]


def _openblas_coretype(flags: set[str]) -> str | None:
    """The OpenBLAS kernel family for x86-64 CPU flags; None where its own detection is fine."""
    if "avx512_bf16" in flags:
        return "Cooperlake"
    if "avx512f" in flags and "avx512vl" in flags:
        return "SkylakeX"
    if "avx2" in flags and "fma" in flags:
        return "Haswell"
    return None


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _try_load(paths) -> str | None:
    for p in paths:
        if os.sep in p and not os.path.exists(p):
            continue
        try:
            ctypes.CDLL(p, mode=ctypes.RTLD_GLOBAL)
            return p
        except OSError:
            continue
    return None


def setup_blas() -> str:
    """Load an optimised BLAS before ``mlx.core`` when MLX would use its reference one.

    Returns a short description of the BLAS in use.
    """
    global BLAS_IN_USE
    choice = os.environ.get("MLXRL_BLAS", "auto").strip().lower()
    if sys.platform != "linux":
        BLAS_IN_USE = "Accelerate" if sys.platform == "darwin" else "system"
        return BLAS_IN_USE
    if "mlx.core" in sys.modules:
        BLAS_IN_USE = "unchanged (mlx.core was imported before mlxrl)"
        if choice not in REFERENCE_CHOICES and _bundled_reference_blas():
            # measured: loading OpenBLAS after mlx.core does not rebind MLX's sgemm (4.7 GFLOP/s)
            import warnings

            warnings.warn("mlx.core was imported before mlxrl, so MLX keeps the reference BLAS its Linux wheel "
                          "bundles (fp32 matmul ~50x slower); import mlxrl before mlx.core", stacklevel=3)
        return BLAS_IN_USE
    if choice in REFERENCE_CHOICES:
        BLAS_IN_USE = "reference (MLXRL_BLAS=none)"
        return BLAS_IN_USE
    if not _bundled_reference_blas() and choice == "auto":
        BLAS_IN_USE = "system"
        return BLAS_IN_USE
    if choice == "openblas":
        candidates = list(OPENBLAS_PATHS)
    elif choice == "mkl":
        candidates = _mkl_paths()
    elif choice == "auto":
        candidates = list(OPENBLAS_PATHS) + _mkl_paths()
    else:
        candidates = [choice]
    if "OPENBLAS_CORETYPE" not in os.environ and os.uname().machine == "x86_64":
        core = _openblas_coretype(_cpu_flags())
        if core:
            os.environ["OPENBLAS_CORETYPE"] = core
    loaded = _try_load(candidates)
    if loaded is None:
        BLAS_IN_USE = "reference (no OpenBLAS/MKL found: apt-get install libopenblas0-pthread)"
    else:
        name = "MKL" if "mkl" in loaded else "OpenBLAS"
        core = os.environ.get("OPENBLAS_CORETYPE") if name == "OpenBLAS" else None
        BLAS_IN_USE = f"{name} ({loaded}{', ' + core if core else ''})"
    return BLAS_IN_USE


setup_blas()

import mlx.core as mx  # noqa: E402  (must come after setup_blas)


def default_device_kind() -> str:
    """'gpu' when MLX's default device is a GPU (Metal or CUDA), else 'cpu'."""
    return "gpu" if mx.default_device() == mx.gpu else "cpu"


def compute_dtype(override: str | None = None) -> mx.Dtype:
    """float32 on CPU (bf16 matmul on MLX CPU is ~30x slower), bf16 on Metal/CUDA."""
    name = override or os.environ.get("MLXRL_DTYPE")
    if name:
        try:
            return {"float32": mx.float32, "fp32": mx.float32, "bfloat16": mx.bfloat16,
                    "bf16": mx.bfloat16, "float16": mx.float16, "fp16": mx.float16}[name.lower()]
        except KeyError:
            raise ValueError(f"unknown dtype {name!r}: use float32, bfloat16 or float16") from None
    return mx.bfloat16 if default_device_kind() == "gpu" else mx.float32


_UNITS = (("TB", 1 << 40), ("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10), ("B", 1))


def parse_size(value: float | int | str | None, total: int | None, name: str = "size") -> int | None:
    """'8GB', '512MiB', 0.75 (a fraction of `total`) or a whole byte count -> bytes; None / '' -> None.

    Anything else is a one-line ValueError naming `name` and the accepted forms."""
    if value is None or value == "":
        return None
    usage = (f"{name} {value!r}: use a size like '12GB' or '512MiB', a whole number of bytes, or a fraction "
             "in (0, 1] of the device's memory")
    if isinstance(value, bool):
        raise ValueError(usage)
    mult = None
    if isinstance(value, str):
        s = value.strip().upper().replace("IB", "B").replace(" ", "")
        for unit, m in _UNITS:
            if s.endswith(unit):
                s, mult = s[: -len(unit)], m
                break
        try:
            value = float(s)
        except ValueError:
            raise ValueError(usage) from None
    if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(usage)
    if mult is not None:
        return int(value * mult)
    if 0 < value <= 1.0:
        if total is None:
            raise ValueError(f"{name} {value!r}: a fraction needs the device's memory size, which is unknown here; "
                             "give a size like '12GB'")
        return int(value * total)
    if not float(value).is_integer():
        raise ValueError(usage)
    return int(value)


def _parse_bytes(value: float | int | str | None, total: int | None, name: str = "size") -> int | None:
    """'8GB', '512MiB', 0.75 (fraction of total) or a byte count -> bytes (see `parse_size`)."""
    return parse_size(value, total, name)


def device_memory_bytes() -> int | None:
    """Memory the default device can use (recommended working set on GPU, RAM on CPU)."""
    try:
        info = mx.device_info()
        for key in ("max_recommended_working_set_size", "memory_size"):
            if info.get(key):
                return int(info[key])
    except Exception:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return None


CPU_CACHE_LIMIT = 256 << 20  # bytes of freed buffers MLX keeps for reuse on CPU (its default is 32 MB)


def default_cache_limit() -> None:
    """On CPU, keep up to CPU_CACHE_LIMIT (256 MB; env MLXRL_CACHE_LIMIT) of freed buffers for reuse.

    MLX's CPU allocator keeps only 32 MB by default, so every larger temporary (a [1024, 151936]
    logits tile is 622 MB; an attention score tensor at L=1024 is 64 MB) is returned to the OS and
    the next one page-faults in again: `python scripts/bench_cpu_ops.py`, `y + 1` on a 156 MB
    [256, 151936] tile, 0.077 s with 32 MB vs 0.026 s with 256 MB (a 622 MB tile fits neither).
    Raising the cache does not change `mx.get_peak_memory()` (active memory); the process's
    resident size may be up to the cache limit above it. The SFT benchmark's tiny model
    (scripts/bench_sft.py --models tiny, three separate runs with MLXRL_CACHE_LIMIT set; runs vary
    ~10%), s/step and peak RSS: 32 MB 6.17 s / 1.32 GB, 256 MB 5.62 s / 1.63 GB, 1 GiB 4.83 s /
    2.21 GB; 256 MB is the default, memory first."""
    if default_device_kind() == "gpu":
        return
    value = os.environ.get("MLXRL_CACHE_LIMIT")
    mx.set_cache_limit(_parse_bytes(value, device_memory_bytes()) if value else CPU_CACHE_LIMIT)


def set_memory_limits(memory_limit=None, wired_limit=None, cache_limit=None) -> dict:
    """MLX's counterparts of PYTORCH_MPS_HIGH_WATERMARK_RATIO and friends.

    Each value is bytes, a string like '12GB', or a fraction (0-1] of device memory.
    Returns the limits that were applied.
    """
    total = device_memory_bytes()
    applied = {}
    mem = _parse_bytes(memory_limit, total, "memory_limit")
    if mem is not None:
        mx.set_memory_limit(mem)
        applied["memory_limit"] = mem
    wired = _parse_bytes(wired_limit, total, "wired_limit")
    if wired is not None:
        if default_device_kind() == "gpu" and sys.platform == "darwin":
            mx.set_wired_limit(wired)
        applied["wired_limit"] = wired
    cache = _parse_bytes(cache_limit, total, "cache_limit")
    if cache is not None:
        mx.set_cache_limit(cache)
        applied["cache_limit"] = cache
    return applied


def startup_line(dtype: mx.Dtype | None = None, note: str = "") -> str:
    """What runs where: MLX, the device, the BLAS, the compute dtype (the model's when given)."""
    dev = "gpu" if default_device_kind() == "gpu" else "cpu"
    name = str(dtype or compute_dtype()).split(".")[-1]
    return f"mlxrl: mlx {mx.__version__} on {dev}, BLAS {BLAS_IN_USE}, compute dtype {name}{note}"


default_cache_limit()
