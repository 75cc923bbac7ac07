"""`dagrl bench learning --vs trl --across RUN.json ...`: several recorded runs of the learning
workload read together, one draw of each side's curve per run.

One run of `dagrl bench learning --vs trl` is one seed on one machine: the sampled tokens, and
from them the whole curve, change with the seed (and, in float32, with the CPU's kernels), and
on 256 held-out problems the accuracy of one checkpoint is itself uncertain by ~2.6 points. So
the issue's figures read from a single pair of runs can turn on the draw. This reads the --json
figures of several runs of the same workload (any seed, either side or both) and prints, per
evaluated step, each side's runs and their mean, then the issue's figures on the mean curves:
the accuracy gap from half-way on, dagrl's wall-clock to TRL's mean final accuracy over TRL's,
and the mean peak RSS ratio. Each run's own verdict stays in its JSON ("comparison").

    dagrl bench learning --vs trl --seed 1 --out runs/seed1 --json runs/seed1.json
    dagrl bench learning --vs trl --across runs/seed0.json runs/seed1.json --plot seeds.svg
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from benchmarks.learning_report import CHASE_BUDGET, COLORS, LABELS, pyplot, save_svg

# Workload fields that may differ between the runs read together: the draw, and how far a
# side trained (a run past --steps still has its points at the shared steps).
MAY_DIFFER = {"seed", "steps"}


def load_runs(paths: list[Path]) -> tuple[dict, list[dict]]:
    """The shared workload (steps: the fewest) and each run's figures, checked to be runs of
    the same workload."""
    runs = []
    for path in paths:
        try:
            result = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise SystemExit(f"{path}: not a --json result of the learning bench ({exc})") \
                from None
        if "workload" not in result or not any(s in result for s in LABELS):
            raise SystemExit(f"{path}: not a --json result of the learning bench (no workload "
                             "or side figures)")
        # A run recorded before --seed existed ran seed 0.
        result["workload"] = {"seed": 0, **result["workload"]}
        runs.append({"path": path, **result})
    first = runs[0]["workload"]
    for run in runs[1:]:
        differ = sorted(k for k in set(first) | set(run["workload"])
                        if k not in MAY_DIFFER and first.get(k) != run["workload"].get(k))
        if differ:
            raise SystemExit(f"{run['path']}: another workload than {runs[0]['path']} ("
                             + ", ".join(f"{k}: {run['workload'].get(k)} vs {first.get(k)}"
                                         for k in differ) + ")")
    work = {**first, "steps": min(run["workload"]["steps"] for run in runs)}
    return work, runs


def points(run: dict, side: str) -> dict[int, tuple[float, float]]:
    """{step: (wall-clock seconds, held-out accuracy)} of one run's side."""
    return {step: (clock, acc) for step, clock, acc in run.get(side, {}).get("accuracy", [])}


def mean_curve(runs: list[dict], side: str, steps: list[int]) -> dict[int, tuple[float, float]]:
    """{step: (mean clock, mean accuracy)} at the steps every run of the side has evaluated."""
    curves = [points(run, side) for run in runs if side in run]
    return {s: (statistics.mean(c[s][0] for c in curves), statistics.mean(c[s][1] for c in curves))
            for s in steps if curves and all(s in c for c in curves)}


def print_table(work: dict, runs: list[dict], sides: list[str]) -> list[int]:
    steps = sorted({s for run in runs for side in sides for s in points(run, side)})
    head = " | ".join(f"{LABELS[s]} held-out: mean (runs in order) | {LABELS[s]} wall (min, mean)"
                      for s in sides)
    print(f"\n| step | {head} |\n|---|" + "---|" * 2 * len(sides))
    for step in steps:
        cells = []
        for side in sides:
            found = [points(run, side)[step] for run in runs if step in points(run, side)]
            if not found:
                cells += ["", ""]
                continue
            each = ", ".join(f"{acc:.3f}" for _, acc in found)
            cells += [f"{statistics.mean(a for _, a in found):.3f} ({each})",
                      f"{statistics.mean(c for c, _ in found) / 60:.1f}"]
        print(f"| {step} | " + " | ".join(cells) + " |")
    for side in sides:
        mine = [run for run in runs if side in run]
        seeds = ", ".join(str(run["workload"]["seed"]) for run in mine)
        final = [points(run, side)[work["steps"]][1] for run in mine
                 if work["steps"] in points(run, side)]
        spread = (f"; step {work['steps']}: {min(final):.3f}-{max(final):.3f}"
                  + (f", std {statistics.stdev(final) * 100:.1f} points" if len(final) > 1
                     else "")) if final else ""
        print(f"{LABELS[side]}: {len(mine)} run(s), seeds {seeds}{spread}")
    return steps


def compare_means(work: dict, runs: list[dict], steps: list[int]) -> dict:
    """The issue's three figures on the mean curves."""
    ours, trl = mean_curve(runs, "ours", steps), mean_curve(runs, "trl", steps)
    out: dict = {"accuracy_gap": {s: ours[s][1] - trl[s][1] for s in sorted(ours)
                                  if s in trl and work["steps"] / 2 <= s <= work["steps"]}}
    for step, gap in out["accuracy_gap"].items():
        print(f"mean step {step}: dagrl {ours[step][1]:.3f} vs TRL {trl[step][1]:.3f} "
              f"({gap * 100:+.1f} points): {'ok' if gap >= -0.05 else 'NOT within 5 points'}")
    if work["steps"] in trl:
        target_clock, target = trl[work["steps"]]
        reached = [s for s in sorted(ours) if s > 0 and ours[s][1] >= target]
        if reached:
            ratio = ours[reached[0]][0] / target_clock
            out["time_to_trl_final"] = {"step": reached[0], "ratio": ratio}
            print(f"dagrl's mean curve reaches TRL's mean step-{work['steps']} accuracy "
                  f"({target:.3f}) at step {reached[0]}, {ours[reached[0]][0] / 60:.1f} min = "
                  f"{ratio:.2f}x TRL's mean {target_clock / 60:.1f} min (target <= "
                  f"{CHASE_BUDGET}x: {'met' if ratio <= CHASE_BUDGET else 'NOT met'})")
        else:
            print(f"dagrl's mean curve does not reach TRL's mean step-{work['steps']} accuracy "
                  f"({target:.3f}) at the steps every dagrl run evaluated")
    peaks = {side: [run[side]["peak_rss_gb"] for run in runs
                    if side in run and work["steps"] in points(run, side)] for side in LABELS}
    if all(peaks.values()):
        rss = statistics.mean(peaks["ours"]) / statistics.mean(peaks["trl"])
        out["peak_rss_ratio"] = rss
        print(f"mean peak RSS dagrl / TRL = {rss:.2f}x (target <= 0.6x: "
              f"{'met' if rss <= 0.6 else 'NOT met'})")
    return out


def write_plot(path: Path, work: dict, runs: list[dict], sides: list[str],
               steps: list[int]) -> None:
    """Held-out accuracy against step and against wall-clock: each run thin, the mean bold."""
    fig, axes = pyplot().subplots(1, 2, figsize=(10, 4))
    for side in sides:
        for run in [r for r in runs if side in r]:
            curve = sorted((s, c, a) for s, (c, a) in points(run, side).items())
            axes[0].plot([s for s, _, _ in curve], [a for _, _, a in curve], "-",
                         color=COLORS[side], alpha=0.35, linewidth=1)
            axes[1].plot([c / 60 for _, c, _ in curve], [a for _, _, a in curve], "-",
                         color=COLORS[side], alpha=0.35, linewidth=1)
        mean = sorted((s, c, a) for s, (c, a) in mean_curve(runs, side, steps).items())
        label = f"{LABELS[side]}, mean of {sum(side in r for r in runs)} run(s)"
        axes[0].plot([s for s, _, _ in mean], [a for _, _, a in mean], "o-",
                     color=COLORS[side], linewidth=2.5, label=label)
        axes[1].plot([c / 60 for _, c, _ in mean], [a for _, _, a in mean], "o-",
                     color=COLORS[side], linewidth=2.5, label=label)
    axes[0].set(xlabel="step", ylabel="held-out accuracy (greedy)", title="per step")
    axes[1].set(xlabel="wall-clock (min, model loading included)", title="per minute")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend(loc="lower right", fontsize=8)
    fig.suptitle(f"GRPO, {work['name']}, {work['precision']}: every run (thin) and the mean "
                 "(bold)")
    save_svg(fig, path)


def summarize(paths: list[Path], plot: Path | None, json_out: Path | None) -> int:
    work, runs = load_runs(paths)
    sides = [s for s in LABELS if any(s in run for run in runs)]
    print(f"{len(runs)} run(s) of {work['name']} ({work['precision']}, {work['prompts']} "
          f"prompts x {work['samples']} samples), compared at step {work['steps']}")
    for i, run in enumerate(runs, 1):
        print(f"run {i}: {run['path']} (seed {run['workload']['seed']}; "
              + ", ".join(LABELS[s] for s in sides if s in run) + ")")
    steps = print_table(work, runs, sides)
    result = {"workload": work, "runs": [str(run["path"]) for run in runs],
              "mean": {side: mean_curve(runs, side, steps) for side in sides}}
    if len(sides) == 2:
        result["comparison"] = compare_means(work, runs, steps)
    if plot:
        write_plot(plot, work, runs, sides, steps)
        print(f"plot: {plot}")
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(result, indent=2))
    return 0
