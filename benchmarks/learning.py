"""Does each algorithm learn? Seeded runs on the default task, reward early vs late.

    dagrl bench learning                                  # every built-in algorithm, 60 steps
    dagrl bench learning --algorithms grpo,ppo --steps 100 --out runs/learning
    dagrl bench learning --vs trl [--quick]               # beside TRL on SmolLM2: see
                                                          # benchmarks/learning_vs_trl.py
    dagrl bench learning --vs trl --update-parity         # one update each on the same
                                                          # samples: benchmarks/update_vs_trl.py

For each algorithm it trains the default tiny model on the built-in arithmetic task with that
algorithm's preset (one worker, seed 0) and prints a Markdown table: mean `reward/mean` over the
first 10 and the last 10 steps, and their difference. docs/algorithms.md quotes its output.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from dagrl.config.loader import with_defaults
from dagrl.config.presets import PRESETS, load_run_config


def run_one(name: str, steps: int, out: Path, extra: Sequence[str]) -> dict:
    from dagrl.runtime.launch import launch

    cfg = load_run_config(None, with_defaults(
        [f"algorithm.name={name}", f"trainer.total_steps={steps}", f"trainer.run_dir={out / name}",
         "trainer.save_final=false", "logging.progress_bar=false",
         f"logging.console_every={steps}"], extra))
    start = time.perf_counter()
    history = launch(cfg)
    rewards = [m["reward/mean"] for m in history]
    window = min(10, len(rewards) // 2)
    first, last = sum(rewards[:window]) / window, sum(rewards[-window:]) / window
    return {"algorithm": name, "steps": steps, "first10": first, "last10": last,
            "gain": last - first, "seconds": time.perf_counter() - start}


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--update-parity" in argv:
        from benchmarks.update_vs_trl import main as parity_main

        return parity_main(argv)
    if any(a == "--vs" or a.startswith("--vs=") for a in argv):
        from benchmarks.learning_vs_trl import main as vs_main

        return vs_main(argv)
    parser = argparse.ArgumentParser(prog="dagrl bench learning", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algorithms", default="all", help="comma-separated names, or all")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--out", default="runs/bench-learning")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("overrides", nargs="*", help="extra key=value config overrides")
    ns = parser.parse_args(argv)
    names = list(PRESETS) if ns.algorithms == "all" else ns.algorithms.split(",")
    rows = [run_one(name, ns.steps, Path(ns.out), ns.overrides) for name in names]
    print("\n| algorithm | reward, first 10 steps | reward, last 10 steps | gain | time (s) |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['algorithm']} | {r['first10']:.3f} | {r['last10']:.3f} | {r['gain']:+.3f} "
              f"| {r['seconds']:.0f} |")
    if ns.json:
        Path(ns.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
