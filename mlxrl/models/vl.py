"""What Qwen2-VL, Qwen2.5-VL and Qwen3-VL share: the vectorised M-RoPE position index, merging
image features into the token embeddings by index arithmetic, and the forward that ties a vision
tower to the language model. Nothing here calls `.item()`/`.tolist()` or loops over rows, so the
forward can be `mx.compile`d per shape bucket.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .dropout import embedding_noise
from .language import CausalLMHead, LanguageModel, TextConfig, attention_mask_for, restart_positions


def mrope_positions(
    input_ids: mx.array,
    image_grid_thw: mx.array | None,
    attention_mask: mx.array | None,
    image_token_id: int,
    merge_size: int,
    segment_ids: mx.array | None = None,
) -> tuple[mx.array, mx.array]:
    """3D (t, h, w) positions of Qwen-VL's M-RoPE, vectorised over the batch.

    Text tokens advance all three axes by one. The tokens of an image with merged grid
    (t, h, w) sit at `start + (t_i, h_i, w_i)`, and the text after it resumes at
    `start + max(h, w)`. Padding (attention_mask == 0) gets position 0 and does not advance.

    Each token gets an "advance" (1 for text, max(h, w) on the last token of an image, 0
    elsewhere); the exclusive cumulative sum is the start position, and image tokens add their
    grid coordinates. Images are numbered in flattened batch order, which is the order of
    `pixel_values`.

    segment_ids [B, L]: packed documents; positions restart at 0 at each document's first token.

    Returns positions [3, B, L] (int32) and rope deltas [B] (max position + 1 - real length,
    what generation adds to later positions).
    """
    B, L = input_ids.shape
    valid = mx.ones((B, L), dtype=mx.bool_) if attention_mask is None else attention_mask.astype(mx.bool_)
    is_img = (input_ids == image_token_id) & valid
    zero = mx.zeros((B, L), dtype=mx.int32)
    if image_grid_thw is None or image_grid_thw.shape[0] == 0:
        t_i = h_i = w_i = zero
        advance = valid.astype(mx.int32)
    else:
        grid = image_grid_thw.astype(mx.int32)
        gt, gh, gw = grid[:, 0], grid[:, 1] // merge_size, grid[:, 2] // merge_size
        n_tok = gt * gh * gw  # tokens per image
        ends = mx.cumsum(n_tok)  # exclusive end offset of each image in the flat token list
        flat = is_img.reshape(-1)
        g = mx.cumsum(flat.astype(mx.int32)) - 1  # ordinal of each image token over the batch
        img = (g[:, None] >= ends[None, :]).astype(mx.int32).sum(axis=1)
        img = mx.minimum(img, grid.shape[0] - 1)
        k = g - (ends - n_tok)[img]  # index inside its image
        hw = (gh * gw)[img]
        t_i = mx.where(flat, k // hw, 0).reshape(B, L)
        h_i = mx.where(flat, (k // gw[img]) % gh[img], 0).reshape(B, L)
        w_i = mx.where(flat, k % gw[img], 0).reshape(B, L)
        last = flat & (k == n_tok[img] - 1)
        span = mx.maximum(gh, gw)[img]
        advance = mx.where(flat, mx.where(last, span, 0), valid.reshape(-1).astype(mx.int32)).reshape(B, L)
    start = restart_positions(advance, segment_ids)
    pos = mx.stack([start + t_i, start + h_i, start + w_i])
    pos = mx.where(valid[None], pos, 0)
    deltas = pos.max(axis=(0, 2)) + 1 - valid.astype(mx.int32).sum(axis=1)
    return pos, deltas


def merge_image_features(embeds: mx.array, image_mask: mx.array, features: mx.array) -> mx.array:
    """Put `features` [M, D] into `embeds` [B, L, D] at the M positions where `image_mask` is True,
    in flattened order (a gather, so it compiles and differentiates)."""
    idx = mx.maximum(mx.cumsum(image_mask.reshape(-1).astype(mx.int32)) - 1, 0).reshape(image_mask.shape)
    return mx.where(image_mask[..., None], features[idx].astype(embeds.dtype), embeds)


def text_config_dict(config: dict) -> dict:
    """The language model's settings from a VL config.json: nested `text_config` (transformers
    >= 4.5x) or flat at the top level (the original Qwen2-VL release)."""
    flat = {k: v for k, v in config.items() if k not in ("vision_config", "text_config")}
    nested = config.get("text_config") or {}
    return {**flat, **nested}


class VisualAndLanguage(nn.Module):
    """transformers' nesting of the newer families (Qwen3-VL, Qwen3.5): `model.visual`, `model.language_model`."""

    def __init__(self, vision: nn.Module, language: nn.Module):
        super().__init__()
        self.visual = vision
        self.language_model = language


class QwenVLBase(CausalLMHead, nn.Module):
    """Forward shared by the Qwen-VL families. Subclasses place the submodules under their
    Hugging Face names and expose them through `vision_tower`, `language_model`, `lm_head`."""

    config: dict
    text_config: TextConfig
    has_deepstack = False

    def _setup(self, config: dict):
        self.config = config
        self.image_token_id = int(config.get("image_token_id", 151655))
        self.video_token_id = int(config.get("video_token_id", 151656))
        vc = config.get("vision_config") or {}
        self.merge_size = int(vc.get("spatial_merge_size", 2))
        tc = text_config_dict(config)
        tie = config.get("tie_word_embeddings", tc.get("tie_word_embeddings", False))
        return tc, bool(tie)

    # -- accessors each layout implements ------------------------------------------------
    @property
    def vision_tower(self) -> nn.Module:
        raise NotImplementedError

    @property
    def language_model(self) -> LanguageModel:
        raise NotImplementedError

    # -- vision ---------------------------------------------------------------------------
    def vision_metadata(self, image_grid_thw) -> dict:
        """Grid-dependent index arrays of the vision tower (computed in numpy, outside the
        compiled graph). The data pipeline may precompute them and pass `vision_meta=`."""
        return self.vision_tower.metadata(np.asarray(image_grid_thw))

    def image_features(self, pixel_values: mx.array, image_grid_thw, vision_meta=None):
        """(merged features, deepstack features) of the vision tower. The tower follows the
        model's gradient checkpointing (the flag the trainers set on `language_model`)."""
        meta = vision_meta if vision_meta is not None else self.vision_metadata(image_grid_thw)
        out = self.vision_tower(pixel_values, meta, checkpoint=self.language_model.gradient_checkpointing)
        return out if isinstance(out, tuple) else (out, [])

    def __call__(
        self,
        input_ids: mx.array | None = None,
        attention_mask: mx.array | None = None,
        pixel_values: mx.array | None = None,
        image_grid_thw: mx.array | None = None,
        position_ids: mx.array | None = None,
        inputs_embeds: mx.array | None = None,
        cache=None,
        return_hidden: bool = False,
        vision_meta: dict | None = None,
        segment_ids: mx.array | None = None,
        pixel_values_videos=None,
        video_grid_thw=None,
        neftune_scale: mx.array | None = None,
        router_aux: list | None = None,
        router_mask: mx.array | None = None,
        **_ignored,
    ) -> mx.array:
        """Logits [B, L, V] (or hidden states [B, L, D] with return_hidden=True).

        position_ids: [3, B, L] M-RoPE positions; computed from input_ids, image_grid_thw and
        attention_mask when omitted (text-only batches get 0..L-1, as in transformers).
        segment_ids [B, L]: packed documents that must not attend to each other.
        neftune_scale: NEFTune's noise scale for the input embeddings in training (`dropout.embedding_noise`).
        router_aux, router_mask: an MoE language model's load-balancing loss (`models.moe.RouterStats`).
        """
        if pixel_values_videos is not None or video_grid_thw is not None:
            raise NotImplementedError("video inputs are not supported yet: pass images (pixel_values)")
        lm = self.language_model
        h = lm.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        h = embedding_noise(h, neftune_scale, self.training)  # text embeddings, as transformers' hook
        deepstack = None
        if pixel_values is not None:
            if image_grid_thw is None:
                raise ValueError("pixel_values given without image_grid_thw: pass the processor's output")
            image_mask = input_ids == self.image_token_id
            feats, deep = self.image_features(pixel_values, image_grid_thw, vision_meta)
            h = merge_image_features(h, image_mask, feats)
            if deep:
                deepstack = (image_mask, deep)
        if position_ids is None:
            if (pixel_values is not None or segment_ids is not None) and cache is None:
                grid = None
                if pixel_values is not None:
                    grid = mx.array(np.asarray(image_grid_thw)) if not isinstance(image_grid_thw, mx.array) \
                        else image_grid_thw
                position_ids, _ = mrope_positions(input_ids, grid, attention_mask, self.image_token_id,
                                                  self.merge_size, segment_ids)
            else:
                offset = cache[0].offset if cache is not None else 0
                B, L = h.shape[:2]
                position_ids = mx.broadcast_to(mx.arange(offset, offset + L, dtype=mx.int32), (3, B, L))
        offset = cache[0].offset if cache is not None else 0
        mask = attention_mask_for(h.shape[1], attention_mask, segment_ids, offset)
        extra = {"attention_mask": attention_mask, "segment_ids": segment_ids} if getattr(lm, "reads_padding", False) \
            else {}
        if router_aux is not None and getattr(lm, "router_stats", None) is not None:
            extra.update(router_aux=router_aux, token_mask=attention_mask if router_mask is None else router_mask)
        h = lm(h, position_ids, mask, cache, deepstack, **extra)
        return h if return_hidden else self.apply_lm_head(h)
