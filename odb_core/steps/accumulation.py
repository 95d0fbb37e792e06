"""The gradient-accumulation window: steps are released only once their optimizer step is complete.

With `accumulation_steps = G`, an optimizer step is G consecutive micro-batch steps, and its exact loss
normaliser is the supervised tokens of all G steps on all ranks (`StepInfo.window_tokens`, NOTE [ Exact
token-weighted loss ] in loss.py). A window may span two rounds, so steps are staged here until the window is
whole (`AccumulationWindow`); a trainer checks the windows it pulls with `window_normalizer`. Pure: no I/O, no
threads.

NOTE [ Steps of a target size ]
With `samples_per_step` (or `tokens_per_step`) = S, an optimizer step is instead the run of consecutive
micro-batches whose global samples (supervised tokens) come nearest S. The rule, applied to each new micro-batch
of m units while the open window holds n < S units: if n + m <= S it joins; otherwise the window closes before it
when S - n <= n + m - S (closing is at least as near), else it joins and the window closes after it. A window
never stays open at >= S units, so every step holds S +- half of one micro-batch's global size, and a single
micro-batch of >= S units is a step alone. m and n are the all_reduced global counts, identical on every rank,
so every rank closes the same windows: the same number of micro-batches per optimizer step everywhere (IDLE
micro-batches where a rank had nothing). A window is released when the next micro-batch decides it (or the epoch
ends: the last window may be short), so `window_tokens`, `window_steps` and `window_samples` are exact when the
trainer sees the first micro-batch. The open window at a round start (`carry_*`) is part of the resume state.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Generic, Literal, TypeVar

from odb_core.steps.loss import step_normalizer
from odb_core.steps.step_info import StepInfo

T = TypeVar("T")
Unit = Literal["samples", "tokens"]


@dataclass(frozen=True, slots=True)
class StepTarget:
    """Close optimizer steps nearest `amount` global samples or supervised tokens (NOTE [ Steps of a target size ])."""

    unit: Unit
    amount: int

    def measure(self, info: StepInfo) -> int:
        return info.global_samples if self.unit == "samples" else info.global_tokens

    def closes_before(self, held: int, added: int) -> bool:
        """Whether a window holding `held` units (and at least one micro-batch) closes before one of `added`."""
        return held + added > self.amount and self.amount - held <= held + added - self.amount

    def count_steps(self, sizes: Sequence[int]) -> int:
        """Optimizer steps of an epoch whose micro-batches have these global sizes (in this target's unit), by
        the same rule as `AccumulationWindow.stage`: what an exact schedule plans with."""
        steps, held, open_ = 0, 0, False
        for added in sizes:
            if open_ and self.closes_before(held, added):
                steps, held = steps + 1, 0
            held, open_ = held + added, True
            if held >= self.amount:
                steps, held, open_ = steps + 1, 0, False
        return steps + int(open_)


@dataclass(slots=True)
class AccumulationWindow(Generic[T]):
    """Stages `(payload, StepInfo)` pairs; `stage` returns the whole window once it is complete: `size` steps, or
    with a `target`, by the rule of NOTE [ Steps of a target size ].

    `carry_count` / `carry_tokens` / `carry_samples` are the steps, global supervised tokens and global samples
    of the open window that were released before a resume point (they are not replayed, but still count)."""

    size: int
    target: StepTarget | None = None
    carry_count: int = 0
    carry_tokens: int = 0
    carry_samples: int = 0
    staged: list[tuple[T, StepInfo]] = field(default_factory=list)

    @property
    def open_count(self) -> int:
        """Steps of the open window so far (carried and staged)."""
        return self.carry_count + len(self.staged)

    @property
    def open_tokens(self) -> int:
        return self.carry_tokens + sum(info.global_tokens for _, info in self.staged)

    @property
    def open_samples(self) -> int:
        return self.carry_samples + sum(info.global_samples for _, info in self.staged)

    def _open_units(self) -> int:
        assert self.target is not None
        return self.open_samples if self.target.unit == "samples" else self.open_tokens

    def restore(self, carry_count: int, carry_tokens: int, carry_samples: int = 0) -> None:
        self.carry_count, self.carry_tokens, self.carry_samples, self.staged = carry_count, carry_tokens, carry_samples, []

    def stage(self, payload: T, info: StepInfo) -> list[tuple[T, StepInfo]]:
        """Add one step; the completed window's steps with the window fields filled in, or [] while it is open."""
        if self.target is None:
            self.staged.append((payload, info))
            return self.flush() if self.open_count >= self.size else []
        released = []
        if self.open_count and self.target.closes_before(self._open_units(), self.target.measure(info)):
            released = self.flush()
        self.staged.append((payload, info))
        if self._open_units() >= self.target.amount:
            released += self.flush()
        return released

    def flush(self) -> list[tuple[T, StepInfo]]:
        """Close the open window now (at an epoch's end with a target; a full window otherwise)."""
        if not self.open_count:
            return []
        tokens, samples, count, first = self.open_tokens, self.open_samples, self.open_count, self.carry_count
        released = [(p, i.in_window(tokens=tokens, samples=samples, steps=count, index=first + k))
                    for k, (p, i) in enumerate(self.staged)]
        self.restore(0, 0, 0)
        return released


@dataclass(frozen=True, slots=True)
class StepWindow(Generic[T]):
    """The micro-batches of one optimizer step, in order (what a trainer that takes one item per optimizer step,
    such as the HF Trainer with a step target, iterates)."""

    batches: tuple[T, ...]

    @property
    def infos(self) -> tuple[StepInfo, ...]:
        return tuple(batch.info for batch in self.batches)  # type: ignore[attr-defined]


def step_windows(batches: Iterator[T]) -> Iterator[StepWindow[T]]:
    """Group a loader's micro-batches (each with `.info`) into whole optimizer steps. The loader releases whole
    windows only, so this never waits on an unfinished one; a window cut short raises RuntimeError."""
    staged: list[T] = []
    for batch in batches:
        staged.append(batch)
        if batch.info.ends_window:  # type: ignore[attr-defined]
            yield StepWindow(tuple(staged))
            staged = []
    if staged:
        raise RuntimeError(f"the loader ended inside an optimizer step ({len(staged)} micro-batches of "
                           f"{staged[0].info.window_steps}); its windows must be whole")  # type: ignore[attr-defined]

def window_normalizer(infos: Sequence[StepInfo], accumulation_steps: int | None) -> int:
    """N (`step_normalizer`) of one optimizer step from the `StepInfo`s of the micro-batches a trainer pulled for
    it, after checking that they are one whole, aligned window (a trainer and a loader that disagree on G, or a
    loop that skipped a batch, would otherwise mix two windows' normalisers). `accumulation_steps` None: a window
    of a target size (NOTE [ Steps of a target size ]), whole when it runs from its first to its last micro-batch."""
    if accumulation_steps is None:
        whole = infos[0].window_index == 0 and infos[-1].ends_window and len(infos) == infos[0].window_steps
    else:
        whole = len(infos) == accumulation_steps and infos[0].step % accumulation_steps == 0
    if not whole or len({info.window_tokens for info in infos}) != 1:
        raise RuntimeError(f"ODB accumulation window broken: got steps {[i.step for i in infos]} of epoch "
                           f"{infos[0].epoch} for {accumulation_steps} accumulation steps; the loader and the "
                           "trainer disagree")
    return step_normalizer(infos[0].window_tokens)
