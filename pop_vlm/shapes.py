"""Synthetic shapes visual question answering: the task behind the bundled demo VLM.

A scene is a canvas (each side one of 224, 320, 448, 640 or 896 px) holding 1 to 4 non-overlapping
objects. Each object is a filled circle, axis-aligned square or isosceles triangle (apex up, width equal
to height) in one of six colours, either small (bounding-box side 10-15% of the canvas's shorter side)
or large (25-35%). The background is white, light grey, or light noise (every channel of every pixel
uniform in 200..255).

Five kinds of question are asked, each with a one-word lowercase answer:

====================  ==================================================  ====================
qtype                 question                                            answer
====================  ==================================================  ====================
``color_of_shape``    What color is the {shape}?                          a colour
``shape_of_color``    What shape is the {color} object?                   a shape
``count``             How many shapes are there?                          "1" ... "4"
``exists``            Is there a {color} {shape}?                         "yes" / "no"
``left_right``        Is the {color} {shape} on the left or the right?    "left" / "right"
====================  ==================================================  ====================

``color_of_shape`` is only asked when exactly one object has that shape, ``shape_of_color`` when exactly one
object has that colour, and ``left_right`` when the object is the only one of its colour and shape and its
bounding box lies wholly in one half of the canvas. Answers are scored by exact match after lower-casing
and turning punctuation into spaces (:func:`score`, through :mod:`pop_vlm.scoring`).

Everything is deterministic given a seed: :func:`sample_scene` draws a scene, :func:`render` draws its
pixels, :func:`questions` draws questions about it, and :func:`scene_to_record` / :func:`sample_from_record`
turn a sample into a JSON-able record and back.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np
from PIL import Image

from .scoring import answer_matches

CANVAS_SIZES: tuple[int, ...] = (224, 320, 448, 640, 896)
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 160, 60),
    "blue": (40, 70, 220),
    "yellow": (240, 210, 30),
    "purple": (140, 50, 170),
    "orange": (245, 130, 20),
}
BACKGROUNDS: dict[str, tuple[int, int, int] | None] = {
    "white": (255, 255, 255),
    "grey": (230, 230, 230),
    "noise": None,  # every channel of every pixel uniform in NOISE_RANGE
}
NOISE_RANGE: tuple[int, int] = (200, 255)  # inclusive
SIZE_RANGES: dict[str, tuple[float, float]] = {"small": (0.10, 0.15), "large": (0.25, 0.35)}
MIN_OBJECTS, MAX_OBJECTS = 1, 4
QTYPES: tuple[str, ...] = ("color_of_shape", "shape_of_color", "count", "exists", "left_right")
ANSWERS: tuple[str, ...] = (*COLORS, *SHAPES, "1", "2", "3", "4", "yes", "no", "left", "right")

TEMPLATES: dict[str, str] = {
    "color_of_shape": "What color is the {shape}?",
    "shape_of_color": "What shape is the {color} object?",
    "count": "How many shapes are there?",
    "exists": "Is there a {color} {shape}?",
    "left_right": "Is the {color} {shape} on the left or the right?",
}


# ----------------------------------------------------------------------------------------------- scenes


@dataclass(frozen=True)
class ShapeObject:
    """One object. ``bbox`` is ``(x0, y0, x1, y1)`` in pixels, ``x1``/``y1`` exclusive, always square."""

    shape: str
    color: str
    size: str
    bbox: tuple[int, int, int, int]

    @property
    def side(self) -> int:
        return self.bbox[2] - self.bbox[0]


@dataclass(frozen=True)
class Scene:
    width: int
    height: int
    background: str
    objects: tuple[ShapeObject, ...]
    noise_seed: int = 0
    seed: int | None = field(default=None, compare=False)


def _as_rng(seed_or_rng) -> np.random.Generator:
    if isinstance(seed_or_rng, np.random.Generator):
        return seed_or_rng
    return np.random.default_rng(seed_or_rng)


def side_range(size: str, width: int, height: int) -> tuple[int, int]:
    """Inclusive range of bounding-box sides (px) allowed for ``size`` on a ``width`` x ``height`` canvas."""
    low, high = SIZE_RANGES[size]
    short = min(width, height)
    return math.ceil(low * short), math.floor(high * short)


def boxes_overlap(a: Sequence[int], b: Sequence[int]) -> bool:
    """Whether two ``(x0, y0, x1, y1)`` boxes (exclusive ends) share any pixel."""
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def _place(rng: np.random.Generator, side: int, width: int, height: int, placed: list, tries: int = 100):
    for _ in range(tries):
        x0 = int(rng.integers(0, width - side + 1))
        y0 = int(rng.integers(0, height - side + 1))
        box = (x0, y0, x0 + side, y0 + side)
        if not any(boxes_overlap(box, other) for other in placed):
            return box
    return None


def sample_scene(
    seed_or_rng=None,
    *,
    n_objects: int | None = None,
    min_objects: int = MIN_OBJECTS,
    max_objects: int = MAX_OBJECTS,
    large_prob: float = 0.5,
    canvas: tuple[int, int] | None = None,
    background: str | None = None,
) -> Scene:
    """Draw a random scene.

    ``seed_or_rng`` is an int seed (the scene is then a pure function of it) or a ``numpy`` Generator.
    ``n_objects`` fixes the object count, otherwise it is uniform in ``[min_objects, max_objects]``;
    ``large_prob`` is the chance that an object is large; ``canvas`` (width, height) and ``background``
    fix those, otherwise they are uniform over the allowed values.
    """
    seed = seed_or_rng if isinstance(seed_or_rng, (int, np.integer)) else None
    rng = _as_rng(seed_or_rng)
    if canvas is None:
        width, height = (int(CANVAS_SIZES[i]) for i in rng.integers(0, len(CANVAS_SIZES), size=2))
    else:
        width, height = canvas
    if background is None:
        background = list(BACKGROUNDS)[int(rng.integers(0, len(BACKGROUNDS)))]
    if n_objects is None:
        n_objects = int(rng.integers(min_objects, max_objects + 1))
    if not MIN_OBJECTS <= n_objects <= MAX_OBJECTS:
        raise ValueError(f"n_objects must be in [{MIN_OBJECTS}, {MAX_OBJECTS}], got {n_objects}")
    noise_seed = int(rng.integers(0, 2**31 - 1))

    while True:  # restart in the rare case the objects cannot be packed
        objects: list[ShapeObject] = []
        for _ in range(n_objects):
            size = "large" if rng.random() < large_prob else "small"
            low, high = side_range(size, width, height)
            side = int(rng.integers(low, high + 1))
            box = _place(rng, side, width, height, [o.bbox for o in objects])
            if box is None:
                break
            shape = SHAPES[int(rng.integers(0, len(SHAPES)))]
            color = list(COLORS)[int(rng.integers(0, len(COLORS)))]
            objects.append(ShapeObject(shape, color, size, box))
        if len(objects) == n_objects:
            return Scene(width, height, background, tuple(objects), noise_seed, None if seed is None else int(seed))


# -------------------------------------------------------------------------------------------- rendering


def contains(obj: ShapeObject, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Boolean mask of which points ``(x, y)`` (continuous pixel coordinates) lie inside ``obj``.

    Pixel ``(i, j)`` is painted when its centre ``(i + 0.5, j + 0.5)`` is inside.
    """
    x0, y0, x1, y1 = obj.bbox
    side = x1 - x0
    inside_box = (x >= x0) & (x < x1) & (y >= y0) & (y < y1)
    if obj.shape == "square":
        return inside_box
    cx = x0 + side / 2.0
    if obj.shape == "circle":
        cy = y0 + side / 2.0
        return inside_box & ((x - cx) ** 2 + (y - cy) ** 2 <= (side / 2.0) ** 2)
    if obj.shape == "triangle":  # apex at the top centre, base along the bottom edge
        return inside_box & (np.abs(x - cx) <= (y - y0) / 2.0)
    raise ValueError(f"unknown shape {obj.shape!r}")


def background_array(scene: Scene) -> np.ndarray:
    """The background as an ``(height, width, 3)`` uint8 array."""
    colour = BACKGROUNDS[scene.background]
    if colour is None:
        rng = np.random.default_rng(scene.noise_seed)
        low, high = NOISE_RANGE
        return rng.integers(low, high + 1, size=(scene.height, scene.width, 3), dtype=np.uint8)
    return np.broadcast_to(np.array(colour, dtype=np.uint8), (scene.height, scene.width, 3)).copy()


def render_array(scene: Scene) -> np.ndarray:
    """Pixels of ``scene`` as an ``(height, width, 3)`` uint8 array (no anti-aliasing)."""
    pixels = background_array(scene)
    for obj in scene.objects:
        x0, y0, x1, y1 = obj.bbox
        ys, xs = np.mgrid[y0:y1, x0:x1]
        mask = contains(obj, xs + 0.5, ys + 0.5)
        pixels[y0:y1, x0:x1][mask] = COLORS[obj.color]
    return pixels


def render(scene: Scene) -> Image.Image:
    """Draw ``scene`` as an RGB PIL image."""
    return Image.fromarray(render_array(scene), mode="RGB")


def label_grid(scene: Scene, rows: int, cols: int, samples: int = 4, min_cover: float = 0.25) -> np.ndarray:
    """Which object covers each cell of a ``rows`` x ``cols`` grid laid over the canvas.

    Returns an int array: ``0`` for background, ``k + 1`` for ``scene.objects[k]``. A cell gets the object
    covering most of it (estimated on ``samples`` x ``samples`` points) if that covers at least
    ``min_cover`` of the cell. Used for dense supervision of a vision encoder.
    """
    offsets = (np.arange(samples) + 0.5) / samples
    ys = (np.arange(rows)[:, None] + offsets[None, :]).reshape(-1) * scene.height / rows
    xs = (np.arange(cols)[:, None] + offsets[None, :]).reshape(-1) * scene.width / cols
    grid_y, grid_x = np.meshgrid(ys, xs, indexing="ij")
    cover = np.zeros((len(scene.objects) + 1, rows, cols))
    for k, obj in enumerate(scene.objects):
        mask = contains(obj, grid_x, grid_y).reshape(rows, samples, cols, samples)
        cover[k + 1] = mask.mean(axis=(1, 3))
    cover[0] = min_cover  # background wins unless an object covers at least min_cover
    return cover.argmax(axis=0)


# -------------------------------------------------------------------------------------------- questions


def _horizontal_half(obj: ShapeObject, width: int) -> str | None:
    x0, _, x1, _ = obj.bbox
    if x1 <= width / 2:
        return "left"
    if x0 >= width / 2:
        return "right"
    return None


def candidate_questions(scene: Scene) -> dict[str, list[tuple[str, str]]]:
    """Every valid ``(question, answer)`` pair for ``scene``, grouped by qtype."""
    shapes = [o.shape for o in scene.objects]
    colors = [o.color for o in scene.objects]
    pairs = [(o.color, o.shape) for o in scene.objects]
    out: dict[str, list[tuple[str, str]]] = {q: [] for q in QTYPES}
    for obj in scene.objects:
        if shapes.count(obj.shape) == 1:
            out["color_of_shape"].append((TEMPLATES["color_of_shape"].format(shape=obj.shape), obj.color))
        if colors.count(obj.color) == 1:
            out["shape_of_color"].append((TEMPLATES["shape_of_color"].format(color=obj.color), obj.shape))
        half = _horizontal_half(obj, scene.width)
        if pairs.count((obj.color, obj.shape)) == 1 and half is not None:
            question = TEMPLATES["left_right"].format(color=obj.color, shape=obj.shape)
            out["left_right"].append((question, half))
    out["count"].append((TEMPLATES["count"], str(len(scene.objects))))
    for color in COLORS:
        for shape in SHAPES:
            answer = "yes" if (color, shape) in pairs else "no"
            out["exists"].append((TEMPLATES["exists"].format(color=color, shape=shape), answer))
    return out


def _pick_exists(rng: np.random.Generator, scene: Scene, options: list[tuple[str, str]], hard_negative_prob: float):
    yes = [qa for qa in options if qa[1] == "yes"]
    no = [qa for qa in options if qa[1] == "no"]
    if yes and (not no or rng.random() < 0.5):
        return yes[int(rng.integers(0, len(yes)))]
    # a "hard" negative shares its colour or its shape with an object in the scene
    present = {o.color for o in scene.objects} | {o.shape for o in scene.objects}
    hard = [qa for qa in no if any(f" {word} " in f" {qa[0][:-1]} " for word in present)]
    pool = hard if hard and rng.random() < hard_negative_prob else no
    return pool[int(rng.integers(0, len(pool)))]


def questions(
    scene: Scene,
    rng=None,
    n: int | None = None,
    qtype_weights: dict[str, float] | None = None,
    hard_negative_prob: float = 0.5,
) -> list[tuple[str, str, str]]:
    """Draw valid ``(question, answer, qtype)`` triples about ``scene``.

    With ``n=None`` one question of every qtype that is valid for the scene is returned (in ``QTYPES``
    order). Otherwise ``n`` distinct questions (fewer if the scene has fewer) are drawn: the qtype by
    ``qtype_weights`` (default uniform) among the qtypes valid for the scene, then a question of that
    type uniformly. ``exists`` questions are "yes" half of the time when possible, and a "no" one is, with
    probability ``hard_negative_prob``, about a colour or shape that is in the scene.
    """
    rng = _as_rng(rng)
    candidates = {q: v for q, v in candidate_questions(scene).items() if v}

    def draw(qtype: str) -> tuple[str, str]:
        if qtype == "exists":
            return _pick_exists(rng, scene, candidates[qtype], hard_negative_prob)
        return candidates[qtype][int(rng.integers(0, len(candidates[qtype])))]

    if n is None:
        return [(*draw(q), q) for q in QTYPES if q in candidates]
    out: list[tuple[str, str, str]] = []
    seen: set[str] = set()
    total = sum(len(v) for v in candidates.values())
    for _ in range(8 * n):
        if len(out) >= min(n, total):
            break
        types = [q for q in QTYPES if q in candidates]
        weights = np.array([(qtype_weights or {}).get(q, 1.0 if qtype_weights is None else 0.0) for q in types])
        if weights.sum() <= 0:
            weights = np.ones(len(types))
        qtype = types[int(rng.choice(len(types), p=weights / weights.sum()))]
        question, answer = draw(qtype)
        if question not in seen:
            seen.add(question)
            out.append((question, answer, qtype))
    return out


# ---------------------------------------------------------------------------------------------- scoring


def score(pred: str, answer: str) -> float:
    """1.0 for an exact match (:func:`pop_vlm.scoring.answer_matches`), else 0.0."""
    return float(answer_matches(pred, answer, "exact"))


# ---------------------------------------------------------------------------------------------- records


def scene_to_record(scene: Scene, question: str | None = None, answer: str | None = None, qtype: str | None = None):
    """A JSON-able dict describing ``scene`` (and optionally one question about it)."""
    record = {
        "seed": scene.seed,
        "width": scene.width,
        "height": scene.height,
        "background": scene.background,
        "noise_seed": scene.noise_seed,
        "objects": [
            {"shape": o.shape, "color": o.color, "size": o.size, "bbox": list(o.bbox)} for o in scene.objects
        ],
    }
    if question is not None:
        record.update(question=question, answer=answer, qtype=qtype)
    return record


def scene_from_record(record: dict) -> Scene:
    """Inverse of :func:`scene_to_record` (the question fields are ignored)."""
    objects = tuple(
        ShapeObject(o["shape"], o["color"], o.get("size", ""), tuple(int(v) for v in o["bbox"]))
        for o in record["objects"]
    )
    return Scene(
        int(record["width"]),
        int(record["height"]),
        record["background"],
        objects,
        int(record.get("noise_seed", 0)),
        record.get("seed"),
    )


def sample_from_record(record: dict) -> tuple[Image.Image, str, str]:
    """Rebuild ``(image, question, answer)`` from a record (e.g. a line of ``assets/qa/shapes_test.jsonl``)."""
    return render(scene_from_record(record)), record["question"], record["answer"]


def make_records(seeds: Iterable[int], qtypes: Sequence[str] | None = None) -> list[dict]:
    """One question record per seed. With ``qtypes``, seed ``i`` asks ``qtypes[i % len(qtypes)]`` when that
    qtype is valid for its scene (otherwise a uniformly drawn valid qtype). The scene and the question
    are drawn from the seed's own generator, so ``make_records([seed], [qtype])`` reproduces a record."""
    records = []
    for i, seed in enumerate(seeds):
        rng = np.random.default_rng(int(seed))
        scene = sample_scene(rng)
        scene = Scene(scene.width, scene.height, scene.background, scene.objects, scene.noise_seed, int(seed))
        wanted = qtypes[i % len(qtypes)] if qtypes else None
        valid = [q for q, v in candidate_questions(scene).items() if v]
        weights = {wanted: 1.0} if wanted in valid else None
        question, answer, qtype = questions(scene, rng, n=1, qtype_weights=weights)[0]
        records.append(scene_to_record(scene, question, answer, qtype))
    return records
