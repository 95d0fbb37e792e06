"""The overlap benchmark (`python -m benchmarks.overlap`, issue 27) and the buffer-memory benchmark on tiny
configurations: every loader reported with finite, positive figures at W = 1 (in this process) and W = 2 (two
spawned Gloo ranks), ODB's ranks together train every sample exactly once under both plannings, and the memory
benchmark reports its peaks for both loaders; the round model (benchmarks/lib/round_model.py) on cases worked
out by hand."""

from __future__ import annotations

import math

import pytest

from benchmarks import buffer_memory
from benchmarks.lib.accelerator import Step
from benchmarks.lib.odb_options import parse_options
from benchmarks.lib.overlap_runs import Setup, run_world
from benchmarks.lib.round_model import epoch_seconds, rounds_of
from odb_core import ODBConfig

SAMPLES = 48
POSITIVE = ("samples_per_s", "vs_plain", "busy", "busy_min", "efficiency", "first_batch_s", "rss_mb", "supply",
            "demand", "wall_s", "synced_demand", "synced_efficiency")


def tiny_setup(workers: int) -> Setup:
    return Setup(workload="sleep", samples=SAMPLES, process_ms=0.5, folder="", budget=4096, fixed_batch=2,
                 process_s=0.5e-3, workers=workers, windows=(16,), plannings=("global", "local"),
                 step=Step(us_per_token=0.5))


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("world", "workers"), [(1, 2), (2, 1)])
def test_every_loader_is_reported_and_odb_trains_each_sample_once(world, workers):
    rows = run_world([tiny_setup(workers)], world)
    planned = ["global", "local"] if world > 1 else ["any"]
    assert [(r["loader"], r["planning"]) for r in rows] == [("plain", None)] + [("odb window 16", p) for p in planned]
    for row in rows:
        assert row["world_size"] == world and len(row["per_rank"]) == world, row
        for key in POSITIVE:
            assert math.isfinite(row[key]) and row[key] > 0, (key, row)
        # workers that live less than one poll of benchmarks/lib/peak_memory.py (50 ms) are not seen: >= 0
        assert 0 < row["busy"] <= 1.0 and row["worker_rss_mb"] >= 0, row
        if row["loader"] == "plain":
            assert row["samples"] == SAMPLES and row["each_once"] is None and row["bound"] is None
        else:
            assert row["samples"] == SAMPLES and row["each_once"] is True, row
            assert 0 < row["bound"] <= 1.0, row  # what the round sizes allow (benchmarks/lib/round_model.py)


def test_odb_options_are_read_as_typed_values():
    assert parse_options(["window=512", "max_buffer_bytes=1e9", "join=false", "max_patches=none", "cost=tokens"]) \
        == {"window": 512, "max_buffer_bytes": 1e9, "join": False, "max_patches": None, "cost": "tokens"}
    with pytest.raises(SystemExit):
        parse_options(["window"])


@pytest.mark.timeout(60)
def test_buffer_memory_reports_the_peaks_of_both_loaders(tmp_path):
    rows = buffer_memory.main(["--samples", "50", "--out", str(tmp_path / "buffer_memory.json")])
    assert [r["loader"] for r in rows] == ["odb", "plain"]
    for row in rows:
        assert row["samples"] == 50 and row["steps"] > 0 and row["added_mib"] >= 0, row
        assert row["peak_mib"] > 0 and row["workers_mib"] > 0, row


def test_the_round_model_gives_the_times_a_pipeline_of_rounds_allows():
    """benchmarks/round_model.py: the rounds are the loader's own, and the times those of a reading stage and a
    training stage in series per round, worked out by hand."""
    config = ODBConfig(token_budget=1, window=4096, min_window=256)
    assert rounds_of(500, config) == [500]  # a shard of up to 2 x min_window is one round
    sizes = rounds_of(12000, config)
    assert sum(sizes) == 12000 and sizes[:4] == [256, 512, 1024, 2048]  # doubling from min_window
    assert sizes[4] == (12000 - 3840) // 2  # then at most half of what is left, halving toward the end
    assert sizes[4:] == sorted(sizes[4:], reverse=True) and sizes[-1] <= 256
    # one round: read 500 at 100/s, then train them at 50/s
    assert epoch_seconds([500], supply=100.0, demand=50.0, cap=4096) == pytest.approx((5.0, 15.0))
    # round 2 is read (at 3 s) while round 1 trains (1 s to 3 s), then trains for 4 s
    assert epoch_seconds([256, 512], supply=256.0, demand=128.0, cap=4096) == pytest.approx((1.0, 7.0))
    # the device is slower: round 2 waits for it, not for reading
    assert epoch_seconds([256, 256], supply=1000.0, demand=100.0, cap=4096) == pytest.approx((0.256, 5.376))
