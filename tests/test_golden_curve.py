"""A golden loss/reward curve: a seeded 4-step GRPO run of the default tiny model, step by step
against the figures recorded in `tests/golden/grpo_tiny_curve.json`.

Reproducibility tests compare a run with itself; this one catches a change that moves the
numbers of every run alike (sampling, advantages, the loss, the optimizer, the model code).
When such a change is intended, record the new curve and review its diff with the change:

    DAGRL_UPDATE_GOLDEN=1 python -m pytest tests/test_golden_curve.py

Rewards and response lengths are compared exactly: they are set by the sampled tokens, and a
token only changes if a float differs by enough to move a sampling boundary (the float
rounding of another CPU's matmul kernels, ~1e-7, moves one with probability ~1e-7 per
token). Losses, norms and entropies get a 1e-4 relative tolerance, far above that rounding
and far below any change to a formula.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from dagrl.config.loader import load_config
from dagrl.config.schema import Config
from dagrl.runtime.launch import launch

GOLDEN = Path(__file__).parent / "golden" / "grpo_tiny_curve.json"
OVERRIDES = ["trainer.total_steps=4", "trainer.seed=0", "trainer.torch_threads=1",
             "logging.progress_bar=false", "logging.console_every=1000"]
EXACT = ("reward/mean", "response/length/mean")
CLOSE = ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/kl")


def test_grpo_curve_matches_the_recorded_one(tmp_path):
    cfg = load_config(Config, None, [f"trainer.run_dir={tmp_path / 'run'}", *OVERRIDES])
    history = launch(cfg)
    curve = [{key: m[key] for key in EXACT + CLOSE} for m in history]
    if os.environ.get("DAGRL_UPDATE_GOLDEN") == "1":
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps({"overrides": OVERRIDES, "curve": curve}, indent=1) + "\n")
        pytest.skip(f"recorded {GOLDEN}")
    golden = json.loads(GOLDEN.read_text())
    assert golden["overrides"] == OVERRIDES, "the recorded curve is of another run: record it again"
    assert len(curve) == len(golden["curve"])
    for step, (got, want) in enumerate(zip(curve, golden["curve"]), start=1):
        for key in EXACT:
            assert got[key] == want[key], f"step {step} {key}: {got[key]} != recorded {want[key]}"
        for key in CLOSE:
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-7), \
                f"step {step} {key}: {got[key]} != recorded {want[key]}"
