"""What the rounds allow: an epoch's wall time on one rank from its round sizes alone (issue 27, docs/benchmarks.md
"Keeping the accelerator fed"), to set a measured pipeline efficiency against the best the design can give.

    python -m benchmarks.round_model --samples 6000 --supply 1000 --demand 727
    python -m benchmarks.round_model --samples 12000 --supply 667 --demand 727 --window 4096 1024

The model is benchmarks/lib/round_model.py's: the loader's own round sizes, workers that read at S samples/s
whenever fewer than `--cap` samples (default: the window) wait unplanned, a device that trains a round at D
samples/s once all of it is read. Efficiency = (samples / min(S, D)) / the epoch's modelled seconds, as
`benchmarks.overlap` measures it.
"""

from __future__ import annotations

import argparse

from benchmarks.lib.round_model import epoch_seconds, rounds_of
from odb_core.settings.config import ODBConfig


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, nargs="+", required=True, help="per rank")
    parser.add_argument("--supply", type=float, required=True, help="samples/s the rank's workers read")
    parser.add_argument("--demand", type=float, required=True, help="samples/s the rank's device trains")
    parser.add_argument("--window", type=int, nargs="+", default=[4096])
    parser.add_argument("--min-window", type=int, default=256, help="0: none (every round a window)")
    parser.add_argument("--cap", type=int, default=None, help="samples read ahead of the plans (default: window)")
    args = parser.parse_args(argv)
    rows = []
    print("| samples | window | rounds | first batch s | epoch s | reading s | efficiency |\n|---|---|---|---|---|---|---|")
    for window in args.window:
        config = ODBConfig(token_budget=1, window=window, min_window=args.min_window or None)
        for samples in args.samples:
            sizes = rounds_of(samples, config)
            first, total = epoch_seconds(sizes, args.supply, args.demand, args.cap or window)
            ideal = samples / min(args.supply, args.demand)
            rows.append({"samples": samples, "window": window, "rounds": sizes, "first_batch_s": first,
                         "epoch_s": total, "efficiency": ideal / total})
            print(f"| {samples} | {window} | {len(sizes)} | {first:.2f} | {total:.2f} | {samples / args.supply:.2f} | "
                  f"{ideal / total:.3f} |")
    return rows


if __name__ == "__main__":
    main()
