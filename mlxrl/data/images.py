"""A row's images: opened from PIL images, paths, bytes or Hugging Face ``Image`` dicts, and filled
into the image blocks of its messages (TRL's rule); every problem one line naming the row."""

from __future__ import annotations

import io
import os

import numpy as np
from PIL import Image

from ..processing import to_rgb
from .files import DataError

__all__ = ["decode_images", "fill_images", "image_sizes", "is_image_block", "row_images"]


def open_image(obj) -> Image.Image:
    if isinstance(obj, Image.Image):
        return obj
    if isinstance(obj, dict):  # Hugging Face Image feature, undecoded
        if obj.get("bytes") is not None:
            return Image.open(io.BytesIO(obj["bytes"]))
        if obj.get("path"):
            return Image.open(obj["path"])
        raise ValueError("image dict has neither 'bytes' nor 'path'")
    if isinstance(obj, (bytes, bytearray)):
        return Image.open(io.BytesIO(obj))
    if isinstance(obj, (str, os.PathLike)):
        return Image.open(obj)
    if isinstance(obj, np.ndarray):
        return Image.fromarray(obj)
    raise TypeError(f"unsupported image type {type(obj).__name__}")


def describe(obj) -> str:
    if isinstance(obj, (str, os.PathLike)):
        return repr(str(obj))
    if isinstance(obj, dict) and obj.get("path"):
        return repr(str(obj["path"]))
    return type(obj).__name__


def decode_images(images: list, index) -> list[Image.Image]:
    out = []
    for k, obj in enumerate(images):
        try:
            im = open_image(obj)
            im.load()
            out.append(Image.fromarray(to_rgb(im)))  # the processor's RGB rule: alpha onto white
        except Exception as e:
            reason = (str(e).strip().splitlines() or [""])[0]
            raise DataError(f"row {index}: cannot read image {k} ({describe(obj)}): "
                             f"{type(e).__name__}: {reason}") from None
    return out


def image_sizes(images: list, index) -> list[tuple[int, int]]:
    """(height, width) of each image, reading only what PIL needs for the size (the header)."""
    sizes = []
    for k, obj in enumerate(images):
        try:
            im = open_image(obj)
            width, height = im.size
            if im is not obj:
                im.close()
        except Exception as e:
            reason = (str(e).strip().splitlines() or [""])[0]
            raise DataError(f"row {index}: cannot read image {k} ({describe(obj)}): "
                             f"{type(e).__name__}: {reason}") from None
        sizes.append((height, width))
    return sizes


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
