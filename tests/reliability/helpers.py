"""Running dagrl as a user does — `dagrl train` / `torchrun ... -m dagrl.train` / `dagrl export`
in subprocesses — and inspecting what it leaves: the terminal's lines, the run directory, the
processes still alive."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from tests.dist_helpers import free_port

# One quick step: 4 prompts x 2 samples, 4 new tokens.
SMALL = ["logging.progress_bar=false", "logging.console_every=1000", "trainer.torch_threads=1",
         "data.train_batch_size=4", "actor.mini_batch_size=4", "rollout.n=2",
         "rollout.max_new_tokens=4", "trainer.total_steps=1"]
FAST = ["logging.progress_bar=false", "logging.console_every=1000", "trainer.torch_threads=1"]


def env() -> dict[str, str]:
    return {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONUNBUFFERED": "1"}


def dagrl_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "dagrl.cli", *args]


def torchrun_cmd(*args: str, workers: int = 2) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(workers),
            "--master-port", str(free_port()), "-m", "dagrl.train",
            f"trainer.n_workers={workers}", *args]


def dagrl_torchrun_cmd(*args: str, workers: int = 2) -> list[str]:
    """`dagrl train --nproc-per-node N`: torchrun's agent inside dagrl (no launcher traceback)."""
    return dagrl_cmd("train", "--nproc-per-node", str(workers), "--master-port",
                     str(free_port()), *args)


def run(cmd: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env(),
                          check=False)


def error_lines(stderr: str) -> list[str]:
    """dagrl's own error lines (torchrun's summary quotes them indented; not counted)."""
    return [line for line in stderr.splitlines() if line.startswith(("error:", "config error:"))]


def assert_one_error_line(proc: subprocess.CompletedProcess, *needles: str) -> str:
    """Exactly one error line, naming every needle; no traceback printed by dagrl."""
    lines = error_lines(proc.stderr)
    assert len(lines) == 1, proc.stderr[-4000:]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def arith_rows(n: int) -> list[dict]:
    return [{"data_source": "arith", "prompt": [{"role": "user", "content": f"{i}+1="}],
             "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
             "extra_info": {"index": i}} for i in range(n)]


def write_rows(path: Path, rows: list[dict], schema: pa.Schema | None = None) -> Path:
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return path


def alive(pid: int) -> bool:
    """A live process (a zombie has exited; only its exit status waits to be collected)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return False
    return data[data.rindex(b")") + 2:].split()[0] != b"Z"


def _children_map() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    data = f.read()
            except OSError:
                continue
            ppid = int(data[data.rindex(b")") + 2:].split()[1])
            out.setdefault(ppid, []).append(int(name))
    return out


class ProcessTree:
    """Every process ever seen below `root` (polled in a thread): what a run started."""

    def __init__(self, root: int, poll_s: float = 0.1) -> None:
        self.root, self.seen = root, set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, args=(poll_s,), daemon=True)
        self._thread.start()

    def _loop(self, poll_s: float) -> None:
        while not self._stop.is_set():
            children = _children_map()
            todo = [self.root, *self.seen]
            while todo:
                for child in children.get(todo.pop(), []):
                    if child not in self.seen:
                        self.seen.add(child)
                        todo.append(child)
            time.sleep(poll_s)

    def stop(self) -> set[int]:
        self._stop.set()
        self._thread.join()
        return self.seen

    def alive(self) -> list[int]:
        return sorted(p for p in self.seen if alive(p))


def wait_for(predicate, timeout: float, what: str, poll_s: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def worker_pids(run_dir: Path, n: int) -> list[int] | None:
    files = sorted((run_dir / "workers").glob("rank*.pid")) if (run_dir / "workers").is_dir() \
        else []
    try:
        pids = [int(f.read_text()) for f in files]
    except ValueError:   # a pid file being written
        return None
    return pids if len(pids) == n else None


def checkpoints(run_dir: Path) -> list[str]:
    root = run_dir / "checkpoints"
    return sorted(p.name for p in root.glob("step_*")) if root.is_dir() else []


def newest_write(run_dir: Path) -> float:
    """The newest modification time of anything under `run_dir` (seconds since the epoch)."""
    times = []
    for path in [run_dir, *run_dir.rglob("*")]:
        with contextlib.suppress(FileNotFoundError):   # removed while listing
            times.append(path.stat().st_mtime)
    return max(times)


def kill9(pid: int) -> float:
    os.kill(pid, signal.SIGKILL)
    return time.time()
