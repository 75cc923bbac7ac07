"""Images in verl's multimodal row layout: an `images` column holding a list of images per row
(each a struct of `bytes` and `path`, as `datasets.Image` and verl's geo3k preprocessing write
them, or raw bytes, or a path), and one `<image>` placeholder in the prompt's text per image,
in order.

The checks here run on the pre-flight's sample rows (data/checks.py) and on every row a step
reads: an image that does not decode, a placeholder count that differs from the image count,
or an image above `data.max_image_pixels` is refused with the file, row and column named.
"""

from __future__ import annotations

import io
from typing import Any

IMAGE_COLUMN = "images"
IMAGE_PLACEHOLDER = "<image>"


def prompt_text(prompt: Any) -> str:
    """The text of a prompt (a string, or a chat message list) in which placeholders count."""
    if isinstance(prompt, str):
        return prompt
    return "".join(str(m.get("content") or "") for m in prompt or [] if isinstance(m, dict))


def image_bytes(value: Any) -> bytes:
    """The encoded image of one entry of the `images` column: {"bytes", "path"} (bytes first,
    else the file at path), raw bytes, or a path."""
    if isinstance(value, dict):
        if value.get("bytes"):
            return bytes(value["bytes"])
        value = value.get("path")
    if isinstance(value, bytes | bytearray):
        return bytes(value)
    if isinstance(value, str) and value:
        with open(value, "rb") as f:
            return f.read()
    raise ValueError(f"no image bytes or path in {type(value).__name__} {str(value)[:60]!r}")


def thumbnail_png(picture, side: int = 96) -> str:
    """A decoded picture shrunk to fit `side` px, as base64 PNG (for val_generations.jsonl and
    the run report, which show each validation answer beside its image)."""
    import base64

    small = picture.copy()
    small.thumbnail((side, side))
    out = io.BytesIO()
    small.save(out, format="PNG")
    return base64.b64encode(out.getvalue()).decode("ascii")


def decode_image(value: Any):
    """One `images` entry as an RGB PIL image (fully decoded: a truncated file fails here)."""
    from PIL import Image

    with Image.open(io.BytesIO(image_bytes(value))) as image:
        image.load()
        return image.convert("RGB")


def image_problem(images: Any, prompt: Any, max_pixels: int) -> str | None:
    """What is wrong with one row's images, as the end of a message that starts with the file
    and row ("column images[1]: ..."), or None."""
    return checked_images(images, prompt, max_pixels)[1]


def checked_images(images: Any, prompt: Any, max_pixels: int) -> tuple[list, str | None]:
    """One row's images decoded (RGB PIL images), and what is wrong with them (see
    `image_problem`; the images are then those decoded before the problem)."""
    images = list(images) if images is not None else []
    decoded: list = []
    placeholders = prompt_text(prompt).count(IMAGE_PLACEHOLDER)
    if placeholders != len(images):
        return decoded, (f"column {IMAGE_COLUMN}: {len(images)} image(s) but {placeholders} "
                         f"{IMAGE_PLACEHOLDER} placeholder(s) in the prompt (one per image, in "
                         "order)")
    for j, value in enumerate(images):
        where = f"column {IMAGE_COLUMN}[{j}]"
        try:
            image = decode_image(value)
        except Exception as err:   # PIL raises several types for a damaged or foreign file
            from PIL import UnidentifiedImageError

            reason = ("no image format PIL reads" if isinstance(err, UnidentifiedImageError)
                      else str(err) or type(err).__name__)
            return decoded, f"{where}: not a readable image ({reason})"
        width, height = image.size
        if max_pixels and width * height > max_pixels:
            return decoded, (f"{where}: {width}x{height} = {width * height} pixels, above "
                             f"data.max_image_pixels={max_pixels} (resize it, or raise the "
                             "limit)")
        decoded.append(image)
    return decoded, None
