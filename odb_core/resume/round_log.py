"""Where the consumer of an epoch stands: the start of each round and the position after each consumed step.

The producer (the epoch's round loop, maybe on a background thread) records every round's `RoundStart` and the
metrics snapshot taken at the same point before any step of that round is released, and the epoch's step count
before its last round's steps are released. The consumer (the iterator the trainer holds) reports each batch it
hands out; `position` is then what `state_dict()` saves (NOTE [ Exact resume ] in pipeline.py). Rounds before the
consumer's are dropped, so the log holds O(rounds in flight) entries.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

from odb_core.resume.state import ResumePoint, RoundStart, SavedPosition
from odb_core.steps.step_info import StepInfo

Metrics = Mapping[str, float | int]


class RoundLog:
    """Round starts of one epoch (producer side) and the consumer's last position (consumer side)."""

    def __init__(self, resumed: SavedPosition | None) -> None:
        self._lock = threading.Lock()
        self._starts: dict[int, tuple[RoundStart, Metrics]] = {}
        self._final: tuple[int, Metrics] | None = None
        self._owned: dict[int, tuple[int, ...]] = {}  # step -> own indices emitted by any rank (global planning)
        self._position = resumed
        self._emitted: list[int] = list(resumed.point.round_emitted) if resumed is not None else []

    # -- producer ------------------------------------------------------------------------------------------
    def begin_round(self, start: RoundStart, metrics: Metrics) -> None:
        with self._lock:
            self._starts[start.round] = (start, dict(metrics))

    def record_owned(self, first_step: int, owned_by_step: tuple[tuple[int, ...], ...]) -> None:
        """Global planning: the indices of this rank's samples that each step of the round emits on any rank
        (before the round's steps are released). `round_emitted` is made of these instead of the step's own."""
        with self._lock:
            self._owned.update((first_step + k, owned) for k, owned in enumerate(owned_by_step))

    def end_epoch(self, steps: int, metrics: Metrics) -> None:
        """The epoch has `steps` steps; `metrics` are the counters after its last one."""
        with self._lock:
            self._final = (steps, dict(metrics))

    # -- consumer ------------------------------------------------------------------------------------------
    def consume(self, info: StepInfo) -> None:
        """The consumer took the step `info` describes (steps arrive in order)."""
        with self._lock:
            start, metrics = self._starts[info.round]
            for stale in [r for r in self._starts if r < info.round]:
                del self._starts[stale]
            if self._position is None or self._position.point.start.round != info.round:
                self._emitted = []
            self._emitted.extend(self._owned.pop(info.step, info.indices))
            for stale in [step for step in self._owned if step < info.step]:
                del self._owned[stale]
            complete = self._final is not None and info.step + 1 == self._final[0]
            if complete:
                metrics = self._final[1]
            point = ResumePoint(start=start, steps_consumed=info.step + 1)
            window_open = 0 if info.ends_window else info.window_index + 1
            self._position = SavedPosition(point=point, complete=complete, metrics=metrics, window_open=window_open)

    @property
    def position(self) -> SavedPosition | None:
        """The position after the last consumed step (with this round's emitted indices), or the resumed one."""
        with self._lock:
            if self._position is None:
                return None
            point = self._position.point
            return SavedPosition(point=ResumePoint(start=point.start, steps_consumed=point.steps_consumed,
                                                   round_emitted=tuple(self._emitted)),
                                 complete=self._position.complete, metrics=self._position.metrics,
                                 window_open=self._position.window_open)

    @property
    def complete(self) -> bool:
        """Whether the consumer took the epoch's last step (known from that step on, before the iterator's
        StopIteration; NOTE [ Epoch progress ] in odb_core/epoch/epoch_length.py)."""
        with self._lock:
            return self._position is not None and self._position.complete
