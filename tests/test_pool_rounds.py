"""Pooled round sizes (NOTE [ Pooled round sizes ] in odb_core/planning/round_sizes.py, `ODBConfig.pool_window`):
past `pool_window` pooled samples, each rank's `window` and `min_window` shrink by one factor; the loader plans
what the simulator plans, every sample once, and a state saved before the field is refused only where it acts.
"""

from __future__ import annotations


import numpy as np
import pytest

from conftest import LengthDataset, saved_midway
from odb_core import Item, ODBConfig, ODBDataLoader, run_virtual_ranks, simulate_epoch
from odb_core.planning.nodes import NodeLayout
from odb_core.settings.config import fingerprint


def _sizes(config: ODBConfig, ranks: int) -> tuple[int, int | None]:
    sized = config.rounds_for_pool(ranks)
    return sized.window, sized.min_window


def test_past_pool_window_each_rank_s_window_and_min_window_shrink_by_one_factor():
    config = ODBConfig(token_budget=16384)  # window 4096, min_window 256, pool_window 8192
    for ranks in (1, 2):
        assert config.rounds_for_pool(ranks) is config  # 2 x 4096 = 8192: unchanged up to W = 2
    assert _sizes(config, 4) == (2048, 128)
    assert _sizes(config, 8) == (1024, 64)
    assert _sizes(config, 64) == (128, 32)  # 256 x 128 / 4096 = 8, raised to the floor of 32
    assert _sizes(config, 1024) == (64, 32)  # 8 per rank, raised to the floor of 64
    assert _sizes(ODBConfig(token_budget=1, window=8192), 2) == (4096, 128)  # the user's window, shrunk alike
    assert _sizes(ODBConfig(token_budget=1, min_window=None), 8) == (1024, None)
    assert _sizes(ODBConfig(token_budget=1, min_window=10), 8) == (1024, 10)  # the floor never raises a min_window
    window, smallest = _sizes(ODBConfig(token_budget=1, window=100), 1024)  # min_window 256 >= window: no ramp
    assert window == 64 and smallest >= window  # (still none: the same factor)
    for unchanged in (ODBConfig(token_budget=1, pool_window=None), ODBConfig(token_budget=1, planning="local")):
        assert unchanged.rounds_for_pool(64) is unchanged


def test_pool_window_is_in_the_fingerprint_only_where_it_shrinks_rounds():
    config = ODBConfig(token_budget=16384)
    assert fingerprint(config, NodeLayout(world=2, per_node=2))["pool_window"] is None
    assert fingerprint(config, NodeLayout(world=4, per_node=4))["pool_window"] == 8192
    assert fingerprint(config, NodeLayout(world=16, per_node=2))["pool_window"] is None  # nodes of 2 pool 2 ranks
    assert fingerprint(ODBConfig(token_budget=1, planning="cluster"), NodeLayout(16, 16))["pool_window"] == 8192
    assert fingerprint(ODBConfig(token_budget=1, planning="local"), NodeLayout(16, 16))["pool_window"] is None


def _steps(groups) -> list[tuple[int, ...]]:
    return [tuple(sorted(getattr(g, "indices", g) or ())) for g in groups]


@pytest.mark.parametrize("pool_window", [1024, None])
def test_the_loader_plans_the_pooled_rounds_the_simulator_plans(pool_window):
    """Four virtual ranks whose pool (4 x 512) is past `pool_window=1024`: each rank's rounds run at window 256 and
    min_window 32 (from 64), in the loader and in `simulate_epoch` alike, and the ranks train every sample once."""
    lengths = [8 + (i * 53) % 200 for i in range(2400)]
    options = dict(token_budget=512, window=512, min_window=64, pool_window=pool_window, shuffle_steps=False)

    def rank_main(rank, transport):
        loader = ODBDataLoader(LengthDataset(lengths), transport=transport, **options)
        order = [int(i) for i in loader.sampler]
        steps = [batch.info.indices for batch in loader]
        rounds = loader.last_report.rounds
        loader.close()
        return steps, rounds, order

    ranks = run_virtual_ranks(rank_main, 4, timeout_s=120)
    streams = [[Item(index=i, length=lengths[i]) for i in order] for _, _, order in ranks]
    plan = simulate_epoch(streams, ODBConfig(**options))
    for rank, (steps, rounds, _) in enumerate(ranks):
        assert _steps(steps) == _steps(plan.steps[rank])
        assert rounds == plan.rounds
    trained = sorted(i for steps, _, _ in ranks for step in steps for i in step)
    assert trained == list(range(len(lengths)))  # identity coverage (join)
    # 600 samples per rank: 64, 128, then the rest whole (<= 2 x 256); pooled: from 32, up to 256, then halving
    assert plan.rounds == (3 if pool_window is None else 9)


@pytest.mark.parametrize("pool_window", [512, 4096])
def test_a_state_saved_before_pool_window_is_refused_only_where_it_acts(pool_window):
    """Two ranks of window 512: `pool_window=512` shrinks their rounds, so a state saved without the field (whose
    rounds did not shrink) is refused, naming the setting to resume it with; at 4096 it acts on nothing and the
    state resumes to the uninterrupted batches."""
    lengths = [8 + (i * 53) % 200 for i in range(1200)]
    data = [{"input_ids": np.arange(n)} for n in lengths]
    options = dict(token_budget=512, window=512, min_window=64, pool_window=pool_window, seed=5)

    def rank_main(rank, transport):
        state, rest = saved_midway(ODBDataLoader(data, transport=transport, **options), 3, "pool_window")
        again = ODBDataLoader(data, transport=transport, **options)
        try:
            again.load_state_dict(state)
        except ValueError as exc:
            again.close()
            return str(exc), None, rest
        resumed = [b.info for b in again]
        again.close()
        return None, resumed, rest

    for error, resumed, rest in run_virtual_ranks(rank_main, 2, timeout_s=120):
        if pool_window == 512:
            assert error is not None and "pool_window=None" in error, error
        else:
            assert error is None and resumed == rest
