"""The `dagrl` command.

    dagrl train [CONFIG] [key=value ...] [--print-config]
    dagrl plan  [CONFIG] [key=value ...]        # the graph and each rank's task list
    dagrl plan  --format dot|svg [--out FILE]   # ... drawn (Graphviz DOT, or SVG)
    dagrl plan  --memory [CONFIG] [key=value]   # ... and each rank's memory, estimated
    dagrl report RUN_DIR                        # RUN_DIR/report.html: plots, DAG, config, trace
    dagrl data make NAME --out DIR [key=value]  # a built-in task as verl-layout parquet
    dagrl export CHECKPOINT|RUN_DIR --out DIR   # a checkpoint's actor as a HF model directory
    dagrl bench dataplane [--workers 2,4,8] ... # our reshard vs a single-controller emulation
    dagrl bench learning [--algorithms all]     # reward early vs late for every algorithm
    dagrl bench rollout                         # our native rollout vs transformers generate
    dagrl bench e2e                             # our GRPO step loop vs TRL's GRPOTrainer
    dagrl bench memory                          # peak RSS of each memory setting, one run
    dagrl bench async                           # sync vs async training on the same 2 workers
    dagrl bench scale [--calibrate] [--quick]   # weak-scaling model, dagrl vs single controller
    dagrl bench vlm [--task count]              # GRPO on pictures beside the blank control
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

USAGE = __doc__


def plan_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="dagrl plan",
                                     description="Show the DAG and every rank's task list "
                                                 "without loading any model.")
    parser.add_argument("--format", choices=("text", "dot", "svg"), default="text",
                        help="text (default), Graphviz DOT, or an SVG picture (no Graphviz needed)")
    parser.add_argument("--out", help="write to this file instead of standard output")
    parser.add_argument("--memory", action="store_true",
                        help="also estimate each rank's memory from the model's config (reads "
                             "config.json or the GGUF header, no weights)")
    parser.add_argument("args", nargs="*", help="[CONFIG.yaml] [key=value ...]")
    ns = parser.parse_args(argv)
    from dagrl.config.loader import ConfigError
    from dagrl.dag.draw import to_dot, to_svg
    from dagrl.dag.planner import format_plan
    from dagrl.dag.spec import GraphError
    from dagrl.registry import UnknownNameError
    from dagrl.roles.plan import plan_with_sides
    from dagrl.runtime.preflight import check_model_parallel
    from dagrl.train import load_cli_config

    try:
        cfg = load_cli_config(ns.args)
        check_model_parallel(cfg)
        graph, order, plans, sides = plan_with_sides(cfg, cfg.trainer.n_workers)
    except (ConfigError, GraphError, UnknownNameError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    render = {"text": lambda *a: format_plan(*a) + "\n", "dot": to_dot, "svg": to_svg}[ns.format]
    text = render(graph, order, plans)
    if ns.format == "text":
        from dagrl.algorithms.catalog import describe_algorithm
        text = "\n".join(describe_algorithm(cfg.algorithm)) + "\n" + text
        if sides is not None:   # trainer.mode=async: what the reshard between the sides is
            text += (f"async: ranks {','.join(map(str, sides.rollout_ranks))} loop over "
                     f"{', '.join(sides.rollout_nodes)} and push scored groups into the async "
                     f"buffer; ranks {','.join(map(str, sides.trainer_ranks))} pull batches at "
                     f"most rollout.max_staleness={cfg.rollout.max_staleness} versions old and "
                     "send new weights back after each update\n")
    if ns.memory:
        text += "\n" + _memory_estimate(cfg, plans, sides) + "\n"
    if ns.out:
        with open(ns.out, "w", encoding="utf-8") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


def _memory_estimate(cfg, plans, sides=None) -> str:
    from dagrl.engines.checkpointing_choice import choose_here
    from dagrl.engines.memory_estimate import (
        estimate_memory,
        format_estimate,
        model_shape,
        other_model_lines,
        other_model_shapes,
    )
    from dagrl.observe.memory import host_rss_bytes
    from dagrl.roles.plan import engines_of

    has_ref = any("ref" in engines_of(p) for p in plans)
    has_critic = any("critic" in engines_of(p) for p in plans)
    shape, runtime, choice = model_shape(cfg), host_rss_bytes(), ""
    if cfg.actor.activation_checkpointing == "auto":
        cfg, choice = choose_here(cfg, shape, runtime, has_ref=has_ref, has_critic=has_critic)
        choice = f"\n{choice} (on this machine now; the run decides when it starts)"
    lines = estimate_memory(cfg, shape, has_ref=has_ref, has_critic=has_critic,
                            **_side_layouts(cfg, plans, sides))
    with_ref = {name for name in cfg.models if any("ref" in engines_of(p, name) for p in plans)}
    lines += other_model_lines(cfg, other_model_shapes(cfg), with_ref)
    return "memory per rank:\n" + format_estimate(lines, runtime_bytes=runtime) + choice


def _side_layouts(cfg, plans, sides) -> dict:
    """trainer.mode=async: the engine layouts of the trainer side (the trained models), the
    rollout side (its copy and KV cache) and the side whose plan runs the reference."""
    if sides is None:
        return {}
    from dagrl.engines.layout import EngineLayout
    from dagrl.roles.plan import engines_of

    n = cfg.trainer.n_workers
    trainer = EngineLayout.of(cfg, n, side_ranks=sides.trainer_ranks, side="trainer")
    rollout = EngineLayout.of(cfg, n, side_ranks=sides.rollout_ranks, side="rollout")
    ref_on_rollout = any("ref" in engines_of(plans[r]) for r in sides.rollout_ranks)
    return {"layout": trainer, "rollout_layout": rollout,
            "ref_layout": rollout if ref_on_rollout else trainer}


def report_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="dagrl report",
                                     description="Write RUN_DIR/report.html: metric plots, the "
                                                 "DAG, the resolved config and the top time "
                                                 "consumers of the profiler trace.")
    parser.add_argument("run_dir", help="a run directory (holds metrics.jsonl)")
    parser.add_argument("--out", help="default: RUN_DIR/report.html")
    ns = parser.parse_args(argv)
    from dagrl.observe.report import ReportError, write_report
    from dagrl.roles.plan import plan_for

    try:
        path, skipped = write_report(ns.run_dir, ns.out, plan_for)
    except (ReportError, ImportError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if skipped:
        print(f"warning: {skipped}", file=sys.stderr)
    print(path)
    return 0


def maker_options(maker, pairs: Sequence[str]) -> dict:
    """`["steps=1", "n_train=512"]` -> keyword arguments of `maker`, each converted to the type
    of the maker's default for it; an unknown key or a bad value names the key."""
    import inspect

    defaults = {name: p.default for name, p in inspect.signature(maker).parameters.items()
                if p.kind is inspect.Parameter.KEYWORD_ONLY and name != "seed"}
    options = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or key not in defaults:
            raise ValueError(f"{pair!r}: give options as key=value with key one of "
                             f"{', '.join(defaults)}")
        kind = type(defaults[key])
        if kind is bool:   # bool("false") is True
            if text.lower() not in ("true", "false"):
                raise ValueError(f"{key}={text!r} is not true or false")
            options[key] = text.lower() == "true"
            continue
        try:
            options[key] = kind(text)
        except ValueError as err:
            raise ValueError(f"{key}={text!r} is not {kind.__name__}") from err
    return options


def data_main(argv: Sequence[str]) -> int:
    from dagrl.data.makers import MAKERS

    parser = argparse.ArgumentParser(prog="dagrl data")
    sub = parser.add_subparsers(dest="action", required=True)
    make = sub.add_parser("make", help="write a built-in dataset as train/test parquet",
                          epilog="e.g. dagrl data make gsm8k-synth --out data/gsm8k-1step "
                                 "steps=1 instruction=' Answer with the number only.'")
    make.add_argument("name", choices=sorted(MAKERS))
    make.add_argument("--out", required=True, help="output directory")
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("options", nargs="*", metavar="key=value",
                      help="the maker's options (gsm8k-synth: n_train, n_test, max_number, "
                           "steps, instruction, ...)")
    # key=value pairs may come after --out, where argparse no longer takes positionals
    ns, rest = parser.parse_known_args(argv)
    try:
        paths = MAKERS[ns.name](ns.out, seed=ns.seed, **maker_options(MAKERS[ns.name],
                                                                      ns.options + rest))
    except ValueError as err:
        print(f"error: dagrl data make {ns.name}: {err}", file=sys.stderr)
        return 2
    for split, path in paths.items():
        print(f"{split}: {path}")
    return 0


BENCHMARKS = ("dataplane", "learning", "rollout", "e2e", "memory", "async", "scale", "vlm")


def bench_main(argv: Sequence[str]) -> int:
    """Run `benchmarks.<name>` (benchmarks/ of the source checkout: a package that
    `pip install -e .` makes importable; the benchmarks need TRL, a second venv or a real
    model, and are run from a clone)."""
    if not argv or argv[0] not in BENCHMARKS:
        print(f"usage: dagrl bench {{{','.join(BENCHMARKS)}}} [options]", file=sys.stderr)
        return 2
    import importlib

    name = f"benchmarks.{argv[0]}"
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name not in ("benchmarks", name):
            raise   # a dependency of the benchmark itself: its own message says which
        print(f"error: dagrl bench: {name} is not importable; the benchmarks come with a source "
              "checkout: clone the repository and install it with pip install -e .",
              file=sys.stderr)
        return 2
    return module.main(argv[1:]) or 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "train":
        from dagrl.train import main as train_main

        return train_main(rest)
    if command == "plan":
        return plan_main(rest)
    if command == "report":
        return report_main(rest)
    if command == "data":
        return data_main(rest)
    if command == "bench":
        return bench_main(rest)
    if command == "export":
        from dagrl.export import main as export_main

        return export_main(rest)
    print(f"unknown command {command!r}\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
