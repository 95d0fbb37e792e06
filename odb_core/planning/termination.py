"""Join and non-join termination: two strategies behind one interface.

NOTE [ Rounds and termination ]
An epoch runs in rounds. In each round every rank (1) tops its buffer up to `window` samples from its stream,
(2) plans groups, (3) all-gathers a `RankState` (10 ints per rank), (4) calls `decide` on the same
gathered states, so every rank gets the same `Decision`, and (5) emits exactly `Decision.target` steps.

A rank is *active* while its stream still has samples; an active rank always reports at least one ready group
(the lone-group rule in `grouping.plan_buffer`), so every round with an active rank consumes at least one sample
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

Global planning (NOTE [ Pooled rounds ] in pooled.py) asks the same two strategies through `decide_pooled`, with
the facts of the pooled plan instead of per-rank states. Join: while some stream is active, T = the number of full
bands of W groups, at least one; once none is, every group (the last band completed by splits, then IDLE).
Non-join: full bands only; it ends in the first round whose pool cannot fill a band while a stream is active, or
once none is, and reports the rest, except where the pool is too small for a band by the config, not by the data
(NOTE [ A pool too small for a band ]
"The pool cannot fill a band" meant the pooled data could no longer feed every rank. But a pool may be short of
W groups for reasons of the config, not the data, and those epochs ended there with every sample buffered or
unread reported, not trained (a review ran it: non-join at W = 8 with a 16,384-token budget over samples of
50-400 tokens, 0 steps and 24,000 samples): the growing ramp's first pools (W x `min_window` samples; at W = 8
under pooled round sizes, 512), the halving rounds at a map-style epoch's end, a buffer stopped by
`max_buffer_bytes`, or a full window of samples that pack a few large groups. So, while a stream is active:
  * a round of the growing ramp (NOTE [ Round sizes ]) plans no step (T = 0; every sample stays buffered) and
    the next, larger one reads more: at most `ramp_rounds` such rounds per epoch;
  * after the ramp, a pool whose ready groups hold at least W samples emits one band, completed by splits;
  * only a pool with fewer ready samples than ranks ends the epoch, as before (no IDLE); once no stream is
    active, the final round emits its full bands and reports the rest (fewer than W groups), as before.
`PoolFacts.growing` (from the config and the round index, the same on every rank) and `.splittable` (from the
shared cut) say which; node-aware rounds send `splittable` in `NodeState`. Non-join under pooled planning may
then split a group mid-epoch, never IDLE; every such round emits at least W samples. Rank-local non-join is
unchanged.

Bound: with n_r samples on rank r, an epoch takes at most max_r(n_r) + 1 rounds (each round before the last one
consumes a sample from every active rank). Each round costs one all_gather of 10 int64 per rank and one
all_reduce of 6 int64 per step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

STATE_FIELDS = 10  # ints per rank in the round's all_gather (`RankState`)
# Per step, one all_reduce sums these over ranks: samples, supervised tokens, input tokens, cost, cost^2, patches.
STEP_SUM_FIELDS = 6


@dataclass(frozen=True, slots=True)
class RankState:
    """One rank's report for a round; travels as `STATE_FIELDS` int64 values.

    `epoch`, `round` and `steps_done` say where the rank stands: every rank must report the same three, or the
    round raises `DesyncError` (ranks resumed from states saved at different steps, or given different epochs).
    `leaving` is set by a rank whose consumer abandoned the epoch (NOTE [ Leaving an epoch ] in pipeline.py)."""

    active: bool
    n_ready: int
    n_groups: int
    n_samples: int
    steps_done: int
    epoch: int = 0
    round: int = 0
    leaving: bool = False
    n_carried: int = 0  # global planning: the first n_carried buffered items were buffered before this round
    resumed_at: int = 0  # the first round after a resume: the step the rank resumes at (0 otherwise)

    def to_ints(self) -> list[int]:
        return [int(self.active), self.n_ready, self.n_groups, self.n_samples, self.steps_done, self.epoch,
                self.round, int(self.leaving), self.n_carried, self.resumed_at]

    @classmethod
    def from_ints(cls, values: Sequence[int]) -> RankState:
        (active, n_ready, n_groups, n_samples, steps_done, epoch, round_, leaving, carried,
         resumed_at) = (int(v) for v in values)
        return cls(active=bool(active), n_ready=n_ready, n_groups=n_groups, n_samples=n_samples,
                   steps_done=steps_done, epoch=epoch, round=round_, leaving=bool(leaving), n_carried=carried,
                   resumed_at=resumed_at)


@dataclass(frozen=True, slots=True)
class Decision:
    """The same answer on every rank: emit `target` steps this round; `final` ends the epoch after it."""

    target: int
    final: bool


@dataclass(frozen=True, slots=True)
class PoolFacts:
    """What a pooled round's decision depends on: whether any stream is active, the groups of the pool that may
    be emitted (`n_ready`: all but the held tail) and in all, and the world size."""

    any_active: bool
    n_ready: int
    n_groups: int
    world: int
    growing: bool = False  # the rounds still grow: the next round's buffers may hold more (NOTE [ Round sizes ])
    splittable: bool = False  # the ready groups hold at least W samples: splits alone can make one band of them

    def full_bands(self, groups: int) -> int:
        return groups // self.world


class DesyncError(RuntimeError):
    """Ranks disagree on the epoch's progress; continuing would hang or mis-weight the loss."""


def check_same_progress(states: Sequence[RankState], round_index: int, epoch: int) -> None:
    """Every rank must be at the same (epoch, round, step) and, after a resume, resume at the same step: same
    config, same epoch, states saved after the same step (NOTE [ A state proves itself ])."""
    resumed = [s.resumed_at for s in states]
    if len(set(resumed)) != 1:
        raise DesyncError(f"ranks resumed at different steps {resumed} of epochs {[s.epoch for s in states]} (by "
                          "rank; a state saved at an epoch's last step resumes at step 0 of the next): their states "
                          "were saved after different steps; save every rank's state after the same step (or load "
                          "one merge_states() of all of them, which checks it)")
    where = [(s.epoch, s.round, s.steps_done) for s in states]
    if len(set(where)) != 1 or where[0][:2] != (epoch, round_index):
        raise DesyncError(f"ranks are at different points of the epoch (epoch, round, step per rank: {where}; this "
                          f"rank: epoch {epoch}, round {round_index}): did every rank load the state it saved after "
                          "the same step, call set_epoch with the same epoch, and build its loader with the same "
                          "config and data?")


class Termination(ABC):
    """Maps the gathered rank states of a round to a `Decision`. Pure: no I/O, same input, same output."""

    @abstractmethod
    def decide(self, states: Sequence[RankState]) -> Decision:
        """Called once per round, by every rank, with every rank's state in rank order."""

    @abstractmethod
    def decide_pooled(self, pool: PoolFacts) -> Decision:
        """Called once per pooled round, by every rank, with the facts of the same pooled plan."""


class JoinTermination(Termination):
    """Drain every rank: identity coverage (each sample in exactly one non-IDLE step on one rank)."""

    def decide(self, states: Sequence[RankState]) -> Decision:
        active = [s for s in states if s.active]
        if active:
            return Decision(target=min(s.n_ready for s in active), final=False)
        return Decision(target=max(s.n_groups for s in states), final=True)

    def decide_pooled(self, pool: PoolFacts) -> Decision:
        """Full bands while a stream is active (at least one band: a short band is completed by splits and
        IDLE); once none is, every group: the last band is completed the same way."""
        if pool.any_active:
            return Decision(target=max(pool.full_bands(pool.n_ready), 1), final=False)
        return Decision(target=-(-pool.n_groups // pool.world), final=True)


class QuotaTermination(Termination):
    """Stop at the shortest rank with equal, closed counts: no IDLE, no split, nothing emitted twice."""

    def decide(self, states: Sequence[RankState]) -> Decision:
        target = min(s.n_ready for s in states)
        final = any(not s.active and s.n_groups <= target for s in states)
        return Decision(target=target, final=final)

    def decide_pooled(self, pool: PoolFacts) -> Decision:
        """Full bands only: the epoch ends in the first round whose pool cannot fill one band of W groups while
        a stream is active (the pooled data can no longer feed every rank), or once no stream is active. That
        round emits the full bands of every group, tail included; the rest is reported. NOTE [ A pool too small
        for a band ]: a round of the growing ramp plans nothing instead (the next reads more), and a pool
        otherwise holding a sample per rank emits one band completed by splits."""
        if pool.any_active and pool.full_bands(pool.n_ready) >= 1:
            return Decision(target=pool.full_bands(pool.n_ready), final=False)
        if pool.any_active and pool.growing:
            return Decision(target=0, final=False)
        if pool.any_active and pool.splittable:
            return Decision(target=1, final=False)
        return Decision(target=pool.full_bands(pool.n_groups), final=True)


def align_to_accumulation(decision: Decision, steps_done: int, accumulation_steps: int) -> Decision:
    """Round the last round's target up so that the epoch's step count is a multiple of `accumulation_steps`
    (an epoch end never cuts a gradient-accumulation window). Extra steps are splits or IDLE."""
    if not decision.final or accumulation_steps == 1:
        return decision
    total = steps_done + decision.target
    return Decision(target=decision.target + (-total) % accumulation_steps, final=True)


def build_termination(join: bool) -> Termination:
    return JoinTermination() if join else QuotaTermination()
