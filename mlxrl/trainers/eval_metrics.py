"""TRL's `compute_metrics` / `preprocess_logits_for_metrics` for SFTTrainer's evaluation, as transformers'
Trainer calls them.

Training never materialises the logits (the head is streamed); evaluation with `compute_metrics` does, one
evaluation batch at a time: logits [B, T, V] = hidden states x the LM head in float32, and labels [B, T]
as TRL's collator makes them (the token at each trained position, -100 elsewhere; position t's logits
predict label t + 1, so a metric shifts as it does under transformers). `preprocess_logits_for_metrics
(logits, labels)` is called per batch with torch tensors, as transformers calls it (NumPy arrays where torch
is not installed), so that an argmax there keeps [B, T] instead of [B, T, V]. Batches are padded with -100
to the longest and concatenated (transformers' `nested_concat`), then `compute_metrics(EvalPrediction)`'s
dict is returned for `evaluate()` to prefix (eval_...).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..processing.tokens import IGNORE_INDEX
from .engine import hidden_states


def labels_of(batch: dict) -> np.ndarray:
    """TRL's labels [B, T] of a prepared SFT batch: `targets` at the scored `rows` are the labels one
    position later (`shift_targets`)."""
    ids = np.asarray(batch["input_ids"])
    rows, targets = np.asarray(batch["rows"]), np.asarray(batch["targets"])
    keep = targets != IGNORE_INDEX
    labels = np.full(ids.size, IGNORE_INDEX, np.int64)
    labels[rows[keep] + 1] = targets[keep]
    return labels.reshape(ids.shape)


def batch_logits(model, batch: dict) -> mx.array:
    """Logits [B, T, V] (float32) of a prepared batch."""
    hidden = hidden_states(model, batch)
    return hidden.astype(mx.float32) @ model.lm_head_weight().astype(mx.float32).T


def _to_numpy(x):
    if isinstance(x, (tuple, list)):
        return type(x)(_to_numpy(v) for v in x)
    if hasattr(x, "detach"):  # a torch tensor
        return x.detach().cpu().numpy()
    return np.asarray(x)


def preprocess(fn, logits: mx.array, labels: np.ndarray):
    """`fn(logits, labels)` with torch tensors when torch is installed (transformers passes its tensors);
    the result back as NumPy. Without `fn`: the logits as NumPy."""
    values = np.array(logits)
    if fn is None:
        return values
    try:
        import torch
    except ImportError:
        return _to_numpy(fn(values, labels))
    return _to_numpy(fn(torch.from_numpy(values), torch.from_numpy(labels)))


def _pad_concat(parts: list):
    """transformers' nested_concat with padding_index -100: arrays of [B, T, ...] padded along T."""
    if isinstance(parts[0], (tuple, list)):
        return type(parts[0])(_pad_concat([p[i] for p in parts]) for i in range(len(parts[0])))
    if parts[0].ndim < 2:
        return np.concatenate(parts)
    longest = max(p.shape[1] for p in parts)
    padded = [np.pad(p, [(0, 0), (0, longest - p.shape[1])] + [(0, 0)] * (p.ndim - 2), constant_values=-100)
              for p in parts]
    return np.concatenate(padded)


def compute(compute_metrics, predictions: list, labels: list) -> dict:
    from transformers import EvalPrediction

    out = compute_metrics(EvalPrediction(predictions=_pad_concat(predictions), label_ids=_pad_concat(labels)))
    if not isinstance(out, dict):
        raise TypeError(f"compute_metrics returned {type(out).__name__}: it must return a dict of metric values")
    return {k: float(v) if isinstance(v, (np.floating, np.integer)) else v for k, v in out.items()}
