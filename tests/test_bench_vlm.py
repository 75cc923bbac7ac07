"""`dagrl bench vlm`: the picture run beside its blank control, and the verdict that compares
them (format learning alone passes issue 36's two criteria, so the control is what decides)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from benchmarks.vlm import criteria, main, report
from dagrl.data.images import decode_image


def summary(run: str, held_out: dict[int, float], first10: float, last10: float) -> dict:
    return {"run": run, "held_out": held_out, "before": held_out[0],
            "after": held_out[max(held_out)], "first10": first10, "last10": last10,
            "gain": last10 - first10, "steps": 100, "seconds": 200.0}


def test_the_verdict_needs_the_pictures_to_beat_the_control_not_only_the_criteria():
    control = summary("blank", {0: 0.0, 100: 0.25}, 0.03, 0.25)
    assert criteria(control) == (True, True)    # the format alone: 0 -> chance, +0.22
    reads = report(summary("pictures", {0: 0.0, 50: 0.3, 100: 0.9}, 0.03, 0.85), control)
    assert "the policy reads the picture" in reads
    assert "held-out after 0.900 vs 0.250 (3.60x)" in reads
    assert "50: 0.300" in reads
    at_chance = report(summary("pictures", {0: 0.0, 100: 0.27}, 0.03, 0.26), control)
    assert "the policy does not read the picture" in at_chance
    assert criteria(summary("pictures", {0: 0.0, 100: 0.0}, 0.0, 0.0)) == (False, False)


def test_quick_bench_trains_the_example_on_pictures_and_on_blank_pictures(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    assert main(["--quick", "--out", str(tmp_path), "--json", str(tmp_path / "rows.json")]) == 0
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert [r["run"] for r in rows] == ["pictures", "blank"]
    for row in rows:
        assert row["steps"] == 4 and sorted(row["held_out"]) == ["0", "2", "4"]
    pictures, blank = (pq.read_table(tmp_path / f"data-{run}" / "train.parquet").to_pylist()
                       for run in ("pictures", "blank"))
    assert [r["reward_model"] for r in pictures] == [r["reward_model"] for r in blank]
    assert decode_image(blank[0]["images"][0]).getextrema() == ((255, 255),) * 3
    assert decode_image(pictures[0]["images"][0]).getextrema() != ((255, 255),) * 3
    out = capsys.readouterr().out
    assert "| pictures |" in out and "| blank |" in out and "pictures vs blank control" in out
    # the same --out again is refused before any work: it would mix with the first runs
    assert main(["--quick", "--out", str(tmp_path)]) == 2
    assert "already holds a run" in capsys.readouterr().err
    # the same table from the finished run directories
    assert main(["--from-runs", str(tmp_path / "pictures"), str(tmp_path / "blank")]) == 0
    again = capsys.readouterr().out
    curves = [line for line in out.splitlines() if line.startswith("held-out greedy")]
    assert curves and curves == [line for line in again.splitlines()
                                 if line.startswith("held-out greedy")]
