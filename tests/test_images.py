"""verl's multimodal rows (dagrl/data/images.py) and the built-in shapes task
(dagrl/data/shapes.py): the pictures hold the answer, and bad images are refused by file, row
and column before any work."""

from __future__ import annotations

import io
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dagrl.data.errors import DatasetError
from dagrl.data.images import decode_image, image_problem
from dagrl.data.shapes import SCHEMA, make_shapes


def red_pixels(image) -> np.ndarray:
    a = np.asarray(image).astype(int)
    return (a[..., 0] > 180) & (a[..., 1] < 80) & (a[..., 2] < 80)


def components(mask: np.ndarray) -> int:
    """4-connected regions of a boolean mask."""
    seen = np.zeros_like(mask)
    count = 0
    for y, x in zip(*np.nonzero(mask), strict=True):
        if seen[y, x]:
            continue
        count += 1
        stack = [(y, x)]
        while stack:
            i, j = stack.pop()
            if 0 <= i < mask.shape[0] and 0 <= j < mask.shape[1] and mask[i, j] \
                    and not seen[i, j]:
                seen[i, j] = True
                stack += [(i + 1, j), (i - 1, j), (i, j + 1), (i, j - 1)]
    return count


def test_count_pictures_hold_as_many_red_shapes_as_the_answer(tmp_path):
    rows = pq.read_table(make_shapes(tmp_path, n_train=40, n_test=8)["train"]).to_pylist()
    answers = []
    for row in rows:
        assert row["prompt"][0]["content"].startswith("How many red shapes")
        assert row["prompt"][0]["content"].endswith("only.<image>")
        assert image_problem(row["images"], row["prompt"], 1280 * 28 * 28) is None
        image = decode_image(row["images"][0])
        assert image.size == (112, 112)
        answers.append(int(row["reward_model"]["ground_truth"]))
        assert components(red_pixels(image)) == answers[-1]
    assert set(answers) == {1, 2, 3, 4}           # every answer occurs


def test_quadrant_pictures_put_the_red_square_in_the_answer_s_quadrant(tmp_path):
    rows = pq.read_table(make_shapes(tmp_path, n_train=40, n_test=8,
                                     task="quadrant")["train"]).to_pylist()
    for row in rows:
        ys, xs = np.nonzero(red_pixels(decode_image(row["images"][0])))
        quadrant = 1 + int(xs.mean() >= 56) + 2 * int(ys.mean() >= 56)
        assert str(quadrant) == row["reward_model"]["ground_truth"]


def test_blank_control_keeps_the_rows_and_empties_the_pictures(tmp_path):
    from dagrl.cli import main

    assert main(["data", "make", "shapes", "--out", str(tmp_path / "b"), "n_train=6",
                 "n_test=2", "blank=true"]) == 0
    blank = pq.read_table(tmp_path / "b" / "train.parquet").to_pylist()
    shown = pq.read_table(make_shapes(tmp_path / "s", n_train=6, n_test=2)["train"]).to_pylist()
    for b, s in zip(blank, shown, strict=True):
        assert b["reward_model"] == s["reward_model"] and b["prompt"] == s["prompt"]
        assert np.asarray(decode_image(b["images"][0])).min() == 255      # all white
    assert main(["data", "make", "shapes", "--out", str(tmp_path / "x"), "blank=maybe"]) == 2


def _png(size: tuple[int, int]) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", size, (255, 255, 255)).save(out, format="PNG")
    return out.getvalue()


def write_image_rows(path, rows) -> str:
    pq.write_table(pa.Table.from_pylist(rows, schema=SCHEMA), path)
    return str(path)


def image_row(index: int, images: list[bytes], text: str = "<image>How many?") -> dict:
    return {"data_source": "shapes", "prompt": [{"role": "user", "content": text}],
            "images": [{"bytes": b, "path": None} for b in images], "ability": "vision",
            "reward_model": {"style": "rule", "ground_truth": "1"},
            "extra_info": {"split": "train", "index": index}}


@pytest.mark.parametrize(("bad", "named"), [
    (image_row(3, [b"not a png"]),
     "row 3, column images[0]: not a readable image (no image format PIL reads)"),
    (image_row(3, [_png((64, 64)), _png((64, 64))]),
     "row 3, column images: 2 image(s) but 1 <image> placeholder(s)"),
    (image_row(3, [], "<image>How many?"), "row 3, column images: 0 image(s) but 1"),
    (image_row(3, [_png((64, 64)), _png((2000, 1000))], "<image><image>Which?"),
     "row 3, column images[1]: 2000x1000 = 2000000 pixels, above data.max_image_pixels=1003520"),
])
def test_bad_images_are_named_by_file_row_and_column(tmp_path, bad, named):
    from dagrl.data.parquet import ParquetPrompts

    rows = [image_row(i, [_png((64, 64))]) for i in range(3)] + [bad]
    path = write_image_rows(tmp_path / "bad.parquet", rows)
    source = ParquetPrompts([path], max_image_pixels=1280 * 28 * 28)
    assert source.has_images
    with pytest.raises(DatasetError, match="^" + re.escape(f"{path}: {named}")):
        source.check_sample(400)


def test_image_rows_for_a_text_model_are_refused_before_any_work(tmp_path):
    """A text model would read `<image>` as words and never see the pictures: refused, named,
    before the run directory exists."""
    from dagrl.config.presets import load_run_config
    from dagrl.runtime.launch import launch

    data = make_shapes(tmp_path / "shapes", n_train=8, n_test=2)["train"]
    cfg = load_run_config(None, [f"data.train_files=[{data}]", "data.max_prompt_length=128",
                                 f"trainer.run_dir={tmp_path / 'run'}", "trainer.total_steps=1",
                                 "logging.progress_bar=false"])
    with pytest.raises(DatasetError, match=r"hold an images column, but model.path=builtin:"
                                           r"tiny-qwen2 reads text only"):
        launch(cfg)
    assert not (tmp_path / "run").exists()


def test_colour_pictures_hold_shapes_of_the_answer_s_colour_alone(tmp_path):
    from dagrl.data.shapes import COLOURS

    rows = pq.read_table(make_shapes(tmp_path, n_train=40, n_test=8,
                                     task="colour")["train"]).to_pylist()
    answers = set()
    for row in rows:
        pixels = np.asarray(decode_image(row["images"][0])).reshape(-1, 3)
        drawn = {tuple(p) for p in pixels if tuple(p) != (255, 255, 255)}
        answer = int(row["reward_model"]["ground_truth"])
        assert drawn == {COLOURS[answer - 1]}, (answer, drawn)
        answers.add(answer)
    assert answers == {1, 2, 3, 4}
