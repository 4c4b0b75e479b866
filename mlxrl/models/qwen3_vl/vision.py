"""Qwen3-VL (dense) vision tower in MLX, parameter names as in HF under ``model.visual.``.

Everything that depends on the image grids (rotary cos/sin, the learned position-embedding
interpolation, the per-frame attention segments) is computed in numpy by ``metadata`` so the
forward holds no data-dependent Python and can be wrapped in ``mx.compile``:

    tower = VisionModel(VisionConfig.from_dict(cfg["vision_config"]))
    meta = tower.metadata(grid_thw)                 # [n_images, 3] -> dict of mx arrays
    merged, deepstack = tower(pixel_values, meta)   # [N // merge**2, out_hidden], list of same

Attention stays inside each frame without a dense [N, N] mask: frames of equal length are
attended as one batch, one call per distinct length (``qwen2_vl.vision.attend``), so the scores
cost sum(L_i**2) over the frames. ``tower(..., checkpoint=True)`` recomputes each block in the
backward (the trainers' gradient_checkpointing).

Parity with transformers: ``pytest tests/test_vision_qwen3.py``.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field

import mlx.core as mx  # mlxrl/__init__ (fast BLAS) has run by the time this package imports
import mlx.nn as nn
import numpy as np

from ..qwen2_vl.vision import ACT, LayerNorm, apply_rotary, attend, run_block, segment_groups, segment_layout, to_mx


@dataclass
class VisionConfig:
    depth: int = 27
    hidden_size: int = 1152
    hidden_act: str = "gelu_pytorch_tanh"
    intermediate_size: int = 4304
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 16
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    out_hidden_size: int = 3584
    num_position_embeddings: int = 2304
    deepstack_visual_indexes: list[int] = field(default_factory=lambda: [8, 16, 24])
    rope_theta: float = 10000.0
    layer_norm_eps: float = 1e-6

    @classmethod
    def from_dict(cls, d: dict) -> VisionConfig:
        params = inspect.signature(cls).parameters
        kwargs = {k: v for k, v in d.items() if k in params}
        # transformers 5 nests the theta in rope_parameters; older configs omit it (10000)
        rope = d.get("rope_parameters") or {}
        if "rope_theta" not in kwargs and "rope_theta" in rope:
            kwargs["rope_theta"] = rope["rope_theta"]
        if "deepstack_visual_indexes" in kwargs:
            kwargs["deepstack_visual_indexes"] = list(kwargs["deepstack_visual_indexes"])
        return cls(**kwargs)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads




class Conv3dProj(nn.Module):
    """Conv3d with kernel == stride over already-cut patches: a matmul.

    The weight keeps HF's [E, C, T, P, P] layout, so checkpoints load without conversion;
    the processor flattens each patch in the same (C, T, P, P) order.
    """

    def __init__(self, in_dim: tuple[int, int, int, int], embed_dim: int):
        super().__init__()
        self.weight = mx.zeros((embed_dim, *in_dim))
        self.bias = mx.zeros((embed_dim,))

    def __call__(self, x: mx.array) -> mx.array:
        w = self.weight.reshape(self.weight.shape[0], -1)
        return mx.addmm(self.bias, x.astype(w.dtype), w.T)


class PatchEmbed(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        p, t = config.patch_size, config.temporal_patch_size
        self.proj = Conv3dProj((config.in_channels, t, p, p), config.hidden_size)

    def __call__(self, x: mx.array) -> mx.array:
        return self.proj(x)


class Attention(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        dim = config.hidden_size
        self.num_heads = config.num_heads
        self.scale = config.head_dim**-0.5
        self.qkv = nn.Linear(dim, 3 * dim, bias=True)
        self.proj = nn.Linear(dim, dim, bias=True)

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array, layout) -> mx.array:
        n = x.shape[0]
        qkv = self.qkv(x).reshape(n, 3, self.num_heads, -1)  # [N, 3, H, hd]
        # rotary in float32 (as HF), then back to the compute dtype
        q, k, v = apply_rotary(qkv[:, 0], cos, sin), apply_rotary(qkv[:, 1], cos, sin), qkv[:, 2]
        return self.proj(attend(q, k, v, self.scale, layout).reshape(n, -1))


class MLP(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.linear_fc1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=True)
        self.act = ACT[config.hidden_act]

    def __call__(self, x: mx.array) -> mx.array:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class Block(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.norm1 = LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.norm2 = LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.attn = Attention(config)
        self.mlp = MLP(config)

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array, layout) -> mx.array:
        x = x + self.attn(self.norm1(x), cos, sin, layout)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Concatenates each merge x merge window (consecutive in the patch order) and projects it.

    The final merger normalises each patch before the concat; deepstack mergers normalise the
    concatenated window (``postshuffle``).
    """

    def __init__(self, config: VisionConfig, postshuffle: bool):
        super().__init__()
        self.window_dim = config.hidden_size * config.spatial_merge_size**2
        self.postshuffle = postshuffle
        norm_dim = self.window_dim if postshuffle else config.hidden_size
        self.norm = LayerNorm(norm_dim, eps=config.layer_norm_eps)
        self.linear_fc1 = nn.Linear(self.window_dim, self.window_dim, bias=True)
        self.linear_fc2 = nn.Linear(self.window_dim, config.out_hidden_size, bias=True)

    def __call__(self, x: mx.array) -> mx.array:
        if self.postshuffle:
            x = self.norm(x.reshape(-1, self.window_dim))
        else:
            x = self.norm(x).reshape(-1, self.window_dim)
        return self.linear_fc2(nn.gelu(self.linear_fc1(x)))  # exact (erf) GELU, as HF's nn.GELU()


class VisionModel(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.config = config
        self.num_grid_per_side = math.isqrt(config.num_position_embeddings)
        self.patch_embed = PatchEmbed(config)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size)
        self.blocks = [Block(config) for _ in range(config.depth)]
        self.merger = PatchMerger(config, postshuffle=False)
        self.deepstack_merger_list = [
            PatchMerger(config, postshuffle=True) for _ in config.deepstack_visual_indexes
        ]
        half = config.head_dim // 2
        # same float32 arithmetic as HF's axial inv_freq (half of head_dim per axis, step 2)
        self._inv_freq = 1.0 / (
            np.float32(config.rope_theta) ** (np.arange(0, half, 2, dtype=np.float32) / np.float32(half))
        )

    # ---- grid-dependent inputs (numpy, outside the compiled forward) ----

    def metadata(self, grid_thw) -> dict:
        """Per-patch arrays for ``grid_thw`` [n_images, 3] (t, h, w in patches).

        Patches come in the processor's order: per image, per frame, merge windows in raster
        order, and inside a window its merge x merge patches in raster order.

        Returns ``cos``/``sin`` [N, head_dim] f32 (2D rotary: row freqs then column freqs,
        repeated twice), ``pos_idx`` [N, 4] int32 / ``pos_w`` [N, 4] f32 (bilinear corners of the
        learned side x side position grid, align_corners=True), ``segment_ids`` [N] int32
        (one id per frame: attention never crosses frames or images) and their attention layout
        (``segment_groups``, ``segment_order`` / ``segment_scatter``: ``qwen2_vl.vision.segment_groups``).
        """
        grid = np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3)
        t, h, w = grid[:, 0], grid[:, 1], grid[:, 2]
        m = self.config.spatial_merge_size
        if np.any(h % m) or np.any(w % m):
            raise ValueError(f"grid h and w must be multiples of spatial_merge_size={m}: {grid.tolist()}")
        counts = t * h * w
        n = int(counts.sum())
        img = np.repeat(np.arange(len(grid)), counts)  # image of each patch
        local = np.arange(n) - np.repeat(np.cumsum(counts) - counts, counts)
        hw = (h * w)[img]
        frame, within = local // hw, local % hw
        segment = (np.cumsum(t) - t)[img] + frame

        # undo the merge-window order: (block_row, block_col, in_row, in_col) -> (row, col)
        blocks_w = w[img] // m
        row = (within // (m * m * blocks_w)) * m + (within // m) % m
        col = ((within // (m * m)) % blocks_w) * m + within % m

        rc = np.stack([row, col], axis=-1).astype(np.float32)  # [N, 2]
        freqs = (rc[:, :, None] * self._inv_freq).reshape(n, -1)  # [N, head_dim // 2]: rows, then cols
        emb = np.concatenate([freqs, freqs], axis=-1)  # [N, head_dim]

        side = self.num_grid_per_side
        r0, r1, wr = _bilinear_axis(row, h[img], side)
        c0, c1, wc = _bilinear_axis(col, w[img], side)
        pos_idx = np.stack([r0 * side + c0, r0 * side + c1, r1 * side + c0, r1 * side + c1], axis=-1)
        pos_w = np.stack([(1 - wr) * (1 - wc), (1 - wr) * wc, wr * (1 - wc), wr * wc], axis=-1)

        segment = segment.astype(np.int32)
        return to_mx({
            "cos": np.cos(emb)[:, None, :],  # [N, 1, head_dim], broadcast over heads
            "sin": np.sin(emb)[:, None, :],
            "pos_idx": pos_idx.astype(np.int32),
            "pos_w": pos_w.astype(np.float32),
            "segment_ids": segment,
            **segment_groups(segment, "segment"),
        })

    # ---- forward (compile-friendly: shapes only, no host round-trips) ----

    def __call__(
        self, pixel_values: mx.array, meta: dict, checkpoint: bool = False
    ) -> tuple[mx.array, list[mx.array]]:
        """pixel_values [N, C*T*P*P] -> (merged [N // merge**2, out_hidden], deepstack features);
        with ``checkpoint`` each block is recomputed in the backward."""
        x = self.patch_embed(pixel_values)  # [N, D]
        # interpolated learned positions: a gather of pos_embed.weight, so it gets gradients
        corners = mx.take(self.pos_embed.weight, meta["pos_idx"], axis=0)  # [N, 4, D]
        pos = (corners * meta["pos_w"][..., None]).sum(axis=1)
        x = x + pos.astype(x.dtype)

        layout = segment_layout(meta, "segment")
        cos, sin = meta["cos"], meta["sin"]

        deepstack = []
        for i, block in enumerate(self.blocks):
            x = run_block(block, x, checkpoint, cos, sin, layout)
            if i in self.config.deepstack_visual_indexes:
                j = self.config.deepstack_visual_indexes.index(i)
                deepstack.append(self.deepstack_merger_list[j](x))
        return self.merger(x), deepstack

    @staticmethod
    def sanitize(weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Keys relative to ``model.visual.``. HF layout is ours; a channels-last patch weight
        ([E, T, P, P, C], as MLX ports store Conv3d) is moved back to [E, C, T, P, P]."""
        out = dict(weights)
        key = "patch_embed.proj.weight"
        w = out.get(key)
        # HF: [E, C, T, P, P] has P last; channels-last has C (< P) last
        if w is not None and w.ndim == 5 and w.shape[-1] != w.shape[-2]:
            out[key] = w.transpose(0, 4, 1, 2, 3)
        return out


def _bilinear_axis(index: np.ndarray, size: np.ndarray, side: int):
    """Lower/upper tap and upper weight of ``index`` on an axis of ``size`` resampled from ``side``
    points with align_corners=True (endpoints map to 0 and side-1)."""
    src = index * (side - 1) / np.maximum(size - 1, 1)
    lo = np.floor(src).astype(np.int64)
    hi = np.minimum(lo + 1, side - 1)
    return lo, hi, (src - lo).astype(np.float32)
