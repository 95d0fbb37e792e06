"""Pooled round sizes (`ODBConfig.pool_window`, NOTE [ Pooled round sizes ]): what capping the pool does to steps
and to how long the device waits for rounds, at the world sizes where it acts.

    python -m benchmarks.pool_rounds                      # the table of docs/benchmarks.md "Pooled round sizes"
    python -m benchmarks.pool_rounds --worlds 64 --per-rank 700 3000

For each world size W (global planning, one pool of W ranks) and epoch length (samples per rank), the epoch is
planned by the real planner (`simulate_epoch`: lognormal lengths with mean 900 and CV 1, budget 16,384) with the
default `window` and `min_window`, once with `pool_window=None` (each rank's rounds up to 4,096) and once with the
default `pool_window` (16,384); then the pipeline model of `python -m benchmarks.round_rules` (each round's read
boundary and device seconds, 1.5 us per padded token) gives the score: samples/s over min(W x S, the device rate
of whole 4,096-sample windows), for S/D in `--ratios`, and the time to the first batch with each rank's workers
reading 1,000 samples/s (the first round's samples per rank / 1,000).
Steps are the real planner's. Writes results/pool_rounds.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks import RESULTS
from benchmarks.lib.round_model import epoch_seconds_of
from benchmarks.lib.planned_rounds import FULL, Candidate, plan_epoch, score
from odb_core.planning.round_sizes import round_target
from odb_core.settings.config import ODBConfig

CURRENT = Candidate("current", round_target, 256)
DEFAULT_POOL = ODBConfig.__dataclass_fields__["pool_window"].default


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", type=int, nargs="+", default=[8, 16, 64])
    parser.add_argument("--per-rank", type=int, nargs="+", default=[400, 800, 1500, 3000, 6000])
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.5, 0.92, 1.4, 3.0, 10.0])
    parser.add_argument("--out", type=Path, default=RESULTS / "pool_rounds.json")
    args = parser.parse_args(argv)
    window = ODBConfig.__dataclass_fields__["window"].default
    rows = []
    cells = " | ".join(f"S/D {r:g}" for r in args.ratios)
    print(f"| W | samples per rank | pool_window | rank's window / min_window | steps | {cells} | "
          "first batch s at 1,000 samples/s per rank |\n|---|---|---|---|---|" + "---|" * (len(args.ratios) + 1))
    for world in args.worlds:
        for per_rank in args.per_rank:
            samples = per_rank * world
            full = plan_epoch(FULL, samples, world, "global", window)
            rate = samples / sum(full.device_seconds)
            for pool in (None, DEFAULT_POOL):
                epoch = plan_epoch(CURRENT, samples, world, "global", window, pool_window=pool)
                scores = [score(epoch, samples, world, r, rate, window) for r in args.ratios]
                first, _ = epoch_seconds_of(epoch.reads, epoch.device_seconds, 1000.0, window)
                sized = ODBConfig(token_budget=16384, pool_window=pool).rounds_for_pool(world)
                rows.append({"world": world, "per_rank": per_rank, "pool_window": pool, "window": sized.window,
                             "min_window": sized.min_window, "steps": epoch.steps, "scores": scores,
                             "first_batch_s": first, "rounds": len(epoch.reads)})
                print(f"| {world} | {per_rank} | {pool} | {sized.window} / {sized.min_window} | {epoch.steps} | " +
                      " | ".join(f"{x:.2f}" for x in scores) + f" | {first:.2f} |")
    result = {"command": vars(args) | {"out": str(args.out)}, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
