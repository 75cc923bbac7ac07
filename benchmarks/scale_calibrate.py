"""`dagrl bench scale --calibrate`: measure this machine and write the calibration file.

    dagrl bench scale --calibrate [--calibration PATH] [--rounds 3]

1. Traced runs: `dagrl train` with 1 worker and the profiler on (profiler.steps), at two
   response-length caps, so the decode cost's two parts (per step, per active row) are told
   apart; per-node times are read from the merged Chrome trace (`node:<id>` spans), response
   lengths (mean, std, max) from metrics.jsonl. The run goes on for a few unprofiled steps:
   their node times (metrics.jsonl) give the profiler's own overhead per node, removed from the
   traced costs.
2. The measured runs the model is checked against: `dagrl train` at 1, 2 and 4 workers (Ray),
   weak scaling (8 prompts per worker), the order of worker counts reversed every round; a
   run's figure is the median step time of its steps after warm-up. This machine is shared:
   every run also records the CPU time its own processes and all other processes used
   (`watch_cpu`), so the model is checked with the cores the run actually had, and the
   traced costs are those of a worker with a core to itself.
3. gloo collectives, FSDP2's own CPU work per worker at 2 and 4 processes, and the
   single-controller driver emulation (benchmarks/scale_measure.py).

Everything lands in one JSON file with the machine's load average before and after; the
model (`dagrl bench scale`) reads it. It takes ~10-15 minutes.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import scale_measure

# The calibration workload: a small Qwen2 (hidden 128, 4 layers), 8 prompts x 4 samples per
# worker, temperature 1: the random policy ends a response at its EOS with a fixed chance per
# token, a geometric (exponential-tailed) length distribution cut at max_new_tokens.
PROMPTS_PER_WORKER, SAMPLES, HIDDEN, LAYERS = 8, 4, 128, 4
BASE = [f"model.tiny_hidden_size={HIDDEN}", f"model.tiny_layers={LAYERS}",
        "trainer.torch_threads=1", "trainer.save_final=false", "logging.progress_bar=false",
        "logging.console_every=1000",
        f"rollout.n={SAMPLES}", "rollout.temperature=1.0", "trainer.device=cpu"]
TRACE_CAPS = (32, 96)         # response caps of the traced runs (fit)
CHECK_CAP = 64                # response cap of the measured runs (checked, not fitted)
TRACE_STEPS = (3, 4, 5, 6)
UNPROFILED_STEPS = 4          # after the profiled ones: the same work without the profiler
STEPS, WARMUP = 12, 2
WORKERS = (1, 2, 4)


def _env() -> dict[str, str]:
    return {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1"}


def _train(run_dir: Path, workers: int, cap: int, extra: list[str],
           steps: int) -> tuple[list[dict], list[tuple]]:
    """One `dagrl train` run: its metrics.jsonl, and the CPU timeline it ran on
    (`watch_cpu`; `usage_between` reads the share of the machine it had in some steps)."""
    args = [f"trainer.run_dir={run_dir}", f"trainer.n_workers={workers}",
            f"trainer.total_steps={steps}", f"rollout.max_new_tokens={cap}",
            f"data.train_batch_size={PROMPTS_PER_WORKER * workers}",
            f"actor.mini_batch_size={PROMPTS_PER_WORKER * workers}", *BASE, *extra]
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([sys.executable, "-m", "dagrl.cli", "train", *args], env=_env(),
                                stdout=subprocess.DEVNULL, stderr=err, text=True)
        timeline = watch_cpu(proc, run_dir / "metrics.jsonl")
        if proc.returncode != 0:
            err.seek(0)
            raise RuntimeError(f"calibration run failed ({workers} workers):\n"
                               f"{err.read()[-3000:]}")
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return metrics, timeline


def _busy_seconds() -> float:
    """CPU seconds this machine's cores have been busy since boot (/proc/stat: all but idle
    and iowait)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def _lines(path: Path) -> int:
    try:
        with open(path, "rb") as f:
            return f.read().count(b"\n")
    except FileNotFoundError:
        return 0


def watch_cpu(proc: subprocess.Popen, metrics: Path, every_s: float = 0.1,
              timeout_s: float = 1800) -> list[tuple]:
    """Wait for `proc`, sampling every `every_s`: (time, CPU seconds of the whole machine,
    CPU seconds of the run's process tree (the driver, Ray's processes, the workers), CPU
    seconds of this process (the sampling itself), steps logged so far). This machine is
    shared: what other processes used in a window of steps did not run our workers."""
    import psutil

    root, seen, timeline = psutil.Process(proc.pid), {}, []
    t0 = time.monotonic()
    while True:
        done = proc.poll() is not None
        if time.monotonic() - t0 > timeout_s:
            proc.kill()
            raise RuntimeError(f"calibration run took over {timeout_s:.0f} s")
        try:
            tree = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            tree = []
        for p in tree:
            # A process's own user + system time (not its reaped children's: each is its own
            # entry); the last sample of one that exits is kept.
            with contextlib.suppress(psutil.Error):
                c = p.cpu_times()
                seen[p.pid] = max(seen.get(p.pid, 0.0), c.user + c.system)
        timeline.append((time.monotonic(), _busy_seconds(), sum(seen.values()),
                         time.process_time(), _lines(metrics)))
        if done:
            return timeline
        time.sleep(every_s)


def usage_between(timeline: list[tuple], first_step: int, last_step: int) -> dict:
    """The machine's share a run had from the end of step `first_step - 1` to the end of step
    `last_step` (the first samples that saw those lines of metrics.jsonl): the cores other
    processes used meanwhile (`others_cores`), those the run used (`run_cores`)."""
    start = next(s for s in timeline if s[4] >= first_step - 1)
    end = next(s for s in timeline if s[4] >= last_step)
    wall = max(end[0] - start[0], 1e-9)
    run = end[2] - start[2]
    others = end[1] - start[1] - run - (end[3] - start[3])
    return {"wall_s": wall, "run_cores": run / wall, "others_cores": max(0.0, others / wall),
            "cores": os.cpu_count()}


def node_spans(trace: dict) -> dict[int, dict[str, float]]:
    """step -> node id -> seconds, from a merged trace's `node:<id>` spans (rank 0 only)."""
    out: dict[int, dict[str, float]] = {}
    for e in trace["traceEvents"]:
        name = e.get("name", "")
        if (e.get("ph") == "X" and e.get("cat") == "user_annotation" and e.get("pid") == 0
                and name.startswith("node:") and "step" in e.get("args", {})):
            per = out.setdefault(int(e["args"]["step"]), {})
            node = name.split(":", 1)[1]
            per[node] = per.get(node, 0.0) + float(e["dur"]) / 1e6
    return out


def traced_run(tmp: Path, cap: int) -> dict:
    """One 1-worker run, profiled on TRACE_STEPS: per profiled step the node seconds from the
    trace and the lengths; per later, unprofiled step the node seconds the observer logged (the
    profiler's own cost per op is measured from the two, see scale_fit.profiler_factors)."""
    run_dir = tmp / f"trace-{cap}"
    steps = ",".join(map(str, TRACE_STEPS))
    last = max(TRACE_STEPS) + UNPROFILED_STEPS
    metrics, timeline = _train(run_dir, 1, cap,
                               ["profiler.enable=true", f"profiler.steps=[{steps}]"], last)
    spans = node_spans(json.loads((run_dir / "profile" / "trace.json").read_text()))
    profiled = [{"step": m["step"], "cap": cap, "nodes": spans[m["step"]], **_lengths(m)}
                for m in metrics if m["step"] in spans]
    unprofiled = [{"step": m["step"], "cap": cap, "nodes": _timings(m), **_lengths(m)}
                  for m in metrics if m["step"] > max(TRACE_STEPS)]
    # the share of the machine the worker had in the profiled steps and in the later ones
    return {"cap": cap, "profiled": profiled, "unprofiled": unprofiled,
            "cpu": usage_between(timeline, min(TRACE_STEPS), max(TRACE_STEPS)),
            "cpu_unprofiled": usage_between(timeline, max(TRACE_STEPS) + 1, last)}


def _timings(m: dict) -> dict[str, float]:
    """The observer's per-node seconds of a step (timing/<node>_s)."""
    return {k.removeprefix("timing/").removesuffix("_s"): v for k, v in m.items()
            if k.startswith("timing/") and k.endswith("_s") and not k.endswith("spread_s")
            and k != "timing/step_s"}


def _lengths(m: dict) -> dict:
    n = m["batch/samples"]
    return {"samples": n, "len_mean": m["response/length/mean"],
            "len_std": m.get("response/length/std", 0.0), "len_max": m["response/length/max"],
            "prompt_mean": m["prompt/length_mean"]}


def measured_runs(tmp: Path, rounds: int) -> list[dict]:
    """Step times at 1, 2, 4 workers (module docstring), and the lengths they generated."""
    out: dict[int, dict] = {w: {"workers": w, "rounds": [], "lengths": []} for w in WORKERS}
    for r in range(rounds):
        order = WORKERS if r % 2 == 0 else tuple(reversed(WORKERS))
        for w in order:
            load = os.getloadavg()
            metrics, timeline = _train(tmp / f"run-{w}-{r}", w, CHECK_CAP, [], STEPS)
            timed = [m for m in metrics if m["step"] > WARMUP]
            out[w]["rounds"].append({
                "median_step_s": statistics.median(m["timing/step_s"] for m in timed),
                "step_s": [m["timing/step_s"] for m in timed], "load_before": load,
                "cpu": usage_between(timeline, WARMUP + 1, STEPS),
                "nodes_s": {k: statistics.median(_timings(m)[k] for m in timed)
                            for k in _timings(timed[0])}})
            out[w]["lengths"] += [_lengths(m) for m in timed]
    for w in WORKERS:
        out[w]["step_s"] = min(x["median_step_s"] for x in out[w]["rounds"])
    return list(out.values())


def step_overhead(tmp: Path) -> dict:
    """Seconds per step outside the nodes (loader, metrics, observer), 1 worker, unprofiled,
    and the machine's share the run had."""
    metrics, timeline = _train(tmp / "overhead", 1, CHECK_CAP, [], 5)
    rest = [m["timing/step_s"] - sum(v for k, v in m.items() if k.startswith("timing/")
                                     and k != "timing/step_s") for m in metrics[WARMUP:]]
    return {"seconds": max(0.0, statistics.median(rest)),
            "cpu": usage_between(timeline, WARMUP + 1, 5)}


def model_shape() -> dict:
    """The calibration model's size, from the same builder dagrl uses for it."""
    from transformers import AutoModelForCausalLM

    from dagrl.engines.models import build_char_tokenizer, tiny_model_config
    from dagrl.observe.flops import matmul_params

    cfg = tiny_model_config("tiny-qwen2", len(build_char_tokenizer()), HIDDEN, LAYERS)
    model = AutoModelForCausalLM.from_config(cfg)
    return {"params": matmul_params(model), "layers": cfg.num_hidden_layers,
            "hidden": cfg.hidden_size}


def calibrate(path: Path, rounds: int = 3) -> dict:
    started = time.time()
    load_start = os.getloadavg()
    print("[scale] matmul peak ...", file=sys.stderr, flush=True)
    data: dict = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                              "python": platform.python_version(),
                              "date": time.strftime("%Y-%m-%d %H:%M"),
                              "load_start": load_start},
                  "matmul_peak_flops": scale_measure.matmul_peak(),
                  "model": model_shape(),
                  "workload": {"prompts_per_worker": PROMPTS_PER_WORKER, "samples": SAMPLES,
                               "trace_caps": list(TRACE_CAPS), "check_cap": CHECK_CAP}}
    with tempfile.TemporaryDirectory(prefix="dagrl-scale-") as tmp_name:
        tmp = Path(tmp_name)
        print("[scale] traced runs ...", file=sys.stderr, flush=True)
        data["traced_runs"] = [traced_run(tmp, cap) for cap in TRACE_CAPS]
        data["step_overhead"] = step_overhead(tmp)
        print("[scale] measured runs at 1, 2, 4 workers ...", file=sys.stderr, flush=True)
        data["measured_runs"] = measured_runs(tmp, rounds)
    print("[scale] gloo collectives ...", file=sys.stderr, flush=True)
    data["collectives"] = scale_measure.collectives()
    print("[scale] FSDP2's CPU work at 1, 2, 4 processes ...", file=sys.stderr, flush=True)
    # the measured runs' per-worker batch: 8 x 4 samples, prompt (~6 tokens) + cap, padded
    data["fsdp_overhead"] = scale_measure.fsdp_overhead(
        {"hidden": HIDDEN, "layers": LAYERS, "samples": PROMPTS_PER_WORKER * SAMPLES,
         "seq": 8 + CHECK_CAP})
    print("[scale] time-sharing of the cores by more processes than cores ...", file=sys.stderr,
          flush=True)
    data["time_sharing"] = scale_measure.time_sharing(
        {"hidden": HIDDEN, "layers": LAYERS, "samples": PROMPTS_PER_WORKER * SAMPLES,
         "seq": 8 + CHECK_CAP})
    print("[scale] single-controller driver emulation (Ray) ...", file=sys.stderr, flush=True)
    data["driver"] = scale_measure.driver_emulation()
    data["machine"]["load_end"] = os.getloadavg()
    data["machine"]["minutes"] = round((time.time() - started) / 60, 1)
    path.write_text(json.dumps(data, indent=1))
    return data

