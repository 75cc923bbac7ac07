"""Sync beside async training on the same 2 workers and the same work, in one run.

    dagrl bench async                         # sync, then async (max_staleness=1), 2 rounds
    dagrl bench async --steps 30 --rounds 1 --json runs/async.json
    python -m benchmarks.async ...            # the same, without the CLI

Both sides are `torchrun --nproc-per-node 2 -m dagrl.train` with the same config but
`trainer.mode`: sync (both workers generate, then both train, every step) or async (rank 1
generates, scores and runs the reference, rank 0 trains, the two overlapping with at most
`--staleness` versions of lag). Same model, data, seed, prompts per step, samples per prompt,
steps and threads (one per worker).

Workload: a randomly initialised tiny Qwen2 (`--hidden`, `--layers`) on the built-in arithmetic
task, 8 prompts x 8 samples per step, temperature 1, up to `--max-new-tokens` 128 tokens,
sequences packed for training (`model.pack_sequences=true`: an update costs the real tokens,
not the padding to the longest response). The response lengths have a long tail, as in real RL
runs: besides EOS, '.' ends a response (`--stop-tokens`), and a freshly initialised model draws
either with probability ~1/24 per token, so lengths are roughly geometric: most responses are
short, a few per step run far longer. Each side's lengths are printed: training moves them,
and with the default actor.lr (3e-3) a few steps already move them differently on the two
sides (one more update behind is enough), which makes the work differ; `--lr` 3e-4 keeps the
two sides' lengths within a few percent over the bench's steps while the reward still rises.

Figures: samples per second of wall time over the steps after the first `--warmup`
(timestamped by this process as each step's metrics line appears in metrics.jsonl, so the two
sides are timed the same way, startup excluded), and reward against wall-clock time (seconds
since the end of the first step) for both; with `--rounds` > 1 the order of the sides alternates
and the figures pool the rounds. The machine's load average is printed before each side: the
figures mean something only on an otherwise idle machine.
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

SIDES = ("sync", "async")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def side_args(side: str, ns: argparse.Namespace, run_dir: Path) -> list[str]:
    common = [f"trainer.run_dir={run_dir}", "trainer.n_workers=2", "trainer.torch_threads=1",
              f"trainer.total_steps={ns.steps}", f"trainer.seed={ns.seed}",
              f"model.tiny_hidden_size={ns.hidden}", f"model.tiny_layers={ns.layers}",
              f"data.train_batch_size={ns.prompts}", f"actor.mini_batch_size={ns.prompts}",
              f"rollout.n={ns.samples}", f"rollout.max_new_tokens={ns.max_new_tokens}",
              f"rollout.stop_token_ids=[{ns.stop_tokens}]", "data.max_prompt_length=16",
              "model.pack_sequences=true", f"actor.lr={ns.lr}",
              "logging.progress_bar=false", "logging.console_every=1000"]
    if side == "async":
        common += ["trainer.mode=async", f"rollout.max_staleness={ns.staleness}"]
    return common + list(ns.extra)


def run_side(side: str, ns: argparse.Namespace, run_dir: Path) -> dict:
    """One training run under torchrun; returns per-step wall times and metrics."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(_free_port()), "-m", "dagrl.train", *side_args(side, ns, run_dir)]
    metrics_file = run_dir / "metrics.jsonl"
    load = os.getloadavg()[0]
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    stamps: list[float] = []
    records: list[dict] = []
    seen = 0
    while True:
        done = proc.poll() is not None
        if metrics_file.is_file():
            lines = metrics_file.read_text().splitlines()
            complete = lines if done else lines[:-1] if lines and not lines[-1] else lines
            for line in complete[seen:]:
                if line.strip():
                    records.append(json.loads(line))
                    stamps.append(time.perf_counter())
            seen = len(complete)
        if done:
            break
        time.sleep(0.02)
    err = proc.stderr.read()
    if proc.returncode != 0:
        raise RuntimeError(f"{side} run failed ({proc.returncode}):\n{err[-3000:]}")
    return {"side": side, "load_before": load, "seconds_total": time.perf_counter() - started,
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dagrl bench async", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of s/s")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--stop-tokens", default="46", help="token ids ending a response besides "
                        "EOS (46 is '.' in the tiny character tokenizer)")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--staleness", type=int, default=1)
    parser.add_argument("--lr", type=float, default=3e-4, help="actor.lr (see the docstring)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sides", default="sync,async")
    parser.add_argument("--json", default="", help="also write every figure here")
    parser.add_argument("--out", default="", help="run directories (default: a temporary one)")
    parser.add_argument("extra", nargs="*", help="more key=value overrides for both sides")
    ns = parser.parse_args(argv)
    sides = [s for s in ns.sides.split(",") if s]
    unknown = set(sides) - set(SIDES)
    if unknown or ns.warmup < 1 or ns.steps <= ns.warmup:
        parser.error(f"--sides from {SIDES}; need 1 <= --warmup < --steps")
    base = Path(ns.out) if ns.out else Path(tempfile.mkdtemp(prefix="dagrl-bench-async-"))
    runs: dict[str, list[dict]] = {s: [] for s in sides}
    for rnd in range(ns.rounds):
        for side in (sides if rnd % 2 == 0 else sides[::-1]):
            run_dir = base / f"{side}-{rnd}"
            print(f"[bench async] round {rnd + 1}: {side} (load average before: "
                  f"{os.getloadavg()[0]:.2f}) ...", flush=True)
            run = run_side(side, ns, run_dir)
            run["summary"] = summarize(run, ns.warmup)
            runs[side].append(run)
            s = run["summary"]
            print(f"[bench async]   {side}: {s['samples_per_s']:.1f} samples/s, "
                  f"{s['tokens_per_s']:.0f} response tokens/s, mean length "
                  f"{s['mean_length']:.1f}, max {s['max_length']:.0f}", flush=True)
    pooled = {side: pool([r["summary"] for r in rs]) for side, rs in runs.items()}
    print(f"\nworkload: tiny qwen2 h{ns.hidden} x{ns.layers}, {ns.prompts} prompts x "
          f"{ns.samples} samples/step, <= {ns.max_new_tokens} tokens, {ns.steps} steps "
          f"({ns.warmup} warm-up), 2 workers x 1 thread, {ns.rounds} round(s)")
    for side, p in pooled.items():
        extra = ""
        if side == "async":
            last = runs[side][-1]["summary"]
            extra = (f", staleness max {last['staleness_max']:.0f}, waits per step: trainer "
                     f"{last['trainer_wait_s']:.2f} s, rollout {last['rollout_wait_s']:.2f} s")
        print(f"{side:>5}: {p['samples_per_s']:.1f} samples/s ({p['tokens_per_s']:.0f} response "
              f"tokens/s, mean length {p['mean_length']:.1f}){extra}")
    if "sync" in pooled and "async" in pooled:
        ratio = pooled["async"]["samples_per_s"] / pooled["sync"]["samples_per_s"]
        print(f"async / sync: {ratio:.2f}x samples/s")
        curves = {side: runs[side][0]["summary"]["reward_curve"] for side in ("sync", "async")}
        print("\nreward against wall-clock time (round 1):\n" + reward_table(curves))
    if ns.json:
        Path(ns.json).parent.mkdir(parents=True, exist_ok=True)
        Path(ns.json).write_text(json.dumps({"args": vars(ns), "pooled": pooled, "runs": runs},
                                            indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
