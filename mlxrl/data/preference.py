"""Preference rows -> token ids for DPO, with TRL 1.16's formats and semantics, and pair batches.

    from mlxrl.data.preference import tokenize_preference, make_preference_batches
    ex = tokenize_preference(row, processor, index=0, max_length=1024)
    batches = make_preference_batches(examples, 4, max_length=1024, pad_token_id=processor.pad_token_id)

Formats (TRL's): explicit prompt (``prompt`` / ``chosen`` / ``rejected``) and implicit prompt (only
``chosen`` / ``rejected``; the shared prefix is the prompt: whole messages for conversations, the
common characters for strings, as ``trl.extract_prompt``), each as plain strings or message lists.
Vision rows add an ``images`` (or ``image``) column; the images belong to the prompt (their blocks
are filled in order, or put before the first user message's text when the prompt has none).

What matches TRL (``DPOTrainer._prepare_dataset`` and its collators): string completions get EOS
appended when they lack it; the prompt, prompt+chosen and prompt+rejected are tokenised separately
(conversations through the chat template, the prompt with the generation prompt, or continuing a
final assistant message) and the completion starts where the prompt's tokens and each full
sequence's tokens stop agreeing (the minimum over chosen and rejected); each full sequence is then
truncated to ``max_length`` (``keep_start``; ``keep_end`` for text only), and rows whose prompt alone
fills ``max_length`` are dropped (keep_start). A batch of B pairs is ONE forward of 2B sequences,
chosen rows first, then rejected rows (TRL's concatenated batch); the images are repeated for the
rejected half.

Deliberate differences: vision rows are tokenised up front like text rows (TRL's vision collator
tokenises prompt and completions apart at collate time: the same ids for Qwen templates, where the
completion starts after "<|im_start|>assistant\\n"); ``padding_free`` really drops the padding (the
2B sequences concatenated in one row whose attention and positions restart per sequence) while TRL
1.16 falls back to padding; rows are padded to length buckets so a compiled step sees few shapes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ..processing.tokens import IGNORE_INDEX
from .batches import default_buckets, fit_bucket, padded_buckets, right_padded
from .formats import (
    DataError,
    chatml,
    check_messages,
    common_prefix,
    expand_images,
    is_messages,
    render_chat,
    with_eos,
)
from .images import fill_images, row_images

__all__ = ["PreferenceExample", "check_preference_row", "extract_prompt", "tokenize_preference",
           "make_preference_batches", "preference_batch"]


@dataclass
class PreferenceExample:
    """One tokenised pair. ``chosen_ids`` / ``rejected_ids`` hold the whole (truncated) sequences,
    prompt included; the masks are 1 on completion tokens (TRL's ``completion_mask``)."""

    chosen_ids: np.ndarray        # [Lc] int32
    chosen_mask: np.ndarray       # [Lc] int32, 1 = completion
    rejected_ids: np.ndarray      # [Lr] int32
    rejected_mask: np.ndarray     # [Lr] int32
    prompt_length: int            # prompt tokens (image tokens expanded), before truncation
    pixel_values: np.ndarray | None = None     # [P, C*T*p*p] the prompt's images
    image_grid_thw: np.ndarray | None = None   # [n, 3]
    index: int = -1
    ref_logps: tuple[float, float] | None = None  # precomputed (chosen, rejected) reference log-probs
    images: list = field(default_factory=list)

    def __len__(self) -> int:
        return max(len(self.chosen_ids), len(self.rejected_ids))


# ---------------------------------------------------------------------------------------- prompts

def extract_prompt(chosen, rejected) -> tuple:
    """The shared prefix of an implicit-prompt pair -> (prompt, chosen, rejected), TRL's rule:
    whole messages for conversations; for strings the common characters, minus a trailing space
    that then starts the completions."""
    n = min(len(chosen), len(rejected))
    idx = n
    for i in range(n):
        if chosen[i] != rejected[i]:
            idx = i - 1 if i > 0 and chosen[i - 1] == " " else i
            break
    return chosen[:idx], chosen[idx:], rejected[idx:]


def _columns(row: dict, index: int):
    where = f"row {index}"
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a dict of columns, got {type(row).__name__}")
    missing = [k for k in ("chosen", "rejected") if k not in row]
    if missing:
        raise DataError(f"{where}: preference data needs 'chosen' and 'rejected' columns (missing "
                        f"{', '.join(map(repr, missing))}; has {', '.join(map(repr, sorted(map(str, row))))})")
    chosen, rejected = row["chosen"], row["rejected"]
    conv = isinstance(chosen, list)
    if conv != isinstance(rejected, list) or (not conv and not (isinstance(chosen, str) and isinstance(rejected, str))):
        raise DataError(f"{where}: 'chosen' and 'rejected' must both be strings or both be message lists, got "
                        f"{type(chosen).__name__} and {type(rejected).__name__}")
    prompt = row.get("prompt")
    if conv:
        chosen, rejected = chatml(chosen), chatml(rejected)
        check_messages(chosen, index, "chosen")
        check_messages(rejected, index, "rejected")
        if isinstance(prompt, list):
            prompt = chatml(prompt)
            check_messages(prompt, index, "prompt")
    # TRL keeps an explicit prompt only when it has the completions' kind (both conversations or both strings)
    if prompt is None or is_messages(prompt) != conv:
        if prompt is not None and not isinstance(prompt, (str, list)):
            raise DataError(f"{where}: 'prompt' is {type(prompt).__name__}: use a string or a list of messages")
        prompt, chosen, rejected = extract_prompt(chosen, rejected)
    elif not conv and not isinstance(prompt, str):
        raise DataError(f"{where}: 'prompt' must be a string like 'chosen' and 'rejected'")
    if conv and (not chosen or not rejected):
        raise DataError(f"{where}: 'chosen' and 'rejected' must each add at least one message after the prompt "
                        "they share")
    return prompt, chosen, rejected, conv


def check_preference_row(row: dict, index: int) -> None:
    """The row's columns and messages, checked without a tokenizer (before a model loads): a
    one-line DataError naming the row, as `tokenize_preference` would raise."""
    _columns(row, index)


def _render_prompt(processor, prompt: list[dict], row: dict, index=None) -> str:
    if not prompt:
        return ""
    last = prompt[-1].get("role")
    if last == "assistant":  # the completion continues the assistant's message
        return render_chat(processor, prompt, row, index, continue_final_message=True)
    if last not in ("user", "tool", "system"):
        raise DataError(f"row {index}: invalid role of the prompt's last message: {last!r}")
    return render_chat(processor, prompt, row, index, add_generation_prompt=True)


# ------------------------------------------------------------------------------------- tokenising

def tokenize_preference(row: dict, processor, *, index: int, max_length: int | None = 1024,
                        truncation_mode: str = "keep_start", append_eos: bool = False) -> PreferenceExample | None:
    """Tokenise one preference row as TRL's DPOTrainer would. Returns None when the prompt alone
    fills ``max_length`` (TRL drops those rows with keep_start).

    append_eos: trl.experimental's ORPO / CPO tokenisation (``tokenize_row``), which renders conversations
    with the chat template too but then appends the EOS token to every completion whose last token is not
    EOS: after a Qwen template's closing "<|im_end|>\n", one more <|im_end|>. Its truncation cuts the
    completion and keeps the whole prompt, which is keep_start's result whenever the prompt fits; a prompt
    that fills max_length leaves TRL an empty completion (its mean log-prob 0 / 0), and the row is dropped
    here."""
    if truncation_mode not in ("keep_start", "keep_end"):
        raise ValueError(f"truncation_mode must be 'keep_start' or 'keep_end', got {truncation_mode!r}")
    prompt, chosen, rejected, conv = _columns(row, index)
    tok = processor.tokenizer
    images = row_images(row)
    if conv:
        if images:
            prompt, images = fill_images(prompt, images, index)
        p_text = _render_prompt(processor, prompt, row, index)
        c_text = render_chat(processor, prompt + chosen, row, index)
        r_text = render_chat(processor, prompt + rejected, row, index)
    else:
        p_text = prompt
        c_text = prompt + with_eos(chosen, tok.eos_token)
        r_text = prompt + with_eos(rejected, tok.eos_token)

    def encode(text):
        return np.asarray(tok(text, add_special_tokens=False)["input_ids"], dtype=np.int64) if text else \
            np.zeros(0, np.int64)

    p_ids, c_ids, r_ids = encode(p_text), encode(c_text), encode(r_text)
    # the completion starts where the prompt's tokens stop agreeing with the full sequence's
    n = min(common_prefix(p_ids, c_ids), common_prefix(p_ids, r_ids))
    p_ids, c_ids, r_ids = p_ids[:n], c_ids[n:], r_ids[n:]
    if append_eos:
        eos = np.asarray([tok.eos_token_id], np.int64)
        c_ids, r_ids = (ids if len(ids) and ids[-1] == eos[0] else np.concatenate([ids, eos]) for ids in (c_ids, r_ids))
    image_id = processor.image_token_id if processor.image_processor is not None else None
    if image_id is not None and ((c_ids == image_id).any() or (r_ids == image_id).any()):
        raise DataError(f"row {index}: an image placeholder is in a completion; images belong to the prompt")
    expanded = expand_images(p_ids, np.zeros(len(p_ids), bool), images, processor, index)
    p_ids = expanded.input_ids.astype(np.int64)

    if max_length is not None and truncation_mode == "keep_start" and len(p_ids) >= max_length:
        return None
    if images and max_length is not None and truncation_mode == "keep_end" and len(p_ids) + max(
            len(c_ids), len(r_ids)) > max_length:
        raise DataError(f"row {index}: truncation_mode='keep_end' would cut this row's prompt and its images; "
                         "use keep_start (TRL refuses keep_end for vision data too) or a larger max_length")

    def side(completion):
        ids = np.concatenate([p_ids, completion]).astype(np.int32)
        mask = np.concatenate([np.zeros(len(p_ids), np.int32), np.ones(len(completion), np.int32)])
        if max_length is not None and len(ids) > max_length:
            cut = slice(None, max_length) if truncation_mode == "keep_start" else slice(-max_length, None)
            ids, mask = ids[cut], mask[cut]
        return ids, mask

    (ci, cm), (ri, rm) = side(c_ids), side(r_ids)
    return PreferenceExample(ci, cm, ri, rm, len(p_ids), expanded.pixel_values, expanded.image_grid_thw, index,
                             images=expanded.images)


# ---------------------------------------------------------------------------------------- batches

def row_bucket(n: int, minimum: int = 64) -> int:
    """The scored rows of a DPO batch are padded to a power of two (at least 64): few compiled shapes."""
    return max(minimum, 1 << int(np.ceil(np.log2(max(n, 1)))))


def layout_sequences(seqs: Sequence[tuple[np.ndarray, np.ndarray]], pad_token_id: int, buckets: Sequence[int],
                     padding_free: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(ids, completion masks) of n sequences -> (input_ids, attention mask, completion mask, segment ids 1..n),
    [n, L] right-padded to a length bucket, or [1, L] concatenated (padding_free)."""
    lengths = [len(ids) for ids, _ in seqs]
    if padding_free:
        width = fit_bucket(sum(lengths), buckets)
        shape = (1, width)
    else:
        width = fit_bucket(max(lengths), buckets)
        shape = (len(seqs), width)
    ids = np.full(shape, pad_token_id, np.int32)
    mask = np.zeros(shape, np.int32)
    comp = np.zeros(shape, np.int32)
    seg = np.zeros(shape, np.int32)
    pos = 0
    for k, (s_ids, s_mask) in enumerate(seqs):
        r, c = (0, pos) if padding_free else (k, 0)
        n = len(s_ids)
        ids[r, c:c + n], mask[r, c:c + n], comp[r, c:c + n], seg[r, c:c + n] = s_ids, 1, s_mask, k + 1
        pos += n if padding_free else 0
    return ids, mask, comp, seg


def next_token_positions(comp: np.ndarray, seg: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Flat positions whose next token is in the same sequence (`same`), and those of them predicting a
    completion token (`completion`): position t predicts token t + 1 (TRL's shifted completion mask)."""
    flat_comp, flat_seg = comp.reshape(-1), seg.reshape(-1)
    same = np.zeros(flat_seg.size, bool)
    same[:-1] = (flat_seg[1:] == flat_seg[:-1]) & (flat_seg[1:] > 0)
    completion = np.zeros(flat_seg.size, bool)
    completion[:-1] = (flat_comp[1:] == 1) & same[:-1]
    return same, completion


def preference_batch(examples: Sequence[PreferenceExample], *, pad_token_id: int, buckets: Sequence[int],
                     padding_free: bool = False, ld_alpha: float | None = None,
                     bucket_rows: bool = True, score_chosen_prompts: bool = False) -> dict:
    """B pairs -> the numpy arrays of one DPO forward over 2B sequences (chosen rows, then rejected).

    input_ids / attention_mask [2B, L] (padding-free: [1, L] with segment_ids 1..2B); pixel_values
    with every prompt's images twice; ``rows`` [R] the flat positions that predict a completion
    token and ``targets`` [R] those tokens (-100 padding up to a row bucket); ``seq_weights``
    [2B, R] maps a position's log-prob to its sequence's sum (1, or ld_alpha on the LD-DPO tail) and
    ``seq_mask`` [2B, R] is the same without LD weighting; ``chosen_counts`` / ``rejected_counts``
    [B] completion tokens per answer (TRL's completion_mask sums). score_chosen_prompts (ORPO, whose NLL
    term covers the chosen sequence's prompt too): the positions predicting the chosen rows' prompt tokens
    are scored as well, ``nll_mask`` [R] marking every position of a chosen row (prompt and completion);
    ``seq_mask`` and ``seq_weights`` stay on the completions.
    """
    b = len(examples)
    seqs = [(e.chosen_ids, e.chosen_mask) for e in examples] + [(e.rejected_ids, e.rejected_mask) for e in examples]
    ids, mask, comp, seg = layout_sequences(seqs, pad_token_id, buckets, padding_free)
    flat_ids, flat_seg = ids.reshape(-1), seg.reshape(-1)
    same, completion = next_token_positions(comp, seg)
    scored = completion | (same & (flat_seg <= b)) if score_chosen_prompts else completion
    rows = np.flatnonzero(scored)
    seq_of = flat_seg[rows] - 1                                    # 0..2B-1
    in_completion = completion[rows]
    n_rows = row_bucket(rows.size) if bucket_rows else rows.size
    padded_rows = np.zeros(n_rows, np.int32)
    padded_rows[:rows.size] = rows
    targets = np.full(n_rows, IGNORE_INDEX, np.int32)
    targets[:rows.size] = flat_ids[rows + 1]
    at = np.flatnonzero(in_completion)
    seq_mask = np.zeros((2 * b, n_rows), np.float32)
    seq_mask[seq_of[at], at] = 1.0
    seq_weights = seq_mask
    if ld_alpha is not None:
        # LD-DPO: completion tokens past the shorter answer's length count ld_alpha
        rank = np.zeros(rows.size, np.int64)                       # 1-based position within its completion
        for k in range(2 * b):
            mine = at[seq_of[at] == k]
            rank[mine] = np.arange(1, mine.size + 1)
        per_seq = seq_mask.sum(1)
        shared = np.minimum(per_seq[:b], per_seq[b:])
        shared = np.concatenate([shared, shared])
        w = np.where(rank[at] <= shared[seq_of[at]], 1.0, ld_alpha).astype(np.float32)
        seq_weights = np.zeros_like(seq_mask)
        seq_weights[seq_of[at], at] = w
    counts = np.array([int(m.sum()) for _, m in seqs], np.float32)
    out = {"input_ids": ids, "rows": padded_rows, "targets": targets,
           "seq_weights": seq_weights, "seq_mask": seq_mask,
           "chosen_counts": counts[:b], "rejected_counts": counts[b:],
           "num_tokens": int(mask.sum()), "num_pairs": b, "example_ids": [e.index for e in examples],
           "token_mask": mask}  # the real tokens, whose routing an MoE model's load-balancing loss averages
    if score_chosen_prompts:
        nll = np.zeros(n_rows, np.float32)
        nll[:rows.size] = seq_of < b
        out["nll_mask"] = nll
    if padding_free or not right_padded(mask):  # else causal attention is exact (`right_padded`)
        out["attention_mask"] = mask
    if padding_free:
        out["segment_ids"] = seg
    pixels = [e.pixel_values for e in examples if e.pixel_values is not None]
    if pixels:
        grids = [e.image_grid_thw for e in examples if e.pixel_values is not None]
        out["pixel_values"] = np.concatenate(pixels * 2).astype(np.float32)
        out["image_grid_thw"] = np.concatenate(grids * 2).astype(np.int32)
    if all(e.ref_logps is not None for e in examples):
        out["ref_chosen"] = np.array([e.ref_logps[0] for e in examples], np.float32)
        out["ref_rejected"] = np.array([e.ref_logps[1] for e in examples], np.float32)
    return out


def epoch_groups(n: int, batch_size: int, *, shuffle: bool, seed: int, epoch: int, num_shards: int = 1,
                 shard: int = 0, drop_last: bool = False) -> list[np.ndarray]:
    """The example indices of each of an epoch's batches: in order, or a permutation drawn from (seed, epoch);
    global batches of batch_size * num_shards, this shard's slice of each (drop_last: only full ones)."""
    order = np.random.default_rng([seed, epoch]).permutation(n) if shuffle else np.arange(n)
    size = batch_size * num_shards
    groups = [order[k:k + size] for k in range(0, len(order), size)]
    if drop_last:
        groups = [g for g in groups if len(g) == size]
    if num_shards > 1:
        groups = [np.array_split(g, num_shards)[shard] for g in groups if len(g) >= num_shards]
    return groups


def pair_groups(examples, batch_size: int, *, max_length, seq_buckets, padding_free, shuffle, seed, epoch,
                num_shards, shard, drop_last, pad_to_multiple_of) -> tuple[list[int], list[np.ndarray]]:
    """(length buckets, each batch's example indices) of one epoch of pair batches: buckets fitting 2B
    sequences (one row of them padding-free) rounded to pad_to_multiple_of; `epoch_groups`' order and slices."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    longest = max((len(e) for e in examples), default=1)
    limit = max(max_length or longest, longest)
    if seq_buckets is None:
        seq_buckets = default_buckets(limit * 2 * batch_size if padding_free else limit, smallest=32)
    buckets = padded_buckets(seq_buckets, pad_to_multiple_of)
    return buckets, epoch_groups(len(examples), batch_size, shuffle=shuffle, seed=seed, epoch=epoch,
                                 num_shards=num_shards, shard=shard, drop_last=drop_last)


def make_preference_batches(examples: Sequence[PreferenceExample], batch_size: int, *, max_length: int | None,
                            pad_token_id: int, seq_buckets: Sequence[int] | None = None,
                            padding_free: bool = False, shuffle: bool = True, seed: int = 0, epoch: int = 0,
                            ld_alpha: float | None = None, bucket_rows: bool = True, num_shards: int = 1,
                            shard: int = 0, drop_last: bool = False,
                            pad_to_multiple_of: int | None = None, score_chosen_prompts: bool = False) -> list[dict]:
    """One epoch of pair batches (the same for the same seed and epoch); the last may hold fewer pairs
    (dropped with ``drop_last``). num_shards / shard: data-parallel ranks get their slice of each global
    batch of ``batch_size * num_shards`` pairs (as `mlxrl.data.make_batches`). The length buckets are
    rounded up to multiples of ``pad_to_multiple_of``."""
    buckets, groups = pair_groups(examples, batch_size, max_length=max_length, seq_buckets=seq_buckets,
                                  padding_free=padding_free, shuffle=shuffle, seed=seed, epoch=epoch,
                                  num_shards=num_shards, shard=shard, drop_last=drop_last,
                                  pad_to_multiple_of=pad_to_multiple_of)
    return [preference_batch([examples[i] for i in g], pad_token_id=pad_token_id, buckets=buckets,
                             padding_free=padding_free, ld_alpha=ld_alpha, bucket_rows=bucket_rows,
                             score_chosen_prompts=score_chosen_prompts)
            for g in groups]
