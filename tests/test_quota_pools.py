"""Non-join (quota) epochs under pooled planning whose pool cannot fill a band of W groups (NOTE [ A pool too small
for a band ] in odb_core/planning/termination.py): a round of the growing ramp plans nothing and the next reads
more; a pool that cannot grow emits one band completed by splits. Before, both ended the epoch, with every sample
buffered or unread reported as not emitted: a whole epoch untrained at W = 8 and more with large budgets."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from conftest import LengthDataset
from odb_core import ODBConfig, ODBDataLoader, run_virtual_ranks, simulate_epoch
from odb_core.planning.budget import Item
from odb_core.planning.nodes import NodePlanning


def emitted(plan) -> list[int]:
    return [it.index for rank in plan.steps for slot in rank if slot is not None for it in slot.items]


def test_a_first_round_too_small_for_a_band_does_not_end_the_epoch():
    streams = [[Item(0, 1), Item(1, 1), Item(2, 1)], [Item(3, 1), Item(4, 1), Item(5, 1)]]
    plan = simulate_epoch(streams, ODBConfig(token_budget=2, window=2, min_window=1, join=False))
    assert plan.n_steps > 0 and len(emitted(plan)) >= 4  # before: 0 steps, all 6 reported


@pytest.mark.parametrize(("world", "nodes", "window"), [(8, None, 4096), (16, NodePlanning(per_node=8), 4096),
                                                       (96, None, 4096), (8, None, 64), (16, NodePlanning(8), 64)])
def test_large_budgets_over_many_ranks_train_the_epoch(world, nodes, window):
    """Lengths 50-400 under 16,384 tokens: ~70 samples a group. The ramp's first pools cannot fill a band; with
    `window=64` (and no ramp) no pool can, and bands are completed by splits. Before: 0 steps, every sample
    reported. What is left is the last round's rest, the quota's closure."""
    rng = random.Random(0)
    streams = [[Item(r * 600 + i, rng.randint(50, 400)) for i in range(600)] for r in range(world)]
    ramp = {} if window == 4096 else {"min_window": None, "pool_window": None}
    config = ODBConfig(token_budget=16384, cost="tokens", join=False, window=window, **ramp)
    plan = simulate_epoch(streams, config, nodes=nodes)
    trained = emitted(plan)
    assert len(trained) == len(set(trained)) and len(trained) >= 0.8 * world * 600
    assert all(slot is not None for rank in plan.steps for slot in rank)  # no IDLE
    assert plan.splits > 0 or window != 64  # no pool of 64 per rank makes a band without them


def reported(plan) -> int:
    return sum(len(rest) for rest in plan.not_emitted)


@pytest.mark.parametrize("extra", [{}, {"min_window": None}])
def test_the_halving_rounds_and_a_byte_bound_do_not_end_the_epoch_either(extra):
    """The second review's cases: map-style streams end in halving rounds, and a byte bound stops a buffer short
    of `window`; neither pool can grow to a band. Before: 8,715 of 57,600 reported at W = 96 (rank-local planning
    4,893), and 0 steps with every sample reported under the byte bound."""
    rng = random.Random(0)
    streams = [[Item(r * 600 + i, rng.randint(50, 400)) for i in range(600)] for r in range(96)]
    config = ODBConfig(token_budget=16384, cost="tokens", join=False, **extra)
    pooled, local = simulate_epoch(streams, config), simulate_epoch(streams, replace(config, planning="local"))
    assert reported(pooled) <= reported(local)
    streams = [[Item(r * 3000 + i, rng.randint(50, 400)) for i in range(3000)] for r in range(8)]
    bounded = replace(config, max_buffer_bytes=50_000)
    plan = simulate_epoch(streams, bounded, sizes={it.index: 1000 for s in streams for it in s})
    assert plan.n_steps > 0 and reported(plan) < 0.05 * 24_000


@pytest.mark.parametrize("options", [{}, {"prefetch_steps": 2}, {"plan_ahead": False}])
def test_the_loader_trains_such_an_epoch_and_resumes_it_exactly(options):
    dataset = LengthDataset([100] * 8000)

    def run(rank, transport):
        loader = ODBDataLoader(dataset, transport=transport, token_budget=65536, join=False, **options)
        steps, state = [], None
        for batch in loader:
            steps.append(batch.info.indices)
            if len(steps) == 1:
                state = loader.state_dict()
        dropped = len(loader.last_report.not_emitted)
        loader.close()
        resumed = ODBDataLoader(dataset, transport=transport, token_budget=65536, join=False, **options)
        resumed.load_state_dict(state)
        rest = [batch.info.indices for batch in resumed]
        resumed.close()
        return steps, dropped, rest

    results = run_virtual_ranks(run, 4, timeout_s=120)
    for steps, dropped, rest in results:
        assert len(steps) >= 2 and rest == steps[1:]
    trained = [i for steps, _, _ in results for step in steps for i in step]
    assert len(trained) == len(set(trained)) and len(trained) + sum(d for _, d, _ in results) == 8000
    assert len(trained) >= 6000  # before: 0 batches, 2,000 reported on each rank
