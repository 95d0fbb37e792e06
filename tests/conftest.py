"""Shared fixtures: small synthetic token datasets (real text fixtures live beside the tests that use them)."""

from __future__ import annotations

import json
import logging
import os

import numpy as np
import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


class LengthDataset(torch.utils.data.Dataset):
    """Map-style dataset of processed samples with given token lengths; labels mask the first half."""

    def __init__(self, lengths) -> None:
        self.lengths = [int(x) for x in lengths]

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> dict:
        n = self.lengths[index]
        ids = (torch.arange(n) * 7 + index) % 97 + 3
        labels = ids.clone()
        labels[: n // 2] = -100
        return {"input_ids": ids, "labels": labels}


class CountingDataset(LengthDataset):
    """A `LengthDataset` that counts the samples read: with `num_workers=0` a sample is read when the loader pulls
    it, so the count shows how far the loader has read ahead of its consumer."""

    def __init__(self, lengths) -> None:
        super().__init__(lengths)
        self.reads = 0

    def __getitem__(self, index: int) -> dict:
        self.reads += 1
        return super().__getitem__(index)


def lognormal_lengths(n: int, cv: float, mean: float = 512.0, seed: int = 0, lo: int = 1, hi: int = 8192):
    rng = np.random.default_rng(seed)
    sigma2 = np.log(1 + cv * cv)
    mu = np.log(mean) - sigma2 / 2
    return np.clip(rng.lognormal(mu, np.sqrt(sigma2), n).astype(int), lo, hi).tolist()


def saved_without(state: dict, field: str) -> dict:
    """A loader `state` as an odb before the fingerprint field `field` existed wrote it (digest recomputed)."""
    from odb_core.resume.fields import digest_of

    config = {k: v for k, v in state["config"].items() if k != field}
    old = {k: v for k, v in {**state, "config": config}.items() if k != "digest"}
    return {**old, "digest": digest_of(old)}


def saved_midway(loader, steps: int, field: str | None) -> tuple[dict, list]:
    """Take `steps` steps of `loader`'s epoch, save its state as an odb before `field` existed wrote it
    (`saved_without`; None: as this odb writes it), through JSON as a checkpoint holds it, then run the rest of the
    epoch and close the loader: the state and the rest's `StepInfo`s, which a resume of that state must give or
    refuse."""
    it = iter(loader)
    for _ in range(steps):
        next(it)
    state = json.loads(json.dumps(loader.state_dict()))
    state = state if field is None else saved_without(state, field)
    rest = [b.info for b in it]
    loader.close()
    return state, rest


@pytest.fixture
def small_dataset() -> LengthDataset:
    return LengthDataset(lognormal_lengths(300, cv=1.0, mean=128, seed=1, hi=1024))


OVER_BUDGET = "alone, over the budget (oversize='alone')"  # in the one-time warning (odb_core/settings/console.py)


class OdbLog:
    """What the `odb` logger printed during a test (`odb_log`)."""

    def __init__(self, caplog: pytest.LogCaptureFixture) -> None:
        self.caplog = caplog

    def over_budget(self) -> list[str]:
        """The oversize warnings logged so far."""
        return [r.getMessage() for r in self.caplog.records if OVER_BUDGET in r.getMessage()]


@pytest.fixture
def odb_log(caplog):
    """The `odb` logger's records: it prints through a handler of its own and does not propagate to the root logger
    that caplog listens to, so caplog's handler is added to it for the test."""
    logger = logging.getLogger("odb")
    logger.addHandler(caplog.handler)
    try:
        yield OdbLog(caplog)
    finally:
        logger.removeHandler(caplog.handler)
