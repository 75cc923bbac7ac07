"""The weak-scaling model (`dagrl bench scale`): the simulator, the fits, the two designs'
behaviour, and a quick run of the bench on the committed calibration file (no timing asserts:
the figures it prints are the model's, from measurements recorded in that file)."""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace

import numpy as np
import pytest

from benchmarks import scale
from benchmarks.scale_calibrate import node_spans, usage_between
from benchmarks.scale_fit import available_cores, contention, fit_decode, stop_prob
from benchmarks.scale_measure import fit_alpha_beta
from benchmarks.scale_model import (
    PHASE_OF,
    Costs,
    DriverCosts,
    Model,
    Options,
    Workload,
    WorkloadError,
    ring,
)
from benchmarks.scale_presets import NVLINK_IB, PresetError, with_overrides
from benchmarks.scale_sim import Sim, device_phases

COSTS = Costs(eta_update=0.4, eta_forward=0.45, eta_decode=0.05, decode_fixed_rows=100,
              reward_s_per_token=2e-6, advantage_s_per_token=5e-8, step_overhead_s=0.05)
DRIVER = DriverCosts(get_s_per_object=1e-3, get_s_per_byte=1e-9, put_s_per_object=1e-3,
                     put_s_per_byte=1e-9, copy_s_per_byte=2e-10, mem_base_bytes=2e8,
                     mem_per_batch_byte=2.0)


def test_a_collective_starts_when_its_last_participant_arrives():
    sim = Sim()
    a = sim.add("work", "compute", [("dev", 0)], 1.0)
    b = sim.add("work", "compute", [("dev", 1)], 3.0)
    sim.add("all-gather", "comm", [("dev", 0), ("dev", 1)], 0.5, deps=(a, b))
    sim.add("more", "compute", [("dev", 0)], 0.25)   # dev 0 is busy until the collective ends
    assert sim.end() == pytest.approx(3.75)
    assert sim.critical_path() == pytest.approx({"compute": 3.25, "comm": 0.5})


def test_alpha_beta_fit_recovers_the_parameters_it_was_made_with():
    alpha, beta = 80e-6, 1 / 2e9
    rows = [{"op": op, "world": p, "bytes": n,
             "seconds": (2 if op == "all_reduce" else 1) * ((p - 1) * alpha
                                                           + (p - 1) / p * n * beta)}
            for op in ("all_gather", "all_to_all", "all_reduce") for p in (2, 4)
            for n in (4096, 1 << 20, 8 << 20)]
    fit = fit_alpha_beta(rows)
    assert fit["alpha_s"] == pytest.approx(alpha, rel=1e-6)
    assert fit["seconds_per_byte"] == pytest.approx(beta, rel=1e-6)


def test_decode_fit_recovers_efficiency_and_fixed_rows():
    peak, eta, rows, eta_fwd = 100e9, 0.05, 120.0, 0.3

    def flops(model, s):   # prefill, decode, per row-step
        return s["prefill"], s["decode"], s["row"]

    steps = []
    for decode, longest in ((4e9, 32), (9e9, 96), (6e9, 64), (5e9, 96)):
        s = {"prefill": 1e8, "decode": decode, "row": 2e6, "len_max": longest}
        s["nodes"] = {"rollout": 1e8 / (eta_fwd * peak)
                      + (decode + rows * longest * 2e6) / (eta * peak)}
        steps.append(s)
    got_eta, got_rows = fit_decode({}, steps, eta_fwd, peak, flops)
    assert got_eta == pytest.approx(eta, rel=1e-6) and got_rows == pytest.approx(rows, rel=1e-6)


def test_node_spans_sums_each_steps_node_spans_of_rank_0():
    trace = {"traceEvents": [
        {"ph": "X", "cat": "user_annotation", "pid": 0, "name": "node:rollout", "dur": 2e6,
         "args": {"step": 3}},
        {"ph": "X", "cat": "user_annotation", "pid": 0, "name": "node:rollout", "dur": 5e5,
         "args": {"step": 3}},    # a nested re-run (DAPO) adds up
        {"ph": "X", "cat": "user_annotation", "pid": 0, "name": "balance:actor_update",
         "dur": 1e6, "args": {"step": 3}},
        {"ph": "X", "cat": "user_annotation", "pid": 1, "name": "node:rollout", "dur": 9e6,
         "args": {"step": 3}},
        {"ph": "X", "cat": "cpu_op", "pid": 0, "name": "aten::mm", "dur": 1e6}]}
    assert node_spans(trace) == {3: {"rollout": 2.5}}


def test_capped_geometric_mean_is_inverted():
    q = stop_prob(20.0, 64)
    assert (1 - (1 - q) ** 64) / q == pytest.approx(20.0, rel=1e-6)


def _model(**kw) -> Model:
    fields = {"params": 1e9, "layers": 16, "hidden": 2048, "prompts_per_device": 4,
              "samples_per_prompt": 4, "prompt_len": 256, "max_response": 1024,
              "length_median": 300, **kw}
    return Model(Workload(**fields), NVLINK_IB, COSTS, DRIVER, Options(replicates=2))


def test_only_the_single_controller_touches_the_driver_and_its_work_grows_with_devices():
    model = _model()
    dagrl = model.run("dagrl", 64)
    assert not any(k.startswith("driver") for k in dagrl.breakdown) and \
        dagrl.driver_peak_bytes == 0
    small, big = model.run("single", 8), model.run("single", 64)
    driver = {r: sum(v for k, v in x.breakdown.items() if k.startswith("driver"))
              for r, x in (("small", small), ("big", big))}
    assert driver["big"] > 6 * driver["small"]   # ~8x the data through one process
    w = model.w
    batch = 64 * w.samples * (w.sample_bytes() + 4.0 * w.max_response)
    assert big.driver_peak_bytes == pytest.approx(DRIVER.mem_base_bytes + 2.0 * batch)


def test_without_communication_cost_or_length_variance_weak_scaling_is_perfect():
    free = with_overrides(NVLINK_IB, {"alpha_intra": 0, "alpha_inter": 0, "bw_intra": 1e30,
                                      "bw_inter": 1e30})
    w = Workload(params=1e9, layers=16, hidden=2048, prompt_len=256, max_response=1024,
                 length_median=300, length_sigma=1e-9)
    model = Model(w, free, COSTS, DRIVER, Options(replicates=1))
    t1 = model.run("dagrl", 1).seconds
    assert model.run("dagrl", 1024).seconds == pytest.approx(t1, rel=1e-3)
    # the ring formula itself: (P-1) alpha + (P-1)/P n beta on the slowest link crossed
    alpha, beta = NVLINK_IB.link(16)
    assert ring(NVLINK_IB, 16, 1e9) == pytest.approx(15 * alpha + 15 / 16 * 1e9 * beta)
    assert NVLINK_IB.link(8)[0] == NVLINK_IB.alpha_intra


def test_long_tail_straggler_slows_weak_scaling():
    # Long tails, far from the cap: the slowest of more devices is slower.
    model = _model(length_sigma=1.2, max_response=16384)
    rollout = {p: model.run("dagrl", p).breakdown["rollout"] for p in (1, 256)}
    assert rollout[256] > 1.2 * rollout[1]


def test_parameters_are_validated_naming_the_key():
    with pytest.raises(WorkloadError, match="workload.params"):
        Workload(params=0)
    with pytest.raises(WorkloadError, match="unknown key"):
        scale._workload({"bogus": "1"})
    with pytest.raises(PresetError, match="hardware.link_efficiency"):
        with_overrides(NVLINK_IB, {"link_efficiency": 2})
    assert scale._workload({"params": "70e9", "padded": "true"}).params == 70e9


def test_quick_bench_prints_both_designs_from_8_to_1024_and_the_calibration_error(
        tmp_path, capsys):
    out, svg = tmp_path / "scale.json", tmp_path / "scale.svg"
    assert scale.main(["--quick", "--json", str(out), "--plot", str(svg)]) == 0
    printed = capsys.readouterr().out
    found = re.search(r"^calibration error: (\d+)%$", printed, re.M)
    assert found, printed
    data = json.loads(out.read_text())
    assert [r["workers"] for r in data["calibration_check"]] == [1, 2, 4]
    assert math.isclose(100 * data["calibration_error"], int(found.group(1)), abs_tol=0.5)
    for name in ("nvlink-ib", "ascend-hccs-roce"):
        rows = {r["devices"]: r for r in data["presets"][name]["rows"]}
        assert {8, 64, 1024} <= set(rows)
        for p in (8, 64, 1024):
            line = re.search(rf"^\s*{p}\s+([\d.]+)\s+([\d.]+)\s", printed, re.M)
            assert line, (p, printed)
            for design in ("dagrl", "single"):
                assert 0 < rows[p][design]["efficiency"] <= 1.0 + 1e-9
        assert rows[1024]["single"]["driver_peak_gib"] > rows[8]["single"]["driver_peak_gib"]
    assert svg.read_text().startswith("<svg") and "dagrl" in svg.read_text()
    assert np.isfinite(data["calibration_error"])


def test_hsdp_keeps_layer_collectives_in_the_node_and_all_reduces_shards_across_nodes():
    w = dict(params=1e9, layers=16, hidden=2048, prompt_len=256, max_response=1024,
             length_median=300)
    hsdp = Model(Workload(**w, fsdp_shard_size=8), NVLINK_IB, COSTS, DRIVER,
                 Options(overlap=False, replicates=1))
    flat = Model(Workload(**w, fsdp_shard_size=0), NVLINK_IB, COSTS, DRIVER,
                 Options(overlap=False, replicates=1))
    layer = 1e9 / 16
    intra, inter = NVLINK_IB.link(8), NVLINK_IB.link(128, stride=8)
    assert intra[0] == NVLINK_IB.alpha_intra and inter[0] == NVLINK_IB.alpha_inter
    ag = 7 * intra[0] + 7 / 8 * layer * 2 * intra[1]
    rs = 7 * intra[0] + 7 / 8 * layer * 4 * intra[1]
    ar = 2 * (127 * inter[0] + 127 / 128 * layer * 4 / 8 * inter[1])
    got = hsdp.fsdp_exposed_s(1024, 0.0, tokens=1000, backward=True)
    assert got == pytest.approx(16 * (2 * ag + rs + ar))
    assert got < flat.fsdp_exposed_s(1024, 0.0, tokens=1000, backward=True) / 5
    assert hsdp.weight_sync_s(1024) == flat.weight_sync_s(8)   # gathered inside the node
    with pytest.raises(WorkloadError, match="fsdp_shard_size=8 does not divide 12"):
        hsdp.shard_size(12)


def test_decode_takes_the_longer_of_its_flop_time_and_its_memory_time():
    model = _model()
    lengths = np.array([100, 400])
    w, hw = model.w, NVLINK_IB
    kv = (w.prompt_len * 500 + (100 * 101 + 400 * 401) / 2) * w.kv_bytes_per_token
    expected = (400 * w.params * w.param_bytes + kv) / (hw.mem_bw * hw.mem_efficiency)
    assert model.decode_memory_s(lengths) == pytest.approx(expected)
    # at full FLOP efficiency and no per-step overhead, decode is bound by memory
    fast = replace(COSTS, eta_decode=1.0, decode_fixed_rows=0.0)
    bound = Model(model.w, NVLINK_IB, fast, DRIVER)
    no_memory = Model(model.w, with_overrides(NVLINK_IB, {"mem_bw": 0}), fast, DRIVER)
    assert no_memory.decode_memory_s(lengths) == 0
    # prefill + max(FLOP time, memory time): the FLOP time of 500 tokens is ~1 ms here
    gap = bound.rollout_s(lengths, 1) - no_memory.rollout_s(lengths, 1)
    assert gap == pytest.approx(expected, rel=0.05)


def test_phases_charge_a_collective_wait_to_the_device_that_waited():
    sim = Sim()
    a = sim.add("rollout", "rollout", [("dev", 0)], 1.0)
    b = sim.add("rollout", "rollout", [("dev", 1)], 3.0)
    sim.add("balance all_to_all", "all_to_all", [("dev", 0), ("dev", 1)], 0.5, deps=(a, b))
    # device 0 waits 2 s for device 1 inside the balance, as dagrl's observer would time it
    assert device_phases(sim, PHASE_OF) == pytest.approx(
        {"rollout": 3.0, "balance_actor_update": 2.5})


def test_contention_is_read_from_the_cpu_timeline_of_the_timed_steps():
    # (time, machine busy s, run's busy s, this process's s, steps logged)
    timeline = [(0.0, 0.0, 0.0, 0.0, 0), (1.0, 2.0, 1.0, 0.0, 2), (3.0, 6.0, 2.0, 0.1, 3),
                (5.0, 9.0, 4.0, 0.2, 5)]
    usage = usage_between(timeline, 3, 5)   # from step 2's line to step 5's
    assert usage["wall_s"] == pytest.approx(4.0)
    assert usage["run_cores"] == pytest.approx(0.75)
    assert usage["others_cores"] == pytest.approx((7.0 - 3.0 - 0.2) / 4)
    cores = usage["cores"]
    assert available_cores(usage) == pytest.approx(max(0.1, cores - 0.95))
    # 4 one-thread workers on what was left, against 4 workers on every core
    assert contention(usage, 4) == pytest.approx(
        max(1, 4 / available_cores(usage)) / max(1, 4 / cores))


def test_fsdp_host_work_is_interpolated_and_only_charged_to_host_workers():
    costs = replace(COSTS, fsdp_workers=(2, 4), fsdp_forward_overhead_s=(0.01, 0.03),
                    fsdp_update_overhead_s=(0.02, 0.06))
    cpu = with_overrides(NVLINK_IB, {"host_cores": 2})
    model = Model(_model().w, cpu, costs, DRIVER)
    assert model.fsdp_host_s(1, "forward") == 0
    assert model.fsdp_host_s(2, "update") == pytest.approx(0.02)
    assert model.fsdp_host_s(3, "forward") == pytest.approx(0.02 * 1.5)   # 3 workers, 2 cores
    assert model.fsdp_host_s(8, "update") == pytest.approx(0.06 * 4)      # held beyond 4
    assert Model(_model().w, NVLINK_IB, costs, DRIVER).fsdp_host_s(4, "update") == 0
    with pytest.raises(WorkloadError, match="one value per costs.fsdp_workers"):
        replace(COSTS, fsdp_workers=(2,))


def test_measured_time_sharing_multiplies_the_host_slowdown_per_kind_of_pass():
    costs = replace(COSTS, sharing_ratios=(1.0, 2.0),
                    sharing_excess={"update": (1.0, 1.1), "decode": (1.05, 1.2)})
    cpu = with_overrides(NVLINK_IB, {"host_cores": 2})
    model = Model(_model().w, cpu, costs, DRIVER)
    assert model._slowdown(1, "decode") == 1.0                     # one process: the reference
    assert model._slowdown(2, "decode") == pytest.approx(1.05)     # measured at P / cores = 1
    assert model._slowdown(4, "update") == pytest.approx(2 * 1.1)
    assert model._slowdown(3, "decode") == pytest.approx(1.5 * 1.125)   # between the two
    assert model._slowdown(4, "forward") == 2.0                    # not measured: ideal
    accel = Model(_model().w, NVLINK_IB, costs, DRIVER)            # its own compute per device
    assert accel._slowdown(4, "update") == 1.0
    assert model.rollout_s(np.full(8, 16), 4) > Model(_model().w, cpu, COSTS,
                                                      DRIVER).rollout_s(np.full(8, 16), 4)
    with pytest.raises(WorkloadError, match="one value > 0 per costs.sharing_ratios"):
        replace(COSTS, sharing_ratios=(1.0,), sharing_excess={"update": (1.0, 1.1)})


def test_watch_cpu_follows_a_process_tree_and_its_logged_steps(tmp_path):
    import subprocess
    import sys

    from benchmarks.scale_calibrate import watch_cpu

    log = tmp_path / "metrics.jsonl"
    # a child that burns CPU in a grandchild (the tree counts), logging a line per "step"
    code = ("import subprocess, sys, time\n"
            "burn = ('import time\\nt = time.process_time()\\n'\n"
            "        'while time.process_time() - t < 0.3: pass')\n"
            "for step in range(3):\n"
            "    subprocess.run([sys.executable, '-c', burn], check=True)\n"
            f"    open({str(log)!r}, 'a').write('{{}}\\n')\n")
    proc = subprocess.Popen([sys.executable, "-c", code])
    timeline = watch_cpu(proc, log, every_s=0.05)
    assert proc.returncode == 0
    assert timeline[-1][4] == 3 and [s[4] for s in timeline] == sorted(s[4] for s in timeline)
    assert timeline[-1][2] - timeline[0][2] >= 0.6    # most of the 3 x 0.3 s the tree burned
    usage = usage_between(timeline, 1, 3)
    # (CPU seconds, not wall time, are asserted: this machine may be busy)
    assert usage["wall_s"] > 0 and usage["run_cores"] > 0
