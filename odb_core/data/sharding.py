"""How a dataset is dealt over ranks, beside the samplers of samplers.py.

`shard` is every rank's stream of a dataset's lengths, dealt exactly as the loader's own sampler deals the samples:
the input `simulate_epoch` takes, so `odb plan` (cli.py) and the benchmarks plan whole epochs from lengths alone, on
the same per-rank streams the real loader would read with `shuffle=True` (`ShardedSampler`). `rank_sharding` says
whether the loader shards a stream over ranks itself (NOTE [ Streams already split over ranks ]).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from odb_core.data.samplers import ShardedSampler
from odb_core.data.stream_epoch import from_datasets
from odb_core.planning.budget import Item
from odb_core.settings.console import LOGGER


def shard(lengths: Sequence[int], world: int, seed: int, epoch: int = 0) -> list[list[Item]]:
    """Each rank's stream exactly as the loader's own sampler (`shuffle=True`) deals it."""
    return [[Item(i, int(lengths[i])) for i in ShardedSampler(len(lengths), rank=r, world_size=world, shuffle=True,
                                                              seed=seed).with_epoch(epoch)]
            for r in range(world)]


def rank_sharding(dataset: Any, shard: bool, *, rank: int, world_size: int) -> bool:
    """NOTE [ Streams already split over ranks ]
    HF `datasets`' `split_dataset_by_node(stream, rank, world_size)` gives each rank its own part of a stream; ODB's
    default `shard_iterable=True` then kept 1/W of that part, and (W - 1)/W of the data went untrained without a
    word. So a `datasets` stream split for this rank and world is read whole, as with `shard_iterable=False`; one
    split for another rank or world is refused; an unsplit one read whole on each rank (`shard_iterable=False` at
    W > 1) is warned about: unless it holds the rank's part only (a `.shard()`, the rank's own files), which the
    stream does not record, each of its samples trains W times. (`datasets` keeps the split in the
    stream's `_distributed`, its only record of it.) Other streams are the user's: `shard_iterable=False` says that
    they are split already. Returns whether ODB shards the stream over ranks."""
    if not from_datasets(dataset):
        return shard
    split = getattr(dataset, "_distributed", None)
    if split is not None and (split.rank, split.world_size) != (rank, world_size):
        raise ValueError(f"rank {rank}: the stream was split with split_dataset_by_node(rank={split.rank}, "
                         f"world_size={split.world_size}), but this is rank {rank} of {world_size}; split it with "
                         "this process's rank and world size, or pass the whole stream and let ODB shard it")
    if split is None and not shard and world_size > 1:
        LOGGER.warning("rank %d: the stream is read whole on each rank (shard_iterable=False) and was not split with "
                       "split_dataset_by_node: unless it holds this rank's part only (a .shard(), this rank's own "
                       "files), each sample trains %d times; leave shard_iterable at True for a stream every rank "
                       "reads whole", rank, world_size)
    return shard and split is None
