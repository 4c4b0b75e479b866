"""Tiled MLP: a token-wise module run over the sequence in tiles, whose backward recomputes one tile at a
time, so no [tokens, intermediate] array ever exists for the whole sequence.

A decoder layer's SwiGLU MLP keeps gate and up ([N, I] each, I about 3 x hidden) for its backward, and the
backward makes their gradients and the down-projection's input gradient, all [N, I]: with gradient
checkpointing that is ~40% of the layer's recompute working set, the peak above the weights and the kept
layer inputs. The MLP is token-wise (each position's output depends on that position only), so it can run
on tiles of positions, as "mini-sequence" / "tiled MLP" training does (DeepSpeed ALST, Axolotl's
`tiled_mlp`):

- forward: the tiles' outputs concatenated; a tile's intermediates die when its output exists.
- backward (`mx.custom_function`): for each tile, the MLP forward is recomputed and differentiated
  (`mx.vjp`) for that tile's input gradient and its share of the trainable weights' gradients, summed over
  the tiles in float32 (cast back to each parameter's dtype at the end). MLX schedules a graph depth-first
  from its outputs, which would run every tile's recompute before any tile's weight-gradient sum and keep
  them all alive; each tile's inputs (its slice of x and of the output cotangent) are therefore chained with
  `mx.depends` to the previous tile's results, so the tiles run one after another and the peak holds one
  tile.

Under gradient checkpointing this costs nothing more: the checkpoint's recompute of the layer never needs
the MLP's output (only gradients are asked of it), so the MLP forward still runs twice per step (the
forward and the tile-wise recompute). Without checkpointing the tiles' recompute is one extra MLP forward.

Dropout inside the module (LoRA's) draws one key per tile from the enclosing `dropout.keyed` call, passed
to the custom function as an input; the backward replays each tile under its key, so its masks are the
forward's. The tile's key is a primal of the tile's `mx.vjp` (its gradient discarded), not a constant the
differentiated function closes over: `mx.vjp` walks every non-primal input of the function's graph to its
roots, and under gradient checkpointing the keys reach the whole forward graph up to the layer (MLX's
checkpoint makes its recompute's inputs depend on the forward's outputs), so a closed-over key made each
tile's trace cost the depth of the model above it (a real-depth 0.6B step at 32768 tokens traced and
compiled in 21.5 s instead of 3.5 s, `scripts/bench_trace.py`). Frozen parameters (a LoRA base, quantized or
not) are read from the module and get no gradient; only `module.trainable_parameters()` are differentiated.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from . import dropout


def tile_bounds(n: int, tokens: int) -> list[tuple[int, int]]:
    """[start, end) of ceil(n / tokens) tiles of (nearly) equal size covering n positions."""
    count = -(-n // tokens)
    size, longer = divmod(n, count)  # the first `longer` tiles get one position more
    starts = [i * size + min(i, longer) for i in range(count + 1)]
    return list(zip(starts[:-1], starts[1:], strict=True))


def tiled(module: nn.Module, call, x: mx.array, tokens: int) -> mx.array:
    """`call(x)` (a token-wise function of `module`'s parameters: the output at a position depends on x at
    that position only) over x [..., N, D] flattened to positions, in tiles of at most `tokens` positions,
    with the tile-by-tile recomputing backward described above. Returns call(x) (same shape as a plain call
    would give) up to float rounding; x with no more than `tokens` positions is a plain call."""
    lead, width = x.shape[:-1], x.shape[-1]
    n = x.size // width  # positions
    if tokens <= 0 or n <= tokens:
        return call(x)
    bounds = tile_bounds(n, tokens)
    training = module.training
    trainable = tree_flatten(module.trainable_parameters())
    names, leaves = [k for k, _ in trainable], [v for _, v in trainable]
    keys = mx.stack([dropout.next_key() for _ in bounds]) if training else mx.zeros((len(bounds), 2), mx.uint32)
    keys = mx.stop_gradient(keys)

    def run_tile(xt, key):
        with dropout.scope(key if training else None):
            return call(xt)

    @mx.custom_function
    def f(flat, keys, *params):
        outs = [run_tile(flat[s:e][None], keys[i])[0] for i, (s, e) in enumerate(bounds)]
        return mx.concatenate(outs, axis=0)

    @f.vjp
    def f_vjp(primals, cotangent, _output):
        flat, keys, *params = primals
        held = module.trainable_parameters()

        def fn(xt, key, *p):
            module.update(tree_unflatten(list(zip(names, p, strict=True))))
            return run_tile(xt[None], mx.stop_gradient(key))[0]

        dxs, sums = [], None
        try:
            for i, (s, e) in enumerate(bounds):
                xt, dyt = flat[s:e], cotangent[s:e]
                if dxs:  # wait for the previous tile: one tile's recompute alive at a time
                    after = [dxs[-1], *sums]
                    xt, dyt = mx.depends(xt, after), mx.depends(dyt, after)
                _, (dx, _, *dp) = mx.vjp(fn, [xt, keys[i], *params], [dyt])
                dp = [d.astype(mx.float32) for d in dp]
                sums = dp if sums is None else [a + b for a, b in zip(sums, dp, strict=True)]
                dxs.append(dx)
        finally:
            module.update(held)
        grads = [g.astype(p.dtype) for g, p in zip(sums or [], params, strict=True)]
        return (mx.concatenate(dxs, axis=0), mx.zeros_like(keys), *grads)

    out = f(x.reshape(n, width), keys, *leaves)
    return out.reshape(*lead, out.shape[-1])


def tile_tokens_for(hidden_size: int, *, tiled: bool | None = None, tokens: int | None = None,
                    checkpointing: bool = False) -> int:
    """Positions per MLP tile, 0 for none: `tiled` (None: follows `checkpointing`, as the trainers' tiled_mlp
    follows gradient_checkpointing), `tokens` per tile (None: the hidden size, DeepSpeed ALST's rule: a tile's
    [tokens, intermediate] arrays are about the size of one MLP weight matrix)."""
    on = checkpointing if tiled is None else tiled
    return int(tokens or hidden_size) if on else 0
