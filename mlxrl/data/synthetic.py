"""Synthetic visual question answering: the embedded default dataset of `python -m mlxrl.sft`.

    from mlxrl.data.synthetic import make_vqa
    train = make_vqa(2000, seed=0)                  # list of rows in TRL's vision conversational format
    test = make_vqa(200, seed=0, split="test")      # held-out scenes (a different random stream)

Each row: {"messages": [user: [image, question], assistant: [answer]], "images": [PIL.Image],
"type": question type}. Scenes are drawn with pillow; nothing is downloaded.

Design (why it looks like this):

- Questions must need the image: within a type, every (question text, answer) pair is dealt from
  a shuffled deck, so the answer given the text alone is uniform (per-text counts differ by at
  most one). `mlxrl.evaluate.text_only_baseline` measures it (0.25 for the default set; about
  0.33 with all four types); tests check it.
- Every answer is ONE word and ONE Qwen token, so exact match is fair and greedy-checkable.
- Question types (``TYPES``; ``DEFAULT_TYPES`` is what `make_vqa` draws unless told otherwise):
    color     one big shape:   "What color is the circle?"                  -> red|green|blue|yellow
    shape     one shape:       "What shape is the red object?"              -> circle|square|triangle
    count     1-3 equal shapes of one kind and colour:
                               "How many circles are there?"                -> 1|2|3
    position  two shapes, one per half, different colours:
                               "Is the red shape on the left or the right?" -> left|right
  Shape and count scenes size their boxes by sqrt(image area), so the coloured fraction of the
  image (a square fills its box, a circle 79%, a triangle 50%; n equal shapes n times one) is a
  cue next to the edges, which pooling over image tokens can read.
- Learnability by the embedded tiny Qwen3-VL (hidden 128, 4 layers, 2-block vision tower on
  16 px patches, one LM token per 32x32 px), measured with a plain loop (whole model trained,
  AdamW lr 2e-3, 20 warm-up steps then cosine, no clipping, batch 8, loss on answer + <|im_end|>):
  colour alone reaches 100% held-out in 150 steps on images of 96..128 px a side (seeds 0 and
  42; learned by step ~50). The spread of image sizes matters a lot: colour was learned by step
  ~50 at a fixed 96x96, ~75 at 96..128 and ~150 at 64..160. Mixed types do not reach 90% in a
  few hundred steps (300 steps: colour+shape 64%; colour+shape+count 50-60%, shape and count
  near chance), hence ``DEFAULT_TYPES = ("color",)`` and ``DEFAULT_SIDES = (96, 128)``: sizes
  and aspect ratios still vary (smart_resize gives 3x3, 3x4, 4x3 and 4x4 token grids). The
  harder types are there for longer runs (``types=TYPES, sides=(64, 160)``).
- Deterministic given (n, seed, split, types, sides); "train" and "test" are different random
  streams, so the test split is held-out scenes.
"""

from __future__ import annotations

import math

import numpy as np
from PIL import Image, ImageDraw

__all__ = ["COLORS", "SHAPES", "TYPES", "DEFAULT_TYPES", "DEFAULT_SIDES", "make_vqa", "draw_scene"]

# Saturated, well-separated colours (jittered a little per shape) on a near-white background.
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30), "green": (30, 160, 50), "blue": (30, 70, 220), "yellow": (235, 200, 20)}
SHAPES = ("circle", "square", "triangle")
COUNTS = ("1", "2", "3")
SIDES = ("left", "right")
TYPES = ("color", "shape", "count", "position")
DEFAULT_TYPES = ("color",)  # what the tiny default model learns to >= 90% in minutes (see above)
DEFAULT_SIDES = (96, 128)  # image width/height range in px
BACKGROUND = (245, 245, 245)
_SPLITS = {"train": 0, "test": 1}


def _question(qtype: str, key: str) -> str:
    if qtype == "color":
        return f"What color is the {key}?"
    if qtype == "shape":
        return f"What shape is the {key} object?"
    if qtype == "count":
        return f"How many {key}s are there?"
    return f"Is the {key} shape on the left or the right?"


def _pairs(qtype: str) -> list[tuple[str, str]]:
    """Every (question key, answer) pair of a type: dealing them evenly balances answers per text."""
    if qtype == "color":
        return [(s, c) for s in SHAPES for c in COLORS]
    if qtype == "shape":
        return [(c, s) for c in COLORS for s in SHAPES]
    if qtype == "count":
        return [(s, n) for s in SHAPES for n in COUNTS]
    return [(c, side) for c in COLORS for side in SIDES]


class _Deck:
    """Deals items in shuffled rounds: after k full rounds every item came out exactly k times."""

    def __init__(self, items, rng: np.random.Generator):
        self.items, self.rng, self.queue = list(items), rng, []

    def draw(self):
        if not self.queue:
            self.queue = [self.items[i] for i in self.rng.permutation(len(self.items))]
        return self.queue.pop()


# ------------------------------------------------------------------------------------------ drawing

def _jitter(rgb, rng: np.random.Generator, amount: int = 10) -> tuple[int, int, int]:
    return tuple(int(np.clip(v + rng.integers(-amount, amount + 1), 0, 255)) for v in rgb)


def draw_scene(width: int, height: int, objects, background=(245, 245, 245)) -> Image.Image:
    """objects: (shape, rgb, (x0, y0, size)) with the shape inside the size x size box at x0, y0."""
    img = Image.new("RGB", (width, height), background)
    draw = ImageDraw.Draw(img)
    for shape, rgb, (x0, y0, s) in objects:
        box = (x0, y0, x0 + s - 1, y0 + s - 1)
        if shape == "circle":
            draw.ellipse(box, fill=rgb)
        elif shape == "square":
            draw.rectangle(box, fill=rgb)
        elif shape == "triangle":
            draw.polygon([(x0 + s / 2, y0), (x0 + s - 1, y0 + s - 1), (x0, y0 + s - 1)], fill=rgb)
        else:
            raise ValueError(f"unknown shape {shape!r}; expected one of {SHAPES}")
    return img


def _place(rng: np.random.Generator, width: int, height: int, k: int, lo: float, hi: float, ref: float,
           xrange: tuple[int, int] | None = None) -> list[tuple[int, int, int]]:
    """k non-overlapping square boxes (with a gap) of side lo..hi x ref pixels.

    xrange confines the boxes horizontally (the position questions use one half each)."""
    x_lo, x_hi = xrange or (0, width)
    for attempt in range(200):
        shrink = 0.9 ** (attempt // 40)  # crowded canvas: smaller boxes rather than endless retries
        boxes = []
        for _ in range(k):
            s = int(ref * rng.uniform(lo, hi) * shrink)
            s = max(12, min(s, x_hi - x_lo - 2, height - 2))
            x = int(rng.integers(x_lo + 1, x_hi - s))
            y = int(rng.integers(1, height - s))
            boxes.append((x, y, s))
        gap = 4
        if all(a[0] + a[2] + gap <= b[0] or b[0] + b[2] + gap <= a[0] or
               a[1] + a[2] + gap <= b[1] or b[1] + b[2] + gap <= a[1]
               for i, a in enumerate(boxes) for b in boxes[i + 1:]):
            return boxes
    raise RuntimeError(f"could not place {k} shapes on a {width}x{height} canvas")


def _scene(qtype: str, key: str, answer: str, rng: np.random.Generator, sides: tuple[int, int]) -> Image.Image:
    width, height = (int(v) for v in rng.integers(sides[0], sides[1] + 1, size=2))
    colors, shapes = list(COLORS), list(SHAPES)
    col = lambda name: _jitter(COLORS[name], rng)
    # shape and count scenes scale their boxes with sqrt(image area): the coloured fraction of the
    # image then also tells the shape (box filled 100% / 79% / 50%) and the count, a cue that
    # pooling over image tokens finds early in training, next to the edges that define shapes
    area = math.sqrt(width * height)
    if qtype == "color":
        objects = [(key, col(answer), _place(rng, width, height, 1, 0.55, 0.85, min(width, height))[0])]
    elif qtype == "shape":
        objects = [(answer, col(key), _place(rng, width, height, 1, 0.57, 0.6, area)[0])]
    elif qtype == "count":
        rgb = col(colors[rng.integers(4)])
        objects = [(key, rgb, b) for b in _place(rng, width, height, int(answer), 0.29, 0.31, area)]
    elif qtype == "position":
        other = [c for c in colors if c != key][rng.integers(3)]
        half, short = width // 2, min(width, height)
        left = _place(rng, width, height, 1, 0.3, 0.5, short, (0, half))[0]
        right = _place(rng, width, height, 1, 0.3, 0.5, short, (half, width))[0]
        named, unnamed = (left, right) if answer == "left" else (right, left)
        objects = [(shapes[rng.integers(3)], col(key), named), (shapes[rng.integers(3)], col(other), unnamed)]
    else:
        raise ValueError(f"unknown question type {qtype!r}; expected one of {TYPES}")
    return draw_scene(width, height, objects, BACKGROUND)


# ------------------------------------------------------------------------------------------ dataset

def make_vqa(n: int, seed: int = 0, split: str = "train", types=DEFAULT_TYPES,
             sides: tuple[int, int] = DEFAULT_SIDES) -> list[dict]:
    """n rows of synthetic VQA in TRL's vision conversational format (plus a "type" key).

    types: question types to draw (a subset of TYPES). sides: (min, max) image width and height.
    Types are dealt from a shuffled deck; within a type, (question, answer) pairs are dealt evenly,
    so no question text predicts its answer. Deterministic given all arguments.
    """
    if split not in _SPLITS:
        raise ValueError(f"split must be one of {tuple(_SPLITS)}, got {split!r}")
    bad = [t for t in types if t not in TYPES]
    if bad or not types:
        raise ValueError(f"types must be a non-empty subset of {TYPES}, got {tuple(types)}")
    lo, hi = (int(v) for v in sides)
    if not 48 <= lo <= hi:
        raise ValueError(f"sides must be (min, max) with 48 <= min <= max, got {tuple(sides)}")
    rng = np.random.default_rng([int(seed), _SPLITS[split]])
    type_deck = _Deck(types, rng)
    pair_decks = {t: _Deck(_pairs(t), rng) for t in types}
    rows = []
    for _ in range(n):
        qtype = type_deck.draw()
        key, answer = pair_decks[qtype].draw()
        image = _scene(qtype, key, answer, rng, (lo, hi))
        rows.append({
            "messages": [
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": _question(qtype, key)}]},
                {"role": "assistant", "content": [{"type": "text", "text": answer}]},
            ],
            "images": [image],
            "type": qtype,
        })
    return rows


# Objects and colours of the text variant of the synthetic task (for text-only models).
_TEXT_SHAPES = ("circle", "square", "triangle", "star")


def text_colour_rows(n: int, seed: int = 0, split: str = "train") -> list[dict]:
    """The synthetic colour task in words, for text-only models: two coloured shapes are described and the
    question asks the colour of one ("A red circle and a blue square. What color is the square?" -> blue);
    one-word answers, rows shaped like `make_vqa`'s without images. Deterministic in (n, seed, split)."""
    colours = list(COLORS)
    rng = np.random.default_rng([int(seed), {"train": 0, "test": 1}[split], 7])
    rows = []
    for _ in range(n):
        shapes = rng.choice(len(_TEXT_SHAPES), 2, replace=False)
        cols = rng.choice(len(colours), 2, replace=False)
        a, b = (_TEXT_SHAPES[k] for k in shapes)
        ca, cb = (colours[k] for k in cols)
        asked = int(rng.integers(2))
        question = f"A {ca} {a} and a {cb} {b}. What color is the {(a, b)[asked]}? Answer with one word."
        rows.append({"messages": [{"role": "user", "content": [{"type": "text", "text": question}]},
                                  {"role": "assistant", "content": [{"type": "text", "text": (ca, cb)[asked]}]}],
                     "type": "color"})
    return rows


def demo_rows(processor, n: int, seed: int, split: str) -> list[dict]:
    """The embedded task's rows: synthetic VQA for a vision-language model, its text variant otherwise."""
    if processor.image_processor is None:
        return text_colour_rows(n, seed=seed, split=split)
    return make_vqa(n, seed=seed, split=split)
