"""Keeping the accelerator fed (issue 27): ODB against a plain padded DataLoader, one process, workers whose
processing releases the GIL and a simulated device step (benchmarks/lib/accelerator.py).

    python -m benchmarks.overlap                     # the table of docs/benchmarks.md
    python -m benchmarks.overlap --process-ms 6 --samples 2000 --windows 4096 512

Plain is a padded `DataLoader` with the largest fixed batch that fits the longest sample under the budget, as a
user without ODB would size it. Both loaders read the same samples with the same workers.
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks import RESULTS
from benchmarks.lib.accelerator import SlowSamples, drive, pad_collate
from odb_core import ODBDataLoader

BUDGET = 16384
STEP_US_PER_TOKEN = 1.5


def run_case(samples: int, process_ms: float, workers: int, windows: list[int]) -> list[dict]:
    dataset = SlowSamples(samples, process_ms)
    fixed = max(BUDGET // max(dataset.lengths), 1)
    plain = torch.utils.data.DataLoader(dataset, batch_size=fixed, num_workers=workers, collate_fn=pad_collate,
                                        multiprocessing_context="fork", persistent_workers=False)
    loaders = [("plain", plain, None)]
    loaders += [(f"odb window {w}", ODBDataLoader(dataset, token_budget=BUDGET, num_workers=workers, window=w,
                                                   multiprocessing_context="fork"), w) for w in windows]
    rows = []
    for name, loader, window in loaders:
        run = drive(loader, STEP_US_PER_TOKEN, workers, process_ms, name)
        rows.append({**run.row(), "process_ms": process_ms, "workers": workers, "fixed_batch": fixed,
                     "window": window})
        if window is not None:
            loader.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=3000)
    parser.add_argument("--process-ms", type=float, nargs="+", default=[2.0, 6.0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--windows", type=int, nargs="+", default=[4096, 512], help="ODB buffer sizes to run")
    parser.add_argument("--out", default=str(RESULTS / "overlap.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = [row for ms in args.process_ms for row in run_case(args.samples, ms, args.workers, args.windows)]
    print("| loader | process ms | samples/s | busy | efficiency | first batch s | supply | demand |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['loader']} | {r['process_ms']:g} | {r['samples_per_s']:.0f} | {r['busy']:.2f} | "
              f"{r['efficiency']:.2f} | {r['first_batch_s']:.2f} | {r['supply']:.0f} | {r['demand']:.0f} |")
    with open(args.out, "w") as out:
        json.dump(rows, out, indent=1)


if __name__ == "__main__":
    main()
