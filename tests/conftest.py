"""Shared fixtures: a tiny model directory and the arithmetic dataset, written once per session."""

from __future__ import annotations

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
