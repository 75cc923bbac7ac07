"""The data files a config lists exist: checked when the config is read, before torch and
transformers load (seconds), so a typo in a path is reported at once. What is inside each file
is checked later, with the tokenizer (dagrl/data/dataset.py and the pre-flight)."""

from __future__ import annotations

from pathlib import Path

from dagrl.config.model_source import BUILTIN_PREFIX
from dagrl.data.errors import DatasetError


def missing_file_error(path: str, key: str) -> DatasetError:
    return DatasetError(f"{path}: no such parquet file (listed in {key})")


def check_listed_files(train_files: list[str], val_files: list[str]) -> None:
    """Each listed file that is not a built-in dataset exists (val_files: [] when the run does
    not validate)."""
    for key, files in (("data.train_files", train_files), ("data.val_files", val_files)):
        for path in files:
            if not path.startswith(BUILTIN_PREFIX) and not Path(path).is_file():
                raise missing_file_error(path, key)
