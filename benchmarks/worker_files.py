"""What a worker's shared-memory tensor costs to reach its rank: torch's way against ODB's descriptors.

    python -m benchmarks.worker_files [--tensors 1200] [--mb 2] [--per-chunk 8] [--hold 16] [--repeats 3]

A forked worker makes `--tensors` float32 tensors of `--mb` MiB, each moved into a shared-memory file of its own
(`move_to_shared`, as a worker's hand-over does), and puts them on a `torch.multiprocessing` queue in chunks of
`--per-chunk` samples, as a DataLoader worker puts its results; the rank takes each chunk, reads one element of
every tensor, and holds the last `--hold` chunks, as its buffer holds samples until their round: so the worker has
let go of a file before the rank does, and the rank frees its pages, as in a loader. Two ways, alternating,
`--repeats` times each:
  * `torch`: the chunk as it is: the queue's pickler registers each file's descriptor with the worker's
    `resource_sharer`, and the rank fetches each over a connection of its own;
  * `descriptors`: the worker sends the chunk's descriptors in one message first (`send_files`) and the rank maps
    them from it (`FileInbox.opened`; NOTE [ A worker's files travel as descriptors ] in
    odb_core/data/worker_files.py);
  * `region`: the worker writes each tensor into its region instead of a file of its own (`placed`), and the rank
    reads it over its one mapping of that region, giving the span back when it drops the tensor (NOTE [ A worker's
    region ] in odb_core/data/worker_region.py).
Reported per tensor (the median over the repeats, and the least and most): the rank's CPU milliseconds (every
thread: unpickling, mapping, and freeing the file's pages once the rank drops the last reference, which both ways
pay alike), the worker's CPU milliseconds (every thread: making and moving the tensor too, which both ways pay
alike) and the wall milliseconds. Writes results/worker_files.json.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time

import torch
import torch.multiprocessing as mp

from benchmarks import RESULTS
from odb_core.data.sendable import move_to_shared
from odb_core.data.worker_files import FileInbox, attach, send_files
from odb_core.data.worker_region import placed

WAYS = ("torch", "descriptors", "region")
REGION_BYTES = 1 << 30  # the worker's region: more than the tensors the rank holds at once
TIMEOUT_S = 60.0  # a worker that died: an error, not a wait


def worker(out, done, way: str, end, tensors: int, numel: int, per_chunk: int) -> None:
    if way != "torch":
        attach(end, 0, REGION_BYTES if way == "region" else 0)
    start, chunk = time.process_time(), []
    for k in range(tensors):
        image = torch.empty(numel).fill_(k)
        sample = placed({"pixel_values": image})
        if type(sample["pixel_values"]) is torch.Tensor:
            move_to_shared(image)
        chunk.append((k, sample))
        if len(chunk) == per_chunk or k == tensors - 1:
            out.put(send_files(chunk))
            chunk = []
    done.wait()  # the rank has every tensor: torch's way, it fetched each descriptor from this process's sharer
    out.put(("cpu", time.process_time() - start))


def run(way: str, tensors: int, numel: int, per_chunk: int, hold: int) -> dict[str, float]:
    context = mp.get_context("fork")
    out, done = context.Queue(maxsize=4), context.Event()
    inbox = FileInbox(1)
    process = context.Process(target=worker, args=(out, done, way, inbox.ends[0], tensors, numel, per_chunk))
    wall, cpu, received, right = time.perf_counter(), time.process_time(), 0, 0
    process.start()
    try:
        held: collections.deque = collections.deque(maxlen=hold)  # a buffer's samples wait for their round
        while received < tensors:
            chunk = inbox.opened(out.get(timeout=TIMEOUT_S))
            received += len(chunk)
            right += sum(int(sample["pixel_values"][0].item() == index) for index, sample in chunk)
            held.append(chunk)
        held.clear()
        rank_cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        done.set()
        worker_cpu = out.get(timeout=TIMEOUT_S)[1]
    finally:
        done.set()
        process.join(timeout=TIMEOUT_S)
        if process.is_alive():
            process.kill()
        inbox.close()
    assert right == tensors, f"{right} of {tensors} tensors arrived with their values"
    return {"rank_cpu_ms": 1e3 * rank_cpu / tensors, "worker_cpu_ms": 1e3 * worker_cpu / tensors,
            "wall_ms": 1e3 * wall / tensors}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tensors", type=int, default=1200)
    parser.add_argument("--mb", type=float, default=2.0)
    parser.add_argument("--per-chunk", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hold", type=int, default=16, help="chunks the rank holds before it lets one go")
    parser.add_argument("--out", default=str(RESULTS / "worker_files.json"))
    args = parser.parse_args()
    numel = int(args.mb * (1 << 20)) // 4
    runs: dict[str, list[dict[str, float]]] = {way: [] for way in WAYS}
    for _ in range(args.repeats):
        for way in WAYS:
            runs[way].append(run(way, args.tensors, numel, args.per_chunk, args.hold))
    medians = {way: {key: statistics.median(r[key] for r in runs[way]) for key in runs[way][0]} for way in WAYS}
    print(f"{args.tensors} tensors of {args.mb} MiB, chunks of {args.per_chunk}, {args.repeats} runs each: median "
          "(least-most)")
    print("| way | rank CPU ms per tensor | worker CPU ms per tensor | wall ms per tensor |")
    print("|---|---|---|---|")
    for way in WAYS:
        cells = [f"{medians[way][key]:.3f} ({min(r[key] for r in runs[way]):.3f}-{max(r[key] for r in runs[way]):.3f})"
                 for key in ("rank_cpu_ms", "worker_cpu_ms", "wall_ms")]
        print(f"| {way} | {' | '.join(cells)} |")
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "medians": medians, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
