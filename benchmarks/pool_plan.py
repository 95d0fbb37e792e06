"""CPU time of one pooled round's plan (`plan_pooled_round`), which every rank computes under global planning.

    python -m benchmarks.pool_plan [--world 256] [--samples 200000] [--repeats 3]

A lognormal pool (median e^6 ~ 403 tokens, CV ~ 1.3, clipped to [16, 8192]) split round-robin over `--world`
buffers, token budget 16384; prints the best process-CPU seconds of `--repeats` for a final round (everything
emitted) and an open round (the tail held back). Run it against two trees with PYTHONPATH to compare them.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from odb_core.planning.alignment import RoundKey
from odb_core.planning.budget import Item
from odb_core.planning.pooled import PoolRequest, plan_pooled_round
from odb_core.settings.config import ODBConfig


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=256)
    parser.add_argument("--samples", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    lengths = np.clip(np.random.default_rng(0).lognormal(6, 1.0, args.samples).astype(int), 16, 8192)
    buffers = [[Item(i, int(lengths[i]), 0, r) for i in range(r, args.samples, args.world)]
               for r in range(args.world)]
    config = ODBConfig(token_budget=16384)
    result = {}
    for name, active in (("final_round_s", False), ("open_round_s", True)):
        request = PoolRequest(active=[active] * args.world, steps_done=0, key=RoundKey(0, 0, 0))
        times = []
        for _ in range(args.repeats):
            start = time.process_time()
            plan_pooled_round(buffers, request, config)
            times.append(time.process_time() - start)
        result[name] = round(min(times), 3)
    print(json.dumps({"world": args.world, "samples": args.samples, **result}))


if __name__ == "__main__":
    main()
