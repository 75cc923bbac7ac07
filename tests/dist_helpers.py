"""Run a function on W local CPU processes joined by a gloo process group (tests only)."""

from __future__ import annotations

import os
import socket
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, fn, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world))
    import torch

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        queue.put((rank, "ok", fn(rank, world, *args)))
    except BaseException:  # report the worker's traceback to the test
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn, world: int, *args, timeout: float = 180.0) -> list:
    """fn(rank, world, *args) on `world` processes; returns the results in rank order."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, fn, args, queue))
             for r in range(world)]
    for p in procs:
        p.start()
    results, errors = {}, []
    try:
        for _ in range(world):
            rank, status, value = queue.get(timeout=timeout)
            if status == "error":
                errors.append(f"rank {rank}:\n{value}")
                break
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5 if errors else 60)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [results[r] for r in range(world)]


def torchrun_train(run_dir, workers: int, *overrides: str) -> str:
    """`dagrl.train` on `workers` torchrun processes; its stdout + stderr (fails the test on a
    non-zero exit, with the end of stderr). `overrides` may repeat the run dir and worker count
    (dagrl itself refuses a key given twice)."""
    import subprocess
    import sys

    from dagrl.config.loader import with_defaults

    args = with_defaults([f"trainer.run_dir={run_dir}", f"trainer.n_workers={workers}"],
                         overrides)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(workers),
           "--master-port", str(free_port()), "-m", "dagrl.train", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def step_metrics(run_dir) -> list[dict]:
    """The training steps' records of RUN_DIR/metrics.jsonl."""
    import json
    from pathlib import Path

    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if "actor/pg_loss" in line]


def assert_same_steps(ours: list[dict], reference: list[dict], keys, rel: float = 1e-4) -> None:
    """Same steps, and each of `keys` equal at `rel` (abs 1e-6) in every step."""
    import pytest

    assert [m["step"] for m in ours] == [m["step"] for m in reference]
    for a, b in zip(ours, reference, strict=True):
        for key in keys:
            assert a[key] == pytest.approx(b[key], rel=rel, abs=1e-6), (a["step"], key)


def assert_resumed_run_matches_one_worker(tmp_path, workers: int, common: list[str],
                                          parallel: list[str], keys) -> None:
    """A 3-step 1-worker run with `common` against a `workers`-process torchrun run with
    `common` + `parallel` that checkpoints every step, stops after step 2 and resumes from it
    to step 3."""
    from dagrl.config.presets import load_run_config
    from dagrl.runtime.checkpoint import list_checkpoints
    from dagrl.runtime.launch import launch

    one = tmp_path / "one"
    launch(load_run_config(None, [f"trainer.run_dir={one}", *common, "trainer.total_steps=3"]))
    run_dir = tmp_path / "parallel"
    overrides = [*common, *parallel, "trainer.save_every=1"]
    torchrun_train(run_dir, workers, *overrides, "trainer.total_steps=2")
    assert [s for s, _ in list_checkpoints(run_dir / "checkpoints")][-1] == 2
    out = torchrun_train(run_dir, workers, *overrides, "trainer.total_steps=3")
    assert "resumed from" in out and f"(step 2, saved by {workers} worker(s)" in out, out[-2000:]
    ours = step_metrics(run_dir)
    assert [m["step"] for m in ours] == [1, 2, 3]
    assert_same_steps(ours, step_metrics(one), keys)
