"""A stream's epoch, carried to persistent DataLoader workers.

NOTE [ A stream's epoch in persistent workers ]
The loader calls a stream's `set_epoch` in the rank's process at each epoch. A persistent DataLoader worker keeps
the copy of the dataset it started with, so a stream that shuffles by `set_epoch` (a torch `IterableDataset` of
the user's) read epoch 0's order in every epoch under `persistent_workers=True`, while a resume inside a later
epoch, with fresh workers, read that epoch's order: other batches than the uninterrupted run's, without an error
(a review's run). `SharedEpoch` wraps such a stream: it keeps the epoch in a shared-memory tensor, which the
workers' copies share, and sets it on the worker's copy of the stream at each `iter()` there. HF `datasets`
streams share their epoch with their workers themselves and are not wrapped, nor is a stream without `set_epoch`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info


def from_datasets(dataset: Any) -> bool:
    """Whether `dataset` is one of the HF `datasets` package's own classes (a stream that shares its epoch with its
    workers, splits itself over them by shards, and records a split over ranks)."""
    return type(dataset).__module__.split(".")[0] == "datasets"


class SharedEpoch(IterableDataset):
    """`dataset`, whose `set_epoch` also reaches its copies in persistent workers (see the NOTE above)."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset
        self.epoch = torch.zeros((), dtype=torch.int64).share_memory_()

    @staticmethod
    def needed(dataset: Any, num_workers: int) -> bool:
        """Whether `dataset` is a stream with `set_epoch` that workers read from copies of their own."""
        return num_workers > 0 and hasattr(dataset, "set_epoch") and not from_datasets(dataset)

    def set_epoch(self, epoch: int) -> None:
        self.epoch.fill_(epoch)
        self.dataset.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        if get_worker_info() is not None:  # a worker's copy: the epoch the rank set last
            self.dataset.set_epoch(int(self.epoch))
        return iter(self.dataset)
