"""Does GRPO on pictures read the picture? `examples/vlm_counting.yaml` beside its control.

    dagrl bench vlm                                   # the example, then the blank control
    dagrl bench vlm --task colour --steps 300         # the other built-in picture tasks
    dagrl bench vlm --quick                           # a few steps of each: the table only
    dagrl bench vlm --from-runs RUN_DIR BLANK_RUN_DIR # the same table for two finished runs

Both runs train the example's tiny VLM from scratch on the same rows of the built-in shapes
task (data/shapes.py, the trainer's seed): one with the pictures, one with every picture blank
(`blank=true`), so the question, the answers and every hyper-parameter are equal and only the
picture differs. It prints, for each run, the held-out greedy accuracy before training and at
every validation, the mean train reward of the first and the last 10 steps, and issue 36's
criteria: held-out after >= 2x before, and reward first 10 -> last 10 up by >= 0.2.

A model trained from scratch first learns the answer format (a digit in 1-4): that alone takes
held-out accuracy from 0 to chance (1 in 4) and the reward by ~0.25, with or without a
picture, so the blank control can pass both criteria by format alone. What shows the policy
reads the picture is the difference between the runs, printed last: the pictures' held-out
accuracy after training against the control's, and the reward gain beyond the control's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from dagrl.config.loader import with_defaults
from dagrl.config.presets import load_run_config
from dagrl.data.shapes import QUESTIONS, make_shapes

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "vlm_counting.yaml"
SCORE = "val/shapes/score"


def run_one(label: str, data: dict[str, Path], out: Path, overrides: Sequence[str]) -> dict:
    """Train the example on `data` (train and test parquet) and summarise its metrics.jsonl."""
    from dagrl.runtime.launch import launch

    run_dir = out / label
    cfg = load_run_config(EXAMPLE, with_defaults(
        [f"data.train_files=[{data['train']}]", f"data.val_files=[{data['test']}]",
         f"trainer.run_dir={run_dir}", "trainer.save_final=false", "trainer.val_before_train=true",
         "logging.progress_bar=false"], overrides))
    start = time.perf_counter()
    launch(cfg)
    return summarise(label, run_dir, time.perf_counter() - start)


def summarise(label: str, run_dir: Path, seconds: float | None = None) -> dict:
    """A finished run's held-out accuracy by step and its first and last 10 steps' reward
    (`seconds`: its wall-clock, else the sum of its steps' `timing/step_s`)."""
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    if seconds is None:
        seconds = sum(m.get("timing/step_s", 0.0) for m in metrics)
    held_out = {m["step"]: m[SCORE] for m in metrics if SCORE in m}
    rewards = [m["reward/mean"] for m in metrics if "reward/mean" in m]
    window = min(10, len(rewards) // 2)
    first, last = sum(rewards[:window]) / window, sum(rewards[-window:]) / window
    return {"run": label, "held_out": held_out, "before": held_out[0],
            "after": held_out[max(held_out)], "first10": first, "last10": last,
            "gain": last - first, "steps": len(rewards), "seconds": seconds}


def criteria(row: dict) -> tuple[bool, bool]:
    """Issue 36's two criteria for one run: held-out after >= 2x before (with before = 0, any
    accuracy above 0 doubles it), reward gain >= 0.2."""
    return row["after"] >= 2 * row["before"] and row["after"] > 0, row["gain"] >= 0.2


def report(pictures: dict, control: dict) -> str:
    lines = ["| run | held-out before | held-out after | reward, first 10 | reward, last 10 "
             "| gain | after >= 2x before | gain >= 0.2 | s/step |", "|---" * 9 + "|"]
    for row in (pictures, control):
        doubled, rose = criteria(row)
        lines.append(f"| {row['run']} | {row['before']:.3f} | {row['after']:.3f} "
                     f"| {row['first10']:.3f} | {row['last10']:.3f} | {row['gain']:+.3f} "
                     f"| {'yes' if doubled else 'no'} | {'yes' if rose else 'no'} "
                     f"| {row['seconds'] / row['steps']:.2f} |")
    lines.append("")
    for row in (pictures, control):
        curve = ", ".join(f"{step}: {acc:.3f}" for step, acc in sorted(row["held_out"].items()))
        lines.append(f"held-out greedy accuracy by step, {row['run']}: {curve}")
    ratio = (pictures["after"] / control["after"] if control["after"] > 0 else float("inf"))
    beyond = pictures["gain"] - control["gain"]
    reads = ratio >= 2 and beyond >= 0.2
    lines += ["", f"pictures vs blank control: held-out after {pictures['after']:.3f} vs "
              f"{control['after']:.3f} ({ratio:.2f}x), reward gain beyond the control's "
              f"{beyond:+.3f}: the policy {'reads' if reads else 'does not read'} the picture "
              "(>= 2x and >= +0.2)"]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dagrl bench vlm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="count", choices=list(QUESTIONS))
    parser.add_argument("--steps", type=int, help="trainer.total_steps (the example's if unset)")
    parser.add_argument("--quick", action="store_true",
                        help="4 steps of each on 128 rows: checks the bench, not the learning")
    parser.add_argument("--out", default="runs/bench-vlm")
    parser.add_argument("--json", help="also write both runs' summaries to this file")
    parser.add_argument("--from-runs", nargs=2, metavar=("PICTURES", "BLANK"),
                        help="compare two finished run directories instead of training")
    parser.add_argument("overrides", nargs="*", help="extra key=value config overrides")
    ns = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    if ns.from_runs:
        rows = [summarise(label, Path(d)) for label, d in zip(("pictures", "blank"),
                                                                ns.from_runs, strict=True)]
        print(report(*rows))
        return 0
    out = Path(ns.out)
    taken = [out / label for label in ("pictures", "blank") if (out / label).exists()]
    if taken:   # a second run there would resume or mix with the first one's metrics
        print(f"error: dagrl bench vlm: {taken[0]} already holds a run; choose another --out "
              "(or compare finished runs with --from-runs)", file=sys.stderr)
        return 2
    seed = load_run_config(EXAMPLE, ns.overrides).trainer.seed
    size = {"n_train": 128, "n_test": 32} if ns.quick else {}
    steps = ns.steps or (4 if ns.quick else None)
    extra = [f"trainer.total_steps={steps}"] if steps else []
    if ns.quick:
        extra += ["trainer.val_every=2", "data.train_batch_size=4", "actor.mini_batch_size=4",
                  "rollout.n=2"]
    overrides = with_defaults(extra, ns.overrides)
    rows = []
    for label, blank in (("pictures", False), ("blank", True)):
        data = make_shapes(out / f"data-{label}", seed=seed,
                           task=ns.task, blank=blank, **size)
        rows.append(run_one(label, data, out, overrides))
    print(f"\ntask {ns.task!r}: {QUESTIONS[ns.task]}\n")
    print(report(*rows))
    if ns.json:
        Path(ns.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
