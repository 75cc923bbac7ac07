"""Damaged checkpoints, really damaged on disk (issue 22, case 2): `trainer.resume=auto` falls
back to the newest checkpoint that loads completely and says so, with no traceback; nothing
loads -> one error line; `dagrl export` refuses a damaged checkpoint; every failure inside
`Checkpointer.load` (DCP's CheckpointException, a BaseException, included) is a CheckpointError
naming checkpoint and file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dagrl.config.presets import load_run_config
from dagrl.runtime.checkpoint import CheckpointError
from dagrl.runtime.run_dir import prepare_run
from dagrl.runtime.worker import Worker
from tests.reliability.helpers import (
    FAST,
    assert_one_error_line,
    dagrl_cmd,
    run,
    torchrun_cmd,
)

VOLATILE = ("timing/", "throughput/", "memory/", "perf/")
SHARD = Path("dcp") / "__0_0.distcp"


def metrics(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if not k.startswith(VOLATILE)}
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train(run_dir: Path, steps: int):
    return run(dagrl_cmd("train", f"trainer.run_dir={run_dir}", *FAST, "trainer.save_every=1",
                         f"trainer.total_steps={steps}"))


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> tuple[Path, list[dict]]:
    """A 3-step run with a checkpoint after every step, and its metrics."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    proc = train(run_dir, 3)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir, metrics(run_dir)


def copy_run(finished, tmp_path: Path) -> Path:
    run_dir = tmp_path / "run"
    shutil.copytree(finished[0], run_dir)
    return run_dir


def step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:08d}"


def truncate(path: Path, fraction: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * fraction)])


DAMAGE = {
    "truncated-shard": lambda ckpt: truncate(ckpt / SHARD),
    "missing-metadata": lambda ckpt: (ckpt / "dcp" / ".metadata").unlink(),
}


@pytest.mark.parametrize("damage", ["truncated-shard",
                                    pytest.param("missing-metadata", marks=pytest.mark.slow)])
def test_resume_falls_back_to_the_previous_complete_checkpoint(finished, tmp_path, damage):
    run_dir = copy_run(finished, tmp_path)
    DAMAGE[damage](step_dir(run_dir, 3))
    proc = train(run_dir, 4)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr + proc.stdout
    assert "checkpoint step_00000003 cannot be used" in proc.stdout
    assert "resuming from step_00000002, the newest checkpoint that loads completely" in \
        proc.stdout
    assert "resuming from step_00000002" in (run_dir / "dagrl.log").read_text()
    # The previous checkpoint was used: step 3 ran again and reproduced the original step 3.
    resumed = metrics(run_dir)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert resumed[:3] == finished[1]


def test_two_workers_agree_to_fall_back(finished, tmp_path):
    """Under torchrun rank 0 checks the manifest and every rank follows its verdict: both
    ranks step back to step 2 together (here a 1-worker checkpoint resumed by 2 workers)."""
    run_dir = copy_run(finished, tmp_path)
    truncate(step_dir(run_dir, 3) / SHARD)
    proc = run(torchrun_cmd(f"trainer.run_dir={run_dir}", *FAST, "trainer.save_every=1",
                            "trainer.total_steps=4"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming from step_00000002, the newest checkpoint that loads completely" in \
        proc.stdout
    assert "saved by 1 worker(s), now 2" in proc.stdout and "[rank" not in proc.stderr
    resumed = metrics(run_dir)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for key in ("reward/mean", "response/length/mean", "actor/pg_loss"):   # step 3 again
        assert resumed[2][key] == pytest.approx(finished[1][2][key], rel=1e-4, abs=1e-6), key


def test_no_loadable_checkpoint_is_one_error_line(finished, tmp_path):
    run_dir = copy_run(finished, tmp_path)
    for step in (1, 2, 3):
        truncate(step_dir(run_dir, step) / SHARD, 0.9)
    proc = train(run_dir, 4)
    assert proc.returncode == 1
    assert_one_error_line(proc, "error: no checkpoint under",
                          f"{step_dir(run_dir, 3)}: file dcp/__0_0.distcp has")
    assert "Traceback" not in proc.stderr
    assert metrics(run_dir) == finished[1]          # nothing trained from scratch over it


@pytest.mark.parametrize("damage", ["half-truncated-shard",
                                    pytest.param("missing-metadata", marks=pytest.mark.slow),
                                    pytest.param("flipped-byte", marks=pytest.mark.slow)])
def test_export_refuses_a_damaged_checkpoint(finished, tmp_path, damage):
    run_dir = copy_run(finished, tmp_path)
    ckpt = step_dir(run_dir, 3)
    if damage == "half-truncated-shard":
        truncate(ckpt / SHARD)
        shown = "file dcp/__0_0.distcp has"
    elif damage == "missing-metadata":
        (ckpt / "dcp" / ".metadata").unlink()
        shown = "file dcp/.metadata is missing"
    else:   # same size, one byte changed: only the checksum can tell
        data = bytearray((ckpt / SHARD).read_bytes())
        data[len(data) // 2] ^= 0xFF
        (ckpt / SHARD).write_bytes(bytes(data))
        shown = "file dcp/__0_0.distcp is damaged (its SHA-256 differs"
    out = tmp_path / "exported"
    proc = run(dagrl_cmd("export", str(run_dir), "--out", str(out)))
    assert proc.returncode == 2
    assert_one_error_line(proc, f"checkpoint {ckpt}: {shown}",
                          f"the checkpoint before it is {step_dir(run_dir, 2)}")
    assert "Traceback" not in proc.stderr and not out.exists()


def test_dcp_failure_without_a_manifest_is_a_checkpoint_error(finished, tmp_path):
    """A checkpoint from before manifests, damaged where sizes cannot tell (the shard's zip
    directory zeroed): DCP raises CheckpointException, a BaseException; load turns it into a
    CheckpointError naming the checkpoint and dcp/."""
    run_dir = copy_run(finished, tmp_path)
    ckpt = step_dir(run_dir, 3)
    for path in run_dir.glob("checkpoints/*/manifest.json"):   # as written before manifests:
        path.unlink()                                         # no manifest, no format field
        state = json.loads((path.parent / "trainer_state.json").read_text())
        del state["format"]
        (path.parent / "trainer_state.json").write_text(json.dumps(state))
    data = bytearray((ckpt / SHARD).read_bytes())
    data[-4096:] = bytes(4096)
    (ckpt / SHARD).write_bytes(bytes(data))
    cfg = prepare_run(load_run_config(None, [f"trainer.run_dir={run_dir}", *FAST,
                                             "trainer.total_steps=3"]))
    worker = Worker(cfg)
    with pytest.raises(CheckpointError, match=rf"checkpoint {ckpt}: cannot load the "
                                              r"model/optimizer state in dcp/"):
        worker.checkpointer.load(ckpt, worker.stateful_engines())
    # resume=auto steps back to step 2 in this process too
    assert worker.resume()[0] == 2
