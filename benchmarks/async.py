"""Sync beside async training on the same 2 workers and the same work, in one run.

    dagrl bench async                         # sync, then async (max_staleness=1), 2 rounds
    dagrl bench async --steps 30 --rounds 1 --json runs/async.json
    dagrl bench async --workload agentic      # multi-turn episodes waiting on an HTTP tool
    python -m benchmarks.async ...            # the same, without the CLI

Both sides are `torchrun --nproc-per-node 2 -m dagrl.train` with the same config but
`trainer.mode`: sync (both workers generate, then both train, every step) or async (rank 1
generates, scores and runs the reference, rank 0 trains, the two overlapping with at most
`--staleness` versions of lag). Same model, data, seed, prompts per step, samples per prompt,
steps and threads (one per worker), except that on the agentic workload the async side's
trainer rank takes `--async-trainer-threads` 2: the core its rollout rank leaves idle while the
episodes wait (trainer.async_trainer_threads; both sides run with OMP_WAIT_POLICY=PASSIVE, so
that a thread waiting for a core sleeps; one thread per worker is unaffected by it).

Workload `arith` (the default): a randomly initialised tiny Qwen2 (`--hidden`, `--layers`) on
the built-in arithmetic task, 8 prompts x 8 samples per step, temperature 1, up to
`--max-new-tokens` 128 tokens, sequences packed for training (`model.pack_sequences=true`: an
update costs the real tokens, not the padding to the longest response). The response lengths
have a long tail, as in real RL runs: besides EOS, '.' ends a response (`--stop-tokens`), and a
freshly initialised model draws either with probability ~1/24 per token, so lengths are roughly
geometric: most responses are short, a few per step run far longer. Each side's lengths are
printed: training moves them, and with the default actor.lr (3e-3) a few steps already move
them differently on the two sides (one more update behind is enough), which makes the work
differ; `--lr` 3e-4 keeps the two sides' lengths within a few percent over the bench's steps
while the reward still rises.

Workload `agentic`: multi-turn episodes (rollout.multi_turn, as examples/tool_calc.yaml: the
built-in `a*b+c` task, the tiny call format, up to `--max-turns` turns) whose tool is the
built-in `http` tool calling a calculator service that the bench starts on 127.0.0.1
(benchmarks/agentic_service.py): a threaded HTTP server that answers with the real value after a
latency drawn, seeded, from `--latency` (lognormal, `--latency-median-ms` 200 and
`--latency-p99-ms` 2000 by default: sigma = ln(p99 / median) / 2.326), as a search API or a
remote code sandbox does. All calls of a turn are in flight at once (`--max-concurrent-calls`).
Both sides of a round draw the same latency sequence (the service is reseeded before each run,
from `--seed` and the round); the configured distribution and the measured one (median, p90, p99
of the calls the service answered) are printed. Here the waiting is what async hides: in sync
mode every worker's episodes wait on the slowest call of each turn while nothing trains; in
async mode the trainer rank updates on the previous batch meanwhile, and the rollout rank starts
the next step's batch while a step's slowest call is out (rollout.multi_turn.look_ahead). The
model (h256 x 4,
`--hidden`/`--layers`) is sized so that an update of the whole batch on the trainer rank costs
about as much as the rollout rank's generation plus its wait on the tool, and there is no KL
term (no reference pass on the rollout rank: `algorithm.kl_loss_coef=0`, as DAPO-style recipes
train; add `algorithm.kl_loss_coef=0.001` to put it back, docs/performance.md has both).

Figures: samples per second of wall time over the steps after the first `--warmup`
(timestamped by this process as each step's metrics line appears in metrics.jsonl, so the two
sides are timed the same way, startup excluded), and reward against wall-clock time (seconds
since the end of the first step) for both; with `--rounds` > 1 the order of the sides alternates
and the figures pool the rounds. The machine's load average is printed before and after each
side: the figures mean something only on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks.agentic_service import (
    DISTRIBUTIONS,
    Call,
    Latency,
    ToolService,
    summarize_calls,
)
from dagrl.config.loader import with_defaults

SIDES = ("sync", "async")
WORKLOADS = ("arith", "agentic")
# Per-workload defaults of the flags left unset (None).
DEFAULTS = {"arith": {"hidden": 128, "layers": 4, "max_new_tokens": 128,
                      "async_trainer_threads": 1},
            "agentic": {"hidden": 256, "layers": 4, "max_new_tokens": 32,
                        "async_trainer_threads": 2}}
# The calculator's argument schema, as the built-in `calculator` tool declares it.
CALCULATOR_PARAMETERS = ("{type: object, properties: {expression: {type: string}}, "
                         "required: [expression], additionalProperties: false}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def workload_args(ns: argparse.Namespace) -> list[str]:
    """The overrides that make the workload (the rest is common to both)."""
    if ns.workload == "arith":
        return [f"rollout.stop_token_ids=[{ns.stop_tokens}]", "data.max_prompt_length=16"]
    m = "rollout.multi_turn"
    # No KL term (as DAPO-style agent recipes train): the reference pass would sit on the one
    # rollout rank beside generation; `algorithm.kl_loss_coef=0.001` after the flags restores it.
    return ["data.train_files=[builtin:tool-calc]", "data.max_prompt_length=12",
            "algorithm.kl_loss_coef=0",
            f"{m}.enable=true", f"{m}.tools=[http]", f"{m}.format=tiny",
            f"{m}.max_turns={ns.max_turns}", f"{m}.max_tokens_per_turn={ns.max_tokens_per_turn}",
            f"{m}.max_concurrent_calls={ns.max_concurrent_calls or ns.prompts * ns.samples}",
            f"{m}.http.url={ns.tool_url}", f"{m}.http.name=calculator",
            f"{m}.http.parameters={CALCULATOR_PARAMETERS}"]


def side_args(side: str, ns: argparse.Namespace, run_dir: Path) -> list[str]:
    common = [f"trainer.run_dir={run_dir}", "trainer.n_workers=2", "trainer.torch_threads=1",
              f"trainer.total_steps={ns.steps}", f"trainer.seed={ns.seed}",
              "trainer.save_final=false",
              f"model.tiny_hidden_size={ns.hidden}", f"model.tiny_layers={ns.layers}",
              f"data.train_batch_size={ns.prompts}", f"actor.mini_batch_size={ns.prompts}",
              f"rollout.n={ns.samples}", f"rollout.max_new_tokens={ns.max_new_tokens}",
              "model.pack_sequences=true", f"actor.lr={ns.lr}",
              "logging.progress_bar=false", "logging.console_every=1000"]
    common += workload_args(ns)
    if side == "async":
        common += ["trainer.mode=async", f"rollout.max_staleness={ns.staleness}"]
        if ns.async_trainer_threads > 1:
            common.append(f"trainer.async_trainer_threads={ns.async_trainer_threads}")
    return with_defaults(common, ns.extra)   # the user's extras replace the workload's


def run_side(side: str, ns: argparse.Namespace, run_dir: Path) -> dict:
    """One training run under torchrun; returns per-step wall times and metrics."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(_free_port()), "-m", "dagrl.train", *side_args(side, ns, run_dir)]
    metrics_file = run_dir / "metrics.jsonl"
    load = os.getloadavg()[0]
    started = time.perf_counter()
    run_dir.mkdir(parents=True, exist_ok=True)
    # A file, not a pipe: the agentic workload logs its failed tool calls every step, and a
    # full pipe that nobody reads until the end would stall the run.
    err_file = run_dir / "stderr.log"
    # Both sides alike: threads that wait for a core sleep (what `dagrl train` sets when a
    # trainer rank takes more threads than its core; no effect on one thread per worker).
    env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    with err_file.open("w") as err_out:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err_out, text=True,
                                env=env)
    stamps: list[float] = []
    records: list[dict] = []
    read = 0   # bytes of the file parsed: whole lines only (a line may be read half-written)
    while True:
        done = proc.poll() is not None
        if metrics_file.is_file():
            with metrics_file.open("rb") as f:
                f.seek(read)
                tail = f.read()
            whole = tail[:tail.rfind(b"\n") + 1]
            for line in whole.splitlines():
                if line.strip():
                    records.append(json.loads(line))
                    stamps.append(time.perf_counter())
            read += len(whole)
        if done:
            break
        time.sleep(0.02)
    if proc.returncode != 0:
        err = err_file.read_text(errors="replace")
        raise RuntimeError(f"{side} run failed ({proc.returncode}):\n{err[-3000:]}")
    final = [json.loads(line) for line in metrics_file.read_bytes().splitlines() if line.strip()]
    if records != final:
        raise RuntimeError(f"{side}: the metrics read during the run ({len(records)} records) "
                           f"are not {metrics_file} at its end ({len(final)} records)")
    return {"side": side, "load_before": load, "load_after": os.getloadavg()[0],
            "seconds_total": time.perf_counter() - started,
            "stamps": stamps, "records": records}


def summarize(run: dict, warmup: int) -> dict:
    recs, stamps = run["records"], run["stamps"]
    timed = recs[warmup:]
    seconds = stamps[-1] - stamps[warmup - 1]
    samples = sum(r["batch/samples"] for r in timed)
    out = {"samples_per_s": samples / seconds, "seconds": seconds, "samples": samples,
           "response_tokens": sum(r["response/length/mean"] * r["batch/samples"] for r in timed),
           "mean_length": sum(r["response/length/mean"] for r in timed) / len(timed),
           "max_length": max(r["response/length/max"] for r in timed),
           "reward_curve": [(s - stamps[0], r["reward/mean"]) for s, r in zip(stamps, recs,
                                                                               strict=True)]}
    out["tokens_per_s"] = out["response_tokens"] / seconds
    if "tools/calls" in recs[0]:
        out["tool_calls"] = sum(r.get("tools/calls", 0) for r in timed)
        out["tool_errors"] = sum(r.get("tools/errors", 0) for r in timed)
        out["turns_mean"] = sum(r.get("multi_turn/turns_mean", 0) for r in timed) / len(timed)
    if run["side"] == "async":
        out["staleness_max"] = max(r.get("async/staleness_max", 0) for r in recs)
        out["trainer_wait_s"] = sum(r.get("async/trainer_wait_s", 0) for r in timed) / len(timed)
        out["rollout_wait_s"] = sum(r.get("async/rollout_wait_s", 0) for r in timed) / len(timed)
    return out


def pool(summaries: list[dict]) -> dict:
    seconds = sum(s["seconds"] for s in summaries)
    samples = sum(s["samples"] for s in summaries)
    tokens = sum(s["response_tokens"] for s in summaries)
    return {"samples_per_s": samples / seconds, "tokens_per_s": tokens / seconds,
            "mean_length": sum(s["mean_length"] for s in summaries) / len(summaries),
            "max_length": max(s["max_length"] for s in summaries)}


def reward_table(curves: dict[str, list[tuple[float, float]]], points: int = 8) -> str:
    """Reward (mean of the steps logged in each window) against wall-clock seconds."""
    end = max(c[-1][0] for c in curves.values())
    edges = [end * (i + 1) / points for i in range(points)]
    lines = ["| seconds | " + " | ".join(f"{side} reward" for side in curves) + " |",
             "|---|" + "---|" * len(curves)]
    for i, edge in enumerate(edges):
        lo = edges[i - 1] if i else -1.0
        cells = []
        for curve in curves.values():
            window = [r for t, r in curve if lo < t <= edge]
            cells.append(f"{sum(window) / len(window):.3f}" if window else "-")
        lines.append(f"| {edge:.0f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="dagrl bench async", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=WORKLOADS, default="arith")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of s/s")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help="arith: 128; agentic: 32 (the whole episode, tool tokens included)")
    parser.add_argument("--stop-tokens", default="46", help="arith: token ids ending a response "
                        "besides EOS (46 is '.' in the tiny character tokenizer)")
    parser.add_argument("--hidden", type=int, default=None, help="arith: 128; agentic: 256")
    parser.add_argument("--layers", type=int, default=None, help="4")
    parser.add_argument("--staleness", type=int, default=1)
    parser.add_argument("--async-trainer-threads", type=int, default=None,
                        help="trainer.async_trainer_threads of the async side's trainer rank "
                             "(arith: 1; agentic: 2, the cores the rollout rank leaves idle "
                             "while its episodes wait)")
    parser.add_argument("--lr", type=float, default=3e-4, help="actor.lr (see the docstring)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sides", default="sync,async")
    agentic = parser.add_argument_group("agentic workload")
    agentic.add_argument("--latency", choices=DISTRIBUTIONS, default="lognormal",
                         help="the tool service's latency distribution")
    agentic.add_argument("--latency-median-ms", type=float, default=200.0)
    agentic.add_argument("--latency-p99-ms", type=float, default=2000.0)
    agentic.add_argument("--max-turns", type=int, default=3)
    agentic.add_argument("--max-tokens-per-turn", type=int, default=12)
    agentic.add_argument("--max-concurrent-calls", type=int, default=0,
                         help="rollout.multi_turn.max_concurrent_calls (0: prompts x samples)")
    parser.add_argument("--json", default="", help="also write every figure here")
    parser.add_argument("--out", default="", help="run directories (default: a temporary one)")
    parser.add_argument("extra", nargs="*", help="more key=value overrides for both sides")
    ns = parser.parse_args(argv)
    for key, value in DEFAULTS[ns.workload].items():
        if getattr(ns, key) is None:
            setattr(ns, key, value)
    ns.tool_url = ""   # the agentic workload's service, once main has started it
    ns.sides = [s for s in ns.sides.split(",") if s]
    if set(ns.sides) - set(SIDES) or ns.warmup < 1 or ns.steps <= ns.warmup:
        parser.error(f"--sides from {SIDES}; need 1 <= --warmup < --steps")
    try:
        ns.latency_model = Latency(ns.latency, ns.latency_median_ms, ns.latency_p99_ms)
    except ValueError as err:
        parser.error(str(err))
    return ns


def run_all(ns: argparse.Namespace, base: Path, service: ToolService | None) -> dict:
    """side -> its runs, the sides alternating their order from round to round."""
    runs: dict[str, list[dict]] = {s: [] for s in ns.sides}
    for rnd in range(ns.rounds):
        for side in (ns.sides if rnd % 2 == 0 else ns.sides[::-1]):
            run_dir = base / f"{side}-{rnd}"
            print(f"[bench async] round {rnd + 1}: {side} (load average before: "
                  f"{os.getloadavg()[0]:.2f}) ...", flush=True)
            if service is not None:   # the two sides of a round wait on the same sequence
                service.reset(f"{ns.seed}/{rnd}")
            run = run_side(side, ns, run_dir)
            run["summary"] = s = summarize(run, ns.warmup)
            line = (f"[bench async]   {side} (load average after: {run['load_after']:.2f}): "
                    f"{s['samples_per_s']:.2f} samples/s, "
                    f"{s['tokens_per_s']:.0f} response tokens/s, mean length "
                    f"{s['mean_length']:.1f}, max {s['max_length']:.0f}")
            if service is not None:
                calls = service.calls()
                run["tool_service"] = t = summarize_calls(calls)
                t["peak_in_flight"] = service.peak_in_flight
                # Every answered call, [drawn ms, served ms, ok]: the pooled quantiles use them.
                run["tool_calls"] = [[c.drawn_ms, c.served_ms, c.ok] for c in calls]
                line += (f"; tool: {t['calls']} calls answered (up to {t['peak_in_flight']} at "
                         f"once), served in p50 {t['served_ms']['p50']:.0f} / p90 "
                         f"{t['served_ms']['p90']:.0f} / p99 {t['served_ms']['p99']:.0f} ms")
            print(line, flush=True)
            runs[side].append(run)
    return runs


def report(ns: argparse.Namespace, runs: dict) -> dict:
    """Print the pooled figures; returns them."""
    pooled = {side: pool([r["summary"] for r in rs]) for side, rs in runs.items()}
    if ns.workload == "arith":
        work = (f"tiny qwen2 h{ns.hidden} x{ns.layers}, {ns.prompts} prompts x {ns.samples} "
                f"samples/step, <= {ns.max_new_tokens} tokens")
    else:
        kl = [a for a in [*workload_args(ns), *ns.extra]
              if a.startswith("algorithm.kl_loss_coef")][-1]   # the last one wins
        work = (f"agentic: tiny qwen2 h{ns.hidden} x{ns.layers} on tool-calc, {ns.prompts} "
                f"prompts x {ns.samples} samples/step, <= {ns.max_turns} turns, <= "
                f"{ns.max_new_tokens} tokens per episode, the calculator over HTTP, {kl}")
    threads = "2 workers x 1 thread" + (
        f" (async: the trainer rank {ns.async_trainer_threads} threads, OMP_WAIT_POLICY="
        f"{os.environ.get('OMP_WAIT_POLICY', 'PASSIVE')})" if ns.async_trainer_threads > 1 else "")
    print(f"\nworkload: {work}, {ns.steps} steps ({ns.warmup} warm-up), {threads}, "
          f"{ns.rounds} round(s), staleness <= {ns.staleness}")
    if ns.workload == "agentic":
        t = summarize_calls([Call(*c) for rs in runs.values() for r in rs
                             for c in r["tool_calls"]])
        print(f"tool latency, configured: {ns.latency_model.describe()}")
        print(f"tool latency, measured over the {t['calls']} calls answered ({t['errors']} with "
              f"an error result): drawn p50 {t['drawn_ms']['p50']:.0f} / p90 "
              f"{t['drawn_ms']['p90']:.0f} / p99 {t['drawn_ms']['p99']:.0f} ms; served p50 "
              f"{t['served_ms']['p50']:.0f} / p90 {t['served_ms']['p90']:.0f} / p99 "
              f"{t['served_ms']['p99']:.0f} ms, max {t['served_max_ms']:.0f} ms")
        pooled["tool_latency"] = t
    for side, p in ((s, pooled[s]) for s in runs):
        last = runs[side][-1]["summary"]
        loads = ", ".join(f"{r['load_before']:.2f} / {r['load_after']:.2f}" for r in runs[side])
        extra = ""
        if "tool_calls" in last:
            extra += (f", turns {last['turns_mean']:.2f}/episode, tool calls "
                      f"{last['tool_calls']:.0f} ({last['tool_errors']:.0f} errors)")
        if side == "async":
            extra += (f", staleness max {last['staleness_max']:.0f}, waits per step: trainer "
                      f"{last['trainer_wait_s']:.2f} s, rollout {last['rollout_wait_s']:.2f} s")
        print(f"{side:>5}: {p['samples_per_s']:.2f} samples/s ({p['tokens_per_s']:.0f} response "
              f"tokens/s, mean length {p['mean_length']:.1f}){extra}; load average before / "
              f"after each run: {loads}")
    if "sync" in runs and "async" in runs:
        pooled["ratio"] = ratio = pooled["async"]["samples_per_s"] / \
            pooled["sync"]["samples_per_s"]
        print(f"async / sync: {ratio:.2f}x samples/s")
        curves = {side: runs[side][0]["summary"]["reward_curve"] for side in ("sync", "async")}
        print("\nreward against wall-clock time (round 1):\n" + reward_table(curves))
    return pooled


def main(argv: Sequence[str] | None = None) -> int:
    ns = parse_args(argv)
    base = Path(ns.out) if ns.out else Path(tempfile.mkdtemp(prefix="dagrl-bench-async-"))
    # A run directory that exists would be resumed (trainer.resume=auto), its old steps read
    # as this bench's: refused before anything runs.
    reused = [f"{side}-{r}" for r in range(ns.rounds) for side in ns.sides
              if (base / f"{side}-{r}").exists()]
    if reused:
        print(f"error: --out {base}: {', '.join(reused)} exist(s) from an earlier bench (the "
              "runs would resume from them); give a new or empty directory", file=sys.stderr)
        return 2
    service = None
    if ns.workload == "agentic":
        service = ToolService(ns.latency_model, seed=ns.seed).start()
        ns.tool_url = service.url + "/calculator"
        print(f"[bench async] tool service at {ns.tool_url}, latency: "
              f"{ns.latency_model.describe()}", flush=True)
    try:
        runs = run_all(ns, base, service)
    finally:
        if service is not None:
            service.close()
    pooled = report(ns, runs)
    if ns.json:
        Path(ns.json).parent.mkdir(parents=True, exist_ok=True)
        args = {k: v for k, v in vars(ns).items() if k != "latency_model"}
        Path(ns.json).write_text(json.dumps({"args": args, "pooled": pooled, "runs": runs},
                                            indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
