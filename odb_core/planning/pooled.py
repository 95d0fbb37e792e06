"""Global planning: one plan over every rank's buffered samples, dealt to the ranks one band of groups per step.

NOTE [ Pooled rounds ]
In global mode (`planning="global"`, W > 1) every rank still reads its own stream into its own buffer, but the
round's plan is computed over the *pool*, the union of every rank's buffered items, which every rank receives
(one all_gather of (index, length, patches) per buffered item). `plan_pooled_round` is a pure function of the
pool, so every rank computes the same plan:
  1. sort the pool by (length, patches) descending, then (owner, index): a total order;
  2. cut it with the rank-local greedy (`pack_sorted`); unless every stream has ended, the last group (the
     *tail*) stays buffered, as in rank-local mode, to be re-planned with the next round's samples, unless all
     its samples were already carried over from an earlier round (it would not grow: see NOTE [ No starving ]);
  3. the termination strategy picks T (`decide_pooled`): while a stream is active, the number of full bands
     (at least one); in the final round, every group (join) or the full bands only (non-join); then T is rounded
     up to a multiple of the accumulation steps;
  4. T x W ready groups are emitted, those holding a carried-over sample first, then the fullest (the others, and
     the tail, stay in their owners' buffers); when fewer groups than T x W exist, the widest are split, then IDLE
     fills the rest;
  5. the emitted groups, by cost, are cut into T bands of W: a band is one step, one group per rank, so groups
     of similar cost run side by side;
  6. in each band a group goes to the rank that holds most of its samples (greedy on the overlap counts), the
     rest to the remaining ranks in rank order; the bands run in the round's shared permutation.
NOTE [ No starving ] A rank reads only as much as its buffer has room for, and its buffer empties only when its
samples are emitted. Were the fullest groups always chosen, a rank whose samples form low-cost groups (all short,
say) could keep its buffer full of pushed-back samples round after round, read nothing, and see its whole stream
pushed to the end of the epoch (or dropped, under non-join). So a sample carried over from an earlier round gives
its group priority, and a tail made only of carried-over samples is not held again: what waited once goes next.
`carried` is part of the plan's input: each rank reports how many of its buffered items it carried into the
round (`RankState.n_carried`, the buffer at the round start), which a resumed rank restores with its buffer.

Every pooled item is either in exactly one emitted group or kept in its owner's buffer: nothing is lost or
duplicated (G3), and every rank emits exactly T steps (G2). The samples of a group that lands on another rank
than their owner *move* (NOTE [ Moving samples ] in moves.py); kept samples never move.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from odb_core.planning.alignment import RoundKey, Slot, step_permutation
from odb_core.planning.budget import GroupBudget, Item, build_budget
from odb_core.planning.grouping import Group, pack_sorted, sort_longest_first, split_widest
from odb_core.planning.planner import BufferEngine
from odb_core.planning.round_sizes import growing
from odb_core.planning.termination import (Decision, PoolFacts, RankState, align_to_accumulation, build_termination,
                                           check_same_progress)
from odb_core.settings.config import ODBConfig

POOL_FIELDS = 3  # per buffered item in the round's all_gather: index, length, patches


@dataclass(frozen=True, slots=True)
class PooledRound:
    """One round's plan, the same on every rank. `steps[k][r]` is rank r's slot in the k-th step (in run order);
    `kept[r]` the items that stay in rank r's buffer."""

    steps: tuple[tuple[Slot, ...], ...]
    kept: tuple[tuple[Item, ...], ...]
    decision: Decision
    n_split: int
    n_pushed_back: int

    def slots_of(self, rank: int) -> tuple[Slot, ...]:
        return tuple(step[rank] for step in self.steps)

    def owned_by_step(self, owner: int) -> list[tuple[int, ...]]:
        """Per step, the indices of `owner`'s items emitted by any rank (what elastic resume subtracts)."""
        return [tuple(it.index for slot in step if slot is not None for it in slot.items if it.owner == owner)
                for step in self.steps]


def _fresh(group: Group) -> bool:
    """Whether no sample of the group was carried over from an earlier round (such groups wait first)."""
    return not any(it.carried for it in group.items)


def _assign_band(band: Sequence[Slot], world: int) -> list[Slot]:
    """One band's groups to ranks: largest overlap first (the rank holding most of a group's samples)."""
    pairs = sorted(((-count, g, owner) for g, group in enumerate(band) if group is not None
                    for owner, count in Counter(it.owner for it in group.items).items()))
    placed: dict[int, int] = {}  # group -> rank
    taken: set[int] = set()
    for _, g, owner in pairs:
        if g not in placed and owner not in taken:
            placed[g] = owner
            taken.add(owner)
    free = iter(r for r in range(world) if r not in taken)
    by_rank: list[Slot] = [None] * world
    for g, group in enumerate(band):
        by_rank[placed[g] if g in placed else next(free)] = group
    return by_rank


def _kept(buffers: Sequence[Sequence[Item]], emitted: Sequence[Slot]) -> tuple[tuple[Item, ...], ...]:
    """Each owner's buffer minus its emitted items (a multiset: an index may repeat in a buffer). Emitted items
    come from the buffers, so an owner that emitted as many items as it buffered keeps nothing."""
    gone: list[Counter[int]] = [Counter() for _ in buffers]
    for group in emitted:
        if group is not None:
            for it in group.items:
                gone[it.owner][it.index] += 1
    kept = []
    for buffer, out in zip(buffers, gone, strict=True):
        if not out:
            kept.append(tuple(buffer))
            continue
        if out.total() == len(buffer):
            kept.append(())
            continue
        stay = []
        for item in buffer:
            if out[item.index] > 0:
                out[item.index] -= 1
            else:
                stay.append(item)
        kept.append(tuple(stay))
    return tuple(kept)


@dataclass(frozen=True, slots=True)
class PoolRequest:
    """The inputs of one pooled round besides the pool itself."""

    active: Sequence[bool]
    steps_done: int
    key: RoundKey


@dataclass(frozen=True, slots=True)
class PoolCut:
    """A pool sorted and cut into groups (steps 1-2 of NOTE [ Pooled rounds ]), before T is known: what the
    termination strategy decides on (`facts`) and what `deal_pool` deals. Node-aware rounds (NOTE [ Node-aware
    rounds ] in nodes.py) cut each node's pool, exchange its facts across nodes, then deal."""

    buffers: Sequence[Sequence[Item]]
    groups: Sequence[Group]
    n_ready: int  # all groups but the held tail
    any_active: bool
    splittable: bool = False  # the ready groups hold a sample per rank: splits alone can make one band of them

    def facts(self, growing: bool = False) -> PoolFacts:
        return PoolFacts(any_active=self.any_active, n_ready=self.n_ready, n_groups=len(self.groups),
                         world=len(self.buffers), growing=growing, splittable=self.splittable)


def cut_pool(buffers: Sequence[Sequence[Item]], active: Sequence[bool], budget: GroupBudget) -> PoolCut:
    """Sort the pool (a total order) and cut it with the rank-local greedy; the tail is held while a stream is
    active unless it is all carried over (NOTE [ No starving ]). Pure; O(P log P) for P pooled items."""
    groups = pack_sorted(sort_longest_first([it for b in buffers for it in b], by_owner=True), budget)
    any_active = any(active)
    hold_tail = any_active and len(groups) > 1 and not all(it.carried for it in groups[-1].items)
    n_ready = len(groups) - 1 if hold_tail else len(groups)
    splittable = sum(len(g.items) for g in groups[:n_ready]) >= len(buffers)
    return PoolCut(buffers=buffers, groups=groups, n_ready=n_ready, any_active=any_active, splittable=splittable)


def deal_pool(cut: PoolCut, decision: Decision, key: RoundKey, config: ODBConfig, budget: GroupBudget) -> PooledRound:
    """Steps 4-6 of NOTE [ Pooled rounds ]: emit `decision.target` bands of W groups and deal them to the ranks.
    Pure and deterministic; every pooled item ends in exactly one emitted group or in its owner's `kept`."""
    world, groups = len(cut.buffers), cut.groups
    slots = decision.target * world
    eligible = len(groups) if decision.final else cut.n_ready  # the final round may emit the tail too
    fullest = sorted(range(eligible), key=lambda i: (_fresh(groups[i]), -groups[i].cost, i))[:slots]
    emitted = [groups[i] for i in sorted(fullest)]
    n_split = split_widest(emitted, slots, budget)
    ranked = sorted(range(len(emitted)), key=lambda i: (-emitted[i].cost, i))
    by_cost: list[Slot] = [emitted[i] for i in ranked] + [None] * (slots - len(emitted))
    bands = [_assign_band(by_cost[k * world : (k + 1) * world], world) for k in range(decision.target)]
    order = step_permutation(len(bands), key, config.shuffle_steps)
    return PooledRound(steps=tuple(tuple(bands[p]) for p in order), kept=_kept(cut.buffers, emitted),
                       decision=decision, n_split=n_split, n_pushed_back=len(groups) - len(fullest))


def plan_pooled_round(buffers: Sequence[Sequence[Item]], request: PoolRequest, config: ODBConfig,
                      budget: GroupBudget | None = None) -> PooledRound:
    """The round's plan over every rank's buffer (see NOTE [ Pooled rounds ]). Pure and deterministic."""
    budget = budget if budget is not None else build_budget(config)
    cut = cut_pool(buffers, request.active, budget)
    decision = build_termination(config.join).decide_pooled(cut.facts(growing(config, request.key.round)))
    decision = align_to_accumulation(decision, request.steps_done, config.accumulation_steps)
    return deal_pool(cut, decision, request.key, config, budget)


def pool_buffers(states: Sequence[RankState], pooled: Sequence[Sequence[int]]) -> list[list[Item]]:
    """Every rank's buffer from the gathered states and `pool_ints()` (rank order; owner = position)."""
    return [[Item(index=ints[k], length=ints[k + 1], patches=ints[k + 2], owner=rank,
                  carried=k < POOL_FIELDS * state.n_carried)
             for k in range(0, POOL_FIELDS * state.n_samples, POOL_FIELDS)]
            for rank, (state, ints) in enumerate(zip(states, pooled, strict=True))]


class PooledEngine(BufferEngine):
    """One rank's buffer in global mode (the pooled counterpart of `RankEngine`). Per round: `state(active)` and
    `pool_ints()` are exchanged, then `finish_round` computes the shared plan and keeps this rank's part of the
    pool. No I/O."""

    def state(self, active: bool) -> RankState:
        return RankState(active=active, n_ready=0, n_groups=0, n_samples=len(self.items), steps_done=self.steps_done,
                         epoch=self.epoch, round=self.round, n_carried=self.n_carried, resumed_at=self.resumed_at)

    def pool_ints(self) -> list[int]:
        return [x for it in self.items for x in (it.index, it.length, it.patches)]

    def finish_round(self, states: Sequence[RankState], pooled: Sequence[Sequence[int]]) -> PooledRound:
        """The shared plan from every rank's state and `pool_ints()` (rank order); keeps this rank's share."""
        check_same_progress(states, self.round, self.epoch)
        buffers = pool_buffers(states, pooled)
        request = PoolRequest(active=[s.active for s in states], steps_done=self.steps_done,
                              key=RoundKey(seed=self.config.seed, epoch=self.epoch, round=self.round))
        plan = plan_pooled_round(buffers, request, self.config, self.budget)
        self.apply(plan)
        return plan

    def apply(self, plan: PooledRound) -> None:
        """Keep this rank's share of the pool and count the round (the simulator plans once for all ranks)."""
        self.items = list(plan.kept[self.rank])
        self.n_carried = len(self.items)
        self.steps_done += plan.decision.target
        self.round += 1
        self.resumed_at = 0
        self.finished = plan.decision.final
