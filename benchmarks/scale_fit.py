"""From a calibration file (benchmarks/scale_calibrate.py) to the model's parameters, and the
model's prediction of the measured 1/2/4-worker runs (the calibration error).

The costs come from the traced 1-worker runs only; the measured runs at 1, 2 and 4 workers use
another response cap and are never fitted to: they only check the model.
"""

from __future__ import annotations

import statistics
from dataclasses import replace

import numpy as np

from benchmarks.scale_model import Costs, DriverCosts, Model, Options, Workload
from benchmarks.scale_presets import Hardware, local_hardware

# dagrl's Batch at the balance before actor_update, per token (data/batch.py fields): prompt
# ids (int64) and mask (int64); responses (int64), response mask, rollout and reference
# log-probs, advantages (float32 each).
LOCAL_BYTES_PER_PROMPT_TOKEN = 16.0
LOCAL_BYTES_PER_RESPONSE_TOKEN = 28.0


def _sums(step: dict) -> tuple[float, float, float]:
    """(samples, sum of lengths, sum of squared lengths) of a step, from mean/std/n."""
    n, mean, std = step["samples"], step["len_mean"], step["len_std"]
    return float(n), n * mean, n * (std * std + mean * mean)


def _step_flops(model: dict, step: dict) -> tuple[float, float, float, float]:
    """(prefill, decode, FLOPs per decode row-step, one padded teacher-forced pass) of a
    traced 1-worker step of the calibration model."""
    n_params, layers, hidden = model["params"], model["layers"], model["hidden"]
    n, s1, s2 = _sums(step)
    p = step["prompt_mean"]
    prompts = n / step.get("samples_per_prompt", 4)

    def seq(s: float) -> float:
        return 2.0 * n_params * s + 2.0 * layers * hidden * s * s

    prefill = prompts * seq(p)
    decode = 2.0 * n_params * s1 + 4.0 * layers * hidden * (p * s1 + (s2 + s1) / 2)
    forward = n * seq(p + step["len_max"])     # padded to the batch's longest response
    return prefill, decode, decode / max(s1, 1.0), forward


def _work(model: dict, step: dict, node: str) -> float:
    """What a node's time is proportional to, for comparing steps: padded tokens for the
    teacher-forced passes, response tokens for the others."""
    if node in ("ref_logprob", "actor_update"):
        return step["samples"] * (step["prompt_mean"] + step["len_max"])
    return step["samples"] * step["len_mean"]


def profiler_factors(cal: dict) -> dict[str, float]:
    """Per node: its time per unit of work without the profiler over the same with it (the
    same runs: profiled steps, then unprofiled ones, each window's contention removed).
    torch.profiler records every operator, which costs most where operators are many and
    small (the decode loop)."""
    model, out = cal["model"], {}
    for node in ("rollout", "ref_logprob", "actor_update", "reward", "advantage"):
        ratios = []
        for run in cal["traced_runs"]:
            with_prof = statistics.median(s["nodes"][node] / _work(model, s, node)
                                          for s in run["profiled"]) / contention(run["cpu"])
            without = statistics.median(s["nodes"][node] / _work(model, s, node)
                                        for s in run["unprofiled"]) / contention(
                                            run["cpu_unprofiled"])
            ratios.append(without / with_prof)
        out[node] = statistics.median(ratios)
    return out


def available_cores(usage: dict) -> float:
    """Cores a run had: this machine's, less what other processes used meanwhile (averaged
    over the run; benchmarks/scale_calibrate.watch_cpu). Floored at a tenth of a core: a run
    that had less than that measured nothing but the other load."""
    return max(0.1, usage["cores"] - usage["others_cores"])


def contention(usage: dict, workers: int = 1) -> float:
    """How much slower a run of `workers` one-thread processes was than with the cores to
    itself: max(1, workers / cores it had) over max(1, workers / all cores)."""
    return (max(1.0, workers / available_cores(usage))
            / max(1.0, workers / usage["cores"]))


def traced_steps(cal: dict) -> list[dict]:
    """The profiled steps, each node's trace time scaled by its profiler factor and by the
    contention of its run (1-worker runs: uncontended = the worker had a core)."""
    factors = profiler_factors(cal)
    samples = cal["workload"]["samples"]
    steps = []
    for run in cal["traced_runs"]:
        slow = contention(run["cpu"])
        for s in run["profiled"]:
            nodes = {k: v * factors.get(k, 1.0) / slow for k, v in s["nodes"].items()}
            steps.append({**s, "nodes": nodes, "samples_per_prompt": samples})
    return steps


def fit_decode(model: dict, steps: list[dict], eta_forward: float, peak: float,
               flops) -> tuple[float, float]:
    """(eta_decode, fixed_rows) from the traced rollouts: rollout seconds minus the prefill =
    (decode FLOPs + fixed_rows x max length x FLOPs per row-step) / (eta_decode x peak)."""
    rows_a, rows_b, t = [], [], []
    for s in steps:
        prefill, decode, row_step = flops(model, s)
        rows_a.append(decode)
        rows_b.append(s["len_max"] * row_step)
        t.append(s["nodes"]["rollout"] - prefill / (eta_forward * peak))
    a = np.stack([rows_a, rows_b], axis=1)
    (x, y), *_ = np.linalg.lstsq(a, np.array(t), rcond=None)
    if x <= 0:
        raise RuntimeError("decode fit failed: no positive cost per row-step; re-run the "
                           "calibration on a quieter machine")
    return float(1.0 / (x * peak)), float(max(y, 0.0) / x)


def fit_costs(cal: dict) -> Costs:
    """Device efficiencies and host rates from the traced steps (module docstring)."""
    model, peak, steps = cal["model"], cal["matmul_peak_flops"], traced_steps(cal)
    fwd = [_step_flops(model, s)[3] for s in steps]
    eta_forward = statistics.median(f / (s["nodes"]["ref_logprob"] * peak)
                                    for f, s in zip(fwd, steps, strict=True))
    eta_update = statistics.median(3 * f / (s["nodes"]["actor_update"] * peak)
                                   for f, s in zip(fwd, steps, strict=True))
    eta_decode, fixed_rows = fit_decode(model, steps, eta_forward, peak,
                                        lambda m, s: _step_flops(m, s)[:3])
    tokens = [s["samples"] * s["len_mean"] for s in steps]
    return Costs(
        eta_update=min(eta_update, 1.0), eta_forward=min(eta_forward, 1.0),
        eta_decode=min(eta_decode, 1.0), decode_fixed_rows=fixed_rows,
        reward_s_per_token=statistics.median(s["nodes"]["reward"] / t
                                             for s, t in zip(steps, tokens, strict=True)),
        advantage_s_per_token=statistics.median(s["nodes"]["advantage"] / t
                                                for s, t in zip(steps, tokens, strict=True)),
        step_overhead_s=cal["step_overhead"]["seconds"] / contention(cal["step_overhead"]["cpu"]),
        fsdp_workers=tuple(cal["fsdp_overhead"]["workers"]),
        fsdp_forward_overhead_s=tuple(cal["fsdp_overhead"]["forward_s"]),
        fsdp_update_overhead_s=tuple(cal["fsdp_overhead"]["update_s"]),
        # calibrations before 2026-11-25 (third session) did not measure it: ideal sharing
        **_sharing(cal.get("time_sharing")))


def _sharing(measured: dict | None) -> dict:
    if not measured:
        return {}
    return {"sharing_ratios": tuple(measured["ratios"]),
            "sharing_excess": {k: tuple(measured[k]) for k in ("update", "forward", "decode")}}


def fit_driver(cal: dict) -> DriverCosts:
    d = cal["driver"]
    return DriverCosts(**{k: d[k] for k in DriverCosts.__dataclass_fields__})


def local(cal: dict) -> Hardware:
    c = cal["collectives"]
    return local_hardware(cal["matmul_peak_flops"], c["alpha_s"], c["seconds_per_byte"],
                          cal["machine"]["cpus"])


def stop_prob(mean: float, cap: int) -> float:
    """The per-token end chance q of a geometric length cut at `cap` with this mean:
    E[min(G, cap)] = (1 - (1 - q)^cap) / q, solved by bisection."""
    lo, hi = 1e-9, 1.0
    for _ in range(200):
        q = (lo + hi) / 2
        if (1 - (1 - q) ** cap) / q > mean:
            lo = q
        else:
            hi = q
    return (lo + hi) / 2


def local_workload(cal: dict, lengths: list[dict]) -> Workload:
    """The measured runs' workload: the calibration model, padded passes, geometric lengths
    with the mean those runs generated."""
    m, w = cal["model"], cal["workload"]
    cap = w["check_cap"]
    mean = statistics.mean(x["len_mean"] for x in lengths)
    prompt = statistics.mean(x["prompt_mean"] for x in lengths)
    return Workload(
        params=m["params"], layers=m["layers"], hidden=m["hidden"],
        prompts_per_device=w["prompts_per_worker"], samples_per_prompt=w["samples"],
        prompt_len=max(1, round(prompt)), max_response=cap, length_dist="geometric",
        length_median=min(cap, max(1.0, mean)), length_stop_prob=stop_prob(mean, cap),
        padded=True, micro_batch_tokens=1 << 30, param_bytes=4, grad_bytes=4, fsdp_shard_size=0,
        bytes_per_prompt_token=LOCAL_BYTES_PER_PROMPT_TOKEN,
        bytes_per_response_token=LOCAL_BYTES_PER_RESPONSE_TOKEN)


def calibration_check(cal: dict, replicates: int = 32) -> list[dict]:
    """Model vs measured step time at 1, 2, 4 workers on this machine, per round of measured
    runs: the model runs the workers on the cores that round had (the machine's, less what
    other processes used meanwhile); a worker count's error is the median over its rounds."""
    costs, driver, hw = fit_costs(cal), fit_driver(cal), local(cal)
    rows = []
    for run in cal["measured_runs"]:
        w = local_workload(cal, run["lengths"])
        rounds = []
        for r in run["rounds"]:
            cores = available_cores(r["cpu"])
            # gloo on CPU cores the workers compute on: no overlap of FSDP's collectives.
            model = Model(w, replace(hw, host_cores=cores), costs, driver,
                          Options(overlap=False, replicates=replicates))
            res = model.run("dagrl", run["workers"])
            pred = res.seconds
            rounds.append({"measured_s": r["median_step_s"], "model_s": pred, "cores": cores,
                           "error": abs(pred - r["median_step_s"]) / r["median_step_s"],
                           "phases": {k: (r["nodes_s"].get(k, 0.0), v)
                                      for k, v in res.phases.items()}})
        rows.append({"workers": run["workers"], "rounds": rounds,
                     "measured_s": statistics.median(x["measured_s"] for x in rounds),
                     "model_s": statistics.median(x["model_s"] for x in rounds),
                     "error": statistics.median(x["error"] for x in rounds),
                     # per phase: (measured, model) seconds, medians over the rounds
                     "phases": {k: tuple(statistics.median(x["phases"][k][i] for x in rounds)
                                         for i in (0, 1)) for k in rounds[0]["phases"]}})
    return rows


def describe_costs(costs: Costs, hw: Hardware) -> list[str]:
    return [f"  device efficiency (share of peak {hw.flops / 1e9:.1f} GFLOP/s): "
            f"update {costs.eta_update:.1%}, forward {costs.eta_forward:.1%}, decode "
            f"{costs.eta_decode:.1%}; decode step fixed cost = {costs.decode_fixed_rows:.0f} "
            f"row-steps",
            f"  host: reward {costs.reward_s_per_token * 1e6:.1f} us/token, advantage "
            f"{costs.advantage_s_per_token * 1e6:.2f} us/token, step overhead "
            f"{costs.step_overhead_s * 1e3:.1f} ms",
            "  FSDP2's CPU work per worker (CPU workers only): " + ", ".join(
                f"{w} workers: forward +{f * 1e3:.0f} ms, update +{u * 1e3:.0f} ms"
                for w, f, u in zip(costs.fsdp_workers, costs.fsdp_forward_overhead_s,
                                   costs.fsdp_update_overhead_s, strict=True)),
            "  time-sharing beyond P / cores (one-thread processes, no collectives), at P / cores "
            + ", ".join(f"{r:g}" for r in costs.sharing_ratios) + ": " + "; ".join(
                f"{kind} " + ", ".join(f"x{v:.2f}" for v in values)
                for kind, values in costs.sharing_excess.items())
            if costs.sharing_excess else "  time-sharing: not measured (ideal P / cores)"]

