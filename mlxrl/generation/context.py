"""One sequence's KV cache and the tokens in it: prefill keeps the longest cached prefix, decoding is pipelined."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from ..errors import MlxrlError
from .engine import is_vl, sample_tokens
from .settings import PREFILL_STEP_SIZE, Settings


# ------------------------------------------------------------------------------------- context
def image_spans(ids: np.ndarray, grid: np.ndarray | None, image_token_id: int, merge_size: int) -> np.ndarray:
    """[n, 2] (start, end) token spans of the n images of `ids` (a 1-D sequence), in order."""
    if grid is None or len(grid) == 0:
        return np.zeros((0, 2), dtype=np.int64)
    at = np.flatnonzero(ids == image_token_id)
    counts = np.asarray(grid, dtype=np.int64).prod(axis=1) // merge_size**2
    if counts.sum() != len(at):
        raise ValueError(f"the sequence has {len(at)} image tokens but its images need {int(counts.sum())}")
    ends = np.cumsum(counts)
    return np.stack([at[ends - counts], at[ends - 1] + 1], axis=1)


def _image_digests(pixel_values, grid) -> list[bytes]:
    """A digest of each image's grid and pixel rows (what tells two pictures with equal token spans apart)."""
    import hashlib

    pixels = np.asarray(pixel_values, dtype=np.float32)
    patches = np.asarray(grid, dtype=np.int64).prod(axis=1)
    rows = np.concatenate([[0], np.cumsum(patches)])
    return [hashlib.blake2b(np.asarray(grid[k], dtype=np.int64).tobytes() + pixels[rows[k]:rows[k + 1]].tobytes(),
                            digest_size=16).digest() for k in range(len(patches))]


@dataclass
class Stats:
    prompt_tokens: int = 0  # the whole sequence before the reply
    prefill_tokens: int = 0  # of which forwarded now (the rest was in the cache)
    prefill_s: float = 0.0  # prefill and the first token
    generation_tokens: int = 0
    decode_s: float = 0.0  # after the first token
    peak_memory_gb: float = 0.0

    @property
    def prefill_tps(self) -> float:
        return self.prefill_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        """Tokens per second after the first one (each needs one forward)."""
        return (self.generation_tokens - 1) / self.decode_s if self.decode_s > 0 else 0.0

    def lines(self) -> list[str]:
        cached = self.prompt_tokens - self.prefill_tokens
        reuse = f" ({cached} more from the cache)" if cached else ""
        return [f"Prompt: {self.prefill_tokens} tokens{reuse}, {self.prefill_tps:.1f} tokens-per-sec "
                f"({self.prefill_s:.2f} s to the first token)",
                f"Generation: {self.generation_tokens} tokens, {self.decode_tps:.1f} tokens-per-sec",
                f"Peak memory: {self.peak_memory_gb:.3f} GB"]


@dataclass
class Reply:
    text: str
    token_ids: list[int]  # without the stop token
    finish_reason: str  # "stop" (a stop token), "length" (max_new_tokens)
    stats: Stats = field(default_factory=Stats)


class Context:
    """One sequence's KV cache and the tokens it holds (`tokens`); `prefill` reuses the longest cached prefix."""

    def __init__(self, model, prefill_step_size: int = PREFILL_STEP_SIZE):
        self.model = model
        self.prefill_step_size = int(prefill_step_size)
        self.reset()

    def reset(self) -> None:
        self.cache = self.model.make_cache()
        self.tokens: list[int] = []
        self.images: dict[int, tuple[int, bytes]] = {}  # cached images: span start -> (span end, digest)

    @property
    def context_length(self) -> int:
        return int(self.model.language_model.config.max_position_embeddings)

    def _trim(self, keep: int) -> int:
        """Cut the cache back to its first `keep` tokens; returns the tokens it holds after (0 where a recurrent
        layer's state, which cannot go back to an earlier token, makes it start again)."""
        if keep == 0 or (keep < len(self.tokens) and not all(c.is_trimmable() for c in self.cache)):
            self.reset()
            return 0
        for c in self.cache:
            extra = c.offset - keep
            if extra > 0:
                c.trim(extra)
        del self.tokens[keep:]
        self.images = {a: v for a, v in self.images.items() if v[0] <= keep}
        return keep

    def _sync(self) -> None:
        """The cache may be ahead of `tokens` after an interrupt (a queued forward): drop the extra."""
        off = self.cache[0].offset if self.cache else 0
        if off != len(self.tokens):
            if off < len(self.tokens):
                self.reset()
            elif not all(c.is_trimmable() for c in self.cache):
                self.reset()
            else:
                for c in self.cache:
                    c.trim(c.offset - len(self.tokens))

    def prefill(self, ids, pixel_values=None, image_grid_thw=None) -> tuple[mx.array, int]:
        """Bring the cache to hold all of `ids` (the whole sequence, 1-D; pixel_values / image_grid_thw:
        all its images) and return (logits of the token after it [1, V], that token's position). Only
        what the cache lacks is forwarded: the longest cached prefix is kept (at most n - 1 tokens, so
        that the last one yields the logits), cut back to the start of an image it would split or whose
        picture differs. With images among the new tokens they go in one forward (their features are
        merged by position in it); text alone in chunks of `prefill_step_size`."""
        self._sync()
        model = self.model
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        n = len(ids)
        if n == 0:
            raise MlxrlError("the prompt is empty")
        if n >= self.context_length:
            raise MlxrlError(f"the prompt is {n} tokens, as long as the model's context or longer "
                             f"({self.context_length}, max_position_embeddings in its config.json): shorten it")
        vl = is_vl(model)
        grid = None if image_grid_thw is None else np.asarray(image_grid_thw, dtype=np.int64).reshape(-1, 3)
        if pixel_values is not None and not vl:
            raise MlxrlError(f"{model.config.get('model_type')} is a text-only model: it cannot take images")
        spans = image_spans(ids, grid, model.image_token_id, model.merge_size) if vl else np.zeros((0, 2), int)
        cached = np.asarray(self.tokens[:n], dtype=np.int64)
        diff = np.flatnonzero(cached != ids[:len(cached)])
        keep = min(int(diff[0]) if len(diff) else len(cached), n - 1)  # at least one token to forward
        # an image is kept only whole (its features come from its pixels in one piece) and only if the cache
        # holds the same picture there: image tokens are all <|image_pad|>, so equal ids prove nothing
        digests = _image_digests(pixel_values, grid) if len(spans) else []
        for (start, end), digest in zip(spans, digests, strict=True):
            if start < keep and self.images.get(int(start)) != (int(end), digest):
                keep = int(start)
                break
        keep = self._trim(keep)
        if vl:
            from ..models.vl import mrope_positions

            g = None if grid is None or len(grid) == 0 else mx.array(grid)
            pos, deltas = mrope_positions(mx.array(ids[None]), g, None, model.image_token_id, model.merge_size)
            next_pos = int(n + deltas.item())
        else:
            pos, next_pos = mx.arange(n, dtype=mx.int32)[None], n
        # the images whose tokens are forwarded now, and their rows of pixel_values
        new_images = np.flatnonzero(spans[:, 0] >= keep) if len(spans) else np.zeros(0, int)
        patches = grid.prod(axis=1) if grid is not None and len(grid) else np.zeros(0, np.int64)
        row0 = np.concatenate([[0], np.cumsum(patches)])
        logits = None
        start = keep
        while start < n:
            has_image = len(new_images) and any(start <= spans[k, 0] for k in new_images)
            end = n if has_image else min(n, start + self.prefill_step_size)
            kw = {}
            if has_image:
                sel = [k for k in new_images if spans[k, 0] >= start]
                rows = np.concatenate([np.arange(row0[k], row0[k + 1]) for k in sel])
                kw = dict(pixel_values=pixel_values[mx.array(rows)], image_grid_thw=mx.array(grid[sel]))
            hidden = model(mx.array(ids[None, start:end].astype(np.int32)), position_ids=pos[..., start:end],
                           cache=self.cache, return_hidden=True, **kw)
            self.tokens.extend(int(t) for t in ids[start:end])
            if end < n:
                mx.eval([c.state for c in self.cache])  # KVCache: keys / values; ArraysCache: its arrays
            else:
                logits = model.apply_lm_head(hidden[:, -1]).astype(mx.float32)
            start = end
        self.images = {int(a): (int(b), d) for (a, b), d in zip(spans, digests, strict=True)}
        self.last_prefill_tokens = n - keep
        return logits, next_pos

    def stream(self, ids, pixel_values=None, image_grid_thw=None, settings: Settings = Settings(),  # noqa: B008  (a frozen dataclass)
               stats: Stats | None = None) -> Iterator[int]:
        """Prefill `ids` (the whole sequence) and yield the reply's token ids; the stop token ends the
        reply and is not yielded. Afterwards `finish_reason` is "stop" or "length" and `stats` (when
        given) is filled in. The cache then holds every token that was forwarded: the prompt and the
        reply (with the stop token; a reply cut at max_new_tokens lacks its last token)."""
        s = settings.check()
        model = self.model
        stats = stats if stats is not None else Stats()
        mx.reset_peak_memory()
        t0 = time.perf_counter()
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        n = len(ids)
        logits, next_pos = self.prefill(ids, pixel_values, image_grid_thw)
        stats.prompt_tokens, stats.prefill_tokens = n, self.last_prefill_tokens
        max_new = min(s.max_new_tokens, self.context_length - n)
        keys = mx.random.split(mx.random.key(s.seed), max_new) if s.temperature > 0 else None
        stops = {int(t) for t in s.stop_token_ids}
        vl = is_vl(model)
        seen = None
        if s.repetition_penalty != 1.0:  # transformers' RepetitionPenaltyLogitsProcessor: prompt + reply
            seen = mx.zeros((logits.shape[-1],), dtype=mx.bool_)
            seen[mx.array(np.unique(ids).astype(np.int32))] = True

        def pick(logits, t):
            if seen is not None:
                p = s.repetition_penalty
                logits = mx.where(seen, mx.where(logits < 0, logits * p, logits / p), logits)
            if s.temperature == 0:
                return mx.argmax(logits, axis=-1).astype(mx.int32)
            return sample_tokens(logits, keys[t], temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                                 min_p=s.min_p)[0]

        def forward(tok, t):  # reply token t sits at position next_pos + t (on all three M-RoPE axes)
            pos = mx.full((1, 1), next_pos + t, dtype=mx.int32)
            hidden = model(tok[:, None], position_ids=mx.broadcast_to(pos, (3, 1, 1)) if vl else pos,
                           cache=self.cache, return_hidden=True)
            return model.apply_lm_head(hidden[:, -1]).astype(mx.float32)

        self.finish_reason = "length"
        tok = pick(logits, 0)
        mx.async_eval(tok)
        produced, t_first, t_last = 0, None, None
        try:
            for t in range(max_new):
                nxt = None
                if t + 1 < max_new:  # queue token t's forward and the next draw before reading token t
                    logits = forward(tok, t)
                    if seen is not None:
                        seen = mx.where(mx.arange(seen.shape[0]) == tok, True, seen)
                    nxt = pick(logits, t + 1)
                    mx.async_eval(nxt)
                value = int(tok.item())
                if t + 1 < max_new:
                    self.tokens.append(value)  # its forward is queued: the cache holds it
                produced += 1
                t_last = time.perf_counter()
                if t_first is None:
                    t_first = t_last
                if value in stops:
                    self.finish_reason = "stop"
                    break
                yield value
                tok = nxt
        finally:
            stats.generation_tokens = produced
            stats.prefill_s = (t_first or time.perf_counter()) - t0
            stats.decode_s = (t_last - t_first) if t_first is not None else 0.0
            stats.peak_memory_gb = mx.get_peak_memory() / 1e9
