"""What the rounds allow: an epoch's wall time on one rank from its round sizes alone (issue 27, docs/benchmarks.md
"Keeping the accelerator fed"), to set a measured pipeline efficiency against the best the design can give.

    python -m benchmarks.round_model --samples 6000 --supply 1000 --demand 727
    python -m benchmarks.round_model --samples 12000 --supply 667 --demand 727 --window 4096 1024

The model: the rank's stream of `--samples` samples is cut into rounds by the loader's own rule (`round_target`,
NOTE [ Round sizes ]; no samples carried between rounds). The workers read one sample every 1/S seconds whenever
fewer than `--cap` samples (default: the window) are read and not yet admitted by a plan (NOTE [ Reading ahead ]).
Round j is planned once all its samples are read and the device has trained round j-1; the device trains it in
n_j / D seconds. Nothing else costs time: no trainer CPU, no collectives, no per-step granularity. Efficiency =
(samples / min(S, D)) / the epoch's modelled seconds, as `benchmarks.overlap` measures it.
"""

from __future__ import annotations

import argparse

from odb_core.planning.round_sizes import round_target
from odb_core.settings.config import ODBConfig


def rounds_of(samples: int, config: ODBConfig) -> list[int]:
    """The round sizes one rank's known-length stream of `samples` samples gets (nothing carried over)."""
    sizes, left = [], samples
    while left > 0:
        size = min(round_target(config, len(sizes), 0, left), left)
        sizes.append(size)
        left -= size
    return sizes


def epoch_seconds(sizes: list[int], supply: float, demand: float, cap: int) -> tuple[float, float]:
    """(seconds to the first batch, seconds of the epoch) for rounds `sizes` (see the module docstring)."""
    planned_at: list[float] = []  # when each round is planned
    admitted = [0]  # samples admitted by the plans so far, after each round
    read = 0.0  # when the last sample was read
    device_free = 0.0
    sample = 0
    for size in sizes:
        for _ in range(size):
            ready = read + 1.0 / supply
            m = next((j for j, total in enumerate(admitted[1:]) if total >= sample + 1 - cap), None)
            if sample + 1 - cap > 0 and m is not None:
                ready = max(ready, planned_at[m])
            read, sample = ready, sample + 1
        plan = max(read, device_free)
        planned_at.append(plan)
        admitted.append(admitted[-1] + size)
        device_free = plan + size / demand
    return planned_at[0], device_free


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
