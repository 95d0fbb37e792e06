"""The gradient-accumulation window: steps are released only once their optimizer step is complete.

With `accumulation_steps = G`, an optimizer step is G consecutive micro-batch steps, and its exact loss
normaliser is the supervised tokens of all G steps on all ranks (`StepInfo.window_tokens`, NOTE [ Exact
token-weighted loss ] in loss.py). A window may span two rounds, so steps are staged here until the window is
whole (`AccumulationWindow`); a trainer checks the windows it pulls with `window_normalizer`. Pure: no I/O, no
threads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Generic, TypeVar

from odb_core.loss import step_normalizer
from odb_core.step_info import StepInfo

T = TypeVar("T")


@dataclass(slots=True)
class AccumulationWindow(Generic[T]):
    """Stages `(payload, StepInfo)` pairs; `stage` returns the whole window once it holds `size` steps.

    `carry_count` / `carry_tokens` are the steps and global supervised tokens of the open window that were
    released before a resume point (they are not replayed, but still count toward `window_tokens`)."""

    size: int
    carry_count: int = 0
    carry_tokens: int = 0
    staged: list[tuple[T, StepInfo]] = field(default_factory=list)

    @property
    def open_count(self) -> int:
        """Steps of the open window so far (carried and staged)."""
        return self.carry_count + len(self.staged)

    @property
    def open_tokens(self) -> int:
        return self.carry_tokens + sum(info.global_tokens for _, info in self.staged)

    def restore(self, carry_count: int, carry_tokens: int) -> None:
        self.carry_count, self.carry_tokens, self.staged = carry_count, carry_tokens, []

    def stage(self, payload: T, info: StepInfo) -> list[tuple[T, StepInfo]]:
        """Add one step; the completed window's steps with `window_tokens` filled in, or [] while it is open."""
        self.staged.append((payload, info))
        if self.open_count < self.size:
            return []
        tokens = self.open_tokens
        released = [(p, replace(i, window_tokens=tokens)) for p, i in self.staged]
        self.restore(0, 0)
        return released


def window_normalizer(infos: Sequence[StepInfo], accumulation_steps: int) -> int:
    """N (`step_normalizer`) of one optimizer step from the `StepInfo`s of the micro-batches a trainer pulled for
    it, after checking that they are one whole, aligned window (a trainer and a loader that disagree on G, or a
    loop that skipped a batch, would otherwise mix two windows' normalisers)."""
    whole = len(infos) == accumulation_steps and infos[0].step % accumulation_steps == 0
    if not whole or len({info.window_tokens for info in infos}) != 1:
        raise RuntimeError(f"ODB accumulation window broken: got steps {[i.step for i in infos]} of epoch "
                           f"{infos[0].epoch} for {accumulation_steps} accumulation steps; the loader and the "
                           "trainer disagree")
    return step_normalizer(infos[0].window_tokens)
