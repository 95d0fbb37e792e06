"""W ranks in one process: `run_virtual_ranks` runs one function per rank on threads over a `VirtualHub`.

The threads exchange through the hub with the same collectives, in the same order, as Gloo ranks, so W real
`ODBDataLoader`s (or anything else built on a `Transport`) run an epoch together without processes: the tests,
the benchmarks and users checking a multi-rank setup on one machine all start them here.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

from odb_core.ranks.sync import PeerError, Transport


class VirtualHub:
    """Rendezvous of W in-process ranks (threads). `timeout_s` bounds every exchange."""

    def __init__(self, world_size: int, timeout_s: float = 60.0) -> None:
        self.world_size = world_size
        self.timeout_s = timeout_s
        self._barrier = threading.Barrier(world_size)
        self._slots: list[list[int] | None] = [None] * world_size

    def exchange(self, rank: int, values: list[int]) -> list[list[int]]:
        try:
            self._barrier.wait(self.timeout_s)
            self._slots[rank] = list(values)
            self._barrier.wait(self.timeout_s)
            gathered = [list(v) for v in self._slots]  # type: ignore[arg-type]
            self._barrier.wait(self.timeout_s)
        except threading.BrokenBarrierError as exc:
            raise PeerError(f"virtual rank {rank}: a peer did not reach the exchange within {self.timeout_s}s") from exc
        return gathered


class VirtualTransport(Transport):
    """Rank `rank` of a `VirtualHub`: lets W loaders run as threads of one process."""

    def __init__(self, hub: VirtualHub, rank: int) -> None:
        super().__init__()
        self.hub, self.rank, self.world_size = hub, rank, hub.world_size

    def _all_gather(self, values: list[int]) -> list[list[int]]:
        return self.hub.exchange(self.rank, values)

    def _all_reduce_sum(self, values: list[int]) -> list[int]:
        gathered = self.hub.exchange(self.rank, values)
        if len({len(v) for v in gathered}) > 1:  # Gloo fails a mismatched collective too
            raise PeerError(f"virtual rank {self.rank}: the ranks' collectives do not match (a peer called another "
                            f"one: it failed or left the epoch); sizes {[len(v) for v in gathered]}")
        return [sum(column) for column in zip(*gathered, strict=True)]

    def _all_to_all_bytes(self, chunks: list[bytes]) -> list[bytes]:
        return [sent[self.rank] for sent in self.hub.exchange(self.rank, chunks)]


T = TypeVar("T")


def run_virtual_ranks(fn: Callable[[int, VirtualTransport], T], world_size: int, *, timeout_s: float = 60.0,
                      transport_class: type[VirtualTransport] = VirtualTransport) -> list[T]:
    """`fn(rank, transport)` on `world_size` threads over one `VirtualHub`; their results in rank order.

    Each rank gets `transport_class(hub, rank)` (a `VirtualTransport`, or a subclass that instruments it).
    `timeout_s` bounds every exchange of the hub: when a rank raises, its peers fail with `PeerError` at their
    next exchange within `timeout_s`. Returns when every thread has ended; the first exception raised on any
    rank (in time order) is re-raised here. A rank blocked outside the hub is not interrupted.
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size!r}: it must be an int >= 1 (the number of virtual ranks)")
    hub = VirtualHub(world_size, timeout_s=timeout_s)
    results: list = [None] * world_size
    errors: list[BaseException] = []
    threads = [threading.Thread(target=_run_rank, args=(fn, rank, transport_class(hub, rank), results, errors),
                                name=f"odb-virtual-rank-{rank}", daemon=True) for rank in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


def _run_rank(fn: Callable[[int, VirtualTransport], T], rank: int, transport: VirtualTransport, results: list,
              errors: list[BaseException]) -> None:
    """One rank's thread: its result into `results[rank]`, or its exception onto `errors`."""
    try:
        results[rank] = fn(rank, transport)
    except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread by run_virtual_ranks
        errors.append(exc)
