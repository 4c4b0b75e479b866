"""mlxrl: MLX-native SFT / DPO / GRPO for Qwen and Qwen-VL models."""

from . import runtime  # noqa: F401  (loads a fast BLAS before mlx.core)

__version__ = "0.1.0"

from .hub import MlxrlError  # noqa: E402
from .loading import load, load_default, save  # noqa: E402
from .trainers.config import SFTConfig  # noqa: E402
from .trainers.dpo import DPOConfig, DPOTrainer  # noqa: E402
from .trainers.grpo import GRPOConfig, GRPOTrainer  # noqa: E402
from .trainers.sft import SFTTrainer  # noqa: E402

__all__ = ["DPOConfig", "DPOTrainer", "GRPOConfig", "GRPOTrainer", "MlxrlError",
           "SFTConfig", "SFTTrainer", "load", "load_default", "save",
           "runtime"]
