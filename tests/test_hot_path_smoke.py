"""`python -m benchmarks.hot_path` runs end to end on its small datasets, with and without the simulated step,
and every row carries the figures docs/benchmarks.md quotes (the figures themselves are a benchmark's, not a
test's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(200)
def test_hot_path_benchmark_reports_every_loader_with_and_without_a_step(tmp_path):
    out = tmp_path / "hot_path.json"
    command = [sys.executable, "-m", "benchmarks.hot_path", "--datasets", "trivial,arrow", "--workers", "0",
               "--repeats", "1", "--samples", "200", "--trivial-samples", "2000", "--step-ms", "0,1", "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=190)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    rows = json.loads(out.read_text())["rows"]
    assert {(r["dataset"], r["step_ms"]) for r in rows} == {(d, s) for d in ("trivial", "arrow") for s in (0.0, 1.0)}
    for row in rows:
        assert row["plain_samples_per_s"] > 0 and row["odb_samples_per_s"] > 0
        assert row["ratio"] > 0 and row["thread_ratio"] > 0
        # arrow: a plain loader reading the same arrays; trivial (no workers): the floor of a length-sorting loader
        extra = {"plain_arrays"} if row["dataset"] == "arrow" else {"length_sorted"}
        assert set(row["trainer_cpu_us_per_sample"]) == {"plain", "odb", "odb_thread"} | extra
        assert row["ratio_vs_plain_arrays" if row["dataset"] == "arrow" else "length_sorted_ratio"] > 0
        assert row["cost"] == "padded"
        assert set(row["full_collections_per_epoch"]) == set(row["trainer_cpu_us_per_sample"])


@pytest.mark.parametrize("loader", ["none", "plain", "odb", "length_sorted"])
def test_the_instruction_count_child_runs_each_loader_natively(loader):
    # what hot_path_instructions runs under valgrind (not installed here): the same code, without the counter
    from benchmarks.hot_path_instructions import CHILD

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", CHILD + "\nprint('batches', sum(1 for _ in batches))", loader, "64",
                           "nogc"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]
    batches = int(done.stdout.split()[-1])
    assert batches == 0 if loader == "none" else batches >= 4  # 64 samples of 64 tokens, at most 16 per batch
