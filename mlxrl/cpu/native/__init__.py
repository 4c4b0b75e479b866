"""mlxrl's native CPU kernels, compiled on first use on this machine (as MLX compiles its own CPU kernels).

MLX's Linux CPU wheel is built for baseline x86-64: `mx.exp`, `mx.sigmoid` and `mx.softmax` are
scalar loops whose fma calls go through libm, ~0.05 G elements/s against ~1.3 for a multiply. A
training step spends most of its non-matmul time there (the attention softmax, SiLU, the LM head's
exp). `cpu_math.cpp` holds vectorised, multi-threaded exp / sigmoid / softmax (last axis) as MLX
primitives with VJPs and JVPs; `mlxrl.fastmath` routes float32 CPU arrays to them. It also holds the
AdamW step (updating in place: no second copy of weights and moments) and the fused LM head
(`mlxrl.losses.fused_head`: one reused tile, the weight gradient accumulated in place by the BLAS),
counter-hash dropout, and the decoder's RMSNorm, rotary embedding and SwiGLU product with their VJPs
(one multi-threaded pass each, where MLX runs several single-core ops), FlashAttention, the gated delta
rule of Qwen3.5's linear attention and its causal convolution (`gated_delta.cpp`, `causal_conv.cpp`), and a
mixture-of-experts layer's gathered matmuls (`experts.cpp`), which cpu_math.cpp #includes: the one
translation unit.

The module is built with the system's `g++` against the installed MLX's headers and library and
nanobind (in MLX's nanobind domain, so `mx.array` crosses unchanged), with `-O3 -march=native`,
into a cache folder keyed by everything the binary depends on (the sources, MLX and nanobind versions,
Python ABI, compiler, CPU flags). The first build takes ~10 s; a file lock keeps concurrent
processes (pytest workers, `mlx.launch` ranks) from building twice, and the library is moved into
place atomically. Where anything is missing (no compiler, no nanobind, a failed build or a module
that cannot exchange arrays with MLX) `load()` returns None once, with one warning saying why, and
mlxrl uses MLX's own ops.

Environment:
  MLXRL_NATIVE=0             use MLX's ops (no build)
  MLXRL_NATIVE_CACHE=DIR     where builds are kept (default ~/.cache/mlxrl/native)
  MLXRL_CPU_THREADS=N        threads per kernel (default: the CPUs this process may run on)
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import warnings
from pathlib import Path

import mlx.core as mx

SOURCE = Path(__file__).with_name("cpu_math.cpp")
# every source the build reads (the build key hashes them): cpu_math.cpp, the one translation unit, and the
# kernels it #includes from this folder (gated_delta.cpp, causal_conv.cpp, experts.cpp)
SOURCES = sorted(Path(__file__).parent.glob("*.cpp"))
MODULE = "_cpu_math"
CXX = os.environ.get("CXX", "g++")
FLAGS = ["-O3", "-march=native", "-std=gnu++20", "-fopenmp-simd", "-fPIC", "-fvisibility=hidden", "-DNDEBUG",
         "-DNB_DOMAIN=mlx"]
NANOBIND_FLAGS = ["-O2", "-std=c++17", "-fPIC", "-fvisibility=hidden", "-fno-strict-aliasing", "-DNB_BUILD",
                  "-DNB_COMPACT_ASSERTIONS", "-DNDEBUG", "-DNB_DOMAIN=mlx"]

_state: dict = {}


def cache_root() -> Path:
    return Path(os.environ.get("MLXRL_NATIVE_CACHE") or Path.home() / ".cache" / "mlxrl" / "native")


def _cpu_signature() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    lines = [line for line in text.splitlines() if line.startswith(("flags", "model name", "Features"))]
    return "\n".join(sorted(set(lines)))


def _compiler_version() -> str:
    out = subprocess.run([CXX, "--version"], capture_output=True, text=True, check=True)
    return out.stdout.splitlines()[0]


def build_key(nanobind_version: str) -> str:
    parts = [*(p.read_bytes().decode() for p in SOURCES), mx.__version__, nanobind_version,
             sysconfig.get_config_var("EXT_SUFFIX"), _compiler_version(), _cpu_signature(),
             " ".join(FLAGS + NANOBIND_FLAGS)]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def _paths():
    import mlx.core
    import nanobind

    mlx_dir = Path(mlx.core.__file__).parent  # not mlx.__path__[0]: a namespace package (any folder named mlx)
    nb_dir = Path(nanobind.__file__).parent
    includes = [sysconfig.get_paths()["include"], str(nb_dir / "include"),
                str(nb_dir / "ext" / "robin_map" / "include")]
    return mlx_dir, nb_dir, includes, nanobind.__version__


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"`{' '.join(cmd[:2])} ...` failed: {' | '.join(tail)}")


def build(target: Path) -> None:
    """Compile cpu_math.cpp and nanobind's library into the extension at `target`."""
    mlx_dir, nb_dir, includes, _ = _paths()
    inc = [f"-I{p}" for p in includes]
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        nb_obj, k_obj, lib = Path(tmp, "nb.o"), Path(tmp, "k.o"), Path(tmp, target.name)
        _run([CXX, *NANOBIND_FLAGS, *inc, "-c", str(nb_dir / "src" / "nb_combined.cpp"), "-o", str(nb_obj)])
        _run([CXX, *FLAGS, *inc, f"-I{mlx_dir / 'include'}", "-c", str(SOURCE), "-o", str(k_obj)])
        _run([CXX, "-shared", str(k_obj), str(nb_obj), f"-L{mlx_dir / 'lib'}", "-lmlx",
              f"-Wl,-rpath,{mlx_dir / 'lib'}", "-o", str(lib)])
        os.replace(lib, target)  # atomic: a reader sees the old file or the whole new one


def _import(path: Path):
    loader = importlib.machinery.ExtensionFileLoader(MODULE, str(path))
    spec = importlib.util.spec_from_file_location(MODULE, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _load():
    if os.environ.get("MLXRL_NATIVE", "1") == "0":
        return None, "MLXRL_NATIVE=0"
    if not sys.platform.startswith("linux"):
        return None, None  # MLX's CPU kernels are vectorised on macOS (NEON); these are for Linux
    if shutil.which(CXX) is None:
        return None, f"no C++ compiler `{CXX}` on PATH (apt-get install g++)"
    try:
        _, _, _, nb_version = _paths()
    except ImportError:
        return None, "nanobind is not installed (pip install nanobind)"
    folder = cache_root() / build_key(nb_version)
    target = folder / (MODULE + sysconfig.get_config_var("EXT_SUFFIX"))
    if not target.exists():
        import fcntl

        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building it: wait, then reuse
            if not target.exists():
                # the one slow moment a first run has before its first step: say what it is
                print("mlxrl: compiling the native CPU kernels for this machine (once; about 10-30 s)",
                      file=sys.stderr, flush=True)
                build(target)
    module = _import(target)
    with mx.stream(mx.cpu):  # arrays cross between MLX and the module (on the CPU, also where a GPU is the default)
        mx.eval(module.exp(mx.array([0.0], dtype=mx.float32)))
    return module, None


def load():
    """The compiled kernel module, or None (with one warning saying why) where it cannot be had."""
    if "module" not in _state:
        try:
            module, why = _load()
        except Exception as exc:  # a failed build must not stop training: MLX's ops still work
            module, why = None, f"{type(exc).__name__}: {exc}"
        _state["module"] = module
        if module is None and why and why != "MLXRL_NATIVE=0":
            warnings.warn(f"mlxrl: native CPU kernels unavailable ({why}); using MLX's slower CPU ops. "
                          "Set MLXRL_NATIVE=0 to silence.", RuntimeWarning, stacklevel=2)
    return _state["module"]
