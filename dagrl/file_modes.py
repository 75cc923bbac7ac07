"""Files dagrl writes for the user (exported models, made datasets) get the modes the umask
gives a newly created file. Atomic writes go through temporary files, which tempfile (and
safetensors) create 0600; renamed into place they would stay readable by their owner alone."""

from __future__ import annotations

import os
from pathlib import Path


def current_umask() -> int:
    mask = os.umask(0)   # the only way to read it is to set it: set it straight back
    os.umask(mask)
    return mask


def apply_umask(path: str | Path) -> None:
    """`path` (a file, or a directory and everything under it) as if created under the umask:
    files 0666 & ~umask, directories 0777 & ~umask."""
    mask = current_umask()
    path = Path(path)
    items = [path, *path.rglob("*")] if path.is_dir() else [path]
    for item in items:
        os.chmod(item, (0o777 if item.is_dir() else 0o666) & ~mask)
