"""Opening pictures as transformers opens them, and their RGB pixels: `open_image` is the one place
mlxrl opens a picture from a path or bytes (training data, `processing`'s image processor, `python -m
mlxrl.generate --image`, the chat's `/image`, `python -m mlxrl --image`); `to_rgb` is the processors'
RGB rule."""

from __future__ import annotations

import io
import os

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from ..errors import DataError

__all__ = ["open_image", "to_rgb", "upright_size"]

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


def to_rgb(image) -> np.ndarray:
    """PIL / uint8 array / path -> HWC uint8 RGB; transparency is composited onto white (as HF does).
    A path is opened by `open_image`, as transformers' `load_image` opens one (EXIF orientation
    applied, PIL's decompression-bomb limit)."""
    if isinstance(image, (str, os.PathLike)):
        image = open_image(image, f"image {os.fspath(image)!r}")
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
