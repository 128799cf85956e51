"""Benchmarks: acceptance length and speed-up per eval set, tree-shape tuning per batch size."""
