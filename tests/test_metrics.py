"""StepMetrics: exact global means and stds from per-rank sufficient statistics."""

from __future__ import annotations

import math

import torch

from dagrl.observe.metrics import StepMetrics


def test_single_rank_values():
    m = StepMetrics()
    m.add_distribution("reward", torch.tensor([1.0, 2.0, 3.0, 6.0]))
    m.add_mean("kl", 3.0, 4)
    m.add_mean("kl", 1.0, 4)          # second micro-batch: (3 + 1) / (4 + 4)
    m.add_sum("tokens", 10)
    m.add_sum("tokens", 5)
    m.add_max("timing/x_s", 0.5)
    m.add_max("timing/x_s", 0.2)
    out = m.reduce()
    assert out["reward/mean"] == 3.0
    assert math.isclose(out["reward/std"], math.sqrt((4 + 1 + 0 + 9) / 4))   # population std
    assert out["reward/max"] == 6.0 and out["reward/min"] == 1.0
    assert out["kl"] == 0.5 and out["tokens"] == 15 and out["timing/x_s"] == 0.5
    assert not any("\0" in k or ":" in k for k in out)


def test_empty_mean_is_nan_not_error():
    m = StepMetrics()
    m.add_mean("x", 0.0, 0)
    assert math.isnan(m.reduce()["x"])
