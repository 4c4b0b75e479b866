"""Unpaired preference rows -> token ids for KTO, with TRL 1.16's formats and semantics, and their batches.

    from mlxrl.data.unpaired import tokenize_unpaired, with_kl_completions, make_unpaired_batches
    examples = with_kl_completions(tokenize_unpaired(rows, processor, max_length=1024), batch_size=4)
    batches = make_unpaired_batches(examples, 4, pad_token_id=processor.pad_token_id, seq_buckets=(64, 128))

What matches TRL (``KTOTrainer._prepare_dataset`` and ``DataCollatorForUnpairedPreference``):

* formats: unpaired rows (``prompt`` / ``completion`` / ``label``, strings or conversations), or preference rows
  (``chosen`` / ``rejected``, explicit or implicit prompt) unpaired as ``trl.unpair_preference_dataset`` does: in
  chunks of 1000 rows (its ``map`` batch), every chosen completion of the chunk (label True), then every rejected
  one (False);
* tokenising: the prompt (with the generation prompt) and prompt + completion apart, the completion starting where
  they stop agreeing; string completions get EOS when they lack it; rows whose prompt alone fills ``max_length``
  are dropped; each sequence is truncated to ``max_length`` (keep_start) in the batch;
* vision rows (TRL's ``DataCollatorForVisionUnpairedPreference``, chosen when the first row has an ``images`` or
  ``image`` column): the images belong to the prompt (their blocks filled in order, or put before the first user
  message's text); the prompt is the characters its rendering shares with the whole conversation's, the completion
  the rest, tokenised apart, and a string completion gets no EOS (TRL's vision path appends none). Beyond TRL, which
  refuses them for vision data, preference rows with images are unpaired like text ones and reference log-probs
  can be precomputed (the rows are tokenised up front here);
* the KL term's mismatched completions: in dataset order, within each chunk of ``per_device_train_batch_size``
  examples, example i is paired with the completion of example i - 1 (the first with the chunk's last):
  (x_1, y_n), (x_2, y_1), ..., (x_n, y_{n-1}). That pairing is fixed by the order, which is why TRL (and mlxrl)
  require ``train_sampling_strategy="sequential"`` for the ``kto`` loss.

A batch is B sequences (``input_ids``, ``rows``, ``targets``, ``seq_mask`` [B, R], ``labels`` [B], ``pixel_values`` /
``image_grid_thw`` of the prompts' images) and, with the KL completions, the same arrays of the B mismatched
sequences under ``kl_`` names (computed without a gradient; their prompts, hence their images, are the same).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..processing.tokens import IGNORE_INDEX
from .batches import default_buckets, padded_buckets, right_padded
from .formats import DataError, chatml, check_messages, common_prefix, expand_images, render_chat, with_eos
from .images import fill_images, row_images
from .preference import _columns, _render_prompt, epoch_groups, layout_sequences, next_token_positions, row_bucket

__all__ = ["UnpairedExample", "check_unpaired_row", "unpair", "tokenize_unpaired", "with_kl_completions",
           "unpaired_batch", "make_unpaired_batches"]

UNPAIR_CHUNK = 1000  # datasets' default map batch size: trl.unpair_preference_dataset's chunks


@dataclass
class UnpairedExample:
    prompt_ids: np.ndarray        # [P]
    completion_ids: np.ndarray    # [C]
    label: bool
    index: int = -1
    kl_completion_ids: np.ndarray | None = None
    pixel_values: np.ndarray | None = None     # [P, C*T*p*p] the prompt's images (the KL sequence's too)
    image_grid_thw: np.ndarray | None = None   # [n, 3]
    ref_logps: tuple[float, float | None] | None = None  # precomputed (completion, KL completion) reference log-probs

    def __len__(self) -> int:
        return len(self.prompt_ids) + max(len(self.completion_ids), len(self.kl_completion_ids)
                                          if self.kl_completion_ids is not None else 0)


def _label(row: dict, index: int) -> bool:
    label = row.get("label")
    if isinstance(label, (bool, np.bool_)) or (isinstance(label, (int, np.integer)) and label in (0, 1)):
        return bool(label)
    raise DataError(f"row {index}: 'label' must be true or false (desirable or not), got {label!r}")


def _unpaired_columns(row: dict, index: int):
    if not isinstance(row, dict):
        raise DataError(f"row {index}: expected a dict of columns, got {type(row).__name__}")
    missing = [k for k in ("prompt", "completion", "label") if k not in row]
    if missing:
        raise DataError(f"row {index}: KTO data needs 'prompt', 'completion' and 'label' columns, or preference "
                        f"columns 'chosen' and 'rejected' (missing {', '.join(map(repr, missing))}; has "
                        f"{', '.join(map(repr, sorted(map(str, row))))})")
    prompt, completion = row["prompt"], row["completion"]
    conv = isinstance(completion, list)
    if conv != isinstance(prompt, list) or (not conv and not (isinstance(prompt, str) and isinstance(completion, str))):
        raise DataError(f"row {index}: 'prompt' and 'completion' must both be strings or both be message lists, got "
                        f"{type(prompt).__name__} and {type(completion).__name__}")
    if conv:
        prompt, completion = chatml(prompt), chatml(completion)
        check_messages(prompt, index, "prompt")
        check_messages(completion, index, "completion")
    return prompt, completion, _label(row, index), conv


def check_unpaired_row(row: dict, index: int) -> None:
    """The row's columns, checked without a tokenizer (before a model loads): one-line DataErrors."""
    if isinstance(row, dict) and "chosen" in row and "rejected" in row:
        _columns(row, index)
    else:
        _unpaired_columns(row, index)


def unpair(rows: Sequence[dict]) -> list[tuple[dict, int]]:
    """Rows as (unpaired row, the index of the row it came from): preference rows unpaired as TRL unpairs them
    (module docstring), unpaired rows as they are."""
    rows = list(rows)
    if not rows or not (isinstance(rows[0], dict) and "chosen" in rows[0] and "rejected" in rows[0]):
        return [(row, i) for i, row in enumerate(rows)]
    out = []
    for start in range(0, len(rows), UNPAIR_CHUNK):
        chunk = [(_columns(row, i), i) for i, row in enumerate(rows[start:start + UNPAIR_CHUNK], start)]
        for side, label in ((1, True), (2, False)):
            out += [({"prompt": cols[0], "completion": cols[side], "label": label,
                      **{k: v for k, v in rows[i].items() if k not in ("prompt", "chosen", "rejected")}}, i)
                    for cols, i in chunk]
    return out


def _is_vision(rows: Sequence[dict]) -> bool:
    """TRL's test of a vision dataset: its first row has an ``images`` or ``image`` column."""
    return bool(rows) and isinstance(rows[0], dict) and ("images" in rows[0] or "image" in rows[0])


def tokenize_unpaired(rows: Sequence[dict], processor, *, max_length: int | None = 1024) -> list[UnpairedExample]:
    """TRL's KTO tokenisation of every row (module docstring); rows whose prompt alone fills max_length are left
    out (the caller counts them)."""
    tok = processor.tokenizer
    rows = list(rows)
    vision = _is_vision(rows)

    def encode(text):
        return np.asarray(tok(text, add_special_tokens=False)["input_ids"], np.int64) if text else np.zeros(0, np.int64)

    out = []
    for row, index in unpair(rows):
        prompt, completion, label, conv = _unpaired_columns(row, index)
        images = row_images(row)
        if conv:
            if images:
                prompt, images = fill_images(prompt, images, index)
            p_text = _render_prompt(processor, prompt, row, index)
            full = render_chat(processor, prompt + completion, row, index)
        else:
            p_text, full = prompt, prompt + (completion if vision else with_eos(completion, tok.eos_token))
        if vision:
            # TRL's vision collator: the prompt is the characters the two renderings share, the completion the rest,
            # each tokenised apart (no EOS appended to string completions)
            p_text = os.path.commonprefix([p_text, full])
            p_ids, c_ids = encode(p_text), encode(full[len(p_text):])
        else:
            f_ids = encode(full)
            n = common_prefix(encode(p_text), f_ids)
            p_ids, c_ids = f_ids[:n], f_ids[n:]
        if processor.image_processor is not None and (c_ids == processor.image_token_id).any():
            raise DataError(f"row {index}: an image placeholder is in the completion; images belong to the prompt")
        expanded = expand_images(p_ids, np.zeros(len(p_ids), bool), images, processor, index)
        p_ids = expanded.input_ids
        if max_length is not None and len(p_ids) >= max_length:
            continue
        out.append(UnpairedExample(p_ids.astype(np.int32), c_ids.astype(np.int32), label, index,
                                   pixel_values=expanded.pixel_values, image_grid_thw=expanded.image_grid_thw))
    return out


def with_kl_completions(examples: list[UnpairedExample], batch_size: int) -> list[UnpairedExample]:
    """Each example's mismatched completion for the KL term: within each chunk of `batch_size` examples in order,
    the previous example's (the first takes the chunk's last)."""
    for start in range(0, len(examples), batch_size):
        chunk = examples[start:start + batch_size]
        for k, e in enumerate(chunk):
            e.kl_completion_ids = chunk[k - 1].completion_ids
    return examples


def _sequence_arrays(seqs, *, pad_token_id: int, buckets: Sequence[int], padding_free: bool,
                     bucket_rows: bool) -> dict:
    ids, mask, comp, seg = layout_sequences(seqs, pad_token_id, buckets, padding_free)
    _, completion = next_token_positions(comp, seg)
    rows = np.flatnonzero(completion)
    n_rows = row_bucket(rows.size) if bucket_rows else rows.size
    padded = np.zeros(n_rows, np.int32)
    padded[:rows.size] = rows
    targets = np.full(n_rows, IGNORE_INDEX, np.int32)
    targets[:rows.size] = ids.reshape(-1)[rows + 1]
    seq_mask = np.zeros((len(seqs), n_rows), np.float32)
    seq_mask[seg.reshape(-1)[rows] - 1, np.arange(rows.size)] = 1.0
    out = {"input_ids": ids, "rows": padded, "targets": targets, "seq_mask": seq_mask, "token_mask": mask}
    if padding_free or not right_padded(mask):
        out["attention_mask"] = mask
    if padding_free:
        out["segment_ids"] = seg
    return out


def unpaired_batch(examples: Sequence[UnpairedExample], *, pad_token_id: int, buckets: Sequence[int],
                   max_length: int | None, padding_free: bool = False, bucket_rows: bool = True) -> dict:
    """B examples -> the numpy arrays of their forward (module docstring); each sequence truncated to max_length."""
    def seq(e, completion):
        ids = np.concatenate([e.prompt_ids, completion]).astype(np.int32)
        m = np.concatenate([np.zeros(len(e.prompt_ids), np.int32), np.ones(len(completion), np.int32)])
        return (ids[:max_length], m[:max_length]) if max_length is not None else (ids, m)

    kw = dict(pad_token_id=pad_token_id, buckets=buckets, padding_free=padding_free, bucket_rows=bucket_rows)
    out = _sequence_arrays([seq(e, e.completion_ids) for e in examples], **kw)
    out.update(labels=np.array([e.label for e in examples], np.float32), num_examples=len(examples),
               num_tokens=int(out["token_mask"].sum()), example_ids=[e.index for e in examples])
    if examples[0].kl_completion_ids is not None:
        kl = _sequence_arrays([seq(e, e.kl_completion_ids) for e in examples], **kw)
        out.update({f"kl_{k}": v for k, v in kl.items() if k != "token_mask"})
    pixels = [e for e in examples if e.pixel_values is not None]
    if pixels:  # every sequence's prompt is its own example's, the KL sequences' too: one set of images serves both
        out["pixel_values"] = np.concatenate([e.pixel_values for e in pixels]).astype(np.float32)
        out["image_grid_thw"] = np.concatenate([e.image_grid_thw for e in pixels]).astype(np.int32)
    if all(e.ref_logps is not None for e in examples):
        out["ref_logps"] = np.array([e.ref_logps[0] for e in examples], np.float32)
        if examples[0].kl_completion_ids is not None:
            out["ref_kl_logps"] = np.array([e.ref_logps[1] for e in examples], np.float32)
    return out


def make_unpaired_batches(examples: Sequence[UnpairedExample], batch_size: int, *, max_length: int | None,
                          pad_token_id: int, seq_buckets: Sequence[int] | None = None, padding_free: bool = False,
                          shuffle: bool = False, seed: int = 0, epoch: int = 0, bucket_rows: bool = True,
                          num_shards: int = 1, shard: int = 0, drop_last: bool = False,
                          pad_to_multiple_of: int | None = None) -> list[dict]:
    """One epoch of batches of `batch_size` examples (in order, or shuffled when the KL term does not need the
    order); num_shards / shard as `data.preference.make_preference_batches`."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    longest = max((len(e) for e in examples), default=1)
    limit = min(max_length or longest, longest)
    if seq_buckets is None:
        seq_buckets = default_buckets(limit * batch_size if padding_free else limit, smallest=32)
    buckets = padded_buckets(seq_buckets, pad_to_multiple_of)
    groups = epoch_groups(len(examples), batch_size, shuffle=shuffle, seed=seed, epoch=epoch, num_shards=num_shards,
                          shard=shard, drop_last=drop_last)
    return [unpaired_batch([examples[i] for i in g], pad_token_id=pad_token_id, buckets=buckets, max_length=max_length,
                           padding_free=padding_free, bucket_rows=bucket_rows) for g in groups]
