"""Smoke test of `dagrl bench dataplane`: a tiny configuration, in-process, no timing asserts.

Two rounds of two launches (ours, single; then single, ours) of two spawned gloo workers each;
most of the time is the workers importing torch.
"""

from __future__ import annotations

import json

import pytest

from benchmarks import dataplane

FIELDS = {"workers", "mib_per_step", "mib_per_worker", "sweep", "ours_s", "single_s", "speedup",
          "ours_peak_mib", "coordinator_peak_mib", "mem_ratio", "verified"}


@pytest.mark.slow
def test_tiny_run_prints_table_and_writes_verified_rows(tmp_path, capsys):
    out = tmp_path / "rows.json"
    # 0.5 MiB per worker at W=2 is the same point as 1 MiB per step, so it is measured once.
    rc = dataplane.main(["--workers", "2", "--sizes", "1", "--per-worker-mib", "0.5",
                         "--repeats", "1", "--rounds", "2", "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    header = printed.splitlines()[0].split()
    assert header[:9] == ["workers", "mib_per_step", "mib_per_worker", "ours_s", "single_s",
                          "speedup", "ours_peak_mib", "coordinator_peak_mib", "mem_ratio"]
    assert "all moves verified" in printed
    assert "target speedup >= 3x" in printed   # a verdict line, whichever way it went
    assert "median over 2 round(s)" in printed

    data = json.loads(out.read_text())
    (row,) = data["rows"]
    assert set(row) >= FIELDS
    assert row["workers"] == 2 and row["verified"] is True
    assert row["sweep"] == "per-worker+total"
    assert abs(row["mib_per_step"] - 1.0) < 0.1             # n rounds to whole samples
    for key in ("ours_s", "single_s", "speedup", "mem_ratio"):
        assert row[key] > 0
    ratios = [float(x) for x in row["round_ratios"].split(",")]
    assert len(ratios) == 2 and min(ratios) <= row["speedup"] <= max(ratios)
    assert row["ours_peak_mib"] >= 0 and row["coordinator_peak_mib"] >= 0
    assert "speedup_met" in data["targets"]


def test_sizes_map_to_whole_samples_per_rank():
    args = dataplane.parse_args(["--workers", "2,4", "--sizes", "8", "--per-worker-mib", "0"])
    assert args.workers == [2, 4] and args.sizes == [8.0] and args.per_worker_mib == 0
    assert args.rounds == 3
    n = round(8 * dataplane.MIB / (4 * dataplane.SAMPLE_BYTES))
    shard = dataplane._shard(rank=1, n=n, seed=0)
    assert shard.nbytes() == n * dataplane.SAMPLE_BYTES     # SAMPLE_BYTES matches the fields
    assert len(set(shard["uid"])) == -(-n // dataplane.GROUP)
