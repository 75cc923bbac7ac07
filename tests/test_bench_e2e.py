"""Smoke test of `dagrl bench e2e`, our side only: a tiny workload, no TRL, no timing asserts."""

from __future__ import annotations

import json

import pytest

from benchmarks import e2e


@pytest.mark.slow
def test_our_side_runs_and_reports_against_the_limit(tmp_path, capsys, monkeypatch):
    out = tmp_path / "result.json"
    # A relative --out, given from outside the checkout (our side's child runs in it).
    monkeypatch.chdir(tmp_path)
    rc = e2e.main(["--sides", "ours", "--steps", "2", "--prompts", "2", "--samples", "2",
                   "--tokens", "4", "--out", "run", "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "ours:" in printed and "limit:" in printed and "ratio" not in printed

    data = json.loads(out.read_text())
    assert "trl" not in data and "ours-compiled" not in data
    ours = data["ours"]
    assert len(ours["rounds"]) == 2                      # the default: two rounds per side
    assert len(ours["step_seconds"]) == 2                # each round's first step excluded
    assert ours["mean_length"] == [4.0] * 4              # min = max new tokens on our side
    assert ours["tokens_per_s"] > 0 and ours["fraction_of_limit"] > 0
    assert 0.1 < ours["peak_rss_gb"] < 20                 # the child process's ru_maxrss
    assert data["limit"]["matmul_gflops"] > 0 and data["limit"]["tokens_per_s"] > 0
    for round_ in (1, 2):
        assert (tmp_path / "run" / f"ours-run{round_}" / "metrics.jsonl").exists()


def test_flops_count_the_workload_model():
    work = e2e.Workload()
    shape = e2e.ModelShape(hidden=128, layers=4, heads=4, kv_heads=2, intermediate=512, vocab=48,
                           tied=True)
    flops = e2e.step_flops(work, prompt_tokens=6.0, shape=shape, kl=False)
    # 4 layers x (2*128^2 + 2*128*64 + 3*128*512) + 48*128 tied head
    assert flops["matmul_params"] == 4 * (32768 + 16384 + 196608) + 6144
    assert flops["total"] == flops["generation"] + flops["update"] == 4 * flops["forward"]
    assert flops["update"] == 3 * flops["forward"]


def test_flops_of_the_smollm2_workload_count_the_reference_forward():
    # SmolLM2-135M's shape; 8 x 4 sequences of ~80 prompt + 48 completion tokens
    shape = e2e.ModelShape(hidden=576, layers=30, heads=9, kv_heads=3, intermediate=1536,
                           vocab=49152, tied=True)
    work = e2e.Workload(steps=3, prompts=8, samples=4, tokens=48, name="smollm2")
    flops = e2e.step_flops(work, prompt_tokens=80.0, shape=shape, kl=True)
    assert flops["matmul_params"] == 30 * (2 * 576**2 + 2 * 576 * 192 + 3 * 576 * 1536) \
        + 49152 * 576                                   # 134.5M: all but the embedding
    assert flops["total"] == 5 * flops["forward"] == flops["generation"] + flops["reference"] \
        + flops["update"]
    assert 4.0e12 < flops["total"] < 6.0e12              # the issue's ~4.7 TFLOP/step
    # Each group's 80-token prompt once: 80 + 4 x 48 tokens per group, not 4 x 128.
    p, r = 80.0, 48
    context = p * (p + 1) / 2 + 4 * ((p + r) * (p + r + 1) / 2 - p * (p + 1) / 2)
    per_group = 2 * flops["matmul_params"] * (p + 4 * r) + 4 * 576 * 30 * context
    assert flops["shared_forward"] == pytest.approx(8 * per_group)
    assert 0.5 < flops["shared_total"] / flops["total"] < 0.56


def test_first_step_is_excluded():
    work = e2e.Workload(prompts=1, samples=1, tokens=10)
    summary = e2e.summarize([100.0, 1.0, 1.0, 4.0], [200.0, 2.0, 2.0, 2.0], work)
    assert summary["tokens_per_s"] == 10 * 3 / 6.0
    assert summary["tokens_per_s_median"] == 10.0
    assert summary["tokens_per_s_best"] == 10.0
    assert summary["tokens_per_cpu_s"] == 5.0


def test_rounds_pool_their_timed_steps():
    work = e2e.Workload(prompts=1, samples=1, tokens=10)
    runs = [{"step_seconds": [100.0, 1.0, 1.0], "step_cpu_seconds": [1.0, 2.0, 2.0],
             "mean_length": [10.0] * 3, "load_before": 0.5, "load_after": 1.0,
             "peak_rss_gb": 1.0},
            {"step_seconds": [50.0, 4.0], "step_cpu_seconds": [1.0, 2.0],
             "mean_length": [10.0] * 2, "load_before": 0.2, "load_after": 0.7,
             "peak_rss_gb": 3.0}]
    pooled = e2e.pool(runs, work)
    assert pooled["step_seconds"] == [1.0, 1.0, 4.0]      # every round's first step left out
    assert pooled["tokens_per_s"] == 10 * 3 / 6.0
    assert pooled["tokens_per_s_median"] == 10.0
    assert (pooled["load_before"], pooled["load_after"]) == (0.2, 1.0)
    assert pooled["peak_rss_gb"] == 3.0                  # the highest round


def test_ratios_compare_each_pair_and_the_fastest_settings():
    a = {"tokens_per_s": 8.0, "tokens_per_s_median": 6.0, "tokens_per_s_best": 10.0,
         "tokens_per_cpu_s": 4.0}
    b = {"tokens_per_s": 4.0, "tokens_per_s_median": 4.0, "tokens_per_s_best": 4.0,
         "tokens_per_cpu_s": 1.0}
    assert e2e.compare(a, b) == {"mean": 2.0, "median": 1.5, "best": 2.5, "cpu": 4.0}


def test_unknown_side_is_refused(tmp_path):
    import pytest

    with pytest.raises(SystemExit):
        e2e.main(["--sides", "ours,vllm", "--out", str(tmp_path)])


def test_the_step_is_broken_down_by_node_against_each_role_s_limit(tmp_path):
    from benchmarks.flop_limit import role_line

    metrics = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "timing/step_s": 9.0, "timing/rollout_s": 2.0 + s,
             "timing/actor_update_s": 6.0, "timing/actor_update_spread_s": 0.0,
             "timing/reward_s": 0.001} for s in (1, 2, 3)]
    metrics.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    roles = e2e.role_seconds(metrics)                    # step 1 (warm-up) left out
    assert roles["rollout"] == [4.0, 5.0] and roles["actor_update"] == [6.0, 6.0]
    assert "actor_update_spread" not in roles and "step" not in roles
    flops = {"generation": 1e9, "update": 3e9}
    line = role_line(roles, flops, gflops=1.0)            # 1 GFLOP/s: 1 s and 3 s of work
    assert line == ("median per node: actor_update 6.00 s (limit 3.00 s, 50%), "
                    "rollout 4.50 s (limit 1.00 s, 22%)")  # reward (1 ms) left out
    # With the shared-prompt count: each role's limit scaled by shared / plain forward.
    flops.update(forward=1e9, shared_forward=0.5e9)
    line = role_line(roles, flops, gflops=1.0)
    assert line == ("median per node: actor_update 6.00 s (limit 3.00 s, 50%; shared 1.50 s, "
                    "25%), rollout 4.50 s (limit 1.00 s, 22%; shared 0.50 s, 11%)")
