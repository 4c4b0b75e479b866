"""Qwen2.5-VL vision tower in MLX: Qwen2-VL's tower with RMSNorm, a SwiGLU MLP and window
attention (full attention only in ``fullatt_block_indexes``).

Window attention: merge units (``merge x merge`` patches) are grouped into windows of
``window_size // patch_size // merge`` units per side. The tokens are reordered so each window
is contiguous (HF's ``window_index``), every block attends within a window or within a frame
(per-segment attention, no [N, N] mask: see ``qwen2_vl.vision``), and the merged features are
put back in the processor's order at the end.
All index arrays come from ``metadata`` (numpy); the forward is compile-friendly.

Test: pytest tests/test_vision_qwen2.py
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..qwen2_vl.vision import (
    ACT,
    Attention,
    PatchEmbed,
    PatchMerger,
    as_grid,
    config_kwargs,
    frame_segment_ids,
    position_ids,
    rotary_cos_sin,
    run_block,
    sanitize_vision_weights,
    segment_groups,
    segment_layout,
    to_mx,
)


@dataclass
class VisionConfig:
    depth: int = 32
    hidden_size: int = 1280
    hidden_act: str = "silu"
    intermediate_size: int = 3420
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 14
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    tokens_per_second: int = 4  # used by the LM's M-RoPE for videos, not by the tower
    window_size: int = 112
    out_hidden_size: int = 3584
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    rope_theta: float = 10000.0

    @classmethod
    def from_dict(cls, d: dict) -> VisionConfig:
        kw = config_kwargs(cls, d)
        if "fullatt_block_indexes" in kw:
            kw["fullatt_block_indexes"] = tuple(kw["fullatt_block_indexes"])
        return cls(**kw)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def window_index(grid: np.ndarray, merge: int, window_units: int) -> tuple[np.ndarray, np.ndarray]:
    """Per merge unit: the permutation that makes windows contiguous, and the window id of
    each unit in that new order. Windows run frame by frame, in raster order of windows,
    with raster order inside each window (edge windows are smaller); same order as HF."""
    order, seg = [], []
    offset = n_windows = 0
    for t, h, w in grid:
        gh, gw = h // merge, w // merge
        nwh, nww = -(-gh // window_units), -(-gw // window_units)
        f, r, c = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
        win = ((f * nwh + r // window_units) * nww + c // window_units).reshape(-1)
        perm = np.argsort(win, kind="stable")  # stable: raster order inside each window
        order.append(perm + offset)
        seg.append(win[perm] + n_windows)
        offset += t * gh * gw
        n_windows += t * nwh * nww
    return np.concatenate(order), np.concatenate(seg)


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=True)
        self.up_proj = nn.Linear(dim, hidden, bias=True)
        self.down_proj = nn.Linear(hidden, dim, bias=True)
        self.act = ACT[act]

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        dim = config.hidden_size
        self.norm1 = nn.RMSNorm(dim, eps=1e-6)
        self.norm2 = nn.RMSNorm(dim, eps=1e-6)
        self.attn = Attention(dim, config.num_heads)
        self.mlp = MLP(dim, config.intermediate_size, config.hidden_act)

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array, layout) -> mx.array:
        x = x + self.attn(self.norm1(x), cos, sin, layout)
        return x + self.mlp(self.norm2(x))


class VisionModel(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.config = config
        c = config
        self.patch_embed = PatchEmbed(c.hidden_size, c.in_channels, c.temporal_patch_size, c.patch_size)
        self.blocks = [Block(c) for _ in range(c.depth)]
        self.merger = PatchMerger(
            c.out_hidden_size, c.hidden_size, c.spatial_merge_size, nn.RMSNorm(c.hidden_size, eps=1e-6)
        )

    def metadata(self, grid_thw) -> dict:
        """Everything is in window order (the order the blocks see): cos/sin [N, head_dim]
        float32, segment_ids [N] (per frame, for full-attention blocks), window_segment_ids [N],
        the attention layouts of both (segment_groups/_order/_scatter, window_segment_*);
        window_index [N / unit] gathers merge units into window order, reverse_index undoes it."""
        c = self.config
        merge = c.spatial_merge_size
        unit = merge**2
        grid = as_grid(grid_thw, merge)
        units, unit_windows = window_index(grid, merge, c.window_size // merge // c.patch_size)
        tokens = (units[:, None] * unit + np.arange(unit)).reshape(-1)  # token-level permutation
        cos, sin = rotary_cos_sin(position_ids(grid, merge), c.head_dim, c.rope_theta)
        frames = frame_segment_ids(grid)[tokens]
        windows = np.repeat(unit_windows, unit).astype(np.int32)
        meta = {
            "cos": cos[tokens],
            "sin": sin[tokens],
            "segment_ids": frames,
            "window_segment_ids": windows,
            "window_index": units.astype(np.int32),
            "reverse_index": np.argsort(units).astype(np.int32),
            **segment_groups(frames, "segment"),
            **segment_groups(windows, "window_segment"),
        }
        return to_mx(meta)

    def __call__(self, pixel_values: mx.array, meta: dict, checkpoint: bool = False) -> mx.array:
        """pixel_values [N, C*T*P*P] -> merged features [N // merge**2, out_hidden_size]; with
        ``checkpoint`` each block is recomputed in the backward."""
        unit = self.config.spatial_merge_size**2
        x = self.patch_embed(pixel_values)  # [N, E]
        n, dim = x.shape
        x = x.reshape(n // unit, unit, dim)[meta["window_index"]].reshape(n, dim)
        frames = segment_layout(meta, "segment")
        windows = segment_layout(meta, "window_segment")
        cos, sin = meta["cos"], meta["sin"]
        full = set(self.config.fullatt_block_indexes)
        for i, block in enumerate(self.blocks):
            x = run_block(block, x, checkpoint, cos, sin, frames if i in full else windows)
        return self.merger(x)[meta["reverse_index"]]  # back to the processor's order

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        return sanitize_vision_weights(weights, self.config.in_channels)
