"""The sequence-classification head: transformers' `*ForSequenceClassification` on our decoders (a reward model).

transformers builds such a model as the base decoder (`model.*`, the same names as the causal LM's) and a
`score` Linear(hidden, num_labels, bias=False) in place of the LM head; its output for a row is the score of the
hidden state at the row's last token that is not the pad token (the rightmost position whose id differs from
`pad_token_id`, position 0 when every id is the pad token: left and right padding alike). `make_classifier` turns
one of our causal models into that layout (the LM head removed, `score` added, config.json's `architectures`,
`id2label` / `label2id` set as transformers writes them), so that `loading.save` writes a folder
`AutoModelForSequenceClassification` loads, and `loading.load` reads one back (or a causal LM's folder with a
fresh `score`, as transformers does when TRL's RewardTrainer is given a causal checkpoint: normal(0,
initializer_range)).

`score_positions` finds each sequence's scored position on the host (numpy, from the ids); `sequence_scores`
applies the head to those positions' hidden states only: [N, D] -> [N, num_labels], never a [tokens, vocab]
tile. `score` is the whole forward of a batch of token rows (transformers' pooled logits), for scoring outside
training (a reward model in GRPO).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..errors import MlxrlError

__all__ = ["CLASSIFIERS", "is_classifier_config", "num_labels_of", "make_classifier", "is_classifier",
           "init_score", "pad_token_id_of", "set_pad_token_id", "score_positions", "sequence_scores", "score",
           "peak_bytes"]

# model_type -> transformers' class (`AutoModelForSequenceClassification`'s table for the models we implement)
CLASSIFIERS = {
    "qwen2": "Qwen2ForSequenceClassification",
    "qwen3": "Qwen3ForSequenceClassification",
    "qwen3_moe": "Qwen3MoeForSequenceClassification",
    "qwen3_5": "Qwen3_5ForSequenceClassification",
    "qwen3_5_text": "Qwen3_5TextForSequenceClassification",
    "qwen3_next": "Qwen3NextForSequenceClassification",
}


def is_classifier_config(config: dict) -> bool:
    """Whether config.json describes a sequence classifier (its `architectures`)."""
    return any(str(a).endswith("ForSequenceClassification") for a in config.get("architectures") or [])


def num_labels_of(config: dict) -> int:
    """transformers' `num_labels`: the size of `id2label` (2 when config.json has none)."""
    labels = config.get("id2label")
    return len(labels) if isinstance(labels, dict) and labels else int(config.get("num_labels", 2))


def is_classifier(model) -> bool:
    return "score" in model


def make_classifier(model, num_labels: int = 1) -> None:
    """`model` (one of our causal models) in transformers' sequence-classification layout, in place: no LM head,
    a `score` Linear(hidden, num_labels) (uninitialised: `init_score` or the checkpoint's weights), config.json's
    fields. A model type transformers has no classifier for is refused in one line."""
    kind = model.config.get("model_type")
    name = CLASSIFIERS.get(kind)
    if name is None:
        raise MlxrlError(f"model_type {kind!r} has no sequence classifier in transformers "
                         f"(AutoModelForSequenceClassification has one for {', '.join(CLASSIFIERS)}): "
                         "use one of those for a reward model")
    if "lm_head" in model:
        model.pop("lm_head")
    d = model.language_model.config.hidden_size
    model.score = nn.Linear(d, int(num_labels), bias=False)
    model.score.weight = model.score.weight.astype(model.compute_dtype())
    labels = {str(i): f"LABEL_{i}" for i in range(int(num_labels))}
    model.config.update(architectures=[name], id2label=labels, label2id={v: int(k) for k, v in labels.items()})
    model.config.pop("num_labels", None)


def init_score(model, seed: int = 0) -> None:
    """A fresh head as transformers initialises one: normal(0, initializer_range)."""
    std = float(model.config.get("initializer_range", (model.config.get("text_config") or {})
                                 .get("initializer_range", 0.02)))
    w = model.score.weight
    model.score.weight = (std * mx.random.normal(w.shape, key=mx.random.key(seed))).astype(w.dtype)


def _text_config(config: dict) -> dict:
    return config["text_config"] if isinstance(config.get("text_config"), dict) else config


def pad_token_id_of(config: dict) -> int | None:
    """transformers' `config.get_text_config().pad_token_id` (the text config's for a VL model)."""
    pad = _text_config(config).get("pad_token_id", config.get("pad_token_id"))
    return None if pad is None else int(pad)


def set_pad_token_id(model, pad_token_id: int) -> None:
    """The pad token id the saved folder's classifier finds its scored position by (TRL sets it so)."""
    _text_config(model.config)["pad_token_id"] = int(pad_token_id)


def score_positions(input_ids: np.ndarray, pad_token_id: int | None) -> np.ndarray:
    """[B] the position transformers scores in each row of input_ids [B, L]: the rightmost id that is not the pad
    token (0 when all are); the last position when there is no pad token (transformers then refuses B > 1)."""
    ids = np.asarray(input_ids)
    if pad_token_id is None:
        return np.full(ids.shape[0], ids.shape[1] - 1, np.int64)
    keep = ids != pad_token_id
    return (np.arange(ids.shape[1]) * keep).argmax(-1)


def sequence_scores(model, hidden: mx.array) -> mx.array:
    """The head over the scored positions' hidden states [N, D] -> float32 scores [N, num_labels]."""
    return model.score(hidden).astype(mx.float32)


def peak_bytes(tokens: int, hidden: int, element_bytes: int) -> int:
    """The memory model of the head in training (`plan`): its weight and the scored rows are negligible; what
    peaks is the trunk's output gradient, the scored rows' gradients scattered into the whole [tokens, D] hidden
    states and the final norm's backward over them (its input, output and their gradients): about eight
    [tokens, D] arrays, measured against `plan.measure` (tests/test_plan.py)."""
    return 8 * tokens * hidden * element_bytes


def score(model, input_ids, attention_mask=None, **inputs) -> mx.array:
    """transformers' pooled logits [B, num_labels] of a batch of token rows: the decoder, then the head at each
    row's last non-pad token (`score_positions` with the model's pad_token_id)."""
    ids = np.asarray(input_ids)
    pad = pad_token_id_of(model.config)
    if pad is None and ids.shape[0] > 1:
        raise MlxrlError("the reward model's config.json has no pad_token_id: it cannot score a batch of rows; set "
                         "pad_token_id (the tokenizer's pad token)")
    kw = {} if attention_mask is None else {"attention_mask": mx.array(attention_mask)}
    hidden = model(input_ids=mx.array(ids), return_hidden=True, **kw, **inputs)
    at = score_positions(ids, pad)
    picked = hidden[mx.arange(ids.shape[0]), mx.array(at)]
    return sequence_scores(model, picked)
