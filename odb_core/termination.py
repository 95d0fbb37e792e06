"""Join and non-join termination: two strategies behind one interface.

NOTE [ Rounds and termination ]
An epoch runs in rounds. In each round every rank (1) tops its buffer up to `window` samples from its stream,
(2) plans groups, (3) all-gathers a `RankState` (one small int vector per rank), (4) calls `decide` on the same
gathered states, so every rank gets the same `Decision`, and (5) emits exactly `Decision.target` steps.

A rank is *active* while its stream still has samples; an active rank always reports at least one ready group
(the lone-group rule in `grouping.plan_window`), so every round with an active rank consumes at least one sample
from every active rank. A rank whose stream ended is *closing*: all its buffered groups are ready.

`JoinTermination` (join=True, the default), called once per round by every rank:
  * while some rank is active, target = min over active ranks of their ready groups. Ranks with more push the
    extra groups back into their buffer; closing ranks with fewer split groups or run IDLE steps;
  * once no rank is active, target = max over ranks of their groups: everything left is emitted, and the epoch
    ends. Every sample of every rank is emitted exactly once.

`QuotaTermination` (join=False), same caller and cadence:
  * target = min over all ranks of their ready groups, so no rank splits and none runs IDLE;
  * the epoch ends in the first round where some closing rank empties its buffer. The other ranks' buffered
    samples and unread streams are not emitted; the loader reports them.

Bound: with n_r samples on rank r, an epoch takes at most max_r(n_r) + 1 rounds (each round before the last one
consumes a sample from every active rank). Each round costs one all_gather of 5 int64 per rank and one
all_reduce of 6 int64 per step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

STATE_FIELDS = 5


@dataclass(frozen=True, slots=True)
class RankState:
    """One rank's report for a round; travels as `STATE_FIELDS` int64 values."""

    active: bool
    n_ready: int
    n_groups: int
    n_samples: int
    steps_done: int

    def to_ints(self) -> list[int]:
        return [int(self.active), self.n_ready, self.n_groups, self.n_samples, self.steps_done]

    @classmethod
    def from_ints(cls, values: Sequence[int]) -> RankState:
        active, n_ready, n_groups, n_samples, steps_done = (int(v) for v in values)
        return cls(active=bool(active), n_ready=n_ready, n_groups=n_groups, n_samples=n_samples,
                   steps_done=steps_done)


@dataclass(frozen=True, slots=True)
class Decision:
    """The same answer on every rank: emit `target` steps this round; `final` ends the epoch after it."""

    target: int
    final: bool


class Termination(ABC):
    """Maps the gathered rank states of a round to a `Decision`. Pure: no I/O, same input, same output."""

    @abstractmethod
    def decide(self, states: Sequence[RankState]) -> Decision:
        """Called once per round, by every rank, with every rank's state in rank order."""


class JoinTermination(Termination):
    """Drain every rank: identity coverage (each sample in exactly one non-IDLE step on one rank)."""

    def decide(self, states: Sequence[RankState]) -> Decision:
        active = [s for s in states if s.active]
        if active:
            return Decision(target=min(s.n_ready for s in active), final=False)
        return Decision(target=max(s.n_groups for s in states), final=True)


class QuotaTermination(Termination):
    """Stop at the shortest rank with equal, closed counts: no IDLE, no split, nothing emitted twice."""

    def decide(self, states: Sequence[RankState]) -> Decision:
        target = min(s.n_ready for s in states)
        final = any(not s.active and s.n_groups <= target for s in states)
        return Decision(target=target, final=final)


def align_to_accumulation(decision: Decision, steps_done: int, accumulation_steps: int) -> Decision:
    """Round the last round's target up so that the epoch's step count is a multiple of `accumulation_steps`
    (an epoch end never cuts a gradient-accumulation window). Extra steps are splits or IDLE."""
    if not decision.final or accumulation_steps == 1:
        return decision
    total = steps_done + decision.target
    return Decision(target=decision.target + (-total) % accumulation_steps, final=True)


def build_termination(join: bool) -> Termination:
    return JoinTermination() if join else QuotaTermination()
