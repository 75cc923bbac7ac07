"""Smoke test of `dagrl bench memory` on the tiny model: every chosen setting runs as its own
`dagrl train` process and is reported against the first; no timing or memory asserts."""

from __future__ import annotations

import json

import pytest

from benchmarks import memory


@pytest.mark.slow
def test_settings_run_side_by_side_and_report_ratios(tmp_path, capsys):
    out = tmp_path / "memory.json"
    rc = memory.main(["--model", "tiny", "--steps", "1", "--prompts", "2", "--samples", "2",
                      "--tokens", "4", "--settings", "baseline,+ trim host memory",
                      "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "baseline: peak RSS" in printed and "+ trim host memory: peak RSS" in printed
    results = json.loads(out.read_text())["results"]
    assert list(results) == ["baseline", "+ trim host memory"]
    for r in results.values():
        assert r["peak_gb"] > 0 and r["step_s"] > 0 and len(r["reward"]) == 1
