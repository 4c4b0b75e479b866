"""The Qwen decoder shared by every architecture: Qwen2 / Qwen3 text models and the language
models of Qwen2-VL, Qwen2.5-VL and Qwen3-VL.

One module covers them because they differ only in switches: q/k/v bias (Qwen2), q/k RMSNorm
(Qwen3), and the rotary layout (1D, sectioned M-RoPE, interleaved M-RoPE). Parameter names are
Hugging Face's (embed_tokens, layers.N.self_attn.q_proj, mlp.gate_proj, norm, ...).

Positions are explicit arrays (`[B, L]` or `[3, B, L]`), never a scalar offset, so packed rows
(positions restarting per document) and M-RoPE share one code path.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn

from ..cpu import fastmath
from . import checkpointing
from .attention import AttentionMask, attention
from .tiled import tiled


@dataclass
class TextConfig:
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    vocab_size: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v bias (always on for Qwen2-family)
    qk_norm: bool = False  # Qwen3-family
    mrope_section: list[int] | None = None
    mrope_interleaved: bool = False  # Qwen3-VL
    model_type: str = "qwen2"
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: dict, **overrides) -> TextConfig:
        names = set(inspect.signature(cls).parameters)
        args = {k: v for k, v in d.items() if k in names}
        args.update(overrides)
        cfg = cls(**args)
        cfg._resolve_rope()
        return cfg

    def _resolve_rope(self):
        # transformers >= 5 nests rope settings under rope_parameters; older configs use
        # rope_theta + rope_scaling ({"type": "mrope", "mrope_section": [...]}). Where both are there (a
        # rope_scaling added to a newer config.json, as Qwen's model cards say for YaRN), rope_scaling wins;
        # the rope_theta of rope_parameters stays (transformers 5.24 then takes rope_scaling alone, with its
        # default theta, 10000: not the checkpoint's).
        params = dict(self.rope_parameters or {})
        params.update(self.rope_scaling or {})
        if "rope_theta" in params:
            self.rope_theta = float(params["rope_theta"])
        if params.get("mrope_section") and self.mrope_section is None:
            self.mrope_section = list(params["mrope_section"])
        if params.get("mrope_interleaved"):
            self.mrope_interleaved = True
        kind = params.get("rope_type", params.get("type", "default")) or "default"
        if kind not in ROPE_TYPES:
            raise NotImplementedError(
                f"rope type {kind!r} is not supported yet (supported: {', '.join(ROPE_TYPES)}); "
                "remove rope_scaling from config.json to train at the native context length"
            )
        self.rope_type, self.rope_params = ("default" if kind == "mrope" else kind), params
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads


def rope_axis_of_frequency(half_dim: int, section: list[int] | None, interleaved: bool) -> list[int]:
    """Which position axis (0=t, 1=h, 2=w) drives each of the `half_dim` rotary frequencies.

    Sectioned M-RoPE (Qwen2/2.5-VL): the first s0 frequencies follow t, the next s1 h, the
    next s2 w. Interleaved (Qwen3-VL): frequency j follows h when j % 3 == 1 and j < 3*s1,
    w when j % 3 == 2 and j < 3*s2, else t. Plain RoPE: every frequency follows axis 0.
    """
    if not section:
        return [0] * half_dim
    if not interleaved:
        if sum(section) != half_dim:
            raise ValueError(f"mrope_section {section} must sum to head_dim/2 = {half_dim}")
        return [axis for axis, n in enumerate(section) for _ in range(n)]
    axes = [0] * half_dim
    for axis in (1, 2):
        for j in range(axis, min(3 * section[axis], half_dim), 3):
            axes[j] = axis
    return axes


ROPE_TYPES = ("default", "mrope", "linear", "yarn")


def rope_frequencies(config: TextConfig) -> tuple[mx.array, float]:
    """The rotary inverse frequencies [head_dim / 2] and the scale of cos / sin of config's rope type, as
    transformers' `ROPE_INIT_FUNCTIONS` compute them: default (M-RoPE's too) theta^(-2i / d); linear
    (position interpolation) those over `factor`; yarn (YaRN, Peng et al. 2023: Qwen3's long-context setting,
    rope_scaling {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}) the
    interpolated frequencies (over `factor`) for the dimensions that turn fewer than `beta_slow` times over
    the original context, the original ones for those that turn more than `beta_fast` times, a linear ramp
    between, and cos / sin scaled by the attention factor 0.1 ln(factor) + 1 (or mscale / mscale_all_dim's
    ratio, or `attention_factor` as given)."""
    dim, base, p = config.head_dim, config.rope_theta, getattr(config, "rope_params", {})
    pos_freqs = base ** (mx.arange(0, dim, 2, dtype=mx.float32) / dim)
    kind = getattr(config, "rope_type", "default")
    if kind == "default":
        return 1.0 / pos_freqs, 1.0
    if kind == "linear":
        return 1.0 / (float(p["factor"]) * pos_freqs), 1.0
    original = p.get("original_max_position_embeddings") or config.max_position_embeddings
    factor = float(p.get("factor") or config.max_position_embeddings / original)

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = p.get("attention_factor")
    if attention is None:
        m, m_all = p.get("mscale"), p.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def turns_to_dim(turns):  # the dimension whose wavelength fits `turns` times into the original context
        return dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = turns_to_dim(p.get("beta_fast") or 32), turns_to_dim(p.get("beta_slow") or 1)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = mx.clip((mx.arange(dim // 2, dtype=mx.float32) - low) / ((high + 0.001 if low == high else high) - low),
                   0, 1)
    extrapolated = 1 - ramp  # 1: the original frequency, 0: the interpolated one
    inv_freq = 1.0 / (factor * pos_freqs) * (1 - extrapolated) + 1.0 / pos_freqs * extrapolated
    return inv_freq, float(attention)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for explicit positions; float32 math whatever the model dtype."""

    def __init__(self, config: TextConfig):
        super().__init__()
        dim = config.head_dim
        self._inv_freq, self._scale = rope_frequencies(config)
        self._axes = mx.array(rope_axis_of_frequency(dim // 2, config.mrope_section, config.mrope_interleaved))
        self.multimodal = bool(config.mrope_section)

    def __call__(self, positions: mx.array) -> tuple[mx.array, mx.array]:
        """positions [B, L] or [3, B, L] -> cos, sin [B, 1, L, head_dim]."""
        if positions.ndim == 2:
            positions = positions[None]
        positions = positions.astype(mx.float32)
        if positions.shape[0] == 1:
            freqs = positions[0][..., None] * self._inv_freq  # [B, L, D/2]
        else:
            # pick, per frequency, the axis that drives it: [3, B, L] -> [B, L, D/2]
            freqs = mx.take(positions, self._axes, axis=0).transpose(1, 2, 0) * self._inv_freq
        emb = mx.concatenate([freqs, freqs], axis=-1)[:, None]
        if self._scale != 1.0:  # YaRN's attention factor
            return mx.cos(emb) * self._scale, mx.sin(emb) * self._scale
        return mx.cos(emb), mx.sin(emb)


def apply_rotary(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """x [B, H, L, D] rotated by cos / sin [B, 1, L, D] (`fastmath.rotary`: native on float32 CPU)."""
    return fastmath.rotary(x, cos, sin)


class RMSNorm(nn.RMSNorm):
    """`nn.RMSNorm` (same parameter, same math) through `fastmath.rms_norm`: on float32 CPU arrays
    one multi-threaded pass per row forward and backward instead of MLX's composed single-core ops."""

    def __call__(self, x: mx.array) -> mx.array:
        return fastmath.rms_norm(x, self["weight"], self.eps)


class Attention(nn.Module):
    def __init__(self, config: TextConfig):
        super().__init__()
        d, hd = config.hidden_size, config.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, hd
        self.scale = hd**-0.5
        bias = config.attention_bias
        self.q_proj = nn.Linear(d, self.n_heads * hd, bias=bias)
        self.k_proj = nn.Linear(d, self.n_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(d, self.n_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * hd, d, bias=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(hd, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(hd, eps=config.rms_norm_eps)

    def __call__(self, x, cos, sin, mask, cache=None):
        B, L, _ = x.shape
        q = self.q_proj(x).reshape(B, L, self.n_heads, -1)
        k = self.k_proj(x).reshape(B, L, self.n_kv_heads, -1)
        v = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        if "q_norm" in self:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rotary(q.transpose(0, 2, 1, 3), cos, sin)
        k = apply_rotary(k.transpose(0, 2, 1, 3), cos, sin)
        if hasattr(cache, "attention"):  # a cache that attends itself: a prompt shared by its samples
            # (generation.SharedPrefixCache; shared_prompt's prompt and completion passes)
            out = cache.attention(q, k, v, scale=self.scale, mask=mask)
        else:
            if cache is not None:
                k, v = cache.update_and_fetch(k, v)
            out = attention(q, k, v, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class MLP(nn.Module):
    def __init__(self, config: TextConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.tile_tokens = 0  # > 0: run over the positions in tiles of this many (`models.tiled`)

    def __call__(self, x):
        return tiled(self, self.swiglu, x, self.tile_tokens)

    def swiglu(self, x):
        return self.down_proj(fastmath.silu_mul(self.gate_proj(x), self.up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: TextConfig):
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def __call__(self, x, cos, sin, mask, cache=None, routing: list | None = None):
        """routing: a list that an expert layer (`models.moe`) appends its routing to (the load-balancing loss)."""
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache)
        if routing is not None and hasattr(self.mlp, "gate"):
            return h + self.mlp(self.post_attention_layernorm(h), routing)
        return h + self.mlp(self.post_attention_layernorm(h))


def attention_mask_for(
    L: int,
    attention_mask: mx.array | None = None,
    segment_ids: mx.array | None = None,
    offset: int = 0,
):
    """The decoder's mask as structure (`attention.AttentionMask`: causal, the padding, the documents; its
    `dense()` is the boolean [B, 1, L, offset+L] array), or "causal" when nothing but causality is needed.

    attention_mask [B, offset+L]: 1 for real tokens, 0 for padding (keys that nobody attends to).
    segment_ids [B, L]: packed documents; a query attends only to keys of its own segment (keys already in
    a cache, `offset`, belong to no document of these queries).
    A fully masked row (a left-padding query) sees itself, so that it gives no NaN.
    """
    if attention_mask is None and segment_ids is None:
        return "causal" if L > 1 else None
    valid = None if attention_mask is None else attention_mask.astype(mx.bool_)
    if segment_ids is not None and offset:
        segment_ids = mx.concatenate([mx.full((segment_ids.shape[0], offset), -1, segment_ids.dtype), segment_ids],
                                     axis=1)
    return AttentionMask(L, offset + L, valid, segment_ids)


def restart_positions(advance: mx.array, segment_ids: mx.array | None = None) -> mx.array:
    """Exclusive cumulative sum of per-token `advance` [B, L] along each row, restarting at 0 at
    the first token of every segment (packed documents). Vectorised: the running sum at each
    segment start is carried forward with a cumulative max (the sum never decreases)."""
    start = mx.cumsum(advance, axis=1) - advance
    if segment_ids is None:
        return start
    first = mx.concatenate([mx.ones_like(segment_ids[:, :1], dtype=mx.bool_),
                            segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    return start - mx.cummax(mx.where(first, start, 0), axis=1)


def text_positions(B: int, L: int, offset: int = 0, segment_ids: mx.array | None = None) -> mx.array:
    """Position ids [B, L] of a text batch: offset, offset + 1, ...; packed documents (segment_ids) restart
    at 0 per document, padding (segment 0) does not advance."""
    if segment_ids is not None:
        valid = (segment_ids > 0).astype(mx.int32)
        return mx.where(valid > 0, restart_positions(valid, segment_ids), 0)
    return mx.broadcast_to(mx.arange(offset, offset + L, dtype=mx.int32), (B, L))


class LanguageModel(nn.Module):
    """embed_tokens -> layers -> norm. Returns hidden states before the LM head."""

    def __init__(self, config: TextConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = [DecoderLayer(config) for _ in range(config.num_hidden_layers)]
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)
        self.gradient_checkpointing = False
        self.keep_attention = False  # with checkpointing: the recomputation reuses the forward's attention
        self.checkpoint_segments = 0  # with checkpointing: the layers also checkpointed in this many segments

    def set_checkpointing(self, on: bool, keep_attention: bool = False, segments: int = 0) -> None:
        """Gradient checkpointing per decoder layer (`on`), the recomputation reusing the forward's attention
        (`keep_attention`), the layers checkpointed in `segments` nested segments too (`models.checkpointing`;
        0: off). ConfigError for a combination that cannot apply."""
        checkpointing.check_segments(int(segments or 0), len(self.layers), bool(on), bool(keep_attention))
        self.gradient_checkpointing, self.keep_attention = bool(on), bool(keep_attention)
        self.checkpoint_segments = int(segments or 0)

    def tile_mlp(self, tokens: int) -> None:
        """Run every layer's MLP in tiles of `tokens` positions, recomputed tile by tile in the backward
        (`models.tiled`); 0: over whole sequences."""
        for layer in self.layers:
            layer.mlp.tile_tokens = int(tokens)

    def __call__(
        self,
        inputs_embeds: mx.array,
        position_ids: mx.array,
        mask=None,
        cache=None,
        deepstack: tuple[mx.array, list[mx.array]] | None = None,
        router_aux: list | None = None,
        token_mask: mx.array | None = None,
    ) -> mx.array:
        """inputs_embeds [B, L, D]; position_ids [B, L] or [3, B, L]; mask as attention_mask_for.

        deepstack: (visual_mask [B, L] bool, [features [M, D] per layer]) adds each layer's
        features to the visual positions after that layer (Qwen3-VL).
        router_aux: a list that receives the load-balancing loss of the expert layers' routing
        (`models.moe.RouterStats`) over the tokens where token_mask [B, L] (default: all) is 1.
        """
        cos, sin = self.rotary_emb(position_ids)
        h = inputs_embeds
        add, feats = None, ()
        if deepstack is not None:
            vis_mask, feats = deepstack
            # row of each visual token in the flat feature list (index arithmetic, no scatter loop)
            idx = mx.maximum(mx.cumsum(vis_mask.reshape(-1).astype(mx.int32)) - 1, 0).reshape(vis_mask.shape)

            def add(c, feat):
                return (c[0] + mx.where(vis_mask[..., None], feat[idx].astype(c[0].dtype), 0),)
        if cache is None and router_aux is not None and getattr(self, "router_stats", None) is not None:
            h = self.router_stats.run(self, h, (cos, sin), lambda layer, x, c_, s_, rl: layer(x, c_, s_, mask,
                                      routing=rl), token_mask, router_aux, add, feats)
            return self.norm(h)
        if cache is None:  # one dropout key per layer call: a checkpointed layer is recomputed with the same masks
            h, = checkpointing.run_layers(self, lambda layer, x, c_, s_: (layer(x, c_, s_, mask),), (h,), (cos, sin),
                                          add, feats)
            return self.norm(h)
        for i, (layer, c) in enumerate(zip(self.layers, cache, strict=True)):
            h = layer(h, cos, sin, mask, c)
            if i < len(feats):
                h, = add((h,), feats[i])
        return self.norm(h)


class CausalLMHead:
    """What every model class shares around its LanguageModel (`self.language_model`): the LM head,
    which is the embedding matrix when `lm_head` is absent (tied), and the KV cache."""

    @property
    def tied(self) -> bool:
        return "lm_head" not in self

    def lm_head_weight(self) -> mx.array:
        """[V, D] weight of the LM head (the embedding matrix when tied). mlxrl keeps the head float
        (`models.quantize`); a head quantized by hand is dequantized here (a float copy per call)."""
        layer = self.language_model.embed_tokens if self.tied else self.lm_head
        if isinstance(layer, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            from .quantize import dequantize

            return dequantize(layer.weight, layer.scales, layer.get("biases"), group_size=layer.group_size,
                              bits=layer.bits, mode=layer.mode)
        return layer.weight

    def compute_dtype(self) -> mx.Dtype:
        """The dtype the model computes in: its final norm's (a frozen head may be kept in bfloat16 under
        float32 compute, `models.widened`)."""
        return self.language_model.norm.weight.dtype

    def apply_lm_head(self, hidden: mx.array) -> mx.array:
        if self.tied:
            return self.language_model.embed_tokens.as_linear(hidden)
        return self.lm_head(hidden)

    def make_cache(self):
        from mlx_lm.models.cache import KVCache

        return [KVCache() for _ in self.language_model.layers]
