"""`qwen3_5` (transformers' `Qwen3_5ForConditionalGeneration`) and `qwen3_5_moe` (`Qwen3_5MoeForConditional
Generation`, expert layers in the MLPs' place, `models.moe`): Qwen3.5 natively multimodal, `model.visual.*`,
`model.language_model.*`, `lm_head` (absent when tied). The vision tower is Qwen3-VL's without DeepStack
(one merger); the language model is Qwen3.5's decoder (`text.Qwen35LanguageModel`) with interleaved M-RoPE
on the gated attention layers' rotated dimensions. Image positions and merging are the Qwen-VL family's
(`models.vl`)."""

from __future__ import annotations

import mlx.nn as nn

from .. import moe
from ..qwen3_vl.model import sanitize_vl_layouts
from ..qwen3_vl.vision import VisionConfig, VisionModel
from ..vl import QwenVLBase, VisualAndLanguage
from .model import from_mlx_layout, make_cache
from .text import Qwen35LanguageModel, Qwen35TextConfig, dense_width, initial_value, install_experts


class Model(QwenVLBase):
    float32_parameters = ("A_log",)  # `loading.set_float_dtype`

    def __init__(self, config: dict):
        super().__init__()
        tc, tie = self._setup(config)
        self.text_config = Qwen35TextConfig.from_dict(tc, qk_norm=True, tie_word_embeddings=tie, **dense_width(tc))
        vision = VisionModel(VisionConfig.from_dict({**(config.get("vision_config") or {}),
                                                     "deepstack_visual_indexes": []}))
        self.model = VisualAndLanguage(vision, Qwen35LanguageModel(self.text_config))
        if "moe" in str(config.get("model_type", "")):  # qwen3_5_moe: Qwen3.5-35B-A3B and the like
            self.moe_config = install_experts(self.model.language_model, tc, self.text_config)
        if not tie:
            self.lm_head = nn.Linear(self.text_config.hidden_size, self.text_config.vocab_size, bias=False)

    @property
    def vision_tower(self):
        return self.model.visual

    @property
    def language_model(self) -> Qwen35LanguageModel:
        return self.model.language_model

    def make_cache(self):
        return make_cache(self.language_model)

    @staticmethod
    def initial_value(name, value):
        """transformers' initial values of the language model's special parameters (`text.initial_value`); the
        vision tower's LayerNorms are plain (`loading.init_weights`)."""
        return None if name.startswith("model.visual.") else initial_value(name, value)

    def sanitize(self, weights: dict) -> dict:
        """transformers' layout, the flat `model.*` / `visual.*` one and mlx-vlm's (as Qwen3-VL's); the
        multi-token-prediction head (`mtp.*`), which training does not use, is dropped."""
        weights = {k: v for k, v in weights.items() if not k.startswith(("mtp.", "language_model.mtp."))}
        return sanitize_vl_layouts(self, moe.fuse_experts(from_mlx_layout(weights)))

    def saved_layout(self, weights: dict) -> dict:
        """What `loading.save` writes: the experts one tensor per expert (transformers' and the Hub's layout)."""
        return moe.split_experts(weights)
