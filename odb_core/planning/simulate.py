"""A virtual cluster: W simulated ranks run the loader's own round logic in one process, on lengths only.

Used by the property tests, by the benchmarks and by `odb plan`. Each rank's stream is a list of `Item`s in
sampler order; every round each rank tops up its buffer, the states are "gathered" in a list, and every rank
applies the same decision, exactly as `RankEngine` does under Gloo. Under global planning (W > 1) the pooled
plan (`plan_pooled_round`, the function every real rank runs) is computed once per round and applied to every
rank's `PooledEngine`. Node-aware planning (`nodes=NodePlanning(per_node)`, NOTE [ Node-aware rounds ]) cuts
and deals each node's pool once per round and applies it to the node's `NodeEngine`s; the cross-node decision
is the loader's (`NodeEngine.decide_nodes`).

Besides the plan, every round records its `RoundCost`: the metadata bytes one rank would receive in each mode for
the round's buffers, the CPU seconds of this mode's plan on one rank, and the samples moved within and across
nodes. The costs are measurements, not part of the plan: two `EpochPlan`s compare equal on the plan alone.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from odb_core.planning.alignment import RoundKey, Slot
from odb_core.planning.budget import Item
from odb_core.planning.grouping import Group
from odb_core.planning.nodes import NODE_FIELDS, NodeEngine, NodeLayout, NodePlanning
from odb_core.planning.planner import BufferEngine, RankEngine
from odb_core.planning.pooled import POOL_FIELDS, PooledEngine, PoolRequest, cut_pool, plan_pooled_round
from odb_core.planning.round_sizes import fill_more, ramp_rounds
from odb_core.planning.termination import STATE_FIELDS, STEP_SUM_FIELDS
from odb_core.settings.config import ODBConfig


@dataclass(frozen=True, slots=True)
class Metadata:
    """Bytes of planning metadata one rank receives in a round, in each mode, for the same buffers: the round's
    all_gathers (int64), the per-step all_reduce (48 B per step, the same in every mode) left out. Node-aware: the
    rank of the node with the widest buffer."""

    global_: int  # every rank's state and buffered items
    node: int  # its node's states and items, and NODE_FIELDS ints per node (none with one node)
    local: int  # every rank's state


@dataclass(frozen=True, slots=True)
class RoundCost:
    """One simulated round: the metadata each mode would receive, the process-CPU seconds of this mode's plan on
    one rank (the slowest: a node's plan, the global plan, or one rank's), and the emitted samples that run on
    another rank than their owner, of the same node (`moved_within`) or of another node (`moved_across`)."""

    metadata: Metadata
    plan_seconds: float
    moved_within: int
    moved_across: int


@dataclass(slots=True)
class EpochPlan:
    """What one epoch emits: `steps[r][k]` is rank r's k-th slot (a `Group` or None for IDLE).

    `gathered_ints` / `reduced_ints` count the int64 values all ranks together receive from the round
    all_gathers and all_reduces (divide by W for one rank). `moved` counts emitted samples that ran on another
    rank than the one that read them (global and node-aware planning), `moved_across` those of them that ran on
    another node (`nodes` given). `planning` and `costs` (one `RoundCost` per round) are not compared."""

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
    moved_across: int = 0
    planning: str = field(default="local", compare=False)
    costs: list[RoundCost] = field(default_factory=list, compare=False)

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
    """Whether an epoch at this world size pools samples (NOTE [ Pooled rounds ]): planning `global` (node-aware
    or not) or `cluster` at W > 1; W = 1 is rank-local."""
    return config.planning != "local" and world > 1


def _fill(engines: Sequence[BufferEngine], streams: Sequence[Sequence[Item]], cursors: list[int],
          ended: list[bool], lengths_known: bool, sizes: Mapping[int, int] | None) -> list[bool]:
    """Top every rank's buffer up from its stream; returns which ranks are still active.

    As `SampleReader.fill` does, a fill takes samples while the round's target has room and, given the samples'
    payload bytes (`sizes`, by dataset index), while the buffer's bytes are under `max_buffer_bytes`; a rank is
    inactive once its stream's last sample is admitted, in that fill (NOTE [ Whether a rank's stream has ended ] in
    odb_core/epoch/reader.py: the loader reads one more chunk to learn it)."""
    for rank, engine in enumerate(engines):
        stream, start = streams[rank], cursors[rank]
        left = len(stream) - start
        space = engine.space(left if lengths_known else None)
        held = None if sizes is None else sum(sizes[item.index] for item in engine.items)
        count = 0
        while count < min(space, left) and (held is None or fill_more(engine.config, held)):
            item = stream[start + count]
            engine.admit(item)
            held = None if held is None else held + sizes[item.index]  # type: ignore[index]
            count += 1
        cursors[rank] += count
        ended[rank] = ended[rank] or cursors[rank] == len(stream)
    return [not e for e in ended]


def planning_mode(config: ODBConfig, world: int, nodes: NodePlanning | None) -> str:
    """`local`, `global` or `node` (node-aware) for an epoch at this world size and node layout (`cluster`
    planning pools every rank whatever the layout)."""
    if not is_pooled(config, world):
        return "local"
    return "node" if nodes is not None and nodes.aware and config.planning == "global" else "global"


def simulate_epoch(streams: Sequence[Sequence[Item]], config: ODBConfig, epoch: int = 0,
                   max_rounds: int | None = None, nodes: NodePlanning | None = None,
                   lengths_known: bool = True, sizes: Mapping[int, int] | None = None) -> EpochPlan:
    """Run one epoch on `len(streams)` virtual ranks. Raises RuntimeError past `max_rounds` (a bound check).

    `lengths_known`: each rank knows how many samples its stream holds, as the loader does for map-style data
    (the last rounds shrink: NOTE [ Round sizes ]); False models an `IterableDataset`. `sizes`: each sample's
    payload bytes by dataset index, for `max_buffer_bytes` (None: the byte bound is not modelled).

    `max_rounds` defaults to the bound stated in NOTE [ Rounds and termination ]: max stream length + 2 (rank-
    local) or all samples + 2 (global, node-aware), plus the rounds of the growing ramp (NOTE [ A pool too small
    for a band ]). `nodes`: the ranks per node; node-aware planning when
    `nodes.aware` and the config plans globally at W > 1 (ValueError if per_node does not divide W).
    """
    world = len(streams)
    layout = (nodes or NodePlanning(per_node=max(world, 1))).layout(max(world, 1))
    mode = planning_mode(config, world, nodes)
    longest = sum(len(s) for s in streams) if mode != "local" else max((len(s) for s in streams), default=0)
    engines = _engines(mode, config, epoch, layout)  # + the ramp's rounds that may plan nothing (non-join pools)
    bound = max_rounds if max_rounds is not None else longest + 2 + ramp_rounds(engines[0].config)
    cursors, ended = [0] * world, [False] * world
    plan = EpochPlan(steps=[[] for _ in range(world)], rounds=0, not_emitted=[[] for _ in range(world)],
                     oversize=0, planning=mode)
    while not engines[0].finished:
        if plan.rounds >= bound:
            raise RuntimeError(f"epoch did not terminate within {bound} rounds")
        active = _fill(engines, streams, cursors, ended, lengths_known, sizes)
        metadata = metadata_bytes([len(e.items) for e in engines], layout)
        start = plan.n_steps
        round_ = ROUNDS[mode](engines, active, plan, layout)
        moves = _moves(plan, start, layout) if mode != "local" else Moves(within=0, across=0)
        plan.moved, plan.moved_across = plan.moved + moves.within + moves.across, plan.moved_across + moves.across
        plan.costs.append(RoundCost(metadata=metadata, plan_seconds=round_.seconds, moved_within=moves.within,
                                    moved_across=moves.across))
        plan.rounds += 1
        plan.targets.append(round_.target)
        plan.reduced_ints += world * round_.target * STEP_SUM_FIELDS
    for rank, engine in enumerate(engines):
        plan.not_emitted[rank] = [it.index for it in engine.items] + [it.index for it in streams[rank][cursors[rank]:]]
        plan.oversize += engine.oversize.count
    return plan


def _engines(mode: str, config: ODBConfig, epoch: int, layout: NodeLayout) -> list[BufferEngine]:
    """One engine per rank; node-aware engines know their local rank."""
    if mode == "node":
        pooled = config.rounds_for_pool(layout.per_node)  # NOTE [ Pooled round sizes ]
        return [NodeEngine(pooled, epoch, rank % layout.per_node) for rank in range(layout.world)]
    if mode == "global":
        return [PooledEngine(config.rounds_for_pool(layout.world), epoch, rank) for rank in range(layout.world)]
    return [RankEngine(config, epoch, rank) for rank in range(layout.world)]


def metadata_bytes(sizes: Sequence[int], layout: NodeLayout) -> Metadata:
    """What one rank receives in a round's planning all_gathers in each mode, given every rank's buffer size."""
    per_node, n_nodes = layout.per_node, layout.n_nodes
    widest_in_node = max((max(sizes[r] for r in layout.ranks_of(n)) for n in range(n_nodes)), default=0)
    across = NODE_FIELDS * n_nodes if n_nodes > 1 else 0
    return Metadata(global_=8 * layout.world * (STATE_FIELDS + POOL_FIELDS * max(sizes, default=0)),
                    node=8 * (per_node * (STATE_FIELDS + POOL_FIELDS * widest_in_node) + across),
                    local=8 * layout.world * STATE_FIELDS)


@dataclass(frozen=True, slots=True)
class Moves:
    """Emitted samples that run on another rank than their owner: of the same node, of another node."""

    within: int
    across: int


def _moves(plan: EpochPlan, start: int, layout: NodeLayout) -> Moves:
    """The moves of the steps from `start` on (owners are cluster ranks in every pooled mode)."""
    within = across = 0
    for rank, slots in enumerate(plan.steps):
        node = layout.node_of(rank)
        for slot in slots[start:]:
            for it in slot.items if slot is not None else ():
                if it.owner != rank:
                    if layout.node_of(it.owner) == node:
                        within += 1
                    else:
                        across += 1
    return Moves(within=within, across=across)


@dataclass(slots=True)
class Stopwatch:
    """Process-CPU seconds of the planning calls it times (`with watch: ...`, summed), with the cyclic garbage
    collector paused inside: the simulator holds every rank's items at once, and a full collection of that heap
    would be charged to whichever plan it interrupts, a pause no real rank (which holds its own pool) sees."""

    seconds: float = 0.0
    _start: float = 0.0
    _collecting: bool = False

    def __enter__(self) -> Stopwatch:
        self._collecting = gc.isenabled()
        gc.disable()
        self._start = time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds += time.process_time() - self._start
        if self._collecting:
            gc.enable()


@dataclass(frozen=True, slots=True)
class Planned:
    """One simulated round's T and the CPU seconds of its plan on one rank."""

    target: int
    seconds: float


def _local_round(engines: Sequence[RankEngine], active: list[bool], plan: EpochPlan, layout: NodeLayout) -> Planned:
    watches, locals_ = [Stopwatch() for _ in engines], []
    for engine, flag, watch in zip(engines, active, watches, strict=True):
        with watch:
            locals_.append(engine.start_round(active=flag))
    decision = engines[0].decide([local.state for local in locals_])
    for rank, engine in enumerate(engines):
        with watches[rank]:
            adjustment = engine.finish_round(locals_[rank], decision)
        plan.steps[rank].extend(adjustment.slots)
        plan.splits += adjustment.n_split
        plan.pushed_back += adjustment.n_pushed_back
    plan.gathered_ints += len(engines) * len(engines) * STATE_FIELDS
    return Planned(target=decision.target, seconds=max(w.seconds for w in watches))


def _buffers(engines: Sequence[BufferEngine]) -> list[list[Item]]:
    """The engines' buffers as the round's exchange delivers them: owner = position, carried items marked."""
    return [[Item(index=it.index, length=it.length, patches=it.patches, owner=rank, carried=k < engine.n_carried)
             for k, it in enumerate(engine.items)] for rank, engine in enumerate(engines)]


def _pooled_round(engines: Sequence[PooledEngine], active: list[bool], plan: EpochPlan,
                  layout: NodeLayout) -> Planned:
    world, first = len(engines), engines[0]
    buffers = _buffers(engines)
    request = PoolRequest(active=active, steps_done=first.steps_done,
                          key=RoundKey(seed=first.config.seed, epoch=first.epoch, round=first.round))
    with Stopwatch() as watch:
        pooled = plan_pooled_round(buffers, request, first.config, first.budget)
    for engine in engines:
        engine.apply(pooled)
    for rank in range(world):
        plan.steps[rank].extend(pooled.slots_of(rank))
    plan.splits += pooled.n_split
    plan.pushed_back += pooled.n_pushed_back
    widest = max(len(b) for b in buffers)
    plan.gathered_ints += world * world * (STATE_FIELDS + POOL_FIELDS * widest)
    return Planned(target=pooled.decision.target, seconds=watch.seconds)


def _node_round(engines: Sequence[NodeEngine], active: list[bool], plan: EpochPlan, layout: NodeLayout) -> Planned:
    """Cut every node's pool, decide across nodes, deal each node's pool to its ranks (NOTE [ Node-aware rounds ])."""
    nodes = [engines[layout.per_node * n : layout.per_node * (n + 1)] for n in range(layout.n_nodes)]
    cuts, watches, decided = [], [Stopwatch() for _ in nodes], Stopwatch()
    for node, members in enumerate(nodes):
        buffers = _buffers(members)
        with watches[node]:
            cuts.append(cut_pool(buffers, [active[r] for r in layout.ranks_of(node)], members[0].budget))
    states = [members[0].node_state(cut) for members, cut in zip(nodes, cuts, strict=True)]
    with decided:
        decision = engines[0].decide_nodes(states, layout.per_node)
    for node, (members, cut) in enumerate(zip(nodes, cuts, strict=True)):
        with watches[node]:
            dealt = members[0].deal(cut, decision)
        for engine in members:
            engine.apply(dealt)
        base = node * layout.per_node
        for local in range(layout.per_node):
            plan.steps[base + local].extend(_owned_by_rank(slot, base) for slot in dealt.slots_of(local))
        plan.splits += dealt.n_split
        plan.pushed_back += dealt.n_pushed_back
        widest = max(len(b) for b in cut.buffers)
        plan.gathered_ints += layout.per_node ** 2 * (STATE_FIELDS + POOL_FIELDS * widest)
    plan.gathered_ints += layout.world * layout.n_nodes * NODE_FIELDS if layout.n_nodes > 1 else 0
    return Planned(target=decision.target, seconds=max(w.seconds for w in watches) + decided.seconds)


def _owned_by_rank(slot: Slot, base: int) -> Slot:
    """A node's slot with its items' owners as cluster ranks (local rank + the node's first rank)."""
    if slot is None or base == 0:
        return slot
    return Group(items=tuple(it._replace(owner=it.owner + base) for it in slot.items), cost=slot.cost)


ROUNDS = {"local": _local_round, "global": _pooled_round, "node": _node_round}


@dataclass(frozen=True, slots=True)
class CostSummary:
    """An epoch's planning costs, for `odb plan --nproc-per-node`: the share of emitted samples that ran on
    another rank of their owner's node and on another node, and per rank per round (mean over rounds) the
    metadata received in the plan's own mode and the CPU seconds of its plan."""

    moved_within_fraction: float
    moved_across_fraction: float
    metadata_bytes_per_round: float
    plan_seconds_per_round: float


def summarize_costs(plan: EpochPlan) -> CostSummary:
    rounds, emitted = max(len(plan.costs), 1), max(plan.emitted, 1)
    mode = {"global": "global_", "node": "node", "local": "local"}[plan.planning]
    return CostSummary(moved_within_fraction=sum(c.moved_within for c in plan.costs) / emitted,
                       moved_across_fraction=sum(c.moved_across for c in plan.costs) / emitted,
                       metadata_bytes_per_round=sum(getattr(c.metadata, mode) for c in plan.costs) / rounds,
                       plan_seconds_per_round=sum(c.plan_seconds for c in plan.costs) / rounds)
