"""The BLAS MLX's Linux CPU wheel runs, and malloc's huge pages: set up before ``mlx.core`` loads.

MLX's Linux CPU wheel bundles a reference BLAS; loading OpenBLAS or MKL with ``RTLD_GLOBAL`` before
``mlx.core`` makes MLX's ``sgemm`` resolve to it (`scripts/bench_blas.py` measures both). Loading it
after ``mlx.core`` does not rebind MLX's symbols, so this is the one thing mlxrl does when it is
imported: ``mlxrl/__init__`` imports ``mlxrl.cpu`` first, which calls `setup_blas()` before any
module imports ``mlx.core`` (a program that imported ``mlx.core`` first gets a warning).

Which one (`MLXRL_BLAS=auto`): Debian's OpenBLAS where it is installed (``libopenblas0-pthread``), else
Intel's MKL from its PyPI wheel, which the package depends on for Linux x86-64, so that ``pip install``
alone gives a fast BLAS (``libmkl_rt`` under the environment's ``lib/``: a venv's, the interpreter's,
or the user base of ``pip install --user``); else the reference, and the start-up line says how to get a
fast one. MKL has no aarch64 build: there Debian's OpenBLAS is the way, and the line says so.

OpenBLAS picks its kernels from the CPU model and falls back to its slowest generic x86-64 kernel
("Prescott") on CPUs newer than the build knows: unless ``OPENBLAS_CORETYPE`` is already set, it is
set from the CPU's flags (``/proc/cpuinfo``) before OpenBLAS loads. Its idle threads spin (``sched_yield``
in a loop) for 2^28 cycles after each call before they sleep, on the cores that mlxrl's native
kernels need between two matmuls: unless ``OPENBLAS_THREAD_TIMEOUT`` is already set, it is set to 4
(2^4 cycles: they sleep at once, and the next call wakes them; docs/benchmarks.md, "Figures behind the
code's choices").

Large buffers: glibc's malloc serves every block over 32 MB with a fresh mmap, faulted in 4 KB page
by page; with transparent huge pages in "madvise" mode `GLIBC_TUNABLES=glibc.malloc.hugetlb=1` makes
malloc ask for huge pages. The tunable is read only at process start, so the CLIs
(`runtime.setup(cli=True)`) re-execute `python -m mlxrl.<cli>` once with it set
(`reexec_with_huge_pages`); importing mlxrl never does. Python API users set the variable themselves.

Environment:
  MLXRL_HUGE_PAGES=0                                        (no re-exec; default on where THP is not "never")
  OPENBLAS_CORETYPE=...                                     (default: chosen from the CPU flags)
  OPENBLAS_THREAD_TIMEOUT=4..30                             (default 4: idle BLAS threads sleep at once)
  MLXRL_BLAS=auto|openblas|mkl|none|/path/to/libblas.so   (default auto)
"""

from __future__ import annotations

import ctypes
import glob
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
    """Re-execute `python -m mlxrl...` with `huge_pages_env()` (see the module docstring): only when the
    interpreter was started as `python -m mlxrl...` (`sys.orig_argv`), so a program or a test that calls a
    CLI's `main()` is never replaced. The new process sees the tunable set and does not re-execute again."""
    orig = getattr(sys, "orig_argv", [])
    if "-m" not in orig[:-1]:
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
    """libmkl_rt where pip puts the `mkl` wheel's libraries (its data files: `<prefix>/lib`), newest
    soname first, then the names the dynamic loader may find by itself."""
    import site

    prefixes = dict.fromkeys([sys.prefix, sys.base_prefix, getattr(site, "USER_BASE", None) or sys.prefix])
    found = [p for prefix in prefixes for p in sorted(glob.glob(str(Path(prefix) / "lib" / "libmkl_rt.so*")),
                                                        reverse=True)]
    return found + ["libmkl_rt.so.3", "libmkl_rt.so.2", "libmkl_rt.so"]


def no_fast_blas_fix() -> str:
    """What a Linux machine without a fast BLAS should install, in words for the start-up line."""
    if os.uname().machine == "x86_64":
        return "pip install mkl, or apt-get install libopenblas0-pthread"
    return "apt-get install libopenblas0-pthread (MKL has no build for this CPU)"


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
            # loading OpenBLAS after mlx.core does not rebind MLX's sgemm: the reference BLAS stays
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
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")  # read when OpenBLAS loads (see the docstring)
    if "OPENBLAS_CORETYPE" not in os.environ and os.uname().machine == "x86_64":
        core = _openblas_coretype(_cpu_flags())
        if core:
            os.environ["OPENBLAS_CORETYPE"] = core
    loaded = _try_load(candidates)
    if loaded is None:
        BLAS_IN_USE = f"reference (no OpenBLAS/MKL found: {no_fast_blas_fix()})"
    else:
        name = "MKL" if "mkl" in loaded else "OpenBLAS"
        core = os.environ.get("OPENBLAS_CORETYPE") if name == "OpenBLAS" else None
        BLAS_IN_USE = f"{name} ({loaded}{', ' + core if core else ''})"
    return BLAS_IN_USE
