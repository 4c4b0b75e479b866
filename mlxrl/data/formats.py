"""Dataset rows -> token ids and labels for SFT, with TRL 1.16's formats and semantics.

    from mlxrl.data import load_rows, tokenize_example
    rows = load_rows("data/train.jsonl")
    ex = tokenize_example(rows[0], processor, index=0, max_length=1024)

Formats (``detect_format``): language modeling (``text``), prompt-completion (``prompt`` +
``completion``, both strings or both message lists) and conversational (``messages``, or ShareGPT
``conversations`` with from/value keys, converted to ChatML as TRL does). Vision rows add an
``images`` (or ``image``) column: PIL images, paths, raw bytes or Hugging Face ``Image`` dicts.

What matches TRL (``SFTTrainer._prepare_dataset`` and ``DataCollatorForVisionLanguageModeling``):
EOS appended to ``text`` / string completions that lack it; the completion starts where the
tokenised prompt and prompt+completion first differ; ``completion_only_loss=None`` means "on for
prompt-completion rows"; ``assistant_only_loss`` trains each assistant turn's content and its
closing ``<|im_end|>\\n`` (what TRL's Qwen training templates put inside ``{% generation %}``);
image blocks are filled from the ``images`` column in order, and a row whose messages have no image
block gets them before its first user message's text. Deliberate differences: EOS is also added for
vision rows (TRL's vision collator forgets it); truncation never cuts an image, and images wholly
outside the kept window are dropped with their pixels; rows left with nothing to train are kept
(``Example.num_trainable == 0``) for the batch-level guard in ``mlxrl.losses.sft`` to report.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

import numpy as np

from ..errors import MlxrlError
from ..processing.tokens import IGNORE_INDEX
from .files import DataError, load_rows
from .images import decode_images, fill_images, image_sizes, is_image_block, row_images

__all__ = ["Example", "DataError", "load_rows", "detect_format", "check_messages", "check_prompt_rows",
           "tokenize_example", "truncate_example", "FORMATS", "ROLES"]



FORMATS = ("language_modeling", "prompt_completion", "conversational")
ROLES = ("system", "user", "assistant", "tool")  # what the Qwen chat templates render (others vanish)
_ASSISTANT_TURN = re.compile(r"<\|im_start\|>assistant\n(.*?<\|im_end\|>\n?)", re.DOTALL)


@dataclass
class Example:
    """One tokenised row. ``labels`` are aligned with ``input_ids`` (TRL's convention: the loss shifts,
    token t predicts labels[t+1]); -100 marks tokens that are not trained.

    Images are kept as the row gave them (path, bytes, PIL image, ...): tokenising reads only their
    size (to expand the placeholders), and ``pixel_values`` decodes, resizes and normalises them
    each time it is read (in the batch collator, which runs on the background data worker), so a
    dataset's pixels are never all held in memory at once."""

    input_ids: np.ndarray                       # [L] int32
    labels: np.ndarray                          # [L] int32
    images: list = field(default_factory=list)  # the row's image objects, in placeholder order
    pixels: np.ndarray | None = None            # [P, C*T*p*p] float32 when given up front (else computed)
    image_grid_thw: np.ndarray | None = None    # [n, 3] int64
    index: int = -1                             # the dataset row
    image_spans: np.ndarray = field(default_factory=lambda: np.zeros((0, 2), np.int64))  # [n, 2] token [start, stop)
    image_processor: object = field(default=None, repr=False, compare=False)

    @property
    def pixel_values(self) -> np.ndarray | None:
        """[P, C*T*p*p] float32 of every image, decoded and processed now (None without images)."""
        if self.pixels is not None or not self.images:
            return self.pixels
        if self.image_processor is None:
            raise DataError(f"row {self.index}: has images but no image processor to turn them into pixels")
        pixel_values, grid = self.image_processor(decode_images(self.images, self.index))
        if not np.array_equal(grid, self.image_grid_thw):
            raise DataError(f"row {self.index}: an image changed size since it was tokenised "
                             f"(grid {grid.tolist()} != {self.image_grid_thw.tolist()})")
        return pixel_values.astype(np.float32)

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_trainable(self) -> int:
        """Tokens the loss scores: labels[1:] != -100 (labels[0] has nothing before it to predict it)."""
        return int((self.labels[1:] != IGNORE_INDEX).sum())


# ------------------------------------------------------------------------------------------- formats

def is_messages(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) for m in value) and (
        "role" in value[0] or "from" in value[0])


def detect_format(row: dict, index: int | None = None, dataset_text_field: str = "text") -> str:
    """"conversational", "prompt_completion" or "language_modeling"; a one-line error otherwise."""
    where = f"row {index}" if index is not None else "row"
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a dict of columns, got {type(row).__name__}")
    for key in ("messages", "conversations"):
        if key in row:
            check_messages(chatml(row[key]) if isinstance(row[key], list) else row[key], index, key)
            return "conversational"
    if "prompt" in row or "completion" in row:
        missing = [k for k in ("prompt", "completion") if k not in row]
        if missing:
            raise DataError(f"{where}: prompt-completion data is missing column(s) {', '.join(map(repr, missing))}")
        kinds = {"messages" if isinstance(row[k], list) else type(row[k]).__name__ for k in ("prompt", "completion")}
        if kinds not in ({"str"}, {"messages"}):
            raise DataError(f"{where}: 'prompt' and 'completion' must both be strings or both be message "
                            f"lists, got {' and '.join(sorted(kinds))}")
        if kinds == {"messages"}:
            for k in ("prompt", "completion"):
                check_messages(chatml(row[k]), index, k)
        return "prompt_completion"
    if dataset_text_field in row:
        if not isinstance(row[dataset_text_field], str):
            raise DataError(f"{where}: {dataset_text_field!r} must be a string")
        return "language_modeling"
    raise DataError(f"{where}: no known columns (has {', '.join(map(repr, sorted(map(str, row)))) or 'none'}); need "
                     f"{dataset_text_field!r}, 'prompt' + 'completion', or 'messages'")


def chatml(messages: list[dict]) -> list[dict]:
    """ShareGPT's from/value keys -> role/content (TRL's maybe_convert_to_chatml), without mutating."""
    out = []
    for m in messages:
        if not isinstance(m, dict):
            out.append(m)  # check_messages names it
            continue
        m = dict(m)
        if "from" in m:
            m["role"] = m.pop("from")
        if "value" in m:
            m["content"] = m.pop("value")
        out.append(m)
    return out


def _short(value, n: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= n else text[:n - 3] + "..."


def check_messages(messages, index, column: str = "messages") -> None:
    """Refuse, naming the row, what a chat template would silently drop or crash on: a message that is
    not a dict, a missing, unknown or non-string role, a missing or null content (an assistant turn with
    ``tool_calls`` may have none), content that is neither text nor a list of text / image blocks."""
    where = f"{f'row {index}' if index is not None else 'row'}: {column!r}"
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where} must be a non-empty list of {{'role', 'content'}} messages")
    for k, m in enumerate(messages):
        at = f"{where} message {k}"
        if not isinstance(m, dict):
            raise DataError(f"{at} is a {type(m).__name__}, not a {{'role', 'content'}} dict")
        role = m.get("role")
        if role is None:
            raise DataError(f"{at} has no 'role' (use {', '.join(ROLES)})")
        if not isinstance(role, str) or role not in ROLES:
            hint = " (ShareGPT's human/gpt are user/assistant)" if role in ("human", "gpt") else ""
            raise DataError(f"{at} has role {_short(role)}: use {', '.join(ROLES)}{hint}")
        calls = m.get("tool_calls")
        if calls is not None:
            if role != "assistant" or not isinstance(calls, list):
                raise DataError(f"{at} ({role}) has tool_calls {_short(calls)}: only assistant messages call tools, "
                                "with a list of {'function': {'name', 'arguments'}}")
            for j, call in enumerate(calls):
                f = call.get("function", call) if isinstance(call, dict) else None
                if not (isinstance(f, dict) and isinstance(f.get("name"), str)
                        and isinstance(f.get("arguments"), (str, dict))):
                    raise DataError(f"{at} tool call {j} is {_short(call)}: use {{'function': {{'name': str, "
                                    "'arguments': dict or JSON text}}")
        content = m.get("content")
        if content is None:
            if role == "assistant" and calls:
                continue
            state = "no 'content'" if "content" not in m else "content null"
            raise DataError(f"{at} ({role}) has {state}: give it text (\"\" for an empty turn) or a list of blocks")
        if isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise DataError(f"{at} ({role}) has content {_short(content)} ({type(content).__name__}): use text "
                            "or a list of {'type': 'text', 'text': ...} / {'type': 'image'} blocks")
        for j, block in enumerate(content):
            if not isinstance(block, dict):
                raise DataError(f"{at} ({role}) content block {j} is {_short(block)}: use {{'type': 'text', "
                                "'text': ...} or {'type': 'image'}")
            if is_image_block(block):
                continue
            kind = block.get("type", "text")
            if kind != "text":
                raise DataError(f"{at} ({role}) content block {j} has type {_short(kind)}: mlxrl reads text and "
                                "image blocks")
            if not isinstance(block.get("text"), str):
                raise DataError(f"{at} ({role}) content block {j} has text {_short(block.get('text'))}: it must be "
                                "a string")


def _text_of(content) -> str:
    if isinstance(content, str):
        return content
    return "".join(b.get("text", "") for b in content or [] if isinstance(b, dict) and isinstance(b.get("text"), str))


def check_prompt_rows(rows, first_index: int = 0) -> None:
    """GRPO's prompt rows (TRL's format), checked before training: a dict with a 'prompt' (non-empty text
    or a message list), images only with a message-list prompt and as many as its image blocks, and the
    same columns in every row (each column goes to the reward functions as a list)."""
    if rows is None or len(rows) == 0:
        raise DataError("the dataset has no rows: GRPO needs rows with a 'prompt' column")
    first = None
    for i, row in enumerate(rows, first_index):
        if not isinstance(row, dict):
            raise DataError(f"row {i}: expected a dict of columns, got {type(row).__name__}")
        if "prompt" not in row:
            raise DataError(f"row {i}: GRPO data needs a 'prompt' column (a string or a list of messages); has "
                            f"{', '.join(map(repr, sorted(map(str, row)))) or 'none'}")
        prompt, images = row["prompt"], row_images(row)
        if isinstance(prompt, str):
            if not prompt.strip():
                raise DataError(f"row {i}: 'prompt' is empty")
            if images:
                raise DataError(f"row {i}: images need a conversational prompt (a list of messages), as in TRL")
        elif isinstance(prompt, list):
            messages = chatml(prompt)
            check_messages(messages, i, "prompt")
            fill_images(messages, images, i)
            template_kwargs(row, i)
            last = messages[-1]
            if last["role"] == "assistant" and not _text_of(last.get("content")).strip():
                raise DataError(f"row {i}: the prompt ends with an assistant message without text for the completion "
                                "to continue; end it with a user message, or give the assistant's opening words")
        else:
            raise DataError(f"row {i}: 'prompt' is {_short(prompt)} ({type(prompt).__name__}): use a string or a "
                            "list of messages")
        keys = set(map(str, row))
        if first is None:
            first = keys
        elif keys != first:
            missing, extra = sorted(first - keys), sorted(keys - first)
            what = (f"lacks column(s) {', '.join(map(repr, missing))}" if missing
                    else f"has column(s) {', '.join(map(repr, extra))}")
            raise DataError(f"row {i}: {what} that row {first_index} {'has' if missing else 'lacks'}: every row needs "
                            "the same columns (each is passed to the reward functions)")


# -------------------------------------------------------------------------------------- tokenisation

def with_eos(text: str, eos: str | None) -> str:
    """`text` ending with the end-of-sequence token (appended unless it is already there)."""
    return text if not eos or text.endswith(eos) else text + eos


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


def _assistant_mask(text: str, offsets: np.ndarray) -> np.ndarray:
    """1 for tokens overlapping an assistant turn's content + "<|im_end|>\\n" (char spans of the
    ChatML text; a token straddling the span's edge counts, as transformers' generation masks do)."""
    mask = np.zeros(len(offsets), dtype=bool)
    for m in _ASSISTANT_TURN.finditer(text):
        lo, hi = m.span(1)
        mask |= (offsets[:, 0] < hi) & (offsets[:, 1] > lo)
    return mask


_RESERVED_TEMPLATE_KWARGS = {"tokenize", "return_tensors", "return_dict", "images", "tools", "messages",
                             "conversation", "add_generation_prompt", "continue_final_message", "chat_template",
                             "padding", "padding_side", "truncation", "max_length"}


def template_kwargs(row: dict, index=None) -> dict:
    """The row's ``chat_template_kwargs`` column (TRL's per-row template arguments), checked."""
    where = f"row {index}" if index is not None else "row"
    extra = row.get("chat_template_kwargs") or {}
    if not isinstance(extra, dict):
        raise DataError(f"{where}: 'chat_template_kwargs' must be a dict, got {type(extra).__name__}")
    reserved = sorted(map(str, set(extra) & _RESERVED_TEMPLATE_KWARGS))
    if reserved or not all(isinstance(k, str) for k in extra):
        raise DataError(f"{where}: 'chat_template_kwargs' may not set {', '.join(reserved) or 'non-text keys'} "
                        "(the trainer sets them)")
    return extra


def render_chat(processor, messages, row: dict, index=None, **kwargs) -> str:
    """The chat template applied to `messages` with the row's ``tools`` and ``chat_template_kwargs``
    columns; whatever goes wrong is one line naming the row."""
    where = f"row {index}" if index is not None else "row"
    tools = row.get("tools")
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: 'tools' is not valid JSON ({e.msg} at column {e.colno})") from None
    if tools is not None and not isinstance(tools, list):
        raise DataError(f"{where}: 'tools' must be a list of tool schemas (or their JSON), got {type(tools).__name__}")
    extra = template_kwargs(row, index)
    try:
        return processor.apply_chat_template(messages, tools=tools, **extra, **kwargs)
    except MlxrlError:
        raise
    except Exception as e:  # jinja's errors (TemplateError, TypeError, ...) for what the template cannot render
        reason = (str(e).strip().splitlines() or [""])[0]
        raise DataError(f"{where}: the chat template cannot render it ({type(e).__name__}: {reason})") from None


def tokenize_example(row: dict, processor, *, index: int, max_length: int | None = 1024,
                     truncation_mode: str = "keep_start", completion_only_loss: bool | None = None,
                     assistant_only_loss: bool = False, dataset_text_field: str = "text") -> Example:
    """Tokenise one row as TRL's SFTTrainer would, expand its images and truncate it.

    processor: ``mlxrl.processing.processor.Processor`` (tokenizer, chat template, image processor for VL).
    completion_only_loss: None = True for prompt-completion rows. assistant_only_loss: conversational
    rows only. truncation_mode: "keep_start" or "keep_end" (both refuse to cut through an image).
    """
    fmt = detect_format(row, index, dataset_text_field)
    tok = processor.tokenizer
    images = row_images(row)
    prompt_text = None
    if fmt == "conversational":
        messages = chatml(row["messages"] if "messages" in row else row["conversations"])
        messages, images = fill_images(messages, images, index)
        text = render_chat(processor, messages, row, index)
    elif fmt == "prompt_completion" and not isinstance(row["prompt"], str):
        prompt, images = fill_images(chatml(row["prompt"]), images, index)
        prompt_text = render_chat(processor, prompt, row, index, add_generation_prompt=True)
        text = render_chat(processor, prompt + chatml(row["completion"]), row, index)
    else:
        if assistant_only_loss:
            raise DataError(f"row {index}: assistant_only_loss=True needs conversational rows ('messages' or "
                             f"message-list prompt/completion), this row is {fmt}")
        if fmt == "prompt_completion":
            prompt_text = row["prompt"]
            text = prompt_text + with_eos(row["completion"], tok.eos_token)
        else:
            text = with_eos(row[dataset_text_field], tok.eos_token)

    enc = tok(text, add_special_tokens=False, return_offsets_mapping=assistant_only_loss)
    ids = np.asarray(enc["input_ids"], dtype=np.int64)
    keep = np.ones(len(ids), dtype=bool)
    if completion_only_loss is None:
        completion_only_loss = fmt == "prompt_completion"
    if completion_only_loss and prompt_text is not None:
        prompt_ids = np.asarray(tok(prompt_text, add_special_tokens=False)["input_ids"], dtype=np.int64)
        keep[:common_prefix(prompt_ids, ids)] = False
    if assistant_only_loss:
        keep &= _assistant_mask(text, np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2))

    example = expand_images(ids, keep, images, processor, index)
    if max_length is not None:
        example = truncate_example(example, max_length, truncation_mode)
    return example


def expand_images(ids: np.ndarray, keep: np.ndarray, images: list, processor, index) -> Example:
    """Repeat each <|image_pad|> to its image's token count; labels follow ``keep``."""
    if images and processor.image_processor is None:
        raise DataError(f"row {index}: has images but the processor has no image processor (a text-only model)")
    at = np.flatnonzero(ids == processor.image_token_id)
    if len(at) != len(images):
        raise DataError(f"row {index}: the text has {len(at)} image placeholder(s) but the row has "
                         f"{len(images)} image(s)")
    labels = np.where(keep, ids, IGNORE_INDEX)
    if not images:
        return Example(ids.astype(np.int32), labels.astype(np.int32), index=index)
    grid = np.asarray([processor.image_processor.grid(*size) for size in image_sizes(images, index)],
                      dtype=np.int64).reshape(-1, 3)
    reps = np.ones(len(ids), dtype=np.int64)
    reps[at] = processor.image_processor.num_image_tokens(grid)
    starts = np.cumsum(reps) - reps  # position of each original token after expansion
    spans = np.stack([starts[at], starts[at] + reps[at]], axis=1)
    return Example(np.repeat(ids, reps).astype(np.int32), np.repeat(labels, reps).astype(np.int32), list(images),
                   None, grid, index, spans, processor.image_processor)


def image_patch_offsets(example: Example) -> np.ndarray:
    """[n+1] row offsets of each image's patches in ``pixel_values``."""
    if example.image_grid_thw is None:
        return np.zeros(1, dtype=np.int64)
    return np.concatenate([[0], np.cumsum(example.image_grid_thw.prod(axis=1))]).astype(np.int64)


def select_window(example: Example, start: int, stop: int) -> Example:
    """Tokens [start, stop) with the images wholly inside; an image cut by the window is an error
    (the caller words it)."""
    spans = example.image_spans
    inside = (spans[:, 0] >= start) & (spans[:, 1] <= stop)
    cut = ~inside & (spans[:, 0] < stop) & (spans[:, 1] > start)
    if cut.any():
        raise _ImageCut(int(np.flatnonzero(cut)[0]))
    keep = np.flatnonzero(inside)
    pixels = grid = None
    if len(keep):
        grid = example.image_grid_thw[keep]
        if example.pixels is not None:
            offsets = image_patch_offsets(example)
            pixels = np.concatenate([example.pixels[offsets[k]:offsets[k + 1]] for k in keep])
    return Example(example.input_ids[start:stop], example.labels[start:stop], [example.images[k] for k in keep],
                   pixels, grid, example.index, spans[keep] - start, example.image_processor)


class _ImageCut(Exception):
    def __init__(self, image: int):
        super().__init__(image)
        self.image = image


def truncate_example(example: Example, max_length: int, truncation_mode: str = "keep_start") -> Example:
    """Keep the first (keep_start) or last (keep_end) ``max_length`` tokens; images outside the kept
    window are dropped with their pixels; cutting through an image raises a one-line error."""
    if truncation_mode not in ("keep_start", "keep_end"):
        raise ValueError(f"truncation_mode must be 'keep_start' or 'keep_end', got {truncation_mode!r}")
    n = len(example)
    if n <= max_length:
        return example
    start, stop = (0, max_length) if truncation_mode == "keep_start" else (n - max_length, n)
    try:
        return select_window(example, start, stop)
    except _ImageCut as cut:
        s, e = (int(x) for x in example.image_spans[cut.image])
        need = e if truncation_mode == "keep_start" else n - s
        raise DataError(f"row {example.index}: truncating its {n} tokens to max_length={max_length} "
                         f"({truncation_mode}) would cut through image {cut.image} (tokens {s}..{e - 1}); "
                         f"use max_length >= {need} or smaller images") from None
