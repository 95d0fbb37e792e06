"""Every rank's stream of a dataset's lengths, dealt exactly as the loader's own sampler deals the samples.

`shard` is the input `simulate_epoch` takes: `odb plan` (cli.py) and the benchmarks plan whole epochs from
lengths alone, on the same per-rank streams the real loader would read with `shuffle=True` (`ShardedSampler`).
"""

from __future__ import annotations

from collections.abc import Sequence

from odb_core.data.sources import ShardedSampler
from odb_core.planning.budget import Item


def shard(lengths: Sequence[int], world: int, seed: int, epoch: int = 0) -> list[list[Item]]:
    """Each rank's stream exactly as the loader's own sampler (`shuffle=True`) deals it."""
    return [[Item(i, int(lengths[i])) for i in ShardedSampler(len(lengths), rank=r, world_size=world, shuffle=True,
                                                              seed=seed).with_epoch(epoch)]
            for r in range(world)]
