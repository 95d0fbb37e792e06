"""One rank's buffer and round logic, with no I/O.

`RankEngine` is shared by the real loader (which feeds it processed samples and exchanges `RankState`s over
Gloo) and by the virtual cluster in `simulate.py` (which feeds it lengths and exchanges states in a list).
Because both run this code, the simulator's plans are the loader's plans.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from odb_core.planning.alignment import Adjustment, RoundKey, adjust, order_slots
from odb_core.planning.budget import Item, SampleError, build_budget
from odb_core.planning.grouping import BufferPlan, plan_buffer
from odb_core.planning.round_sizes import round_target
from odb_core.planning.termination import (Decision, DesyncError, RankState, align_to_accumulation, build_termination,
                                           check_same_progress)
from odb_core.settings.config import ODBConfig

__all__ = ["DesyncError", "LocalRound", "Oversize", "RankEngine", "BufferEngine"]


@dataclass(frozen=True, slots=True)
class LocalRound:
    """This rank's half of a round before the exchange: its plan and the state it reports."""

    plan: BufferPlan
    state: RankState


@dataclass(slots=True)
class Oversize:
    """The samples a rank admitted that exceed a limit on their own and so run alone, over it
    (`oversize="alone"`): how many, and the largest of each cost fact among them, which the warning names
    (NOTE [ Samples over the budget ] in odb_core/epoch/pipeline.py). Counting only: planning logs nothing."""

    count: int = 0
    cost: float = 0.0  # the largest token cost of one alone (its length under the padded and tokens costs)
    longest: int = 0  # the most tokens of one
    patches: int = 0  # the most vision patches of one

    def add(self, item: Item, cost: float) -> None:
        self.count += 1
        self.cost, self.longest = max(self.cost, cost), max(self.longest, item.length)
        self.patches = max(self.patches, item.patches)


class BufferEngine:
    """One rank's buffer of observed-but-unemitted samples and its epoch counters (both planning modes).

    `space()` and `admit()` fill the buffer before each round; `round`, `steps_done`, `oversize` (an `Oversize`)
    and `finished` count the epoch's progress. The planning itself is the subclass's."""

    def __init__(self, config: ODBConfig, epoch: int, rank: int = 0) -> None:
        self.config, self.epoch, self.rank = config, epoch, rank
        self.budget = build_budget(config)
        self.termination = build_termination(config.join)
        self.items: list[Item] = []
        self.n_carried = 0  # the first n_carried items were buffered before the current round began
        self.resumed_at = 0  # set for the first round after a resume (RankState.resumed_at)
        self.round = 0
        self.steps_done = 0
        self.oversize = Oversize()
        self.finished = False

    def space(self, left: int | None) -> int:
        """How many more samples the buffer takes before this round's plan (NOTE [ Round sizes ]); `left`: samples
        of this rank's stream not yet admitted, None when its length is unknown."""
        return max(round_target(self.config, self.round, len(self.items), left) - len(self.items), 0)

    def admit(self, item: Item) -> None:
        """Add one observed sample to the buffer, applying the oversize policy."""
        # a checked sample has length >= 1; `odb plan` and `simulate_epoch` may pass any int, which the cost models
        # answer (a negative length can exceed an attention budget)
        if not (0 < item.length <= self.budget.alone_length and not item.patches) and not self.budget.alone_fits(item):
            if self.config.oversize == "error":  # name the limit it exceeds: the patch cap too
                cap = self.config.max_patches
                limits = [f"max_patches={cap}"] if cap is not None and item.patches > cap else []
                if self.budget.alone_cost(item) > self.config.token_budget or not limits:
                    limits.insert(0, f"token_budget={self.config.token_budget}")
                which = "it" if len(limits) == 1 else "them"
                raise SampleError(item.index, f"cost of length {item.length} (patches {item.patches}) exceeds "
                                              f"{' and '.join(limits)} on its own; raise {which}, truncate the "
                                              "sample, or set oversize='alone'")
            self.oversize.add(item, self.budget.alone_cost(item))
        self.items.append(item)

    def leaving_state(self) -> RankState:
        """What a rank reports when its consumer abandoned the epoch (NOTE [ Leaving an epoch ])."""
        return RankState(active=False, n_ready=0, n_groups=0, n_samples=len(self.items), steps_done=self.steps_done,
                         epoch=self.epoch, round=self.round, leaving=True, resumed_at=self.resumed_at)

    def end_early(self) -> None:
        """Some rank left the epoch: this rank's epoch ends here, after the steps already planned."""
        self.round += 1
        self.finished = True


class RankEngine(BufferEngine):
    """Rank-local planning: this rank's buffer is planned alone, and alignment equalises the step counts.

    Call order per round: `space()` and `admit()` until the buffer is full or the stream ends, then
    `start_round()`, exchange `LocalRound.state` with every rank, then `finish_round()` with all states.
    """

    def start_round(self, active: bool) -> LocalRound:
        """Plan the buffer. `active` is False once this rank's stream has ended (the rank is closing)."""
        plan = plan_buffer(self.items, self.budget, closing=not active)
        state = RankState(active=active, n_ready=plan.n_ready, n_groups=len(plan.groups),
                          n_samples=len(self.items), steps_done=self.steps_done, epoch=self.epoch, round=self.round,
                          resumed_at=self.resumed_at)
        return LocalRound(plan=plan, state=state)

    def decide(self, states: Sequence[RankState]) -> Decision:
        """The round's decision from every rank's state (identical on every rank)."""
        check_same_progress(states, self.round, self.epoch)
        decision = self.termination.decide(states)
        return align_to_accumulation(decision, self.steps_done, self.config.accumulation_steps)

    def finish_round(self, local: LocalRound, decision: Decision) -> Adjustment:
        """Apply the decision: exactly `decision.target` ordered slots; unchosen samples stay buffered."""
        adjustment = adjust(local.plan, decision.target, self.budget)
        key = RoundKey(seed=self.config.seed, epoch=self.epoch, round=self.round)
        ordered = order_slots(adjustment.slots, key, self.config.shuffle_steps)
        self.items = list(adjustment.kept)
        self.steps_done += decision.target
        self.round += 1
        self.resumed_at = 0
        self.finished = decision.final
        return Adjustment(slots=ordered, kept=adjustment.kept, n_split=adjustment.n_split,
                          n_pushed_back=adjustment.n_pushed_back)
