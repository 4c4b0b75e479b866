"""Runtime policy: compute dtype, memory limits, and the explicit setup the CLIs and trainers call.

Importing mlxrl changes nothing but what must come before MLX's first use: the BLAS MLX loads on Linux
(`mlxrl.cpu.blas`, before ``mlx.core``) and, on the CPU, depth-first evaluation (`mlxrl.cpu.depth_first_eval`,
before MLX's first evaluation) and one malloc arena (`mlxrl.cpu.one_malloc_arena`). `setup()` is called by
every trainer (at construction) and every CLI (`setup(cli=True)`, first thing): it has glibc's malloc keep
freed memory for reuse (`keep_freed_memory`), sets MLX's CPU buffer cache (`default_cache_limit`: none where
malloc keeps it), and for a CLI re-executes `python -m mlxrl.<cli>` once with malloc's huge pages
(`cpu.blas.reexec_with_huge_pages`). While a trainer trains, the kept heap's free pages go back to the OS
every MLXRL_TRIM_SECONDS (`free_pages_returned`).

Environment:
  MLXRL_DTYPE=float32|bfloat16|float16                      (default: float32 on CPU, bf16 on GPU)
  MLXRL_CACHE_LIMIT=256MB                                   (MLX's CPU buffer cache; default 0, 256 MB with
                                                             MLXRL_KEEP_FREED=0; see default_cache_limit)
  MLXRL_KEEP_FREED=0                                        (malloc unmaps large blocks; see keep_freed_memory)
  MLXRL_TRIM_SECONDS=0.1                                    (the kept heap's free pages returned this often while
                                                             training; 0: never; see free_pages_returned)
  (the BLAS and huge-page variables: see mlxrl.cpu.blas)
"""

from __future__ import annotations

import math
import os
import sys
from contextlib import contextmanager

import mlx.core as mx

from .cpu import blas


def default_device_kind() -> str:
    """'gpu' when MLX's default device is a GPU (Metal or CUDA), else 'cpu'."""
    return "gpu" if mx.default_device() == mx.gpu else "cpu"


def compute_dtype(override: str | None = None) -> mx.Dtype:
    """float32 on CPU (MLX's bf16 matmul there is far slower than the float32 BLAS), bf16 on Metal/CUDA."""
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
KEPT_CACHE_LIMIT = 0  # the same when malloc keeps freed memory itself (keep_freed_memory)


def default_cache_limit(kept: bool = False) -> None:
    """On CPU, keep up to CPU_CACHE_LIMIT (env MLXRL_CACHE_LIMIT) of freed buffers for reuse; none
    (KEPT_CACHE_LIMIT) when `kept`, malloc keeping freed memory in its heap (`keep_freed_memory`).

    MLX's CPU allocator keeps little by default, so every larger temporary (a [rows, vocab] logits tile,
    an attention score tensor) is returned to the OS and the next one page-faults in again. Raising the
    cache does not change `mx.get_peak_memory()` (active memory); the resident size may be up to the
    cache limit above it. Once malloc keeps freed memory, a freed buffer is reused from its heap for any
    size, where MLX's cache reuses it only for the same size: the cache then holds memory nothing else can
    use, up to its limit, and saves no time. The trade, measured, is in docs/platforms.md ("Runtime") and
    `scripts/bench_cpu_ops.py`."""
    if default_device_kind() == "gpu":
        return
    mx.set_cache_limit(default_cpu_cache_bytes(kept))


def default_cpu_cache_bytes(kept: bool | None = None) -> int:
    """The CPU buffer cache `default_cache_limit` sets: MLXRL_CACHE_LIMIT when given, else none where malloc
    keeps freed memory (`kept`; None: where `keep_freed_memory` would, the planner's guess), else
    CPU_CACHE_LIMIT."""
    value = os.environ.get("MLXRL_CACHE_LIMIT")
    if value:
        return parse_size(value, device_memory_bytes())
    if kept is None:
        kept = _keeps_freed_memory_here()
    return KEPT_CACHE_LIMIT if kept else CPU_CACHE_LIMIT


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD = 1 << 30  # blocks below this come from malloc's heap and are reused after free


def keep_freed_memory() -> bool:
    """On CPU with glibc, have malloc serve blocks up to MMAP_THRESHOLD from its heap and keep freed
    memory there for reuse (env MLXRL_KEEP_FREED=0: off). True when set.

    glibc maps every block over its mmap threshold (at most 32 MB by default) with a fresh `mmap` and
    unmaps it on free, so each layer's [tokens, width] activations, recomputed and freed every step,
    are faulted in page by page and zeroed by the kernel again and again. MLX's CPU allocator keeps
    freed buffers only up to its cache limit and only for an exact size (`default_cache_limit`); the
    heap reuses any freed range for any size. Resident memory stays at the heap's high-water mark
    instead of falling back between steps: the peak is what it was (measured in docs/platforms.md, "Runtime")."""
    if not _keeps_freed_memory_here():
        return False
    libc = _glibc()
    try:
        return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
                    and libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1))
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False


def _glibc():
    """The C library as ctypes sees it (its glibc-only functions are missing elsewhere); None if not loadable."""
    import ctypes

    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def _keeps_freed_memory_here() -> bool:
    """Whether `keep_freed_memory` asks malloc to keep freed memory here: the CPU on Linux, unless
    MLXRL_KEEP_FREED=0 (glibc's mallopt may still refuse: musl has none)."""
    return default_device_kind() == "cpu" and sys.platform.startswith("linux") \
        and os.environ.get("MLXRL_KEEP_FREED", "1") != "0"


TRIM_SECONDS = 0.1  # how often `free_pages_returned` hands the heap's free pages back while training (0: never)


@contextmanager
def free_pages_returned(seconds: float | None = None):
    """Inside, where malloc keeps freed memory (`keep_freed_memory`), a daemon thread calls glibc's
    `malloc_trim(0)` every `seconds` (default: MLXRL_TRIM_SECONDS, else TRIM_SECONDS; 0: never).

    The kept heap reuses a freed range for any later block that fits in it; a range no block has fit in
    since it was freed stays resident, so the process's resident size rises above MLX's live memory by the
    heap's free ranges.
    `malloc_trim(0)` gives the physical pages of every free range back to the OS (`madvise`
    MADV_DONTNEED): the ranges stay in the heap, so reuse still needs no `mmap`, and only a range reused
    after a trim is faulted in again, where without the kept heap every large block is. The thread holds
    malloc's lock only while it walks the free lists (measured in docs/platforms.md, "Runtime")."""
    if seconds is None:
        seconds = float(os.environ.get("MLXRL_TRIM_SECONDS") or TRIM_SECONDS)
    if seconds <= 0 or not _keeps_freed_memory_here():
        yield
        return
    import threading

    trim = getattr(_glibc(), "malloc_trim", None)
    if trim is None:  # not glibc
        yield
        return
    stop = threading.Event()

    def loop():
        while not stop.wait(seconds) and not sys.is_finalizing():
            trim(0)

    threading.Thread(target=loop, name="mlxrl-malloc-trim", daemon=True).start()
    try:
        yield
    finally:
        stop.set()  # the thread ends at its next wake; no join, which a Ctrl-C held down could interrupt


def set_memory_limits(memory_limit=None, wired_limit=None, cache_limit=None) -> dict:
    """MLX's counterparts of PYTORCH_MPS_HIGH_WATERMARK_RATIO and friends.

    Each value is bytes, a string like '12GB', or a fraction (0-1] of device memory.
    Returns the limits that were applied.
    """
    total = device_memory_bytes()
    applied = {}
    mem = parse_size(memory_limit, total, "memory_limit")
    if mem is not None:
        mx.set_memory_limit(mem)
        applied["memory_limit"] = mem
    wired = parse_size(wired_limit, total, "wired_limit")
    if wired is not None:
        if default_device_kind() == "gpu" and sys.platform == "darwin":
            mx.set_wired_limit(wired)
        applied["wired_limit"] = wired
    cache = parse_size(cache_limit, total, "cache_limit")
    if cache is not None:
        mx.set_cache_limit(cache)
        applied["cache_limit"] = cache
    return applied


def startup_line(dtype: mx.Dtype | None = None, note: str = "") -> str:
    """What runs where: MLX, the device, the BLAS, the compute dtype (the model's when given)."""
    dev = "gpu" if default_device_kind() == "gpu" else "cpu"
    name = str(dtype or compute_dtype()).split(".")[-1]
    return f"mlxrl: mlx {mx.__version__} on {dev}, BLAS {blas.BLAS_IN_USE}, compute dtype {name}{note}"


def compile_note(compiled: bool) -> str:
    """One line for a compiled step on MLX's CUDA backend, else "". MLX builds each fused kernel of a compiled
    step with NVRTC at its first call and keeps the PTX (`<tmp>/mlx/<version>/ptx`, MLX_PTX_CACHE_DIR), so a
    machine's first run pays for it, and long enough to look like a hang (figures: docs/platforms.md, "On a real
    GPU")."""
    if not compiled or not mx.cuda.is_available() or default_device_kind() != "gpu":
        return ""
    return ("mlxrl: CUDA builds a compiled step's kernels at its first call (slow on a machine's first run, "
            "kept in MLX's PTX cache after); --compile false steps eagerly")


_SET_UP = False


def apply_tf32(flag: bool | None = None) -> bool:
    """Whether float32 matmuls may run in TF32 on a GPU; returns the setting in effect.

    MLX's CUDA backend runs float32 matmuls and convolutions in TF32 (10-bit mantissa, ~1e-3 relative
    error) unless MLX_ENABLE_TF32=0 (its Metal backend reads the same switch for the neural accelerators'
    matmuls of newer Apple GPUs); torch's default is full float32, which transformers' `tf32=None` leaves
    as it is. mlxrl follows torch (and so TRL): off unless `tf32=True`, or MLX_ENABLE_TF32 set in the
    environment when `flag` is None. MLX reads the variable once, at its first float32 matmul on the GPU:
    the CLIs and trainers call this before anything runs one (in Python, call it, or export the variable,
    before running a model). No effect on the CPU or on bf16 compute."""
    if flag is not None or "MLX_ENABLE_TF32" not in os.environ:
        os.environ["MLX_ENABLE_TF32"] = "1" if flag else "0"
    return os.environ["MLX_ENABLE_TF32"] not in ("0", "")


def setup(cli: bool = False, tf32: bool | None = None, use_cpu: bool = False) -> None:
    """What mlxrl changes in the process, done when asked instead of at import: a CLI
    (`cli=True`, called first thing in its main) re-executes itself with malloc's huge pages (only
    for `python -m mlxrl...`; the new process sees the tunable and goes on); every call applies
    `tf32` (`apply_tf32`); the first call sets malloc's reuse of freed memory (`keep_freed_memory`) and
    MLX's CPU buffer cache (`default_cache_limit`: none when malloc keeps freed memory; a trainer's
    --cache_limit is applied after it). `use_cpu` (TrainingArguments' flag): MLX's default device becomes
    the CPU, before a CLI loads the model (whose default dtype follows the device)."""
    global _SET_UP
    if cli:
        blas.reexec_with_huge_pages()
    apply_tf32(tf32)
    if use_cpu:
        mx.set_default_device(mx.cpu)
    if not _SET_UP:
        default_cache_limit(kept=keep_freed_memory())
        _SET_UP = True

