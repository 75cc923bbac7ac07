"""CI runs the suites with DAGRL_NO_SKIPS=1 (.ci/run, .ci/slow): a skipped test fails the run, named
(tests/conftest.py). Checked here on a probe test that skips when asked to."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_probe_skips_when_asked():
    if os.environ.get("DAGRL_SKIP_PROBE") == "1":
        pytest.skip("asked to skip")


def _run_probe(skip: bool) -> subprocess.CompletedProcess:
    env = {**os.environ, "DAGRL_NO_SKIPS": "1", "DAGRL_SKIP_PROBE": "1" if skip else "0"}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "tests/test_no_skips.py::test_probe_skips_when_asked"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_a_skip_fails_the_session_under_dagrl_no_skips():
    skipped = _run_probe(skip=True)
    assert skipped.returncode == 1, skipped.stdout[-2000:]
    assert "DAGRL_NO_SKIPS=1: 1 test(s) skipped: tests/test_no_skips.py::" \
           "test_probe_skips_when_asked" in skipped.stdout
    passed = _run_probe(skip=False)
    assert passed.returncode == 0, passed.stdout[-2000:]
