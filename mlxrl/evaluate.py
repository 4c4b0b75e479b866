"""Exact-match evaluation without a generation engine, and the text-only baseline.

    import mlxrl
    from mlxrl.data.synthetic import make_vqa
    from mlxrl.evaluate import exact_match, exact_match_by_type, text_only_baseline
    model, processor = mlxrl.load_default()
    rows = make_vqa(200, seed=0, split="test")
    exact_match(model, processor, rows)          # fraction answered exactly (greedy)
    exact_match_by_type(model, processor, rows)  # {"all": ..., "color": ..., ...}
    text_only_baseline(rows)                     # what answering from the question text alone reaches

Teacher-forced scoring is exact for greedy decoding: greedy emits the answer's tokens followed by
<|im_end|> (as the chat template renders the assistant's turn: Qwen3.5's empty thinking block first)
iff, with the prompt + answer + <|im_end|> fed in one forward, the argmax of the logits at the
position before each of those tokens is that token (the first mismatch is where greedy would
diverge). One forward per batch, no KV cache, no sampling loop.
"""

from __future__ import annotations

from collections import Counter, defaultdict

import numpy as np

__all__ = ["answer_correct", "exact_match", "exact_match_by_type", "text_only_baseline", "split_row"]

END = "<|im_end|>"


def _text_of(content) -> str:
    if isinstance(content, str):
        return content
    return "".join(b.get("text", "") for b in content or [] if isinstance(b, dict) and b.get("type", "text") == "text")


def split_row(row: dict) -> tuple[list[dict], str]:
    """(prompt messages, answer text) of a conversational row: "messages" whose last turn is the
    assistant's, or TRL's conversational "prompt" / "completion" pair."""
    if "messages" in row:
        messages = row["messages"]
        if not messages or messages[-1]["role"] != "assistant":
            raise ValueError("a row's last message must be the assistant's answer to score it")
        return list(messages[:-1]), _text_of(messages[-1]["content"])
    if "prompt" in row and "completion" in row:
        return list(row["prompt"]), "".join(_text_of(m["content"]) for m in row["completion"])
    raise ValueError(f"cannot score a row with keys {sorted(row)}: expected 'messages' or 'prompt'+'completion'")


def _question_of(row: dict) -> str:
    prompt, _ = split_row(row)
    return "\n".join(f"{m['role']}: {_text_of(m['content'])}" for m in prompt)


def _reply(processor, prompt: list[dict], answer: str) -> tuple[str, str]:
    """(the generation prompt, what greedy decoding must emit after it): the answer and <|im_end|> as the chat
    template renders the assistant's turn, e.g. Qwen3.5's empty thinking block before it (where its tokens
    continue the prompt's: a reply that merges with the prompt's last token is scored as the bare answer)."""
    head = processor.apply_chat_template(prompt, add_generation_prompt=True)
    whole = processor.apply_chat_template([*prompt, {"role": "assistant", "content": answer}])
    tail = whole[len(head):] if whole.startswith(head) else ""
    if answer in tail and END in tail:
        tail = tail[:tail.index(END) + len(END)]
        ids = lambda text: processor.tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
        if ids(head + tail) == ids(head) + ids(tail):
            return head, tail
    return head, answer + END


def _encode(processor, rows: list[dict]):
    """Right-padded numpy batch of prompt + reply (the answer and <|im_end|>), and per row its target positions."""
    texts, images, answers = [], [], []
    for row in rows:
        head, reply = _reply(processor, *split_row(row))
        texts.append(head + reply)
        images.append(list(row.get("images") or []))
        answers.append(processor.tokenizer(reply, add_special_tokens=False)["input_ids"])
    batch = processor(text=texts, images=images if any(images) else None, padding_side="right",
                      return_tensors="np")
    ids, lengths = batch["input_ids"], batch["attention_mask"].sum(axis=1)
    for i, (ans, n) in enumerate(zip(answers, lengths, strict=True)):
        # the answer must tokenise the same inside the row (Qwen's "\n" boundary guarantees it)
        if ids[i, n - len(ans):n].tolist() != ans:
            raise ValueError(f"row {i}: answer {texts[i]!r} does not tokenise the same inside the prompt")
    # the logits at position t predict token t + 1
    rows_at = np.concatenate([np.full(len(a), i) for i, a in enumerate(answers)])
    pos = np.concatenate([np.arange(n - len(a) - 1, n - 1) for a, n in zip(answers, lengths, strict=True)])
    return batch, rows_at, pos, ids[rows_at, pos + 1]


def _predict(model, batch: dict, rows_at: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """Greedy next-token ids at (rows_at, pos). A real model only runs its LM head on those positions
    (never [B, L, V] logits); any other callable returning logits works too (tests use fakes)."""
    import mlx.core as mx  # after `import mlxrl` (fast BLAS first)

    inputs = {k: mx.array(v) if v.dtype == np.float32 else mx.array(v.astype(np.int32)) for k, v in batch.items()}
    r, p = mx.array(rows_at.astype(np.int32)), mx.array(pos.astype(np.int32))
    if hasattr(model, "apply_lm_head"):
        hidden = model(**inputs, return_hidden=True)                  # [B, L, D]
        logits = model.apply_lm_head(hidden[r, p])                    # [N, V]
    else:
        logits = model(**inputs)[r, p]                                # [N, V]
    pred = mx.argmax(logits.astype(mx.float32), axis=-1)
    return np.asarray(pred)


def answer_correct(model, processor, rows: list[dict], batch_size: int = 8) -> np.ndarray:
    """bool [len(rows)]: whether greedy decoding reproduces each row's answer and then stops."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    out = np.zeros(len(rows), dtype=bool)
    for start in range(0, len(rows), batch_size):
        chunk = rows[start:start + batch_size]
        batch, rows_at, pos, targets = _encode(processor, chunk)
        hit = _predict(model, batch, rows_at, pos) == targets
        # a row is right iff every one of its answer tokens (and the end token) is
        wrong = np.bincount(rows_at[~hit], minlength=len(chunk))
        out[start:start + len(chunk)] = wrong == 0
    return out


def exact_match(model, processor, rows: list[dict], batch_size: int = 8) -> float:
    """Fraction of rows whose answer the model reproduces exactly under greedy decoding."""
    if not rows:
        raise ValueError("exact_match needs at least one row")
    return float(answer_correct(model, processor, rows, batch_size).mean())


def exact_match_by_type(model, processor, rows: list[dict], batch_size: int = 8) -> dict[str, float]:
    """{"all": exact match, <type>: exact match of the rows of that "type"} (types only if rows have them)."""
    if not rows:
        raise ValueError("exact_match_by_type needs at least one row")
    correct = answer_correct(model, processor, rows, batch_size)
    groups: dict[str, list[bool]] = defaultdict(list)
    for row, ok in zip(rows, correct, strict=True):
        if "type" in row:
            groups[str(row["type"])].append(bool(ok))
    return {"all": float(correct.mean()), **{t: float(np.mean(v)) for t, v in sorted(groups.items())}}


def text_only_baseline(rows: list[dict]) -> float:
    """Accuracy of answering every row with the most frequent answer for its exact question text
    (computed on these same rows: an upper bound on what a model blind to the images can reach)."""
    if not rows:
        raise ValueError("text_only_baseline needs at least one row")
    by_question: dict[str, Counter] = defaultdict(Counter)
    for row in rows:
        by_question[_question_of(row)][split_row(row)[1]] += 1
    return sum(c.most_common(1)[0][1] for c in by_question.values()) / len(rows)
