"""Peak memory a loader adds while it iterates samples that carry images (issue 27: "adds <= 1.5 GiB of peak RSS").

    python -m benchmarks.buffer_memory                               # 3,000 samples of 1 MiB of pixel rows
    python -m benchmarks.buffer_memory --samples 300 --odb-option window=512

Each sample (`feeding.PixelRows`) has a few hundred token ids and one image of 256 x 1024 float32 pixel rows
(1 MiB) with its `image_grid_thw`, made in `__getitem__` by one of 2 forked DataLoader workers. Each loader runs
in a fresh process (spawn), so that its peaks are its own: ODB (`ODBDataLoader`, default settings plus any
`--odb-option`, budget --budget) and, as the reference, a plain `DataLoader(batch_size=8)`; both collate with
`PadCollator`, and each batch is dropped once counted. Reported per loader:
  * added MiB: the process's `ru_maxrss` (getrusage RUSAGE_SELF) after the epoch minus the same taken after the
    dataset and the loader were built, before `iter()`;
  * workers MiB: `ru_maxrss` of RUSAGE_CHILDREN after the loader is closed (the largest worker's peak; a forked
    worker's RSS counts the pages it shares with the rank);
  * shared MiB: the peak of the shared memory in use (the used bytes of the tmpfs at /dev/shm, read every 2 ms by
    a thread) during the epoch, over what was in use before `iter()`. A tensor a worker hands over larger than
    ODB's pipe limit (`PACK_LIMIT_BYTES`), and every batch of the plain loader, travels in a shared-memory file
    that no process's RSS counts until it touches the pages: samples buffered that way weigh here, not in the
    added RSS (a plain loader's batches are all there, which is why its added RSS is a few MiB);
  * added + shared MiB: the two peaks summed (at least the peak of the sum), the figure held against the target;
  * steps, samples and seconds of the epoch.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import resource
import os
import sys
import threading
import time
from pathlib import Path

import torch

from benchmarks import RESULTS
from benchmarks.data.feeding import PixelRows
from benchmarks.lib.odb_options import parse_options
from odb_core import ODBDataLoader, PadCollator

TARGET_MIB = 1536
WORKER_OPTIONS = {"num_workers": 2, "multiprocessing_context": "fork"}


def maxrss_mib(who: int = resource.RUSAGE_SELF) -> float:
    return resource.getrusage(who).ru_maxrss / 1024  # KiB on Linux


class SharedPeak:
    """The most bytes in use on the tmpfs at /dev/shm while it runs, sampled every `period_s` by a thread."""

    def __init__(self, period_s: float = 0.002) -> None:
        self.period_s, self.peak = period_s, self.used()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def used() -> int:
        stats = os.statvfs("/dev/shm")
        return (stats.f_blocks - stats.f_bfree) * stats.f_frsize

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.peak = max(self.peak, self.used())

    def __enter__(self) -> "SharedPeak":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def measure(loader_name: str, samples: int, budget: int, options: dict) -> dict:
    """One loader's epoch, in this process: its peaks (see the module docstring)."""
    torch.set_num_threads(1)
    dataset = PixelRows(samples)
    if loader_name == "odb":
        loader = ODBDataLoader(dataset, token_budget=budget, **WORKER_OPTIONS, **options)
    else:
        loader = torch.utils.data.DataLoader(dataset, batch_size=8, collate_fn=PadCollator(), **WORKER_OPTIONS)
    baseline, shared_before = maxrss_mib(), SharedPeak.used()
    start, steps, seen = time.perf_counter(), 0, 0
    with SharedPeak() as shared:
        for batch in loader:
            steps += 1
            seen += batch["input_ids"].shape[0] if getattr(batch, "info", None) is None else len(batch.info.indices)
            del batch
    seconds = time.perf_counter() - start
    after = maxrss_mib()
    if isinstance(loader, ODBDataLoader):
        loader.close()
    del loader
    return {"loader": loader_name, "samples": seen, "steps": steps, "seconds": seconds, "baseline_mib": baseline,
            "peak_mib": after, "added_mib": after - baseline, "workers_mib": maxrss_mib(resource.RUSAGE_CHILDREN),
            "shared_mib": max(shared.peak - shared_before, 0) / 2**20,
            "added_and_shared_mib": after - baseline + max(shared.peak - shared_before, 0) / 2**20}


def _child(queue, *args) -> None:
    queue.put(measure(*args))


def measure_fresh(loader_name: str, samples: int, budget: int, options: dict) -> dict:
    """`measure` in a fresh spawned process."""
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=_child, args=(queue, loader_name, samples, budget, options))
    process.start()
    result = queue.get()
    process.join()
    return result


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=3000)
    parser.add_argument("--budget", type=int, default=16384)
    parser.add_argument("--odb-option", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out", default=str(RESULTS / "buffer_memory.json"))
    args = parser.parse_args(argv)
    options = parse_options(args.odb_option)
    rows = [measure_fresh(name, args.samples, args.budget, options) for name in ("odb", "plain")]
    print("| loader | samples | steps | s | added peak RSS MiB | shared MiB | added + shared MiB | workers' peak MiB "
          "| within 1.5 GiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['loader']} | {r['samples']} | {r['steps']} | {r['seconds']:.1f} | {r['added_mib']:.0f} | "
              f"{r['shared_mib']:.0f} | {r['added_and_shared_mib']:.0f} | {r['workers_mib']:.0f} | "
              f"{r['added_and_shared_mib'] <= TARGET_MIB} |")
    command = " ".join(["python -m benchmarks.buffer_memory", *(sys.argv[1:] if argv is None else argv)])
    Path(args.out).write_text(json.dumps({"command": command, "odb_options": options, "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    main()
