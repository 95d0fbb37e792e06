"""One epoch on one rank: fill the window, plan, align over the transport, collate, and yield steps.

NOTE [ One round ]
  1. fill: read tagged samples until the window is full or the stream ends; check each (`inspect_sample`);
  2. plan + all_gather(RankState) + decide + adjust (`RankEngine`): exactly T ordered slots;
  3. collate each slot (IDLE: the cached zero-weight dummy) and count its supervised/input tokens;
  4. all_reduce_sum of 6 ints per slot: global samples, supervised tokens, input tokens, cost, cost^2 and vision
     patches;
  5. release steps; with accumulation_steps = G, a step is released once its G-step window is complete, so
     that `StepInfo.window_tokens` is exact (a window may span two rounds).
The whole round is deterministic given the samples, so the batches do not depend on worker timing.
"""

from __future__ import annotations

import traceback
from collections import defaultdict, deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from odb_core.alignment import Slot
from odb_core.collate import CollateFn, padded_tokens, run_collate, supervised_tokens
from odb_core.engine import RankEngine
from odb_core.metrics import LoaderMetrics, cost_cv
from odb_core.sample import LengthFn, as_dummy, count_patches, input_tokens, inspect_sample
from odb_core.sources import unpack_sample
from odb_core.step_info import ODBBatch, StepInfo
from odb_core.sync import Transport
from odb_core.termination import RankState

REDUCED_FIELDS = 6
Chunk = list[tuple[int, Any]]


@dataclass(frozen=True, slots=True)
class EpochReport:
    """What an epoch emitted on this rank, and what it did not (only non-join leaves samples behind)."""

    epoch: int
    steps: int
    rounds: int
    not_emitted: tuple[int, ...]
    unread_chunks_remaining: bool
    stream_position: int = 0  # samples read from this rank's stream (admitted + pending), resume offset included


@dataclass(frozen=True, slots=True)
class RunContext:
    """Everything an epoch needs besides its data; shared by the epochs of one loader."""

    engine_factory: Callable[[int], RankEngine]
    transport: Transport
    collate_fn: CollateFn
    length_fn: LengthFn | None
    metrics: LoaderMetrics
    fallback_dummy: Callable[[], Mapping[str, Any]]
    fetch: Callable[[int], Mapping[str, Any]]
    observer: Callable[[StepInfo], None] | None = None


@dataclass(frozen=True, slots=True)
class _Built:
    """A collated slot and its local counts, before the all_reduce."""

    batch: Mapping[str, Any]
    indices: tuple[int, ...]
    samples: int
    tokens: int
    input_tokens: int
    padded: int
    cost: int
    patches: int

    def as_ints(self) -> list[int]:
        return [self.samples, self.tokens, self.input_tokens, self.cost, self.cost * self.cost, self.patches]


@dataclass(slots=True)
class _Payloads:
    """Buffered sample payloads by dataset index (a multiset: samplers may repeat an index)."""

    by_index: defaultdict[int, deque[Any]] = field(default_factory=lambda: defaultdict(deque))

    def put(self, index: int, sample: Any) -> None:
        self.by_index[index].append(sample)

    def take(self, index: int) -> Any:
        queue = self.by_index[index]
        sample = queue.popleft()
        if not queue:
            del self.by_index[index]
        return sample


@dataclass(frozen=True, slots=True)
class RoundStart:
    """Where a round began: enough to replay it exactly in a new process (see NOTE [ Exact resume ])."""

    round: int
    steps_done: int
    consumed: int
    buffer: tuple[int, ...]
    carry_count: int
    carry_tokens: int
    dummy_index: int | None


@dataclass(frozen=True, slots=True)
class ResumePoint:
    """Replay from `start`, dropping the steps numbered below `steps_consumed` (already trained on).

    `round_emitted` lists this rank's indices in the consumed steps of that round (from `start.steps_done` up
    to `steps_consumed`); exact replay does not need it, elastic resume does (NOTE [ Elastic resume ])."""

    start: RoundStart
    steps_consumed: int
    round_emitted: tuple[int, ...] = ()


class EpochRun(Iterator[ODBBatch]):
    """Yields this rank's steps of one epoch. Every rank's `EpochRun` yields the same number of steps.

    NOTE [ Exact resume ]
    At the start of every round the run records a `RoundStart`: the stream position (samples admitted so far),
    the dataset indices still buffered, the step count, the open accumulation window carried in from earlier
    rounds (its step count and supervised tokens) and the index of the sample used for IDLE dummies. A new
    process that re-fetches those indices, skips the stream to the same position and replays the round runs the
    same pure plan and the same collectives, so it yields the same batches; steps already consumed are dropped.
    The loader's metrics are snapshotted at the same point (`round_metrics`) and the replayed round records all
    its steps again, so resumed counters equal the uninterrupted ones. `final_steps` is the epoch's step count,
    set before the final round's steps are released (with `final_metrics`), so a consumer can tell that it took
    the last step.
    """

    def __init__(self, ctx: RunContext, epoch: int, chunks: Iterator[Chunk],
                 resume: ResumePoint | None = None) -> None:
        self.ctx, self.epoch, self.chunks = ctx, epoch, chunks
        self.engine = ctx.engine_factory(epoch)
        self.pending: deque[tuple[int, Any]] = deque()
        self.payloads = _Payloads()
        self.stream_ended = False
        self.consumed = 0
        self.dummy_index: int | None = None
        self.dummy: Mapping[str, Any] | None = None
        self.dummy_patches = 0
        self.ready: deque[ODBBatch] = deque()
        self.window: list[tuple[_Built, StepInfo]] = []
        self.carry_count = self.carry_tokens = 0
        self.skip_below = 0
        self.round_starts: dict[int, RoundStart] = {}
        self.round_metrics: dict[int, dict[str, float | int]] = {}
        self.final_steps: int | None = None
        self.final_metrics: dict[str, float | int] | None = None
        self.report: EpochReport | None = None
        if resume is not None:
            self._restore(resume)

    def _restore(self, resume: ResumePoint) -> None:
        start = resume.start
        self.engine.round, self.engine.steps_done = start.round, start.steps_done
        self.consumed, self.skip_below = start.consumed, resume.steps_consumed
        self.carry_count, self.carry_tokens = start.carry_count, start.carry_tokens
        for index in start.buffer:
            sample = self.ctx.fetch(index)
            self.engine.admit(inspect_sample(index, sample, self.ctx.length_fn))
            self.payloads.put(index, sample)
        if start.dummy_index is not None:
            self.dummy_index, self.dummy = start.dummy_index, self.ctx.fetch(start.dummy_index)
            self.dummy_patches = count_patches(self.dummy)

    def __next__(self) -> ODBBatch:
        while not self.ready:
            if self.engine.finished:
                self._close_epoch()
                raise StopIteration
            self._run_round()
        return self.ready.popleft()

    def close(self) -> None:
        """Release the worker iterator (and with it the worker processes); called on errors and on shutdown."""
        self.chunks = iter(())

    def _fill(self) -> bool:
        """Top the window up; returns whether this rank is still active (its stream may hold more)."""
        while self.engine.space() > 0:
            if not self.pending:
                try:
                    chunk = next(self.chunks, None)
                except BaseException as exc:
                    # Free the worker iterator now (not at the next GC), so its processes exit at once.
                    traceback.clear_frames(exc.__traceback__)
                    self.close()
                    raise
                if chunk is None:
                    self.stream_ended = True
                    return False
                self.pending.extend(chunk)
            index, sample = self.pending.popleft()
            sample = unpack_sample(sample)
            item = inspect_sample(index, sample, self.ctx.length_fn)
            self.engine.admit(item)
            self.payloads.put(index, sample)
            self.consumed += 1
            self._offer_dummy(index, sample, item.patches)
        return not (self.stream_ended and not self.pending)

    def _offer_dummy(self, index: int, sample: Mapping[str, Any], patches: int) -> None:
        """NOTE [ IDLE dummy ] The dummy is the first sample this rank read, replaced once by the first one with
        vision patches: a VLM's IDLE step then runs the vision tower too, as every real step does, so sharded
        engines (ZeRO-3, FSDP) that gather the vision parameters see the same collectives on every rank. The
        choice depends only on the stream order, and `RoundStart.dummy_index` records it for resume."""
        if self.dummy is None or (patches > 0 and self.dummy_patches == 0):
            self.dummy_index, self.dummy, self.dummy_patches = index, sample, patches

    def _snapshot(self) -> RoundStart:
        carried = self.carry_tokens + sum(info.global_tokens for _, info in self.window)
        return RoundStart(round=self.engine.round, steps_done=self.engine.steps_done, consumed=self.consumed,
                          buffer=tuple(item.index for item in self.engine.items),
                          carry_count=self.carry_count + len(self.window), carry_tokens=carried,
                          dummy_index=self.dummy_index)

    def _run_round(self) -> None:
        self.round_metrics[self.engine.round] = self.ctx.metrics.snapshot()
        self.round_starts[self.engine.round] = self._snapshot()
        stats = self.ctx.transport.stats
        bytes_before, seconds_before = stats.bytes_sent, stats.seconds
        active = self._fill()
        local = self.engine.start_round(active)
        gathered = self.ctx.transport.all_gather(local.state.to_ints())
        decision = self.engine.decide([RankState.from_ints(v) for v in gathered])
        round_index = self.engine.round
        adjustment = self.engine.finish_round(local, decision)
        if self.engine.finished:
            self.final_steps = self.engine.steps_done
        built = [self._build(slot) for slot in adjustment.slots]
        reduced = self.ctx.transport.all_reduce_sum([x for b in built for x in b.as_ints()])
        self.ctx.metrics.rounds += 1
        self.ctx.metrics.splits += adjustment.n_split
        self.ctx.metrics.pushed_back_groups += adjustment.n_pushed_back
        self.ctx.metrics.sync_bytes += stats.bytes_sent - bytes_before
        self.ctx.metrics.sync_seconds += stats.seconds - seconds_before
        first_step = self.engine.steps_done - len(built)
        for k, b in enumerate(built):
            totals = reduced[k * REDUCED_FIELDS : (k + 1) * REDUCED_FIELDS]
            self._stage(b, totals, round_index, first_step + k)
        if self.engine.finished:
            self.final_metrics = self.ctx.metrics.snapshot()

    def _build(self, slot: Slot) -> _Built:
        if slot is None:
            batch = run_collate(self.ctx.collate_fn, [as_dummy(self._dummy_sample())], ())
            return _Built(batch=batch, indices=(), samples=0, tokens=0, input_tokens=0, padded=0, cost=0, patches=0)
        samples = [self.payloads.take(index) for index in slot.indices]
        batch = run_collate(self.ctx.collate_fn, samples, slot.indices)
        real = sum(input_tokens(s) for s in samples)
        return _Built(batch=batch, indices=slot.indices, samples=slot.size, tokens=supervised_tokens(batch, samples),
                      input_tokens=real, padded=padded_tokens(batch, real), cost=round(slot.cost),
                      patches=sum(item.patches for item in slot.items))

    def _dummy_sample(self) -> Mapping[str, Any]:
        if self.dummy is None:
            self.dummy = self.ctx.fallback_dummy()
        return self.dummy

    def _stage(self, built: _Built, totals: list[int], round_index: int, step: int) -> None:
        g_samples, g_tokens, g_input, g_cost, g_cost_sq, g_patches = totals
        imbalance = cost_cv(g_cost, g_cost_sq, self.ctx.transport.world_size)
        info = StepInfo(epoch=self.epoch, step=step, round=round_index, indices=built.indices,
                        is_idle=not built.indices, local_samples=built.samples, global_samples=g_samples,
                        local_tokens=built.tokens, global_tokens=g_tokens, local_input_tokens=built.input_tokens,
                        global_input_tokens=g_input, padded_tokens=built.padded, cost=float(built.cost),
                        rank_imbalance=imbalance, window_tokens=-1, local_patches=built.patches,
                        global_patches=g_patches)
        self.window.append((built, info))
        self.ctx.metrics.record_step(info)  # replayed steps too: metrics resume from the round start
        if self.carry_count + len(self.window) == self.engine.config.accumulation_steps:
            self._release_window()

    def _release_window(self) -> None:
        window_tokens = self.carry_tokens + sum(info.global_tokens for _, info in self.window)
        for built, info in self.window:
            if info.step < self.skip_below:
                continue
            final = StepInfo(**{**_fields(info), "window_tokens": window_tokens})
            if self.ctx.observer is not None:
                self.ctx.observer(final)
            self.ready.append(ODBBatch(built.batch, final))
        self.window = []
        self.carry_count = self.carry_tokens = 0

    def _close_epoch(self) -> None:
        if self.report is not None:
            return
        assert not self.window and not self.carry_count, "an epoch must end on an accumulation-window boundary"
        self.ctx.metrics.oversize_samples += self.engine.oversize
        leftover = [item.index for item in self.engine.items] + [index for index, _ in self.pending]
        self.report = EpochReport(epoch=self.epoch, steps=self.engine.steps_done, rounds=self.engine.round,
                                  not_emitted=tuple(leftover), unread_chunks_remaining=not self.stream_ended,
                                  stream_position=self.consumed + len(self.pending))


def _fields(info: StepInfo) -> dict[str, Any]:
    return {name: getattr(info, name) for name in StepInfo.__slots__}
