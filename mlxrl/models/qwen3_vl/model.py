"""Qwen3-VL (dense, and `qwen3_vl_moe`): `model.visual.*`, `model.language_model.*`, `lm_head` (HF layout).
The language model is Qwen3's (q/k RMSNorm, no bias) with interleaved M-RoPE and DeepStack:
features from early vision layers are added to the visual positions after the first LM layers. Qwen3-VL-MoE
(Qwen3-VL-30B-A3B) puts the expert layer (`models.moe`, top-k always normalised) in the MLPs' place of its sparse
layers; its checkpoints hold the fused experts transposed (`gate_up_proj` [E, D, 2I], `down_proj` [E, I, D]),
which `sanitize` turns and `saved_layout` turns back."""

from __future__ import annotations

import mlx.nn as nn

from .. import moe
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
        if config.get("model_type") == "qwen3_vl_moe":
            self.moe_config = moe.MoeConfig.from_dict({**tc, "norm_topk_prob": True})
            moe.install(self.model.language_model, self.moe_config, self.text_config.hidden_size, None)
        if not tie:
            self.lm_head = nn.Linear(self.text_config.hidden_size, self.text_config.vocab_size, bias=False)

    @property
    def vision_tower(self):
        return self.model.visual

    @property
    def language_model(self) -> LanguageModel:
        return self.model.language_model

    def sanitize(self, weights: dict) -> dict:
        if hasattr(self, "moe_config"):
            weights = moe.fuse_experts(weights)
            weights = {k: self._turned(k, v) for k, v in weights.items()}
        return sanitize_vl_layouts(self, weights)

    def _turned(self, key: str, value):
        """A fused float expert tensor of Qwen3-VL-MoE's checkpoint layout ([E, in, out]) as ours ([E, out, in]);
        ours and anything else unchanged (a square one is taken as the checkpoint's, as the Hub holds them)."""
        if not key.endswith((".experts.gate_up_proj", ".experts.down_proj")) or value.ndim != 3:
            return value
        e = self.moe_config
        d, i = self.text_config.hidden_size, e.moe_intermediate_size
        ours = (e.num_experts, 2 * i, d) if key.endswith("gate_up_proj") else (e.num_experts, d, i)
        theirs = (ours[0], ours[2], ours[1])
        return value.swapaxes(1, 2) if tuple(value.shape) == theirs else value

    def saved_layout(self, weights: dict) -> dict:
        """The experts as Qwen3-VL-MoE's checkpoints hold them (fused, transposed), which transformers loads;
        quantized ones in mlx-lm's switch layout; a dense Qwen3-VL's weights unchanged."""
        if not hasattr(self, "moe_config"):
            return weights
        fused = (".experts.gate_up_proj", ".experts.down_proj")
        out = moe.split_experts({k: v for k, v in weights.items() if not k.endswith(fused)})
        out.update({k: v.swapaxes(1, 2) for k, v in weights.items() if k.endswith(fused)})
        return out


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
