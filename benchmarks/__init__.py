"""Benchmarks of odb against its peers, run from the repository root as modules: `python -m benchmarks.<module>`.

Scripts (each runs as `python -m benchmarks.<module>`; none is imported by another module of benchmarks/):
  compare, mm_bench                  every peer on the same workloads (writes results/)
  utilization, hot_path,             single measures of odb's own loader
  hot_path_instructions              (hot_path: ODB against a plain DataLoader on three real dataset shapes)
  overlap, buffer_memory,            keeping the accelerator fed: ODB against plain with a simulated device step
  byte_bound, move_bytes             on 1-4 Gloo ranks; the peak memory a loader adds with 1 MiB image samples;
                                     what max_buffer_bytes costs on MM-Mix-like samples; one round's sample moves
  pool_plan                          CPU time of one pooled (global) round's plan at W = 256
  global_scale, move_modes           global against rank-local planning (odb plan at scale), send against fetch
  node_plan                          node-aware against global and rank-local on nodes of 8 ranks (issue 30)
  demo                               `make demo`: CPU fine-tuning, Standard against ODB
  gpu.train_throughput               training throughput and peak memory on one GPU
  workers.*                          the torchrun ranks of the training benchmarks; `workers.training` standalone
  reference.reference_release        `--validate`: the reference release's driver against its real loader
  reference.ref_driver,              run inside benchmarks/.venv-ref (reference/setup_ref_env.sh), launched by
  data.sharegpt_qwen                 comparison/reference_peer.py and data/real_lengths.py
Libraries (imported, never run):
  lib/          what several benchmarks share: the offline oracle, time to quality, the hot-path loaders, the CPU
                training launcher, the simulated accelerator and the overlap runs, peak memory, --odb-option
  data/         the workloads: synthetic lengths, ChitChat, real-data lengths, the MM-Mix-like VLM pipeline, the
                overlap and buffer-memory datasets (feeding)
  comparison/   the peers (the reference release among them), the schedule every method produces, batch quality,
                the Markdown/PNG report
  alignment     compare's exchange-cost part
  gpu.quality   the GPU script's time-to-quality part

Every module imports its siblings absolutely (`benchmarks.data.workloads`); the repository root must be on the
path, which `python -m` from the root does. The locations below are the package's own, whatever the caller's
working directory. No module imports a runnable one (one with `if __name__ == "__main__":`): what two scripts share
moves to a library (tests/test_benchmarks_layout.py keeps it so).

NOTE [ Standard-library package inits ]
`reference/ref_driver.py` and `data/sharegpt_qwen.py` run as `python -m benchmarks.<...>` inside .venv-ref, which
has neither odb's packages nor their dependencies, so importing them runs this file and `reference/__init__.py` or
`data/__init__.py` there: all three import the standard library only, and so does `data/sharegpt_records.py`,
which `sharegpt_qwen` imports.
"""

from pathlib import Path

PACKAGE = Path(__file__).resolve().parent
REPO_ROOT = PACKAGE.parent
RESULTS = PACKAGE / "results"  # committed outputs (JSON, Markdown, PNG)
CACHE = PACKAGE / ".cache"  # git-ignored: token lengths and processed samples
REF_VENV = PACKAGE / ".venv-ref"  # git-ignored: the reference release's environment (reference/setup_ref_env.sh)
