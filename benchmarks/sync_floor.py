"""What the per-step all_reduce of `python -m benchmarks.overlap` costs on this machine with no loader at all: W
real Gloo ranks on 127.0.0.1 each sleep a simulated device step of `--step-ms` (GIL-free, as the benchmark's step
does) and then all_reduce one element, `--steps` times; the mean wall milliseconds of the all_reduce per step,
and of the sleep beyond what was asked (oversleep). Steps of 0 ms give the back-to-back cost of the collective.

    python -m benchmarks.sync_floor                              # W = 2 and 4; steps of 0, 1, 5 and 23 ms
    python -m benchmarks.sync_floor --worlds 2 --step-ms 23 --steps 300

Every rank's steps are equal here, so nothing waits for a slower rank: what is left is the collective and the
wake-up of processes that slept (docs/benchmarks.md, "Where the time of the sleep rows goes").
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks import RESULTS
from benchmarks.lib.localhost import free_port

WARM_UP = 20  # all_reduces before the timed ones (the first few set up Gloo's pairs)


def timed_steps(step_s: float, steps: int) -> tuple[float, float]:
    """(mean seconds of the all_reduce after each step, mean oversleep) over `steps` steps of `step_s` seconds."""
    in_collective = oversleep = 0.0
    for _ in range(steps):
        start = time.perf_counter()
        if step_s:
            time.sleep(step_s)
        woke = time.perf_counter()
        oversleep += woke - start - step_s
        dist.all_reduce(torch.zeros(1))
        in_collective += time.perf_counter() - woke
    return in_collective / steps, oversleep / steps


def _rank(rank: int, world: int, port: int, step_ms: list[float], steps: int, folder: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for _ in range(WARM_UP):
            dist.all_reduce(torch.zeros(1))
        rows = []
        for ms in step_ms:
            collective, oversleep = timed_steps(ms / 1e3, steps)
            rows.append({"world_size": world, "step_ms": ms, "steps": steps, "all_reduce_ms": collective * 1e3,
                         "oversleep_ms": oversleep * 1e3, "rank": rank})
        Path(folder, f"rank{rank}.json").write_text(json.dumps(rows))
    finally:
        dist.destroy_process_group()


def measure(world: int, step_ms: list[float], steps: int) -> list[dict]:
    """One row per step length: the all_reduce and oversleep milliseconds, mean over steps and ranks."""
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(_rank, args=(world, free_port(), step_ms, steps, folder), nprocs=world, join=True)
        per_rank = [json.loads(Path(folder, f"rank{r}.json").read_text()) for r in range(world)]
    rows = []
    for k, ms in enumerate(step_ms):
        ranks = [runs[k] for runs in per_rank]
        rows.append({"world_size": world, "step_ms": ms, "steps": steps,
                     "all_reduce_ms": sum(r["all_reduce_ms"] for r in ranks) / world,
                     "oversleep_ms": sum(r["oversleep_ms"] for r in ranks) / world})
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--step-ms", type=float, nargs="+", default=[0.0, 1.0, 5.0, 23.0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", default=str(RESULTS / "sync_floor.json"))
    args = parser.parse_args(argv)
    rows = [row for world in args.worlds for row in measure(world, args.step_ms, args.steps)]
    print("| W | step ms | all_reduce ms | oversleep ms |\n|---|---|---|---|")
    for row in rows:
        print(f"| {row['world_size']} | {row['step_ms']:g} | {row['all_reduce_ms']:.2f} | {row['oversleep_ms']:.2f} |")
    command = " ".join(["python -m benchmarks.sync_floor", *(sys.argv[1:] if argv is None else argv)])
    Path(args.out).write_text(json.dumps({"command": command, "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    main()
