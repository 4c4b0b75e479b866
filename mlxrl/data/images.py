"""A row's images: opened from PIL images, paths, bytes or Hugging Face ``Image`` dicts, and filled
into the image blocks of its messages (TRL's rule); every problem one line naming the row.

`open_image` is the one place mlxrl opens a picture from a path or bytes: training data here,
`processing.to_rgb`'s path branch, `python -m mlxrl.generate --image`, the chat's `/image` and
`python -m mlxrl --image` all go through it."""

from __future__ import annotations

import io
import os

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from ..processing import to_rgb
from .files import DataError

__all__ = ["decode_images", "fill_images", "image_sizes", "is_image_block", "open_image", "row_images",
           "upright_size"]

ORIENTATION = 0x0112  # the EXIF Orientation tag
SIDEWAYS = (5, 6, 7, 8)  # orientations that exif_transpose turns by 90 degrees: width and height swap


def _open(source) -> Image.Image:
    """PIL's lazy open of a path, bytes or Hugging Face Image dict: the header only. `Image.open` is where
    PIL refuses a decompression bomb (more than 2 x `Image.MAX_IMAGE_PIXELS` pixels), as it does for
    transformers' `load_image`."""
    if isinstance(source, dict):  # Hugging Face Image feature, undecoded
        if source.get("bytes") is not None:
            return Image.open(io.BytesIO(source["bytes"]))
        if source.get("path"):
            return _open(source["path"])
        raise ValueError("image dict has neither 'bytes' nor 'path'")
    if isinstance(source, (bytes, bytearray)):
        return Image.open(io.BytesIO(source))
    if isinstance(source, (str, os.PathLike)):
        if not os.path.exists(source):
            raise FileNotFoundError("no such file")
        if os.path.isdir(source):
            raise IsADirectoryError("is a folder, not an image file")
        return Image.open(source)
    raise TypeError(f"unsupported image type {type(source).__name__}")


def _reason(e: Exception) -> str:
    """One line for what went wrong opening a picture."""
    text = (str(e).strip().splitlines() or [""])[0]
    if isinstance(e, Image.DecompressionBombError):  # not an OSError: it must be named on its own
        return (f"too many pixels to open safely ({text}); PIL refuses it as a possible decompression bomb, "
                "as transformers' load_image does: downscale the picture")
    if isinstance(e, (FileNotFoundError, IsADirectoryError)) and not e.filename:  # ours, from _open
        return text
    if isinstance(e, (UnidentifiedImageError, OSError)):
        return f"not a readable image ({text})"
    return f"{type(e).__name__}: {text}"


def open_image(source, what: str) -> Image.Image:
    """`source` as an RGB PIL image, opened as transformers' `load_image` opens a path (and datasets'
    ``Image`` feature decodes a file): PIL's decompression-bomb limit, then `ImageOps.exif_transpose`, so
    that a portrait phone photo stored sideways (EXIF Orientation 6 or 8) comes out upright, then RGB.

    The RGB rule is the Qwen-VL processors' (`processing.to_rgb`, transformers' `convert_to_rgb`):
    transparency composited onto white. `load_image`'s own ``convert("RGB")`` would keep the colours
    hidden under transparent pixels instead; with one rule, a picture given as a path and the same
    picture decoded by datasets (which keeps its mode) reach the model as the same pixels. L, P, CMYK, ...
    without transparency convert as ``convert("RGB")`` does in both.

    A PIL image (or a uint8 array) given as such is converted but not transposed: transformers'
    processors do not transpose one either. Whatever goes wrong is a `DataError`: ``"{what}: reason"``."""
    try:
        if isinstance(source, np.ndarray):
            source = Image.fromarray(source)
        if isinstance(source, Image.Image):
            return Image.fromarray(to_rgb(source))
        image = _open(source)
        try:
            upright = ImageOps.exif_transpose(image)  # decodes the pixels (a copy, transposed or not)
        finally:
            image.close()
        return Image.fromarray(to_rgb(upright))
    except Exception as e:
        raise DataError(f"{what}: {_reason(e)}") from None


def upright_size(source, what: str) -> tuple[int, int]:
    """(height, width) of `source` as `open_image` will return it, reading only the header of a file: the
    EXIF orientation from what the header holds (PIL's generic `Image.getexif`: a PNG's own `getexif`
    would decode the whole picture to look for an eXIf chunk after the pixel data; such a rare file is
    caught when decoded, where the sizes are compared)."""
    try:
        if isinstance(source, np.ndarray):
            source = Image.fromarray(source)
        if isinstance(source, Image.Image):
            width, height = source.size
            return height, width
        with _open(source) as image:
            width, height = image.size
            orientation = Image.Image.getexif(image).get(ORIENTATION, 1)
    except Exception as e:
        raise DataError(f"{what}: {_reason(e)}") from None
    return (width, height) if orientation in SIDEWAYS else (height, width)


def describe(obj) -> str:
    if isinstance(obj, (str, os.PathLike)):
        return repr(str(obj))
    if isinstance(obj, dict) and obj.get("path"):
        return repr(str(obj["path"]))
    return type(obj).__name__


def _what(index, k: int, obj) -> str:
    return f"row {index}: cannot read image {k} ({describe(obj)})"


def decode_images(images: list, index) -> list[Image.Image]:
    """The row's images as upright RGB PIL images (`open_image`)."""
    return [open_image(obj, _what(index, k, obj)) for k, obj in enumerate(images)]


def image_sizes(images: list, index) -> list[tuple[int, int]]:
    """(height, width) of each image as `decode_images` will decode it, reading only what PIL needs for
    the size (the header)."""
    return [upright_size(obj, _what(index, k, obj)) for k, obj in enumerate(images)]


def row_images(row: dict) -> list:
    if row.get("images") is not None:
        images = row["images"]
        return list(images) if isinstance(images, (list, tuple)) else [images]
    if row.get("image") is not None:
        return [row["image"]]
    return []


def is_image_block(block) -> bool:
    return isinstance(block, dict) and (block.get("type") == "image" or "image" in block or "image_url" in block)


def fill_images(messages: list[dict], images: list, index) -> tuple[list[dict], list]:
    """Fill image blocks from the ``images`` column, in order (TRL's prepare_multimodal_messages).

    With no image block anywhere, the images go before the first user message's text. Blocks that
    carry their own ``image`` keep it. Returns the messages and every image in block order."""
    blocks = [b for m in messages if isinstance(m.get("content"), list) for b in m["content"] if is_image_block(b)]
    if images and not blocks:
        first = next((i for i, m in enumerate(messages) if m.get("role") == "user"), None)
        if first is None:
            raise DataError(f"row {index}: {len(images)} image(s) but no user message to put them in")
        content = messages[first].get("content")
        content = [{"type": "text", "text": content}] if isinstance(content, str) else list(content or [])
        messages = [*messages[:first], {**messages[first], "content": [{"type": "image"} for _ in images] + content},
                    *messages[first + 1:]]
    empty = sum(1 for m in messages if isinstance(m.get("content"), list)
                for b in m["content"] if is_image_block(b) and b.get("image") is None)
    if empty != len(images):
        raise DataError(f"row {index}: the messages have {empty} image block(s) to fill but the row has "
                         f"{len(images)} image(s)")
    pending, ordered, out = iter(images), [], []
    for m in messages:
        if isinstance(m.get("content"), list):
            content = []
            for b in m["content"]:
                if is_image_block(b):
                    b = {**b, "type": "image", "image": b["image"] if b.get("image") is not None else next(pending)}
                    ordered.append(b["image"])
                content.append(b)
            m = {**m, "content": content}
        out.append(m)
    return out, ordered
