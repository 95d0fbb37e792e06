"""Moves that overlap training: a round's moved samples travel on a lane of their own while its steps train.

NOTE [ Moves overlap training ]
Under global planning most of a round's samples run on another rank than the one that read them (NOTE [ Moving
samples ]). Moved in line, the round's steps could not be released before the move had ended: the round's
all_reduce needs every step's supervised and input tokens, and a rank can count a moved sample only once it holds
it. For a VLM round that is about a second per round at W = 64 (docs/design.md, "Keeping the accelerator fed",
item 4) with the accelerator idle. So, when the loader has a move lane (`overlap_moves=True`, `move="send"`,
global planning, W > 1; `MoveLane`):
  1. right after the plan, on the thread that runs the rounds, each owner takes the samples it sends, counts each
     one's facts (`FACT_FIELDS` ints: supervised tokens as a label-preserving collator counts them, whether it has
     labels, and its input tokens when a `length_fn` sets the length) and pickles them with their arrays out of
     band (the pickling is where a sample that cannot travel fails, on its owner, at once: `SampleError`);
  2. the facts travel in one `all_to_all_bytes` on the metadata transport, in the rounds' collective order (every
     rank calls it every pooled round, with or without moves): a few ints per moved sample, the size of each
     chunk's frame (so `LoaderMetrics.moved_bytes` is counted at the plan, as in line), and whether the owner
     passes shared tensors by handle this round (NOTE [ Moving shared tensors by handle ]);
  3. the samples travel on the lane, a second Gloo group with a courier thread of its own, driven by one
     `ThreadPoolExecutor` thread per loader ("odb-moves"): the frames are written (the one copy of the arrays),
     exchanged and decoded there, in chunks of steps (`step_chunks`: step 0, then 1-2, 3-6, ..., one exchange
     each), in step order and round order on every rank. One exchange for the whole round would end only when
     the round's last byte came, and the round's first step, which mixes samples from every rank, would wait for
     all of it: with chunks it waits for its own samples, and each later chunk moves while the steps before it
     train;
  4. the round's steps are counted from the samples this rank holds and the facts of those it waits for (a
     `Moved` stands for each), the all_reduce runs and the steps are released at once; a step waits for its
     moved samples only when it is collated (taken, or collated ahead), so only the part of the move that the
     steps before it did not cover is a stall. A collator that is not label-preserving collates at plan time,
     so its round waits for the move as before (the facts exchange still runs: the collective order must not
     depend on the collator).
The plan, the collectives on the metadata transport and their order, the batches and every `StepInfo` field are
those of moving in line: the counts are sums of the same per-sample facts (tested against `overlap_moves=False`
on virtual and Gloo ranks). The lane's exchanges never wait for a step: exchange k needs only every rank's lane
thread, which starts it right after plan k, so it ends whatever the consumers do, and the lanes' exchanges pair
up in order (one thread each; every rank has the same steps, so the same chunks). The next round's start and the
epoch's end wait for the exchanges in flight, so at most one round's are. Faults: a peer
that dies mid-move fails the lane's collective (its sockets close, or the shared heartbeat finds it silent within
`liveness_timeout_s`), and the step that waits for the move raises that `PeerError`. Cost: the frames of one
round in flight (sent and received) beside the buffer; one Gloo group and two threads per loader.
"""

from __future__ import annotations

import bisect
import dataclasses
import threading
from collections import defaultdict
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from odb_core.data.collate import sample_supervised_tokens
from odb_core.data.region_maps import flush_borrowed
from odb_core.data.sample import LengthFn, input_tokens
from odb_core.data.sendable import pack_sample, unpack_sample
from odb_core.planning.pooled import PooledRound
from odb_core.ranks.moves import (Pickled, decode_samples, frame_of, frame_size, incoming, outgoing, pickle_samples,
                                  unsendable)
from odb_core.ranks.shared_handles import HandleRoutes, from_handles, to_handles
from odb_core.ranks.sync import PeerError, Transport

LANE_THREAD = "odb-moves"  # the lane's thread, named for its own close (a finalizer may run on it)
FACT_FIELDS = 3  # per moved sample: supervised tokens, has labels (0/1), input tokens (with a length_fn; else 0)


def sample_facts(sample: Mapping[str, Any], length_fn: LengthFn | None) -> tuple[int, int, int]:
    """What a receiving rank needs to count a moved sample into its step before the sample arrives."""
    return (sample_supervised_tokens([sample]), int("labels" in sample),
            input_tokens(sample) if length_fn is not None else 0)


Received = dict[int, list[Any]]  # what one exchange on the lane brought: the samples per owner, in the order sent


@dataclass(frozen=True, slots=True)
class Moved:
    """A moved sample's place in a planned step until it arrives: its facts, and where it will be."""

    flight: MovesInFlight
    owner: int  # the owner's rank on the lane (a node's local rank under node-aware rounds)
    position: int
    supervised: int
    labelled: bool
    input_tokens: int

    def sample(self) -> Any:
        """The sample itself, waiting for its chunk's exchange if it has not ended."""
        return self.flight.sample(self.owner, self.position)


@dataclass(slots=True)
class MovesInFlight:
    """One round's moves on the lane: the facts now, the samples as each exchange of `futures` ends (one per
    chunk of steps, `step_chunks`; `starts[owner][c]` is the position of chunk c's first sample from `owner`).
    `take` hands out the `Moved` of the next item from an owner, in the order sent (`RankRound.arrivals`'
    interface)."""

    facts: dict[int, list[list[int]]]
    futures: list[Future[Received]]
    starts: dict[int, list[int]]
    samples: int
    bytes_in: int  # the frames' bytes this rank receives (their sizes travel with the facts)
    offset: int = 0  # what `take` subtracts from an owner (world ranks under node-aware rounds)
    bytes_out: int = 0  # `Arrivals`' field: bytes sent on the metadata transport (the lane has its own stats)
    claimed: defaultdict[int, int] = field(default_factory=lambda: defaultdict(int))

    def take(self, key: tuple[int, int]) -> Moved:
        owner = key[0] - self.offset
        position = self.claimed[owner]
        self.claimed[owner] = position + 1
        supervised, labelled, tokens = self.facts[owner][position]
        return Moved(self, owner, position, supervised, bool(labelled), tokens)

    def sample(self, owner: int, position: int) -> Any:
        """A received sample (waiting for its chunk's exchange), dropped from here once handed out, so that it is
        freed with its step."""
        starts = self.starts[owner]
        chunk = bisect.bisect_right(starts, position) - 1  # the last chunk that starts at or before it
        box = self.futures[chunk].result()[owner]
        local = position - starts[chunk]
        sample, box[local] = box[local], None
        return sample

    def settle(self) -> None:
        """Wait for every exchange of the round; raises what an exchange raised."""
        for future in self.futures:
            future.result()

    def in_cluster(self, offset: int) -> MovesInFlight:
        return dataclasses.replace(self, offset=offset)


def step_chunks(n_steps: int) -> list[range]:
    """The round's steps as the lane moves their samples, one exchange each: step 0, steps 1-2, 3-6, 7-14, ...
    (each chunk twice the last). A step waits only for its own chunk, which moved while the steps before it
    trained: the first step waits for one step's samples, not the round's."""
    chunks, start, size = [], 0, 1
    while start < n_steps:
        chunks.append(range(start, min(start + size, n_steps)))
        start, size = start + size, size * 2
    return chunks


class MoveLane:
    """A loader's lane for samples (NOTE [ Moves overlap training ]): a transport of its own over the ranks that
    exchange samples (the world, or the node), and the one thread that runs its exchanges in round order.

    Opened by the first epoch that moves samples (`opened`, on the thread that calls `iter()`, at the same point
    on every rank): opening is a collective, and runs the settings check first, so that ranks that disagree raise
    `DesyncError` from their first exchange, as they do without a lane. `open_transport` returns None where the
    transport cannot make a lane (moves then run in line)."""

    def __init__(self, open_transport: Callable[[], Transport | None], shared_memory: bool = True,
                 open_files: int = 0) -> None:
        self._open: Callable[[], Transport | None] | None = open_transport
        self.shared_memory, self.open_files = shared_memory, open_files
        self.transport: Transport | None = None
        self.routes = HandleRoutes(())  # NOTE [ Moving shared tensors by handle ]
        self._thread: ThreadPoolExecutor | None = None

    def opened(self) -> bool:
        if self._open is not None:
            open_transport, self._open = self._open, None
            self.transport = open_transport()
            if self.transport is not None:
                self.routes = HandleRoutes.open(self.transport, self.shared_memory, self.open_files)
                self._thread = ThreadPoolExecutor(1, thread_name_prefix=LANE_THREAD)
        return self._thread is not None

    def submit(self, pickled: list[Pickled | None], keep: list[torch.UntypedStorage],
               meet: bool) -> Future[Received]:
        """One exchange (a chunk's frames per destination), run after those submitted before it; `keep` holds the
        storages its handles point at until every rank has opened them (`meet`: a rank of the lane sends handles in
        this round, which every rank knows from the facts)."""
        assert self._thread is not None and self.transport is not None, "submit() on a lane that is not open"
        return self._thread.submit(_exchange, self.transport, pickled, keep, meet)

    def close(self) -> None:
        """End the thread after the exchange in flight (bounded by the lane's timeouts), then the transport."""
        self._open = None
        if self._thread is not None:  # not waiting for itself, from a finalizer the collector ran on the lane's thread
            own = threading.current_thread().name.startswith(LANE_THREAD)
            self._thread.shutdown(wait=not own, cancel_futures=True)
            self._thread = None  # a second close (the loader's finalizer at interpreter exit) has nothing to end
        if self.transport is not None:
            self.transport.close()


def _exchange(lane: Transport, pickled: list[Pickled | None], keep: list[torch.UntypedStorage],
              meet: bool) -> Received:
    """On the lane's thread: write the frames, exchange them, decode what came (opening the handles' files), and
    where handles travel, meet the lane's ranks before `keep` is let go."""
    try:
        failure: BaseException | None = None
        try:
            flush_borrowed()  # the halves of lent spans given back here since: the peers' workers reuse them
            frames: list[bytes | np.ndarray] = [b"" if p is None else frame_of(p) for p in pickled]
        except Exception as exc:  # noqa: BLE001 - NOTE [ A failed exchange keeps the lane in step ]
            failure = exc
            cause = f"rank {lane.rank} could not send its samples of this exchange ({type(exc).__name__}: {exc})"
            frames = [b"" if dest == lane.rank else _ABORT + cause.encode() for dest in range(lane.world_size)]
        received = lane.all_to_all_bytes(frames)
        del frames, pickled
        samples: Received = {}
        try:
            for owner, chunk in enumerate(received):
                if owner != lane.rank and len(chunk):
                    if bytes(memoryview(chunk)[: len(_ABORT)]) == _ABORT:
                        raise PeerError(f"ODB: {bytes(memoryview(chunk)[len(_ABORT):]).decode(errors='replace')}; "
                                        "this round's moved samples cannot arrive (that rank's own error says why)")
                    samples[owner] = [from_handles(unpack_sample(s)) for s in decode_samples(chunk)]
                    received[owner] = b""  # its arrays hold the chunk now, and free it with their samples
        except BaseException as exc:  # noqa: BLE001 - raised below, once the ranks have met
            failure = failure or exc
        if meet:  # even after a failure here, so that every lane stays in step
            try:
                lane.all_gather([0])  # every rank has opened the files of the handles it received
            except BaseException:
                if failure is None:
                    raise
        if failure is not None:
            raise failure
        return samples
    finally:
        keep.clear()  # also on failure: a traceback kept by the future must not keep the storages


# NOTE [ A failed exchange keeps the lane in step ]
# The lane's exchanges pair up by order: a rank whose exchange k failed before its collective (a frame it could not
# allocate) and went on to exchange k + 1 paired that with its peers' k, so they decoded the next chunk's samples as
# this one's and trained on wrong samples without a word, until a bare IndexError. So a rank whose frames fail still
# takes part in the collective, sending each peer `_ABORT` and the cause instead of a frame: exchange k fails on
# every rank (a `PeerError` naming the rank and the cause on the others, its own error there), and the exchanges
# after it stay paired. A frame's header starts with its buffer count, never -1.
_ABORT = np.array([-1], dtype="<i8").tobytes() + b"odb-abort:"


class OverlappedMoves:
    """`move="send"` with a lane: facts on the metadata transport, samples on the lane (NOTE [ Moves overlap
    training ]). `transport` and the lane number the same ranks the same way."""

    def __init__(self, transport: Transport, lane: MoveLane, length_fn: LengthFn | None) -> None:
        self.transport, self.lane, self.length_fn = transport, lane, length_fn

    def exchange(self, plan: PooledRound, take_own: Callable[[int], Any]) -> MovesInFlight:
        rank, world = self.transport.rank, self.transport.world_size
        step_ranges = step_chunks(len(plan.steps))
        chunks: list[tuple[list[Pickled | None], list[torch.UntypedStorage]]] = []
        routes = self.lane.routes
        facts_out: list[list[tuple[int, int, int]]] = [[] for _ in range(world)]
        sizes_out = [[0] * len(step_ranges) for _ in range(world)]  # frame bytes per chunk
        starts: defaultdict[int, list[int]] = defaultdict(list)
        arrived = [0] * world  # samples from each owner in the chunks so far
        for c, steps in enumerate(step_ranges):
            part = dataclasses.replace(plan, steps=plan.steps[steps.start : steps.stop])
            pickled: list[Pickled | None] = [None] * world
            keep: list[torch.UntypedStorage] = []
            for dest, items in outgoing(part, rank).items():
                samples = [take_own(it.index) for it in items]
                facts_out[dest] += [sample_facts(s, self.length_fn) for s in samples]
                handled = 0
                if routes.to[dest]:  # NOTE [ Moving shared tensors by handle ]
                    handles = [to_handles(s, keep) for s in samples]
                    samples, handled = [s for s, _ in handles], sum(n for _, n in handles)
                packed = [pack_sample(s, limit_bytes=None) for s in samples]
                try:
                    pickled[dest] = pickle_samples(packed)
                except Exception as exc:  # noqa: BLE001 - name the sample that cannot travel
                    raise unsendable(items, packed, rank, dest) from exc
                sizes_out[dest][c] = frame_size(pickled[dest]) + handled
            chunks.append((pickled, keep))
            arriving = incoming(part, rank)
            for owner in range(world):
                starts[owner].append(arrived[owner])
                arrived[owner] += len(arriving.get(owner, ()))
        n_chunks = len(chunks)
        sends_handles = int(any(keep for _, keep in chunks))  # to every rank: all know whether the lane meets
        facts_in = [np.frombuffer(bytes(b), dtype="<i8") for b in self.transport.all_to_all_bytes(
            [np.array([sends_handles, *sizes] + [x for fact in f for x in fact], dtype="<i8").tobytes()
             for sizes, f in zip(sizes_out, facts_out, strict=True)])]
        meet = any(int(v[0]) for v in facts_in)
        facts = {owner: facts_in[owner][1 + n_chunks :].reshape(-1, FACT_FIELDS).tolist()
                 for owner in range(world) if arrived[owner]}
        bytes_in = sum(int(v[1 : 1 + n_chunks].sum()) for owner, v in enumerate(facts_in) if owner != rank)
        for owner, sent in facts.items():
            if len(sent) != arrived[owner]:
                raise RuntimeError(f"rank {rank}: rank {owner} sent the facts of {len(sent)} samples where the plan "
                                   f"moves {arrived[owner]} from it: the ranks do not run the same plan")
        futures = [self.lane.submit(pickled, keep, meet) for pickled, keep in chunks]  # in step order, on every rank
        return MovesInFlight(facts, futures, dict(starts), samples=sum(arrived), bytes_in=bytes_in)
