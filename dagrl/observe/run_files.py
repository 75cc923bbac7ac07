"""The run's JSON-lines logs (metrics.jsonl, val_generations.jsonl) read as a crash may leave
them: a last line cut short, a tail of NUL bytes (what some file systems show after a power
loss: the size was committed, the data was not), bytes that are not UTF-8. The checkpoint is the
run's truth; these logs are append-only records beside it, so a damaged line is skipped and
counted, never fatal, and a resume cuts the logs back to the checkpoint's step.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path


@contextlib.contextmanager
def naming_path(path: Path) -> Iterator[None]:
    """An OS error while writing `path` names it: a failed write() or flush() (a full disk, a
    file system gone read-only) carries no file name of its own, and the error line would say
    "No space left on device" without saying where."""
    try:
        yield
    except OSError as err:
        if err.filename is None and err.errno is not None:
            raise OSError(err.errno, err.strerror or str(err), str(path)) from err
        raise


@dataclass
class JsonlContents:
    """The readable records of a JSON-lines file and the lines that were not."""

    records: list[dict] = field(default_factory=list)
    skipped: list[tuple[int, str]] = field(default_factory=list)   # (line number, why)
    complete: bool = True   # the file ends with a newline (or is empty): appends start clean

    def skipped_line(self, path: Path) -> str:
        """One line naming the skipped lines (the first few), or "" when none were."""
        if not self.skipped:
            return ""
        shown = ", ".join(f"line {n} ({why})" for n, why in self.skipped[:3])
        more = f" and {len(self.skipped) - 3} more" if len(self.skipped) > 3 else ""
        return f"{path}: skipped {len(self.skipped)} damaged line(s): {shown}{more}"


def _parse_line(raw: bytes) -> dict | str:
    """A record, or why the line is not one."""
    if b"\0" in raw:
        return "NUL bytes"
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return "not UTF-8"
    try:
        record = json.loads(text)
    except json.JSONDecodeError:
        return "not JSON, cut short?"
    if not isinstance(record, dict) or type(record.get("step")) is not int:
        return "no integer step"
    return record


def read_jsonl(path: Path) -> JsonlContents:
    """Every record of `path` that decodes, and the line number and reason of each that does
    not. Blank lines are neither."""
    data = path.read_bytes()
    out = JsonlContents(complete=not data or data.endswith(b"\n"))
    for number, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        parsed = _parse_line(raw)
        if isinstance(parsed, str):
            out.skipped.append((number, parsed))
        else:
            out.records.append(parsed)
    return out


def cut_jsonl(path: Path, last_step: int) -> tuple[int, JsonlContents]:
    """Keep the records of steps <= `last_step` (a resume's checkpoint step; -1 drops them all:
    a run that starts over) and drop damaged lines, replacing the file atomically when anything
    goes. Returns how many records were dropped and what was read."""
    if not path.is_file():
        return 0, JsonlContents()
    contents = read_jsonl(path)
    kept = [r for r in contents.records if r["step"] <= last_step]
    dropped = len(contents.records) - len(kept)
    if dropped or contents.skipped or not contents.complete:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in kept),
                       encoding="utf-8")
        os.replace(tmp, path)
    return dropped, contents
