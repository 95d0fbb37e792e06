"""One epoch on one rank: fill the window, plan, align over the transport, collate, and yield steps.

NOTE [ One round ]
  1. fill: read tagged samples until the window is full or the stream ends; check each (`SampleReader`);
  2. plan (`rounds.py`): rank-local, all_gather(RankState) + decide + adjust (`RankEngine`); global, also the
     pooled items, the shared plan (`PooledEngine`, NOTE [ Pooled rounds ]) and the moved samples (or, with a
     move lane, their facts, the samples following on the lane: NOTE [ Moves overlap training ]): exactly T
     ordered slots on every rank;
  3. count each slot's supervised/input tokens, keeping its samples, not a collated batch (IDLE: the dummy
     sample, zero counts); a step is collated when the consumer takes it (NOTE [ A step is collated when it is
     taken ] in collation.py);
  4. all_reduce_sum of 6 ints per slot: global samples, supervised tokens, input tokens, cost, cost^2 and vision
     patches;
  5. release steps; with accumulation_steps = G, a step is released once its G-step window is complete, so
     that `StepInfo.window_tokens` is exact (a window may span two rounds; `AccumulationWindow`); with a step
     target (`samples_per_step` / `tokens_per_step`) once the window is decided (NOTE [ Steps of a target
     size ]), and the epoch's last window when the epoch ends.
The whole round is deterministic given the samples, so the batches do not depend on worker timing.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from odb_core.data.collate import CollateFn
from odb_core.data.sample import LengthFn
from odb_core.epoch.collate_ahead import CollateAhead
from odb_core.epoch.collation import Collation, PlannedStep
from odb_core.epoch.plan_ahead import CLOSE_WAIT_S, PlanAhead, RoundAheadError, WaitParts
from odb_core.epoch.reader import ReadAhead, SampleReader
from odb_core.epoch.stream import Chunk
from odb_core.planning.alignment import Slot
from odb_core.planning.termination import STEP_SUM_FIELDS
from odb_core.ranks.moves_ahead import MovesInFlight
from odb_core.ranks.rounds import RankRound, Rounds, sample_of
from odb_core.ranks.sync import Transport
from odb_core.resume.fields import StateError
from odb_core.resume.round_log import RoundLog
from odb_core.resume.state import ResumePoint, RoundStart
from odb_core.settings.console import warn_oversize
from odb_core.steps.accumulation import AccumulationWindow, StepTarget
from odb_core.steps.metrics import LoaderMetrics, cost_cv
from odb_core.steps.step_info import ODBBatch, StepInfo

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EpochReport:
    """What an epoch emitted on this rank, and what it did not (only non-join leaves samples behind)."""

    epoch: int
    steps: int
    rounds: int
    not_emitted: tuple[int, ...]
    unread_chunks_remaining: bool
    stream_position: int = 0  # samples read from this rank's stream (admitted + pending), resume offset included
    abandoned: bool = False  # a consumer left the epoch early (NOTE [ Leaving an epoch ])
    advice: Mapping[str, str] = field(default_factory=dict)  # by case: NOTE [ Which lever ] in wait_advice.py


@dataclass(slots=True)
class Once:
    """A warning a loader gives at most once: its epochs share it through `RunContext`."""

    given: bool = False


@dataclass(frozen=True, slots=True)
class RunContext:
    """Everything an epoch needs besides its data; shared by the epochs of one loader."""

    rounds_factory: Callable[[int], Rounds]
    transport: Transport
    collate_fn: CollateFn
    length_fn: LengthFn | None
    metrics: LoaderMetrics
    fallback_dummy: Callable[[], Mapping[str, Any]]
    fetch: Callable[[int], Mapping[str, Any]]
    observer: Callable[[StepInfo], None] | None = None
    packed_samples: bool = False  # worker processes send small tensors as arrays
    collate_ahead: bool = False  # NOTE [ Collating the next step ahead ]
    plan_ahead: bool = False  # NOTE [ Planning the next round ahead ]
    oversize_warning: Once = field(default_factory=Once)  # NOTE [ Samples over the budget ]


class EpochRun(Iterator[ODBBatch]):
    """Yields this rank's steps of one epoch. Every rank's `EpochRun` yields the same number of steps.

    NOTE [ Exact resume ]
    At the start of every round the run records a `RoundStart` in its `RoundLog`: the stream position (samples
    admitted so far), the dataset indices still buffered, the step count, the open accumulation window carried in
    from earlier rounds (its step count and supervised tokens) and the index of the sample used for IDLE dummies. A
    new process that re-fetches those indices, skips the stream to the same position and replays the round runs the
    same pure plan and the same collectives, so it yields the same batches; steps already consumed are dropped; the
    replayed round must reach the consumed step, or the position is refused (`StateError`: a version-2 state has no
    digest, so this is what catches an edited step count there). The loader's metrics are snapshotted at the same
    point and the replayed round records all its steps again, so resumed counters equal the uninterrupted ones. The
    epoch's step count reaches the log before the final round's steps are released, so the consumer can tell that it
    took the last step.
    """

    def __init__(self, ctx: RunContext, epoch: int, chunks: Iterator[Chunk], log: RoundLog,
                 resume: ResumePoint | None = None, stream_length: int | None = None) -> None:
        self.ctx, self.epoch, self.log = ctx, epoch, log
        self.rounds = ctx.rounds_factory(epoch)
        self.engine = self.rounds.engine
        self.parts = WaitParts()  # this epoch's reading and exchange seconds, until counted (NOTE [ Waiting for data ])
        self.reader = SampleReader(chunks, ctx.length_fn, ctx.fallback_dummy, ctx.packed_samples, stream_length,
                                   self.parts)
        config = self.engine.config
        target = StepTarget(*config.step_target) if config.step_target is not None else None
        self.window: AccumulationWindow[PlannedStep] = AccumulationWindow(config.accumulation_steps, target)
        self.ready: deque[tuple[PlannedStep, StepInfo]] = deque()  # released, collated when taken
        self.collation = Collation.of(ctx.collate_fn, ctx.length_fn, release=self.reader.close)
        self.collating = CollateAhead(self.collation, ctx.collate_ahead)
        self.ahead = ReadAhead()  # NOTE [ Reading ahead ]
        self.flight: MovesInFlight | None = None  # NOTE [ Moves overlap training ]
        self.round_ahead: PlanAhead[ODBBatch] = PlanAhead(self.parts, ctx.metrics)  # NOTE [ Planning the next ... ]
        self.exchanging = False  # inside a round's collectives (from its plan to its all_reduce)
        self.skip_below = 0
        self.report: EpochReport | None = None
        if resume is not None:
            start = resume.start
            self.engine.round, self.engine.steps_done = start.round, start.steps_done
            self.skip_below = resume.steps_consumed
            self.window.restore(start.carry_count, start.carry_tokens, start.carry_samples)
            self.reader.restore(start, self.engine, ctx.fetch)
            self.engine.n_carried = len(start.buffer)  # what the saved round began with
            self.engine.resumed_at = resume.steps_consumed  # checked against every rank's (check_same_progress)

    def __next__(self) -> ODBBatch:
        if self.round_ahead.pending:
            batch = self.round_ahead.take()
        else:
            try:
                batch = self._next_step()
            finally:
                self.parts.add_to(self.ctx.metrics)
        if self.ctx.plan_ahead and not self.ready and not self.engine.finished:
            self.round_ahead.start(self._next_step)  # NOTE [ Planning the next round ahead ]
        return batch

    def _next_step(self) -> ODBBatch:
        if self.ahead.due:
            self.reader.read_ahead(self.ahead.take_step())
        while not self.ready:
            if self.engine.finished:
                self._close_epoch()
                self.collating.close()
                raise StopIteration
            self._run_round()
        step, info = self.ready.popleft()
        batch = self.collating.take(step)  # NOTE [ A step is collated when it is taken ]
        if self.ready:
            self.collating.start(self.ready[0][0], step)  # NOTE [ Collating the next step ahead ]
        return ODBBatch(batch, info)

    def close(self) -> None:
        """Release the worker iterator (and with it the worker processes) and the collating thread; called on errors and
        on shutdown; a round run ahead gets `CLOSE_WAIT_S` to end (NOTE [ Planning the next round ahead ])."""
        self.round_ahead.close()
        self.reader.close()
        self.collating.close()

    def leave(self) -> None:
        """NOTE [ Leaving an epoch ]
        A consumer that stops iterating an epoch before its end (a `break`, `set_epoch`, a new `iter()`) must not leave
        its peers inside a collective that it never joins, nor let the next epoch's first collective pair up with a
        peer's last one of this epoch. So the rank that leaves takes part in exactly one more state exchange, flagged
        `leaving`, at the position of the next round, instead of that round; every rank that sees the flag ends its
        epoch right after the steps it already planned (`EpochReport.abandoned`), and runs no more collectives for it.
        The rounds are lockstep, so a peer is either in that same exchange (as a normal round or leaving too) or reaches
        it when its own consumer takes the next step or leaves. Called once, on the thread that runs the rounds, between
        rounds; a finished epoch needs nothing.

        NOTE [ A failed epoch is not left ]
        Leaving says that this rank stopped on purpose, and the others end the epoch as if it were over. An epoch whose
        `next()` raised (a bad sample, a failed fetch, a dead worker or peer) did not: a consumer that closed the loader
        or called `iter()` after the error (a `finally:`, a context manager) used to leave it all the same, and the
        healthy ranks ended the epoch without this rank's samples and without an error. So the loader's iterator stops a
        failed epoch without this exchange (`_EpochIterator.close`): the other ranks meet the error at their next
        collective, as for a rank that dies (`PeerError` once this rank's Gloo group or process is gone, or after
        `sync_timeout_s`; `DesyncError` if it starts another epoch first). The same holds for an error outside the
        loader (the training step, a callback): `ODBDataLoader.close()` called while an exception propagates (an
        `except` block, a `finally:` it passes through; `unwinding` in prefetch.py) does not leave the epoch either.
        `iter()`, `set_epoch()` and `load_state_dict()` still leave it there: a loop that goes on after an error every
        rank met (a rollback to a saved state) needs its ranks in step. A round run ahead ends first (NOTE [ Planning
        the next round ahead ]); one that failed inside its collectives leaves the peers there, so the epoch is not
        left: `RoundAheadError` from its error. Nor is it left by a `close()` from a signal handler inside this thread's
        own round exchange (its leaving would pair with a peer's next exchange: Gloo aborted, or both waited
        `sync_timeout_s`)."""
        ended, error = self.round_ahead.settle(self._ahead_wait_s())
        if not ended:
            raise TimeoutError("the round run ahead did not end; the epoch is not left")
        if self.exchanging and error is None:  # this thread inside its own round's exchange (NOTE [ A failed ... ])
            raise RuntimeError("close() inside this rank's own round exchange (a signal handler?): epoch not left")
        if self.exchanging:
            raise RoundAheadError(f"the round run ahead failed inside its exchanges ({type(error).__name__}: "
                                  f"{error}), so the epoch cannot be left in step with the other ranks") from error
        if error is not None:
            logger.warning("ODB: the round run ahead failed (%s: %s) outside its exchanges; the epoch is left as "
                           "asked", type(error).__name__, error)
        self.collating.close()
        self._settle_moves()
        if not self.engine.finished:
            self.rounds.leave()
            self.report = self._report(abandoned=True)

    def quiet(self) -> bool:
        """Wait for a round run ahead as long as `leave()` does; whether it ended (or none ran)."""
        return self.round_ahead.wait(self._ahead_wait_s())

    def _ahead_wait_s(self) -> float:
        return self.engine.config.sync_timeout_s + CLOSE_WAIT_S

    def _round_start(self) -> RoundStart:
        return RoundStart(round=self.engine.round, steps_done=self.engine.steps_done, consumed=self.reader.consumed,
                          buffer=tuple(item.index for item in self.engine.items),
                          carry_count=self.window.open_count, carry_tokens=self.window.open_tokens,
                          dummy_index=self.reader.dummy_index, carry_samples=self.window.open_samples)

    def _settle_moves(self) -> None:
        """Wait for the last round's moves if still in flight (NOTE [ Moves overlap training ]); raises what they
        raised."""
        flight, self.flight = self.flight, None
        if flight is not None:
            flight.settle()

    def _run_round(self) -> None:
        metrics = self.ctx.metrics
        self._settle_moves()
        self.log.begin_round(self._round_start(), metrics.snapshot())
        stats = self.ctx.transport.stats
        bytes_before, seconds_before = stats.bytes_sent, stats.seconds
        active = self.reader.fill(self.engine)
        self.log.filled(self.engine.round, list(self.engine.items), self.epoch)  # NOTE [ A resume reads what ... ]
        self._warn_oversize()
        first_step = self.engine.steps_done
        self.exchanging = True
        planned = self.rounds.plan(active, self.reader.take)
        if planned.abandoned:
            self.exchanging = False
            self.report = self._report(abandoned=True)
            self.log.end_epoch(self.engine.steps_done, metrics.snapshot(), abandoned=True)
            return
        if self.skip_below > self.engine.steps_done:  # the saved round was replayed: NOTE [ Exact resume ]
            raise StateError(f"state.position.steps_consumed={self.skip_below} is past the end of the saved round, "
                             f"which replays to step {self.engine.steps_done} of epoch {self.epoch}; the state is "
                             "corrupt, edited, or from other data or settings: resume from another checkpoint")
        if planned.owned_by_step is not None:
            self.log.record_owned(first_step, planned.owned_by_step)
        steps = [self._plan_step(slot, planned) for slot in planned.slots]  # samples and counts, no batch
        reduced = self.ctx.transport.all_reduce_sum([x for step in steps for x in step.counts.as_ints()])
        self.exchanging = False
        moved = planned.arrivals
        self.flight = moved if isinstance(moved, MovesInFlight) else None
        metrics.rounds += 1
        metrics.splits += planned.n_split
        metrics.pushed_back_groups += planned.n_pushed_back
        metrics.moved_samples += moved.samples if moved else 0
        metrics.moved_bytes += moved.bytes_in if moved else 0
        metrics.sync_bytes += stats.bytes_sent - bytes_before - (moved.bytes_out if moved else 0)
        self.parts.sync_seconds += stats.seconds - seconds_before
        for k, step in enumerate(steps):
            totals = reduced[k * STEP_SUM_FIELDS : (k + 1) * STEP_SUM_FIELDS]
            self._stage(step, totals, planned.index, first_step + k)
        metrics.publish_moves()
        finished, reader = self.engine.finished, self.reader
        self.ahead.plan(0 if finished else reader.space(self.engine), reader.byte_space(self.engine), len(self.ready),
                        0 if finished else self.engine.config.window)
        if self.engine.finished:
            self._release(self.window.flush())  # a target-sized epoch may end in a short step
            self.log.end_epoch(self.engine.steps_done, metrics.snapshot())

    def _warn_oversize(self) -> None:
        """NOTE [ Samples over the budget ]
        A sample whose cost alone exceeds the budget (or `max_patches`) runs alone under `oversize="alone"`: the
        out-of-memory an accelerator will meet, whose only other trace is a budget utilization above 1. The planner
        counts such samples as it admits them (`BufferEngine.admit`, pure: an `Oversize` tally); after the fill,
        before any step of the round is released, a loader's first such round logs one warning (`warn_oversize`,
        the `odb` logger: the budget, the longest sample, the fix). Once per loader (its epochs share the
        `RunContext`), on each rank that reads one; no adapter adds its own, so every path (HF Trainer, TRL,
        DeepSpeed, LLaMA-Factory) warns once. A resumed run warns again."""
        once = self.ctx.oversize_warning
        if self.engine.oversize.count and not once.given:
            once.given = True
            warn_oversize(self.engine.config, self.engine.oversize, self.ctx.transport.rank,
                          self.ctx.transport.world_size)

    def _plan_step(self, slot: Slot, planned: RankRound) -> PlannedStep:
        if slot is None:
            return self.collation.idle(self.reader.dummy_sample())
        take, rank = self.reader.take, self.ctx.transport.rank
        if planned.arrivals is None:  # rank-local planning: every sample is this rank's own (once per step)
            return self.collation.plan(slot, [take(item.index) for item in slot.items])
        return self.collation.plan(slot, [sample_of(item, planned, rank, take) for item in slot.items])

    def _stage(self, planned: PlannedStep, totals: list[int], round_index: int, step: int) -> None:
        g_samples, g_tokens, g_input, g_cost, g_cost_sq, g_patches = totals
        counts = planned.counts
        imbalance = cost_cv(g_cost, g_cost_sq, self.ctx.transport.world_size)
        # without accumulation every step is an optimizer step of its own: its window fields are its own and known
        # now, so the step is built once and `record_step` counts the optimizer step it ends, as `_release` would
        alone = self.window.size == 1 and self.window.target is None
        info = StepInfo(epoch=self.epoch, step=step, round=round_index, indices=planned.indices,
                        is_idle=not planned.indices, local_samples=counts.samples, global_samples=g_samples,
                        local_tokens=counts.tokens, global_tokens=g_tokens, local_input_tokens=counts.input_tokens,
                        global_input_tokens=g_input, padded_tokens=counts.padded, cost=float(counts.cost),
                        rank_imbalance=imbalance, window_tokens=g_tokens if alone else -1,
                        local_patches=counts.patches, global_patches=g_patches, window_steps=int(alone),
                        window_samples=g_samples if alone else 0)
        self.ctx.metrics.record_step(info)  # replayed steps too: metrics resume from the round start
        if alone:
            self._emit(planned, info)
        else:
            self._release(self.window.stage(planned, info))

    def _release(self, window: list[tuple[PlannedStep, StepInfo]]) -> None:
        for released, final in window:
            if final.ends_window:
                self.ctx.metrics.record_window(final)
            self._emit(released, final)

    def _emit(self, planned: PlannedStep, info: StepInfo) -> None:
        """Hand a step with its window fields to the consumer (unless a resume replays it), to be collated when
        it is taken."""
        if info.step < self.skip_below:
            return
        if self.ctx.observer is not None:
            self.ctx.observer(info)
        self.ready.append((planned, info))

    def _close_epoch(self) -> None:
        self._settle_moves()
        if self.report is not None:
            return
        assert not self.window.open_count, "an epoch must end on an accumulation-window boundary"
        self.ctx.metrics.oversize_samples += self.engine.oversize.count
        self.report = self._report(abandoned=False)

    def _report(self, abandoned: bool) -> EpochReport:
        leftover = [item.index for item in self.engine.items] + self.reader.pending_indices()
        return EpochReport(epoch=self.epoch, steps=self.engine.steps_done, rounds=self.engine.round,
                           not_emitted=tuple(leftover), unread_chunks_remaining=not self.reader.stream_ended,
                           stream_position=self.reader.consumed + len(self.reader.pending), abandoned=abandoned)
