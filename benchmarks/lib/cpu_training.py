"""Real training throughput on CPU at W = 2 (torchrun, gloo): launches `workers/train_worker` and summarises it.

Throughput figures are medians over the repeats; the ratio against Standard is the median of the per-repeat
ratios (each repeat runs every method back to back, so a ratio compares runs made under the same machine load).
Run by `python -m benchmarks.compare --parts training` and, standalone, `python -m benchmarks.workers.training`.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks import REPO_ROOT


def launch(methods: list[str], repeats: int, samples: int, extra: list[str] | None = None,
           timeout: float = 900) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                   "-m", "benchmarks.workers.train_worker", "--out", out, "--methods", ",".join(methods),
                   "--repeats", str(repeats), "--samples", str(samples), *(extra or [])]
        done = subprocess.run(command, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout)
        result = Path(out, "training.json")
        if done.returncode != 0 or not result.exists():
            raise RuntimeError(f"train_worker failed ({done.returncode}):\n{done.stdout[-2000:]}\n"
                               f"{done.stderr[-4000:]}")
        return json.loads(result.read_text())


def summarise(raw: dict) -> dict:
    records = raw["records"]
    methods = list(dict.fromkeys(r["method"] for r in records))
    by = {m: [r for r in records if r["method"] == m] for m in methods}
    summary = {}
    for method, runs in by.items():
        entry = {"samples_per_s": statistics.median(r["samples_per_s"] for r in runs),
                 "tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
                 "seconds": statistics.median(r["seconds"] for r in runs),
                 "optimizer_steps": runs[0]["optimizer_steps"], "repeats": len(runs)}
        if "standard" in by and method != "standard":
            ratios = [r["samples_per_s"] / s["samples_per_s"] for r, s in zip(runs, by["standard"])]
            entry["vs_standard"] = statistics.median(ratios)
            entry["vs_standard_range"] = [min(ratios), max(ratios)]
        summary[method] = entry
    return {"setup": raw["setup"], "summary": summary, "records": records}


def run_training(methods: list[str], repeats: int, samples: int, log=print) -> dict:
    result = summarise(launch(methods, repeats, samples))
    for method, entry in result["summary"].items():
        log(f"  training {method:11s} {entry['samples_per_s']:7.1f} samples/s {entry['tokens_per_s']:8.0f} tok/s"
            + (f"  x{entry['vs_standard']:.2f} vs standard" if "vs_standard" in entry else ""))
    return result
