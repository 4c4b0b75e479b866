"""Dropout whose mask is a function of an explicit key, so a checkpointed layer's recomputation in the
backward drops the same elements as its forward did.

`nn.utils.checkpoint` recomputes a layer in the backward by calling it again. MLX's `nn.Dropout` draws its
mask from the global random state at call time, so the recomputed layer (and the gradient built from it)
saw a different mask than the forward that produced the loss: with LoRA dropout and gradient
checkpointing (both defaults) the gradient was not the loss's. PyTorch's checkpoint restores the RNG state
for the same reason. Here `keyed` draws one key per layer call outside the checkpointed function and
passes it in as an input; inside, every `Dropout` takes its key from that one in call order (`mx.random.split`),
and the recomputation replays the same order, hence the same masks.

On float32 CPU arrays the mask comes from the native kernel (`mlxrl.cpu.native`: a counter-based hash of
the element index and the key, multi-threaded, and its VJP applies the same mask without keeping it);
elsewhere from `mx.random.bernoulli` with that key, as `nn.Dropout` computes it.
"""

from __future__ import annotations

from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn

from ..cpu import fastmath

_KEYS: list[list[mx.array]] = []  # the keys of the checkpointed calls in progress (innermost last)


@contextmanager
def eval_mode(model: nn.Module):
    """`model` in eval mode (dropout off) inside, and back in the mode it was in afterwards, however the block
    ends: an evaluation or a generation that raises must not leave a run training without its dropout."""
    was = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was)


def fresh_key() -> mx.array:
    """A uint32[2] key drawn from MLX's global random state."""
    return mx.random.randint(0, 2**31 - 1, (2,), dtype=mx.int32).astype(mx.uint32)


def next_key() -> mx.array:
    """The next key of the enclosing `keyed` call (or `scope`), in call order; a fresh one outside any."""
    if not _KEYS:
        return fresh_key()
    cell = _KEYS[-1]
    keys = mx.random.split(mx.stop_gradient(cell[0]))  # a key has no gradient (RandomBits has no VJP)
    cell[0] = keys[0]
    return keys[1]


@contextmanager
def scope(key: mx.array | None):
    """Inside, `Dropout` takes its keys from `key` (split in call order) as inside a `keyed` call; None: no
    change. `models.tiled` runs each tile of a token-wise module under its own key, forward and backward."""
    if key is None:
        yield
        return
    _KEYS.append([key])
    try:
        yield
    finally:
        _KEYS.pop()


def keyed(module: nn.Module, fn, checkpoint: bool = False, keep_attention: bool = False, key: mx.array | None = None):
    """`fn` (a call of `module`) run with one key for its `Dropout` masks, drawn per call; with `checkpoint`,
    as `nn.utils.checkpoint(module, fn)` whose recomputation sees the same masks as the forward. The masks
    are the same with and without checkpointing (a tiled MLP, `models.tiled`, draws one key per tile: the
    same tiles give the same masks). In eval mode (no dropout, no key) `fn` as it is.

    keep_attention (with checkpoint, in training): the recomputation reuses the forward's FlashAttention
    outputs instead of running the attention again (`fastmath.KeptAttention`; the native kernel path only,
    elsewhere the attention is recomputed). `mx.checkpoint` traces `fn` twice per call: the forward, then
    the recomputation when the backward is built; each call gets its own keeper, which tells them apart.

    key: the key of the call (in training), drawn by the caller; None: a fresh one per call
    (`models.checkpointing` draws a segment's keys before it and passes each in)."""
    keep, training = checkpoint and keep_attention, module.training
    if not training and not keep:
        return nn.utils.checkpoint(module, fn) if checkpoint else fn

    def call(*args):
        keeper = fastmath.KeptAttention() if keep else None

        def run(key, *args):
            if keeper is not None:
                fastmath.KEEPERS.append(keeper)
            try:
                with scope(key if training else None):
                    return fn(*args)
            finally:
                if keeper is not None:
                    fastmath.KEEPERS.pop()
                    keeper.replay = True  # the next trace of this call is the backward's recomputation

        inner = nn.utils.checkpoint(module, run) if checkpoint else run
        k = (fresh_key() if key is None else key) if training else mx.zeros((2,), mx.uint32)  # eval: no draw
        return inner(mx.stop_gradient(k), *args)

    return call


class Dropout(nn.Module):
    """`nn.Dropout(p)` (zero each element with probability p, scale the rest by 1 / (1 - p), identity in
    eval mode) with its key from the enclosing `keyed` call, or from the global random state outside one."""

    def __init__(self, p: float = 0.5):
        super().__init__()
        if not 0 <= p < 1:
            raise ValueError(f"dropout probability must be in [0, 1), got {p}")
        self._keep = 1.0 - p

    def _extra_repr(self) -> str:
        return f"p={1 - self._keep}"

    def __call__(self, x: mx.array) -> mx.array:
        if self._keep == 1.0 or not self.training:
            return x
        key = next_key()
        kernels = fastmath.kernels_for(x)
        if kernels is not None:
            return kernels.dropout(x, key, self._keep)
        mask = mx.random.bernoulli(self._keep, x.shape, key=key)
        return (mask * x) * (1 / self._keep)

    def matmul(self, x: mx.array, w: mx.array) -> mx.array:
        """`self(x) @ w` for a narrow w ([d, r]: LoRA's A), the same key and mask. On float32 CPU arrays one
        native pass (`lora_down`) that never writes the dropped copy of x, so neither the forward, the
        checkpoint's recomputation nor A's gradient (its VJP recomputes the mask) holds one."""
        if self._keep == 1.0 or not self.training:
            return x @ w
        kernels = fastmath.kernels_for(x)
        if kernels is not None and w.dtype == mx.float32 and w.ndim == 2:
            return kernels.lora_down(x, next_key(), w, self._keep)
        return self(x) @ w


def embedding_noise(h: mx.array, scale: mx.array | None, training: bool) -> mx.array:
    """NEFTune (TRL's `neftune_noise_alpha`, transformers' `neftune_post_forward_hook`): in training, the
    input embeddings plus uniform noise in [-scale, scale], scale = alpha / sqrt(L * hidden) with L the
    batch's padded length in TRL's collation (the SFT trainer computes it: `SFTTrainer.prepare`). A
    constant to the backward (the gradient of h is unchanged); drawn with the next key, as dropout is."""
    if scale is None or not training:
        return h
    noise = mx.random.uniform(-1.0, 1.0, h.shape, dtype=mx.float32, key=next_key())
    return h + (noise * scale.astype(mx.float32)).astype(h.dtype)
