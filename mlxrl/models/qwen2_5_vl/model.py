"""Qwen2.5-VL: Qwen2-VL's layout and language model with a windowed RMSNorm/SwiGLU vision tower."""

from __future__ import annotations

from ..qwen2_vl.model import Model as Qwen2VLModel
from .vision import VisionConfig, VisionModel


class Model(Qwen2VLModel):
    vision_module = VisionModel
    vision_config_class = VisionConfig
