"""`dagrl bench NAME` imports `benchmarks.NAME` as an ordinary module (an editable install, or
pytest's `pythonpath`, makes the package importable) and leaves sys.path alone; without the
package it says so in one line."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from dagrl.cli import main


def test_bench_runs_the_benchmark_module_without_touching_sys_path(tmp_path: Path):
    before = list(sys.path)
    with pytest.raises(SystemExit):   # e2e's own argument check: the dispatch reached it
        main(["bench", "e2e", "--sides", "ours,vllm", "--out", str(tmp_path)])
    assert sys.path == before


def test_bench_without_the_benchmarks_package_says_so_in_one_line(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):
    for name in ("benchmarks", "benchmarks.e2e"):   # as if nothing provided them
        monkeypatch.setitem(sys.modules, name, None)
    assert main(["bench", "e2e"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "benchmarks.e2e is not importable" in err
    assert "pip install -e ." in err


def test_bench_names_the_benchmarks(capsys: pytest.CaptureFixture[str]):
    assert main(["bench", "nope"]) == 2
    assert "dataplane" in capsys.readouterr().err
