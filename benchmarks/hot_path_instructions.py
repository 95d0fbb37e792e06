"""ODB's own work per sample on `trivial` without workers, counted in instructions: a figure this shared VM's load
cannot move (its timings of the same loader vary by a third between processes).

Each loader runs one epoch in a fresh process under valgrind's callgrind (`apt install valgrind`; about 90 s per
process, two at a time); a process that only builds the dataset is the baseline subtracted from the others. Every
loader runs with the garbage collector on (what a trainer gets) and off (the code's own instructions, without the
full collections that a window of buffered tensors triggers; docs/benchmarks.md, "The loader's hot path").
Instructions are turned into microseconds at the plain loader's own rate, measured natively right after.

  python -m benchmarks.hot_path_instructions [--samples 16384] [--out benchmarks/results/hot_path_instructions.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOADERS = ("none", "plain", "odb", "length_sorted")
# One epoch of `loader` over Trivial(n) (`none`: the dataset alone); argv: loader, n, "gc" or "nogc".
CHILD = """
import gc, sys
loader, n, collector = sys.argv[1], int(sys.argv[2]), sys.argv[3]
if collector == "nogc":
    gc.disable()
import torch
torch.set_num_threads(1)
from benchmarks.lib.hot_path_loaders import BATCH, SEQ, LengthSorted, Trivial
from odb_core import ODBDataLoader, PadCollator
dataset = Trivial(n)
if loader == "plain":
    batches = torch.utils.data.DataLoader(dataset, batch_size=BATCH)
elif loader == "odb":
    batches = ODBDataLoader(dataset, token_budget=BATCH * SEQ, collate_fn=PadCollator())
elif loader == "length_sorted":
    batches = LengthSorted(dataset)
else:
    batches = ()
for batch in batches:
    pass
"""


def instructions(loader: str, n: int, collector: str) -> int:
    """Instructions of one child process under callgrind."""
    with tempfile.TemporaryDirectory() as tmp:
        done = subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={tmp}/out",
                               sys.executable, "-c", CHILD, loader, str(n), collector],
                              capture_output=True, text=True, cwd=ROOT, check=True,
                              env={**os.environ, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"})
    return int(re.search(r"Collected : (\d+)", done.stderr).group(1))


def native_plain_us(n: int, repeats: int = 9) -> float:
    """The plain loader's trainer CPU per sample, best of `repeats` epochs, in this process."""
    import torch

    from benchmarks.lib.hot_path_loaders import BATCH, Trivial, epoch_rate

    torch.set_num_threads(1)
    plain = torch.utils.data.DataLoader(Trivial(n), batch_size=BATCH)
    return min(epoch_rate(plain, lambda batch: batch["input_ids"].shape[0])[1] for _ in range(repeats))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=16384)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "hot_path_instructions.json")
    args = parser.parse_args(argv)
    if shutil.which("valgrind") is None:
        sys.exit("hot_path_instructions needs valgrind (apt install valgrind)")
    runs = [(loader, collector) for collector in ("gc", "nogc") for loader in LOADERS]
    with ThreadPoolExecutor(max_workers=2) as pool:
        counts = dict(zip(runs, pool.map(lambda run: instructions(run[0], args.samples, run[1]), runs), strict=True))
    per_sample = {f"{loader}_{collector}": (counts[loader, collector] - counts["none", collector]) / args.samples
                  for loader, collector in runs if loader != "none"}
    plain_us = native_plain_us(args.samples)
    rate = per_sample["plain_nogc"] / plain_us  # instructions per microsecond of this kind of work, on this VM
    result = {"samples": args.samples, "instructions_per_sample": {k: round(v) for k, v in per_sample.items()},
              "plain_cpu_us_per_sample": round(plain_us, 2), "instructions_per_us": round(rate),
              "own_instructions_per_sample": {c: round(per_sample[f"odb_{c}"] - per_sample[f"plain_{c}"])
                                              for c in ("gc", "nogc")},
              "length_sorted_extra_instructions_per_sample": {
                  c: round(per_sample[f"length_sorted_{c}"] - per_sample[f"plain_{c}"]) for c in ("gc", "nogc")},
              "command": " ".join(["python -m benchmarks.hot_path_instructions", *(argv or sys.argv[1:])])}
    result["own_us_per_sample"] = {c: round(v / rate, 1) for c, v in result["own_instructions_per_sample"].items()}
    print(json.dumps(result, indent=2))
    args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
