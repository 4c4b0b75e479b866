"""mlxrl: MLX-native SFT / DPO / GRPO for Qwen and Qwen-VL models.

Importing mlxrl loads a fast BLAS before ``mlx.core`` on Linux, asks MLX for depth-first evaluation
on the CPU and glibc's malloc for one arena (`mlxrl.cpu`: each must precede MLX's first use or the first
worker thread's allocation) and nothing else: the trainers and loaders
below are imported when first used, and process-wide settings (MLX's CPU buffer cache, the CLIs'
huge-page re-exec) are made by `mlxrl.runtime.setup()`, which the CLIs and the trainers call.
"""

from . import cpu  # noqa: F401  (the BLAS before mlx.core)

__version__ = "0.1.0"

_LAZY = {"MlxrlError": "errors", "load": "loading", "load_default": "loading", "save": "loading",
         "SFTConfig": "trainers.sft.config", "SFTTrainer": "trainers.sft.trainer", "DPOConfig": "trainers.dpo.config",
         "DPOTrainer": "trainers.dpo.trainer", "GRPOConfig": "trainers.grpo.config",
         "GRPOTrainer": "trainers.grpo.trainer", "runtime": None}

__all__ = ["DPOConfig", "DPOTrainer", "GRPOConfig", "GRPOTrainer", "MlxrlError",
           "SFTConfig", "SFTTrainer", "load", "load_default", "save",
           "runtime"]


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
