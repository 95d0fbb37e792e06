"""What the accelerator sees of a loader: a simulated device step, and the figures of docs/benchmarks.md "Keeping
the accelerator fed" (issue 27), per rank (`drive`) and over the ranks of a run (`aggregate`).

A real training step launches kernels and then waits for the device without holding the GIL; real processing in
DataLoader workers (image decoding, tokenization in native code) runs in other processes. So the device step here
is `time.sleep(step_us_per_token x padded tokens)` in the training thread (padded tokens: the rows x width of the
batch's `input_ids`), followed at W > 1 by a one-element all_reduce on the default group when `sync_steps`: the
gradient all_reduce that makes every rank wait for the slowest one at each step. Figures:
  * samples/s: samples trained per wall second, first batch included (over ranks: all samples / slowest wall);
  * busy: the fraction of wall time the simulated device was stepping (over ranks: their mean, and the least);
  * data wait (ODB only): the fraction of wall time the trainer spent in the loader's `next()`, and two parts of
    it, reading (the loader blocked on the workers' stream) and exchange (the rounds' collectives on ODB's group),
    as `odb/data_wait_fraction` and its parts log them (NOTE [ Waiting for data ] in odb_core/steps/metrics.py);
  * sync: the fraction of wall time in the per-step all_reduce (over ranks: their mean): the wait for the slowest
    rank plus what one small Gloo collective costs on the machine;
  * machine CPU: the fraction of the machine's CPU time that was busy during the run (every process, from
    /proc/stat; over ranks: their mean; None where there is no /proc/stat), which tells a run held back by the
    cores from one held back by waits;
  * supply: what the workers can produce (workers of every rank / processing seconds per sample), demand: what
    the device can consume (samples / device seconds; over ranks: all samples / the largest device seconds);
    efficiency = samples/s / min(supply, demand); with a nominal processing time besides the measured one (the
    sleep workload's wait), `nominal_efficiency` is the same with the supply of the nominal time;
  * first batch: seconds from `iter()` to the first batch in hand (over ranks: the slowest);
  * training CPU s: CPU seconds of the training process (every thread, no worker) during the run (over ranks:
    the most), what the loader takes from the cores the workers share;
  * peak RSS: the training process's and its largest worker's (benchmarks/lib/peak_memory.py; over ranks: max).
"""

from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from benchmarks.lib.peak_memory import WorkerPeaks, peak_mb, reset_peak

MOVE_FIELDS = ("rounds", "moved_samples", "moved_bytes", "sync_bytes", "sync_seconds", "wait_seconds", "read_seconds")


@dataclass(frozen=True, slots=True, kw_only=True)
class RankRun:
    """One rank's run of one loader; `indices` are the dataset indices it trained (ODB's `batch.info.indices`),
    empty for a loader that does not report them."""

    rank: int
    samples: int
    steps: int
    wall_s: float
    cpu_s: float
    device_s: float
    first_batch_s: float
    rss_mb: float
    worker_rss_mb: float
    indices: tuple[int, ...] = ()
    moves: dict = field(default_factory=dict)  # ODB's counters (`LoaderMetrics`: moved_bytes, sync_seconds, wait_seconds)
    step_s: tuple[float, ...] = ()  # the simulated device seconds of each step, in order
    sync_s: float = 0.0  # seconds in the per-step all_reduce
    machine_cpu: float | None = None  # the machine's busy CPU fraction during the run (`machine_cpu_times`)
    started_at: float = 0.0  # wall-clock time of `iter()` (`time.time()`)
    step_at: tuple[tuple[float, float, int], ...] = ()  # with `timeline`: each step's wall-clock start, end, round

    @property
    def busy(self) -> float:
        return self.device_s / self.wall_s


@dataclass(frozen=True, slots=True, kw_only=True)
class Step:
    """The simulated device step: with `host_copy`, the host's side of copying the batch to the device first (every
    tensor's bytes copied into a staging buffer made once, as a copy from pageable memory goes through the CUDA
    driver's pinned staging buffer, or a pin-memory thread copies a batch into pinned memory: the loader's batch is
    read once by the host, whichever loader made it); then `us_per_token` per padded token (the device seconds
    returned); then the ranks' per-step all_reduce."""

    us_per_token: float = 1.5
    sync: bool = True
    host_copy: bool = False

    def __call__(self, batch) -> tuple[float, float]:
        """Step on `batch`: the simulated device seconds, and the wall seconds of the all_reduce after it."""
        if self.host_copy:
            copy_to_staging(batch)
        rows, width = batch["input_ids"].shape
        seconds = self.us_per_token * 1e-6 * rows * width
        time.sleep(seconds)
        if not (self.sync and dist.is_initialized() and dist.get_world_size() > 1):
            return seconds, 0.0
        start = time.perf_counter()
        dist.all_reduce(torch.zeros(1))
        return seconds, time.perf_counter() - start


_STAGING: list[torch.Tensor] = []  # this process's staging buffer, grown to the largest tensor copied


def copy_to_staging(batch) -> int:
    """Copy every tensor of `batch` (a mapping) into the staging buffer, one after another; the bytes copied. The
    copies release the GIL, as a device copy's host part does."""
    copied = 0
    for value in batch.values():
        if not isinstance(value, torch.Tensor) or value.numel() == 0:
            continue
        flat = value.contiguous().view(-1).view(torch.uint8)
        if not _STAGING or _STAGING[0].numel() < flat.numel():
            _STAGING[:] = [torch.zeros(flat.numel() + flat.numel() // 4, dtype=torch.uint8)]  # touched once, here
        _STAGING[0][: flat.numel()].copy_(flat)
        copied += flat.numel()
    return copied


def machine_cpu_times() -> tuple[int, int] | None:
    """(busy, total) CPU ticks of the whole machine since boot, from /proc/stat (idle and iowait are not busy);
    None where there is no /proc/stat."""
    if not os.path.exists("/proc/stat"):
        return None
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    return sum(ticks) - ticks[3] - ticks[4], sum(ticks)


def busy_between(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    if before is None or after is None or after[1] == before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


def drive(batches, step: Step, rank: int = 0, timeline: bool = False) -> RankRun:
    """Train on every batch of `batches` (an iterable of padded dicts) with the simulated device step; with
    `timeline`, record each step's wall-clock start, end and round (benchmarks/lib/timeline.py)."""
    reset_peak()
    workers = WorkerPeaks().start()
    started_at = time.time()
    start, cpu, machine = time.perf_counter(), time.process_time(), machine_cpu_times()
    first, samples, steps, device, sync, indices, step_s, step_at = None, 0, 0, 0.0, 0.0, [], [], []
    for batch in batches:
        if first is None:
            first = time.perf_counter() - start
        began = time.time() if timeline else 0.0
        seconds, synced = step(batch)
        if timeline:
            step_at.append((began, time.time(), getattr(getattr(batch, "info", None), "round", -1)))
        step_s.append(seconds)
        device += seconds
        sync += synced
        steps += 1
        info = getattr(batch, "info", None)
        if info is not None:
            indices += info.indices
        samples += len(info.indices) if info is not None else batch["input_ids"].shape[0]
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    machine = busy_between(machine, machine_cpu_times())
    worker_mb = workers.stop()
    metrics = getattr(batches, "metrics", None)
    moves = {} if metrics is None else {k: getattr(metrics, k) for k in MOVE_FIELDS}
    return RankRun(rank=rank, samples=samples, steps=steps, wall_s=wall, cpu_s=cpu, device_s=device,
                   first_batch_s=first or 0.0, rss_mb=peak_mb(), worker_rss_mb=worker_mb,
                   indices=tuple(indices), moves=moves, step_s=tuple(step_s), sync_s=sync, machine_cpu=machine,
                   started_at=started_at, step_at=tuple(step_at))


@dataclass(frozen=True, slots=True, kw_only=True)
class Figures:
    """A run over every rank: the row of the table (see the module docstring for each figure)."""

    world_size: int
    samples: int
    steps: int
    wall_s: float
    samples_per_s: float
    busy: float
    busy_min: float
    supply: float
    demand: float
    efficiency: float
    synced_demand: float
    synced_efficiency: float
    first_batch_s: float
    cpu_s: float
    rss_mb: float
    worker_rss_mb: float
    data_wait: float | None  # ODB's own `odb/data_wait_fraction` over the run, mean over ranks (None: plain)
    reading: float | None = None  # its parts: `odb/data_wait_reading_fraction` (blocked on the workers' stream)
    exchange: float | None = None  # and `odb/data_wait_exchange_fraction` (the rounds' collectives)
    sync: float = 0.0
    machine_cpu: float | None = None
    nominal_efficiency: float | None = None

    def row(self) -> dict:
        return asdict(self)


def aggregate(runs: list[RankRun], workers_per_rank: int, process_s: float,
              nominal_process_s: float | None = None) -> Figures:
    samples = sum(r.samples for r in runs)
    wall = max(r.wall_s for r in runs)
    rate = samples / wall
    supply = len(runs) * workers_per_rank / process_s if process_s > 0 else math.inf
    nominal = None if not nominal_process_s else len(runs) * workers_per_rank / nominal_process_s
    machine = [r.machine_cpu for r in runs if r.machine_cpu is not None]
    device = max(r.device_s for r in runs)
    demand = samples / device if device else math.inf
    synced = synced_device_s(runs)
    synced_demand = samples / synced if synced else math.inf
    return Figures(world_size=len(runs), samples=samples, steps=max(r.steps for r in runs), wall_s=wall,
                   samples_per_s=rate, busy=statistics.fmean(r.busy for r in runs),
                   busy_min=min(r.busy for r in runs), supply=supply, demand=demand,
                   efficiency=rate / min(supply, demand), synced_demand=synced_demand,
                   synced_efficiency=rate / min(supply, synced_demand), first_batch_s=max(r.first_batch_s for r in runs),
                   cpu_s=max(r.cpu_s for r in runs), rss_mb=max(r.rss_mb for r in runs),
                   worker_rss_mb=max(r.worker_rss_mb for r in runs),
                   data_wait=_loader_share(runs, "wait_seconds"), reading=_loader_share(runs, "read_seconds"),
                   exchange=_loader_share(runs, "sync_seconds"),
                   sync=statistics.fmean(r.sync_s / r.wall_s for r in runs),
                   machine_cpu=statistics.fmean(machine) if machine else None,
                   nominal_efficiency=None if nominal is None else rate / min(nominal, demand))


def _loader_share(runs: list[RankRun], counter: str) -> float | None:
    """A loader's seconds counter (`LoaderMetrics`) over wall seconds, mean over ranks; None for a plain loader."""
    if not all(counter in r.moves for r in runs):
        return None
    return statistics.fmean(r.moves[counter] / r.wall_s for r in runs)


def synced_device_s(runs: list[RankRun]) -> float:
    """The device seconds of ranks that wait for each other at every step: the sum over steps of the slowest
    rank's step (the per-step all_reduce); one rank's device seconds at W = 1."""
    steps = [r.step_s for r in runs]
    if len({len(s) for s in steps}) != 1:
        return max(r.device_s for r in runs)
    return sum(max(column) for column in zip(*steps))
