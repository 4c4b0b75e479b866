"""Preference rows -> token ids for a reward model (TRL 1.16's RewardTrainer), and their batches.

    from mlxrl.data.reward import tokenize_reward_rows, make_reward_batches
    examples = tokenize_reward_rows(rows, processor, max_length=1024)
    batches = make_reward_batches(examples, 4, pad_token_id=processor.pad_token_id, max_length=1024)

What matches TRL (``RewardTrainer._prepare_dataset`` and its ``DataCollatorForPreference``):

* formats: explicit prompt (``prompt`` / ``chosen`` / ``rejected``: the prompt is put before each answer) and
  implicit prompt (``chosen`` / ``rejected`` are whole sequences), strings or conversations, an optional
  ``margin`` column, the rows' ``tools`` and ``chat_template_kwargs``; already tokenised rows (``chosen_ids`` /
  ``rejected_ids``, or the legacy ``chosen_input_ids`` / ``rejected_input_ids``);
* tokenising: each whole sequence at once (no prompt / completion split: a reward model scores the sequence),
  a conversation through the chat template (no generation prompt), a string with EOS appended when it lacks
  it (prompt + answer + EOS), both with the tokenizer's special tokens as TRL calls it;
* images (beyond TRL, whose RewardTrainer collates text only; for a VL model transformers has a classifier for:
  Qwen3.5): an ``images`` (or ``image``) column belongs to the prompt both sequences begin with, their blocks
  filled in order (or put before the first user message's text) in each conversation, the placeholders expanded
  to the images' token counts; the batch's ``pixel_values`` hold each row's images twice (chosen, then rejected);
* ``max_length``: a pair with either sequence longer is dropped (never truncated); the count is printed;
* a batch of B pairs is one forward of 2B sequences, chosen rows then rejected, right-padded with the pad token
  (or concatenated without padding, ``padding_free``), each scored at its last token that is not the pad token
  (``score_at`` [2B], flat positions: transformers' rule, `models.score.score_positions`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .batches import right_padded
from .files import naming_rows, origins_of
from .formats import DataError, chatml, check_messages, expand_images, render_chat, with_eos
from .images import fill_images, row_images
from .preference import layout_sequences, pair_groups

__all__ = ["RewardExample", "check_reward_row", "tokenize_reward_row", "tokenize_reward_rows", "reward_batch",
           "make_reward_batches"]


@dataclass
class RewardExample:
    chosen_ids: np.ndarray      # [Lc] the whole chosen sequence
    rejected_ids: np.ndarray    # [Lr]
    margin: float | None = None
    index: int = -1
    pixel_values: np.ndarray | None = None     # [P, C*T*p*p] the row's images (both sequences hold them)
    image_grid_thw: np.ndarray | None = None   # [n, 3]

    def __len__(self) -> int:
        return max(len(self.chosen_ids), len(self.rejected_ids))


TOKENIZED = (("chosen_ids", "rejected_ids"), ("chosen_input_ids", "rejected_input_ids"))


def _tokenized(row: dict, index: int):
    for c, r in TOKENIZED:
        if c in row and r in row:
            out = []
            for key in (c, r):
                ids = np.asarray(row[key])
                if ids.ndim != 1 or not ids.size or not np.issubdtype(ids.dtype, np.integer):
                    raise DataError(f"row {index}: {key!r} must be a non-empty list of token ids")
                out.append(ids.astype(np.int32))
            return out
    return None


def _margin(row: dict, index: int) -> float | None:
    if "margin" not in row or row["margin"] is None:
        return None
    m = row["margin"]
    if isinstance(m, bool) or not isinstance(m, (int, float, np.integer, np.floating)) or not np.isfinite(m):
        raise DataError(f"row {index}: 'margin' must be a finite number, got {m!r}")
    return float(m)


def _sequences(row: dict, index: int):
    """(chosen, rejected, conversational) as TRL joins them: the prompt before each answer when there is one."""
    if not isinstance(row, dict):
        raise DataError(f"row {index}: expected a dict of columns, got {type(row).__name__}")
    missing = [k for k in ("chosen", "rejected") if k not in row]
    if missing:
        raise DataError(f"row {index}: reward data needs 'chosen' and 'rejected' columns (missing "
                        f"{', '.join(map(repr, missing))}; has {', '.join(map(repr, sorted(map(str, row))))}), or "
                        "tokenised 'chosen_ids' and 'rejected_ids'")
    chosen, rejected, prompt = row["chosen"], row["rejected"], row.get("prompt")
    conv = isinstance(chosen, list)
    if conv != isinstance(rejected, list) or (not conv and not (isinstance(chosen, str) and isinstance(rejected, str))):
        raise DataError(f"row {index}: 'chosen' and 'rejected' must both be strings or both be message lists, got "
                        f"{type(chosen).__name__} and {type(rejected).__name__}")
    if prompt is not None and isinstance(prompt, list) != conv:
        raise DataError(f"row {index}: 'prompt' is a {type(prompt).__name__} but the answers are "
                        f"{'message lists' if conv else 'strings'}: give all three the same kind")
    if conv:
        chosen, rejected = chatml(chosen), chatml(rejected)
        if prompt is not None:
            prompt = chatml(prompt)
            check_messages(prompt, index, "prompt")
            chosen, rejected = prompt + chosen, prompt + rejected
        check_messages(chosen, index, "chosen")
        check_messages(rejected, index, "rejected")
    elif prompt is not None:
        if not isinstance(prompt, str):
            raise DataError(f"row {index}: 'prompt' must be a string like 'chosen' and 'rejected'")
    return chosen, rejected, conv, prompt


def check_reward_row(row: dict, index: int) -> None:
    """The row's columns and messages, checked without a tokenizer (before a model loads)."""
    if _tokenized(row, index) is None:
        _sequences(row, index)
    _margin(row, index)


def tokenize_reward_row(row: dict, processor, *, index: int) -> RewardExample:
    """One row as TRL's RewardTrainer tokenises it (module docstring)."""
    margin = _margin(row, index)
    ids = _tokenized(row, index)
    if ids is not None:
        return RewardExample(ids[0], ids[1], margin, index)
    chosen, rejected, conv, prompt = _sequences(row, index)
    tok = processor.tokenizer
    images = row_images(row)
    if conv and images:  # the images belong to the prompt both conversations begin with
        (chosen, filled), (rejected, _) = (fill_images(side, images, index) for side in (chosen, rejected))
        images = filled
    if conv:
        texts = [render_chat(processor, side, row, index) for side in (chosen, rejected)]
        encoded = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    else:
        texts = [(prompt or "") + with_eos(side, tok.eos_token) for side in (chosen, rejected)]
        encoded = [tok(t)["input_ids"] for t in texts]
    c, r = (expand_images(np.asarray(e, np.int64), np.ones(len(e), bool), images, processor, index)
            for e in encoded)
    if not c.input_ids.size or not r.input_ids.size:
        raise DataError(f"row {index}: an empty sequence after tokenisation")
    return RewardExample(c.input_ids, r.input_ids, margin, index, c.pixel_values, c.image_grid_thw)


def tokenize_reward_rows(rows, processor, *, max_length: int | None = 1024, name: str = "train") -> list:
    """Every row tokenised; pairs with a sequence over max_length dropped (counted); a margin column that only
    some rows have refused."""
    with naming_rows(origins_of(rows)):
        out = [tokenize_reward_row(row, processor, index=i) for i, row in enumerate(rows)]
        has = [e.margin is not None for e in out]
        if any(has) and not all(has):
            k = has.index(not has[0])
            raise DataError(f"row {k}: {'no' if has[0] else 'a'} 'margin' where row 0 has "
                            f"{'one' if has[0] else 'none'}: give every row a margin, or none")
    kept = out if max_length is None else [e for e in out if len(e) <= max_length]
    if len(kept) < len(out):
        print(f"{name}: dropped {len(out) - len(kept)} of {len(out)} pairs longer than max_length={max_length} "
              "(TRL filters them out)", flush=True)
    if not kept:
        raise DataError(f"{name} dataset: no pair left (every pair has a sequence longer than "
                        f"max_length={max_length})")
    return kept


def reward_batch(examples: Sequence[RewardExample], *, pad_token_id: int, buckets: Sequence[int],
                 padding_free: bool = False) -> dict:
    """B pairs -> the numpy arrays of one forward of 2B sequences (chosen rows, then rejected): input_ids
    [2B, L] (padding-free: [1, L] with segment_ids 1..2B), score_at [2B] each sequence's scored flat position,
    margin [B] when the rows have one."""
    b = len(examples)
    seqs = [e.chosen_ids for e in examples] + [e.rejected_ids for e in examples]
    ids, mask, _, seg = layout_sequences([(s, np.ones(len(s), np.int32)) for s in seqs], pad_token_id, buckets,
                                         padding_free)
    flat_ids, flat_seg = ids.reshape(-1), seg.reshape(-1)
    score_at = np.zeros(2 * b, np.int32)
    for k in range(2 * b):
        span = np.flatnonzero(flat_seg == k + 1)
        real = span[flat_ids[span] != pad_token_id]
        score_at[k] = real[-1] if real.size else span[0]
    out = {"input_ids": ids, "score_at": score_at, "num_tokens": int(mask.sum()), "num_pairs": b,
           "example_ids": [e.index for e in examples], "token_mask": mask}
    if examples[0].margin is not None:
        out["margin"] = np.array([e.margin for e in examples], np.float32)
    if padding_free or not right_padded(mask):
        out["attention_mask"] = mask
    if padding_free:
        out["segment_ids"] = seg
    pixels = [e for e in examples if e.pixel_values is not None]
    if pixels:  # in the sequences' order: every chosen row's images, then the same for the rejected rows
        out["pixel_values"] = np.concatenate([e.pixel_values for e in pixels] * 2).astype(np.float32)
        out["image_grid_thw"] = np.concatenate([e.image_grid_thw for e in pixels] * 2).astype(np.int32)
    return out


def make_reward_batches(examples: Sequence[RewardExample], batch_size: int, *, pad_token_id: int,
                        max_length: int | None = None, seq_buckets: Sequence[int] | None = None,
                        padding_free: bool = False, shuffle: bool = True, seed: int = 0, epoch: int = 0,
                        num_shards: int = 1, shard: int = 0, drop_last: bool = False,
                        pad_to_multiple_of: int | None = None) -> list[dict]:
    """One epoch of reward batches (as `preference.make_preference_batches`: the same order for the same seed
    and epoch, data-parallel slices of each global batch, length buckets rounded to pad_to_multiple_of)."""
    buckets, groups = pair_groups(examples, batch_size, max_length=max_length, seq_buckets=seq_buckets,
                                  padding_free=padding_free, shuffle=shuffle, seed=seed, epoch=epoch,
                                  num_shards=num_shards, shard=shard, drop_last=drop_last,
                                  pad_to_multiple_of=pad_to_multiple_of)
    return [reward_batch([examples[i] for i in g], pad_token_id=pad_token_id, buckets=buckets,
                         padding_free=padding_free) for g in groups]

