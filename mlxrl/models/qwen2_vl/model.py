"""Qwen2-VL: vision tower at `visual.*`, language model at `model.*`, `lm_head` (HF Hub layout,
which is also what transformers 5 writes)."""

from __future__ import annotations

import mlx.nn as nn

from ..language import LanguageModel, TextConfig
from ..vl import QwenVLBase
from .vision import VisionConfig, VisionModel


class Model(QwenVLBase):
    vision_module = VisionModel
    vision_config_class = VisionConfig
    # Checkpoints keep this (legacy) layout, but transformers >= 4.52 names the modules
    # `model.language_model.*` and `model.visual.*`: what PEFT keys adapters by (see lora.py).
    hf_module_prefixes = (("model.", "model.language_model."), ("visual.", "model.visual."))

    def __init__(self, config: dict):
        super().__init__()
        tc, tie = self._setup(config)
        # the Qwen2 language model: q/k/v bias, no q/k norm, sectioned M-RoPE
        self.text_config = TextConfig.from_dict(tc, attention_bias=True, qk_norm=False, tie_word_embeddings=tie)
        self.visual = self.vision_module(self.vision_config_class.from_dict(config.get("vision_config") or {}))
        self.model = LanguageModel(self.text_config)
        if not tie:
            self.lm_head = nn.Linear(self.text_config.hidden_size, self.text_config.vocab_size, bias=False)

    @property
    def vision_tower(self):
        return self.visual

    @property
    def language_model(self) -> LanguageModel:
        return self.model

    def sanitize(self, weights: dict) -> dict:
        """Map the layouts this family has been saved in to ours; idempotent. Layouts: the Hub's
        (`model.*`, `visual.*`), transformers >= 4.52's (`model.language_model.*`, `model.visual.*`) and
        mlx-vlm's (`language_model.model.*`, `language_model.lm_head.*`, `vision_tower.*`, a
        channels-last patch kernel), with an MLX checkpoint's `scales` / `biases` next to its weights."""
        out, vision = {}, {}
        for k, v in weights.items():
            if "rotary_emb.inv_freq" in k:
                continue
            for theirs, ours in (("model.language_model.", "model."), ("model.visual.", "visual."),
                                 ("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                                 ("vision_tower.", "visual.")):
                if k.startswith(theirs):
                    k = ours + k[len(theirs):]
                    break
            if k.startswith("lm_head.") and self.tied:
                continue
            if k.startswith("visual."):
                vision[k[len("visual."):]] = v
            else:
                out[k] = v
        out.update({"visual." + k: v for k, v in self.visual.sanitize(vision).items()})
        return out
