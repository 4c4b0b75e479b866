"""The fused LM head: the head and a token-separable loss with its gradients in one pass over row tiles.

Both tile the VOCABULARY, so the gradient needs each tile's logits again: 4 [N, D] x [D, V]
matmuls against the naive head's 3. When the loss is token-separable (its gradient w.r.t. each
logp depends on that token only: SFT nll / dft with a global normaliser, GRPO's token-level
surrogates), the fused path tiles the ROWS instead: a chunk of rows x the full vocabulary has its
exact logsumexp at once, so loss, logp, entropy, argmax, d_hidden and d_weight come out of one pass
with 3 matmuls per chunk and a single exp over the tile:

* `fused_head_loss(...)`: differentiable (`mx.custom_function` whose forward also produces the
  gradients and whose VJP scales them by the loss's cotangent); chunks chained with `mx.depends`.
* `fused_head_grads(...)` / `fused_value_and_grad(...)`: the eager twin (an `mx.eval` per chunk)
  and the two-phase step built on it.

On float32 CPU arrays with nll / dft, both run the whole chunk loop as ONE native kernel
(`mlxrl.cpu.native`'s fused head: one tile buffer reused for every chunk, d_weight accumulated in place
by the BLAS; a frozen head, LoRA's, in one pass over vocabulary blocks with an online softmax, each
block of the weight read, and widened when bfloat16, once for both of its products). The MLX graph
cannot do that: the `mx.depends` that orders its chunks keeps each old d_weight alive, so every chunk
allocated a new one. The graph path therefore returns each row's logsumexp and d loss / d logp from
its row pass and builds d_weight one vocab tile at a time in the VJP (one more matmul for a trained
head; docs/platforms.md, has the figures). Callable token losses
(GRPO's) keep the graph.
"""

from __future__ import annotations

import mlx.core as mx

from ..cpu import fastmath
from ..processing.tokens import IGNORE_INDEX
from .head import head_logprobs
from .tiles import default_chunk_size, exp_shift, row_bounds, scored_rows, two_phase, weight_tile

ROW_TILE_BYTES = 160 << 20  # default budget for the native fused head's one reused [rows, vocab] tile
# The graph's row chunks are smaller: MLX allocates a kernel's output when it dispatches it, ahead of
# execution, so about five [rows, vocab] tiles (two chunks' z and ez, and the next chunk's z) are live.
GRAPH_ROW_TILE_BYTES = 48 << 20


def default_chunk_rows(vocab_size: int, tile_bytes: int = ROW_TILE_BYTES) -> int:
    """Rows per chunk so that one float32 [rows, vocab] tile stays within `tile_bytes`."""
    return int(max(8, tile_bytes // (4 * max(vocab_size, 1)) // 8 * 8))


NATIVE_VOCAB_BLOCK = 2048  # vocab rows per block of the native frozen head's pass (`kWidenRows`)


def native_peak_bytes(rows: int, vocab: int, width: int, weight_grad: bool) -> float:
    """Memory model of the native fused head (the planner's). A trained head: the [V, D] float32 weight
    gradient, one reused [chunk rows, V] tile and the chunk's scaled rows; a frozen one: its [rows, block]
    tile, as many rows as the [chunk rows, V] budget holds, and one widened [block, D] block of the weight;
    both: d_hidden and the rows' own arrays."""
    chunk_rows = min(rows, default_chunk_rows(vocab))
    if weight_grad:
        return 4 * vocab * width + 4 * chunk_rows * (vocab + width) + 8 * rows * width
    block = min(vocab, NATIVE_VOCAB_BLOCK)
    tile_rows = min(rows, max(1, default_chunk_rows(vocab) * vocab // block))
    return 4 * block * (tile_rows + width) + 8 * rows * width


def graph_peak_bytes(rows: int, vocab: int, width: int, elem: int, weight_grad: bool, tied: bool) -> float:
    """Memory model of the graph path's fused head (the planner's; measured on MLX 0.32): the row
    chunks' z and ez, about five [rows, V] float32 tiles live once chunks follow each other (MLX
    allocates at dispatch, ahead of execution); a trained head's d_weight comes from vocab tiles in the
    VJP: its pieces (one [V, D] in the weight's dtype, twice when tied to the embedding, whose gather's
    scatter comes next to it) beside their concatenation (the gradient, counted by the caller); a
    bf16 weight is cast to float32 once for the forward. `elem`: bytes per weight element."""
    rows_g = min(rows, default_chunk_rows(vocab, GRAPH_ROW_TILE_BYTES))
    chunks = -(-rows // rows_g)
    forward = min(2 + 1.5 * (chunks - 1), 5) * 4 * rows_g * vocab
    if not weight_grad:
        return forward
    tile = 4 * rows * min(default_chunk_size(rows, vocab, width=width), vocab)
    pieces = vocab * width * elem * (2 if tied else 1)
    return max(forward + (4 * vocab * width if elem != 4 else 0), pieces + 2 * tile)


def _nll_grad(logp, w):
    return -(w * logp), -w


def _dft_grad(logp, w):
    p = mx.exp(logp)  # the token's own (detached) prob: a constant weight in the gradient
    return -(w * p * logp), -(w * p)


_TOKEN_LOSSES = {"nll": _nll_grad, "dft": _dft_grad}


def _callable_grad(token_loss):
    def f(logp, w, *args):
        # weight-0 rows (padding scored under mx.compile) are evaluated at logp 0: a real but very
        # unlikely logp there can overflow the loss (GRPO's exp(ref - logp)), and 0 * inf is NaN
        safe = mx.where(w != 0, logp, 0.0)
        losses, vjp = mx.vjp(lambda lp: token_loss(lp, *args), [safe], [w])
        return w * losses[0], vjp[0]

    return f


def _fused_chunk(h, weight, t, inv_t, w, args, grad_fn, with_entropy, dw):
    """Loss, logp, entropy, argmax, d_hidden of one row chunk, and d_weight accumulated into `dw`
    when one is given (the eager path); also each row's logsumexp and g = d loss / d logp.

    z = h W^T / T [Nc, V] holds the chunk's exact logsumexp, so the loss's gradient w.r.t. each
    logp is known here and dz = g (onehot - p) never needs the logits again:
        ez = exp(z - max),  s = sum ez,  a = -g / s,  dz = a (ez - s onehot)
        dh = (a / T) (ez W - s W[t]),  dW += ez^T (a h / T) - scatter(t, s a h / T)
    (the row scale a is folded into the [Nc, D] operands and the one-hot term is a gather of W's
    target rows: two [Nc, V] tiles, z and ez, are the chunk's whole tile memory)."""
    hs = h.astype(mx.float32) * inv_t if inv_t != 1.0 else h.astype(mx.float32)
    z = hs @ weight.T  # [Nc, V] (weight: float32, cast once by the caller)
    arg = mx.argmax(z, -1).astype(mx.int32)
    m = mx.take_along_axis(z, arg[:, None], -1)  # [Nc, 1]
    zt = mx.take_along_axis(z, t[:, None], -1)[:, 0]
    ez = exp_shift(z, m)
    s = ez @ mx.ones((z.shape[1],), mx.float32)  # row sums as a gemv (multi-threaded BLAS, one read)
    lse = m[:, 0] + mx.log(s)
    logp = zt - lse
    if with_entropy:  # H = lse - sum(ez z) / s, the row dot as a batched gemv
        ent = lse - (ez[:, None, :] @ z[:, :, None])[:, 0, 0] / s
    else:
        ent = mx.zeros_like(lse)
    loss, g = grad_fn(logp, w, *args)
    a = -g / s
    dh = (a * inv_t)[:, None] * (ez @ weight - s[:, None] * weight[t])
    if dw is not None:
        ahs = a[:, None] * hs
        dw = mx.addmm(dw, ez.T, ahs).at[t].add(-s[:, None] * ahs)
    return loss.sum(), logp, ent, arg, dh, dw, lse, g


_NATIVE_MODES = {_nll_grad: 0, _dft_grad: 1}  # the token losses mlxrl's native fused head computes


def _native_kernels(hidden, weight, grad_fn, weight_grad):
    """The native module when its fused head runs this call, else None: nll / dft over float32 CPU rows, with
    a float32 weight or a frozen bfloat16 one (`models.widened`: widened a block of rows at a time inside)."""
    kernels = fastmath.kernels_for(hidden)
    if grad_fn not in _NATIVE_MODES or kernels is None or not hasattr(kernels, "fused_head"):
        return None
    return kernels if weight.dtype == mx.float32 or (weight.dtype == mx.bfloat16 and not weight_grad) else None


def _fused_native(hidden, weight, targets, w, grad_fn, inv_t, chunk_rows, with_entropy, weight_grad):
    """The whole row-chunk loop as one native CPU kernel (`_native_kernels`), or None: one tile buffer for
    every chunk and d_weight accumulated in place (3 matmuls, one [V, D] gradient)."""
    kernels = _native_kernels(hidden, weight, grad_fn, weight_grad)
    if kernels is None:
        return None
    loss, logp, ent, arg, dh, dw = kernels.fused_head(
        hidden, weight, targets, w.astype(mx.float32), float(inv_t), _NATIVE_MODES[grad_fn],
        int(chunk_rows or default_chunk_rows(weight.shape[0])), bool(with_entropy), bool(weight_grad))
    return loss, logp, ent, arg, dh, dw if weight_grad else mx.zeros_like(weight)


def _fused_run(hidden, weight, targets, w, args, grad_fn, inv_t, chunk_rows, with_entropy, weight_grad, eager):
    """All row chunks. Returns (loss, logp, entropy, argmax, d_hidden, d_weight, lse, g).

    eager (an mx.eval per chunk): d_weight is accumulated chunk by chunk with `addmm` into one buffer
    (each evaluated chunk leaves it the sole owner, so MLX donates it to the next addmm).
    lazy (one graph, chunks chained with mx.depends): d_weight is NOT computed here (None); the
    caller gets each row's logsumexp and d loss / d logp `g` and builds it with
    `_vocab_weight_grad`. Inside one graph MLX cannot accumulate in place: it checks donation when a
    kernel is dispatched, and the node that orders chunk k+1 after chunk k's addmm still holds the
    accumulator then (dispatch runs ahead of execution), so every chunk allocated a new [V, D]."""
    native = None if args else _fused_native(hidden, weight, targets, w, grad_fn, inv_t, chunk_rows, with_entropy,
                                             weight_grad)
    if native is not None:
        if eager:
            mx.eval(*native)
        return (*native, None, None)
    n, v = hidden.shape[0], weight.shape[0]
    w32 = weight.astype(mx.float32)  # once per call, not twice per row chunk (each cast: a [V, D] f32 copy)
    dw = mx.zeros(weight.shape, mx.float32) if weight_grad and eager else None
    loss = mx.zeros((), mx.float32)
    outs = []
    for s, e in row_bounds(n, chunk_rows or default_chunk_rows(v, GRAPH_ROW_TILE_BYTES)):
        h = hidden[s:e]
        if not eager and outs:
            # the next chunk waits for ALL of the previous one's outputs, so its tiles die first
            h = mx.depends(h, [loss, *outs[-1]])
        c_loss, logp, ent, arg, dh, dw, lse, g = _fused_chunk(h, w32, targets[s:e], inv_t, w[s:e],
                                                              [a[s:e] for a in args], grad_fn, with_entropy, dw)
        loss = loss + c_loss
        outs.append((logp, ent, arg, dh, lse, g))
        if eager:
            mx.eval(loss, outs[-1], dw if dw is not None else [])
    logp, ent, arg, dh, lse, g = (mx.concatenate(x) for x in zip(*outs, strict=True))
    if dw is not None:
        dw = dw.astype(weight.dtype)
    elif eager:
        dw = mx.zeros_like(weight)
    return loss, logp, ent, arg, dh.astype(hidden.dtype), dw, lse, g


def _vocab_weight_grad(hidden, weight, targets, lse, g, inv_t, chunk=None):
    """d_weight [V, D] (in the weight's dtype) of sum_i g_i logp_i, one vocab tile at a time:

        dW[s:e] = (g (onehot(t) - exp(z - lse)))^T (h / T),    z = (h / T) W[s:e]^T    (float32)

    Each tile's rows of d_weight are written once, so nothing is accumulated: the pieces (one [V, D]
    in all) and their concatenation are the whole weight-gradient memory, flat in N, whatever the
    weight's dtype. The tiles are chained with mx.depends (each waits for the previous piece) so
    one [N, chunk] tile and one float32 slice of the weight are live at a time. The price: the
    logits are computed a second time (4 matmuls for the head instead of 3)."""
    n, v = hidden.shape[0], weight.shape[0]
    hs = hidden.astype(mx.float32)
    hs = hs * inv_t if inv_t != 1.0 else hs
    pieces = []
    for s, e in row_bounds(v, chunk or default_chunk_size(n, v, width=hidden.shape[1])):
        z = mx.depends(hs, pieces[-1:]) @ weight_tile(weight, s, e, pieces[-1:]).T  # [N, C]
        dz = _dz_nll(z, lse, g, targets, mx.arange(s, e, dtype=mx.int32))
        pieces.append((dz.T @ hs).astype(weight.dtype))
    return mx.concatenate(pieces) if len(pieces) > 1 else pieces[0]


@mx.compile
def _dz_nll(z, lse, g, t, cols):
    """g (onehot(t) - p) over a [N, C] logit tile, p = exp(z - lse), in one fused pass."""
    return g[:, None] * ((cols[None, :] == t[:, None]).astype(mx.float32) - mx.exp(z - lse[:, None]))


def _fused_setup(hidden, targets, loss_type, num_items, token_weights, token_args, skip_ignored):
    """Rows to score, their targets, per-token weights (mask / num_items by default) and args."""
    if loss_type in _TOKEN_LOSSES:
        grad_fn = _TOKEN_LOSSES[loss_type]
    elif callable(loss_type):
        grad_fn = _callable_grad(loss_type)
    else:
        raise ValueError(f"unknown loss_type {loss_type!r}: use 'nll', 'dft' or a per-token callable")
    mask = (targets != IGNORE_INDEX).astype(mx.float32)
    if token_weights is None:
        n = mask.sum() if num_items is None else mx.array(num_items, dtype=mx.float32)
        w = mask / mx.maximum(n.astype(mx.float32), 1.0)
    else:
        w = token_weights.astype(mx.float32) * mask
    rows = scored_rows(targets) if skip_ignored else None
    t = mx.maximum(targets, 0).astype(mx.int32)
    args = list(token_args)
    if rows is not None:
        r = mx.array(rows, dtype=mx.int32)
        hidden, t, w, args = hidden[r], t[r], w[r], [a[r] for a in args]
    return rows, hidden, t, w, args, grad_fn


def _scatter_rows(n, rows, logp, ent, arg, dh):
    if rows is None:
        return logp, ent, arg, dh
    r = mx.array(rows, dtype=mx.int32)
    full = [mx.zeros((n,), mx.float32).at[r].add(logp), mx.zeros((n,), mx.float32).at[r].add(ent),
            mx.full((n,), -1, mx.int32).at[r].add(arg + 1)]
    return (*full, None if dh is None else mx.zeros((n, dh.shape[1]), dh.dtype).at[r].add(dh))


def _make_fused(grad_fn, inv_t, chunk_rows, with_entropy, weight_grad, n_args, chunk_size=None):
    @mx.custom_function
    def fn(hidden, weight, targets, w, *args):
        loss, logp, ent, arg, dh, dw, lse, g = _fused_run(hidden, weight, targets, w, args, grad_fn, inv_t,
                                                          chunk_rows, with_entropy, weight_grad, eager=False)
        if dw is not None:  # the native kernel: d_weight made in the forward, in place
            tail = (dw if weight_grad else mx.zeros((), weight.dtype), mx.zeros((), mx.float32))
        else:  # the graph: the VJP builds d_weight from each row's lse and g (and scales g, not a [V, D])
            tail = (lse, g)
        # a frozen head's zero gradient is made in the VJP, not kept as an output (outputs are evaluated)
        return loss, logp, ent, arg, dh, *tail

    @fn.vjp
    def fn_vjp(primals, cotangents, outputs):
        hidden, weight, targets, w, *args = primals
        c = cotangents[0]  # only the loss is differentiable; logp / entropy / argmax are metrics
        dh = outputs[4]
        # gradients in their primal's dtype (a float32 `c` would promote a bf16 weight's gradient)
        dh = dh * c.astype(dh.dtype)
        if not weight_grad:
            dw = mx.zeros_like(weight)
        elif outputs[5].shape == weight.shape:
            dw = outputs[5] * c.astype(weight.dtype)
        else:
            dw = _vocab_weight_grad(hidden, weight, targets, outputs[5], outputs[6] * c.astype(mx.float32), inv_t,
                                    chunk_size)
        return (dh, dw, mx.zeros_like(targets), mx.zeros_like(w),
                *(mx.zeros_like(a) for a in args))

    return fn


def _frozen_low_precision(hidden, weight, targets, w, args, grad_fn, temperature, with_entropy, chunk_size):
    """A frozen bf16 head: the vocab-tiled `head_logprobs` (each tile casts only its [C, D] slice of
    the weight to float32) and the token loss on its log-probs, whose gradient w.r.t. each logp is
    the same g as the fused pass's. The row-chunked pass needs the whole weight in float32 (a [V, D]
    float32 copy, twice the bf16 weight) to compute float32 logits; this costs one more matmul
    (3 instead of 2) and holds only tiles. Loss = sum l_i with d loss / d logp_i = g_i."""
    out = head_logprobs(hidden, weight, targets, temperature=temperature, return_entropy=with_entropy,
                        return_argmax=True, skip_ignored=False, weight_grad=False, chunk_size=chunk_size)
    logp, arg = out[0], out[-1]
    ent = out[1] if with_entropy else mx.zeros_like(logp)
    lp = mx.stop_gradient(logp)
    token_loss, g = grad_fn(lp, w, *args)
    loss = mx.stop_gradient((token_loss - g * lp).sum()) + (mx.stop_gradient(g) * logp).sum()
    return loss, lp, ent, arg


def fused_head_loss(
    hidden: mx.array,
    weight: mx.array,
    targets: mx.array,
    *,
    loss_type="nll",
    num_items=None,
    token_weights: mx.array | None = None,
    token_args=(),
    temperature: float = 1.0,
    chunk_rows: int | None = None,
    with_entropy: bool = True,
    skip_ignored: bool = True,
    weight_grad: bool = True,
    chunk_size: int | None = None,
):
    """The LM head and a token-separable loss in ONE streamed pass over row chunks, differentiable
    w.r.t. hidden and weight (`mx.custom_function`: the forward also produces the gradients, the
    VJP scales them by the loss's cotangent). 3 matmuls per chunk, as many as the naive head.

        loss = sum_i w_i l_i(logp_i),  w_i = mask_i / num_items (default) or token_weights_i * mask_i

    loss_type: "nll" (l = -logp), "dft" (l = -sg(p) logp, TRL's DFT), or a callable
    `l(logp [Nc], *args) -> [Nc]` that is elementwise in logp (GRPO's token-level losses), with
    `token_args` [N, ...] arrays sliced to the chunk's rows. The gradient w.r.t. each logp must
    depend on that token only, known once its row's logsumexp is: that is what lets one pass do it.
    num_items: trained tokens in the whole accumulated batch (TRL's normaliser; default this batch's).
    Returns (loss, logp [N], entropy [N], argmax [N]); only the loss carries a gradient (the others
    are metrics: ignored rows get 0 / 0 / -1). skip_ignored / weight_grad as in `head_logprobs`.
    chunk_rows: rows per chunk of the row pass; chunk_size: vocab columns per tile of the graph
    path's vocab passes (the trainable weight's gradient, a frozen bf16 head); defaults bound each
    float32 tile (`GRAPH_ROW_TILE_BYTES`, `TILE_BYTES`).
    """
    n = hidden.shape[0]
    rows, h, t, w, args, grad_fn = _fused_setup(hidden, targets, loss_type, num_items, token_weights, token_args,
                                                skip_ignored)
    if h.shape[0] == 0:
        z = mx.zeros((n,), mx.float32)
        return (hidden * 0).sum() + (weight * 0).sum(), z, z, mx.full((n,), -1, mx.int32)
    # a frozen bf16 head (a bf16 model's, or one kept under float32 compute: `models.widened`) takes the
    # vocab-tiled head, unless the native kernel runs it (it widens the weight a block at a time)
    native = not args and _native_kernels(h, weight, grad_fn, weight_grad) is not None
    if not weight_grad and weight.dtype != mx.float32 and not native:
        loss, logp, ent, arg = _frozen_low_precision(h, weight, t, w, args, grad_fn, temperature, with_entropy,
                                                     chunk_size)
    else:
        fn = _make_fused(grad_fn, 1.0 / temperature, chunk_rows, with_entropy, weight_grad, len(args), chunk_size)
        loss, logp, ent, arg, *_ = fn(h, weight, t, w, *args)
    logp, ent, arg, _ = _scatter_rows(n, rows, logp, ent, arg, None)
    if rows is None and not skip_ignored:
        keep = targets != IGNORE_INDEX
        logp, ent, arg = mx.where(keep, logp, 0), mx.where(keep, ent, 0), mx.where(keep, arg, -1)
    return loss, logp, ent, arg


def fused_head_grads(hidden, weight, targets, *, loss_type="nll", num_items=None, token_weights=None, token_args=(),
                     temperature=1.0, chunk_rows=None, with_entropy=True, weight_grad=True):
    """Eager twin of `fused_head_loss` for a two-phase step: an `mx.eval` per row chunk, no graph
    kept. Returns (loss, (logp, entropy, argmax), d_hidden [N, D], d_weight [V, D])."""
    n = hidden.shape[0]
    rows, h, t, w, args, grad_fn = _fused_setup(hidden, targets, loss_type, num_items, token_weights, token_args,
                                                True)
    if h.shape[0] == 0:
        z = mx.zeros((n,), mx.float32)
        return mx.zeros((), mx.float32), (z, z, mx.full((n,), -1, mx.int32)), mx.zeros_like(hidden), \
            mx.zeros_like(weight)
    loss, logp, ent, arg, dh, dw, _, _ = _fused_run(h, weight, t, w, args, grad_fn, 1.0 / temperature, chunk_rows,
                                                    with_entropy, weight_grad, eager=True)
    logp, ent, arg, dh = _scatter_rows(n, rows, logp, ent, arg, dh)
    mx.eval(loss, logp, ent, arg, dh)
    return loss, (logp, ent, arg), dh, dw


def fused_value_and_grad(trunk, params, targets, *, head_weight, loss_type="nll", num_items=None, token_weights=None,
                         token_args=(), temperature=1.0, chunk_rows=None, with_entropy=True, weight_grad=True):
    """The two-phase step with the fused head: trunk forward -> `fused_head_grads` (loss, metrics,
    d_hidden, d_weight in one eager pass) -> one `mx.vjp` of trunk and head weight. Like
    `streamed_value_and_grad`, but the loss is token-separable (see `fused_head_loss`) and the head
    costs 3 matmuls instead of 4 (2 with weight_grad=False, for a frozen head).
    Returns (loss, grads, (logp, entropy, argmax))."""
    def head(hidden, weight):
        loss, metrics, d_hidden, d_weight = fused_head_grads(
            hidden, weight, targets, loss_type=loss_type, num_items=num_items, token_weights=token_weights,
            token_args=token_args, temperature=temperature, chunk_rows=chunk_rows, with_entropy=with_entropy,
            weight_grad=weight_grad)
        return (loss, metrics), d_hidden, d_weight

    (loss, metrics), grads = two_phase(trunk, head_weight, params, head)
    return loss, grads, metrics
