"""Batched sampling with a KV cache for mlxrl's Qwen / Qwen-VL models, each prompt prefilled once.

    from mlxrl.generation.engine import generate
    batch = processor(text=prompts, images=images, padding_side="left")
    out = generate(model, **batch, num_generations=8, max_tokens=128, temperature=1.0, top_p=0.95, seed=0)
    out.completion_ids, out.completion_mask, out.logps, out.finished, out.truncated   # [P*G, T] / [P*G]

How it runs:

* **prefill once per prompt.** The P prompts (and their images: the vision tower runs once per
  prompt) go through the model once, filling mlx-lm `KVCache`s of batch P. Decoding runs P*G rows
  (prompt-major: prompt 0's G samples, then prompt 1's) over a `SharedPrefixCache` per layer, which
  keeps the prompt's keys / values once and the samples' own tokens in a `KVCache` of batch P*G: the
  prompt is forwarded P times, not P*G, and its cache is held and read once, not G times.
* **positions.** Prompts may be left- or right-padded (right padding is moved to the left first).
  Text models get positions `cumsum(mask) - 1`; Qwen-VL models get M-RoPE positions from
  `mrope_positions`, and the next token of each row sits at its max position + 1 (the real length
  plus the row's rope delta), on all three axes. Padding keys are masked out at every step.
* **sampling** follows transformers' order: logits / temperature -> top_k -> top_p -> min_p, then a
  categorical draw by inverse CDF (`temperature=0`: argmax). The filters are transformers' warpers
  (checked against them), applied to the *tempered* distribution (mlx-lm's own `make_sampler` filters
  before the temperature, which is not what transformers / vLLM / TRL do), on its unnormalised
  weights: one exp per logit and ~5 live [B, V] arrays (mlx-lm's `apply_top_k` / `apply_top_p` on
  log-probs held ~14 at B=64, V=151936).
* **stopping.** A row finishes at its first stop token (kept in the completion and in the mask, like
  TRL's completion mask); afterwards it emits `pad_token_id` with mask 0. The loop ends when every
  row has finished or after `max_tokens` tokens (those rows are `truncated`).
* **reproducible.** Draws use keys split from `mx.random.key(seed)`, one per step, independent of
  the global random state and of when the loop stops.

Log-probs returned (both float32 [P*G, T], 0 on padding):

* `logps`: log softmax(logits / temperature) of the chosen token, *unfiltered*: what
  `head_logprobs(..., temperature=temperature)` gives for the same weights in a training forward.
  TRL computes `old_per_token_logps` with such a forward, right after generation and only when
  generation and optimisation steps are misaligned (num_iterations > 1 or steps_per_generation >
  gradient_accumulation_steps); otherwise it uses the detached current log-probs. These are equal
  to that forward up to float error, so a trainer may use them instead of the extra forward.
* `sampling_logps`: log-prob under the distribution actually sampled from (tempered, filtered by
  top_k / top_p / min_p, renormalised), i.e. vLLM's `processed_logprobs`. TRL uses those only for
  the vLLM importance-sampling correction (`sampling_per_token_logps`), never as old log-probs.
  Without filters they equal `logps`.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..cpu import fastmath
from ..models.attention import dense
from ..models.vl import QwenVLBase, mrope_positions

IM_END, END_OF_TEXT = 151645, 151643
DEFAULT_STOP_TOKEN_IDS = (IM_END, END_OF_TEXT)  # Qwen chat turns end with <|im_end|>


def is_vl(model) -> bool:
    return isinstance(model, QwenVLBase)


# ------------------------------------------------------------------------------------ positions
def prompt_positions(model, input_ids: mx.array, attention_mask: mx.array, image_grid_thw=None):
    """Positions of a padded prompt batch and the position of each row's next token.

    Returns (positions, next_position): [B, L] (text) or [3, B, L] (Qwen-VL M-RoPE), and [B] int32.
    Padding (mask 0) gets position 0 and does not advance, for left and right padding alike.
    """
    mask = attention_mask.astype(mx.int32)
    if is_vl(model):
        grid = None if image_grid_thw is None else mx.array(image_grid_thw)
        pos, deltas = mrope_positions(input_ids, grid, mask, model.image_token_id, model.merge_size)
        return pos, mask.sum(axis=1) + deltas
    pos = mx.where(mask > 0, mx.cumsum(mask, axis=1) - 1, 0)
    return pos, mask.sum(axis=1)


def continue_positions(model, next_position: mx.array, length: int) -> mx.array:
    """Positions of `length` text tokens that follow a prompt: next_position + 0..length-1 per row
    ([B, L], or the same on all three M-RoPE axes [3, B, L])."""
    pos = next_position[:, None].astype(mx.int32) + mx.arange(length, dtype=mx.int32)[None]
    return mx.broadcast_to(pos[None], (3, *pos.shape)) if is_vl(model) else pos


def left_align(input_ids: mx.array, attention_mask: mx.array, pad_token_id: int):
    """Move each row's real tokens to the right end (left padding); a no-op for left-padded input."""
    mask = np.asarray(attention_mask).astype(bool)
    if mask[:, -1].all():
        return input_ids, attention_mask
    ids = np.asarray(input_ids)
    out_ids = np.full_like(ids, pad_token_id)
    out_mask = np.zeros_like(mask)
    for i in range(ids.shape[0]):
        row = ids[i][mask[i]]
        if len(row):
            out_ids[i, -len(row):], out_mask[i, -len(row):] = row, True
    return mx.array(out_ids), mx.array(out_mask.astype(np.int32))


def images_per_row(input_ids, image_grid_thw, image_token_id: int, merge_size: int) -> np.ndarray:
    """How many images (of `image_grid_thw`, in order) each row of `input_ids` holds."""
    grid = np.asarray(image_grid_thw).astype(np.int64)
    tokens = grid.prod(axis=1) // merge_size**2
    per_row = (np.asarray(input_ids) == image_token_id).sum(axis=1)
    ends = np.cumsum(tokens)
    row_ends = np.cumsum(per_row)
    # image k belongs to the first row whose cumulative token count reaches the image's end
    owner = np.searchsorted(row_ends, ends, side="left")
    return np.bincount(owner, minlength=len(per_row))


def repeat_prompts(model, num_generations: int, input_ids, attention_mask, pixel_values=None,
                   image_grid_thw=None):
    """Each prompt row (and its images, in `pixel_values` order) repeated G times, prompt-major:
    what forwarding every sample separately needs. Eager (numpy index arithmetic on the grid)."""
    G = num_generations
    ids, mask = mx.repeat(input_ids, G, axis=0), mx.repeat(attention_mask, G, axis=0)
    if pixel_values is None:
        return ids, mask, None, None
    grid = np.asarray(image_grid_thw).astype(np.int64)
    counts = images_per_row(input_ids, grid, model.image_token_id, model.merge_size)
    first = np.concatenate([[0], np.cumsum(counts)])
    order = np.concatenate([np.tile(np.arange(first[p], first[p + 1]), G) for p in range(len(counts))])
    patches = grid.prod(axis=1)
    start = np.concatenate([[0], np.cumsum(patches)])
    rows = np.concatenate([np.arange(start[k], start[k + 1]) for k in order])
    return ids, mask, pixel_values[mx.array(rows)], mx.array(grid[order])


# ------------------------------------------------------------------------------------- sampling
TOP_P_CANDIDATES = 1024


def _top_p_weights(w: mx.array, top_p: float, candidates: int = TOP_P_CANDIDATES) -> mx.array:
    """transformers' top_p on unnormalised weights w [B, V]: keep a token while the mass strictly above
    it is < top_p of the row's total (so the smallest set reaching top_p; ties with its last token
    kept), 0 elsewhere. Sorts only the top `candidates` of each row when the nucleus lies inside them
    (MLX's CPU sort of a whole vocabulary row is much slower than `topk`); the whole row otherwise."""
    V = w.shape[-1]
    k = min(candidates, V)
    top = mx.sort(mx.topk(w, k, axis=-1), axis=-1) if k < V else mx.sort(w, axis=-1)  # [B, k] ascending
    above = mx.cumsum(top, axis=-1, reverse=True, inclusive=False)
    dropped = (above >= top_p * w.sum(axis=-1, keepdims=True)).sum(axis=-1, keepdims=True)
    if k < V and not (dropped >= 1).all().item():  # the nucleus reaches past the candidates
        return _top_p_weights(w, top_p, V)
    return mx.where(w < mx.take_along_axis(top, dropped, axis=-1), 0.0, w)


def filtered_weights(logits: mx.array, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                     min_p: float = 0.0):
    """(z, zmax, e, w) for logits [B, V]: z = logits / temperature (float32), zmax its row max,
    e = exp(z - zmax) (the tempered distribution, unnormalised) and w = e with filtered tokens set to 0,
    in transformers' order: top_k (below the k-th largest z; ties kept), top_p (of what top_k left),
    min_p (p < min_p * p_max, i.e. w < min_p: the top token has w = 1 and is never filtered).
    Working on weights instead of log-probs keeps ~5 [B, V] arrays alive instead of ~14 (measured at
    B=64, V=151936) and needs one exp per element."""
    if not 0.0 < top_p <= 1.0 or not 0.0 <= min_p <= 1.0 or top_k < 0:
        raise ValueError(f"sampling filters out of range: top_k={top_k} (>= 0), top_p={top_p} (in (0, 1]), "
                         f"min_p={min_p} (in [0, 1])")
    z = logits.astype(mx.float32)
    if temperature != 1.0:
        z = z * (1.0 / temperature)
    zmax = z.max(axis=-1, keepdims=True)
    e = w = fastmath.exp_shift(z, zmax)
    if 0 < top_k < z.shape[-1]:
        w = mx.where(z < mx.topk(z, int(top_k), axis=-1).min(axis=-1, keepdims=True), 0.0, w)
    if 0 < top_p < 1.0:
        w = _top_p_weights(w, float(top_p))
    if min_p > 0.0:
        w = mx.where(w < min_p, 0.0, w)
    return z, zmax, e, w


def filter_logprobs(logits: mx.array, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                    min_p: float = 0.0) -> tuple[mx.array, mx.array]:
    """(sampling log-probs, tempered log-probs), float32 [B, V]: tempered = log softmax(logits /
    temperature); sampling = tempered filtered by top_k, top_p, min_p (filtered tokens -inf) and
    renormalised (vLLM's processed log-probs). From `filtered_weights`."""
    z, zmax, e, w = filtered_weights(logits, temperature, top_k, top_p, min_p)
    tempered = z - zmax - mx.log(e.sum(axis=-1, keepdims=True))
    return mx.log(w) - mx.log(w.sum(axis=-1, keepdims=True)), tempered


def _inverse_cdf(weights: mx.array, key: mx.array | None) -> mx.array:
    """One index per row of non-negative `weights` [B, V] (any scale), drawn with probability
    proportional to its weight: the first index whose running sum exceeds u * total, u ~ U[0, 1).
    A zero-weight (filtered) index is never drawn. One cumsum and one comparison over the row,
    instead of Gumbel-max's [B, V] random draws and two logs (MLX's CPU transcendental functions
    are slow: ~0.05 G elements/s for exp and log vs ~0.5 for a sum)."""
    c = mx.cumsum(weights, axis=-1)
    u = mx.random.uniform(shape=(weights.shape[0], 1), key=key) * c[:, -1:]
    return mx.minimum((c <= u).sum(axis=-1), weights.shape[-1] - 1).astype(mx.int32)


def sample_tokens(logits: mx.array, key: mx.array | None = None, *, temperature: float = 1.0, top_k: int = 0,
                  top_p: float = 1.0, min_p: float = 0.0):
    """Draw one token per row of `logits` [B, V]. Returns (tokens int32 [B], sampling log-probs [B],
    tempered log-probs [B]); temperature 0 is argmax (both log-probs then at temperature 1)."""
    if temperature == 0:
        lp = logits.astype(mx.float32)
        lp = lp - fastmath.logsumexp(lp, axis=-1, keepdims=True)
        tok = mx.argmax(lp, axis=-1).astype(mx.int32)
        chosen = mx.take_along_axis(lp, tok[:, None], axis=-1)[:, 0]
        return tok, chosen, chosen
    z, zmax, e, w = filtered_weights(logits, temperature, top_k, top_p, min_p)
    tok = _inverse_cdf(w, key)
    pick = tok[:, None]
    lp = (mx.take_along_axis(z, pick, -1) - zmax - mx.log(e.sum(axis=-1, keepdims=True)))[:, 0]
    if w is e:  # no filter
        return tok, lp, lp
    slp = (mx.log(mx.take_along_axis(w, pick, -1)) - mx.log(w.sum(axis=-1, keepdims=True)))[:, 0]
    return tok, slp, lp


# ----------------------------------------------------------------------------------- generation
@dataclass
class DecodeState:
    """Where a generation stopped: the layers' caches, which cached positions are real [n, S], each row's
    position after its prompt [n] and how many completion tokens every row has fed through the model."""

    cache: list
    mask: mx.array
    next_pos: mx.array
    fed: int


@dataclass
class Generation:
    """Output of `generate`. Rows are prompt-major: row r is sample r % G of prompt r // G."""

    completion_ids: mx.array  # [P*G, T] int32; pad_token_id after the stop token
    completion_mask: mx.array  # [P*G, T] int32; 1 up to and including the stop token
    logps: mx.array  # [P*G, T] float32; log softmax(logits / T) of the token (unfiltered), 0 on pad
    sampling_logps: mx.array  # [P*G, T] float32; under the filtered sampling distribution, 0 on pad
    finished: mx.array  # [P*G] bool; ended with a stop token
    truncated: mx.array  # [P*G] bool; hit max_tokens before any stop token
    prompt_index: mx.array  # [P*G] int32; r // G
    state: DecodeState | None = None  # the caches after the last fed token (keep_state=True)

    @property
    def lengths(self) -> mx.array:
        return self.completion_mask.sum(axis=1)


class SharedPrefixCache:
    """One layer's KV cache for G samples per prompt that holds the prompt's keys / values once.

    prefix keys / values [P, Hkv, Lp, D] (the prefill's), the samples' own in an mlx-lm `KVCache` of
    batch P*G (prompt-major). `offset` is the length a sample's row has seen (Lp + its own tokens), as
    a `KVCache` over the repeated prompt would report. `attention` is that row's attention over
    prompt + own tokens, computed without repeating the prompt: the queries of a prompt's G samples
    (and of the query heads sharing a kv head) are stacked into one [G * rep * L, D] block against
    the prompt's keys, the scores of both parts go through one softmax, and the probabilities
    multiply each part's values, all in float32 as the fused attention keeps them (a bf16 cache is
    widened one layer at a time). Per decoding step the prompt's keys and values are read once per
    prompt instead of G times, and the cache holds P * Lp + P * G * T positions instead of
    P * G * (Lp + T)."""

    def __init__(self, keys: mx.array, values: mx.array, group: int):
        from mlx_lm.models.cache import KVCache

        self.prefix_keys, self.prefix_values, self.group = keys, values, group
        self.samples = KVCache()

    @property
    def offset(self) -> int:
        return self.prefix_keys.shape[2] + self.samples.offset

    def attention(self, q: mx.array, k: mx.array, v: mx.array, *, scale: float, mask=None) -> mx.array:
        """q [P*G, Hq, L, D], the new k / v [P*G, Hkv, L, D]; mask None or boolean / additive,
        broadcastable to [P*G, 1, L, Lp + T] (prompt keys, then the samples' own)."""
        ks, vs = self.samples.update_and_fetch(k, v)
        dtype = q.dtype  # scores, softmax and the weighted sums in float32, as the fused attention keeps them
        q, ks, vs = q.astype(mx.float32), ks.astype(mx.float32), vs.astype(mx.float32)
        kp, vp = self.prefix_keys.astype(mx.float32), self.prefix_values.astype(mx.float32)
        n, Hq, L, D = q.shape
        P, Hkv, Lp = kp.shape[:3]
        G, rep = self.group, Hq // Hkv
        q = (q * scale).reshape(P, G, Hkv, rep, L, D)
        stacked = q.transpose(0, 2, 1, 3, 4, 5).reshape(P, Hkv, G * rep * L, D)
        s_prompt = (stacked @ kp.swapaxes(-1, -2)).reshape(P, Hkv, G, rep, L, Lp)
        s_prompt = s_prompt.transpose(0, 2, 1, 3, 4, 5).reshape(n, Hkv, rep, L, Lp)
        s_own = q.reshape(n, Hkv, rep, L, D) @ ks[:, :, None].swapaxes(-1, -2)  # [n, Hkv, rep, L, T]
        scores = mx.concatenate([s_prompt, s_own], axis=-1)
        mask = dense(mask)
        if mask is not None and not isinstance(mask, str) and mask.ndim == 4:
            mask = mask[:, :, None]  # [n | 1, 1, L, S] -> [n | 1, 1, 1, L, S]
        probs = fastmath.softmax(fastmath.masked_scores(scores, mask))
        p_prompt = probs[..., :Lp].reshape(P, G, Hkv, rep, L, Lp).transpose(0, 2, 1, 3, 4, 5)
        out = (p_prompt.reshape(P, Hkv, G * rep * L, Lp) @ vp).reshape(P, Hkv, G, rep, L, D)
        out = out.transpose(0, 2, 1, 3, 4, 5).reshape(n, Hkv, rep, L, D)
        out = out + probs[..., Lp:] @ vs[:, :, None]
        return out.reshape(n, Hq, L, D).astype(dtype)


def _model_kwargs(model, pixel_values, image_grid_thw, vision_meta) -> dict:
    if not is_vl(model):
        if pixel_values is not None:
            raise ValueError("a text-only model cannot take images")
        return {}
    return dict(pixel_values=pixel_values, image_grid_thw=image_grid_thw, vision_meta=vision_meta)


def _next_logits(model, hidden: mx.array) -> mx.array:
    return model.apply_lm_head(hidden[:, -1]).astype(mx.float32)  # [B, V]: the last position only


def generate(
    model,
    input_ids: mx.array,
    attention_mask: mx.array | None = None,
    *,
    pixel_values: mx.array | None = None,
    image_grid_thw: mx.array | None = None,
    vision_meta: dict | None = None,
    num_generations: int = 1,
    max_tokens: int = 256,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    stop_token_ids=DEFAULT_STOP_TOKEN_IDS,
    pad_token_id: int = END_OF_TEXT,
    seed: int | None = None,
    shared_prefill: bool = True,
    keep_state: bool = False,
    **_ignored,
) -> Generation:
    """Sample `num_generations` (G) completions for each of the P prompts in `input_ids` [P, L].

    input_ids / attention_mask / pixel_values / image_grid_thw: a processor batch (left padding
    preferred; right-padded rows are left-aligned first). max_tokens: TRL's max_completion_length.
    temperature 0: greedy. top_k 0, top_p 1, min_p 0: filter off. stop_token_ids: a row ends at
    the first of these (default <|im_end|>, <|endoftext|>). seed: None draws the key from MLX's
    global random state (reproducible under `mx.random.seed`).
    shared_prefill=False repeats every prompt (and its images) G times before the prefill instead
    of sharing its cache: the per-sample baseline, same outputs.
    keep_state=True keeps the caches in the result, for `continue_generation` (a further turn).
    """
    G = int(num_generations)
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if attention_mask is None:
        attention_mask = mx.ones(input_ids.shape, dtype=mx.int32)
    input_ids, attention_mask = left_align(input_ids, attention_mask, pad_token_id)
    if seed is None:
        seed = int(mx.random.randint(0, 2**31 - 1).item())

    if not shared_prefill and G > 1:
        input_ids, attention_mask, pixel_values, image_grid_thw = repeat_prompts(
            model, G, input_ids, attention_mask, pixel_values, image_grid_thw)
        vision_meta, rep = None, 1
    else:
        rep = G
    # prefill: the prompt batch (P rows, or P*G without sharing) once, with its images
    cache = model.make_cache()
    positions, next_pos = prompt_positions(model, input_ids, attention_mask, image_grid_thw)
    hidden = model(input_ids, attention_mask=attention_mask, position_ids=positions, cache=cache,
                   return_hidden=True, **_model_kwargs(model, pixel_values, image_grid_thw, vision_meta))
    logits = _next_logits(model, hidden)
    if rep > 1:  # share the prompt's keys/values with its G samples
        # attention layers keep the prompt's keys / values once; a recurrent layer's state is per row
        cache = [c.repeated(rep) if hasattr(c, "repeated") else
                 SharedPrefixCache(c.keys[..., :c.offset, :], c.values[..., :c.offset, :], rep) for c in cache]
        logits = mx.repeat(logits, rep, axis=0)
        attention_mask = mx.repeat(attention_mask, rep, axis=0)
        next_pos = mx.repeat(next_pos, rep, axis=0)
    out = _decode(model, cache, logits, attention_mask.astype(mx.int32), next_pos, max_tokens=max_tokens,
                  seed=seed, stop_token_ids=stop_token_ids, pad_token_id=pad_token_id, temperature=temperature,
                  top_k=top_k, top_p=top_p, min_p=min_p, group=G)
    if not keep_state:
        out.state = None
    return out


def _decode(model, cache, logits, mask, next_pos, *, max_tokens, seed, stop_token_ids, pad_token_id, temperature,
            top_k, top_p, min_p, group) -> Generation:
    """The sampling loop from the first completion token's logits [n, V]: each step draws a token per row and
    feeds it (a finished row feeds padding, masked) until every row has stopped or max_tokens are drawn."""
    keys = mx.random.split(mx.random.key(seed), max(max_tokens, 1))
    stops = mx.array(sorted(set(int(s) for s in stop_token_ids)), dtype=mx.int32)
    n = logits.shape[0]
    finished = mx.zeros((n,), dtype=mx.bool_)
    toks, lps, slps, valid = [], [], [], []
    fed = 0
    for t in range(max_tokens):
        tok, slp, lp = sample_tokens(logits, keys[t], temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
        live = ~finished
        tok = mx.where(live, tok, pad_token_id)
        toks.append(tok), lps.append(mx.where(live, lp, 0.0)), slps.append(mx.where(live, slp, 0.0))
        valid.append(live)
        finished = finished | (live & (tok[:, None] == stops[None]).any(axis=1))
        if t == max_tokens - 1:
            break
        mask = mx.concatenate([mask, live.astype(mx.int32)[:, None]], axis=1)
        hidden = model(tok[:, None], attention_mask=mask, position_ids=continue_positions(model, next_pos + t, 1),
                       cache=cache, return_hidden=True)
        fed += 1
        logits = _next_logits(model, hidden)
        mx.async_eval(logits, finished, tok, lp, slp)
        if finished.all().item():  # the next step's forward is already queued; stop after this one
            break
    out = Generation(
        completion_ids=mx.stack(toks, axis=1),
        completion_mask=mx.stack(valid, axis=1).astype(mx.int32),
        logps=mx.stack(lps, axis=1),
        sampling_logps=mx.stack(slps, axis=1),
        finished=finished,
        truncated=~finished,
        prompt_index=mx.arange(n, dtype=mx.int32) // group,
        state=DecodeState(cache, mask, next_pos, fed),
    )
    mx.eval(out.completion_ids, out.completion_mask, out.logps, out.sampling_logps, out.finished, out.truncated)
    return out


def _select_rows(cache, rows: mx.array) -> list:
    """Each layer's cache cut to `rows` (a prompt-shared cache becomes a plain per-row one: after a turn every
    row has its own history)."""
    from mlx_lm.models.cache import KVCache

    out = []
    for c in cache:
        if hasattr(c, "recurrent_state"):
            d = type(c)()
            d.cache = [None if a is None else a[rows] for a in c.cache]
            d.offset = c.offset
        else:
            if isinstance(c, SharedPrefixCache):
                own_k, own_v = c.samples.keys_and_values()
                groups = rows // c.group
                keys = mx.concatenate([c.prefix_keys[groups], own_k[rows]], axis=2)
                values = mx.concatenate([c.prefix_values[groups], own_v[rows]], axis=2)
            else:
                keys, values = (a[rows] for a in c.keys_and_values())
            d = KVCache()
            d.keys, d.values, d.offset = keys, values, keys.shape[2]
        out.append(d)
    return out


def continue_generation(
    model,
    previous: Generation,
    rows,
    new_tokens: list[list[int]],
    *,
    max_tokens: int = 256,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    stop_token_ids=DEFAULT_STOP_TOKEN_IDS,
    pad_token_id: int = END_OF_TEXT,
    seed: int | None = None,
) -> Generation:
    """The next turn of `rows` of a `generate` (or `continue_generation`) made with keep_state=True: each row's
    history stays in its KV / recurrent caches, the row's `new_tokens` (a tool's answer and the next assistant
    header, say) are forwarded after it and one completion per row is sampled from there; nothing of the history
    is forwarded again. Returns a Generation of len(rows) rows holding only the new completions (and the state
    for a further turn). The output equals a `generate` over the whole conversation as one prompt (tested)."""
    state = previous.state
    if state is None:
        raise ValueError("continue_generation needs a Generation made with keep_state=True")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if seed is None:
        seed = int(mx.random.randint(0, 2**31 - 1).item())
    rows = [int(r) for r in rows]
    if len(rows) != len(new_tokens) or not rows:
        raise ValueError("continue_generation needs one list of new tokens per row (and at least one row)")
    ids, lengths = np.array(previous.completion_ids), np.array(previous.completion_mask).sum(axis=1)
    # a row's completion tokens the loop drew but never fed (its last, when it stopped at the final step)
    chunks = [ids[r, state.fed:lengths[r]].tolist() + list(map(int, t)) for r, t in zip(rows, new_tokens,
                                                                                           strict=True)]
    width = max(len(c) for c in chunks)
    if width == 0:
        raise ValueError("continue_generation needs at least one new token per row")
    index = mx.array(rows, dtype=mx.int32)
    cache = _select_rows(state.cache, index)
    chunk_ids = np.full((len(rows), width), pad_token_id, dtype=np.int32)
    chunk_mask = np.zeros((len(rows), width), dtype=np.int32)
    for i, c in enumerate(chunks):
        chunk_ids[i, :len(c)], chunk_mask[i, :len(c)] = c, 1
    fed_so_far = mx.array(np.minimum(lengths[rows], state.fed).astype(np.int32))
    next_pos = state.next_pos[index] + fed_so_far
    mask = mx.concatenate([state.mask[index], mx.array(chunk_mask)], axis=1)
    hidden = model(mx.array(chunk_ids), attention_mask=mask, position_ids=continue_positions(model, next_pos, width),
                   cache=cache, return_hidden=True)
    count = mx.array(chunk_mask.sum(axis=1))
    last = mx.take_along_axis(hidden, (count - 1)[:, None, None], axis=1)  # each row's last real position
    logits = model.apply_lm_head(last[:, 0]).astype(mx.float32)
    # the sampling loop feeds token t at next_pos + t and masks the chunk's right padding: positions of the
    # real tokens continue from each row's own length
    return _decode(model, cache, logits, mask, next_pos + count, max_tokens=max_tokens, seed=seed,
                   stop_token_ids=stop_token_ids, pad_token_id=pad_token_id, temperature=temperature, top_k=top_k,
                   top_p=top_p, min_p=min_p, group=1)
