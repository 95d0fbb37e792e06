"""One round's plan as one rank sees it, in either planning mode: the collectives around the pure planners.

`LocalRounds` (rank-local planning) exchanges the `RankState` (`STATE_FIELDS` ints) and lets `RankEngine` decide and
adjust; `PooledRounds` (global planning on one node, or `cluster`, NOTE [ Pooled rounds ]) also exchanges every
buffered item, computes the shared pooled plan and moves the samples whose group runs on another rank (NOTE
[ Moving samples ]); `NodeRounds` (global planning over several nodes, NOTE [ Node-aware rounds ]) does that within
the node and exchanges one `NodeState` across nodes. All return a `RankRound`: this rank's ordered slots and how
to get each slot's samples. Every rank makes the same collective calls in the same order, whatever its data.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import defaultdict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from odb_core.data.sample import LengthFn
from odb_core.planning.alignment import Slot
from odb_core.planning.budget import Item
from odb_core.planning.nodes import NodeEngine, NodeLayout, NodeState
from odb_core.planning.planner import BufferEngine, RankEngine
from odb_core.planning.pooled import POOL_FIELDS, PoolCut, PooledEngine
from odb_core.planning.simulate import is_pooled
from odb_core.planning.termination import RankState
from odb_core.ranks.moves import Arrivals, FetchMoves, SendMoves
from odb_core.ranks.moves_ahead import MoveLane, MovesInFlight, OverlappedMoves
from odb_core.ranks.node_groups import NodeTransports, lane_transport
from odb_core.ranks.shared_handles import open_files_with_handles
from odb_core.ranks.sync import Transport
from odb_core.settings.config import ODBConfig


@dataclass(frozen=True, slots=True)
class RankRound:
    """This rank's part of one round: its slots in run order, and (global planning) the samples moved to it and
    the indices of its own samples emitted in each step by any rank (what elastic resume subtracts)."""

    index: int
    slots: tuple[Slot, ...]
    final: bool
    n_split: int
    n_pushed_back: int
    arrivals: Arrivals | MovesInFlight | None = None  # MovesInFlight: NOTE [ Moves overlap training ]
    owned_by_step: tuple[tuple[int, ...], ...] | None = None
    abandoned: bool = False


def _someone_left(engine: BufferEngine, states: Sequence[RankState | NodeState]) -> RankRound | None:
    """A round in which some rank reported `leaving` ends the epoch for every rank (NOTE [ Leaving an epoch ])."""
    if not any(s.leaving for s in states):
        return None
    index = engine.round
    engine.end_early()
    return RankRound(index=index, slots=(), final=True, n_split=0, n_pushed_back=0, abandoned=True)


def leave(engine: BufferEngine, transport: Transport) -> None:
    """This rank's consumer abandoned the epoch: take part in the next round's state exchange once, saying so."""
    transport.all_gather(engine.leaving_state().to_ints())
    engine.end_early()


Mover = SendMoves | FetchMoves | OverlappedMoves


class Rounds(Protocol):
    engine: BufferEngine

    def plan(self, active: bool, take_own: Callable[[int], Any]) -> RankRound:
        """Run the round's collectives and return this rank's part (called once per round by every rank)."""

    def leave(self) -> None:
        """Instead of the next round: tell every rank that this one left the epoch (one state exchange)."""


class LocalRounds:
    """Rank-local planning: one all_gather of a `RankState` per round."""

    def __init__(self, engine: RankEngine, transport: Transport) -> None:
        self.engine, self.transport = engine, transport

    def plan(self, active: bool, take_own: Callable[[int], Any]) -> RankRound:
        local = self.engine.start_round(active)
        states = [RankState.from_ints(v) for v in self.transport.all_gather(local.state.to_ints())]
        left = _someone_left(self.engine, states)
        if left is not None:
            return left
        decision = self.engine.decide(states)
        index = self.engine.round
        adjustment = self.engine.finish_round(local, decision)
        return RankRound(index=index, slots=adjustment.slots, final=decision.final, n_split=adjustment.n_split,
                         n_pushed_back=adjustment.n_pushed_back)

    def leave(self) -> None:
        leave(self.engine, self.transport)


def _pooled_ints(engine: PooledEngine, transport: Transport, states: Sequence[RankState]) -> list[list[int]]:
    """Every rank's buffered items (`pool_ints`), padded to the longest buffer: one all_gather (none if empty)."""
    widest = POOL_FIELDS * max(s.n_samples for s in states)
    mine = engine.pool_ints()
    return transport.all_gather(mine + [0] * (widest - len(mine))) if widest else [[]] * len(states)


class PooledRounds:
    """Global planning: the `RankState`s, then every buffered item (padded to the longest buffer), then the moves."""

    def __init__(self, engine: PooledEngine, transport: Transport, mover: Mover) -> None:
        self.engine, self.transport, self.mover = engine, transport, mover

    def plan(self, active: bool, take_own: Callable[[int], Any]) -> RankRound:
        states = [RankState.from_ints(v) for v in self.transport.all_gather(self.engine.state(active).to_ints())]
        left = _someone_left(self.engine, states)
        if left is not None:
            return left
        pooled = _pooled_ints(self.engine, self.transport, states)
        index = self.engine.round
        plan = self.engine.finish_round(states, pooled)
        arrivals = self.mover.exchange(plan, take_own)
        rank = self.transport.rank
        return RankRound(index=index, slots=plan.slots_of(rank), final=plan.decision.final, n_split=plan.n_split,
                         n_pushed_back=plan.n_pushed_back, arrivals=arrivals,
                         owned_by_step=tuple(plan.owned_by_step(rank)))

    def leave(self) -> None:
        leave(self.engine, self.transport)


class NodeRounds:
    """Node-aware planning (NOTE [ Node-aware rounds ]): within the node the `RankState`s, then the node's buffered
    items; across nodes one `NodeState` per node; then the moves within the node. A node whose rank left skips its
    pool exchange but still reports across nodes, so every node ends the epoch in the same round (NOTE [ Leaving an
    epoch ]). The node plan's owners are local ranks; the returned round speaks in world ranks."""

    def __init__(self, engine: NodeEngine, nodes: NodeTransports, mover: Mover) -> None:
        self.engine, self.nodes, self.mover = engine, nodes, mover

    def plan(self, active: bool, take_own: Callable[[int], Any]) -> RankRound:
        node = self.nodes.node
        states = [RankState.from_ints(v) for v in node.all_gather(self.engine.state(active).to_ints())]
        cut: PoolCut | None = None
        if not any(s.leaving for s in states):
            cut = self.engine.cut_round(states, _pooled_ints(self.engine, node, states))
        mine = self.engine.node_state(cut) if cut is not None else self.engine.leaving_node_state()
        gathered = [NodeState.from_ints(v) for v in self.nodes.across.all_gather(mine.to_ints())]
        left = _someone_left(self.engine, gathered)
        if left is not None:
            return left
        assert cut is not None  # a node with a leaving rank reported `leaving`
        index = self.engine.round
        plan = self.engine.finish_node_round(cut, gathered)
        arrivals = _in_cluster(self.mover.exchange(plan, take_own), self.nodes.offset)
        slots = tuple(_slot_in_cluster(slot, self.nodes.offset) for slot in plan.slots_of(node.rank))
        return RankRound(index=index, slots=slots, final=plan.decision.final, n_split=plan.n_split,
                         n_pushed_back=plan.n_pushed_back, arrivals=arrivals,
                         owned_by_step=tuple(plan.owned_by_step(node.rank)))

    def leave(self) -> None:
        self.nodes.node.all_gather(self.engine.leaving_state().to_ints())
        self.nodes.across.all_gather(self.engine.leaving_node_state().to_ints())
        self.engine.end_early()


def _slot_in_cluster(slot: Slot, offset: int) -> Slot:
    """A node plan's slot with its items' owners as world ranks (local rank + the node's first rank)."""
    if slot is None or not offset:
        return slot
    return dataclasses.replace(slot, items=tuple(it._replace(owner=it.owner + offset) for it in slot.items))


def _in_cluster(arrivals: Arrivals | MovesInFlight, offset: int) -> Arrivals | MovesInFlight:
    """Arrivals keyed by world-rank owners (see `_slot_in_cluster`)."""
    if not offset:
        return arrivals
    if isinstance(arrivals, MovesInFlight):
        return arrivals.in_cluster(offset)
    by_key: defaultdict[tuple[int, int], deque[Any]] = defaultdict(deque)
    by_key.update({(owner + offset, index): queue for (owner, index), queue in arrivals.by_key.items()})
    return dataclasses.replace(arrivals, by_key=by_key)


@dataclass(frozen=True, slots=True)
class RoundsFactory:
    """Builds each epoch's `Rounds` for a loader: at W > 1 global planning unless `planning="local"`, node-aware
    when `nodes` (this rank's node transports: a layout of several nodes under `planning="global"`)."""

    config: ODBConfig
    transport: Transport
    fetch: Callable[[int], Mapping[str, Any]]
    map_style: bool
    length_fn: LengthFn | None = None  # checks a sample re-read under move="fetch" against what its owner read
    nodes: NodeTransports | None = None
    lane: MoveLane | None = None  # moves overlap training: NOTE [ Moves overlap training ]

    def __call__(self, epoch: int) -> LocalRounds | PooledRounds | NodeRounds:
        rank, world = self.transport.rank, self.transport.world_size
        if not is_pooled(self.config, world):
            return LocalRounds(RankEngine(self.config, epoch, rank), self.transport)
        if self.nodes is not None:
            local = self.nodes.node.rank
            pooled = self.config.rounds_for_pool(self.nodes.node.world_size)  # NOTE [ Pooled round sizes ]
            return NodeRounds(NodeEngine(pooled, epoch, local), self.nodes, self._mover(local, self.nodes.node))
        pooled = self.config.rounds_for_pool(world)
        return PooledRounds(PooledEngine(pooled, epoch, rank), self.transport, self._mover(rank, self.transport))

    def _mover(self, rank: int, transport: Transport) -> Mover:
        """How samples reach the ranks of `transport` (`rank` is this rank's number there)."""
        if move_mode(self.config, self.map_style) == "fetch":
            return FetchMoves(rank, self.fetch, self.length_fn)
        if self.lane is not None and self.lane.opened():
            return OverlappedMoves(transport, self.lane, self.length_fn)
        return SendMoves(transport)


def move_lane(config: ODBConfig, transport: Transport, layout: NodeLayout, map_style: bool) -> MoveLane | None:
    """The loader's move lane (NOTE [ Moves overlap training ]): under global planning at W > 1 with
    `move="send"` and `overlap_moves`; else None (moves run in line). Opened by the first epoch (`MoveLane`)."""
    pooled = is_pooled(config, transport.world_size)
    if not (config.overlap_moves and pooled and move_mode(config, map_style) == "send"):
        return None
    return MoveLane(functools.partial(lane_transport, transport, layout), config.shared_memory_moves,
                    open_files_with_handles(config.max_buffer_bytes, config.window))


def move_mode(config: ODBConfig, map_style: bool) -> str:
    """`send` or `fetch` for this dataset (see `ODBConfig.move` and NOTE [ Moving samples ])."""
    if config.move == "fetch" and not map_style:
        raise ValueError("ODBConfig.move='fetch' re-reads moved samples by index, which an IterableDataset cannot "
                         "do; use move='send' (or 'auto')")
    return "send" if config.move == "auto" else config.move


def sample_of(item: Item, round_: RankRound, rank: int, take_own: Callable[[int], Any]) -> Any:
    """The payload of one item of this rank's slot: moved in, or from this rank's own buffer."""
    if round_.arrivals is not None and item.owner != rank:
        return round_.arrivals.take((item.owner, item.index))
    return take_own(item.index)
