"""Benchmarks that need a GPU (`train_throughput`; its `--cpu-smoke` mode is the CI check)."""
