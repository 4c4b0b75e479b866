"""Tokenizer, image processor and chat templates for Qwen and Qwen-VL models.

    from mlxrl.processing.processor import Processor
    proc = Processor.from_pretrained("path/to/Qwen3-VL-2B-Instruct")
    text = proc.apply_chat_template(messages, add_generation_prompt=True)
    batch = proc(text=[text], images=[[img]])   # input_ids, attention_mask, pixel_values, image_grid_thw

The image pipeline reproduces transformers' ``Qwen2VLImageProcessorPil`` (PIL resample, float64
rescale, float32 normalise, merge-aware patch order); ``tests/test_processing.py`` checks it.
Runs on numpy + PIL; the tokenizer is a transformers fast tokenizer.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
from PIL import Image

from .pictures import to_rgb  # noqa: F401  (processing.to_rgb: the processors' RGB rule)
from .tokenizer import (  # noqa: F401  (the templates and the tokenizer are part of processing's API)
    QWEN3_5_CHAT_TEMPLATE,
    QWEN3_5_NOTHINK_CHAT_TEMPLATE,
    QWEN3_VL_CHAT_TEMPLATE,
    QWEN_CHAT_TEMPLATE,
    QWEN_SPECIAL_TOKENS,
    QWEN_VL_CHAT_TEMPLATE,
    build_qwen3_5_tokenizer,
    build_qwen_tokenizer,
)

__all__ = ["QWEN_CHAT_TEMPLATE", "QWEN_VL_CHAT_TEMPLATE", "QWEN3_VL_CHAT_TEMPLATE", "QWEN3_5_CHAT_TEMPLATE",
           "QWEN3_5_NOTHINK_CHAT_TEMPLATE",
           "QWEN_SPECIAL_TOKENS", "build_qwen_tokenizer", "build_qwen3_5_tokenizer", "smart_resize", "ImageProcessor",
           "Processor"]

IMAGE_TOKEN = "<|image_pad|>"
VIDEO_TOKEN = "<|video_pad|>"
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


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
        x = to_rgb(image)  # [H, W, 3] uint8
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
    if model_type.startswith("qwen3_5"):
        return QWEN3_5_CHAT_TEMPLATE
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
