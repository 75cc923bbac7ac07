"""Shared fixtures: a tiny model directory and the arithmetic dataset, written once per session."""

from __future__ import annotations

import os

import pytest

from dagrl.data.makers import make_arith
from dagrl.engines.models import load_model, load_tokenizer, write_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen2", "tiny-qwen2",
                            hidden_size=64, layers=2, seed=0)


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir):
    return load_tokenizer(str(tiny_model_dir))


@pytest.fixture()
def tiny_model(tiny_model_dir):
    return load_model(str(tiny_model_dir))


@pytest.fixture(scope="session")
def arith_files(tmp_path_factory):
    return make_arith(tmp_path_factory.mktemp("data") / "arith", seed=0)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The composition matrix's runs (marker `composition`, minutes) run only when the -m
    expression names them: `-m vllm` alone must not start its vLLM runs (the default -m in
    pyproject deselects them all)."""
    if "composition" in (config.option.markexpr or ""):
        return
    runs = [item for item in items if item.get_closest_marker("composition")]
    if runs:
        config.hook.pytest_deselected(items=runs)
        items[:] = [item for item in items if not item.get_closest_marker("composition")]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """DAGRL_NO_SKIPS=1 (CI: .ci/run and .ci/slow): a skipped test fails the session, naming
    it — every test of the suite can run there (chromium renders the report, mlflow is
    installed, ...), so a skip means a dependency went missing, not a test that may sit out."""
    if os.environ.get("DAGRL_NO_SKIPS") != "1" or hasattr(session.config, "workerinput"):
        return   # an xdist worker: the controller sees every worker's reports
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter is not None else []
    if skipped:
        names = "; ".join(f"{r.nodeid} ({r.longrepr[-1] if isinstance(r.longrepr, tuple) else ''})"
                          for r in skipped)
        reporter.write_line(f"DAGRL_NO_SKIPS=1: {len(skipped)} test(s) skipped: {names}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
