"""One epoch on one rank: fill the window, plan, align over the transport, collate, and yield steps.

NOTE [ One round ]
  1. fill: read tagged samples until the window is full or the stream ends; check each (`inspect_sample`);
  2. plan + all_gather(RankState) + decide + adjust (`RankEngine`): exactly T ordered slots;
  3. collate each slot (IDLE: the cached zero-weight dummy) and count its supervised/input tokens;
  4. all_reduce_sum of 5 ints per slot: global samples, supervised tokens, input tokens, cost and cost^2;
  5. release steps; with accumulation_steps = G, a step is released once its G-step window is complete, so
     that `StepInfo.window_tokens` is exact (a window may span two rounds).
The whole round is deterministic given the samples, so the batches do not depend on worker timing.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from odb_core.alignment import Slot
from odb_core.collate import CollateFn, padded_tokens, run_collate, supervised_tokens
from odb_core.engine import RankEngine
from odb_core.metrics import LoaderMetrics, cost_cv
from odb_core.sample import LengthFn, as_dummy, input_tokens, inspect_sample
from odb_core.step_info import ODBBatch, StepInfo
from odb_core.sync import Transport
from odb_core.termination import RankState

REDUCED_FIELDS = 5
Chunk = list[tuple[int, Any]]


@dataclass(frozen=True, slots=True)
class EpochReport:
    """What an epoch emitted on this rank, and what it did not (only non-join leaves samples behind)."""

    epoch: int
    steps: int
    rounds: int
    not_emitted: tuple[int, ...]
    unread_chunks_remaining: bool


@dataclass(frozen=True, slots=True)
class RunContext:
    """Everything an epoch needs besides its data; shared by the epochs of one loader."""

    engine_factory: Callable[[int], RankEngine]
    transport: Transport
    collate_fn: CollateFn
    length_fn: LengthFn | None
    metrics: LoaderMetrics
    fallback_dummy: Callable[[], Mapping[str, Any]]
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

    def as_ints(self) -> list[int]:
        return [self.samples, self.tokens, self.input_tokens, self.cost, self.cost * self.cost]


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


class EpochRun(Iterator[ODBBatch]):
    """Yields this rank's steps of one epoch. Every rank's `EpochRun` yields the same number of steps."""

    def __init__(self, ctx: RunContext, epoch: int, chunks: Iterator[Chunk]) -> None:
        self.ctx, self.epoch, self.chunks = ctx, epoch, chunks
        self.engine = ctx.engine_factory(epoch)
        self.pending: deque[tuple[int, Any]] = deque()
        self.payloads = _Payloads()
        self.stream_ended = False
        self.dummy: Mapping[str, Any] | None = None
        self.ready: deque[ODBBatch] = deque()
        self.window: list[tuple[_Built, StepInfo]] = []
        self.steps_staged = 0
        self.report: EpochReport | None = None

    def __next__(self) -> ODBBatch:
        while not self.ready:
            if self.engine.finished:
                self._close_epoch()
                raise StopIteration
            self._run_round()
        return self.ready.popleft()

    def _fill(self) -> bool:
        """Top the window up; returns whether this rank is still active (its stream may hold more)."""
        while self.engine.space() > 0:
            if not self.pending:
                chunk = next(self.chunks, None)
                if chunk is None:
                    self.stream_ended = True
                    return False
                self.pending.extend(chunk)
            index, sample = self.pending.popleft()
            self.engine.admit(inspect_sample(index, sample, self.ctx.length_fn))
            self.payloads.put(index, sample)
            if self.dummy is None:
                self.dummy = sample
        return not (self.stream_ended and not self.pending)

    def _run_round(self) -> None:
        active = self._fill()
        local = self.engine.start_round(active)
        gathered = self.ctx.transport.all_gather(local.state.to_ints())
        decision = self.engine.decide([RankState.from_ints(v) for v in gathered])
        round_index = self.engine.round
        adjustment = self.engine.finish_round(local, decision)
        built = [self._build(slot) for slot in adjustment.slots]
        reduced = self.ctx.transport.all_reduce_sum([x for b in built for x in b.as_ints()])
        self.ctx.metrics.rounds += 1
        self.ctx.metrics.splits += adjustment.n_split
        self.ctx.metrics.pushed_back_groups += adjustment.n_pushed_back
        for k, b in enumerate(built):
            totals = reduced[k * REDUCED_FIELDS : (k + 1) * REDUCED_FIELDS]
            self._stage(b, totals, round_index)

    def _build(self, slot: Slot) -> _Built:
        if slot is None:
            batch = run_collate(self.ctx.collate_fn, [as_dummy(self._dummy_sample())], ())
            return _Built(batch=batch, indices=(), samples=0, tokens=0, input_tokens=0, padded=0, cost=0)
        samples = [self.payloads.take(index) for index in slot.indices]
        batch = run_collate(self.ctx.collate_fn, samples, slot.indices)
        real = sum(input_tokens(s) for s in samples)
        return _Built(batch=batch, indices=slot.indices, samples=slot.size, tokens=supervised_tokens(batch, samples),
                      input_tokens=real, padded=padded_tokens(batch, real), cost=round(slot.cost))

    def _dummy_sample(self) -> Mapping[str, Any]:
        if self.dummy is None:
            self.dummy = self.ctx.fallback_dummy()
        return self.dummy

    def _stage(self, built: _Built, totals: list[int], round_index: int) -> None:
        g_samples, g_tokens, g_input, g_cost, g_cost_sq = totals
        info = StepInfo(epoch=self.epoch, step=self.steps_staged, round=round_index, indices=built.indices,
                        is_idle=not built.indices, local_samples=built.samples, global_samples=g_samples,
                        local_tokens=built.tokens, global_tokens=g_tokens, local_input_tokens=built.input_tokens,
                        global_input_tokens=g_input, padded_tokens=built.padded, cost=float(built.cost),
                        window_tokens=-1)
        self.steps_staged += 1
        self.window.append((built, info))
        self.ctx.metrics.record_step(info, cost_cv(g_cost, g_cost_sq, self.ctx.transport.world_size))
        if len(self.window) == self.engine.config.accumulation_steps:
            self._release_window()

    def _release_window(self) -> None:
        window_tokens = sum(info.global_tokens for _, info in self.window)
        for built, info in self.window:
            final = StepInfo(**{**_fields(info), "window_tokens": window_tokens})
            if self.ctx.observer is not None:
                self.ctx.observer(final)
            self.ready.append(ODBBatch(built.batch, final))
        self.window = []

    def _close_epoch(self) -> None:
        if self.report is not None:
            return
        assert not self.window, "an epoch must end on an accumulation-window boundary"
        self.ctx.metrics.oversize_samples += self.engine.oversize
        leftover = [item.index for item in self.engine.items] + [index for index, _ in self.pending]
        self.report = EpochReport(epoch=self.epoch, steps=self.engine.steps_done, rounds=self.engine.round,
                                  not_emitted=tuple(leftover), unread_chunks_remaining=not self.stream_ended)


def _fields(info: StepInfo) -> dict[str, Any]:
    return {name: getattr(info, name) for name in StepInfo.__slots__}
