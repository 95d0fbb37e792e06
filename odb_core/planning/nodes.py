"""Node-aware planning: each node pools and plans its own ranks' buffers; the nodes align their step counts.

NOTE [ Node-aware rounds ]
A cluster is N nodes of P ranks (`NodeLayout`; rank = node x P + local rank, torchrun's numbering). Moving a
sample between two ranks of one node is cheap; moving it to another node is network traffic, and pooling every
rank's metadata costs every rank O(samples of the cluster) bytes and plan time per round. A node-aware round is
global planning (NOTE [ Pooled rounds ]) with the node's ranks as the world, plus one small exchange across nodes:
  1. within the node: all_gather of the P `RankState`s, then of the node's buffered (index, length, patches),
     exactly as global planning does over the whole world today (`PooledEngine.state`, `pool_ints`);
  2. every rank of the node cuts the node's pool (`cut_pool`: sort, greedy, hold the tail): the same `PoolCut`
     on every rank of the node, hence the same `NodeState` (NODE_FIELDS ints: active, ready groups, groups,
     progress, leaving, splittable);
  3. across nodes: all_gather of the `NodeState`s (N x NODE_FIELDS ints per rank: in the loader, one group per
     local rank, holding the N ranks that share it, so each rank receives its peers' copy of each node's state);
  4. every rank decides T from the N node states (`decide_nodes`, pure): each node's own wish is what the
     termination strategy's `decide_pooled` says for its pool with W = P; the wishes are then combined by the
     same strategy's DGAP `decide`, a node standing for a rank (its wish as its ready and total group count, a
     final wish as closing). Join: while some node still reads, T = the smallest wish of those nodes (at least
     one band); nodes with more keep the rest buffered, nodes that finished reading split or run IDLE; once no
     node reads, T = the largest wish, final. Non-join: T = the smallest wish; the epoch ends in the first
     round where a node whose wish was final is the smallest (its quota closes), the rest is reported. Then T is
     rounded up to the accumulation steps on the last round (`align_to_accumulation`);
  5. every rank deals its node's pool into T bands of P groups (`deal_pool`), the same shared step permutation
     (seed, epoch, round) on every node, so step k runs each node's k-th costliest band side by side.
Invariants: every rank emits exactly T steps (T is a function of the N node states every rank holds); every
emitted group is cut from one node's pool and dealt to one of that node's ranks, so no sample crosses a node
boundary; within a node every pooled item is emitted once or kept by its owner (as in `deal_pool`); with one node
the cut, the decision and the deal are global planning's (`decide_nodes` of one state is `decide_pooled`): the
plan is identical (tests/test_nodes.py). Termination: in a join round with a reading node, every reading node
emits at least one group (T >= 1 and it has ready groups), so an epoch of N samples ends within N + 2 rounds; a
non-join round that is not final has T >= 1 on every node.
Cost per rank per round: (10 + 3 x the node's widest buffer) x P ints within the node, N x NODE_FIELDS ints
across nodes (none with one node), and a plan over the node's pool: O(P_n log P_n) for the node's P_n samples,
against O(W x widest buffer) ints and a plan over the whole cluster's pool under global planning.
Leaving an epoch (NOTE [ Leaving an epoch ]): a node whose ranks' states say `leaving` skips the pool exchange and
reports `leaving` in step 3, which every rank takes part in every round, so every node ends the epoch together.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from odb_core.planning.alignment import RoundKey
from odb_core.planning.pooled import PoolCut, PooledEngine, PooledRound, cut_pool, deal_pool, pool_buffers
from odb_core.planning.round_sizes import growing
from odb_core.planning.termination import (Decision, PoolFacts, RankState, align_to_accumulation, build_termination,
                                           check_same_progress)

NODE_FIELDS = 9  # ints per node in the round's cross-node all_gather (`NodeState`)


@dataclass(frozen=True, slots=True)
class NodeLayout:
    """`world` ranks on nodes of `per_node` consecutive ranks: rank r is local rank r % per_node of node
    r // per_node (torchrun's numbering). One node (per_node = world) is global planning."""

    world: int
    per_node: int

    def __post_init__(self) -> None:
        if self.per_node < 1 or self.world < 1 or self.world % self.per_node:
            raise ValueError(f"per_node={self.per_node} must be >= 1 and divide the world size {self.world} (every "
                             "node runs the same number of ranks)")

    @property
    def n_nodes(self) -> int:
        return self.world // self.per_node

    def node_of(self, rank: int) -> int:
        return rank // self.per_node

    def ranks_of(self, node: int) -> range:
        return range(node * self.per_node, (node + 1) * self.per_node)

    @property
    def aware_per_node(self) -> int | None:
        """The ranks per node when there are several nodes (what a state fingerprint records), else None."""
        return self.per_node if self.n_nodes > 1 else None


@dataclass(frozen=True, slots=True)
class NodePlanning:
    """How a virtual cluster's ranks sit on nodes, for `simulate_epoch` and `odb plan --nproc-per-node`:
    `per_node` ranks per node; `aware`: plan per node (node-aware rounds), or one global plan whose moves are
    counted within and across nodes. (A loader will take the same two facts from its config.)"""

    per_node: int
    aware: bool = True

    def layout(self, world: int) -> NodeLayout:
        return NodeLayout(world=world, per_node=self.per_node)


@dataclass(frozen=True, slots=True)
class NodeState:
    """One node's report in the cross-node exchange; travels as `NODE_FIELDS` int64 values. The first three are
    the node's `PoolFacts` (a stream of the node is active; ready groups, all groups of its cut); the rest is the
    node's progress, which every node must share (`check_nodes_progress`), and whether one of its ranks left."""

    active: bool
    n_ready: int
    n_groups: int
    steps_done: int
    epoch: int = 0
    round: int = 0
    leaving: bool = False
    resumed_at: int = 0
    splittable: bool = False  # its ready groups hold a sample per rank (NOTE [ A pool too small for a band ])

    def to_ints(self) -> list[int]:
        return [int(self.active), self.n_ready, self.n_groups, self.steps_done, self.epoch, self.round,
                int(self.leaving), self.resumed_at, int(self.splittable)]

    @classmethod
    def from_ints(cls, values: Sequence[int]) -> NodeState:
        active, n_ready, n_groups, steps_done, epoch, round_, leaving, resumed_at, splits = (int(v) for v in values)
        return cls(active=bool(active), n_ready=n_ready, n_groups=n_groups, steps_done=steps_done, epoch=epoch,
                   round=round_, leaving=bool(leaving), resumed_at=resumed_at, splittable=bool(splits))

    def progress(self) -> RankState:
        """The node's progress as a `RankState`, for `check_same_progress`."""
        return RankState(active=self.active, n_ready=self.n_ready, n_groups=self.n_groups, n_samples=0,
                         steps_done=self.steps_done, epoch=self.epoch, round=self.round, leaving=self.leaving,
                         resumed_at=self.resumed_at)


def check_nodes_progress(states: Sequence[NodeState], round_index: int, epoch: int) -> None:
    """Every node must be at the same (epoch, round, step): raises `DesyncError` otherwise."""
    check_same_progress([s.progress() for s in states], round_index, epoch)


def decide_nodes(states: Sequence[NodeState], per_node: int, join: bool, growing: bool = False) -> Decision:
    """The round's T from every node's state (the same on every rank; step 4 of NOTE [ Node-aware rounds ]).
    Pure. Each node's wish is `decide_pooled` over its facts with W = per_node; the termination strategy's
    `decide` then aligns the wishes as it aligns ranks (a final wish reads as a closing rank)."""
    termination = build_termination(join)
    wishes = [termination.decide_pooled(cut_facts(s, per_node, growing)) for s in states]
    return termination.decide([RankState(active=not w.final, n_ready=w.target, n_groups=w.target, n_samples=0,
                                         steps_done=0) for w in wishes])


def cut_facts(state: NodeState, per_node: int, growing: bool = False) -> PoolFacts:
    """A node's pool facts as its state reports them (what its own `decide_pooled` wish is computed from)."""
    return PoolFacts(any_active=state.active, n_ready=state.n_ready, n_groups=state.n_groups, world=per_node,
                     growing=growing, splittable=state.splittable)


class NodeEngine(PooledEngine):
    """One rank's buffer under node-aware planning; `rank` is its local rank in the node. Per round, after the
    within-node exchange of `state(active)` and `pool_ints()` (as `PooledEngine`, over the node's ranks):
    `cut_round` cuts the node's pool, `node_state` is exchanged across nodes, `finish_node_round` decides and keeps
    this rank's share. No I/O."""

    def cut_round(self, states: Sequence[RankState], pooled: Sequence[Sequence[int]]) -> PoolCut:
        """The node's cut from its ranks' states and pool ints (local rank order); the same on every rank of it."""
        check_same_progress(states, self.round, self.epoch)
        return cut_pool(pool_buffers(states, pooled), [s.active for s in states], self.budget)

    def node_state(self, cut: PoolCut, leaving: bool = False) -> NodeState:
        facts = cut.facts()
        return NodeState(active=facts.any_active, n_ready=facts.n_ready, n_groups=facts.n_groups,
                         steps_done=self.steps_done, epoch=self.epoch, round=self.round, leaving=leaving,
                         resumed_at=self.resumed_at, splittable=facts.splittable)

    def leaving_node_state(self) -> NodeState:
        """What every rank of a node reports across nodes when one of its ranks left (NOTE [ Leaving an epoch ])."""
        return NodeState(active=False, n_ready=0, n_groups=0, steps_done=self.steps_done, epoch=self.epoch,
                         round=self.round, leaving=True, resumed_at=self.resumed_at)

    def decide_nodes(self, nodes: Sequence[NodeState], per_node: int) -> Decision:
        """T for this round from every node's state (node order), aligned to the accumulation steps."""
        check_nodes_progress(nodes, self.round, self.epoch)
        decision = decide_nodes(nodes, per_node, self.config.join, growing(self.config, self.round))
        return align_to_accumulation(decision, self.steps_done, self.config.accumulation_steps)

    def deal(self, cut: PoolCut, decision: Decision) -> PooledRound:
        """The node's plan for `decision` (identical on every rank of the node); not yet applied."""
        key = RoundKey(seed=self.config.seed, epoch=self.epoch, round=self.round)
        return deal_pool(cut, decision, key, self.config, self.budget)

    def finish_node_round(self, cut: PoolCut, nodes: Sequence[NodeState]) -> PooledRound:
        """Decide, deal the node's pool and keep this rank's share (the loader's call; the simulator deals once
        per node and `apply`s the plan to each of the node's engines)."""
        plan = self.deal(cut, self.decide_nodes(nodes, len(cut.buffers)))
        self.apply(plan)
        return plan
