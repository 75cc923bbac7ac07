"""A visual task whose answer is in the image: pictures of coloured shapes drawn in code, in
verl's multimodal row layout (data/images.py), for training an image-text model from scratch.

    dagrl data make shapes --out data/shapes                      # how many red shapes? 1-4
    dagrl data make shapes --out data/shapes task=quadrant        # where is the red square? 1-4
    dagrl data make shapes --out data/shapes task=colour          # what colour? 1-4
    dagrl data make shapes --out data/shapes-blank blank=true     # the same rows, images blank

`count`: 1-4 red shapes (circles and squares) among 0-3 shapes of other colours; `quadrant`:
one red square in quadrant 1 (top left), 2 (top right), 3 (bottom left) or 4 (bottom right)
among shapes of other colours; `colour`: 1-3 shapes of one colour, 1 (red), 2 (blue), 3 (green)
or 4 (yellow). The question names no count and no place: without the image
the answer is a guess (1 in 4). `blank=true` writes the same rows with every image plain white,
the control that shows a policy reads the image. Answers are numbers (`reward_model.
ground_truth`), scored by the last number in the response (`shapes` scorer).
"""

from __future__ import annotations

import io
import random
from pathlib import Path

import pyarrow as pa

from dagrl.data.images import IMAGE_PLACEHOLDER
from dagrl.data.parquet_write import check_int, write_parquet_atomic

DATA_SOURCE = "shapes"
OTHER_COLOURS = [(40, 90, 220), (30, 160, 60), (230, 180, 20)]   # blue, green, yellow
RED = (220, 30, 30)
COLOURS = [RED, *OTHER_COLOURS]     # the `colour` task's answers 1-4, in this order
QUESTIONS = {
    "count": "How many red shapes are in the picture? Answer with the number only.",
    "quadrant": "Which quadrant holds the red square: 1 (top left), 2 (top right), "
                "3 (bottom left) or 4 (bottom right)? Answer with the number only.",
    "colour": "What colour are the shapes: 1 (red), 2 (blue), 3 (green) or 4 (yellow)? "
              "Answer with the number only.",
}
_IMAGES = pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
SCHEMA = pa.schema([
    ("data_source", pa.string()),
    ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
    ("images", _IMAGES),
    ("ability", pa.string()),
    ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
    ("extra_info", pa.struct([("split", pa.string()), ("index", pa.int64())])),
])


def _place(rng: random.Random, size: int, radius: int, taken: list, box: tuple | None = None):
    """A centre for a shape of `radius` that overlaps none of `taken` (within `box` =
    (x0, y0, x1, y1) when given), or None after enough tries."""
    x0, y0, x1, y1 = box or (0, 0, size, size)
    for _ in range(200):
        x = rng.randint(x0 + radius + 1, x1 - radius - 2)
        y = rng.randint(y0 + radius + 1, y1 - radius - 2)
        # a square's corner lies r * sqrt(2) from its centre: 1.5 (r + r') apart, no two
        # shapes touch, so the picture shows as many shapes as were drawn
        if all((x - a) ** 2 + (y - b) ** 2 > (1.5 * (radius + r) + 3) ** 2
               for a, b, r in taken):
            taken.append((x, y, radius))
            return x, y
    return None


def _draw(size: int, shapes: list[tuple], blank: bool) -> bytes:
    """PNG bytes of a white square with `shapes` = (kind, colour, x, y, radius)."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (size, size), (255, 255, 255))
    if not blank:
        draw = ImageDraw.Draw(image)
        for kind, colour, x, y, r in shapes:
            box = (x - r, y - r, x + r, y + r)
            (draw.ellipse if kind == "circle" else draw.rectangle)(box, fill=colour)
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def _picture(rng: random.Random, size: int, task: str,
             distractors: int = 3) -> tuple[list[tuple], int]:
    """(shapes, answer) of one picture, with up to `distractors` shapes of other colours."""
    radius = max(4, size // 14)
    taken: list = []
    shapes, answer = [], 0
    if task == "count":
        answer = rng.randint(1, 4)
        colours = [RED] * answer + [rng.choice(OTHER_COLOURS)
                                    for _ in range(rng.randint(0, distractors))]
    elif task == "colour":   # every shape one colour: nothing to tell apart but the colour
        answer = rng.randint(1, 4)
        colours = [COLOURS[answer - 1]] * rng.randint(1, 3)
    else:
        answer = rng.randint(1, 4)
        half = size // 2
        box = (half * ((answer - 1) % 2), half * ((answer - 1) // 2),
               half * ((answer - 1) % 2 + 1), half * ((answer - 1) // 2 + 1))
        x, y = _place(rng, size, radius, taken, box)
        shapes.append(("square", RED, x, y, radius))
        colours = [rng.choice(OTHER_COLOURS)
                   for _ in range(rng.randint(min(1, distractors), distractors))]
    for colour in colours:
        spot = _place(rng, size, radius, taken)
        if spot is None:   # (never at the default sizes) fewer distractors, never fewer reds
            if colour == RED:
                raise ValueError(f"size={size}: no room for {answer} shapes; use a larger size")
            continue
        shapes.append((rng.choice(["circle", "square"]), colour, *spot, radius))
    return shapes, answer


def make_shapes(out_dir: str | Path, *, seed: int = 0, n_train: int = 2048, n_test: int = 256,
                size: int = 112, task: str = "count", blank: bool = False,
                distractors: int = 3, row_group_size: int = 256) -> dict[str, Path]:
    """Write train.parquet and test.parquet of the shapes task (see the module docstring);
    `distractors`: the most shapes of other colours in a picture (0: red shapes only)."""
    check_int("n_train", n_train, 1)
    check_int("n_test", n_test, 1)
    check_int("size", size, 56)
    check_int("distractors", distractors, 0)
    if task not in QUESTIONS:
        raise ValueError(f"task must be one of {', '.join(QUESTIONS)}, got {task!r}")
    rng = random.Random(seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, n in (("train", n_train), ("test", n_test)):
        rows = []
        for index in range(n):
            shapes, answer = _picture(rng, size, task, distractors)
            rows.append({
                "data_source": DATA_SOURCE,
                "prompt": [{"role": "user",
                            # the picture last, next to the answer: a model trained
                            # from scratch finds it there long before it learns to look
                            # back across the question (measured on the tiny VLM)
                            "content": f"{QUESTIONS[task]}{IMAGE_PLACEHOLDER}"}],
                "images": [{"bytes": _draw(size, shapes, blank), "path": None}],
                "ability": "vision",
                "reward_model": {"style": "rule", "ground_truth": str(answer)},
                "extra_info": {"split": split, "index": index},
            })
        table = pa.Table.from_pylist(rows, schema=SCHEMA)
        paths[split] = write_parquet_atomic(table, out / f"{split}.parquet",
                                            row_group_size=row_group_size)
    return paths
