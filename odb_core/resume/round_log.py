"""Where the consumer of an epoch stands: the start of each round and the position after each consumed step.

The producer (the epoch's round loop, maybe on a background thread) records every round's `RoundStart` and the
metrics snapshot taken at the same point before any step of that round is released, and the epoch's step count
before its last round's steps are released. The consumer (the iterator the trainer holds) reports each batch it
hands out; `position` is then what `state_dict()` saves (NOTE [ Exact resume ] in pipeline.py). Rounds before the
consumer's are dropped, so the log holds O(rounds in flight) entries.

NOTE [ A step is logged whole ]
A signal handler may raise at almost any point of Python code on the main thread (Python's own on Ctrl-C; torch's
SIGCHLD handler for another DataLoader's worker, or for ODB's own where ODB's handler is not installed:
NOTE [ A dead worker's signal ] in child_signal.py), so `consume` can be cut anywhere. It therefore builds the new
position first and commits it with one assignment (`_Held`: the position and how many entries of the round's emitted
list belong to it); cut before that, its committed position is as it was, and `state_dict()` saves the previous step's
position, never a mix of the two steps. Cut after it (before `next()` returns), the step counts as taken though the
caller never received it, and a state saved then resumes after that step: a failing epoch, whose position is kept only
for a save after the failure.

NOTE [ Which last step is complete ]
A position after an epoch's last step is saved as complete (`epoch_complete`: the resumed loader's `iter()` yields
nothing and runs no collective) only where the step's own round planned the epoch's end. An epoch may also end in a
round that plans no step (pooled quota rounds whose pool cannot fill a band; a join epoch whose last samples went
out the round before): the last step's round did not know it, and when the empty round's end reaches this log
depends on threads (`plan_ahead`, `prefetch_steps`) and on the other ranks. Taken from whenever it arrived, ranks
saved after the same step disagreed (some complete, some not), and the resume refused them as saved after different
steps. Now such a position is incomplete on every rank alike: a resume replays the last round to the empty one,
whose collective every rank runs, and the epoch yields nothing more (the HF adapter's view then moves on to the next
epoch: NOTE [ Resuming at an epoch's end ] in odb_core/epoch/epoch_length.py).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from odb_core.planning.budget import Item
from odb_core.resume.replay import check_replayed_round, lengths_digest, order_digest
from odb_core.resume.state import ResumePoint, RoundStart, SavedPosition
from odb_core.steps.step_info import StepInfo

Metrics = Mapping[str, float | int]


class _Held(NamedTuple):
    """The consumer's committed position and the first `count` entries of `emitted`, its round's emitted indices
    (the list may run past `count`: a `consume` cut before its commit)."""

    position: SavedPosition | None
    emitted: list[int]
    count: int


class RoundLog:
    """Round starts of one epoch (producer side) and the consumer's last position (consumer side)."""

    def __init__(self, resumed: SavedPosition | None, order: Sequence[int] | None = None) -> None:
        self._lock = threading.RLock()  # re-entered by a signal handler's `state_dict()` inside `consume`
        self._starts: dict[int, tuple[RoundStart, Metrics]] = {}
        self._fills: dict[int, list[Item]] = {}  # a round's buffered samples once filled: their digest when saved
        self._order, self._order_digest = order, None  # the epoch's, digested when saved: NOTE [ A resume reads ... ]
        self._replayed = resumed.point.start if resumed is not None else None  # the saved round, checked at its fill
        self._final: tuple[int, Metrics, int] | None = None  # steps, metrics, the round the epoch ended in
        self._last_round = -1
        self._owned: dict[int, tuple[int, ...]] = {}  # step -> own indices emitted by any rank (global planning)
        emitted = list(resumed.point.round_emitted) if resumed is not None else []
        self._held = _Held(resumed, emitted, len(emitted))  # NOTE [ A step is logged whole ]

    # -- producer ------------------------------------------------------------------------------------------
    def begin_round(self, start: RoundStart, metrics: Metrics) -> None:
        with self._lock:
            self._starts[start.round] = (start, dict(metrics))
            self._last_round = max(self._last_round, start.round)

    def filled(self, round_: int, items: list[Item], epoch: int) -> None:
        """The round's buffered samples once its fill ended, before its plan (a copy of the buffer's list: their
        digest is taken only when a position is saved). A resumed epoch's first round, the saved one read again, is
        refused where they are not the saved run's (NOTE [ A resume reads what the save read ] in replay.py)."""
        replayed, self._replayed = self._replayed, None
        if replayed is not None:
            check_replayed_round(replayed, items, epoch)
        with self._lock:
            self._fills[round_] = items

    def record_owned(self, first_step: int, owned_by_step: tuple[tuple[int, ...], ...]) -> None:
        """Global planning: the indices of this rank's samples that each step of the round emits on any rank
        (before the round's steps are released). `round_emitted` is made of these instead of the step's own."""
        with self._lock:
            self._owned.update((first_step + k, owned) for k, owned in enumerate(owned_by_step))

    def end_epoch(self, steps: int, metrics: Metrics, *, abandoned: bool = False) -> None:
        """The epoch has `steps` steps; `metrics` are the counters after its last one (NOTE [ Which last step is
        complete ]; an epoch a consumer left ends at whatever step it stands, as before that NOTE)."""
        with self._lock:
            self._final = (steps, dict(metrics), -1 if abandoned else self._last_round)

    # -- consumer ------------------------------------------------------------------------------------------
    def consume(self, info: StepInfo) -> None:
        """The consumer took the step `info` describes (steps arrive in order); all or nothing (NOTE [ A step is
        logged whole ])."""
        with self._lock:
            start, metrics = self._starts[info.round]
            held = self._held
            same_round = held.position is not None and held.position.point.start.round == info.round
            emitted, count = (held.emitted, held.count) if same_round else ([], 0)
            del emitted[count:]  # what a cut `consume` left past the committed entries
            emitted.extend(self._owned.get(info.step, info.indices))
            final = self._final  # only the round that planned the end knows it at its steps' release
            complete = final is not None and info.step + 1 == final[0] and final[2] in (info.round, -1)
            if complete:
                metrics = final[1]
            point = ResumePoint(start=start, steps_consumed=info.step + 1)
            window_open = 0 if info.ends_window else info.window_index + 1
            position = SavedPosition(point=point, complete=complete, metrics=metrics, window_open=window_open)
            self._held = _Held(position, emitted, len(emitted))  # the commit
            for stale in [r for r in self._starts if r < info.round]:
                del self._starts[stale]
                self._fills.pop(stale, None)
            for stale in [step for step in self._owned if step <= info.step]:
                del self._owned[stale]

    @property
    def position(self) -> SavedPosition | None:
        """The position after the last consumed step (with this round's emitted indices), or the resumed one."""
        with self._lock:
            position, emitted, count = self._held
            if position is None:
                return None
            point, items = position.point, self._fills.get(position.point.start.round)
            start = point.start if items is None else dataclasses.replace(  # None: a loaded one, not read again yet
                point.start, order_digest=self._digest_of_order(), lengths_digest=lengths_digest(items))
            return SavedPosition(point=ResumePoint(start=start, steps_consumed=point.steps_consumed,
                                                   round_emitted=tuple(emitted[:count])),
                                 complete=position.complete, metrics=position.metrics,
                                 window_open=position.window_open)

    def _digest_of_order(self) -> str | None:
        if self._order is not None and self._order_digest is None:
            self._order_digest = order_digest(self._order)
        return self._order_digest

    @property
    def complete(self) -> bool:
        """Whether the consumer took the epoch's last step (known from that step on, before the iterator's
        StopIteration; NOTE [ Epoch progress ] in odb_core/epoch/epoch_length.py)."""
        with self._lock:
            position = self._held.position
            return position is not None and position.complete
