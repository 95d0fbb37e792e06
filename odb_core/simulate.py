"""A virtual cluster: W simulated ranks run the loader's own round logic in one process, on lengths only.

Used by the property tests, by the benchmarks and by `odb plan`. Each rank's stream is a list of `Item`s in
sampler order; every round each rank tops up its window, the states are "gathered" in a list, and every rank
applies the same decision, exactly as `RankEngine` does under Gloo.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from odb_core.alignment import Slot
from odb_core.budget import Item
from odb_core.config import ODBConfig
from odb_core.engine import RankEngine
from odb_core.step_info import STEP_SUM_FIELDS
from odb_core.termination import STATE_FIELDS


@dataclass(slots=True)
class EpochPlan:
    """What one epoch emits: `steps[r][k]` is rank r's k-th slot (a `Group` or None for IDLE).

    `gathered_ints` / `reduced_ints` count the int64 values all ranks together receive from the round
    all_gathers and all_reduces (divide by W for one rank)."""

    steps: list[list[Slot]]
    rounds: int
    not_emitted: list[list[int]]
    oversize: int
    gathered_ints: int = 0
    reduced_ints: int = 0
    splits: int = 0
    pushed_back: int = 0
    targets: list[int] = field(default_factory=list)

    @property
    def n_steps(self) -> int:
        return len(self.steps[0]) if self.steps else 0


def simulate_epoch(streams: Sequence[Sequence[Item]], config: ODBConfig, epoch: int = 0,
                   max_rounds: int | None = None) -> EpochPlan:
    """Run one epoch on `len(streams)` virtual ranks. Raises RuntimeError past `max_rounds` (a bound check).

    `max_rounds` defaults to the bound stated in NOTE [ Rounds and termination ]: max stream length + 2.
    """
    world = len(streams)
    bound = max_rounds if max_rounds is not None else max((len(s) for s in streams), default=0) + 2
    engines = [RankEngine(config, epoch) for _ in range(world)]
    cursors = [0] * world
    plan = EpochPlan(steps=[[] for _ in range(world)], rounds=0, not_emitted=[[] for _ in range(world)],
                     oversize=0)
    while not engines[0].finished:
        if plan.rounds >= bound:
            raise RuntimeError(f"epoch did not terminate within {bound} rounds")
        locals_ = []
        for rank, engine in enumerate(engines):
            take = min(engine.space(), len(streams[rank]) - cursors[rank])
            for item in streams[rank][cursors[rank] : cursors[rank] + take]:
                engine.admit(item)
            cursors[rank] += take
            locals_.append(engine.start_round(active=cursors[rank] < len(streams[rank])))
        states = [local.state for local in locals_]
        decision = engines[0].decide(states)
        for rank, engine in enumerate(engines):
            adjustment = engine.finish_round(locals_[rank], decision)
            plan.steps[rank].extend(adjustment.slots)
            plan.splits += adjustment.n_split
            plan.pushed_back += adjustment.n_pushed_back
        plan.rounds += 1
        plan.targets.append(decision.target)
        plan.gathered_ints += world * world * STATE_FIELDS
        plan.reduced_ints += world * decision.target * STEP_SUM_FIELDS
    for rank, engine in enumerate(engines):
        plan.not_emitted[rank] = [it.index for it in engine.items] + [it.index for it in streams[rank][cursors[rank]:]]
        plan.oversize += engine.oversize
    return plan
