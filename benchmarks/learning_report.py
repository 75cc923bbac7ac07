"""The table and the plot of `dagrl bench learning --vs trl` (benchmarks/learning_vs_trl.py).

Held-out accuracy comes from one evaluator for both sides (evaluations: {"initial" |
"<side>/<step>": {"accuracy", "seconds", "scores"}}, scores: each held-out problem's, in the
split's order, so a gap between two checkpoints gets a paired interval); train reward and
wall-clock from each side's progress record (the step's seconds since its run began, model
loading included). Several runs (seeds) are read together by benchmarks/learning_seeds.py.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from pathlib import Path
from typing import Any

LABELS = {"ours": "dagrl", "trl": "TRL"}
COLORS = {"ours": "#1f77b4", "trl": "#ff7f0e"}


def accuracy_curve(side: str, evaluations: dict, progress: Any) -> list[tuple[int, float, float]]:
    """(step, wall-clock seconds, held-out accuracy) from the initial model on."""
    points = [(0, 0.0, evaluations["initial"]["accuracy"])] if "initial" in evaluations else []
    for key, record in evaluations.items():
        if key.startswith(f"{side}/"):
            step = int(key.split("/")[1])
            if step in progress.clock:
                points.append((step, progress.clock[step], record["accuracy"]))
    return sorted(points)


def mean_reward(progress: Any, first: int, last: int) -> float | None:
    values = [progress.reward[s] for s in range(first, last + 1)
              if progress.reward.get(s) is not None]
    return statistics.mean(values) if values else None


def _fmt(value: float | None, spec: str) -> str:
    return "" if value is None else format(value, spec)


def print_report(work: Any, progress: dict, evaluations: dict) -> dict:
    """Print the Markdown table and the comparisons; return every figure."""
    sides = [s for s in ("ours", "trl") if s in progress]
    curves = {s: accuracy_curve(s, evaluations, progress[s]) for s in sides}
    result: dict = {"workload": dataclasses.asdict(work), "evaluations": evaluations}
    for side in sides:
        p = progress[side]
        result[side] = {"accuracy": curves[side], "clock": p.clock, "reward": p.reward,
                        "peak_rss_gb": p.peak_rss_gb, "segments": p.segments}
    print(f"\n{work.steps} steps of {work.prompts} prompts x {work.samples} samples, held-out "
          f"accuracy (greedy, one evaluator) every {work.every} steps, {work.precision}")
    head = " | ".join(f"{LABELS[s]} held-out | {LABELS[s]} train reward | {LABELS[s]} wall (min)"
                      for s in sides)
    print(f"\n| step | {head} |\n|---|" + "---|" * 3 * len(sides))
    steps = sorted({step for s in sides for step, _, _ in curves[s]})
    for step in steps:
        cells = []
        for side in sides:
            acc = {st: a for st, _, a in curves[side]}.get(step)
            reward = mean_reward(progress[side], step - work.every + 1, step) if step else None
            clock = progress[side].clock.get(step, 0.0 if step == 0 else None)
            cells += [_fmt(acc, ".3f"), _fmt(reward, ".3f"),
                      _fmt(None if clock is None else clock / 60, ".1f")]
        print(f"| {step} | " + " | ".join(cells) + " |")
    print("(train reward: the mean over the steps since the row above)")
    for side in sides:
        p = progress[side]
        loads = ", ".join(f"{seg['load_before']:.1f} -> {seg['load_after']:.1f}"
                          for seg in p.segments)
        done = max(p.clock, default=0)
        beyond = f", then on to step {done}" if done > work.steps else ""
        print(f"{LABELS[side]}: {min(done, work.steps)} of {work.steps} steps{beyond}; peak RSS "
              f"{p.peak_rss_gb:.2f} GiB; {len(p.segments)} segment(s), load average {loads}")
    if set(sides) == {"ours", "trl"}:
        result["comparison"] = compare(work, curves, progress, evaluations)
    return result


def paired_interval(ours: list[float] | None, theirs: list[float] | None) -> float | None:
    """Half-width of the 95% interval of mean(ours) - mean(theirs), the two checkpoints' scores
    on the same held-out problems: 1.96 x std(d) / sqrt(n) over the per-problem differences d
    (the normal approximation; pairing removes the problems' own difficulty from the noise).
    None where either side's scores were not recorded."""
    if not ours or not theirs or len(ours) != len(theirs) or len(ours) < 2:
        return None
    diffs = [a - b for a, b in zip(ours, theirs, strict=True)]
    return 1.96 * statistics.stdev(diffs) / math.sqrt(len(diffs))


def compare(work: Any, curves: dict, progress: dict, evaluations: dict) -> dict:
    """The issue's three figures: accuracy from half-way on within 5 points of TRL's (or above),
    dagrl's wall-clock to TRL's last accuracy over TRL's, peak RSS ratio (once both sides have
    run every step)."""
    ours = {step: (clock, acc) for step, clock, acc in curves["ours"]}
    trl = {step: (clock, acc) for step, clock, acc in curves["trl"]}
    shared = [s for s in sorted(ours) if s in trl and s >= work.steps / 2]
    gaps = {s: ours[s][1] - trl[s][1] for s in shared}
    out: dict = {"accuracy_gap": gaps, "accuracy_gap_interval": {}}
    for step, gap in gaps.items():
        half = paired_interval(evaluations.get(f"ours/{step}", {}).get("scores"),
                               evaluations.get(f"trl/{step}", {}).get("scores"))
        if half is not None:
            out["accuracy_gap_interval"][step] = half
        spread = "" if half is None else f" ± {half * 100:.1f}"
        print(f"step {step}: dagrl {ours[step][1]:.3f} vs TRL {trl[step][1]:.3f} "
              f"({gap * 100:+.1f}{spread} points): "
              f"{'ok' if gap >= -0.05 else 'NOT within 5 points'}")
    if out["accuracy_gap_interval"]:
        print("(±: the 95% interval of the gap over the held-out problems, paired, for these "
              "two checkpoints; another seed is another draw, not inside it)")
    if trl and max(trl) == work.steps:
        target_clock, target = trl[work.steps]
        reached = [s for s in sorted(ours) if s > 0 and ours[s][1] >= target]
        if reached:
            ratio = ours[reached[0]][0] / target_clock
            out["time_to_trl_final"] = {"step": reached[0], "seconds": ours[reached[0]][0],
                                        "trl_seconds": target_clock, "ratio": ratio}
            print(f"dagrl reaches TRL's step-{work.steps} accuracy ({target:.3f}) at step "
                  f"{reached[0]}, after {ours[reached[0]][0] / 60:.1f} min = {ratio:.2f}x TRL's "
                  f"{target_clock / 60:.1f} min (target <= 0.5x: "
                  f"{'met' if ratio <= 0.5 else 'NOT met'})")
        else:
            print(f"dagrl does not reach TRL's step-{work.steps} accuracy ({target:.3f}) in its "
                  "evaluated checkpoints")
    done = {side: max(progress[side].clock, default=0) for side in ("ours", "trl")}
    if min(done.values()) < work.steps:
        # A side's peak so far may be its model load alone: no ratio until both have run.
        print(f"peak RSS compared when both sides have run all {work.steps} steps (dagrl at "
              f"step {done['ours']}, TRL at step {done['trl']})")
        return out
    rss = progress["ours"].peak_rss_gb / progress["trl"].peak_rss_gb
    out["peak_rss_ratio"] = rss
    print(f"peak RSS dagrl / TRL = {rss:.2f}x (target <= 0.6x: "
          f"{'met' if rss <= 0.6 else 'NOT met'})")
    return out


# The bound on the time to TRL's final accuracy: past half of TRL's wall-clock, dagrl
# training on could no longer meet it, so the chase ends there.
CHASE_BUDGET = 0.5


def next_chase_step(work: Any, max_steps: int, progress: dict,
                    evaluations: dict) -> tuple[int | None, str]:
    """Whether dagrl trains on past work.steps to reach TRL's last accuracy: (the step to train
    to, why) or (None, why not). Training on is the only way to measure the time to that
    accuracy when dagrl's evaluated checkpoints stay below it; each block is work.every steps
    and is evaluated before the next is decided."""
    if "ours" not in progress or "trl" not in progress:
        return None, "both sides are needed"
    trl_clock = progress["trl"].clock.get(work.steps)
    target = evaluations.get(f"trl/{work.steps}", {}).get("accuracy")
    if trl_clock is None or target is None:
        return None, f"TRL has no evaluated step-{work.steps} checkpoint yet"
    curve = accuracy_curve("ours", evaluations, progress["ours"])
    last, clock, _ = max(curve)
    if last < work.steps:
        return None, f"dagrl has no evaluated step-{work.steps} checkpoint yet"
    if any(acc >= target for step, _, acc in curve if step > 0):
        return None, f"dagrl has reached TRL's step-{work.steps} accuracy ({target:.3f})"
    if clock >= CHASE_BUDGET * trl_clock:
        return None, (f"dagrl's step {last} came after {clock / 60:.1f} min, past "
                      f"{CHASE_BUDGET}x TRL's {trl_clock / 60:.1f} min: TRL's step-{work.steps} "
                      f"accuracy ({target:.3f}) is not reached within it")
    if last + work.every > max_steps:
        return None, (f"step {last + work.every} would pass --max-steps {max_steps} (dagrl "
                      f"below TRL's step-{work.steps} accuracy, {target:.3f}, up to step {last})")
    return last + work.every, (f"dagrl's best held-out accuracy up to step {last} is below "
                               f"TRL's step-{work.steps} ({target:.3f}) after {clock / 60:.1f} "
                               f"of TRL's {trl_clock / 60:.1f} min")


def write_plot(path: Path, work: Any, progress: dict, evaluations: dict) -> None:
    """Held-out accuracy against step and against wall-clock, and the train reward (a moving
    mean over 10 steps) against step, both sides, as an SVG."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for side in [s for s in ("ours", "trl") if s in progress]:
        p, color = progress[side], COLORS[side]
        label = f"{LABELS[side]} (peak RSS {p.peak_rss_gb:.1f} GiB)"
        curve = accuracy_curve(side, evaluations, p)
        axes[0].plot([s for s, _, _ in curve], [a for _, _, a in curve], "o-", color=color,
                     label=label)
        axes[1].plot([c / 60 for _, c, _ in curve], [a for _, _, a in curve], "o-",
                     color=color, label=label)
        steps = sorted(s for s, r in p.reward.items() if r is not None)
        window = [statistics.mean(p.reward[t] for t in steps[max(0, i - 9):i + 1])
                  for i in range(len(steps))]
        axes[2].plot(steps, window, color=color, label=LABELS[side])
    axes[0].set(xlabel="step", ylabel="held-out accuracy (greedy)", title="per step")
    axes[1].set(xlabel="wall-clock (min, model loading included)", title="per minute")
    axes[2].set(xlabel="step", ylabel="train reward (mean of 10 steps)", title="train reward")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend(loc="lower right", fontsize=8)
    fig.suptitle(f"GRPO, {work.name}: {work.prompts} prompts x {work.samples} samples per step, "
                 f"{work.precision}, same hyper-parameters and evaluator on both sides")
    save_svg(fig, path)


def pyplot() -> Any:
    """matplotlib's pyplot, drawing off-screen, SVG text kept as text (small, searchable)."""
    import matplotlib

    matplotlib.use("Agg")
    matplotlib.rcParams["svg.fonttype"] = "none"
    import matplotlib.pyplot as plt

    return plt


def save_svg(fig: Any, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="svg", metadata={"Date": None})   # no timestamp: diffs stay small
    plt.close(fig)
