"""Checkpoints: written by every rank together, committed atomically, loadable by any world size.

A checkpoint is a directory `<checkpoint_dir>/step_<step:08d>/`:

    dcp/                 torch.distributed.checkpoint: actor and critic weights and optimizer
                         state, each rank writing its own shards (no gather onto one rank)
    trainer_state.json   step, dataloader position, LR schedulers, KL controller, engine versions
    rng/rank<r>.pt       each rank's torch / numpy / python RNG states
    hf/                  the model config and tokenizer, so `dagrl export` needs nothing else

It is written under `.tmp-step_<step>` and renamed into place by rank 0 after every rank has
finished: a directory named `step_*` is always complete, and a crash or a full disk mid-write
leaves the previous checkpoints as they were. `keep_last` prunes the oldest after a commit.

Loading goes through DCP's resharding: model and optimizer state are saved with fully
qualified names and each rank reads the slices its current FSDP layout needs, so a checkpoint
written by N workers loads into M. The dataloader position is global (see data/dataset.py), so
the data order continues whatever M is.
"""

from __future__ import annotations

import contextlib
import json
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
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from dagrl.device import rng_state, set_rng_state

STEP_DIR = re.compile(r"^step_(\d+)$")
STATE_FILE = "trainer_state.json"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names the directory."""


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
                 barrier: Callable[[], None]) -> None:
        self.root, self.rank, self.keep_last = Path(root), rank, keep_last
        self.barrier = barrier

    # --- save ------------------------------------------------------------------------------
    def save(self, step: int, engines: dict[str, Stateful], trainer_state: dict,
             hf_files: Callable[[Path], None] | None = None) -> Path:
        """Write the checkpoint of `step` and commit it. `trainer_state` (JSON) and `hf_files`
        (writes the model config and tokenizer into a directory) are used on rank 0 only."""
        final, tmp = step_dir(self.root, step), self.root / f".tmp-step_{step:08d}"
        error: BaseException | None = None
        try:
            if self.rank == 0:
                self.root.mkdir(parents=True, exist_ok=True)
                for stale in self.root.glob(".tmp-step_*"):   # left by an interrupted save
                    shutil.rmtree(stale, ignore_errors=True)
                tmp.mkdir()
            self.barrier()
            state = {name: _engine_state(e) for name, e in engines.items()}
            with single_process_quiet():
                dcp.save(state, checkpoint_id=str(tmp / "dcp"), no_dist=not dist.is_initialized())
            (tmp / "rng").mkdir(exist_ok=True)
            torch.save(rng_state(), tmp / "rng" / f"rank{self.rank}.pt")
            if self.rank == 0:
                full = {**trainer_state, "step": step, "schedulers": {
                    name: e.scheduler.state_dict() for name, e in engines.items()}}
                _write_json(tmp / STATE_FILE, full)
                if hf_files is not None:
                    hf_files(tmp / "hf")
        except BaseException as err:   # noqa: BLE001 — re-raised below with the directory named
            error = err
        self.barrier()
        if error is not None:
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            previous = latest_checkpoint(self.root)
            raise CheckpointError(
                f"writing checkpoint {final} failed ({type(error).__name__}: {error}); "
                f"nothing was committed, the previous checkpoint "
                f"({previous or 'none'}) is untouched") from error
        if self.rank == 0:
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
        the trainer state saved with it."""
        path = Path(path)
        try:
            trainer_state = json.loads((path / STATE_FILE).read_text())
        except (OSError, ValueError) as err:
            raise CheckpointError(f"{path}: cannot read {STATE_FILE} ({err})") from err
        missing = [name for name in engines if name not in trainer_state["schedulers"]]
        if missing:
            raise CheckpointError(f"{path} holds no state for {missing} (it has "
                                  f"{sorted(trainer_state['schedulers'])}); the graph now trains "
                                  "a model the checkpointed run did not")
        state = {name: _engine_state(e) for name, e in engines.items()}
        try:
            with single_process_quiet():
                dcp.load(state, checkpoint_id=str(path / "dcp"), no_dist=not dist.is_initialized())
        except Exception as err:
            raise CheckpointError(f"{path}: cannot load model/optimizer state ({err})") from err
        for name, e in engines.items():
            set_state_dict(e.model, e.optimizer, model_state_dict=state[name]["model"],
                           optim_state_dict=state[name]["optim"])
            e.scheduler.load_state_dict(trainer_state["schedulers"][name])
        rng_file = path / "rng" / f"rank{self.rank}.pt"
        if rng_file.is_file():   # absent when resuming with more workers than were saved
            set_rng_state(torch.load(rng_file, weights_only=False))
        return trainer_state


@contextlib.contextmanager
def single_process_quiet():
    """DCP warns on every call without a process group, which is how one worker runs."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


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
