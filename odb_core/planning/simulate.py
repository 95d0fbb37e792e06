"""A virtual cluster: W simulated ranks run the loader's own round logic in one process, on lengths only.

Used by the property tests, by the benchmarks and by `odb plan`. Each rank's stream is a list of `Item`s in
sampler order; every round each rank tops up its buffer, the states are "gathered" in a list, and every rank
applies the same decision, exactly as `RankEngine` does under Gloo. Under global planning (W > 1) the pooled
plan (`plan_pooled_round`, the function every real rank runs) is computed once per round and applied to every
rank's `PooledEngine`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from odb_core.planning.alignment import RoundKey, Slot
from odb_core.planning.budget import Item
from odb_core.planning.planner import BufferEngine, RankEngine
from odb_core.planning.pooled import POOL_FIELDS, PooledEngine, PoolRequest, plan_pooled_round
from odb_core.planning.termination import STATE_FIELDS, STEP_SUM_FIELDS
from odb_core.settings.config import ODBConfig


@dataclass(slots=True)
class EpochPlan:
    """What one epoch emits: `steps[r][k]` is rank r's k-th slot (a `Group` or None for IDLE).

    `gathered_ints` / `reduced_ints` count the int64 values all ranks together receive from the round
    all_gathers and all_reduces (divide by W for one rank). `moved` counts emitted samples that ran on another
    rank than the one that read them (global planning only)."""

    steps: list[list[Slot]]
    rounds: int
    not_emitted: list[list[int]]
    oversize: int
    gathered_ints: int = 0
    reduced_ints: int = 0
    splits: int = 0
    pushed_back: int = 0
    moved: int = 0
    targets: list[int] = field(default_factory=list)

    @property
    def n_steps(self) -> int:
        return len(self.steps[0]) if self.steps else 0

    def global_sizes(self, unit: str = "samples") -> list[int]:
        """Per step, the samples (`unit="samples"`) or input tokens (`"tokens"`) of every rank together."""
        measure = (lambda slot: slot.size) if unit == "samples" else (lambda slot: sum(it.length for it in slot.items))
        return [sum(measure(rank[k]) for rank in self.steps if rank[k] is not None) for k in range(self.n_steps)]

    @property
    def emitted(self) -> int:
        return sum(slot.size for rank in self.steps for slot in rank if slot is not None)


def is_pooled(config: ODBConfig, world: int) -> bool:
    """Whether an epoch at this world size plans globally (NOTE [ Pooled rounds ]); W = 1 is rank-local."""
    return config.planning == "global" and world > 1


def _fill(engines: Sequence[BufferEngine], streams: Sequence[Sequence[Item]], cursors: list[int],
          ended: list[bool], lengths_known: bool) -> list[bool]:
    """Top every rank's buffer up from its stream; returns which ranks are still active.

    As `SampleReader.fill` does, a rank learns that its stream ended only when it wants more samples than are
    left; one whose buffer fills up with exactly the last sample is still active until a later fill has room."""
    for rank, engine in enumerate(engines):
        left = len(streams[rank]) - cursors[rank]
        space = engine.space(left if lengths_known else None)
        for item in streams[rank][cursors[rank] : cursors[rank] + min(space, left)]:
            engine.admit(item)
        cursors[rank] += min(space, left)
        ended[rank] = ended[rank] or space > left
    return [not e for e in ended]


def simulate_epoch(streams: Sequence[Sequence[Item]], config: ODBConfig, epoch: int = 0,
                   max_rounds: int | None = None, lengths_known: bool = True) -> EpochPlan:
    """Run one epoch on `len(streams)` virtual ranks. Raises RuntimeError past `max_rounds` (a bound check).

    `lengths_known`: each rank knows how many samples its stream holds, as the loader does for map-style data
    (the last rounds shrink: NOTE [ Round sizes ]); False models an `IterableDataset`.

    `max_rounds` defaults to the bound stated in NOTE [ Rounds and termination ]: max stream length + 2 (rank-
    local) or all samples + 2 (global).
    """
    world = len(streams)
    pooled = is_pooled(config, world)
    longest = sum(len(s) for s in streams) if pooled else max((len(s) for s in streams), default=0)
    bound = max_rounds if max_rounds is not None else longest + 2
    engine_type = PooledEngine if pooled else RankEngine
    engines = [engine_type(config, epoch, rank) for rank in range(world)]
    cursors, ended = [0] * world, [False] * world
    plan = EpochPlan(steps=[[] for _ in range(world)], rounds=0, not_emitted=[[] for _ in range(world)],
                     oversize=0)
    while not engines[0].finished:
        if plan.rounds >= bound:
            raise RuntimeError(f"epoch did not terminate within {bound} rounds")
        active = _fill(engines, streams, cursors, ended, lengths_known)
        target = _pooled_round(engines, active, plan) if pooled else _local_round(engines, active, plan)
        plan.rounds += 1
        plan.targets.append(target)
        plan.reduced_ints += world * target * STEP_SUM_FIELDS
    for rank, engine in enumerate(engines):
        plan.not_emitted[rank] = [it.index for it in engine.items] + [it.index for it in streams[rank][cursors[rank]:]]
        plan.oversize += engine.oversize.count
    return plan


def _local_round(engines: Sequence[RankEngine], active: list[bool], plan: EpochPlan) -> int:
    locals_ = [engine.start_round(active=flag) for engine, flag in zip(engines, active, strict=True)]
    decision = engines[0].decide([local.state for local in locals_])
    for rank, engine in enumerate(engines):
        adjustment = engine.finish_round(locals_[rank], decision)
        plan.steps[rank].extend(adjustment.slots)
        plan.splits += adjustment.n_split
        plan.pushed_back += adjustment.n_pushed_back
    plan.gathered_ints += len(engines) * len(engines) * STATE_FIELDS
    return decision.target


def _pooled_round(engines: Sequence[PooledEngine], active: list[bool], plan: EpochPlan) -> int:
    world, first = len(engines), engines[0]
    buffers = [[Item(index=it.index, length=it.length, patches=it.patches, owner=rank, carried=k < engine.n_carried)
                for k, it in enumerate(engine.items)] for rank, engine in enumerate(engines)]
    request = PoolRequest(active=active, steps_done=first.steps_done,
                          key=RoundKey(seed=first.config.seed, epoch=first.epoch, round=first.round))
    pooled = plan_pooled_round(buffers, request, first.config, first.budget)
    for engine in engines:
        engine.apply(pooled)
    for rank in range(world):
        slots = pooled.slots_of(rank)
        plan.steps[rank].extend(slots)
        plan.moved += sum(it.owner != rank for slot in slots if slot is not None for it in slot.items)
    plan.splits += pooled.n_split
    plan.pushed_back += pooled.n_pushed_back
    widest = max(len(b) for b in buffers)
    plan.gathered_ints += world * world * (STATE_FIELDS + POOL_FIELDS * widest)
    return pooled.decision.target
