"""Where a run's time goes, from timestamps (`python -m benchmarks.overlap --timeline`): when each DataLoader worker
fetched each sample, and when each simulated step started and ended.

The figures of benchmarks/lib/accelerator.py are sums over a run; they cannot tell a worker that idles in the
middle of an epoch from one that only starts late or ends early, nor the device's wait at a round's boundary from
its wait inside a round. With `--timeline`, each rank's dataset is wrapped in `TimedFetches`, whose workers append
the wall-clock start and end of every `__getitem__`, and their process's CPU seconds at both, to a file of their
own, and `drive` records each step's
start, end and round (`StepInfo.round`; -1 for a plain loader). Per rank (`rank_timeline`), seconds from `iter()`,
the rank's workers taken together:
  * first fetch / last read: when the rank's workers began their first fetch and ended their last;
  * workers busy: the fetches' seconds over the workers' seconds from the rank's first fetch to its last read
    (1.0: no worker idled in between, nor started late or ended early; what is left is each worker's own work
    between fetches, any pause, and a worker's late start or early end);
  * worker CPU: the CPU seconds (every thread of the process) each worker spent from the start of its first fetch
    to the end of its last, per sample fetched, and as a share of that span (mean over workers): a worker that
    gets less of a core over its span than another reading the same samples was waiting for one;
  * after last read: the rank's wall time after its workers' last fetch, to the end of its run (the rounds it
    trains once nothing is left to read, their exchanges, and the epoch's end);
  * gaps: the seconds between one step's end and the next step's start (the loader's `next()`), and the part of
    them at a round's boundary (the step before and the step after belong to different rounds).
Over ranks (`world_timeline`): the mean of each, and the latest last read.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(eq=False)
class TimedFetches(torch.utils.data.Dataset):
    """`dataset`, with each `__getitem__`'s wall-clock start and end appended to `folder/fetch-<pid>.txt` by the
    process that runs it (a DataLoader worker, or the rank itself without workers)."""

    dataset: torch.utils.data.Dataset
    folder: str
    _fd: int | None = None
    _pid: int | None = None

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        start, cpu = time.time(), time.process_time()
        sample = self.dataset[index]
        end, cpu_end = time.time(), time.process_time()
        if self._pid != os.getpid():  # forked: a file of this process's own
            self._pid = os.getpid()
            self._fd = os.open(Path(self.folder, f"fetch-{self._pid}.txt"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.write(self._fd, f"{start:.6f} {end:.6f} {cpu:.6f} {cpu_end:.6f}\n".encode())  # one write: none lost
        return sample

    def __getstate__(self) -> dict:  # a spawned worker opens its own file
        return {"dataset": self.dataset, "folder": self.folder, "_fd": None, "_pid": None}


def fetch_spans(folder: str | Path) -> list[list[tuple[float, float, float, float]]]:
    """Per process that fetched (one file each), its fetches' (start, end, CPU at start, CPU at end), in order."""
    spans = []
    for path in sorted(Path(folder).glob("fetch-*.txt")):
        rows = [tuple(map(float, line.split())) for line in path.read_text().splitlines() if line]
        spans.append(sorted(rows))
    return spans


def rank_timeline(spans: list[list[tuple[float, ...]]], steps: list[tuple[float, float, int]], started: float,
                  ended: float) -> dict:
    """One rank's timeline figures (see the module docstring); `steps`: (start, end, round) per step, in order;
    `started` / `ended`: the wall-clock times of `iter()` and of the run's end (`drive`'s `started_at + wall_s`)."""
    fetched = [s for s in spans if s]
    if not fetched:
        raise ValueError("no fetch was timed: the rank read nothing through its TimedFetches")
    first = min(s[0][0] for s in fetched)
    last = max(s[-1][1] for s in fetched)
    busy = sum(f[1] - f[0] for s in fetched for f in s)
    cpu = [s[-1][3] - s[0][2] for s in fetched]  # each worker's CPU seconds over its own span
    gaps = [(steps[k + 1][0] - steps[k][1], steps[k + 1][2] != steps[k][2]) for k in range(len(steps) - 1)]
    return {"first_fetch_s": first - started, "last_read_s": last - started,
            "workers_busy": busy / (len(fetched) * (last - first)) if last > first else 1.0,
            "worker_cpu_ms_per_sample": 1e3 * sum(cpu) / sum(len(s) for s in fetched),
            "worker_cpu_share": statistics.fmean(c / max(s[-1][1] - s[0][0], 1e-9) for c, s in zip(cpu, fetched)),
            "after_last_read_s": ended - last, "gaps_s": sum(g for g, _ in gaps),
            "boundary_gaps_s": sum(g for g, boundary in gaps if boundary)}


def world_timeline(ranks: list[dict]) -> dict:
    """The ranks' timeline figures: the mean of each, and the latest last read."""
    out = {key: statistics.fmean(r[key] for r in ranks) for key in ranks[0]}
    out["latest_last_read_s"] = max(r["last_read_s"] for r in ranks)
    return out
