"""Checkpoints: written by every rank together, committed atomically, loadable by any world size.

A checkpoint is a directory `<checkpoint_dir>/step_<step:08d>/`:

    dcp/                 torch.distributed.checkpoint: actor and critic weights and optimizer
                         state, each rank writing its own shards (no gather onto one rank)
    trainer_state.json   step, dataloader position, LR schedulers, KL controller, engine versions
    rng/rank<r>.pt       each rank's torch / numpy / python RNG states
    hf/                  the model config and tokenizer, so `dagrl export` needs nothing else

    manifest.json        size and SHA-256 of every file above (runtime/manifest.py), the
                         model's identity (runtime/model_identity.py) and the training layout

It is written under `.tmp-step_<step>` and renamed into place by rank 0 after every rank has
finished: a directory named `step_*` is always complete, and a crash or a full disk mid-write
leaves the previous checkpoints as they were. `keep_last` prunes the oldest after a commit.

Loading checks the manifest first (rank 0, verdict shared), then loads; any failure is a
`CheckpointError` naming the checkpoint and the file. `load_newest` (trainer.resume=auto) falls
back to the next older checkpoint when one fails, and says so.

Loading goes through DCP's resharding: model and optimizer state are saved with fully
qualified names and each rank reads the slices its current FSDP layout needs, so a checkpoint
written by N workers loads into M. The dataloader position is global (see data/dataset.py), so
the data order continues whatever M is.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from dagrl.device import rng_state, set_rng_state
from dagrl.runtime.manifest import MANIFEST, dcp_problem, manifest_problem, write_manifest

STEP_DIR = re.compile(r"^step_(\d+)$")
STATE_FILE = "trainer_state.json"
# 2: written with a manifest (runtime/manifest.py) that records the model's identity; a
# checkpoint of this format without one has lost it.
FORMAT = 2


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names the directory."""


# What loading a damaged checkpoint raises: DCP wraps per-rank errors in CheckpointException,
# a BaseException (so `except Exception` misses it); torch.load and json raise the usual ones.
LOAD_ERRORS = (Exception, CheckpointException)


def os_cause(err: BaseException) -> OSError | None:
    """The OS error under `err`, if any: through `raise ... from`, implicit chaining and DCP's
    per-rank failures (CheckpointException.failures: rank -> (exception, traceback))."""
    queue, seen = [err], set()
    while queue:
        e = queue.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError):
            return e
        if isinstance(e, CheckpointException):
            queue += [failure[0] for failure in e.failures.values()]
        queue += [e.__cause__, e.__context__]
    return None


def describe_os_error(err: OSError, writing: Path) -> str:
    """`No space left on device: '/ckpt/.tmp-step_3/dcp'`: the cause and the path, the error's
    own or (a failed write() names no file) the one being written."""
    paths = [p for p in (err.filename, err.filename2) if p is not None] or [writing]
    return (err.strerror or str(err)) + "".join(f": {str(p)!r}" for p in paths)


def first_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    # CheckpointException's first lines list ranks and "Traceback ..."; its last is the cause.
    text = lines[-1] if isinstance(err, CheckpointException) and lines else \
        (lines[0] if lines else "")
    return f"{type(err).__name__}: {text[:300]}"


def checkpoint_problem(path: Path, under: tuple[str, ...] = ()) -> str:
    """What the manifest says is damaged (among the files under the `under` prefixes, when
    given); for a checkpoint written before manifests, what DCP's metadata says; "" if none."""
    problem = manifest_problem(path, under)
    if problem is not None:
        return problem
    if _format(path) >= FORMAT:   # written with a manifest: it was deleted
        return (f"its {MANIFEST} is missing (the checkpoint was written with one), so its "
                "files cannot be verified")
    return dcp_problem(path / "dcp")


def _format(path: Path) -> int:
    """The checkpoint format its trainer state records (1: before the field existed)."""
    try:
        return int(json.loads((path / STATE_FILE).read_text()).get("format", 1))
    except (OSError, ValueError, TypeError, AttributeError):
        return 1


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Committed checkpoints under `root`, oldest first (temporary directories are ignored)."""
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = STEP_DIR.match(path.name)
        if match and (path / STATE_FILE).is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


def latest_checkpoint(root: Path) -> Path | None:
    found = list_checkpoints(root)
    return found[-1][1] if found else None


def resolve_resume(resume: str, root: Path) -> Path | None:
    """`trainer.resume`: "never" -> None; "auto" -> the newest committed checkpoint under
    `root` (None if there is none); anything else is a checkpoint directory that must exist."""
    if resume == "never":
        return None
    if resume == "auto":
        return latest_checkpoint(root)
    path = Path(resume)
    if not (path / STATE_FILE).is_file():
        raise CheckpointError(f"trainer.resume={resume!r}: not a checkpoint directory (no "
                              f"{STATE_FILE}); committed checkpoints are named step_<N>")
    return path


@dataclass
class Stateful:
    """A trained model and its optimizer and LR scheduler, as checkpoints see them."""
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any


class Checkpointer:
    """Saves and loads the training state of one rank; every rank calls save/load together.

    `barrier` synchronises all ranks (a no-op for one worker); only rank 0 touches directory
    names, so the commit is one rename.
    """

    def __init__(self, root: Path, *, rank: int, keep_last: int,
                 barrier: Callable[[], None],
                 broadcast: Callable[[Any], Any] = lambda obj: obj,
                 all_ok: Callable[[bool], bool] = lambda ok: ok,
                 process_group: dist.ProcessGroup | None = None) -> None:
        self.root, self.rank, self.keep_last = Path(root), rank, keep_last
        # The ranks that hold the trained models (trainer.mode=async: the trainer ranks; None:
        # all of them), over which DCP coordinates.
        self.process_group = process_group
        # `broadcast`: rank 0's object on every rank; `all_ok`: True on every rank iff every
        # rank passed True. Identities for one worker. Ranks must agree on whether a load
        # worked, or one would train while another falls back.
        self.barrier, self.broadcast, self.all_ok = barrier, broadcast, all_ok

    # --- save ------------------------------------------------------------------------------
    def save(self, step: int, engines: dict[str, Stateful], trainer_state: dict,
             hf_files: Callable[[Path], None] | None = None,
             manifest: dict | None = None) -> Path:
        """Write the checkpoint of `step` and commit it. `trainer_state` (JSON), `hf_files`
        (writes the model config and tokenizer into a directory) and `manifest` (entries for
        the manifest beside its file list) are used on rank 0 only."""
        final, tmp = step_dir(self.root, step), self.root / f".tmp-step_{step:08d}"
        error: BaseException | None = None
        writing = tmp   # what is being written: named in the error (write() names no file)
        try:
            if self.rank == 0:
                self.root.mkdir(parents=True, exist_ok=True)
                for stale in self.root.glob(".tmp-step_*"):   # left by an interrupted save
                    shutil.rmtree(stale, ignore_errors=True)
                tmp.mkdir()
            self.barrier()
            state = {name: _engine_state(e) for name, e in engines.items()}
            writing = tmp / "dcp"
            with single_process_quiet():
                dcp.save(state, checkpoint_id=str(writing), no_dist=not dist.is_initialized(),
                         process_group=self.process_group)
            (tmp / "rng").mkdir(exist_ok=True)
            writing = tmp / "rng" / f"rank{self.rank}.pt"
            torch.save(rng_state(), writing)
            if self.rank == 0:
                full = {**trainer_state, "step": step, "format": FORMAT, "schedulers": {
                    name: e.scheduler.state_dict() for name, e in engines.items()}}
                writing = tmp / STATE_FILE
                _write_json(writing, full)
                if hf_files is not None:
                    writing = tmp / "hf"
                    hf_files(writing)
        except BaseException as err:   # noqa: BLE001 — re-raised below with the directory named
            error = err
        self.barrier()
        if error is not None:
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            previous = latest_checkpoint(self.root)
            cause = os_cause(error)
            why = describe_os_error(cause, writing) if cause is not None else first_line(error)
            raise CheckpointError(
                f"writing checkpoint {final} failed ({why}); nothing was committed, the "
                f"previous checkpoint ({previous or 'none'}) is untouched") from error
        if self.rank == 0:
            write_manifest(tmp, manifest)
            _commit(tmp, final)
            self._prune()
        self.barrier()
        return final

    def _prune(self) -> None:
        if self.keep_last <= 0:
            return
        for _, path in list_checkpoints(self.root)[:-self.keep_last]:
            shutil.rmtree(path, ignore_errors=True)

    # --- load ------------------------------------------------------------------------------
    def load(self, path: Path, engines: dict[str, Stateful]) -> dict:
        """Load `path` into `engines` (resharding as needed) and this rank's RNG state; returns
        the trainer state saved with it. Any failure, on any rank, is a CheckpointError on
        every rank, naming the checkpoint and the file."""
        path = Path(path)
        problem = self._problem(path) if self.rank == 0 else None
        problem = self.broadcast(problem)
        if problem:
            raise CheckpointError(f"checkpoint {path}: {problem}")
        error: CheckpointError | None = None
        try:
            trainer_state = self._load(path, engines)
        except CheckpointError as err:
            error = err
        if not self.all_ok(error is None):
            raise error or CheckpointError(f"checkpoint {path}: another rank could not load it")
        return trainer_state

    @staticmethod
    def _problem(path: Path) -> str:
        return checkpoint_problem(path)

    def _load(self, path: Path, engines: dict[str, Stateful]) -> dict:
        try:
            trainer_state = json.loads((path / STATE_FILE).read_text())
            saved = trainer_state["schedulers"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise CheckpointError(f"checkpoint {path}: cannot read {STATE_FILE} "
                                  f"({first_line(err)})") from err
        missing = [name for name in engines if name not in saved]
        if missing:
            raise CheckpointError(f"{path} holds no state for {missing} (it has "
                                  f"{sorted(saved)}); the graph now trains a model the "
                                  "checkpointed run did not")
        state = {name: _engine_state(e) for name, e in engines.items()}
        try:
            with single_process_quiet():
                dcp.load(state, checkpoint_id=str(path / "dcp"), no_dist=not dist.is_initialized(),
                         process_group=self.process_group)
        except LOAD_ERRORS as err:
            raise CheckpointError(f"checkpoint {path}: cannot load the model/optimizer state in "
                                  f"dcp/ ({first_line(err)})") from err
        rng_file = path / "rng" / f"rank{self.rank}.pt"
        try:
            # absent when resuming with more workers than were saved
            rng = torch.load(rng_file, weights_only=False) if rng_file.is_file() else None
            for name, e in engines.items():
                set_state_dict(e.model, e.optimizer, model_state_dict=state[name]["model"],
                               optim_state_dict=state[name]["optim"])
                e.scheduler.load_state_dict(saved[name])
        except LOAD_ERRORS as err:
            raise CheckpointError(f"checkpoint {path}: cannot restore rng/{rng_file.name} or "
                                  f"the schedulers ({first_line(err)})") from err
        if rng is not None:
            set_rng_state(rng)
        return trainer_state

    def load_newest(self, engines: dict[str, Stateful],
                    log: Callable[[str], None]) -> tuple[Path, dict] | None:
        """`trainer.resume=auto`: the newest committed checkpoint that loads completely, after
        saying why each newer one was skipped; None when there is none. Every checkpoint
        failing is an error: starting over would silently discard the run."""
        failed: list[str] = []
        for _, path in reversed(list_checkpoints(self.root)):
            try:
                state = self.load(path, engines)
            except CheckpointError as err:
                failed.append(str(err))
                log(f"checkpoint {path.name} cannot be used ({err}); trying the one before it")
                continue
            if failed:
                log(f"resuming from {path.name}, the newest checkpoint that loads completely")
            return path, state
        if failed:
            raise CheckpointError(f"no checkpoint under {self.root} loads completely (newest: "
                                  f"{failed[0]}); move them away and set trainer.resume=never "
                                  "to start over")
        return None


def _not_from_dcp(record: logging.LogRecord) -> bool:
    return "distributed/checkpoint" not in record.pathname.replace(os.sep, "/")


@contextlib.contextmanager
def single_process_quiet():
    """DCP warns on every call without a process group, which is how one worker runs; and on a
    damaged checkpoint it logs the tracebacks of its fallbacks on the root logger before it
    raises. The error we raise from its exception says what failed, in one line."""
    root = logging.getLogger()
    root.addFilter(_not_from_dcp)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            yield
    finally:
        root.removeFilter(_not_from_dcp)


def _engine_state(e: Stateful) -> dict:
    # Fully qualified names and (for FSDP2) DTensor shards: what makes the load reshardable.
    model_state, optim_state = get_state_dict(e.model, e.optimizer)
    return {"model": model_state, "optim": optim_state}


def _write_json(path: Path, data: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _commit(tmp: Path, final: Path) -> None:
    """Rename `tmp` to `final` (replacing an older `final`, e.g. a step re-run after a restart)."""
    if final.exists():
        old = final.with_name(f".old-{final.name}")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    dir_fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)   # make the rename itself durable
    finally:
        os.close(dir_fd)
