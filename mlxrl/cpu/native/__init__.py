"""mlxrl's native CPU kernels, compiled on first use on this machine (as MLX compiles its own CPU kernels).

MLX's Linux CPU wheel is built for baseline x86-64: `mx.exp`, `mx.sigmoid` and `mx.softmax` are
scalar loops whose fma calls go through libm, far slower than a multiply (the figures: docs/benchmarks.md,
"Figures behind the code's choices"). A training step spends most of its non-matmul time there (the
attention softmax, SiLU, the LM head's exp). The kernels here are MLX primitives, float32, vectorised and
multi-threaded, one C++ source per family:

  common.h         what the families share: the includes, the vectorised exp (the Cephes algorithm MLX uses)
                   and its row max / exp-sum loops, the threading helpers, the primitives' output buffers (the
                   queue drained before a large one, see drain_bytes) and base classes
  microkernel.h    the register-tiled micro-kernel of the small products (FlashAttention's blocks, the gated
                   delta rule's chunks)
  elementwise.cpp  exp / sigmoid / softmax (last axis) with VJPs and JVPs; `mlxrl.cpu.fastmath` routes
                   float32 CPU arrays to them
  optimizers.cpp   the gradient norm's sum of squares, the AdamW step (updating in place: no second copy of
                   weights and moments) and 8-bit blockwise AdamW
  fused_head.cpp   the fused LM head (`mlxrl.losses.fused_head`: one reused tile, the weight gradient
                   accumulated in place by the BLAS; a frozen head in one pass over vocabulary blocks)
  dropout.cpp      counter-hash dropout, and LoRA's dropout + down-projection without the dropout copy
  layers.cpp       RMSNorm, LayerNorm, rotary embedding, the SwiGLU product and GELU's tanh form with their
                   VJPs (one multi-threaded pass each, where MLX runs several single-core ops)
  attention.cpp    FlashAttention, forward and backward
  gated_delta.cpp  the gated delta rule of Qwen3.5's linear attention, forward and backward
  causal_conv.cpp  its causal convolution with the SiLU, and the VJP
  experts.cpp      a mixture-of-experts layer's gathered matmuls, one GEMM per expert
  bindings.cpp     the module `_cpu_math` (every binding), and the one translation unit the build compiles:
                   it #includes each family's source

The module is built with the system's `g++` against the installed MLX's headers and library and
nanobind (in MLX's nanobind domain, so `mx.array` crosses unchanged), with `-O3 -march=native`,
into a cache folder keyed by everything the binary depends on (the sources and headers, MLX and nanobind
versions, Python ABI, compiler, CPU flags). The first build takes a while (once per key); a file lock keeps
concurrent processes (pytest workers, `mlx.launch` ranks) from building twice, and the library is moved into
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

SOURCE = Path(__file__).with_name("bindings.cpp")
# every file the build reads (the build key hashes them): bindings.cpp, the one translation unit, and the
# family sources and headers it #includes from this folder
SOURCES = sorted([*Path(__file__).parent.glob("*.cpp"), *Path(__file__).parent.glob("*.h")])
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
    """Compile bindings.cpp (with the sources it includes) and nanobind's library into the extension at `target`."""
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
