"""`qwen3_5_text` (transformers' `Qwen3_5ForCausalLM`): `model.embed_tokens`, `model.layers.N.linear_attn.*` or
`model.layers.N.self_attn.*`, `model.norm`, `lm_head` (absent when tied); `qwen3_5_moe_text`
(`Qwen3_5MoeForCausalLM`) the same with expert layers (`model.layers.N.mlp.gate`, `.experts`, `.shared_expert`,
`.shared_expert_gate`) in the MLPs' place; `qwen3_next` (`Qwen3NextForCausalLM`, Qwen3-Next-80B-A3B) the same
decoder with its fused DeltaNet projections (`in_proj_qkvz`, `in_proj_ba`), 1-D rotary positions and the expert
layer in its sparse layers."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache

from .. import moe
from ..dropout import embedding_noise
from ..language import CausalLMHead, attention_mask_for, text_positions
from .text import Qwen35LanguageModel, Qwen35TextConfig, dense_width, initial_value, install_experts


class LinearCache(ArraysCache):
    """A Gated DeltaNet layer's decoding state, in mlx-lm's `ArraysCache` (as its Qwen3-Next keeps it): the
    convolution's last K - 1 inputs [B, K - 1, C] and the rule's float32 state [B, Hv, dk, dv], with the
    tokens seen (`offset`, as mlx-lm's KVCache counts them). A recurrent state cannot be cut back to an
    earlier token: `is_trimmable` is False (a caller that needs fewer tokens starts again)."""

    def __init__(self):
        super().__init__(2)
        self.offset = 0

    @property
    def conv_state(self):
        return self.cache[0]

    @conv_state.setter
    def conv_state(self, value):
        self.cache[0] = value

    @property
    def recurrent_state(self):
        return self.cache[1]

    @recurrent_state.setter
    def recurrent_state(self, value):
        self.cache[1] = value

    def repeated(self, group: int) -> LinearCache:
        """This cache with each row repeated `group` times (prompt-major): a prompt's state for its G samples."""
        out = LinearCache()
        out.cache = [None if c is None else mx.repeat(c, group, axis=0) for c in self.cache]
        out.offset = self.offset
        return out


def make_cache(language_model) -> list:
    """One decoding cache per layer: a `LinearCache` for a Gated DeltaNet layer, mlx-lm's KVCache for attention."""
    from mlx_lm.models.cache import KVCache

    return [LinearCache() if layer.layer_type == "linear_attention" else KVCache() for layer in language_model.layers]


class Model(CausalLMHead, nn.Module):
    float32_parameters = ("A_log",)  # `loading.set_float_dtype`

    def __init__(self, config: dict):
        super().__init__()
        self.config = config
        text = config.get("text_config", config)  # a text config nested as the VL model nests it
        self.text_config = Qwen35TextConfig.from_dict(text, qk_norm=True, **dense_width(text))
        self.model = Qwen35LanguageModel(self.text_config)
        if "moe" in str(config.get("model_type", "")) or config.get("model_type") == "qwen3_next":
            self.moe_config = install_experts(self.model, text, self.text_config)
        if not self.text_config.tie_word_embeddings:
            self.lm_head = nn.Linear(self.text_config.hidden_size, self.text_config.vocab_size, bias=False)

    @property
    def language_model(self) -> Qwen35LanguageModel:
        return self.model

    def saved_layout(self, weights: dict) -> dict:
        """What `loading.save` writes: the experts one tensor per expert (transformers' and the Hub's layout)."""
        return moe.split_experts(weights)

    @staticmethod
    def initial_value(name, value):
        return initial_value(name, value)

    def __call__(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, cache=None,
                 return_hidden: bool = False, segment_ids=None, pixel_values=None, neftune_scale=None,
                 router_aux=None, router_mask=None, **_ignored):
        """Logits [B, L, V], or hidden states [B, L, D] with return_hidden. attention_mask [B, L]: 1 for real
        tokens (padding enters the linear layers as zeros and is never attended); segment_ids [B, L]: packed
        documents (positions, attention, the convolution and the delta rule's state restart per document).
        router_aux: a list receiving the MoE model's load-balancing loss over router_mask's tokens (default:
        attention_mask's)."""
        if pixel_values is not None:
            raise ValueError("qwen3_5_text is a text-only model: it cannot take images")
        h = self.model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        h = embedding_noise(h, neftune_scale, self.training)
        offset = cache[0].offset if cache is not None else 0
        if position_ids is None:
            position_ids = text_positions(*h.shape[:2], offset, segment_ids)
        mask = attention_mask_for(h.shape[1], attention_mask, segment_ids, offset)
        moe_kw = {} if router_aux is None else {"router_aux": router_aux,
                                                "token_mask": attention_mask if router_mask is None else router_mask}
        h = self.model(h, position_ids, mask, cache, attention_mask=attention_mask, segment_ids=segment_ids, **moe_kw)
        return h if return_hidden else self.apply_lm_head(h)

    def make_cache(self):
        return make_cache(self.model)

    def sanitize(self, weights: dict) -> dict:
        """transformers' layout (`model.*`), a Qwen3.5 VL checkpoint's language model (`model.language_model.*`;
        the tower and the multi-token-prediction head dropped) and mlx-lm's (`language_model.model.*`, its conv
        kernel and norms, `from_mlx_layout`), with an MLX checkpoint's `scales` / `biases`; idempotent."""
        out = {}
        for k, v in moe.fuse_experts(from_mlx_layout(weights)).items():
            if "rotary_emb.inv_freq" in k or k.startswith(("mtp.", "model.visual.", "visual.", "vision_tower.",
                                                           "language_model.mtp.")):
                continue
            for theirs, ours in (("model.language_model.", "model."), ("language_model.model.", "model."),
                                 ("language_model.lm_head.", "lm_head.")):
                if k.startswith(theirs):
                    k = ours + k[len(theirs):]
            if k.startswith("lm_head.") and self.tied:
                continue
            out[k] = v
        return out


# the norms mlx-lm stores as plain scales (1 + transformers' zero-centred offset)
_MLX_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight", ".q_norm.weight",
              ".k_norm.weight")


def from_mlx_layout(weights: dict) -> dict:
    """A checkpoint mlx-lm (or mlx-vlm) converted, in transformers' form: its depthwise conv kernels are
    channels-last [C, K, 1] (transformers' [C, 1, K]) and its zero-centred norms hold 1 + the offset. The conv
    kernel's layout tells the two apart, so a transformers checkpoint (and this function's output) is returned
    as it is."""
    converted = any("conv1d.weight" in k and v.ndim == 3 and v.shape[-1] == 1 and v.shape[1] > 1
                    for k, v in weights.items())
    if not converted:
        return weights
    out = {}
    for k, v in weights.items():
        if "conv1d.weight" in k and v.ndim == 3:
            v = v.swapaxes(1, 2)
        elif k.endswith(_MLX_NORMS) and v.ndim == 1:
            v = v - 1.0
        out[k] = v
    return out
