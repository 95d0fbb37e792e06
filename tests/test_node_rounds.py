"""Node-aware rounds in the real loader (NOTE [ Node-aware rounds ], NOTE [ Node groups ]): 2 nodes x 2 ranks.

On virtual ranks (threads over a `VirtualHub`, the loader's own collectives) and in a real 4-process Gloo job
on localhost whose ranks see torchrun's `LOCAL_WORLD_SIZE=2` (tests/node_cases.py): join and non-join, map-style
and streaming data, shards skewed across nodes in count and in length. Each test is named after the guarantee it
checks (docs/guarantees.md, "Node-aware rounds").
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace
from typing import Any

import pytest

from node_cases import (NODE, WORLD, Job, emitted, node_config, read_items, run_job, scenario_loader,
                        scenario_names)
from odb_core import DesyncError, ODBDataLoader, run_virtual_ranks, simulate_epoch
from odb_core.planning.nodes import NodePlanning
from odb_core.resume.resume import merge_states
from odb_core.settings.console import describe

pytestmark = pytest.mark.timeout(120)


def run_virtual(name: str, save_after: int | None = None, nproc_per_node: int = NODE) -> list[dict[str, Any]]:
    """Every rank's epoch of scenario `name` on virtual ranks (`Job.rank_epoch`, the Gloo job's body)."""
    return run_virtual_ranks(lambda rank, transport: Job(name, rank, transport, save_after, nproc_per_node).rank_epoch(),
                             WORLD, timeout_s=60)


def assert_node_epoch(name: str, ranks: list[dict[str, Any]]) -> None:
    """Equal steps; every emitted sample read within the emitting rank's node; join: each read sample once,
    non-join: nothing twice and the rest reported; the steps are `simulate_epoch`'s node-aware plan."""
    config = node_config(name)
    steps = [r["steps"] for r in ranks]
    assert len({len(s) for s in steps}) == 1 and steps[0], [len(s) for s in steps]
    reader = {i: rank for rank, r in enumerate(ranks) for i in r["read"]}
    for rank, r in enumerate(ranks):
        assert {reader[i] // NODE for i in emitted(r)} <= {rank // NODE}, f"rank {rank} emitted another node's sample"
    everything = Counter(i for r in ranks for i in emitted(r))
    if config.join:
        assert everything == Counter(list(reader))
    else:
        assert max(everything.values()) == 1
        assert sorted([*everything, *(i for r in ranks for i in r["not_emitted"])]) == sorted(reader)
    streams = [read_items(name, r["read"]) for r in ranks]
    plan = simulate_epoch(streams, config, nodes=NodePlanning(NODE), lengths_known=not name.startswith("stream"))
    assert steps == [[list(s.indices) if s is not None else [] for s in rank_steps] for rank_steps in plan.steps]


@pytest.mark.parametrize("name", scenario_names())
def test_virtual_nodes_align_steps_and_move_samples_only_within_a_node(name):
    assert_node_epoch(name, run_virtual(name))


@pytest.mark.parametrize("name", ["map-join", "stream-non-join"])
def test_virtual_nodes_resume_exactly_at_the_same_layout(name):
    ranks = run_virtual(name, save_after=3)
    for r in ranks:
        assert r["resumed"] == r["steps"][3:]


@pytest.mark.parametrize(("name", "advice"), [("map-join", r"resume elastically on this one: load .*merge_states"),
                                               ("stream-join", r"or nothing else: an elastic resume, which plans the rest on "
                                                               r"another layout, needs a map-style dataset")])
def test_a_state_is_refused_at_another_layout_naming_both(name, advice):
    """A stream's state cannot resume elastically either: before, its refusal advised merge_states, whose result
    was then refused ("cannot resume from world size 4 to 4")."""
    ranks = run_virtual(name, save_after=2)

    def load(rank: int, transport) -> None:
        loader = scenario_loader(name, rank, transport, nproc_per_node=1)
        with pytest.raises(ValueError, match=r"2 nodes of 2 ranks.*4 nodes of 1 rank.*" + advice):
            loader.load_state_dict(ranks[rank]["state"])

    run_virtual_ranks(load, WORLD, timeout_s=60)


@pytest.mark.parametrize(("saved", "new"), [(2, 4), (2, 1), (4, 2)])
def test_merged_states_resume_elastically_at_another_layout_emitting_each_sample_once(saved, new, caplog):
    """2 x 2 to one node, to 4 nodes of 1, and one node to 2 x 2: the remaining samples are planned on the new
    layout (NOTE [ Elastic resume ]), which rank 0 says (before, a resume at the same world size went elastic
    without a word)."""
    ranks = run_virtual("map-join", save_after=2, nproc_per_node=saved)
    merged = merge_states([r["state"] for r in ranks])
    before = [i for r in ranks for step in r["steps"][:2] for i in step]

    def resume(rank: int, transport) -> list[list[int]]:
        loader = scenario_loader("map-join", rank, transport, nproc_per_node=new)
        loader.load_state_dict(merged)
        return [list(batch.info.indices) for batch in loader]

    with caplog.at_level("WARNING", logger="odb_core.resume.resume"):
        after = run_virtual_ranks(resume, WORLD, timeout_s=60)
    assert caplog.text.count("another node layout") == 1 and "planned anew (an elastic resume)" in caplog.text
    assert len({len(steps) for steps in after}) == 1
    resumed = [i for rank_steps in after for step in rank_steps for i in step]
    assert Counter(before + resumed) == Counter(i for r in ranks for i in r["read"])


def test_ranks_launched_with_different_layouts_fail_at_construction():
    """(A rank that sees one node builds no node groups: it raises at its first exchange instead.)"""
    def build(rank: int, transport) -> ODBDataLoader:
        return scenario_loader("map-join", rank, transport, nproc_per_node=2 if rank else 1)

    with pytest.raises(DesyncError, match="nproc_per_node"):
        run_virtual_ranks(build, WORLD, timeout_s=10)


def test_a_node_that_leaves_the_epoch_ends_it_for_every_node_and_the_next_epoch_is_aligned():
    def rank_main(rank: int, transport) -> list[int]:
        loader = scenario_loader("map-join", rank, transport)
        first = 0
        for first, _ in enumerate(loader, start=1):
            if rank == 2 and first == 2:
                break
        return [first, sum(1 for _ in loader)]

    counts = run_virtual_ranks(rank_main, WORLD, timeout_s=60)
    assert len({c[1] for c in counts}) == 1 and counts[2][0] == 2


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory) -> dict:
    """One job of 4 Gloo processes on two nodes of two ranks, which the tests below only read."""
    return run_job(tmp_path_factory.mktemp("two_nodes"), timeout_s=90)


@pytest.mark.slow
def test_gloo_two_nodes_of_two_ranks_align_move_within_nodes_and_resume(two_nodes):
    """The real thing: 4 Gloo processes, `LOCAL_WORLD_SIZE=2` as torchrun sets it on two nodes of two ranks; and a
    rank that leaves an epoch early under node-aware rounds."""
    result = two_nodes
    for name in scenario_names():
        ranks = [result[rank][name] for rank in range(WORLD)]
        assert_node_epoch(name, ranks)
        for r in ranks:
            assert r["resumed"] == r["steps"][3:], name
            assert r["metrics"]["moved_samples"] > 0 or name.startswith("stream")
    # a rank of the second node leaves an epoch after 2 steps: it ends for both nodes, and the next one is aligned
    left = [result[rank]["leave"] for rank in range(WORLD)]
    assert left[2][0] == 2 and all(taken >= 2 for taken, _ in left), left
    assert len({steps for _, steps in left}) == 1 and left[0][1] > 0, left


@pytest.mark.slow
@pytest.mark.parametrize("per_node", [4, 1])
def test_gloo_merged_states_of_two_nodes_resume_on_another_layout_emitting_each_sample_once(two_nodes, tmp_path,
                                                                                           per_node):
    """2 x 2 Gloo ranks save after 3 steps; their merged states resume on one node of 4 and on 4 nodes of 1."""
    first = two_nodes
    ranks = [first[rank]["map-join"] for rank in range(WORLD)]
    merged = tmp_path / "merged.json"
    merged.write_text(json.dumps(merge_states([r["state"] for r in ranks])))
    again = run_job(tmp_path / "resumed", timeout_s=90, per_node=per_node, merged=merged)
    resumed = [again[rank]["resumed"] for rank in range(WORLD)]
    assert {again[rank]["nodes"] for rank in range(WORLD)} == {WORLD // per_node}
    assert len({len(steps) for steps in resumed}) == 1
    before = [i for r in ranks for step in r["steps"][:3] for i in step]
    after = [i for steps in resumed for step in steps for i in step]
    assert Counter(before + after) == Counter(i for r in ranks for i in r["read"])


def test_cluster_planning_keeps_one_pool_across_nodes_and_moves_samples_between_them():
    def rank_main(rank: int, transport) -> dict[str, Any]:
        loader = scenario_loader("map-join", rank, transport, planning="cluster")
        return {"steps": [list(b.info.indices) for b in loader], "read": [int(i) for i in loader.sampler]}

    ranks = run_virtual_ranks(rank_main, WORLD, timeout_s=60)
    plan = simulate_epoch([read_items("map-join", r["read"]) for r in ranks], node_config("map-join"))
    assert [r["steps"] for r in ranks] == [[list(s.indices) if s else [] for s in steps] for steps in plan.steps]
    assert plan.planning == "global"
    reader = {i: rank for rank, r in enumerate(ranks) for i in r["read"]}
    assert any(reader[i] // NODE != rank // NODE for rank, r in enumerate(ranks) for i in emitted(r))


@pytest.mark.parametrize("name", ["map-join", "map-non-join"])
def test_the_exact_schedule_is_the_node_aware_epoch(name):
    def rank_main(rank: int, transport) -> tuple[int, int]:
        loader = scenario_loader(name, rank, transport)
        planned = loader.plan_epochs_exactly([0]).micro_batches[0]
        return planned, sum(1 for _ in loader)

    counts = run_virtual_ranks(rank_main, WORLD, timeout_s=60)
    assert len(set(counts)) == 1 and counts[0][0] == counts[0][1]


def test_the_console_line_names_node_aware_planning_and_one_node_stays_as_it_was():
    config = node_config("map-join")
    assert "mode node-aware global planning (2 nodes) + join" in describe(config, WORLD, "HF Trainer", n_nodes=2)
    assert "mode global planning + join" in describe(config, WORLD, "HF Trainer")
    assert "mode cluster planning + join" in describe(replace(config, planning="cluster"), WORLD, "HF Trainer", 2)
