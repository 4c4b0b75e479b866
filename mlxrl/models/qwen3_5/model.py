"""`qwen3_5_text` (transformers' `Qwen3_5ForCausalLM`): `model.embed_tokens`, `model.layers.N.linear_attn.*` or
`model.layers.N.self_attn.*`, `model.norm`, `lm_head` (absent when tied)."""

from __future__ import annotations

import mlx.nn as nn

from ..dropout import embedding_noise
from ..language import CausalLMHead, attention_mask_for, text_positions
from .text import Qwen35LanguageModel, Qwen35TextConfig


class LinearCache:
    """A Gated DeltaNet layer's decoding state: the convolution's last K - 1 inputs, the rule's float32
    [B, Hv, dk, dv] state, and the tokens seen (`offset`, as mlx-lm's KVCache counts them)."""

    def __init__(self):
        self.conv_state, self.state, self.offset = None, None, 0


class Model(CausalLMHead, nn.Module):
    def __init__(self, config: dict):
        super().__init__()
        self.config = config
        text = config.get("text_config", config)  # a text config nested as the VL model nests it
        self.text_config = Qwen35TextConfig.from_dict(text, qk_norm=True)
        self.model = Qwen35LanguageModel(self.text_config)
        if not self.text_config.tie_word_embeddings:
            self.lm_head = nn.Linear(self.text_config.hidden_size, self.text_config.vocab_size, bias=False)

    @property
    def language_model(self) -> Qwen35LanguageModel:
        return self.model

    def __call__(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, cache=None,
                 return_hidden: bool = False, segment_ids=None, pixel_values=None, neftune_scale=None, **_ignored):
        """Logits [B, L, V], or hidden states [B, L, D] with return_hidden. attention_mask [B, L]: 1 for real
        tokens (padding enters the linear layers as zeros and is never attended); segment_ids [B, L]: packed
        documents (positions, attention, the convolution and the delta rule's state restart per document)."""
        if pixel_values is not None:
            raise ValueError("qwen3_5_text is a text-only model: it cannot take images")
        h = self.model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        h = embedding_noise(h, neftune_scale, self.training)
        offset = cache[0].offset if cache is not None else 0
        if position_ids is None:
            position_ids = text_positions(*h.shape[:2], offset, segment_ids)
        mask = attention_mask_for(h.shape[1], attention_mask, segment_ids, offset)
        h = self.model(h, position_ids, mask, cache, attention_mask=attention_mask, segment_ids=segment_ids)
        return h if return_hidden else self.apply_lm_head(h)

    def make_cache(self):
        from mlx_lm.models.cache import KVCache

        return [LinearCache() if layer.layer_type == "linear_attention" else KVCache()
                for layer in self.model.layers]

    def sanitize(self, weights: dict) -> dict:
        out = {}
        for k, v in weights.items():
            if "rotary_emb.inv_freq" in k or k.startswith(("mtp.", "model.visual.")):
                continue
            if k.startswith("lm_head.") and self.tied:
                continue
            out[k] = v
        return out
