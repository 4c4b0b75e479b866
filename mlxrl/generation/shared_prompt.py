"""Per-token log-probs of G completions per prompt with the prompt forwarded once per group.

    from mlxrl.generation.shared_prompt import shared_prompt_logprobs
    logps = shared_prompt_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                                   pixel_values=..., image_grid_thw=..., temperature=1.0)   # [P*G, C]

GRPO scores G completions of the same prompt. Forwarding each `prompt + completion` row costs
G*(P+C) tokens; here every decoder layer runs the prompt batch [P, Lp] once (images through the
vision tower once per prompt) and the completions [P*G, C] once: P + G*C tokens. In each layer the
prompt's keys/values, computed *with* gradient, are handed to the G completion rows of that prompt,
which attend to them (padding masked) plus their own keys causally. The gradient of every
completion token therefore flows back into the prompt's K/V, and through them into the prompt's
hidden states, the layers below, the embeddings and the vision tower: the shared forward gives
the same log-probs and the same parameter gradients as the repeated one (tested <= 1e-4, text
and VLM). The idea is TRL PR #2669's, whose no-grad prompt cache dropped that gradient.

Positions: prompts keep their own (text: cumsum of the mask; Qwen-VL: M-RoPE with images), and a
completion continues from its prompt's next position (real length + rope delta) on all axes.

The completion's first token is predicted by the prompt's last real token, whose hidden state is
shared by the G rows; the next C-1 by the completion's own hidden states. Log-probs come from the
streamed head `head_logprobs` with temperature: `[tokens, vocab]` logits are never built.

Compile-friendly: no `.item()`, no per-row Python loops, only array ops; under `mx.compile` pass
`vision_meta` (from `model.vision_metadata(grid)`) and `skip_ignored=False`.

The repeated forward (`repeated_logprobs`) is the reference and the "sharing off" baseline.
"""

from __future__ import annotations

import mlx.core as mx

from ..cpu import fastmath
from ..losses.head import head_logprobs
from ..models import checkpointing
from ..models.attention import AttentionMask, attention
from ..models.language import attention_mask_for
from ..models.vl import merge_image_features
from ..processing.tokens import IGNORE_INDEX
from .engine import continue_positions, is_vl, prompt_positions, repeat_prompts


class _Capture:
    """Stands in for a KV cache in the prompt's pass through a layer: keeps the layer's K/V. Its
    attention is causal over each prompt's real keys: the native FlashAttention kernel with the
    prompts' key windows (`bounds`) where it runs, else the attention with the padding mask.

    A recurrent layer (Qwen3.5's Gated DeltaNet) reads the prompts' padding (`prompt_mask`) here and hands
    over its convolution's inputs and the rule's final state (`keep_prompt_states`), both with their
    gradient: the convolution's last K - 1 real inputs of each prompt (left or right padded) are gathered."""

    keys = values = recurrent = None

    def __init__(self, bounds: mx.array, prompt_mask: mx.array):
        self.bounds, self.prompt_mask = bounds, prompt_mask

    def keep_prompt_states(self, conv_inputs: mx.array, final_state: mx.array, kernel: int) -> None:
        last = self.bounds[:, 1:2] - 1  # [P, 1]: each prompt's last real token
        at = last + mx.arange(-(kernel - 2), 1, dtype=mx.int32)[None]  # [P, K - 1]
        tail = mx.take_along_axis(conv_inputs, mx.maximum(at, 0)[..., None], axis=1)
        tail = mx.where((at >= 0)[..., None], tail, 0)  # a prompt shorter than K - 1: zeros before it
        self.recurrent = (tail, final_state)

    def attention(self, q, k, v, *, scale, mask=None):
        self.keys, self.values = k, v
        fast = fastmath.flash_attention(q, k, v, scale=scale, causal=True, bounds=self.bounds)
        if fast is not None:
            return fast[0]
        return attention(q, k, v, scale=scale, mask=mask)


class _SharedPrefix:
    """Stands in for a KV cache in the completions' pass: each completion row attends to its prompt's
    K/V (the prompt's real keys) and, causally, to its own.

    Where the native FlashAttention kernel runs, as two attentions merged by their log-sum-exps: the
    queries of a prompt's G completions (and of the heads sharing a kv head) stacked into one block
    against the prompt's keys [P, Hkv, Lp, D], windowed to its real keys (`bounds`), and each row
    against its own keys, causally; out = (o_p e^(lse_p) + o_c e^(lse_c)) / (e^(lse_p) + e^(lse_c)).
    Neither the prompt's K/V repeated G times nor the [P*G, Hq, C, Lp + C] scores exist, forward or
    backward. Elsewhere: the prompt's K/V repeated G times along the batch (prompt-major) and
    prepended to the row's own, under the mask."""

    def __init__(self, keys, values, group: int, bounds: mx.array, recurrent=None):
        self.keys, self.values, self.group, self.bounds = keys, values, group, bounds
        self.recurrent = recurrent

    def prompt_states(self):
        """A recurrent layer's start for each completion row: its prompt's conv inputs and final state."""
        return tuple(mx.repeat(s, self.group, axis=0) for s in self.recurrent)

    def _flash(self, q, k, v, scale):
        n, Hq, C, D = q.shape
        P, Hkv, Lp, _ = self.keys.shape
        G, rep = self.group, Hq // Hkv
        stacked = q.reshape(P, G, Hkv, rep, C, D).transpose(0, 2, 1, 3, 4, 5).reshape(P, Hq * G, C, D)
        prompt = fastmath.flash_attention(stacked, self.keys, self.values, scale=scale, bounds=self.bounds)
        own = fastmath.flash_attention(q, k, v, scale=scale, causal=True)
        if prompt is None or own is None:
            return None
        o_p = prompt[0].reshape(P, Hkv, G, rep, C, D).transpose(0, 2, 1, 3, 4, 5).reshape(n, Hq, C, D)
        lse_p = prompt[1].reshape(P, Hkv, G, rep, C).transpose(0, 2, 1, 3, 4).reshape(n, Hq, C)
        o_c, lse_c = own
        m = mx.maximum(lse_p, lse_c)  # finite: a row always sees its own first key
        w_p, w_c = mx.exp(lse_p - m)[..., None], mx.exp(lse_c - m)[..., None]
        return (o_p * w_p + o_c * w_c) / (w_p + w_c)

    def attention(self, q, k, v, *, scale, mask=None):
        fast = self._flash(q, k, v, scale)
        if fast is not None:
            return fast
        kp = mx.repeat(self.keys, self.group, axis=0)  # [P*G, H, Lp, D]
        vp = mx.repeat(self.values, self.group, axis=0)
        k, v = mx.concatenate([kp, k], axis=2), mx.concatenate([vp, v], axis=2)
        return attention(q, k, v, scale=scale, mask=mask)


def _embeddings(model, prompt_ids, completion_ids, pixel_values, image_grid_thw, vision_meta):
    """Token embeddings of the prompts [P, Lp, D] (image features merged in: the vision tower runs
    once per prompt batch) and of the completions [P*G, C, D], and Qwen3-VL's DeepStack (visual
    mask, per-layer features) or None. One lookup for both: each use of the embedding table costs
    a dense [V, D] gradient in backward."""
    lm = model.language_model
    n_prompt = prompt_ids.size
    flat = mx.concatenate([prompt_ids.reshape(-1), completion_ids.reshape(-1).astype(prompt_ids.dtype)])
    h = lm.embed_tokens(flat)
    hp, hc = h[:n_prompt].reshape(*prompt_ids.shape, -1), h[n_prompt:].reshape(*completion_ids.shape, -1)
    if pixel_values is None:
        return hp, hc, None
    if not is_vl(model):
        raise ValueError("a text-only model cannot take images")
    image_mask = prompt_ids == model.image_token_id
    feats, deep = model.image_features(pixel_values, image_grid_thw, vision_meta)
    hp = merge_image_features(hp, image_mask, feats)
    return hp, hc, ((image_mask, deep) if deep else None)


def _last_real(mask: mx.array) -> mx.array:
    """Index of each row's last real token ([B] int32), for left and right padding."""
    L = mask.shape[1]
    return (mask.astype(mx.int32) * mx.arange(1, L + 1, dtype=mx.int32)[None]).argmax(axis=1).astype(mx.int32)


def shared_prompt_hidden(
    model,
    prompt_ids: mx.array,
    prompt_mask: mx.array,
    completion_ids: mx.array,
    *,
    pixel_values: mx.array | None = None,
    image_grid_thw: mx.array | None = None,
    vision_meta: dict | None = None,
    router_aux: list | None = None,
    completion_mask: mx.array | None = None,
) -> mx.array:
    """Hidden states [P*G, C, D] (after the final norm) that predict each completion token:
    row r, column t predicts completion_ids[r, t] given prompt r // G and completion_ids[r, :t].

    prompt_ids / prompt_mask [P, Lp]: the prompts (left or right padded); completion_ids [P*G, C]
    (prompt-major; tokens after the end may be anything: causality keeps them from earlier tokens).
    router_aux: a list receiving an MoE model's load-balancing loss over the P*G rows prompt + completion as
    `repeated_hidden` would see them (each prompt token counted G times, completion tokens where
    completion_mask [P*G, C] is 1), the prompt's routing computed once (`moe.RouterStats`).
    """
    P, Lp = prompt_ids.shape
    n, C = completion_ids.shape
    if n % P:
        raise ValueError(f"{n} completion rows is not a multiple of {P} prompts")
    G = n // P
    lm = model.language_model
    prompt_mask = prompt_mask.astype(mx.int32)

    hp, hc, deepstack = _embeddings(model, prompt_ids, completion_ids, pixel_values, image_grid_thw, vision_meta)
    pos_p, next_pos = prompt_positions(model, prompt_ids, prompt_mask, image_grid_thw)
    pos_c = continue_positions(model, mx.repeat(next_pos, G, axis=0), C)
    cos_p, sin_p = lm.rotary_emb(pos_p)
    cos_c, sin_c = lm.rotary_emb(pos_c)

    mask_p = attention_mask_for(Lp, prompt_mask)  # causal & padding: [P, 1, Lp, Lp] as an array
    # a completion row sees its prompt's real keys, then its own causally: [P*G, 1, C, Lp+C] as an array
    see_prompt = mx.repeat(prompt_mask.astype(mx.bool_), G, axis=0)  # [P*G, Lp]
    mask_c = AttentionMask(C, Lp + C, mx.concatenate([see_prompt, mx.ones((n, C), mx.bool_)], axis=1))
    if deepstack is not None:
        vis_mask, feats = deepstack
        vis_idx = mx.maximum(mx.cumsum(vis_mask.reshape(-1).astype(mx.int32)) - 1, 0).reshape(vis_mask.shape)

    # each prompt's real keys [first, last + 1): the native kernel's windows (left or right padding)
    bounds = mx.stack([prompt_mask.argmax(axis=1).astype(mx.int32), _last_real(prompt_mask) + 1], axis=1)

    stats = getattr(lm, "router_stats", None) if router_aux is not None else None
    if stats is not None:  # the prompt's tokens stand for its G rows' copies
        w_p = (prompt_mask.astype(mx.float32) * G).reshape(-1, 1)
        w_c = (mx.ones((n, C), mx.float32) if completion_mask is None else completion_mask.astype(mx.float32))
        w_c = w_c.reshape(-1, 1)

    def run_layer(layer, hp, hc, *rest):
        cp, sp, cc, sc = rest[-4:] if stats is None else rest[2:6]
        cap = _Capture(bounds, prompt_mask)
        routing = [] if stats is not None else None
        kw = {} if routing is None else {"routing": routing}
        hp = layer(hp, cp, sp, mask_p, cap, **kw)  # the prompt once: P rows
        n_p = 0 if routing is None else len(routing)
        hc = layer(hc, cc, sc, mask_c, _SharedPrefix(cap.keys, cap.values, G, bounds, cap.recurrent), **kw)  # G rows
        if stats is None:
            return hp, hc
        tokens, probs = rest[0], rest[1]
        for i, one in enumerate(routing):
            t, p = stats.layer_sums(*one, rest[6] if i < n_p else rest[7])
            tokens, probs = tokens + t, probs + p
        return hp, hc, tokens, probs

    def add(carry, feat):  # Qwen3-VL's deepstack features: the prompt's visual positions
        return (carry[0] + mx.where(vis_mask[..., None], feat[vis_idx].astype(carry[0].dtype), 0), *carry[1:])

    feats = feats if deepstack is not None else ()
    if stats is None:
        hp, hc = checkpointing.run_layers(lm, run_layer, (hp, hc), (cos_p, sin_p, cos_c, sin_c), add, feats)
    else:
        zeros = mx.zeros((stats.num_experts,), mx.float32)
        hp, hc, tokens, probs = checkpointing.run_layers(lm, run_layer, (hp, hc, zeros, zeros),
                                                         (cos_p, sin_p, cos_c, sin_c, w_p, w_c), add, feats)
        router_aux.append(stats.loss(tokens, probs, (w_p.sum() + w_c.sum()) * stats.sparse_layers))

    # the prompt's last real token predicts the first completion token of each of its G rows
    last = mx.take_along_axis(hp, _last_real(prompt_mask)[:, None, None], axis=1)  # [P, 1, D]
    first = mx.repeat(lm.norm(last), G, axis=0)  # [P*G, 1, D]
    if C == 1:
        return first
    return mx.concatenate([first, lm.norm(hc[:, :-1])], axis=1)


def completion_logprobs(model, hidden, completion_ids, completion_mask, *, temperature=1.0, return_entropy=False,
                        chunk_size=None, skip_ignored=True):
    """The streamed head over `shared_prompt_hidden` / `repeated_hidden` states [n, C, D]: per-token
    log p(completion token) [n, C] (0 where completion_mask is 0), and the entropy with return_entropy."""
    n, C, D = hidden.shape
    valid = completion_mask.astype(mx.bool_)
    targets = mx.where(valid, completion_ids, IGNORE_INDEX).reshape(-1)
    out = head_logprobs(hidden.reshape(-1, D), model.lm_head_weight(), targets, temperature=temperature,
                        chunk_size=chunk_size, return_entropy=return_entropy, skip_ignored=skip_ignored)
    if not return_entropy:
        return mx.where(valid, out.reshape(n, C), 0.0)
    logp, ent = out
    return mx.where(valid, logp.reshape(n, C), 0.0), mx.where(valid, ent.reshape(n, C), 0.0)


def shared_prompt_logprobs(
    model,
    prompt_ids: mx.array,
    prompt_mask: mx.array,
    completion_ids: mx.array,
    completion_mask: mx.array,
    *,
    pixel_values: mx.array | None = None,
    image_grid_thw: mx.array | None = None,
    vision_meta: dict | None = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
    chunk_size: int | None = None,
    skip_ignored: bool = True,
):
    """Per-token log p(completion token) [P*G, C] (float32, 0 where completion_mask is 0), the
    prompt forwarded once per group; with return_entropy also the per-token entropy.

    prompt_ids / prompt_mask [P, Lp] (+ the prompts' pixel_values / image_grid_thw),
    completion_ids / completion_mask [P*G, C], prompt-major (rows r*G..r*G+G-1 belong to prompt r,
    as `generate` returns them). temperature: logits are divided by it (TRL's GRPO temperature).
    skip_ignored=False under mx.compile (the head then scores padded positions too).
    """
    hidden = shared_prompt_hidden(model, prompt_ids, prompt_mask, completion_ids, pixel_values=pixel_values,
                                  image_grid_thw=image_grid_thw, vision_meta=vision_meta)
    return completion_logprobs(model, hidden, completion_ids, completion_mask, temperature=temperature,
                               return_entropy=return_entropy, chunk_size=chunk_size, skip_ignored=skip_ignored)


def repeated_hidden(
    model,
    prompt_ids: mx.array,
    prompt_mask: mx.array,
    completion_ids: mx.array,
    completion_mask: mx.array,
    *,
    pixel_values: mx.array | None = None,
    image_grid_thw: mx.array | None = None,
    router_aux: list | None = None,
) -> mx.array:
    """`shared_prompt_hidden`'s hidden states [P*G, C, D] by forwarding each of the P*G rows
    `prompt + completion` separately (each prompt and its images repeated G times). Eager (images
    are regrouped in numpy). Right-padded prompts are left-aligned first, so that each row is its prompt's
    real tokens followed by its completion, as a recurrent layer must read them."""
    P, Lp = prompt_ids.shape
    n, C = completion_ids.shape
    G = n // P
    prompt_ids, prompt_mask = _left_aligned(prompt_ids, prompt_mask.astype(mx.int32))
    ids, mask, pv, grid = repeat_prompts(model, G, prompt_ids, prompt_mask.astype(mx.int32), pixel_values,
                                         image_grid_thw)
    ids = mx.concatenate([ids, completion_ids.astype(ids.dtype)], axis=1)
    mask = mx.concatenate([mask, completion_mask.astype(mx.int32)], axis=1)
    positions, _ = prompt_positions(model, ids, mask, grid)
    kwargs = dict(pixel_values=pv, image_grid_thw=grid) if pv is not None else {}
    if router_aux is not None:
        kwargs["router_aux"] = router_aux  # an MoE model's load-balancing loss over `mask`'s tokens
    h = model(ids, attention_mask=mask, position_ids=positions, return_hidden=True, **kwargs)  # [P*G, Lp+C, D]
    # token t of the completion is predicted at the prompt's last real token (t = 0) or at Lp + t - 1
    first = _last_real(mask[:, :Lp])[:, None]
    rest = mx.broadcast_to(Lp + mx.arange(C - 1, dtype=mx.int32)[None], (n, C - 1))
    return mx.take_along_axis(h, mx.concatenate([first, rest], axis=1)[..., None], axis=1)


def _left_aligned(ids: mx.array, mask: mx.array) -> tuple[mx.array, mx.array]:
    """Each row's real tokens moved to its right end, in order (left padding unchanged), by a stable sort on
    (real, position): array ops only, so it compiles."""
    L = ids.shape[1]
    order = mx.argsort(mask * L + mx.arange(L, dtype=mx.int32)[None], axis=1)
    return mx.take_along_axis(ids, order, axis=1), mx.take_along_axis(mask, order, axis=1)


def repeated_logprobs(
    model,
    prompt_ids: mx.array,
    prompt_mask: mx.array,
    completion_ids: mx.array,
    completion_mask: mx.array,
    *,
    pixel_values: mx.array | None = None,
    image_grid_thw: mx.array | None = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
    chunk_size: int | None = None,
    skip_ignored: bool = True,
):
    """The same log-probs as `shared_prompt_logprobs` by forwarding each of the P*G rows
    `prompt + completion` separately (`repeated_hidden`): the reference, and the baseline with
    prompt sharing off."""
    hidden = repeated_hidden(model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                             pixel_values=pixel_values, image_grid_thw=image_grid_thw)
    return completion_logprobs(model, hidden, completion_ids, completion_mask, temperature=temperature,
                               return_entropy=return_entropy, chunk_size=chunk_size, skip_ignored=skip_ignored)
