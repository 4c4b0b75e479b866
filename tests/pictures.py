"""Test pictures: a coloured background with three random rectangles (deterministic by seed)."""

import numpy as np
from PIL import Image, ImageDraw


def picture(w, h, seed):
    rng = np.random.default_rng(seed)
    img = Image.new("RGB", (w, h), tuple(int(c) for c in rng.integers(0, 255, 3)))
    d = ImageDraw.Draw(img)
    for _ in range(3):
        x0, y0 = rng.integers(0, w // 2), rng.integers(0, h // 2)
        d.rectangle([x0, y0, x0 + w // 3, y0 + h // 3], fill=tuple(int(c) for c in rng.integers(0, 255, 3)))
    return img
