"""Benchmarks, kept outside the library: each prints its figures and the ratios of the sides it
runs, measured side by side in one run (docs/performance.md records them).

    dagrl bench dataplane | learning | rollout | e2e | memory | async | scale [options]
    python -m benchmarks.<name> [options]                           (from the repository root)

A package beside `dagrl`, installed with it by `pip install -e .` (pyproject.toml), so `dagrl
bench` imports it like any module; the benchmarks read files of the source checkout.
"""
