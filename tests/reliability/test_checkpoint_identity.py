"""A checkpoint knows which model it was written for (issue 38): resuming it into another model
is refused before anything is built, naming both; a checkpoint that was written with a manifest
and lost it is not taken for a pre-manifest one (it cannot be verified: resume falls back)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.reliability.helpers import FAST, assert_one_error_line, dagrl_cmd, error_lines, run


def train(run_dir: Path, total_steps: int, *overrides: str):
    return run(dagrl_cmd("train", f"trainer.run_dir={run_dir}", *FAST, "trainer.save_every=1",
                         f"trainer.total_steps={total_steps}", *overrides))


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A 2-step tiny-qwen2 run with a checkpoint after each step."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    proc = train(run_dir, 2, "model.path=builtin:tiny-qwen2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


def copy_run(finished: Path, tmp_path: Path) -> Path:
    shutil.copytree(finished, tmp_path / "run")
    return tmp_path / "run"


def test_the_manifest_records_the_model_and_the_layout(finished):
    manifest = json.loads((finished / "checkpoints" / "step_00000002" / "manifest.json")
                          .read_text())
    assert manifest["model"]["model_type"] == "qwen2"
    assert len(manifest["model"]["config_sha256"]) == 64
    assert manifest["layout"]["workers"] == 1 and manifest["layout"]["mode"] == "sync"


def test_resuming_into_another_model_is_refused_before_anything_is_built(finished, tmp_path):
    run_dir = copy_run(finished, tmp_path)
    before = sorted(p.name for p in (run_dir / "artifacts").iterdir())
    proc = train(run_dir, 3, "model.path=builtin:tiny-llama")
    assert proc.returncode == 1
    line = assert_one_error_line(proc, "step_00000002 was written for qwen2",
                                 "this run's model is llama", "builtin:tiny-llama")
    assert proc.stderr.strip() == line
    # nothing built: the tiny-llama model was never written, no step was logged
    assert sorted(p.name for p in (run_dir / "artifacts").iterdir()) == before
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 2


def test_a_lost_manifest_is_not_taken_for_an_old_checkpoint(finished, tmp_path):
    run_dir = copy_run(finished, tmp_path)
    (run_dir / "checkpoints" / "step_00000002" / "manifest.json").unlink()
    proc = train(run_dir, 3, "model.path=builtin:tiny-qwen2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert "manifest.json is missing" in out and "step_00000001" in out
    assert not error_lines(proc.stderr)
    steps = [json.loads(line)["step"]
             for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]      # step 2 re-run from step 1's checkpoint
