"""Benchmark scripts: each runs as `python benchmarks/<name>.py [--quick]` and prints JSON last."""
