"""Which indices a rank reads, in which order: ODB's own rank sharding, an elastic remainder's fixed list, and the
chunks the workers fetch (NOTE [ Workers emit tagged samples ] in sources.py)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator

import torch
from torch.utils.data import Sampler


class ShardedSampler(Sampler[int]):
    """ODB's own rank sharding: rank r takes positions r, r+W, r+2W, ... of the (optionally shuffled) order.

    Unlike `DistributedSampler` it neither pads nor drops: ranks may get counts that differ by one, or a rank may
    get none. ODB's alignment makes the step counts equal anyway. The shuffle is a function of (seed, epoch).
    """

    def __init__(self, size: int, *, rank: int, world_size: int, shuffle: bool, seed: int) -> None:
        self.size, self.rank, self.world_size = size, rank, world_size
        self.shuffle, self.seed, self.epoch = shuffle, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def with_epoch(self, epoch: int) -> list[int]:
        """This rank's indices for `epoch` (without changing the sampler's own epoch)."""
        saved, self.epoch = self.epoch, epoch
        try:
            return list(iter(self))
        finally:
            self.epoch = saved

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
            order = torch.randperm(self.size, generator=generator).tolist()
        else:
            order = list(range(self.size))
        return iter(order[self.rank :: self.world_size])

    def __len__(self) -> int:
        return len(range(self.rank, self.size, self.world_size))


class IndexListSampler(Sampler[int]):
    """A fixed list of this rank's indices, in order: the remainder of an epoch after an elastic resume (see
    NOTE [ Elastic resume ] in `resume.py`). It has no `set_epoch`: it serves exactly one epoch."""

    def __init__(self, indices: list[int]) -> None:
        self.indices = list(indices)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


class ChunkSampler(Sampler[list[int]]):
    """Cuts a sampler's indices into chunks of `chunk`, after skipping the first `start` indices (resume)."""

    def __init__(self, sampler: Sampler[int], chunk: int) -> None:
        self.sampler, self.chunk, self.start = sampler, chunk, 0
        self.order: list[int] = []  # this epoch's indices: lets a non-join report name the never-read ones
        self.drawn = False  # an order was drawn: every `iter()` reads it until the next `draw()`

    def draw(self) -> list[int]:
        """Draw an epoch's order (`SampleStream.open`, at each epoch, before the workers start: a resume checks it).
        torch iterates a DataLoader's batch sampler twice when it starts worker processes (once where its iterator
        is built, once where it is reset), so the order cannot be drawn by `iter()`: with a sampler that holds a
        generator, the workers would read another order than the one drawn (and checked) first."""
        self.order, self.drawn = [int(i) for i in self.sampler], True
        return self.order

    def __iter__(self) -> Iterator[list[int]]:
        """The drawn order in chunks, from `start`: a `set_epoch` after the draw does not change it (G7)."""
        indices = iter((self.order if self.drawn else self.draw())[self.start :])
        return iter(lambda: list(itertools.islice(indices, self.chunk)), [])

    def __len__(self) -> int:
        return math.ceil(max(len(self.sampler) - self.start, 0) / self.chunk)  # type: ignore[arg-type]
