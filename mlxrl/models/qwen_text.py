"""Qwen2 / Qwen2.5 / Qwen3 causal language models (text only) and Qwen3-MoE (Qwen3-30B-A3B: expert layers in the
MLPs' place, `models.moe`), HF layout: `model.embed_tokens`, `model.layers.N...`, `model.norm`, `lm_head` (absent
when tied)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from . import moe
from .dropout import embedding_noise
from .language import CausalLMHead, LanguageModel, TextConfig, attention_mask_for, text_positions


class Model(CausalLMHead, nn.Module):
    def __init__(self, config: dict):
        super().__init__()
        self.config = config
        model_type = config.get("model_type", "qwen2")
        qwen2 = model_type == "qwen2"
        self.text_config = TextConfig.from_dict(
            config,
            # Qwen2 always has q/k/v bias and no q/k norm; Qwen3 the reverse.
            attention_bias=True if qwen2 else bool(config.get("attention_bias", False)),
            qk_norm=not qwen2,
        )
        self.model = LanguageModel(self.text_config)
        if model_type == "qwen3_moe":
            self.moe_config = moe.MoeConfig.from_dict(config)
            moe.install(self.model, self.moe_config, self.text_config.hidden_size, None)
        if not self.text_config.tie_word_embeddings:
            self.lm_head = nn.Linear(self.text_config.hidden_size, self.text_config.vocab_size, bias=False)

    @property
    def language_model(self) -> LanguageModel:
        return self.model

    def __call__(
        self,
        input_ids: mx.array | None = None,
        attention_mask: mx.array | None = None,
        position_ids: mx.array | None = None,
        inputs_embeds: mx.array | None = None,
        cache=None,
        return_hidden: bool = False,
        segment_ids: mx.array | None = None,
        pixel_values=None,
        neftune_scale: mx.array | None = None,
        router_aux: list | None = None,
        router_mask: mx.array | None = None,
        **_ignored,
    ) -> mx.array:
        """Logits [B, L, V], or hidden states [B, L, D] before the LM head with return_hidden. neftune_scale:
        NEFTune's noise scale for the input embeddings in training (`dropout.embedding_noise`). router_aux: a
        list that receives an MoE model's load-balancing loss over the tokens router_mask [B, L] (default:
        attention_mask) keeps (`moe.RouterStats`); a dense model leaves it empty."""
        if pixel_values is not None:
            raise ValueError(f"{self.config.get('model_type')} is a text-only model: it cannot take images")
        h = self.model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        h = embedding_noise(h, neftune_scale, self.training)
        offset = cache[0].offset if cache is not None else 0
        if position_ids is None:
            position_ids = text_positions(*h.shape[:2], offset, segment_ids)
        mask = attention_mask_for(h.shape[1], attention_mask, segment_ids, offset)
        h = self.model(h, position_ids, mask, cache, router_aux=router_aux,
                       token_mask=attention_mask if router_mask is None else router_mask)
        return h if return_hidden else self.apply_lm_head(h)

    def saved_layout(self, weights: dict) -> dict:
        """The tensors `loading.save` writes: an MoE model's experts one tensor per expert (the Hub's layout,
        which transformers and mlx-lm load); quantized experts in mlx-lm's switch layout."""
        return moe.split_experts(weights) if hasattr(self, "moe_config") else weights

    def sanitize(self, weights: dict) -> dict:
        if hasattr(self, "moe_config"):
            weights = moe.fuse_experts(weights)
        out = {}
        for k, v in weights.items():
            if "rotary_emb.inv_freq" in k:
                continue
            if k.startswith("lm_head.") and self.tied:  # weight (and an MLX checkpoint's scales / biases)
                continue
            out[k] = v
        return out
