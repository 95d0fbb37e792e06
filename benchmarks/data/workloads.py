"""Length workloads shared by the benchmarks (synthetic, reproducible from a seed) and the datasets that serve
samples to a loader: of given lengths (`LengthsDataset`) or already processed (`Listed`)."""

from __future__ import annotations

import numpy as np
import torch


def lognormal(n: int, cv: float, mean: float = 1024.0, lo: int = 16, hi: int = 8192, seed: int = 0) -> list[int]:
    """Lognormal token lengths with the given coefficient of variation, clipped to [lo, hi]."""
    rng = np.random.default_rng(seed)
    sigma2 = np.log(1.0 + cv * cv)
    mu = np.log(mean) - sigma2 / 2.0
    return np.clip(rng.lognormal(mu, np.sqrt(sigma2), n), lo, hi).astype(int).tolist()


class LengthsDataset(torch.utils.data.Dataset):
    """Processed samples of the given lengths: what a tokenizing pipeline would hand the loader."""

    def __init__(self, lengths: list[int]) -> None:
        self.lengths = lengths

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> dict:
        ids = torch.full((self.lengths[index],), 7, dtype=torch.long)
        return {"input_ids": ids, "labels": ids}


class Listed(torch.utils.data.Dataset):
    """Samples already processed (a list), as a map-style dataset."""

    def __init__(self, samples: list[dict]) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict:
        return self.samples[index]


def bimodal(n: int, short_share: float = 0.8, seed: int = 0, lo: int = 16, hi: int = 8192) -> list[int]:
    """MM-Mix-like lengths: a large share of short samples (lognormal mean 384, CV 0.3: one image plus a short
    text) and a long mode (lognormal mean 1536, CV 0.5: several images or long answers) whose tail reaches `hi`."""
    rng = np.random.default_rng(seed)
    short = rng.random(n) < short_share

    def draw(mean: float, cv: float) -> np.ndarray:
        sigma2 = np.log(1.0 + cv * cv)
        return rng.lognormal(np.log(mean) - sigma2 / 2.0, np.sqrt(sigma2), n)

    lengths = np.where(short, draw(384.0, 0.3), draw(1536.0, 0.5))
    return np.clip(lengths, lo, hi).astype(int).tolist()
