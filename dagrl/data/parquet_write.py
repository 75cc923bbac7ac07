"""Helpers shared by the dataset makers: argument checks and an atomic parquet write."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from dagrl.file_modes import apply_umask


def check_int(name: str, value: object, minimum: int) -> None:
    # bool is an int subclass, but `n_test=True` is a bug, not a count
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def write_parquet_atomic(table: pa.Table, path: str | Path, *, row_group_size: int) -> Path:
    """Write ``table`` to ``path`` via a temp file in the same directory and ``os.replace``.

    The rename is atomic on POSIX, so an interrupted write never leaves a truncated file
    where a loader would look for a dataset.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        pq.write_table(table, tmp, row_group_size=row_group_size)
        apply_umask(tmp)   # mkstemp made it 0600
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
