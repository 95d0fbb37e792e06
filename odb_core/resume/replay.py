"""What a resumed epoch reads, checked against what the saved run read: the rank's index order and the saved
round's samples.

NOTE [ A resume reads what the save read ]
An exact resume replays the saved round from the stream position `consumed` and drops the steps already trained
(NOTE [ Exact resume ] in odb_core/epoch/pipeline.py). That is right only where the resumed run reads the same
indices in the same order and finds the same lengths. A user sampler drawn with another seed (or an unseeded
`RandomSampler`), or a dataset re-tokenized between the runs, made the replayed round plan other batches; the
steps it dropped were then not the ones trained, and a join epoch repeated some samples and never trained others,
without an error (a review's runs: 16 repeated and 9 lost; 3 and 4 after a lower cutoff). The checks against the
sampler's descriptor and the buffered indices (NOTE [ A state proves itself ] in state.py) cannot see either.

So every `RoundStart` carries two digests (blake2b, 64 bits): `order_digest`, of the rank's index order for the
epoch (map-style data), and `lengths_digest`, of the round's buffered samples once its fill ended (their index,
length and vision patches, sorted). A resumed `iter()` draws the order before its workers start and refuses
another one; the replayed round's fill is compared before its plan, so before that rank enters any collective
of the round (where only some ranks refuse, the others fail at the round's exchange with a `PeerError`, as for any
error of a peer). Both refusals are `StateError`s naming the epoch (the round too, for a fill) and what changes an
order or a length. A user sampler is no longer drawn when the state is loaded (its position is checked against the
order `iter()` draws): a sampler holding a generator drew its next order there, and `iter()` another one than the
saved run's. Each epoch's order is drawn once (`ChunkSampler.draw`), not at each of the two `iter()`s torch runs
on a batch sampler when it starts worker processes, which made the order read by the workers another than the one
drawn first (and the batches depend on `num_workers`, with such a sampler).

Cost: a copy of the buffer's list of items per round (the `RoundLog` keeps it, and the epoch's order, while
the consumer may still save in that round); the digests are taken only when a position is saved (`state_dict()`,
a `close()` inside an epoch; the order's once per epoch), and once more by a resume. A state saved before the
digests records none and resumes unchecked, as before; so does a stream (`IterableDataset`) for its order, which
cannot be drawn ahead (its replayed positions are checked as it is skipped, `skip_stream`), while its rounds'
lengths are checked like any other's.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from odb_core.data.sendable import unpack_sample
from odb_core.planning.budget import Item
from odb_core.resume.fields import StateError
from odb_core.resume.state import ResumePoint, RoundStart, check_in_order

_SAME_DATA = ("resume with the data, processing and sampler the saved run had, or start the epoch anew with a "
              "fresh loader")


def _digest(values: np.ndarray) -> str:
    return hashlib.blake2b(np.ascontiguousarray(values, dtype=np.int64).tobytes(), digest_size=8).hexdigest()


def order_digest(order: Sequence[int]) -> str:
    """The digest of a rank's index order for an epoch."""
    return _digest(np.asarray(order, dtype=np.int64))


def lengths_digest(items: Iterable[Item]) -> str:
    """The digest of a round's buffered samples: (index, length, patches) of each, in sorted order."""
    rows = sorted((item.index, item.length, item.patches) for item in items)
    return _digest(np.asarray(rows, dtype=np.int64).reshape(-1))


def check_drawn_order(point: ResumePoint, order: Sequence[int], epoch: int) -> None:
    """Refuse to resume at `point` on an epoch whose drawn `order` is not the saved run's, or does not hold the
    position's samples (a state without a digest: only the latter)."""
    start = point.start
    if start.order_digest is not None and order_digest(order) != start.order_digest:
        raise StateError(f"this rank's sampler drew another order of indices for epoch {epoch} than the run that "
                         f"saved the state (state.position.start.order_digest): a sampler seeded otherwise, an "
                         f"unseeded RandomSampler, a generator drawn another number of times before this epoch (one "
                         f"seeded once and drawn at every epoch resumes only in its first: use a sampler whose order "
                         f"is a function of set_epoch, as DistributedSampler or ODB's own, without sampler=), or a "
                         f"dataset of another size. Replaying the saved round on it would repeat some samples and "
                         f"skip others; {_SAME_DATA}")
    check_in_order(point, order, epoch)


def check_replayed_round(start: RoundStart, items: Iterable[Item], epoch: int) -> None:
    """Refuse a replayed round whose fill (the buffered `items`) is not the one the saved run planned."""
    if start.lengths_digest is not None and lengths_digest(items) != start.lengths_digest:
        raise StateError(f"the samples of round {start.round} of epoch {epoch}, which the resume replays, are not "
                         f"the ones the saved run planned (state.position.start.lengths_digest): their lengths "
                         f"or indices changed, e.g. the dataset was re-tokenized, or its template, cutoff, "
                         f"length_fn or the sampler's order changed. Replaying it would train other batches than "
                         f"the steps it skips; {_SAME_DATA}")


def skip_stream(chunks: Iterator[list[tuple[int, Any]]], start: RoundStart
                ) -> tuple[dict[int, Any], Iterator[list[tuple[int, Any]]]]:
    """Read the first `start.consumed` samples of a tagged chunk stream, keeping those the round needs again (its
    buffer and IDLE dummy); returns them and the rest of the stream (resume of an iterable dataset: it can only be
    re-read from its start). Refuses a stream that does not hold them there."""
    needed = set(start.buffer) | ({start.dummy_index} if start.dummy_index is not None else set())
    kept: dict[int, Any] = {}
    seen, consumed = 0, start.consumed
    rest: list[tuple[int, Any]] = []
    while seen < consumed:
        chunk = next(chunks, None)
        if chunk is None:
            raise RuntimeError(f"the resumed stream ended after {seen} samples, but the saved position is at "
                               f"{consumed}: the IterableDataset does not replay the same samples")
        take = min(len(chunk), consumed - seen)
        for index, sample in chunk[:take]:
            if index in needed:
                kept[index] = unpack_sample(sample)
        seen += take
        rest = chunk[take:]
    missing = sorted(needed - set(kept))
    if missing:
        raise StateError(f"state.position.start names stream positions {missing[:8]} that the stream's first "
                         f"{consumed} samples do not hold: the state is corrupt, or the IterableDataset does not "
                         "replay the same samples")
    return kept, itertools.chain([rest] if rest else [], chunks)
