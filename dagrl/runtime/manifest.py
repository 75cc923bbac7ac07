"""A checkpoint's manifest: the size and SHA-256 of every file, written at save, checked before
anything is loaded from it.

A committed checkpoint can still be damaged afterwards — a copy cut short, a full disk on
another machine, a file deleted by hand — and `torch.distributed.checkpoint` then fails with a
zip-library error deep in a stack, or, worse, a half-truncated shard still yields the tensors
that sit in its first half and an export succeeds silently. Checking the manifest first names
the damaged file before a single tensor is read, so `trainer.resume=auto` can fall back to an
older checkpoint and `dagrl export` can refuse. Hashing runs at ~2 GB/s (SHA-256 with the CPU's
SHA extensions), well below the cost of writing the checkpoint. A checkpoint written before
manifests existed is still checked for missing and truncated shards, from the byte ranges its
DCP metadata records (`dcp_problem`).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

MANIFEST = "manifest.json"
_CHUNK = 1 << 22


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(checkpoint: Path, extra: dict | None = None) -> None:
    """List every file under `checkpoint` (relative path -> size, sha256) in its manifest,
    with `extra` (the model's identity and the training layout: runtime/model_identity.py)."""
    files = {}
    for path in sorted(checkpoint.rglob("*")):
        if path.is_file() and path.name != MANIFEST:
            files[path.relative_to(checkpoint).as_posix()] = {
                "size": path.stat().st_size, "sha256": file_sha256(path)}
    with open(checkpoint / MANIFEST, "w", encoding="utf-8") as f:
        json.dump({"version": 1, **(extra or {}), "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def manifest_problem(checkpoint: Path, under: tuple[str, ...] = ()) -> str | None:
    """What is wrong with the files the manifest lists (only those under the `under` prefixes,
    when given): "" when every one is present, complete and unchanged; None when the checkpoint
    has no manifest (written before manifests existed: it cannot be verified)."""
    path = checkpoint / MANIFEST
    if not path.is_file():
        return None
    try:
        files = json.loads(path.read_text(encoding="utf-8"))["files"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"its {MANIFEST} is unreadable ({err})"
    for rel, meta in files.items():
        if under and not rel.startswith(under):
            continue
        file = checkpoint / rel
        if not file.is_file():
            return f"file {rel} is missing"
        size = file.stat().st_size
        if size != meta["size"]:
            return f"file {rel} has {size} bytes, {meta['size']} were written (truncated?)"
        if file_sha256(file) != meta["sha256"]:
            return f"file {rel} is damaged (its SHA-256 differs from the one written at save)"
    return ""


def dcp_problem(dcp_dir: Path) -> str:
    """Missing or truncated files of a DCP directory, from the (file, offset, length) of every
    item its `.metadata` records: "" when every file is at least as long as its data."""
    from torch.distributed.checkpoint import FileSystemReader

    if not (dcp_dir / ".metadata").is_file():
        return "file dcp/.metadata is missing"
    try:
        metadata = FileSystemReader(str(dcp_dir)).read_metadata()
        needed: dict[str, int] = {}
        for info in (metadata.storage_data or {}).values():
            end = info.offset + info.length
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    except Exception as err:   # noqa: BLE001 — a damaged metadata file raises anything
        return f"file dcp/.metadata is unreadable ({type(err).__name__})"
    for rel, end in sorted(needed.items()):
        file = dcp_dir / rel
        if not file.is_file():
            return f"file dcp/{rel} is missing"
        size = file.stat().st_size
        if size < end:
            return f"file dcp/{rel} has {size} bytes, its data runs to byte {end} (truncated?)"
    return ""


def read_manifest(checkpoint: Path) -> dict | None:
    """The manifest's contents; None when there is none or it is unreadable (the load then
    names the problem)."""
    try:
        return json.loads((checkpoint / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
