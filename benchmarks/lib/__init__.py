"""The benchmarks' common library: what two or more benchmarks share, and no runnable script.

  oracle             the offline oracle (a global sort, then a greedy next-fit) and its step count
  time_to_quality    the MLPerf-style time-to-quality figure, the Trainer clock that measures it, the counting collator
  hot_path_loaders   the hot-path benchmarks' datasets and loaders (`hot_path`, `hot_path_instructions`, their children)
  cpu_training       the CPU training-throughput launcher (`workers/train_worker` under torchrun) and its summary
  accelerator        the simulated device step and the figures of a loader run, per rank and over ranks (`overlap`)
  overlap_runs       `overlap`'s loaders on W Gloo ranks (spawned) or in-process, and its table rows
  peak_memory        peak RSS of the training process and of its DataLoader workers, per run (/proc)
  odb_options        `--odb-option key=value` parsing (`overlap`, `buffer_memory`)
  localhost          a free port for Gloo ranks spawned on this machine

No module of benchmarks/ imports a runnable one (a module with `if __name__ == "__main__":`): what a script
shares lives here, in `data/` (the workloads) or in `comparison/` (tests/test_benchmarks_layout.py keeps it so).
"""
