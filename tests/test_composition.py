"""The composition matrix (tests/composition_matrix.py, docs/composition.md).

Default suite (seconds, no training): which pairs of features the components refuse, a
pairwise covering array of runs over the others, and docs/composition.md equal to what they
say now (`DAGRL_WRITE_COMPOSITION=1` rewrites it).

`pytest -m composition` (and `-m "vllm and composition"` in the vLLM venv): each run of the
array trains 3 steps with its launcher; every step's metrics are present and finite, each
level's own metrics show it was on, and a run that only adds layouts to its semantic levels
reproduces their 1-worker run.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import pytest

from tests import composition_matrix as cm
from tests.dist_helpers import step_metrics, torchrun_train
from tests.test_vllm import model_dir, vllm_server  # noqa: F401 (the server runs' fixtures)

# Compared with the 1-worker reference, step by step, at the run's relative tolerance or this
# absolute one: PPO's policy loss over whitened advantages is 0 up to float noise of ~1e-6.
COMPARED = ("reward/mean", "response/length/mean", "actor/pg_loss", "actor/grad_norm")
ABS = 1e-5
MATRIX = cm.Matrix.compute()


def test_every_allowed_pair_is_in_a_run_the_components_accept():
    covered = set().union(*(run.covers for run in MATRIX.runs))
    assert covered == {p for p in MATRIX.pairs if p not in MATRIX.refused}
    for run in MATRIX.runs:
        assert cm.accepted_world(run.combo) == (run.world, None), run.combo.label


def test_levels_of_different_factors_set_no_key_differently():
    # Two levels of two factors may meet in a run: their overrides must not fight over a key.
    for a, b in cm.all_pairs():
        keys_a = dict(o.split("=", 1) for o in a.overrides)
        keys_b = dict(o.split("=", 1) for o in b.overrides)
        clash = {k for k in keys_a.keys() & keys_b.keys() if keys_a[k] != keys_b[k]}
        assert not clash, (a.key, b.key, clash)


def test_doc_is_what_the_components_say_now():
    text = cm.render(MATRIX)
    if os.environ.get("DAGRL_WRITE_COMPOSITION") == "1":
        cm.DOC.write_text(text)
    assert cm.DOC.read_text() == text, (
        "docs/composition.md is out of date: rerun with DAGRL_WRITE_COMPOSITION=1")


# --- the runs ----------------------------------------------------------------------------------

def _param(run: cm.Run):
    marks = [pytest.mark.composition] + ([pytest.mark.vllm] if run.combo.vllm else [])
    return pytest.param(run, marks=marks, id=f"run{run.index}")


class Resources:
    """What runs share, started on first use and stopped at the end of the module: a Ray
    instance (joined by every Ray run, as a cluster would be) and test_vllm's `vllm serve` of
    the tiny policy."""

    def __init__(self, root: Path, request) -> None:
        self.root, self.request = root, request
        self.ray_started = False
        self.metrics: dict[int, list[dict]] = {}   # finished runs' steps, by index
        self.failed: set[int] = set()

    def overrides(self, run: cm.Run) -> list[str]:
        server = any("{server_url}" in o for o in run.combo.overrides(run.world))
        return run.combo.overrides(run.world, {"server_url": self.server_url()} if server else None)

    def ray(self) -> None:
        import ray

        if not self.ray_started:
            os.environ.setdefault("RAY_AUTH_MODE", "disabled")
            ray.init(num_cpus=max(cm.WORLD_SIZES), include_dashboard=False, log_to_driver=True,
                     logging_level="WARNING")
            self.ray_started = True

    def server_url(self) -> str:
        return self.request.getfixturevalue("vllm_server")

    def close(self) -> None:
        if self.ray_started:
            import ray

            ray.shutdown()


@pytest.fixture(scope="module")
def resources(tmp_path_factory, request):
    res = Resources(tmp_path_factory.mktemp("composition"), request)
    yield res
    res.close()


def launch_run(run: cm.Run, run_dir: Path, res: Resources) -> list[dict]:
    """Train `run` with its launcher; its training steps' metrics."""
    from dagrl.runtime.launch import launch
    from dagrl.train import load_cli_config

    overrides = res.overrides(run)
    if run.combo.launcher.name == "torchrun":
        torchrun_train(run_dir, run.world, *overrides)
    else:
        if run.world > 1:
            res.ray()
        launch(load_cli_config([f"trainer.run_dir={run_dir}", *overrides]))
    return step_metrics(run_dir)


def check_steps(run: cm.Run, run_dir: Path, steps: list[dict]) -> None:
    """Every step logged, every value finite, each level's own metrics (or files) there."""
    assert [m["step"] for m in steps] == [1, 2, 3], run.combo.label
    for m in steps:
        bad = {k: v for k, v in m.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, (m["step"], bad)
        for key in COMPARED:
            assert key in m, (m["step"], key)
    logged = set().union(*(m.keys() for m in _records(run_dir)))
    for lv in run.combo.levels:
        for mark in lv.evidence:
            if mark.startswith("file:"):
                assert (run_dir / mark[5:]).exists(), (lv.key, mark)
            else:
                assert any(k.startswith(mark) for k in logged), (lv.key, mark)


def _records(run_dir: Path) -> list[dict]:
    import json

    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("run", [_param(r) for r in MATRIX.runs])
def test_run(run: cm.Run, tmp_path, resources):
    if run.combo.vllm:
        pytest.importorskip("vllm")
    started = time.monotonic()
    try:
        steps = launch_run(run, tmp_path / "run", resources)
    except BaseException:
        resources.failed.add(run.index)
        raise
    finally:
        print(f"\n[composition] run {run.index} ({run.world} worker(s), {run.combo.label}): "
              f"{time.monotonic() - started:.1f} s")
    resources.metrics[run.index] = steps
    check_steps(run, tmp_path / "run", steps)
    if run.reference is not None:
        reference, rel = reference_steps(run, tmp_path, resources), run.combo.rel()
        for ours, ref in zip(steps, reference, strict=True):
            for key in COMPARED:
                assert ours[key] == pytest.approx(ref[key], rel=rel, abs=ABS), (
                    f"step {ours['step']} {key}: {ours[key]} here, {ref[key]} in its 1-worker "
                    f"run {run.reference} (rel {rel:g})")


def reference_steps(run: cm.Run, tmp_path: Path, resources: Resources) -> list[dict]:
    """The steps of `run`'s 1-worker reference run: from its own test, or trained here (when
    -k left that test out)."""
    ref = MATRIX.runs[run.reference - 1]
    if ref.index in resources.failed:
        pytest.fail(f"no parity check: the reference, run {ref.index}, failed")
    if ref.index not in resources.metrics:
        resources.metrics[ref.index] = launch_run(ref, tmp_path / "reference", resources)
    return resources.metrics[ref.index]
