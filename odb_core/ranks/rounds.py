"""One round's plan as one rank sees it, in either planning mode: the collectives around the pure planners.

`LocalRounds` (rank-local planning) exchanges the `RankState` (`STATE_FIELDS` ints) and lets `RankEngine` decide and
adjust; `PooledRounds` (global planning, NOTE [ Pooled rounds ]) also exchanges every buffered item, computes the
shared pooled plan and moves the samples whose group runs on another rank (NOTE [ Moving samples ]). Both return a
`RankRound`: this rank's ordered slots and how to get each slot's samples. Every rank makes the same collective
calls in the same order, whatever its data.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from odb_core.data.sample import LengthFn
from odb_core.planning.alignment import Slot
from odb_core.planning.budget import Item
from odb_core.planning.planner import BufferEngine, RankEngine
from odb_core.planning.pooled import POOL_FIELDS, PooledEngine
from odb_core.planning.simulate import is_pooled
from odb_core.planning.termination import RankState
from odb_core.ranks.moves import Arrivals, FetchMoves, SendMoves
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
    arrivals: Arrivals | None = None
    owned_by_step: tuple[tuple[int, ...], ...] | None = None
    abandoned: bool = False


def _someone_left(engine: BufferEngine, states: list[RankState]) -> RankRound | None:
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


class PooledRounds:
    """Global planning: the `RankState`s, then every buffered item (padded to the longest buffer), then the moves."""

    def __init__(self, engine: PooledEngine, transport: Transport, mover: SendMoves | FetchMoves) -> None:
        self.engine, self.transport, self.mover = engine, transport, mover

    def plan(self, active: bool, take_own: Callable[[int], Any]) -> RankRound:
        states = [RankState.from_ints(v) for v in self.transport.all_gather(self.engine.state(active).to_ints())]
        left = _someone_left(self.engine, states)
        if left is not None:
            return left
        widest = POOL_FIELDS * max(s.n_samples for s in states)
        mine = self.engine.pool_ints()
        pooled = self.transport.all_gather(mine + [0] * (widest - len(mine))) if widest else [[]] * len(states)
        index = self.engine.round
        plan = self.engine.finish_round(states, pooled)
        arrivals = self.mover.exchange(plan, take_own)
        rank = self.transport.rank
        return RankRound(index=index, slots=plan.slots_of(rank), final=plan.decision.final, n_split=plan.n_split,
                         n_pushed_back=plan.n_pushed_back, arrivals=arrivals,
                         owned_by_step=tuple(plan.owned_by_step(rank)))

    def leave(self) -> None:
        leave(self.engine, self.transport)


@dataclass(frozen=True, slots=True)
class RoundsFactory:
    """Builds each epoch's `Rounds` for a loader: global planning at W > 1 unless `planning="local"`."""

    config: ODBConfig
    transport: Transport
    fetch: Callable[[int], Mapping[str, Any]]
    map_style: bool
    length_fn: LengthFn | None = None  # checks a sample re-read under move="fetch" against what its owner read

    def __call__(self, epoch: int) -> LocalRounds | PooledRounds:
        rank, world = self.transport.rank, self.transport.world_size
        if not is_pooled(self.config, world):
            return LocalRounds(RankEngine(self.config, epoch, rank), self.transport)
        mover = FetchMoves(rank, self.fetch, self.length_fn) if move_mode(self.config, self.map_style) == "fetch" \
            else SendMoves(self.transport)
        return PooledRounds(PooledEngine(self.config, epoch, rank), self.transport, mover)


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
