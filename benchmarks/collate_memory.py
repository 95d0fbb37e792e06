"""What a VLM step's concatenation costs the trainer process, in fresh memory and in reused memory.

    python -m benchmarks.collate_memory [--images 67] [--mb 2.1] [--steps 20] [--repeats 3]

ODB collates in the trainer process, so a step's `pixel_values` (`--images` samples of `--mb` MB of float32 patch
rows, 1,176 floats each: Qwen2-VL's) are concatenated there. Each step's parts are fresh tensors in shared memory,
as a DataLoader worker hands them over. Three ways, `--steps` steps each, the result dropped before the next, as a
training loop drops its last batch; alternating runs, `--repeats` each:
  * `fresh`: `torch.cat` into new memory, as `PadCollator` did before NOTE [ Reused collation memory ];
  * `arenas`: `ArenaPool.cat` (what `PadCollator` does now), whose first steps allocate its arenas;
  * `copy only`: `torch.cat(out=...)` into one tensor made before the timing, the floor.
Reported per way: CPU ms per step (user and system, this process's `getrusage`) and page faults per step, medians
over the runs. Writes results/collate_memory.json.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
from pathlib import Path

import torch

from benchmarks import RESULTS
from odb_core.data.arenas import ArenaPool

ROW_FLOATS = 1176  # a Qwen2-VL patch row: 3 channels x 2 frames x 14 x 14


def step_parts(images: int, mb: float, seed: int) -> list[torch.Tensor]:
    rows = max(1, int(mb * 1e6 / 4 / ROW_FLOATS))
    generator = torch.Generator().manual_seed(seed)
    return [torch.rand(rows, ROW_FLOATS, generator=generator).share_memory_() for _ in range(images)]


def usage() -> tuple[float, float, int]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime, r.ru_minflt


def timed_run(way: str, images: int, mb: float, steps: int) -> dict:
    """One run of `steps` steps: CPU and faults of the concatenations alone (making the parts is not counted)."""
    pool = ArenaPool()
    floor = torch.empty(0)
    user = system = faults = 0.0
    for step in range(steps):
        parts = step_parts(images, mb, step)
        if way == "copy only" and floor.shape[0] != sum(p.shape[0] for p in parts):
            floor = torch.empty(sum(p.shape[0] for p in parts), ROW_FLOATS)
            floor.fill_(0)  # its pages faulted in before the timing
        u0, s0, f0 = usage()
        if way == "fresh":
            batch = torch.cat(parts, dim=0)
        elif way == "arenas":
            batch = pool.cat(parts)
        else:
            batch = torch.cat(parts, dim=0, out=floor)
        u1, s1, f1 = usage()
        user, system, faults = user + u1 - u0, system + s1 - s0, faults + f1 - f0
        del batch, parts
    return {"user_ms": user / steps * 1e3, "system_ms": system / steps * 1e3, "faults": faults / steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=67)
    parser.add_argument("--mb", type=float, default=2.1)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS / "collate_memory.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    ways = ("fresh", "arenas", "copy only")
    runs: dict[str, list[dict]] = {way: [] for way in ways}
    for _ in range(args.repeats):
        for way in ways:
            runs[way].append(timed_run(way, args.images, args.mb, args.steps))
    rows = {way: {key: statistics.median(run[key] for run in each) for key in each[0]} for way, each in runs.items()}
    step_mb = args.images * max(1, int(args.mb * 1e6 / 4 / ROW_FLOATS)) * ROW_FLOATS * 4 / 1e6
    print(f"{args.images} images x {args.mb} MB ({step_mb:.0f} MB a step), {args.steps} steps, medians of "
          f"{args.repeats} runs\n")
    print("| way | CPU ms per step | user | system | page faults per step |\n|---|---|---|---|---|")
    for way, row in rows.items():
        print(f"| {way} | {row['user_ms'] + row['system_ms']:.1f} | {row['user_ms']:.1f} | {row['system_ms']:.1f} "
              f"| {row['faults']:.0f} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"command": vars(args) | {"out": str(args.out)}, "step_mb": step_mb,
                                    "rows": rows, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
