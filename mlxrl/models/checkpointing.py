"""Gradient checkpointing over the decoder layers: per layer, and nested in segments.

Per layer (`gradient_checkpointing`): each layer keeps its input [B, T, D] through the step and is
recomputed from it in the backward: L kept inputs. At long sequences they are most of the step's memory
(Qwen3-1.7B at 40960 tokens: 28 x 335 MB = 9.4 GB, next to 7 GB of weights).

Segments (`checkpoint_segments = S`, with gradient_checkpointing, in training): the layers also run in
consecutive segments of ceil(L / S) layers (S of them, fewer where the division rounds up), each checkpointed
around its layers' own checkpoints (torch's `checkpoint_sequential`, nested; the sqrt(L) schedule of Chen et
al., 2016). Through the step only each segment's input is kept; in the backward a segment is recomputed once
more, and its layers' inputs live only while it is differentiated: `kept_inputs` (10 instead of 28 at S = 4),
for one more forward of every layer but the last segment's (that segment runs per layer: its layers' inputs
are all alive when the backward begins with it either way, so wrapping it would only recompute it). The
dropout keys of a segment's layers are drawn before it, in the order the per-layer loop draws them, and enter
it as inputs, so the masks, the loss and the gradients are the per-layer ones, bit for bit
(`tests/test_checkpointing.py`). MLX evaluates a segment's recomputation when the backward reaches it
(depth-first on the CPU, and under MLX's own breadth-first order, a GPU's: both measured to keep the saving).
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn

from ..errors import ConfigError
from . import dropout


class _Segment(nn.Module):
    """The layers of one segment, as one module: `nn.utils.checkpoint` differentiates its parameters."""

    def __init__(self, layers: list):
        super().__init__()
        self.layers = layers


def segment_size(layers: int, segments: int) -> int:
    """Layers per segment: ceil(layers / segments); 0 when segments are off (0)."""
    return -(-layers // segments) if segments else 0


def kept_inputs(layers: int, segments: int) -> int:
    """Layer inputs [B, T, D] alive together in a checkpointed backward: every layer's (per layer), or each
    segment's and, while a segment is differentiated, its layers' (its first input is the segment's)."""
    if segments <= 1:
        return layers
    size = segment_size(layers, segments)
    return math.ceil(layers / size) + size - 1


def recomputed_layers(layers: int, segments: int) -> int:
    """Layers that run one more forward: all but the last segment's (which runs per layer)."""
    if segments <= 1:
        return 0
    size = segment_size(layers, segments)
    return (math.ceil(layers / size) - 1) * size


def best_segments(layers: int) -> int:
    """The segment count that keeps the fewest layer inputs and, among those, recomputes the fewest layers
    (4 for Qwen3's 28 layers: 10 inputs, 21 layers recomputed; 5 also keeps 10 but recomputes 24); 0 where
    no count keeps fewer than every layer's input (3 layers or fewer)."""
    best = min(range(2, max(layers, 2)), key=lambda s: (kept_inputs(layers, s), recomputed_layers(layers, s), s),
               default=0)
    return best if best and kept_inputs(layers, best) < layers else 0


def check_segments(segments: int, layers: int | None, checkpointing: bool, keep_attention: bool, p: str = "") -> None:
    """ConfigError (a ValueError) when `checkpoint_segments` cannot apply (layers None: before the model is
    known); p: the flags' prefix ("--" on a command line)."""
    if not segments:
        return
    if not checkpointing:
        raise ConfigError(f"{p}checkpoint_segments nests checkpoints around gradient_checkpointing's: turn "
                          f"{p}gradient_checkpointing on, or set {p}checkpoint_segments 0")
    if keep_attention:
        raise ConfigError(f"{p}checkpoint_segments saves memory at the cost of a recomputation, {p}keep_attention "
                          "spends memory to skip one: use one of them")
    if layers is not None and layers < 3:
        raise ConfigError(f"{p}checkpoint_segments {segments}: this model's {layers} decoder layer(s) are too few to "
                          f"segment (at least 3): set {p}checkpoint_segments 0")
    if layers is not None and not 2 <= segments < layers:
        raise ConfigError(f"{p}checkpoint_segments {segments}: between 2 and {layers - 1} for this model's {layers} "
                          f"decoder layers ({best_segments(layers) or 'none'} keeps the fewest inputs), or 0 for off")


def run_layers(lm, layer_fn, carry: tuple, args: tuple = (), after=None, extras: list | tuple = ()) -> tuple:
    """The decoder layers of `lm` (a LanguageModel) over `carry`, a tuple of arrays: layer_fn(layer, *carry,
    *args) -> the next carry; then, after layer i < len(extras), after(carry, extras[i]) (Qwen3-VL's
    deepstack: a differentiable input per layer). `args` are the same inputs for every layer (cos, sin).
    Checkpointed per layer with lm.gradient_checkpointing (the dropout keys of `dropout.keyed`), in
    lm.checkpoint_segments segments too (this module's docstring)."""
    layers, segments = lm.layers, int(getattr(lm, "checkpoint_segments", 0) or 0)

    def one(layer, key=None):
        return dropout.keyed(layer, lambda *a, _l=layer: tuple(layer_fn(_l, *a)), checkpoint=lm.gradient_checkpointing,
                             keep_attention=lm.keep_attention and key is None, key=key)

    segmenting = segments > 1 and lm.gradient_checkpointing and lm.training
    size = segment_size(len(layers), segments) if segmenting else max(len(layers), 1)  # else one, per layer
    n_c, n_a = len(carry), len(args)
    for s0 in range(0, len(layers), size):
        idx = range(s0, min(len(layers), s0 + size))
        if idx[-1] == len(layers) - 1:  # the last segment, per layer: its layers' inputs are all alive while
            for i in idx:                # it is differentiated anyway, and the backward begins with it
                carry = one(layers[i])(*carry, *args)
                if after is not None and i < len(extras):
                    carry = after(carry, extras[i])
            break
        keys = [dropout.fresh_key() for _ in idx]  # what the per-layer loop draws, in its order
        feats = [extras[i] for i in idx if i < len(extras)]

        def segment(*xs, _idx=idx):
            c, a = xs[:n_c], xs[n_c:n_c + n_a]
            ks, fs = xs[n_c + n_a:n_c + n_a + len(_idx)], xs[n_c + n_a + len(_idx):]
            for j, i in enumerate(_idx):
                c = one(layers[i], mx.stop_gradient(ks[j]))(*c, *a)
                if after is not None and j < len(fs):
                    c = after(c, fs[j])
            return tuple(c)

        carry = tuple(nn.utils.checkpoint(_Segment([layers[i] for i in idx]), segment)(*carry, *args, *keys, *feats))
    return tuple(carry)
