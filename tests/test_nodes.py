"""Node-aware planning (NOTE [ Node-aware rounds ] in odb_core/planning/nodes.py) on the virtual cluster.

Generated clusters: 1..4 nodes of 1..4 ranks, uneven and skewed streams (whole nodes with few or no samples, ranks
with their own typical length), the three cost models, small windows and the default, accumulation 1..3, join
and non-join. Each test is named after the guarantee it checks (docs/guarantees.md, "Node-aware rounds").
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from odb_core import Item, ODBConfig, simulate_epoch
from odb_core.planning.nodes import NODE_FIELDS, NodeEngine, NodeLayout, NodePlanning, NodeState, decide_nodes
from odb_core.planning.pooled import POOL_FIELDS
from odb_core.planning.round_sizes import ramp_rounds
from odb_core.planning.termination import STATE_FIELDS, Decision, RankState
from odb_core.settings.config import COST_NAMES
from test_properties import PROPERTY_SETTINGS, oversize_alone, reference_cost


@st.composite
def clusters(draw, join: bool | None = None) -> tuple[list[list[Item]], ODBConfig, int]:
    """(streams, config, ranks per node): globally unique indices, skewed per node and per rank."""
    n_nodes, per_node = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    budget = draw(st.integers(16, 256))
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    node_scale = [rng.choice([0, 0.2, 1.0, 1.0]) for _ in range(n_nodes)]  # some nodes read little or nothing
    streams, index = [], 0
    for rank in range(n_nodes * per_node):
        count = int(rng.randint(0, 60) * node_scale[rank // per_node])
        typical = rng.choice([0.05, 0.3, 0.8]) * budget  # each rank its own typical length
        stream = [Item(index + k, max(1, min(2 * budget, int(rng.expovariate(1.0) * typical) + 1)),
                       rng.randint(0, 8) if budget % 2 else 0) for k in range(count)]
        streams.append(stream)
        index += count
    cost = draw(st.sampled_from(COST_NAMES))
    config = ODBConfig(token_budget=budget, cost=cost, attention_alpha=0.01 if cost == "attention" else 0.0,
                       window=draw(st.sampled_from([1, 3, 8, 32, 4096])),
                       max_patches=draw(st.one_of(st.none(), st.integers(8, 32))),
                       accumulation_steps=draw(st.integers(1, 3)), join=draw(st.booleans()) if join is None else join,
                       seed=draw(st.integers(0, 2**16)), shuffle_steps=draw(st.booleans()))
    return streams, config, per_node


def emitted(plan, rank: int) -> list[int]:
    return [i for slot in plan.steps[rank] if slot is not None for i in slot.indices]


@PROPERTY_SETTINGS
@given(clusters())
def test_node_aware_with_one_node_is_exactly_the_global_plan(case):
    streams, config, _ = case
    assert simulate_epoch(streams, config, nodes=NodePlanning(per_node=len(streams))) == simulate_epoch(streams, config)


@PROPERTY_SETTINGS
@given(clusters())
def test_node_aware_moves_no_sample_across_nodes(case):
    """Checked from the indices: every sample a rank emits was read by a rank of the same node."""
    streams, config, per_node = case
    plan = simulate_epoch(streams, config, nodes=NodePlanning(per_node))
    reader = {it.index: rank for rank, stream in enumerate(streams) for it in stream}
    for rank in range(len(streams)):
        assert {reader[i] // per_node for i in emitted(plan, rank)} <= {rank // per_node}
    assert plan.moved_across == 0 and all(c.moved_across == 0 for c in plan.costs)
    assert plan.moved == sum(reader[it.index] != rank for rank in range(len(streams)) for g in plan.steps[rank] if g
                             for it in g.items) == sum(c.moved_within for c in plan.costs)


@PROPERTY_SETTINGS
@given(clusters())
def test_node_aware_ranks_get_equal_step_counts_on_accumulation_boundaries_and_terminate(case):
    streams, config, per_node = case
    plan = simulate_epoch(streams, config, nodes=NodePlanning(per_node))  # RuntimeError past N + 2 (+ ramp) rounds
    assert {len(steps) for steps in plan.steps} == {sum(plan.targets)}
    assert plan.n_steps % config.accumulation_steps == 0
    ramp = 0 if config.join else ramp_rounds(config.rounds_for_pool(per_node))  # NOTE [ A pool too small for a band ]
    assert plan.rounds <= sum(map(len, streams)) + 1 + ramp


@PROPERTY_SETTINGS
@given(clusters(join=True))
def test_node_aware_join_emits_every_sample_exactly_once(case):
    streams, config, per_node = case
    plan = simulate_epoch(streams, config, nodes=NodePlanning(per_node))
    everything = [i for rank in range(len(streams)) for i in emitted(plan, rank)]
    assert Counter(everything) == Counter(it.index for s in streams for it in s)
    assert all(left == [] for left in plan.not_emitted)


@PROPERTY_SETTINGS
@given(clusters(join=False))
def test_node_aware_non_join_closes_a_quota_without_splits_or_idle(case):
    """Nothing twice, the rest reported; equal counts by full bands only: no IDLE, except the last round's
    rounding up to the accumulation steps; splits only there and where a node's pool cannot grow and cannot fill
    one band (NOTE [ A pool too small for a band ]: before, such an epoch ended there, its samples untrained)."""
    streams, config, per_node = case
    plan = simulate_epoch(streams, config, nodes=NodePlanning(per_node))
    everything = [i for rank in range(len(streams)) for i in emitted(plan, rank)]
    assert len(everything) == len(set(everything))
    left = [i for rank_left in plan.not_emitted for i in rank_left]
    assert sorted(everything + left) == sorted(it.index for s in streams for it in s)
    last = range(sum(plan.targets[:-1]), sum(plan.targets)) if plan.targets else range(0)
    for steps in plan.steps:
        idle = [k for k, slot in enumerate(steps) if slot is None]
        assert all(k in last for k in idle) and len(idle) <= config.accumulation_steps - 1


@PROPERTY_SETTINGS
@given(clusters())
def test_node_aware_groups_hold_the_budget(case):
    streams, config, per_node = case
    plan = simulate_epoch(streams, config, nodes=NodePlanning(per_node))
    for group in (g for steps in plan.steps for g in steps if g is not None):
        assert abs(group.cost - reference_cost(config, group.items)) <= 1e-6 * max(1.0, group.cost)
        if not (group.size == 1 and oversize_alone(config, group.items[0])):
            assert reference_cost(config, group.items) <= config.token_budget
            assert config.max_patches is None or sum(it.patches for it in group.items) <= config.max_patches


@PROPERTY_SETTINGS
@given(clusters())
def test_node_aware_round_metadata_is_the_node_pool_plus_ints_per_node(case):
    streams, config, per_node = case
    plan = simulate_epoch(streams, config, nodes=NodePlanning(per_node))
    n_nodes = len(streams) // per_node
    for cost in plan.costs:
        assert cost.metadata.local == 8 * STATE_FIELDS * len(streams)
        assert cost.metadata.node <= cost.metadata.global_ + 8 * NODE_FIELDS * n_nodes
        assert (cost.metadata.node - (8 * NODE_FIELDS * n_nodes if n_nodes > 1 else 0)) % (8 * per_node) == 0


def exchanged_epoch(streams: list[list[Item]], config: ODBConfig, per_node: int) -> list[list]:
    """The loader's call sequence, rank by rank, with the collectives as lists: within the node `state` and
    `pool_ints` (padded to the widest buffer), `cut_round`; across nodes `node_state`; `finish_node_round`."""
    layout = NodeLayout(world=len(streams), per_node=per_node)
    engines = [NodeEngine(config, 0, rank % per_node) for rank in range(len(streams))]
    cursors, steps = [0] * len(streams), [[] for _ in streams]
    while not engines[0].finished:
        active = []
        for rank, engine in enumerate(engines):
            left = len(streams[rank]) - cursors[rank]
            space = engine.space(left)  # a map-style stream: its length is known (NOTE [ Round sizes ])
            for item in streams[rank][cursors[rank] : cursors[rank] + min(space, left)]:
                engine.admit(item)
            cursors[rank] += min(space, left)
            active.append(cursors[rank] < len(streams[rank]))  # as `_fill`: NOTE [ Whether a rank's stream has ended ]
        states = [engine.state(flag) for engine, flag in zip(engines, active)]
        cuts = []
        for rank, engine in enumerate(engines):
            node = layout.ranks_of(layout.node_of(rank))
            widest = POOL_FIELDS * max(states[r].n_samples for r in node)
            pooled = [engines[r].pool_ints() + [0] * (widest - len(engines[r].pool_ints())) for r in node]
            cuts.append(engine.cut_round([RankState.from_ints(states[r].to_ints()) for r in node], pooled))
        wire = [engines[rank].node_state(cuts[rank]).to_ints() for rank in range(0, len(streams), per_node)]
        for rank, engine in enumerate(engines):
            plan = engine.finish_node_round(cuts[rank], [NodeState.from_ints(v) for v in wire])
            steps[rank].extend(None if s is None else s.indices for s in plan.slots_of(rank % per_node))
    return steps


@pytest.mark.parametrize("join", [True, False])
@pytest.mark.parametrize(("n_nodes", "per_node", "window"), [(3, 2, 4), (2, 3, 16), (4, 1, 2)])
def test_each_rank_computes_its_node_plan_from_its_node_pool_and_a_few_ints_per_node(n_nodes, per_node, window, join):
    """The exchanges the loader will make (within the node: states and items; across nodes: NODE_FIELDS ints
    per node) give every rank the simulator's plan."""
    rng = random.Random(n_nodes * 10 + per_node)
    streams = [[Item(r * 100 + k, rng.randint(1, 900)) for k in range(rng.randint(5, 40))]
               for r in range(n_nodes * per_node)]
    config = ODBConfig(token_budget=1024, window=window, join=join, accumulation_steps=2)
    plan = simulate_epoch(streams, config, nodes=NodePlanning(per_node))
    assert exchanged_epoch(streams, config, per_node) == [[None if s is None else s.indices for s in steps]
                                                          for steps in plan.steps]


def test_nodes_align_on_the_smallest_reading_wish_then_drain_with_join():
    """Join: node 0 reads and has 10 ready groups (5 bands of 2); node 1 finished reading with 3 groups (wish
    2 bands, final): T = 5; node 1 splits or idles. Once neither reads, T = the largest wish."""
    reading = NodeState(active=True, n_ready=10, n_groups=11, steps_done=0)
    closing = NodeState(active=False, n_ready=3, n_groups=3, steps_done=0)
    assert decide_nodes([reading, closing], per_node=2, join=True) == Decision(target=5, final=False)
    done = NodeState(active=False, n_ready=11, n_groups=11, steps_done=0)
    assert decide_nodes([done, closing], per_node=2, join=True) == Decision(target=6, final=True)
    # non-join: the closing node's full bands (1) are the smallest wish, so its quota closes the epoch
    assert decide_nodes([reading, closing], per_node=2, join=False) == Decision(target=1, final=True)
    assert NodeState.from_ints(reading.to_ints()) == reading and len(reading.to_ints()) == NODE_FIELDS


def test_a_node_layout_must_divide_the_world():
    with pytest.raises(ValueError, match="per_node=3 must be >= 1 and divide the world size 8"):
        NodeLayout(world=8, per_node=3)
    assert list(NodeLayout(world=8, per_node=4).ranks_of(1)) == [4, 5, 6, 7]
