"""What the accelerator sees of a loader: a simulated device step and worker-side processing that both release
the GIL, and the figures of docs/benchmarks.md "Keeping the accelerator fed" (issue 27).

A real training step launches kernels and then waits for the device without holding the GIL; real processing in
DataLoader workers (image decoding, tokenization in native code) runs in other processes. So the device step here
is `time.sleep(step_us_per_token x padded tokens)` in the training thread, and a sample's processing is a
`time.sleep` in the worker's `__getitem__`. Figures per run:
  * samples/s: samples trained per wall second, first batch included;
  * busy: the fraction of wall time the simulated device was stepping;
  * supply: what the workers can produce (workers / processing seconds per sample), demand: what the device can
    consume (samples / device seconds of this loader's batches); efficiency = samples/s / min(supply, demand);
  * first batch: seconds from `iter()` to the first batch in hand.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch


class SlowSamples(torch.utils.data.Dataset):
    """Lognormal token lengths; each `__getitem__` first waits `process_ms` with the GIL released."""

    def __init__(self, n: int, process_ms: float, mean: float = 900.0, cv: float = 1.0, cap: int = 16384,
                 seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        sigma2 = math.log(1 + cv * cv)
        raw = rng.lognormal(math.log(mean) - sigma2 / 2, math.sqrt(sigma2), n)
        self.lengths = np.clip(raw.round(), 8, cap).astype(int).tolist()
        self.process_s = process_ms / 1e3

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> dict:
        time.sleep(self.process_s)
        n = self.lengths[index]
        ids = (torch.arange(n) * 7 + index) % 31000 + 3
        return {"input_ids": ids, "labels": ids.clone()}


@dataclass(frozen=True)
class Run:
    loader: str
    samples: int
    wall_s: float
    device_s: float
    first_batch_s: float
    samples_per_s: float
    busy: float
    supply: float
    demand: float
    efficiency: float

    def row(self) -> dict:
        return asdict(self)


def drive(batches, step_us_per_token: float, workers: int, process_ms: float, name: str) -> Run:
    """Train on every batch of `batches` (an iterable of padded dicts) with the simulated device step."""
    start = time.perf_counter()
    first, samples, device = None, 0, 0.0
    for batch in batches:
        if first is None:
            first = time.perf_counter() - start
        rows, width = batch["input_ids"].shape
        step = step_us_per_token * 1e-6 * rows * width
        time.sleep(step)
        device += step
        samples += len(batch.info.indices) if hasattr(batch, "info") else rows
    wall = time.perf_counter() - start
    supply = workers / (process_ms / 1e3) if process_ms > 0 else math.inf
    demand = samples / device if device else math.inf
    rate = samples / wall
    return Run(loader=name, samples=samples, wall_s=wall, device_s=device, first_batch_s=first or 0.0,
               samples_per_s=rate, busy=device / wall, supply=supply, demand=demand,
               efficiency=rate / min(supply, demand))


def pad_collate(samples: list[dict]) -> dict:
    width = max(len(s["input_ids"]) for s in samples)
    ids = torch.zeros(len(samples), width, dtype=torch.long)
    for row, s in enumerate(samples):
        ids[row, : len(s["input_ids"])] = s["input_ids"]
    return {"input_ids": ids}
