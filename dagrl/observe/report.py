"""`dagrl report RUN_DIR`: one self-contained HTML page about a run.

Reads what a run leaves behind — metrics.jsonl, config.resolved.yaml and, when the run was
profiled, profile/trace.json — and writes RUN_DIR/report.html: metric plots (PNG, base64-inlined
so the page has no outside references), the DAG and per-rank plan as inline SVG
(dagrl/dag/draw.py), the resolved config, and the top time consumers of the trace.
Plots need matplotlib: pip install 'dagrl[report]'.
"""

from __future__ import annotations

import base64
import io
import json
import math
import re
from collections.abc import Callable
from datetime import datetime
from html import escape
from pathlib import Path

from dagrl.config.loader import load_config
from dagrl.config.schema import Config
from dagrl.dag.draw import to_svg
from dagrl.dag.planner import RankPlan
from dagrl.dag.spec import GraphSpec
from dagrl.observe.observer import task_name
from dagrl.observe.profiler import MERGED_TRACE, PROFILE_DIR, top_spans
from dagrl.observe.run_files import JsonlContents, read_jsonl

# config, world size -> (graph, node order, one plan per rank): dagrl.roles.plan.plan_for.
PlanFor = Callable[[Config, int], tuple[GraphSpec, list[str], list[RankPlan]]]

# Metrics named timing/*_s that are not a task of the plan (used when the plan is unknown).
STEP_TIMINGS = {"timing/step_s", "timing/weight_sync_s", "timing/validation_s"}
# Validation scores (val/<data_source>/score, pass@n, maj@n, ...), not its counts.
VALIDATION = re.compile(r"^val(idation)?[-_/]")
NOT_A_SCORE = re.compile(r"(samples|errors)$")


class ReportError(Exception):
    """The run directory lacks what the report needs."""


def load_metrics(run_dir: Path) -> JsonlContents:
    """The readable records of RUN_DIR/metrics.jsonl and the damaged lines skipped (a crash
    can cut the last line or leave NUL bytes: observe/run_files.py)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        raise ReportError(f"{run_dir}: no metrics.jsonl (is this a dagrl run directory?)")
    contents = read_jsonl(path)
    if not contents.records:
        raise ReportError(f"{path} holds no readable step"
                          + (f" ({contents.skipped_line(path)})" if contents.skipped else ""))
    return contents


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of `key`, skipping steps where it is missing or null."""
    pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
    return [p[0] for p in pts], [float(p[1]) for p in pts]


def _figure():
    try:
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ImportError("dagrl report draws its plots with matplotlib, which is not "
                          "installed: pip install 'dagrl[report]'") from err
    # The object API, not pyplot: no global backend or figure state in the caller's process.
    fig = Figure(figsize=(7.0, 3.2), dpi=100, layout="constrained")
    return fig, fig.add_subplot()


def _steps_axis(ax) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _lines(rows, keys: list[tuple[str, str]], ylabel: str, band: tuple[str, str] | None = None,
           log: bool = False):
    """A line per (key, label) present; an optional shaded min/max band around the first."""
    fig, ax = _figure()
    drawn = 0
    for key, label in keys:
        x, y = series(rows, key)
        if x:
            ax.plot(x, y, marker="." if len(x) < 30 else None, label=label)
            drawn += 1
    if band:
        xl, lo = series(rows, band[0])
        xh, hi = series(rows, band[1])
        if xl and xl == xh:
            ax.fill_between(xl, lo, hi, alpha=0.2, label="min..max")
    if not drawn:
        return None
    if log:
        ax.set_yscale("log")
    _steps_axis(ax)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    return fig


def node_time_keys(rows: list[dict], task_names: list[str] | None) -> list[str]:
    """timing/<task>_s of every task, in plan order when the plan is known."""
    present = {k for r in rows for k in r}
    if task_names:
        return [f"timing/{n}_s" for n in task_names if f"timing/{n}_s" in present]
    return sorted(k for k in present if k.startswith("timing/") and k.endswith("_s")
                  and not k.endswith("_spread_s") and k not in STEP_TIMINGS)


def _node_times(rows, task_names):
    keys = node_time_keys(rows, task_names)
    if not keys:
        return None
    # Validation and the weight sync take time outside the plan's tasks (a real model's
    # validation can be most of a run): bands of their own, the step-0 validation included.
    keys += [k for k in ("timing/weight_sync_s", "timing/validation_s")
             if any(r.get(k) for r in rows)]
    rows = [r for r in rows if "timing/step_s" in r or r.get("timing/validation_s")]
    fig, ax = _figure()
    steps = [r["step"] for r in rows]
    stacks = [[float(r.get(k) or 0.0) for r in rows] for k in keys]
    ax.stackplot(steps, stacks, labels=[k[len("timing/"):-2] for k in keys], alpha=0.85)
    x, y = series(rows, "timing/step_s")
    if x:
        ax.plot(x, y, color="black", linewidth=1, label="step (wall)")
    _steps_axis(ax)
    ax.set_ylabel("seconds (slowest rank)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig


def _all_zero(rows, keys: list[str]) -> bool:
    return all(not r.get(k) for r in rows for k in keys)


def _spread(rows, task_names):
    keys = [k[:-2] + "_spread_s" for k in node_time_keys(rows, task_names)]
    if keys and _all_zero(rows, keys):
        return "0 at every step (one rank: nothing to straggle behind)"
    return _lines(rows, [(k, k[len("timing/"):-len("_spread_s")]) for k in keys],
                  "max - min over ranks (s)")


def _throughput(rows, _):
    fig = _lines(rows, [("throughput/tokens_per_s", "tokens/s")], "tokens / s")
    if fig is None:
        return None
    ax = fig.axes[0]
    for key, label, scale in (("perf/mfu", "MFU (%)", 100.0),
                              ("perf/tflops_per_device", "TFLOP/s per device", 1.0)):
        x, y = series(rows, key)
        if x:       # MFU where the device's peak is known, else the achieved FLOP rate
            twin = ax.twinx()
            twin.plot(x, [v * scale for v in y], color="tab:red", linestyle="--", label=label)
            twin.set_ylabel(label, color="tab:red")
            break
    return fig


def _memory(rows, task_names):
    present = {k for r in rows for k in r}
    per_node = "device" if any(k.endswith("_device_gb") for k in present) else "host"
    names = task_names or sorted({k[len("memory/"):-len(f"_{per_node}_gb")] for k in present
                                  if k.endswith(f"_{per_node}_gb")})
    keys = [("memory/host_peak_gb", "host peak (process)"),
            ("memory/device_peak_gb", "device peak"),
            ("memory/estimated_peak_gb", "estimated peak (dagrl plan --memory)")]
    after = "host, after" if per_node == "host" else "device peak"
    keys += [(f"memory/{n}_{per_node}_gb", f"{n} ({after})") for n in names]
    fig = _lines(rows, keys, "GiB (max over ranks)")
    if fig is not None:   # many lines: the legend beside the axes, not over the curves
        fig.axes[0].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig


# reward/<name> metrics that are not a scorer's own component (the distribution and counts).
REWARD_SUMMARY = {"reward/mean", "reward/max", "reward/min", "reward/std", "reward/errors"}


def reward_component_keys(rows: list[dict]) -> list[str]:
    """reward/<name> metrics besides the reward's distribution: what a scorer returning a dict
    adds (e.g. reward/acc, reward/format) and the overlong penalty."""
    return sorted({k for r in rows for k in r
                   if k.startswith("reward/") and k not in REWARD_SUMMARY})


def _reward_components(rows, _):
    keys = reward_component_keys(rows)
    zero = [k for k in keys if _all_zero(rows, [k])]
    drawn = [k for k in keys if k not in zero]
    if not drawn:
        return (f"{', '.join(k[len('reward/'):] for k in zero)}: 0 at every step"
                if zero else None)
    fig = _lines(rows, [(k, k[len("reward/"):]) for k in drawn], "mean")
    if zero:   # named, not drawn as a line along the axis
        fig.axes[0].set_title(f"0 at every step: {', '.join(k[len('reward/'):] for k in zero)}",
                              fontsize=8)
    return fig


def _validation(rows, _):
    keys = sorted({k for r in rows for k in r if VALIDATION.match(k) and not NOT_A_SCORE.search(k)})
    return _lines(rows, [(k, k) for k in keys], "score") if keys else None


# (section id, title, what it shows, draw(rows, task_names) -> Figure | None)
PLOTS: list[tuple[str, str, str, Callable]] = [
    ("reward", "Reward", "mean reward of the step's samples, shaded from min to max",
     lambda r, _: _lines(r, [("reward/mean", "mean")], "reward", ("reward/min", "reward/max"))),
    ("reward_components", "Reward components", "the extra keys a scorer returns in its dict, "
     "and penalties (mean over the step's samples)", _reward_components),
    ("kl", "KL to the reference", "actor KL (loss term) and the reward penalty's KL",
     lambda r, _: _lines(r, [("actor/kl", "actor/kl"), ("actor/reward_kl", "reward KL")], "KL")),
    ("entropy", "Entropy", "mean token entropy of the policy during the update",
     lambda r, _: _lines(r, [("actor/entropy", "entropy")], "nats")),
    ("response_length", "Response length", "tokens per response, shaded from min to max",
     lambda r, _: _lines(r, [("response/length/mean", "mean")], "tokens",
                         ("response/length/min", "response/length/max"))),
    ("validation", "Validation score", "validation metrics (when the run validated)",
     _validation),
    ("node_time", "Time per node", "each task's time on the slowest rank, stacked; the line is "
     "the step's wall time", _node_times),
    ("straggler", "Straggler spread", "per task: slowest minus fastest rank", _spread),
    ("throughput", "Throughput", "prompt + response tokens per second of step time; dashed: "
     "MFU where the device's peak is known, else achieved model TFLOP/s per device",
     _throughput),
    ("memory", "Memory", "process peaks, the estimate made before the run (dagrl plan "
     "--memory), and per node its device peak (on the CPU: host RSS after the node)",
     _memory),
]


def _plan(run_dir: Path, plan_for: PlanFor | None):
    """(svg, task names) of the run's graph and plan, or (error message, None)."""
    if plan_for is None:
        return "(the DAG could not be drawn: no planner was given; `dagrl report` gives one)", None
    try:
        cfg = load_config(Config, run_dir / "config.resolved.yaml", [])
        graph, order, plans = plan_for(cfg, cfg.trainer.n_workers)
    except Exception as err:   # the report still has its plots without a picture of the DAG
        return f"(the DAG could not be drawn: {escape(str(err))})", None
    names: list[str] = []
    for plan in plans:
        names += [task_name(t) for t in plan.tasks if task_name(t) not in names]
    return to_svg(graph, order, plans), names


def _trace_tables(run_dir: Path) -> str:
    path = run_dir / PROFILE_DIR / MERGED_TRACE
    if not path.exists():
        return ("<p>No profiler trace in this run (run with <code>profiler.enable=true</code>)."
                "</p>")
    try:
        trace = json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError) as err:   # a run killed while writing it
        return f"<p class='warning'>{escape(MERGED_TRACE)} is damaged ({escape(str(err))})</p>"
    tasks: dict[str, list[float]] = {}
    ranks = set()
    for e in trace["traceEvents"]:
        if e.get("ph") == "X" and e.get("cat") == "user_annotation" and \
                e.get("name", "").split(":", 1)[0] in ("node", "reshard", "balance"):
            tasks.setdefault(e["name"], []).append(float(e["dur"]) / 1000)
            ranks.add(e["pid"])
    spans = sorted(tasks.items(), key=lambda kv: -sum(kv[1]))
    rows = "".join(f"<tr><td>{escape(n)}</td><td>{len(d)}</td><td>{sum(d) / len(d):.2f}</td>"
                   f"<td>{max(d):.2f}</td><td>{max(d) - min(d):.2f}</td></tr>" for n, d in spans)
    top = top_spans(trace, limit=20, skip_categories={"user_annotation", "Trace"})
    op_rows = "".join(f"<tr><td>{escape(r['name'][:90])}</td><td>{escape(r['cat'])}</td>"
                      f"<td>{r['count']}</td><td>{r['total_ms']:.2f}</td></tr>" for r in top)
    return (f"<p>From <code>{escape(str(path.relative_to(run_dir)))}</code> "
            f"({len(ranks)} rank(s)). Open it in <a href='https://ui.perfetto.dev'>Perfetto</a>"
            f" or chrome://tracing.</p>"
            "<h3>DAG tasks</h3><table><tr><th>span</th><th>recorded</th><th>mean ms</th>"
            f"<th>max ms</th><th>max - min ms</th></tr>{rows}</table>"
            "<h3>Top time consumers (operators, kernels, collectives; inclusive time summed over "
            "ranks)</h3><table><tr><th>name</th><th>category</th><th>count</th>"
            f"<th>total ms</th></tr>{op_rows}</table>")


def _val_samples(run_dir: Path, shown: int = 12) -> str:
    """The last validation's kept samples (logging.val_generations): each answer beside its
    prompt's images, the ground truth and the score."""
    from dagrl.observe.loggers import GENERATIONS_FILE

    path = run_dir / GENERATIONS_FILE
    records = read_jsonl(path).records if path.exists() else []
    if not records:
        return "<p class='missing'>none kept (logging.val_generations=0 or no validation)</p>"
    last = max(r.get("step", 0) for r in records)
    rows = []
    for r in [r for r in records if r.get("step", 0) == last][:shown]:
        pictures = "".join(f"<img class='thumb' alt='image' src='data:image/png;base64,"
                           f"{escape(b64)}'>" for b64 in r.get("images", []))
        rows.append(f"<tr><td>{pictures}</td><td><pre>{escape(str(r.get('prompt', ''))[-300:])}"
                    f"</pre></td><td><pre>{escape(str(r.get('response', '')))}</pre></td>"
                    f"<td>{escape(str(r.get('ground_truth', '')))}</td>"
                    f"<td>{escape(str(r.get('score', '')))}</td></tr>")
    return (f"<p>step {last}, the first {len(rows)} samples kept</p><table class='samples'>"
            "<tr><th>image</th><th>prompt (end)</th><th>response</th><th>ground truth</th>"
            f"<th>score</th></tr>{''.join(rows)}</table>")


def _shown_config(text: str) -> str:
    """The resolved config without model.tiny_*: they size the built-in tiny model, already
    written and named by model.path in a resolved config (noise beside a real model)."""
    return "\n".join(line for line in text.splitlines()
                     if not line.startswith("  tiny_")) + "\n"


def _summary(rows: list[dict]) -> str:
    last = rows[-1]
    items = [("steps logged", str(len(rows)))]
    validation = sum(float(r.get("timing/validation_s") or 0.0) for r in rows)
    if validation:
        total = validation + sum(float(r.get("timing/step_s") or 0.0) for r in rows)
        items.append(("time validating", f"{validation:.0f} s ({validation / total:.0%} of "
                                         "the steps + validation)"))
    for key, label in (("reward/mean", "final reward"), ("timing/step_s", "last step (s)"),
                       ("throughput/tokens_per_s", "last tokens/s"), ("perf/mfu", "last MFU")):
        value = last.get(key)
        if isinstance(value, (int, float)) and math.isfinite(value):
            items.append((label, f"{value:.4g}"))
    return "<ul class='summary'>" + "".join(
        f"<li><b>{escape(k)}</b> {escape(v)}</li>" for k, v in items) + "</ul>"


CSS = """body{font-family:Helvetica,Arial,sans-serif;margin:24px;max-width:1200px;color:#222}
h1{margin-bottom:4px} .meta{color:#666} section{margin:18px 0}
.plots{display:grid;grid-template-columns:repeat(auto-fill,minmax(560px,1fr));gap:12px}
.plot{border:1px solid #ddd;padding:8px;border-radius:6px} .plot p{color:#666;margin:2px 0 6px}
.samples pre{white-space:pre-wrap;margin:0;max-width:420px} .thumb{width:96px;margin:2px}
.plot img{width:100%} table{border-collapse:collapse;font-size:13px}
td,th{border:1px solid #ccc;padding:3px 8px;text-align:left} pre{background:#f6f6f6;padding:8px;
overflow:auto;font-size:12px} .summary li{display:inline-block;margin-right:18px}
.dag{overflow:auto;border:1px solid #ddd;border-radius:6px} .warning{color:#a40}"""


def shown_path(path: Path) -> str:
    """How the report names a path: relative to the working directory when below it, else just
    its name. A report is shared; the writer's absolute paths (home, user name) stay out of it."""
    resolved = path.resolve()
    try:
        return str(resolved.relative_to(Path.cwd().resolve()))
    except ValueError:
        return resolved.name


def render_report(run_dir: str | Path, plan_for: PlanFor | None = None,
                  metrics: JsonlContents | None = None) -> str:
    """The report's HTML. `plan_for(config, world_size) -> (graph, order, plans)` (the one in
    `dagrl.roles.plan`) draws the run's DAG and per-rank plan."""
    run_dir = Path(run_dir)
    metrics = metrics if metrics is not None else load_metrics(run_dir)
    rows = metrics.records
    skipped = metrics.skipped_line(Path("metrics.jsonl"))   # no path of the writer's machine
    dag_svg, task_names = _plan(run_dir, plan_for)
    plots = []
    for pid, title, caption, draw in PLOTS:
        fig = draw(rows, task_names)
        if fig is None or isinstance(fig, str):
            body = f"<p class='missing'>{escape(fig or 'not recorded in this run')}</p>"
        else:
            body = f"<img alt='{escape(title)}' src='data:image/png;base64,{_png(fig)}'>"
        plots.append(f"<div class='plot' id='plot-{pid}'><h3>{escape(title)}</h3>"
                     f"<p>{escape(caption)}</p>{body}</div>")
    config = run_dir / "config.resolved.yaml"
    config_text = (_shown_config(config.read_text(errors="replace")) if config.exists()
                   else "(no config.resolved.yaml)")
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>dagrl report: "
            f"{escape(run_dir.name)}</title><style>{CSS}</style></head><body>"
            f"<h1>dagrl run {escape(run_dir.name)}</h1>"
            f"<p class='meta'>{escape(shown_path(run_dir))} — report written "
            f"{datetime.now():%Y-%m-%d %H:%M}</p>"
            + (f"<p class='warning'>{escape(skipped)}</p>" if skipped else "")
            + f"{_summary(rows)}"
            f"<section id='plots'><h2>Metrics</h2><div class='plots'>{''.join(plots)}</div>"
            f"</section><section id='dag'><h2>DAG and per-rank plan</h2><div class='dag'>"
            f"{dag_svg}</div></section>"
            f"<section id='samples'><h2>Validation samples</h2>{_val_samples(run_dir)}"
            f"</section>"
            f"<section id='trace'><h2>Profiler trace</h2>{_trace_tables(run_dir)}</section>"
            f"<section id='config'><h2>Resolved config</h2><pre>{escape(config_text)}</pre>"
            f"</section></body></html>\n")


def write_report(run_dir: str | Path, out: str | Path | None = None,
                 plan_for: PlanFor | None = None) -> tuple[Path, str]:
    """Write the report (default RUN_DIR/report.html); returns its path and the line naming
    the damaged metrics lines it skipped ("" when none)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ReportError(f"no such run directory: {run_dir}")
    path = Path(out) if out else run_dir / "report.html"
    metrics = load_metrics(run_dir)
    path.write_text(render_report(run_dir, plan_for, metrics), encoding="utf-8")
    return path, metrics.skipped_line(run_dir / "metrics.jsonl")
