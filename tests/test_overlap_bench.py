"""The overlap benchmark (`python -m benchmarks.overlap`, issue 27) and the buffer-memory benchmark on tiny
configurations: every loader reported with finite, positive figures at W = 1 (in this process) and W = 2 (two
spawned Gloo ranks), ODB's ranks together train every sample exactly once under both plannings, and the memory
benchmark reports its peaks for both loaders; the round model (benchmarks/lib/round_model.py) on cases worked
out by hand."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks import buffer_memory, sync_floor
from benchmarks.data import feeding
from benchmarks.lib.accelerator import _STAGING, Step, copy_to_staging
from benchmarks.lib.odb_options import parse_options
from benchmarks.lib.overlap_runs import Setup, run_world
from benchmarks.lib.round_model import epoch_seconds, epoch_seconds_of, latency_bound, pool_bound, rounds_of
from benchmarks.lib.timeline import fetch_spans, rank_timeline, world_timeline
from odb_core import ODBConfig

SAMPLES = 48
POSITIVE = ("samples_per_s", "vs_plain", "busy", "busy_min", "efficiency", "first_batch_s", "rss_mb", "supply",
            "demand", "wall_s", "synced_demand", "synced_efficiency")


def tiny_setup(workers: int, host_copy: bool = False, nominal_process_s: float | None = None) -> Setup:
    return Setup(workload="sleep", samples=SAMPLES, process_ms=0.5, folder="", budget=4096, fixed_batch=2,
                 process_s=0.5e-3, nominal_process_s=nominal_process_s, workers=workers, windows=(16,),
                 plannings=("global", "local"),
                 step=Step(us_per_token=0.5, host_copy=host_copy))


def test_the_host_copy_reads_every_byte_of_the_batch():
    pixels = torch.arange(24, dtype=torch.float32).view(4, 6).t()  # not contiguous
    batch = {"input_ids": torch.arange(10).view(2, 5), "pixel_values": pixels, "info": "not a tensor"}
    assert copy_to_staging(batch) == 10 * 8 + 24 * 4
    staged = _STAGING[0][: 24 * 4].view(torch.float32).view(6, 4)  # the last tensor copied
    assert torch.equal(staged, pixels)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("world", "workers", "host_copy", "nominal"), [(1, 2, True, 1e-4), (2, 1, False, None)])
def test_every_loader_is_reported_and_odb_trains_each_sample_once(world, workers, host_copy, nominal):
    rows = run_world([tiny_setup(workers, host_copy, nominal)], world)
    planned = ["global", "local"] if world > 1 else ["any"]
    assert [(r["loader"], r["planning"]) for r in rows] == [("plain", None)] + [("odb window 16", p) for p in planned]
    for row in rows:
        assert row["world_size"] == world and len(row["per_rank"]) == world, row
        for key in POSITIVE:
            assert math.isfinite(row[key]) and row[key] > 0, (key, row)
        # workers that live less than one poll of benchmarks/lib/peak_memory.py (50 ms) are not seen: >= 0
        assert 0 < row["busy"] <= 1.0 and row["worker_rss_mb"] >= 0, row
        # the device's, the all_reduce's and the loader's seconds are disjoint parts of each rank's wall time
        assert (row["sync"] > 0) == (world > 1) and row["busy"] + row["sync"] + (row["data_wait"] or 0) <= 1, row
        assert 0 < row["machine_cpu"] <= 1, row
        if nominal is None:
            assert row["nominal_efficiency"] is None, row
        else:  # the supply of the nominal time: 2 workers / 0.1 ms, against 2 / 0.5 ms measured
            assert row["nominal_efficiency"] == pytest.approx(
                row["samples_per_s"] / min(world * workers / nominal, row["demand"])), row
        if row["loader"] == "plain":
            assert row["samples"] == SAMPLES and row["each_once"] is None and row["bound"] is None
            assert row["data_wait"] is row["reading"] is row["exchange"] is None, row
        else:
            # the reading and the exchange are parts of the wait (inline: the loader's default)
            assert 0 < row["reading"] and row["reading"] + row["exchange"] <= row["data_wait"], row
            assert row["exchange"] > 0 or world == 1, row
            assert row["samples"] == SAMPLES and row["each_once"] is True, row
            assert 0 < row["bound"] <= 1.0, row  # what the round sizes allow (benchmarks/lib/round_model.py)


def test_the_timeline_figures_of_a_run_worked_out_by_hand():
    """Two workers: one fetches at 1-2 and 3-4 s (its CPU clock 0 -> 0.5 and 1.0 -> 1.5 s), the other at 1.5-2.5 s
    (10.0 -> 10.8 s); steps of rounds 0, 0, 1 run 4.5-5, 5.2-6 and 7-7.5 s; the rank's `iter()` at 0.5 s and its
    run's end at 8 s."""
    spans = [[(1.0, 2.0, 0.0, 0.5), (3.0, 4.0, 1.0, 1.5)], [(1.5, 2.5, 10.0, 10.8)]]
    steps = [(4.5, 5.0, 0), (5.2, 6.0, 0), (7.0, 7.5, 1)]
    figures = rank_timeline(spans, steps, started=0.5, ended=8.0)
    assert figures == pytest.approx({"first_fetch_s": 0.5, "last_read_s": 3.5, "workers_busy": 3.0 / 6.0,
                                     "worker_cpu_ms_per_sample": 1e3 * (1.5 + 0.8) / 3,
                                     "worker_cpu_share": (1.5 / 3.0 + 0.8 / 1.0) / 2,
                                     "after_last_read_s": 4.0, "gaps_s": 0.2 + 1.0, "boundary_gaps_s": 1.0})
    other = {**figures, "last_read_s": 5.5}
    assert world_timeline([figures, other]) == pytest.approx({**figures, "last_read_s": 4.5,
                                                              "latest_last_read_s": 5.5})


@pytest.mark.timeout(60)
def test_a_timed_run_reports_where_its_workers_and_steps_spent_the_epoch(tmp_path):
    """With a timeline folder, each loader's row has the timeline of real fetches in forked workers: every sample
    fetched once in a worker (one line each), the workers' reads inside the run, and the device's gaps inside its
    wall time."""
    setup = dataclasses.replace(tiny_setup(workers=2), plannings=("global",), timeline_dir=str(tmp_path))
    rows = run_world([setup], 1)
    assert [r["loader"] for r in rows] == ["plain", "odb window 16"]
    for j, row in enumerate(rows):
        spans = fetch_spans(tmp_path / f"0-{j}" / "rank0")
        assert len(spans) == 2 and sum(len(s) for s in spans) == SAMPLES, spans  # a file per worker
        t = row["timeline"]
        assert 0 <= t["first_fetch_s"] < t["last_read_s"] <= row["wall_s"], t
        assert 0 < t["workers_busy"] <= 1 and t["worker_cpu_ms_per_sample"] > 0 and t["worker_cpu_share"] > 0, t
        # the wall time is timed with another clock (perf_counter): equal to a millisecond
        assert t["after_last_read_s"] == pytest.approx(row["wall_s"] - t["last_read_s"], abs=1e-3), t
        assert 0 <= t["boundary_gaps_s"] <= t["gaps_s"] < row["wall_s"], t
        assert (t["boundary_gaps_s"] > 0) == (row["loader"] != "plain"), t  # ODB's 48 samples make several rounds


def test_the_sleep_workload_is_timed_like_the_others():
    """Its supply counts what a fetch takes (the wait, the oversleep, the tensors), the wait alone beside it."""
    dataset = feeding.SlowSamples(40, process_ms=2.0)
    assert feeding.nominal_seconds(dataset) == 0.002
    assert feeding.process_seconds(dataset, count=20) > 0.002
    assert feeding.nominal_seconds(feeding.PixelRows(4)) is None


@pytest.mark.timeout(60)
def test_the_sync_floor_reports_the_collective_after_each_step_length(tmp_path):
    rows = sync_floor.main(["--worlds", "2", "--step-ms", "0", "2", "--steps", "10", "--out", str(tmp_path / "f.json")])
    assert [(r["world_size"], r["step_ms"], r["steps"]) for r in rows] == [(2, 0.0, 10), (2, 2.0, 10)]
    for row in rows:
        assert 0 < row["all_reduce_ms"] < 1000 and row["oversleep_ms"] >= 0, row  # a sleep never ends early


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
        assert row["peak_mib"] > 0 and row["workers_mib"] > 0 and row["shared_mib"] >= 0, row
        assert row["added_and_shared_mib"] == pytest.approx(row["added_mib"] + row["shared_mib"])
    assert rows[1]["shared_mib"] > 0, "the plain loader's batches travel in shared memory"


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


@settings(max_examples=300, deadline=None)
@given(sizes=st.lists(st.integers(1, 400), min_size=1, max_size=12), supply=st.floats(10.0, 1000.0),
       demand=st.floats(10.0, 1000.0), cap=st.integers(1, 2000))
def test_no_schedule_of_whole_rounds_beats_the_latency_bound(sizes, supply, demand, cap):
    """docs/design.md, issue 27 item 2: an epoch of whole rounds takes at least max over r of C_r / S +
    (E - C_{r-1}) / D; reading that never stops attains it, and at S = D it is (E + the largest round) / S."""
    cap = max(cap, max(sizes))  # a round fits the read-ahead (the loader reads at least a round ahead)
    _, seconds = epoch_seconds(sizes, supply, demand, cap)
    bound = latency_bound(sizes, supply, demand)
    assert seconds >= bound * (1 - 1e-9)
    _, unbounded = epoch_seconds(sizes, supply, demand, cap=sum(sizes))
    assert unbounded == pytest.approx(bound, rel=1e-9)
    assert latency_bound(sizes, supply, supply) == pytest.approx((sum(sizes) + max(sizes)) / supply, rel=1e-9)


@settings(max_examples=300, deadline=None)
@given(steps=st.lists(st.tuples(st.integers(0, 300), st.integers(1, 300)), min_size=1, max_size=12),
       supply=st.floats(10.0, 1000.0), ratio=st.floats(1.0, 4.0))
def test_no_schedule_beats_the_pool_bound_and_one_attains_it(steps, supply, ratio):
    """docs/design.md, issue 27 item 2, "A bound no loader that sorts escapes": with S <= D, a loader that ever
    picks a step from a pool of B read, untrained samples takes at least E / D + B / S. Checked on schedules that
    carry samples between rounds (a sliding window): round j is planned after reading `read` more samples and
    trains `trained` of its pool (at most the pool), the rest staying for later rounds; the last round trains all
    that is left. A first round of B and then rounds of one attain the bound where it is below 1."""
    demand, reads, trained, pools, read, done = supply * ratio, [], [], [], 0, 0
    for k, (more, take) in enumerate(steps):
        read += more + (1 if read == done else 0)  # a round plans at least one untrained sample
        pool = read - done
        take = pool if k == len(steps) - 1 else min(take, pool)
        reads.append(read), trained.append(take), pools.append(pool)
        done += take
    _, seconds = epoch_seconds_of(reads, [n / demand for n in trained], supply, cap=read)
    assert seconds >= (read / demand + max(pools) / supply) * (1 - 1e-9)
    assert read / supply / seconds <= pool_bound(read, max(pools), supply, demand) * (1 + 1e-9)
    first = max(pools)
    attaining = [first] + [1] * (read - first)
    if first > demand / supply:  # else the second round's term binds (B / D < 1 / S)
        attained = max(first / supply + read / demand, read / supply + 1 / demand)
        assert latency_bound(attaining, supply, demand) == pytest.approx(attained, rel=1e-9)


def test_the_pool_bound_of_issue_27s_slow_row():
    """The figures docs/design.md quotes: at S/D = 667/721 an efficiency of 0.95 needs pools of at most 0.128 E
    (1,530 of 12,000 samples, 382 of 3,000); the default rounds' largest pool (4,080) allows 0.79, their own
    bound 0.78."""
    assert pool_bound(12000, 1530, 667.0, 721.0) >= 0.95 > pool_bound(12000, 1540, 667.0, 721.0)
    assert pool_bound(3000, 382, 667.0, 721.0) >= 0.95 > pool_bound(3000, 383, 667.0, 721.0)
    sizes = rounds_of(12000, ODBConfig(token_budget=1))
    assert pool_bound(12000, max(sizes), 667.0, 721.0) == pytest.approx(0.790, abs=5e-4)
    assert 12000 / 667.0 / latency_bound(sizes, 667.0, 721.0) <= pool_bound(12000, max(sizes), 667.0, 721.0)
    assert pool_bound(6000, 2048, 1000.0, 723.5) == 1.0  # workers faster than the device: no bound


def test_the_latency_bound_of_the_default_rounds_at_supply_equal_to_demand():
    """The figure docs/design.md quotes: 12,000 samples on one rank in the default rounds (largest 4,080) at S = D
    allow at most 12,000 / 16,080 = 0.746 of the workers' rate; rounds of at most 600 would allow 0.952."""
    sizes = rounds_of(12000, ODBConfig(token_budget=1))
    assert max(sizes) == 4080
    assert 12000 / 667.0 / latency_bound(sizes, 667.0, 667.0) == pytest.approx(12000 / 16080)
    assert 12000 / 667.0 / latency_bound([600] * 20, 667.0, 667.0) == pytest.approx(12000 / 12600)


def test_the_round_rules_sweep_scores_the_loader_s_own_rule_and_restores_it():
    """`python -m benchmarks.round_rules` swaps candidate rules into the planner for its what-if: the `current`
    row is the loader's own rule (its steps are those of the real planner), and the swap is undone after."""
    import odb_core.planning.planner as planner
    import odb_core.planning.simulate as simulate
    from benchmarks import round_rules
    from odb_core.planning.round_sizes import round_target

    fill = simulate._fill
    result = round_rules.main(["--per-rank", "700", "--worlds", "1", "2", "--plannings", "global", "--ratios",
                               "0.92", "3", "--out", "/dev/null"])
    assert planner.round_target is round_target and simulate._fill is fill
    rows = {row["rule"]: row for row in result["rows"]}
    assert set(rows) == {c.name for c in round_rules.RULES}
    assert rows["current"]["worst_change"] == 0.0 and rows["current"]["steps_change"] == 0.0
    assert all(0.2 < x <= 1.0 + 1e-9 for row in rows.values() for x in row["mean_by_ratio"])
    epoch = round_rules.plan_epoch(round_rules.RULES[0], 1400, 2, "global", 4096)
    assert epoch.steps == result["steps"]["current"][1] and epoch.reads[-1] == 700  # every sample read


def test_the_pool_rounds_benchmark_compares_the_capped_pool_with_the_uncapped_one():
    """`python -m benchmarks.pool_rounds`: each (W, epoch) twice, without and with the default `pool_window`, the
    rank's window and min_window as `rounds_for_pool` sizes them, and the real planner's steps."""
    from benchmarks import pool_rounds

    result = pool_rounds.main(["--worlds", "4", "--per-rank", "400", "--ratios", "0.92", "10", "--out", "/dev/null"])
    uncapped, capped = result["rows"]
    assert (uncapped["pool_window"], uncapped["window"], uncapped["min_window"]) == (None, 4096, 256)
    assert (capped["pool_window"], capped["window"], capped["min_window"]) == (8192, 2048, 128)
    assert capped["first_batch_s"] == pytest.approx(0.128) and uncapped["first_batch_s"] == pytest.approx(0.4)
    assert abs(capped["steps"] - uncapped["steps"]) <= 2
    assert all(0.2 < x <= 1.0 + 1e-9 for row in result["rows"] for x in row["scores"])
