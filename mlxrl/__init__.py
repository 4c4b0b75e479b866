"""mlxrl: MLX-native SFT / DPO / ORPO / CPO / KTO / GRPO for Qwen and Qwen-VL models.

Importing mlxrl loads a fast BLAS before ``mlx.core`` on Linux, asks MLX for depth-first evaluation
on the CPU and glibc's malloc for one arena (`mlxrl.cpu`: each must precede MLX's first use or the first
worker thread's allocation) and nothing else: the trainers and loaders
below are imported when first used, and process-wide settings (MLX's CPU buffer cache, the CLIs'
huge-page re-exec) are made by `mlxrl.runtime.setup()`, which the CLIs and the trainers call.
"""

from . import cpu  # noqa: F401  (the BLAS before mlx.core)

__version__ = "0.1.0"

from .registry import exports as _trainer_exports  # noqa: E402  (a table: imports nothing heavy)

_LAZY = {"MlxrlError": "errors", "load": "loading", "load_default": "loading", "save": "loading",
         **_trainer_exports(), "runtime": None}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    """`mlxrl.SFTTrainer` and friends, imported on first use (PEP 562)."""
    import importlib

    if name not in _LAZY:
        raise AttributeError(f"module 'mlxrl' has no attribute {name!r}")
    module = _LAZY[name]
    value = importlib.import_module(f"{__name__}.{module or name}")
    if module is not None:
        value = getattr(value, name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + list(_LAZY))
