"""Synthetic visual questions for the demo model, drawn with Pillow.

Every sample is a function of one ``random.Random``: the same generator state gives
the same image (byte for byte), question and answer. Training draws sample ``i`` of a
run from ``sample_at(seed, i)``, so the data does not depend on how many loader
workers produce it; evaluation draws a held-out set from another seed with
``held_out(seed, n)``, balanced over the question types.

Images vary in size (96-640 px a side, aspect up to 1.6), background (flat, gradient,
noise) and encoding (JPEG at quality 30-95, or lossless); the model's processor later
resizes them to its fixed square, so sizes and positions are stated relative to the
image.
"""

from __future__ import annotations

import io
import math
import random
import re
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Literal, NamedTuple

import numpy as np
from PIL import Image, ImageDraw, ImageFont

QType = Literal["color", "shape", "count", "position", "size", "digit", "word"]
QTYPES: tuple[QType, ...] = ("color", "shape", "count", "position", "size", "digit", "word")

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 35),
    "green": (35, 165, 60),
    "blue": (40, 80, 225),
    "yellow": (245, 220, 30),
    "orange": (250, 135, 20),
    "purple": (135, 50, 185),
    "white": (248, 248, 248),
    "black": (18, 18, 18),
}
SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "star", "diamond", "cross")
PLURALS: dict[str, str] = {s: ("crosses" if s == "cross" else s + "s") for s in SHAPES}
WORDS: tuple[str, ...] = ("cat", "dog", "sun", "car", "cup", "key", "tree", "fish", "bird", "moon", "lamp", "ship")
DIGITS: tuple[str, ...] = tuple(str(d) for d in range(10))
MAX_COUNT = 6

# Question templates; {k} a shape, {p} its plural, {c} a colour, {s} a side or a size.
COLOR_OF_KIND = ("What color is the {k}?", "What colour is the {k}?", "What is the color of the {k}?")
COLOR_OF_ONLY = ("What color is the shape?", "What color is this shape?")
SHAPE_OF_ONLY = ("What shape is this?", "What shape is shown?", "What shape is in the image?", "Which shape is this?")
SHAPE_OF_COLOR = ("What shape is {c}?", "Which shape is {c}?", "What is the {c} shape?")
COUNT_OF_KIND = ("How many {p} are there?", "How many {p} are in the image?", "Count the {p}.")
COUNT_ALL = ("How many shapes are there?", "How many objects are in the image?",
             "How many shapes are in the picture?", "Count the shapes.")
SIDE_OF_ONE_X = ("Is the {k} on the left or the right?", "Is the {k} on the left or right side?")
SIDE_OF_ONE_Y = ("Is the {k} at the top or the bottom?", "Is the {k} at the top or bottom?")
WHICH_SIDE_X = "Which shape is on the {s}?"
WHICH_SIDE_Y = "Which shape is at the {s}?"
RELATIVE_X = "Is the {a} left or right of the {b}?"
RELATIVE_Y = "Is the {a} above or below the {b}?"
SIZE_OF_ONE = ("Is the {k} big or small?", "Is the {k} small or big?")
SIZE_OF_COLORED = ("Is the {c} {k} big or small?", "Is the {c} {k} small or big?")
COLOR_OF_SIZED = "What color is the {s} {k}?"
READ_DIGIT = ("What digit is shown?", "What number is written?", "Which digit is this?", "What number is in the image?")
READ_WORD = ("What word is written?", "What does the text say?", "What word is shown?", "Read the word.")
ALL_TEMPLATES: tuple[str, ...] = (
    *COLOR_OF_KIND, *COLOR_OF_ONLY, *SHAPE_OF_ONLY, *SHAPE_OF_COLOR, *COUNT_OF_KIND, *COUNT_ALL,
    *SIDE_OF_ONE_X, *SIDE_OF_ONE_Y, WHICH_SIDE_X, WHICH_SIDE_Y, RELATIVE_X, RELATIVE_Y,
    *SIZE_OF_ONE, *SIZE_OF_COLORED, COLOR_OF_SIZED, *READ_DIGIT, *READ_WORD,
)

MIN_SIDE, MAX_SIDE, MAX_ASPECT = 96, 640, 1.6
COLOR_JITTER = 14
MIN_CONTRAST = 140.0  # Euclidean RGB distance wanted between an object colour and the background


class Sample(NamedTuple):
    """One visual question: the image, the question, its one-word answer, its type."""

    image: Image.Image
    question: str
    answer: str
    qtype: QType


class Shape(NamedTuple):
    """One drawn object: kind, colour name, centre and circumradius in pixels, turn in degrees."""

    kind: str
    color: str
    cx: float
    cy: float
    r: float
    angle: float = 0.0


class TextBox(NamedTuple):
    """Rendered text and the pixel box ``(left, top, right, bottom)`` its ink lies in."""

    text: str
    box: tuple[int, int, int, int]


class Scene(NamedTuple):
    """Where everything in a picture is: what training's per-patch targets are made from."""

    size: tuple[int, int]
    shapes: tuple[Shape, ...] = ()
    text: TextBox | None = None


Annotated = tuple[Sample, Scene]


# --- drawing -------------------------------------------------------------------------

def _star_points(r: float) -> list[tuple[float, float]]:
    points = []
    for k in range(10):
        radius = r if k % 2 == 0 else r * 0.45
        angle = -math.pi / 2 + k * math.pi / 5
        points.append((radius * math.cos(angle), radius * math.sin(angle)))
    return points


def _cross_points(r: float) -> list[tuple[float, float]]:
    a, b = r, r * 0.34
    return [(-b, -a), (b, -a), (b, -b), (a, -b), (a, b), (b, b),
            (b, a), (-b, a), (-b, b), (-a, b), (-a, -b), (-b, -b)]


def _outline(kind: str, r: float) -> list[tuple[float, float]]:
    """Polygon of a shape of circumradius about ``r``, centred on the origin, upright."""
    if kind == "circle":
        return [(r * math.cos(t), r * math.sin(t)) for t in np.linspace(0, 2 * math.pi, 48, endpoint=False)]
    if kind == "square":
        s = r * 0.8
        return [(-s, -s), (s, -s), (s, s), (-s, s)]
    if kind == "triangle":
        return [(0.0, -r), (r * 0.95, r * 0.7), (-r * 0.95, r * 0.7)]
    if kind == "diamond":
        return [(0.0, -r), (r * 0.8, 0.0), (0.0, r), (-r * 0.8, 0.0)]
    if kind == "star":
        return _star_points(r)
    if kind == "cross":
        return _cross_points(r)
    raise ValueError(f"unknown shape {kind!r}; known: {', '.join(SHAPES)}")


def _rotated(points: list[tuple[float, float]], degrees: float) -> list[tuple[float, float]]:
    c, s = math.cos(math.radians(degrees)), math.sin(math.radians(degrees))
    return [(x * c - y * s, x * s + y * c) for x, y in points]


def _jittered(rgb: tuple[int, int, int], rng: random.Random) -> tuple[int, int, int]:
    return tuple(min(255, max(0, v + rng.randint(-COLOR_JITTER, COLOR_JITTER))) for v in rgb)


def shape_polygon(shape: Shape) -> list[tuple[float, float]]:
    """The outline of ``shape`` in picture coordinates."""
    return [(shape.cx + x, shape.cy + y) for x, y in _rotated(_outline(shape.kind, shape.r), shape.angle)]


def _draw_shape(draw: ImageDraw.ImageDraw, shape: Shape, rng: random.Random) -> None:
    draw.polygon(shape_polygon(shape), fill=_jittered(COLORS[shape.color], rng))


@lru_cache(maxsize=256)
def _font(size: int) -> ImageFont.FreeTypeFont:
    return ImageFont.load_default(size=size)


# --- canvas --------------------------------------------------------------------------

def _canvas_size(rng: random.Random) -> tuple[int, int]:
    base = math.exp(rng.uniform(math.log(MIN_SIDE), math.log(MAX_SIDE)))  # small pictures as often as large
    aspect = math.exp(rng.uniform(-math.log(MAX_ASPECT), math.log(MAX_ASPECT)))
    width = int(min(MAX_SIDE, max(MIN_SIDE, base * math.sqrt(aspect))))
    height = int(min(MAX_SIDE, max(MIN_SIDE, base / math.sqrt(aspect))))
    return width, height


def _distance(a: Sequence[float], b: Sequence[float]) -> float:
    return math.dist(a, b)


def _background_color(rng: random.Random, avoid: Sequence[str]) -> tuple[int, int, int]:
    """A muted colour far from every object colour in ``avoid``.

    The first draw at least ``MIN_CONTRAST`` away from all of them wins; with many
    object colours there may be none, and then the farthest of the draws does.
    """
    best, best_distance = (128, 128, 128), -1.0
    for _ in range(64):
        gray = rng.uniform(20, 235)
        saturation = rng.uniform(0.0, 0.6)
        rgb = tuple(int(gray + (rng.uniform(0, 255) - gray) * saturation) for _ in range(3))
        distance = min(_distance(rgb, COLORS[name]) for name in avoid)
        if distance >= MIN_CONTRAST:
            return rgb
        if distance > best_distance:
            best, best_distance = rgb, distance
    return best


def _background(rng: random.Random, size: tuple[int, int], avoid: Sequence[str]) -> Image.Image:
    """A flat, gradient or noisy background whose colour stands apart from ``avoid``."""
    width, height = size
    base = _background_color(rng, avoid)
    style = rng.choice(("flat", "gradient", "noise"))
    if style == "flat":
        return Image.new("RGB", size, base)
    if style == "gradient":
        delta = np.array([rng.uniform(-35, 35) for _ in range(3)], dtype=np.float32)
        along_x = rng.random() < 0.5
        ramp = np.linspace(-0.5, 0.5, width if along_x else height, dtype=np.float32)[:, None] * delta
        line = np.clip(np.array(base, dtype=np.float32) + ramp, 0, 255).astype(np.uint8)
        pixels = np.broadcast_to(line[None, :, :] if along_x else line[:, None, :], (height, width, 3))
        return Image.fromarray(np.ascontiguousarray(pixels), "RGB")
    # Grain two pixels wide: drawing it at a quarter of the area keeps the generator fast,
    # and the model sees the picture shrunk far below that scale anyway.
    grain = (max(1, height // 2), max(1, width // 2), 3)
    noise = np.random.default_rng(rng.getrandbits(64)).standard_normal(grain, dtype=np.float32)
    pixels = np.clip(noise * rng.uniform(4, 18) + np.array(base, dtype=np.float32), 0, 255).astype(np.uint8)
    return Image.fromarray(pixels, "RGB").resize(size, Image.NEAREST)


def _encoded(image: Image.Image, rng: random.Random) -> Image.Image:
    """The image as a camera or a web page would hand it over: mostly JPEG, sometimes lossless."""
    if rng.random() < 0.25:
        return image
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=rng.randint(30, 95))
    buffer.seek(0)
    decoded = Image.open(buffer)
    decoded.load()
    return decoded


# --- placement -----------------------------------------------------------------------

def _place(rng: random.Random, size: tuple[int, int], radii: Sequence[float],
           x_range: Sequence[tuple[float, float]] | None = None,
           y_range: Sequence[tuple[float, float]] | None = None) -> list[tuple[float, float]] | None:
    """Centres for circles of ``radii`` inside the image, apart from each other; None if they don't fit.

    ``x_range`` / ``y_range`` give, per object, the allowed interval of its centre as
    fractions of the width / height.
    """
    width, height = size
    gap = 0.03 * min(size)
    centres: list[tuple[float, float]] = []
    for i, r in enumerate(radii):
        x_lo, x_hi = x_range[i] if x_range else (0.0, 1.0)
        y_lo, y_hi = y_range[i] if y_range else (0.0, 1.0)
        x_lo, x_hi = max(r, x_lo * width), min(width - r, x_hi * width)
        y_lo, y_hi = max(r, y_lo * height), min(height - r, y_hi * height)
        if x_lo > x_hi or y_lo > y_hi:
            return None
        for _ in range(100):
            c = (rng.uniform(x_lo, x_hi), rng.uniform(y_lo, y_hi))
            if all(_distance(c, o) >= r + radii[j] + gap for j, o in enumerate(centres)):
                centres.append(c)
                break
        else:
            return None
    return centres


def _scene(rng: random.Random, kinds: Sequence[str], colors: Sequence[str],
           radius_fractions: Sequence[float], **ranges: Sequence[tuple[float, float]]) -> tuple[Image.Image, Scene] | None:
    size = _canvas_size(rng)
    radii = [f * min(size) for f in radius_fractions]
    centres = _place(rng, size, radii, **ranges)
    if centres is None:
        return None
    image = _background(rng, size, colors)
    draw = ImageDraw.Draw(image)
    # Small turns only: a square turned by 45 degrees is a diamond.
    shapes = tuple(Shape(k, c, x, y, r, rng.uniform(-12, 12)) for k, c, (x, y), r in zip(kinds, colors, centres, radii))
    for shape in shapes:
        _draw_shape(draw, shape, rng)
    return _encoded(image, rng), Scene(size, shapes)


def _distinct(rng: random.Random, pool: Sequence[str], n: int) -> list[str]:
    return rng.sample(list(pool), n)


# --- question types ------------------------------------------------------------------
# Each returns None when a random layout does not fit; the caller draws again.

def _one_to_three(rng: random.Random) -> tuple[Image.Image, Scene, Shape, int] | None:
    """One shape, or two or three of distinct kinds and colours; and the one a question asks about."""
    n = 1 if rng.random() < 0.5 else rng.randint(2, 3)
    kinds, colors = _distinct(rng, SHAPES, n), _distinct(rng, COLORS, n)
    fractions = [rng.uniform(0.12, 0.35) if n == 1 else rng.uniform(0.08, 0.2) for _ in range(n)]
    scene = _scene(rng, kinds, colors, fractions)
    if scene is None:
        return None
    image, layout = scene
    return image, layout, rng.choice(layout.shapes), n


def _color_question(rng: random.Random) -> Annotated | None:
    drawn = _one_to_three(rng)
    if drawn is None:
        return None
    image, layout, target, n = drawn
    templates = COLOR_OF_KIND + (COLOR_OF_ONLY if n == 1 else ())
    return Sample(image, rng.choice(templates).format(k=target.kind), target.color, "color"), layout


def _shape_question(rng: random.Random) -> Annotated | None:
    drawn = _one_to_three(rng)
    if drawn is None:
        return None
    image, layout, target, n = drawn
    templates = SHAPE_OF_ONLY if n == 1 else SHAPE_OF_COLOR
    return Sample(image, rng.choice(templates).format(c=target.color), target.kind, "shape"), layout


def _count_question(rng: random.Random) -> Annotated | None:
    n = rng.randint(1, MAX_COUNT)
    same_kind = rng.random() < 0.4
    kinds = [rng.choice(SHAPES)] * n if same_kind else [rng.choice(SHAPES) for _ in range(n)]
    colors = [rng.choice(list(COLORS)) for _ in range(n)]
    top = 0.16 if n <= 3 else 0.12
    scene = _scene(rng, kinds, colors, [rng.uniform(0.06, top) for _ in range(n)])
    if scene is None:
        return None
    if same_kind:
        question = rng.choice(COUNT_OF_KIND).format(p=PLURALS[kinds[0]])
    else:
        question = rng.choice(COUNT_ALL)
    return Sample(scene[0], question, str(n), "count"), scene[1]


_OUTER = ((0.0, 0.36), (0.64, 1.0))  # first / second third of an axis, with a margin


def _position_question(rng: random.Random) -> Annotated | None:
    horizontal = rng.random() < 0.5
    side = rng.randint(0, 1)  # 0: left / top, 1: right / bottom
    names = ("left", "right") if horizontal else ("top", "bottom")
    if rng.random() < 0.5:
        kind, color = rng.choice(SHAPES), rng.choice(list(COLORS))
        ranges = {"x_range" if horizontal else "y_range": [_OUTER[side]]}
        scene = _scene(rng, [kind], [color], [rng.uniform(0.08, 0.16)], **ranges)
        if scene is None:
            return None
        template = rng.choice(SIDE_OF_ONE_X if horizontal else SIDE_OF_ONE_Y)
        return Sample(scene[0], template.format(k=kind), names[side], "position"), scene[1]

    kinds, colors = _distinct(rng, SHAPES, 2), _distinct(rng, COLORS, 2)
    ranges = {"x_range" if horizontal else "y_range": [_OUTER[0], _OUTER[1]]}
    scene = _scene(rng, kinds, colors, [rng.uniform(0.08, 0.16) for _ in range(2)], **ranges)
    if scene is None:
        return None
    first, second = kinds  # first is on the left / top
    style = rng.randint(0, 1)
    if style == 0:
        template = WHICH_SIDE_X if horizontal else WHICH_SIDE_Y
        return Sample(scene[0], template.format(s=names[side]), kinds[side], "position"), scene[1]
    asked, other = (first, second) if rng.random() < 0.5 else (second, first)
    answer = names[0] if asked == first else names[1]
    template = RELATIVE_X if horizontal else RELATIVE_Y
    if not horizontal:
        answer = "above" if asked == first else "below"
    return Sample(scene[0], template.format(a=asked, b=other), answer, "position"), scene[1]


def _size_question(rng: random.Random) -> Annotated | None:
    big = rng.random() < 0.5
    if rng.random() < 0.5:
        kind, color = rng.choice(SHAPES), rng.choice(list(COLORS))
        fraction = rng.uniform(0.3, 0.42) if big else rng.uniform(0.07, 0.14)
        scene = _scene(rng, [kind], [color], [fraction])
        if scene is None:
            return None
        template = rng.choice(SIZE_OF_ONE)
        return Sample(scene[0], template.format(k=kind), "big" if big else "small", "size"), scene[1]

    kind, colors = rng.choice(SHAPES), _distinct(rng, COLORS, 2)  # colors[0] is the big one
    scene = _scene(rng, [kind, kind], colors, [rng.uniform(0.2, 0.3), rng.uniform(0.06, 0.11)])
    if scene is None:
        return None
    if rng.random() < 0.5:
        color = colors[0] if big else colors[1]
        question = rng.choice(SIZE_OF_COLORED)
        return Sample(scene[0], question.format(c=color, k=kind), "big" if big else "small", "size"), scene[1]
    question = COLOR_OF_SIZED.format(s="big" if big else "small", k=kind)
    return Sample(scene[0], question, colors[0] if big else colors[1], "size"), scene[1]


def _text_image(rng: random.Random, text: str, label: str,
                height_fraction: tuple[float, float]) -> tuple[Image.Image, Scene] | None:
    size = _canvas_size(rng)
    ink = rng.choice(list(COLORS))
    font = _font(max(10, int(rng.uniform(*height_fraction) * min(size))))
    left, top, right, bottom = font.getbbox(text)
    while right - left > 0.9 * size[0] and font.size > 10:
        font = _font(int(font.size * 0.9))
        left, top, right, bottom = font.getbbox(text)
    w, h = right - left, bottom - top
    if w > size[0] or h > size[1]:
        return None
    layer = Image.new("L", (w + 8, h + 8), 0)
    ImageDraw.Draw(layer).text((4 - left, 4 - top), text, font=font, fill=255)
    layer = layer.rotate(rng.uniform(-8, 8), resample=Image.BILINEAR, expand=False)
    x = rng.randint(0, max(0, size[0] - layer.width))
    y = rng.randint(0, max(0, size[1] - layer.height))
    image = _background(rng, size, [ink])
    image.paste(Image.new("RGB", layer.size, _jittered(COLORS[ink], rng)), (x, y), layer)
    left, top, right, bottom = layer.getbbox() or (0, 0, layer.width, layer.height)
    box = (x + left, y + top, min(size[0], x + right), min(size[1], y + bottom))
    return _encoded(image, rng), Scene(size, text=TextBox(label, box))


def _digit_question(rng: random.Random) -> Annotated | None:
    digit = rng.choice(DIGITS)
    drawn = _text_image(rng, digit, digit, (0.35, 0.8))
    if drawn is None:
        return None
    question = rng.choice(READ_DIGIT)
    return Sample(drawn[0], question, digit, "digit"), drawn[1]


def _word_question(rng: random.Random) -> Annotated | None:
    word = rng.choice(WORDS)
    drawn = _text_image(rng, word.upper() if rng.random() < 0.3 else word, word, (0.25, 0.5))
    if drawn is None:
        return None
    question = rng.choice(READ_WORD)
    return Sample(drawn[0], question, word, "word"), drawn[1]


GENERATORS: dict[QType, Callable[[random.Random], Annotated | None]] = {
    "color": _color_question,
    "shape": _shape_question,
    "count": _count_question,
    "position": _position_question,
    "size": _size_question,
    "digit": _digit_question,
    "word": _word_question,
}


# --- public API ----------------------------------------------------------------------

def make_annotated(rng: random.Random, qtype: QType | None = None) -> Annotated:
    """One sample of ``qtype`` (any type, uniformly, when None) drawn from ``rng``, with its scene."""
    if qtype is None:
        qtype = rng.choice(QTYPES)
    if qtype not in GENERATORS:
        raise ValueError(f"unknown question type {qtype!r}; known: {', '.join(QTYPES)}")
    while True:
        drawn = GENERATORS[qtype](rng)
        if drawn is not None:
            return drawn


def make_sample(rng: random.Random, qtype: QType | None = None) -> Sample:
    """One sample of ``qtype`` (any type, uniformly, when None) drawn from ``rng``."""
    return make_annotated(rng, qtype)[0]


def sample_rng(seed: int, index: int) -> random.Random:
    """The generator of sample ``index`` of the stream ``seed``; independent of every other index."""
    return random.Random((seed << 32) | index)


# How often training draws each type: reading and counting take the model longest to learn.
TRAINING_WEIGHTS: dict[QType, float] = {
    "color": 1.0, "shape": 1.0, "count": 1.25, "position": 0.9, "size": 0.75, "digit": 1.2, "word": 1.3,
}


def annotated_at(seed: int, index: int) -> Annotated:
    """Sample ``index`` of the training stream ``seed`` and its scene; the type drawn by ``TRAINING_WEIGHTS``."""
    rng = sample_rng(seed, index)
    qtype = rng.choices(QTYPES, weights=[TRAINING_WEIGHTS[q] for q in QTYPES])[0]
    return make_annotated(rng, qtype)


def sample_at(seed: int, index: int) -> Sample:
    """Sample ``index`` of the training stream ``seed``."""
    return annotated_at(seed, index)[0]


def held_out(seed: int, n: int) -> list[Sample]:
    """``n`` samples from stream ``seed``, the question types taken in turn so each gets ``n / 7``."""
    return [make_sample(sample_rng(seed, i), QTYPES[i % len(QTYPES)]) for i in range(n)]


# --- per-patch targets ---------------------------------------------------------------
# What each patch of the model's square shows, for training's dense auxiliary loss: the
# kind and colour of the object covering it, the digit or word its text belongs to, and
# whether an object's centre lies in it. Class 0 is "nothing".

TEXT_CLASSES: tuple[str, ...] = DIGITS + WORDS
_SUPERSAMPLE = 8  # mask pixels per patch side
_MIN_COVER = 0.1


def patch_targets(scene: Scene, grid: int) -> dict[str, np.ndarray]:
    """``kind``, ``color``, ``text`` class ids and ``centre`` flags per patch, each ``[grid * grid]`` int64.

    The picture is squashed to the square exactly as the processor squashes it, so
    patch ``(row, col)`` covers the same part of the picture as image token ``row * grid + col``.
    """
    side = grid * _SUPERSAMPLE
    sx, sy = side / scene.size[0], side / scene.size[1]
    kind = np.zeros((grid, grid), dtype=np.int64)
    color = np.zeros((grid, grid), dtype=np.int64)
    text = np.zeros((grid, grid), dtype=np.int64)
    centre = np.zeros((grid, grid), dtype=np.int64)
    best = np.full((grid, grid), _MIN_COVER)
    for shape in scene.shapes:
        cover = _coverage([(x * sx, y * sy) for x, y in shape_polygon(shape)], side, grid)
        wins = cover > best
        best = np.where(wins, cover, best)
        kind[wins] = SHAPES.index(shape.kind) + 1
        color[wins] = list(COLORS).index(shape.color) + 1
        row = min(grid - 1, int(shape.cy * sy) // _SUPERSAMPLE)
        col = min(grid - 1, int(shape.cx * sx) // _SUPERSAMPLE)
        centre[row, col] = 1
    if scene.text is not None:
        left, top, right, bottom = scene.text.box
        box = [(left * sx, top * sy), (right * sx, top * sy), (right * sx, bottom * sy), (left * sx, bottom * sy)]
        text[_coverage(box, side, grid) > 0.25] = TEXT_CLASSES.index(scene.text.text) + 1
    return {"kind": kind.ravel(), "color": color.ravel(), "text": text.ravel(), "centre": centre.ravel()}


def _coverage(polygon: list[tuple[float, float]], side: int, grid: int) -> np.ndarray:
    """Share of each of ``grid x grid`` cells that ``polygon`` (in ``side``-pixel coordinates) covers."""
    mask = Image.new("L", (side, side), 0)
    ImageDraw.Draw(mask).polygon(polygon, fill=255)
    return np.asarray(mask.resize((grid, grid), Image.BOX), dtype=np.float64) / 255.0


# The picture bundled as examples/demo.jpg and the questions it answers.
DEMO_QUESTIONS: dict[str, str] = {
    "What color is the circle?": "red",
    "How many shapes are there?": "3",
    "What shape is blue?": "square",
}


def demo_picture() -> Image.Image:
    """A fixed 480x360 scene: a red circle, a blue square and a yellow triangle."""
    image = Image.new("RGB", (480, 360), (205, 212, 220))
    draw = ImageDraw.Draw(image)
    rng = random.Random(0)
    for shape in (Shape("circle", "red", 130, 175, 62), Shape("square", "blue", 350, 105, 52, 6.0),
                  Shape("triangle", "yellow", 360, 265, 46, -4.0)):
        _draw_shape(draw, shape, rng)
    return image


def vocabulary() -> list[str]:
    """Every word the generator can put in a question or an answer, lower case, sorted."""
    words: set[str] = set(COLORS) | set(SHAPES) | set(PLURALS.values()) | set(WORDS) | set(DIGITS)
    words |= {"left", "right", "top", "bottom", "above", "below", "big", "small"}
    for template in ALL_TEMPLATES:
        words |= set(re.findall(r"[a-z]+", re.sub(r"\{\w+\}", " ", template.lower())))
    return sorted(words)
