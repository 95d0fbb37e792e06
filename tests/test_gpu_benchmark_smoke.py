"""The GPU benchmark script runs end to end in its CPU smoke mode (tiny model): same code path as on a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(120)
def test_gpu_benchmark_cpu_smoke_writes_throughput_and_time_to_quality(tmp_path):
    out = tmp_path / "gpu_smoke.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "benchmarks.gpu.train_throughput", "--cpu-smoke", "--out", str(out)]
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    result = json.loads(out.read_text())
    runs = {(r["workload"], r["method"]): r for r in result["runs"]}
    assert set(runs) == {(w, m) for w in ("sharegpt-like", "mm-mix-like") for m in ("standard", "odb")}
    for run in runs.values():
        assert run["timed_steps"] > 0 and run["samples_per_s"] > 0 and run["tokens_per_s"] > 0
        assert run["padded_tokens"] >= run["real_tokens"] > 0
    assert set(result["odb_over_standard"]) == {"sharegpt-like", "mm-mix-like"}
    assert result["parameters"] > 0 and result["scale"]["dtype"] == "float32"
    # the quality part: both methods learn the real text at the same optimizer step, and the figure is computed
    quality = {r["method"]: r for r in result["quality"]["runs"]}
    assert set(quality) == {"standard", "odb"}
    for run in quality.values():
        curve = run["eval_curve"]
        assert len(curve) >= 2 and curve[-1]["eval_loss"] < curve[0]["eval_loss"]
        assert run["samples_per_step_mean"] == pytest.approx(8, abs=2)  # --samples-per-step 8 in the smoke mode
    figure = result["time_to_quality"]
    assert figure["target_eval_loss"] == quality["standard"]["eval_loss"]
    assert figure["odb"]["final_eval_loss"] == quality["odb"]["eval_loss"]
    assert figure["common_target"]["speedup"] > 0
