"""The comparison of batching methods: the peers (`peers`), the reference release among them (`reference_peer`,
the .venv side of benchmarks/reference/), the `Schedule` every method produces and its measures (`schedule`),
batch quality over the workloads (`quality`) and the tables and figures (`report`). A library: imports
`benchmarks.data`, `benchmarks.lib` and odb_core, never benchmarks/reference/ (which imports this package)."""
