"""Damaged run logs (issue 38): metrics.jsonl as a crash leaves it (a last line cut short, a
NUL tail after a power loss, bytes that are not UTF-8) never stops a resume or `dagrl report`:
the damaged lines are skipped and named in one warning line, the log is cut back to the
checkpoint's step, and a run that starts over (no checkpoint) does not log its steps twice."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dagrl.observe.run_files import cut_jsonl, read_jsonl
from tests.reliability.helpers import FAST, dagrl_cmd, error_lines, run

DAMAGE = {
    "not-utf8": b'{"step": 9, "note": "\xff\xfe"}\n',
    "nul-tail": b"\0" * 64,
    "cut-line": b'{"step": 9, "reward/me',
}


def damaged(path: Path, *kinds: str) -> None:
    """Append the damage of each kind, in the order of DAMAGE (a crash cuts only the last
    line), each on its own line."""
    kinds = [k for k in DAMAGE if k in kinds]
    with path.open("ab") as f:
        for i, kind in enumerate(kinds):
            f.write(DAMAGE[kind])
            if i < len(kinds) - 1 and not DAMAGE[kind].endswith(b"\n"):
                f.write(b"\n")


def steps(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"]
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_damaged_lines_are_skipped_and_named(tmp_path, kind):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "reward/mean": 0.1}) + "\n" for s in (1, 2)))
    damaged(path, kind)
    contents = read_jsonl(path)
    assert [r["step"] for r in contents.records] == [1, 2]
    assert [n for n, _ in contents.skipped] == [3]
    assert "line 3" in contents.skipped_line(path) and str(path) in contents.skipped_line(path)
    dropped, _ = cut_jsonl(path, last_step=1)
    assert dropped == 1 and path.read_bytes() == (json.dumps({"step": 1, "reward/mean": 0.1})
                                                  + "\n").encode()


def test_a_valid_last_record_without_its_newline_gets_one(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}')
    dropped, contents = cut_jsonl(path, last_step=5)
    assert dropped == 0 and not contents.skipped
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n'   # the next append starts clean


def train(run_dir: Path, total_steps: int):
    return run(dagrl_cmd("train", f"trainer.run_dir={run_dir}", *FAST, "trainer.save_every=1",
                         f"trainer.total_steps={total_steps}"))


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A 3-step run with a checkpoint after every step."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    proc = train(run_dir, 3)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert steps(run_dir) == [1, 2, 3]
    return run_dir


def test_resume_skips_damaged_lines_and_cuts_back_to_the_checkpoint(finished, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(finished, run_dir)
    # The run died after logging step 3 but before its checkpoint committed.
    shutil.rmtree(run_dir / "checkpoints" / f"step_{3:08d}")
    damaged(run_dir / "metrics.jsonl", *DAMAGE)
    proc = train(run_dir, 4)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    warnings = [line for line in out.splitlines() if "damaged line(s)" in line]
    assert len(warnings) == 1 and "skipped 3 damaged line(s)" in warnings[0], out[-3000:]
    assert "Traceback" not in out and not error_lines(proc.stderr)
    assert steps(run_dir) == [1, 2, 3, 4]      # step 3 once: re-run from step 2's checkpoint


def test_a_run_that_starts_over_does_not_log_its_steps_twice(tmp_path):
    # An attempt killed before its first checkpoint left steps 1-2 (and a cut line) behind.
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "reward/mean": 0.0}) + "\n" for s in (1, 2)))
    damaged(run_dir / "metrics.jsonl", "cut-line")
    proc = run(dagrl_cmd("train", f"trainer.run_dir={run_dir}", *FAST, "trainer.total_steps=1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert steps(run_dir) == [1]
    assert "2 record(s) of an earlier attempt dropped" in proc.stdout + proc.stderr


def test_report_renders_a_damaged_metrics_file_and_names_what_it_skipped(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "reward/mean": 0.1 * s}) + "\n"
                            for s in (1, 2, 3)))
    damaged(path, *DAMAGE)
    proc = run(dagrl_cmd("report", str(tmp_path)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    warning = [line for line in proc.stderr.splitlines() if line.startswith("warning:")]
    assert len(warning) == 1 and "skipped 3 damaged line(s)" in warning[0]
    assert "line 4" in warning[0] and "line 6" in warning[0]
    html = (tmp_path / "report.html").read_text()
    assert "skipped 3 damaged line(s)" in html and "<b>steps logged</b> 3" in html
