"""Qwen2-VL vision tower in MLX: patch embed, ViT blocks with 2D rotary, 2x2 patch merger.

Parameter names are Hugging Face's, relative to ``visual.``. Everything that depends on the
image grids (rotary cos/sin, per-frame segment ids) is computed in numpy by ``metadata``; the
forward only does array math, so ``mx.compile`` traces it once per shape.

Attention stays inside segments (a frame here; a window or a frame in Qwen2.5-VL) and never
builds a dense [N, N] mask over the batch's patches: segments of equal length are stacked into
one [S, L] batch and attended without a mask, one attention call per distinct length, so the
scores cost sum(L_i**2), not N**2 (``segment_groups``, ``attend``). Each block is recomputed in
the backward when the tower is called with ``checkpoint=True`` (the trainers' gradient_checkpointing).

The helpers here (grid parsing, position ids, rotary, segment layouts, patch embed, attention)
are shared with the Qwen2.5-VL tower.

Test: pytest tests/test_vision_qwen2.py
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ...cpu import fastmath

# Old config.json files (and transformers' attribute_map) use other names for these fields.
_ALIASES = {"in_chans": "in_channels", "num_attention_heads": "num_heads", "num_hidden_layers": "depth"}


def config_kwargs(cls, d: dict) -> dict:
    """Keyword arguments for the dataclass ``cls`` from an HF vision-config dict."""
    d = dict(d)
    for old, new in _ALIASES.items():
        if old in d and new not in d:
            d[new] = d[old]
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if "rope_theta" not in d and "rope_theta" in rope:
        d["rope_theta"] = rope["rope_theta"]
    names = inspect.signature(cls).parameters
    return {k: v for k, v in d.items() if k in names}


@dataclass
class VisionConfig:
    depth: int = 32
    embed_dim: int = 1280
    hidden_size: int = 3584  # output width: the language model's hidden size
    hidden_act: str = "quick_gelu"
    mlp_ratio: float = 4
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 14
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    rope_theta: float = 10000.0

    @classmethod
    def from_dict(cls, d: dict) -> VisionConfig:
        return cls(**config_kwargs(cls, d))

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads


# ---------------------------------------------------------------- grid-dependent metadata (numpy)


def as_grid(grid_thw, merge: int) -> np.ndarray:
    """[n, 3] int64 array of (t, h, w) patch grids; h and w must be multiples of ``merge``."""
    grid = np.asarray(grid_thw).astype(np.int64).reshape(-1, 3)
    if (grid[:, 1:] % merge).any() or (grid <= 0).any():
        raise ValueError(f"grid_thw rows must be positive with h, w multiples of {merge}: {grid.tolist()}")
    return grid


def position_ids(grid: np.ndarray, merge: int) -> np.ndarray:
    """[N, 2] (row, col) of every patch, in the processor's order: merge blocks of
    ``merge x merge`` patches, blocks in raster order, frames one after another."""
    out = []
    for t, h, w in grid:
        rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        blocks = (h // merge, merge, w // merge, merge)
        rows = rows.reshape(blocks).transpose(0, 2, 1, 3).reshape(-1)
        cols = cols.reshape(blocks).transpose(0, 2, 1, 3).reshape(-1)
        out.append(np.tile(np.stack([rows, cols], axis=-1), (t, 1)))
    return np.concatenate(out, axis=0)


def rotary_cos_sin(pos: np.ndarray, head_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """Axial 2D rotary: a quarter of the head rotates by the row, a quarter by the column, and
    the result is repeated for the two rotate-half halves. Returns float32 [N, head_dim] each."""
    half = head_dim // 2
    inv_freq = 1.0 / theta ** (np.arange(0, half, 2, dtype=np.float64) / half)  # [head_dim // 4]
    freqs = (pos[:, :, None] * inv_freq).reshape(len(pos), -1)  # [N, head_dim // 2]: rows, then cols
    freqs = np.concatenate([freqs, freqs], axis=-1)
    return np.cos(freqs).astype(np.float32), np.sin(freqs).astype(np.float32)


def frame_segment_ids(grid: np.ndarray) -> np.ndarray:
    """[N] int32: one id per frame of every image/video (attention never crosses frames)."""
    sizes = np.repeat(grid[:, 1] * grid[:, 2], grid[:, 0])
    return np.repeat(np.arange(len(sizes)), sizes).astype(np.int32)


# ---------------------------------------------------------------- layers


def quick_gelu(x: mx.array) -> mx.array:
    return x * fastmath.sigmoid(1.702 * x)


ACT = {"quick_gelu": quick_gelu, "gelu": nn.gelu, "silu": fastmath.silu, "gelu_pytorch_tanh": fastmath.gelu_approx}


def segment_groups(seg: np.ndarray, name: str) -> dict[str, object]:
    """The attention layout of segments ``seg`` [N] (each id one contiguous run of tokens).

    ``{name}_groups``: one int32 [S, L] array per distinct segment length L (ascending), the
    tokens of its S segments. When the groups flattened and concatenated are not the tokens in
    order: ``{name}_order`` [N] int32, that concatenation (a gather into group order), and
    ``{name}_scatter`` [N] int32, its inverse (the row of each token). With one image size in a
    batch, or sizes ascending, both are omitted and the forward only slices and reshapes. Exact
    lengths: no padding, no key mask."""
    n = len(seg)
    starts = np.flatnonzero(np.r_[True, seg[1:] != seg[:-1]])
    if len(starts) != len(np.unique(seg)):
        raise ValueError(f"{name} ids must each form one contiguous run of tokens")
    lengths = np.diff(np.r_[starts, n])
    groups = [(starts[lengths == L][:, None] + np.arange(L)).astype(np.int32) for L in np.unique(lengths)]
    out: dict[str, object] = {f"{name}_groups": groups}
    order = np.concatenate([g.reshape(-1) for g in groups])
    if not np.array_equal(order, np.arange(n)):
        scatter = np.empty(n, np.int32)
        scatter[order] = np.arange(n, dtype=np.int32)
        out[f"{name}_order"] = order
        out[f"{name}_scatter"] = scatter
    return out


def to_mx(meta: dict) -> dict:
    """numpy metadata -> mx arrays (lists of arrays stay lists)."""
    return {k: [mx.array(a) for a in v] if isinstance(v, list) else mx.array(v) for k, v in meta.items()}


def segment_layout(meta: dict, name: str) -> tuple:
    """What ``attend`` takes for segments ``name``: (groups, order or None, scatter or None)."""
    return meta[f"{name}_groups"], meta.get(f"{name}_order"), meta.get(f"{name}_scatter")


def attend(q: mx.array, k: mx.array, v: mx.array, scale: float, layout) -> mx.array:
    """Attention within segments; q, k, v and the result are [N, H, D]. The tokens are put in
    group order (one gather, when needed), each group of S equal-length segments is a slice
    attended as [S, H, L, D] without a mask (scores [S, H, L, L]), and the result is put back."""
    groups, order, scatter = layout
    n, h, d = q.shape
    if order is not None:
        q, k, v = q[order], k[order], v[order]
    outs, offset = [], 0
    for rows in groups:
        s, length = rows.shape
        qg, kg, vg = (
            a[offset : offset + s * length].reshape(s, length, h, d).transpose(0, 2, 1, 3) for a in (q, k, v)
        )
        offset += s * length
        out = fastmath.scaled_dot_product_attention(qg, kg, vg, scale=scale)  # [S, H, L, D]
        outs.append(out.transpose(0, 2, 1, 3).reshape(-1, h, d))
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs)
    return out if scatter is None else out[scatter]


def run_block(block: nn.Module, x: mx.array, checkpoint: bool, *args) -> mx.array:
    """``block(x, *args)``; with ``checkpoint`` its activations are recomputed in the backward
    (``args``, the grid metadata, are constants of the graph)."""
    if not checkpoint:
        return block(x, *args)
    return nn.utils.checkpoint(block, lambda h, _b=block: _b(h, *args))(x)


def apply_rotary(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """x [N, H, D] in any dtype (typically a strided view of the fused qkv output), cos / sin [N, D] or
    [N, 1, D] float32: the rotation runs in float32 and returns x's dtype (`fastmath.rotary` over x as
    [1, N, H, D]: on float32 CPU arrays one native pass that reads the view in place)."""
    if cos.ndim == 2:
        cos, sin = cos[:, None], sin[:, None]
    return fastmath.rotary(x[None], cos[None], sin[None])[0]


class LayerNorm(nn.LayerNorm):
    """`nn.LayerNorm` (same parameters, same math) through `fastmath.layer_norm`: on float32 CPU arrays one
    multi-threaded pass per row forward and backward instead of MLX's composed single-core ops."""

    def __call__(self, x: mx.array) -> mx.array:
        if "weight" not in self or "bias" not in self:
            return super().__call__(x)
        return fastmath.layer_norm(x, self["weight"], self["bias"], self.eps)


class Conv3dWeight(nn.Module):
    """Holds the Conv3d kernel in HF layout [E, C, T, P, P] so the name is ``proj.weight``."""

    def __init__(self, embed_dim: int, in_channels: int, temporal: int, patch: int):
        super().__init__()
        self.weight = mx.zeros((embed_dim, in_channels, temporal, patch, patch))


class PatchEmbed(nn.Module):
    def __init__(self, embed_dim: int, in_channels: int, temporal: int, patch: int):
        super().__init__()
        self.proj = Conv3dWeight(embed_dim, in_channels, temporal, patch)

    def __call__(self, x: mx.array) -> mx.array:
        # The processor already flattened each patch as (C, T, P, P): a Conv3d whose kernel
        # equals its stride is then one matmul with the flattened kernel.
        w = self.proj.weight
        return x.astype(w.dtype) @ w.reshape(w.shape[0], -1).T


class Attention(nn.Module):
    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.scale = (dim // num_heads) ** -0.5
        self.qkv = nn.Linear(dim, 3 * dim, bias=True)
        self.proj = nn.Linear(dim, dim, bias=True)

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array, layout) -> mx.array:
        n = x.shape[0]
        qkv = self.qkv(x).reshape(n, 3, self.num_heads, -1)
        q = apply_rotary(qkv[:, 0], cos, sin)
        k = apply_rotary(qkv[:, 1], cos, sin)
        return self.proj(attend(q, k, qkv[:, 2], self.scale, layout).reshape(n, -1))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.act = ACT[act]

    def __call__(self, x: mx.array) -> mx.array:
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        dim = config.embed_dim
        self.norm1 = LayerNorm(dim, eps=1e-6)
        self.norm2 = LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, config.num_heads)
        self.mlp = MLP(dim, int(dim * config.mlp_ratio), config.hidden_act)

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array, layout) -> mx.array:
        x = x + self.attn(self.norm1(x), cos, sin, layout)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Norm, then concatenate each merge x merge block of patches (adjacent rows in the
    processor's order) and project with a 2-layer GELU MLP to the LM width."""

    def __init__(self, out_dim: int, context_dim: int, merge: int, ln_q: nn.Module):
        super().__init__()
        self.hidden = context_dim * merge**2
        self.ln_q = ln_q
        # A list (not nn.Sequential) so the names are mlp.0 / mlp.2 as in HF.
        self.mlp = [nn.Linear(self.hidden, self.hidden), nn.GELU(), nn.Linear(self.hidden, out_dim)]

    def __call__(self, x: mx.array) -> mx.array:
        x = self.ln_q(x).reshape(-1, self.hidden)
        for layer in self.mlp:
            x = layer(x)
        return x


def sanitize_vision_weights(weights: dict[str, mx.array], in_channels: int) -> dict[str, mx.array]:
    """Identity for HF checkpoints. Drops rotary buffers some exports carry and turns a
    channels-last patch kernel [E, T, P, P, C] (mlx-vlm's layout) back into [E, C, T, P, P];
    a kernel already in HF layout (dim 1 == C) is left alone, so this is idempotent."""
    out = {}
    for k, v in weights.items():
        if k.startswith("rotary_pos_emb."):
            continue
        if k == "patch_embed.proj.weight" and v.ndim == 5 and v.shape[1] != in_channels:
            if v.shape[-1] == in_channels:
                v = v.transpose(0, 4, 1, 2, 3)
        out[k] = v
    return out


# ---------------------------------------------------------------- the tower


class VisionModel(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.config = config
        c = config
        self.patch_embed = PatchEmbed(c.embed_dim, c.in_channels, c.temporal_patch_size, c.patch_size)
        self.blocks = [Block(c) for _ in range(c.depth)]
        self.merger = PatchMerger(c.hidden_size, c.embed_dim, c.spatial_merge_size, LayerNorm(c.embed_dim, eps=1e-6))

    def metadata(self, grid_thw) -> dict:
        """cos/sin [N, head_dim] float32, segment_ids [N] (one per frame) and their attention
        layout (segment_groups and, when needed, segment_order/_scatter: ``segment_groups``)."""
        c = self.config
        grid = as_grid(grid_thw, c.spatial_merge_size)
        cos, sin = rotary_cos_sin(position_ids(grid, c.spatial_merge_size), c.head_dim, c.rope_theta)
        seg = frame_segment_ids(grid)
        return to_mx({"cos": cos, "sin": sin, "segment_ids": seg, **segment_groups(seg, "segment")})

    def __call__(self, pixel_values: mx.array, meta: dict, checkpoint: bool = False) -> mx.array:
        """pixel_values [N, C*T*P*P] -> merged features [N // merge**2, hidden_size]; with
        ``checkpoint`` each block is recomputed in the backward."""
        x = self.patch_embed(pixel_values)  # [N, E]
        layout = segment_layout(meta, "segment")
        for block in self.blocks:
            x = run_block(block, x, checkpoint, meta["cos"], meta["sin"], layout)
        return self.merger(x)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        return sanitize_vision_weights(weights, self.config.in_channels)
