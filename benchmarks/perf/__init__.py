"""Performance benchmarks: every figure is a ratio of two rates measured in the same run.

    python -m benchmarks.perf [--quick] [--only NAME] [--json PATH]

One module per measurement (see ``BENCHMARKS`` in ``__main__``); docs/performance.md holds
the method and the latest numbers. The machines are shared and noisy, so no absolute rate
is a claim: only ratios of rates taken minutes apart on the same machine are.
"""
