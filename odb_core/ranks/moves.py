"""Moving samples between ranks under global planning: the only data that crosses ranks.

NOTE [ Moving samples ]
A pooled plan (NOTE [ Pooled rounds ]) may put a sample that rank o read into a group that rank d runs. Every rank
knows the whole plan, so both ends know the move without asking: rank o's outgoing list to d is, in step order,
the items of d's slots whose owner is o, and rank d expects exactly that list from o. Two ways to move:
  * `send` (`SendMoves`): rank o pickles the processed samples (top-level tensors as numpy arrays) and one
    `all_to_all_bytes` per round carries each list to its rank; a sample that stays is never sent. Works for any
    dataset, streams included; the receiving rank only unpickles.
  * `fetch` (`FetchMoves`): rank d re-reads `dataset[index]` in its trainer process (map-style datasets only, so the
    sample's processing runs a second time there), and rank o drops its copy.
Both give the same batches (the collated samples are the same), so the choice never changes the plan.
"""

from __future__ import annotations

import pickle
from collections import defaultdict, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from odb_core.data.sources import pack_sample, unpack_sample
from odb_core.planning.budget import Item
from odb_core.planning.pooled import PooledRound
from odb_core.ranks.sync import Transport

Key = tuple[int, int]  # (owner rank, dataset index)


def outgoing(plan: PooledRound, rank: int) -> dict[int, list[Item]]:
    """Per destination rank, this rank's items that run there, in step order."""
    out: dict[int, list[Item]] = defaultdict(list)
    for step in plan.steps:
        for dest, slot in enumerate(step):
            if dest != rank and slot is not None:
                out[dest].extend(it for it in slot.items if it.owner == rank)
    return out


def incoming(plan: PooledRound, rank: int) -> dict[int, list[Item]]:
    """Per owner rank, the items of this rank's slots that owner read, in step order."""
    out: dict[int, list[Item]] = defaultdict(list)
    for step in plan.steps:
        slot = step[rank]
        if slot is not None:
            for it in slot.items:
                if it.owner != rank:
                    out[it.owner].append(it)
    return out


@dataclass(slots=True)
class Arrivals:
    """Samples moved to this rank in one round, taken by (owner, index) in the order they were sent."""

    by_key: defaultdict[Key, deque[Any]] = field(default_factory=lambda: defaultdict(deque))
    samples: int = 0
    bytes_in: int = 0
    bytes_out: int = 0

    def put(self, key: Key, sample: Any) -> None:
        self.by_key[key].append(sample)
        self.samples += 1

    def take(self, key: Key) -> Any:
        return self.by_key[key].popleft()


class SendMoves:
    """`move="send"`: the owners send the processed samples (one all_to_all of bytes per round)."""

    def __init__(self, transport: Transport) -> None:
        self.transport = transport

    def exchange(self, plan: PooledRound, take_own: Callable[[int], Any]) -> Arrivals:
        rank, world = self.transport.rank, self.transport.world_size
        sends = outgoing(plan, rank)
        chunks = [b""] * world
        for dest, items in sends.items():
            chunks[dest] = pickle.dumps([pack_sample(take_own(it.index), limit_bytes=None) for it in items],
                                        protocol=pickle.HIGHEST_PROTOCOL)
        received = self.transport.all_to_all_bytes(chunks)
        arrivals = Arrivals(bytes_in=sum(len(c) for c in received), bytes_out=sum(len(c) for c in chunks))
        for owner, items in incoming(plan, rank).items():
            for item, sample in zip(items, pickle.loads(received[owner]), strict=True):
                arrivals.put((owner, item.index), unpack_sample(sample))
        return arrivals


class FetchMoves:
    """`move="fetch"`: the receiving rank re-reads each moved index; the owner drops its copy."""

    def __init__(self, rank: int, fetch: Callable[[int], Mapping[str, Any]]) -> None:
        self.rank, self.fetch = rank, fetch

    def exchange(self, plan: PooledRound, take_own: Callable[[int], Any]) -> Arrivals:
        for items in outgoing(plan, self.rank).values():
            for item in items:
                take_own(item.index)
        arrivals = Arrivals()
        for owner, items in incoming(plan, self.rank).items():
            for item in items:
                arrivals.put((owner, item.index), self.fetch(item.index))
        return arrivals
