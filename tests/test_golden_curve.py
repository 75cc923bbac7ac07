"""A golden loss/reward curve: a seeded 4-step GRPO run of the default tiny model, step by step
against the figures recorded in `tests/golden/grpo_tiny_curve.json`.

Reproducibility tests compare a run with itself; this one catches a change that moves the
numbers of every run alike (sampling, advantages, the loss, the optimizer, the model code).
When such a change is intended, record the new curve and review its diff with the change:

    DAGRL_UPDATE_GOLDEN=1 python -m pytest tests/test_golden_curve.py

The run computes in float64 (`model.dtype=float64`), so that another CPU or BLAS build, whose
matmuls round differently, still gives the same curve: its float64 differences (~1e-16) almost
never survive the sampler's cast of the logits to float32, so the same tokens are drawn and
rewards and lengths can be compared exactly. (In float32 a last-bit difference in a logit moves
a sampled token with a probability estimated at ~1e-5 per token, and a 4-step run draws
thousands.)
Losses, norms, entropies and KL get a 1e-6 relative tolerance, far above float64 rounding and
far below any change to a formula.
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
             "model.dtype=float64", "logging.progress_bar=false", "logging.console_every=1000"]
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
    for step, (got, want) in enumerate(zip(curve, golden["curve"], strict=True), start=1):
        for key in EXACT:
            assert got[key] == want[key], f"step {step} {key}: {got[key]} != recorded {want[key]}"
        for key in CLOSE:
            assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-9), \
                f"step {step} {key}: {got[key]} != recorded {want[key]}"
