"""A row's images: opened from PIL images, paths, bytes or Hugging Face ``Image`` dicts, and filled
into the image blocks of its messages (TRL's rule); every problem one line naming the row.

Pictures are opened by `mlxrl.processing.pictures.open_image` (re-exported here), as transformers opens them."""

from __future__ import annotations

import os

from PIL import Image

from ..processing.pictures import open_image, upright_size
from .files import DataError

__all__ = ["decode_images", "fill_images", "image_sizes", "is_image_block", "open_image", "row_images",
           "upright_size"]

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
