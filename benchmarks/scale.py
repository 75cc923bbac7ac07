"""`dagrl bench scale`: a calibrated weak-scaling model of one GRPO step, 1 to 1024 devices,
for dagrl's multi-controller data path beside a single controller (the verl pattern).

    dagrl bench scale                        # model from benchmarks/scale_calibration.json
    dagrl bench scale --calibrate            # measure this machine first (~7-15 min)
    dagrl bench scale --quick                # fewer devices and replicates (the test's mode)
    dagrl bench scale --workload params=70e9,layers=80,hidden=8192 --hw link_efficiency=0.6
    dagrl bench scale --plot docs/scaling.svg --json runs/scale.json
    python -m benchmarks.scale [same options]

What it prints: the calibration (device efficiencies, host rates, gloo alpha-beta, the
driver's costs), the model against the measured 1/2/4-worker runs on this machine
(`calibration error: N%`, the largest of the three), then per hardware preset one row per
device count: `<P>  <dagrl %>  <single-controller %>`, the step times, the driver's memory and
the bottleneck of each design (the critical-path category that grew most since 1 device), and a
sensitivity table at the largest P. The model and every assumption: docs/scaling.md.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import asdict, replace
from html import escape
from pathlib import Path

from benchmarks import scale_fit
from benchmarks.scale_model import Model, Options, Workload, WorkloadError
from benchmarks.scale_presets import PRESETS, PresetError, with_overrides

CALIBRATION = Path(__file__).with_name("scale_calibration.json")
DEVICES = [2 ** k for k in range(11)]            # 1 ... 1024
QUICK_DEVICES = [1, 8, 64, 1024]
GIB = float(1 << 30)


def _pairs(text: str) -> dict[str, float]:
    out = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"expected key=value, got {item!r}")
        out[key.strip()] = value.strip()
    return out


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="dagrl bench scale", description=__doc__.split("\n")[0])
    p.add_argument("--calibration", type=Path, default=CALIBRATION,
                   help=f"calibration file to read (and write with --calibrate); default "
                        f"{CALIBRATION.name} beside this script")
    p.add_argument("--calibrate", action="store_true",
                   help="measure this machine first and write the calibration file")
    p.add_argument("--rounds", type=int, default=3, help="--calibrate: rounds of measured runs")
    p.add_argument("--preset", choices=[*PRESETS, "all"], default="all")
    p.add_argument("--devices", type=lambda s: [int(x) for x in s.split(",")], default=None,
                   help="device counts (default 1,2,4,...,1024)")
    p.add_argument("--workload", type=_pairs, default={},
                   help="Workload fields, key=value,... (benchmarks/scale_model.py)")
    p.add_argument("--hw", type=_pairs, default={}, help="preset fields to override, key=value")
    p.add_argument("--no-overlap", action="store_true",
                   help="FSDP2 communication not hidden behind compute")
    p.add_argument("--replicates", type=int, default=8,
                   help="simulated steps per point (response lengths redrawn), mean reported")
    p.add_argument("--quick", action="store_true",
                   help=f"devices {QUICK_DEVICES}, 2 replicates, no sensitivity table")
    p.add_argument("--plot", type=Path, help="write the efficiency curves as SVG")
    p.add_argument("--json", type=Path, help="also write every figure as JSON")
    return p.parse_args(argv)


def _workload(overrides: dict[str, str]) -> Workload:
    base = Workload()
    unknown = sorted(set(overrides) - set(asdict(base)))
    if unknown:
        raise WorkloadError(f"--workload: unknown key(s) {unknown}; known: {sorted(asdict(base))}")
    typed = {}
    for key, value in overrides.items():
        kind = type(getattr(base, key))
        typed[key] = (value.lower() in ("1", "true", "yes")) if kind is bool else kind(
            float(value)) if kind is int else kind(value)
    return replace(base, **typed)


def _bottleneck(result, base) -> str:
    """The critical-path category that grew most since 1 device, and by how much."""
    growth = {k: v - base.breakdown.get(k, 0.0) for k, v in result.breakdown.items()}
    if not growth:
        return "-"
    key = max(growth, key=growth.get)
    if growth[key] <= 0.005 * base.seconds:
        return "none"
    return f"{key} +{growth[key]:.2f}s"


def scaling_rows(model: Model, devices: list[int]) -> list[dict]:
    rows, base = [], {}
    for design in ("dagrl", "single"):
        base[design] = model.run(design, 1)
    for p in devices:
        r = {"devices": p}
        for design in ("dagrl", "single"):
            res = base[design] if p == 1 else model.run(design, p)
            r[design] = {"seconds": res.seconds, "efficiency": base[design].seconds / res.seconds,
                         "bottleneck": _bottleneck(res, base[design]),
                         "breakdown": res.breakdown}
            if design == "single":
                r[design]["driver_peak_gib"] = res.driver_peak_bytes / GIB
        rows.append(r)
    return rows


def print_rows(rows: list[dict]) -> None:
    print(f"{'P':>5}  {'dagrl %':>7}  {'single-controller %':>19}  {'dagrl s':>8}  "
          f"{'single s':>8}  {'driver GiB':>10}  bottleneck: dagrl | single")
    for r in rows:
        d, s = r["dagrl"], r["single"]
        print(f"{r['devices']:>5}  {100 * d['efficiency']:>7.1f}  {100 * s['efficiency']:>19.1f}  "
              f"{d['seconds']:>8.2f}  {s['seconds']:>8.2f}  {s['driver_peak_gib']:>10.2f}  "
              f"{d['bottleneck']} | {s['bottleneck']}")


def sensitivity(w: Workload, hw, costs, driver, reps: int, p: int) -> list[dict]:
    """dagrl and single at `p` devices with one assumption changed at a time."""
    o = Options(replicates=reps)
    cases = [
        ("as documented", w, hw, costs, o),
        ("FSDP over all devices", replace(w, fsdp_shard_size=0), hw, costs, o),
        ("no FSDP overlap", w, hw, costs, Options(overlap=False, replicates=reps)),
        ("latencies x10", w, replace(hw, alpha_intra=10 * hw.alpha_intra,
                                     alpha_inter=10 * hw.alpha_inter), costs, o),
        ("link efficiency 0.5", w, replace(hw, link_efficiency=0.5), costs, o),
        ("decode bound by FLOPs only", w, replace(hw, mem_bw=0.0), costs, o),
        ("device efficiencies x2", w, hw, replace(
            costs, eta_update=min(1, 2 * costs.eta_update),
            eta_forward=min(1, 2 * costs.eta_forward), eta_decode=min(1, 2 * costs.eta_decode)),
         o),
        ("single: reward on workers", w, hw, costs, Options(driver_reward=False, replicates=reps)),
        ("dagrl: balance before ref", w, hw, costs,
         Options(balance_before_forward=True, replicates=reps)),
    ]
    out = []
    for name, wl, h, c, opt in cases:
        model = Model(wl, h, c, driver, opt)
        row = {"case": name}
        for design in ("dagrl", "single"):
            row[design] = model.run(design, 1).seconds / model.run(design, p).seconds
        out.append(row)
    return out


# --- the plot: SVG written directly (no plotting library needed); efficiency against devices on
# a log2 axis, one line per (preset, design).
WIDTH, HEIGHT = 720, 420
LEFT, RIGHT, TOP, BOTTOM = 70, 210, 40, 60
COLORS = {"dagrl": "#1f77b4", "single": "#d62728"}
DASHES = ["", "6,4", "2,3", "8,3,2,3"]


def efficiency_svg(series: list[dict], title: str, y_min: float = 0.0) -> str:
    """series: {"label", "design" ("dagrl" | "single"), "style" (index), "points":
    [(devices, efficiency %)]} -> an SVG document."""
    xs = [p for s in series for p, _ in s["points"]]
    x_lo, x_hi = math.log2(min(xs)), math.log2(max(xs))
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def px(devices: float) -> float:
        return LEFT + (math.log2(devices) - x_lo) / max(x_hi - x_lo, 1e-9) * plot_w

    def py(eff: float) -> float:
        return TOP + (100.0 - eff) / (100.0 - y_min) * plot_h

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
           f'font-family="sans-serif" font-size="12">',
           f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
           f'<text x="{LEFT}" y="22" font-size="14">{escape(title)}</text>']
    for eff in range(int(y_min), 101, 10):
        y = py(eff)
        out.append(f'<line x1="{LEFT}" y1="{y:.1f}" x2="{LEFT + plot_w}" y2="{y:.1f}" '
                   f'stroke="#ddd"/><text x="{LEFT - 8}" y="{y + 4:.1f}" '
                   f'text-anchor="end">{eff}%</text>')
    for k in range(int(x_lo), int(x_hi) + 1):
        x = px(2 ** k)
        out.append(f'<line x1="{x:.1f}" y1="{TOP}" x2="{x:.1f}" y2="{TOP + plot_h}" '
                   f'stroke="#eee"/><text x="{x:.1f}" y="{TOP + plot_h + 18}" '
                   f'text-anchor="middle">{2 ** k}</text>')
    out.append(f'<text x="{LEFT + plot_w / 2}" y="{HEIGHT - 18}" text-anchor="middle">devices '
               f'(weak scaling: fixed work per device)</text>')
    out.append(f'<text x="16" y="{TOP + plot_h / 2}" transform="rotate(-90 16 '
               f'{TOP + plot_h / 2})" text-anchor="middle">weak-scaling efficiency</text>')
    for i, s in enumerate(series):
        color, dash = COLORS.get(s["design"], "black"), DASHES[s.get("style", 0) % len(DASHES)]
        pts = " ".join(f"{px(p):.1f},{py(max(e, y_min)):.1f}" for p, e in s["points"])
        out.append(f'<polyline points="{pts}" fill="none" stroke="{color}" stroke-width="2" '
                   f'stroke-dasharray="{dash}"/>')
        for p, e in s["points"]:
            out.append(f'<circle cx="{px(p):.1f}" cy="{py(max(e, y_min)):.1f}" r="2.5" '
                       f'fill="{color}"/>')
        ly = TOP + 14 + 20 * i
        lx = LEFT + plot_w + 12
        out.append(f'<line x1="{lx}" y1="{ly - 4}" x2="{lx + 28}" y2="{ly - 4}" stroke="{color}" '
                   f'stroke-width="2" stroke-dasharray="{dash}"/><text x="{lx + 34}" '
                   f'y="{ly}">{escape(s["label"])}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return _main(args)
    except (WorkloadError, PresetError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def _main(args: argparse.Namespace) -> int:
    if args.calibrate:
        from benchmarks.scale_calibrate import calibrate

        calibrate(args.calibration, rounds=args.rounds)
    if not args.calibration.is_file():
        print(f"error: no calibration file {args.calibration}; run dagrl bench scale "
              f"--calibrate first", file=sys.stderr)
        return 2
    cal = json.loads(args.calibration.read_text())
    workload = _workload(args.workload)
    reps = 2 if args.quick else args.replicates
    devices = args.devices or (QUICK_DEVICES if args.quick else DEVICES)
    costs, driver, local = scale_fit.fit_costs(cal), scale_fit.fit_driver(cal), scale_fit.local(cal)
    m = cal["machine"]
    print(f"calibration: {args.calibration.name}, measured {m['date']} on {m['cpus']} CPU cores "
          f"(load average {m['load_start'][0]:.1f} at start, {m['load_end'][0]:.1f} at end)")
    print("\n".join(scale_fit.describe_costs(costs, local)))
    col = cal["collectives"]
    print(f"  gloo (loopback): alpha {col['alpha_s'] * 1e6:.0f} us, beta "
          f"{1 / col['seconds_per_byte'] / 1e9:.2f} GB/s (median fit error "
          f"{col['fit_error_median']:.0%})")
    print(f"  driver (Ray): get {driver.get_s_per_object * 1e3:.2f} ms/object + "
          f"{1 / max(driver.get_s_per_byte, 1e-15) / 1e9:.2f} GB/s, put "
          f"{driver.put_s_per_object * 1e3:.2f} ms/object + "
          f"{1 / max(driver.put_s_per_byte, 1e-15) / 1e9:.2f} GB/s, copy "
          f"{1 / max(driver.copy_s_per_byte, 1e-15) / 1e9:.2f} GB/s; peak RSS "
          f"{driver.mem_base_bytes / 2 ** 20:.0f} MiB + {driver.mem_per_batch_byte:.2f} x batch")

    check = scale_fit.calibration_check(cal, replicates=8 if args.quick else 32)
    print("model vs measured on this machine (dagrl, weak scaling, 8 prompts x 4 samples per "
          "worker):")
    for r in check:
        rounds = "; ".join(f"{x['measured_s']:.3f} vs {x['model_s']:.3f} on {x['cores']:.2f} "
                           f"cores" for x in r["rounds"])
        print(f"  {r['workers']} worker(s): measured {r['measured_s']:.3f} s/step, model "
              f"{r['model_s']:.3f} s/step, error {r['error']:.1%}  (rounds: {rounds})")
        print("    phases, measured/model s: " + ", ".join(
            f"{k} {m:.3f}/{p:.3f}" for k, (m, p) in sorted(r["phases"].items())))
    error = max(r["error"] for r in check)
    print(f"calibration error: {100 * error:.0f}%")

    out = {"calibration_check": check, "calibration_error": error, "presets": {},
           "costs": asdict(costs), "driver": asdict(driver), "workload": asdict(workload)}
    presets = list(PRESETS) if args.preset == "all" else [args.preset]
    series = []
    for i, name in enumerate(presets):
        hw = with_overrides(PRESETS[name], args.hw)
        model = Model(workload, hw, costs, driver,
                      Options(overlap=not args.no_overlap, replicates=reps,
                              min_device_steps=64 if args.quick else 2048))
        print(f"\npreset {name}: {hw.source}")
        print(f"workload: {workload.params:.3g} parameters, {workload.samples} samples/device "
              f"({workload.prompts_per_device} prompts x {workload.samples_per_prompt}), prompt "
              f"{workload.prompt_len}, responses {workload.length_dist} median "
              f"{workload.length_median:g} cut at {workload.max_response}, FSDP2 "
              + (f"sharded over {workload.fsdp_shard_size} devices (HSDP)"
                 if workload.fsdp_shard_size else "over all devices"))
        rows = scaling_rows(model, devices)
        print_rows(rows)
        out["presets"][name] = {"hardware": hw.to_dict(), "rows": rows}
        for design, label in (("dagrl", "dagrl"), ("single", "single controller")):
            series.append({"label": f"{label}, {name}", "design": design, "style": i,
                           "points": [(r["devices"], 100 * r[design]["efficiency"])
                                      for r in rows]})
        if not args.quick:
            top = max(devices)
            sens = sensitivity(workload, hw, costs, driver, reps, top)
            out["presets"][name]["sensitivity"] = sens
            print(f"sensitivity at {top} devices ({name}): efficiency dagrl | single")
            for s in sens:
                print(f"  {s['case']:<28} {100 * s['dagrl']:6.1f}% | {100 * s['single']:6.1f}%")
    if args.plot:
        low = min(p for s in series for _, p in s["points"])
        args.plot.write_text(efficiency_svg(
            series, "GRPO step, weak scaling: dagrl vs a single controller (model)",
            y_min=max(0.0, 10 * (low // 10) - 10)))
        print(f"plot: {args.plot}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1, default=float))
    return 0


if __name__ == "__main__":
    from benchmarks.scale import main as _main_entry

    sys.exit(_main_entry())
