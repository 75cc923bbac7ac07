"""Benchmarks, kept outside the library: each prints its figures and the ratios of the sides it
runs, measured side by side in one run (docs/performance.md records them).

    dagrl bench dataplane | learning | rollout | e2e | memory | scale [options]  (a checkout)
    python -m benchmarks.<name> [options]                           (from the repository root)
"""
