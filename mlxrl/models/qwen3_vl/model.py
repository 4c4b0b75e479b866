"""Qwen3-VL (dense): `model.visual.*`, `model.language_model.*`, `lm_head` (HF layout).
The language model is Qwen3's (q/k RMSNorm, no bias) with interleaved M-RoPE and DeepStack:
features from early vision layers are added to the visual positions after the first LM layers."""

from __future__ import annotations

import mlx.nn as nn

from ..language import LanguageModel, TextConfig
from ..vl import QwenVLBase, VisualAndLanguage
from .vision import VisionConfig, VisionModel


class Model(QwenVLBase):
    has_deepstack = True

    def __init__(self, config: dict):
        super().__init__()
        tc, tie = self._setup(config)
        self.text_config = TextConfig.from_dict(
            tc, attention_bias=bool(tc.get("attention_bias", False)), qk_norm=True,
            mrope_interleaved=True, tie_word_embeddings=tie,
        )
        vision = VisionModel(VisionConfig.from_dict(config.get("vision_config") or {}))
        self.model = VisualAndLanguage(vision, LanguageModel(self.text_config))
        if not tie:
            self.lm_head = nn.Linear(self.text_config.hidden_size, self.text_config.vocab_size, bias=False)

    @property
    def vision_tower(self):
        return self.model.visual

    @property
    def language_model(self) -> LanguageModel:
        return self.model.language_model

    def sanitize(self, weights: dict) -> dict:
        return sanitize_vl_layouts(self, weights)


def sanitize_vl_layouts(model, weights: dict) -> dict:
    """Map the layouts the Qwen3-VL tower's families have been saved in to ours; idempotent. Layouts:
    transformers' (`model.language_model.*`, `model.visual.*`), the flat `model.*` / `visual.*` one and
    mlx-vlm's (`language_model.model.*`, `language_model.lm_head.*`, `vision_tower.*`, a channels-last patch
    kernel), with an MLX checkpoint's `scales` / `biases` next to its weights."""
    out, vision = {}, {}
    for k, v in weights.items():
        if "rotary_emb.inv_freq" in k:
            continue
        if k.startswith("language_model.model."):
            k = "model.language_model." + k[len("language_model.model."):]
        elif k.startswith("language_model.lm_head."):
            k = k[len("language_model."):]
        elif k.startswith("vision_tower."):
            k = "model.visual." + k[len("vision_tower."):]
        elif k.startswith("visual."):
            k = "model." + k
        elif k.startswith("model.") and not k.startswith(("model.visual.", "model.language_model.")):
            k = "model.language_model." + k[len("model."):]
        if k.startswith("lm_head.") and model.tied:
            continue
        if k.startswith("model.visual."):
            vision[k[len("model.visual."):]] = v
        else:
            out[k] = v
    out.update({"model.visual." + k: v for k, v in model.model.visual.sanitize(vision).items()})
    return out
