"""Real multi-process Gloo clusters on localhost: step alignment, rank-summed counts, coverage and IDLE dummies.

Each test launches a tiny job from `dist_cases.py` (per-rank processes with torchrun's environment variables,
`python -m torch.distributed.run`, or `torch.multiprocessing.spawn`). The ranks write their per-step `StepInfo`
records as JSON; every assertion runs here, on what all ranks reported.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from dist_cases import Case, JobResult, mixed_lengths, rank_skewed_lengths, run_job

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # a hang guard; jobs take ~5-15 s each

def _run(case: Case, launcher: str, tmp_path: Path) -> list[dict[str, Any]]:
    """Run the job; return the per-rank records in rank order (fails with the ranks' output otherwise)."""
    result: JobResult = run_job(case, launcher, tmp_path, timeout_s=240)
    ok = not result.timed_out and all(rc == 0 for rc in result.returncodes)
    assert ok and sorted(result.records) == list(range(case.world_size)), (
        f"{launcher} job failed (timed_out={result.timed_out}, returncodes={result.returncodes}, "
        f"records from ranks {sorted(result.records)}):\n{result.output[-6000:]}")
    return [result.records[r] for r in range(case.world_size)]


def _epoch(records: list[dict[str, Any]], epoch: int) -> list[dict[str, Any]]:
    return [record["epochs"][epoch] for record in records]


def assert_aligned(case: Case, ranks: list[dict[str, Any]]) -> None:
    """G2 and the per-step contract, for one epoch's records of every rank."""
    lengths = {len(r["steps"]) for r in ranks}
    assert len(lengths) == 1, f"ranks yielded different step counts {[len(r['steps']) for r in ranks]}"
    n_steps = lengths.pop()
    for rank, r in enumerate(ranks):
        assert r["report_steps"] == n_steps, f"rank {rank}: last_report.steps disagrees with the yielded steps"
        assert [s["step"] for s in r["steps"]] == list(range(n_steps)), f"rank {rank}: step numbers not 0..T-1"
    for k in range(n_steps):
        column = [r["steps"][k] for r in ranks]
        for local, glob in [("local_samples", "global_samples"), ("local_tokens", "global_tokens"),
                            ("local_input_tokens", "global_input_tokens")]:
            total = sum(s[local] for s in column)
            assert all(s[glob] == total for s in column), (
                f"step {k}: {glob} {[s[glob] for s in column]} != sum of {local} {[s[local] for s in column]}")
        for rank, s in enumerate(column):
            assert_step_contract(case, rank, s)
    assert_window_tokens(case, ranks, n_steps)


def assert_step_contract(case: Case, rank: int, s: dict[str, Any]) -> None:
    where = f"rank {rank} step {s['step']}"
    assert s["is_idle"] == (not s["indices"]), f"{where}: is_idle={s['is_idle']} with indices {s['indices']}"
    if s["is_idle"]:
        assert (s["local_samples"], s["local_tokens"], s["local_input_tokens"]) == (0, 0, 0), where
        assert s["labels_all_ignored"], f"{where}: an IDLE dummy must have every label at -100"
        assert s["rows"] >= 1 and s["width"] >= 1, f"{where}: an IDLE dummy must be a model-ready batch"
    else:
        assert s["local_samples"] == len(s["indices"]) == s["rows"], where
        assert s["rows"] * s["width"] <= case.token_budget or s["rows"] == 1, f"{where}: over the padded budget"


def assert_window_tokens(case: Case, ranks: list[dict[str, Any]], n_steps: int) -> None:
    g = case.accumulation_steps
    assert n_steps % g == 0, f"{n_steps} steps do not end on an accumulation window of {g}"
    for start in range(0, n_steps, g):
        expected = sum(ranks[0]["steps"][k]["global_tokens"] for k in range(start, start + g))
        for rank, r in enumerate(ranks):
            got = [r["steps"][k]["window_tokens"] for k in range(start, start + g)]
            assert got == [expected] * g, f"rank {rank} window at step {start}: window_tokens {got} != {expected}"


def emitted(rank_epoch: dict[str, Any]) -> list[int]:
    return [i for s in rank_epoch["steps"] for i in s["indices"]]


def assert_join_coverage(case: Case, ranks: list[dict[str, Any]]) -> None:
    """G3: rank-local, each rank emits exactly its sampler output (as a multiset); global, the ranks together emit
    exactly the union of their sampler outputs (samples move between ranks). Join reports nothing left behind."""
    for rank, r in enumerate(ranks):
        if case.planning == "local":
            assert Counter(emitted(r)) == Counter(r["sampler"]), f"rank {rank}: emitted != its sampler output"
        assert r["not_emitted"] == [], f"rank {rank}: join left {r['not_emitted']} behind"
    everything = [i for r in ranks for i in emitted(r)]
    assert Counter(everything) == Counter(i for r in ranks for i in r["sampler"]), "emitted != the sampler outputs"
    if case.sampler == "odb":  # disjoint shards: every dataset index once, on exactly one rank
        assert sorted(everything) == list(range(len(case.lengths)))


class UnreportedIndices(AssertionError):
    """Non-join left sampler indices out of `last_report.not_emitted` (raised after every other check of the
    epoch passed, so that the message names exactly this gap)."""


def assert_quota_closure(case: Case, ranks: list[dict[str, Any]]) -> None:
    """G4: nothing emitted twice; what was read is a prefix of the sampler output; emitted + not_emitted is
    exactly the sampler output (the last check raises `UnreportedIndices`). Per rank under rank-local planning;
    under global planning a rank emits others' samples, so the checks run on the union of the ranks."""
    views = ranks if case.planning == "local" else [{
        "sampler": [i for r in ranks for i in r["sampler"]], "not_emitted": [i for r in ranks for i in r["not_emitted"]],
        "steps": [s for r in ranks for s in r["steps"]], "unread_chunks_remaining": any(
            r["unread_chunks_remaining"] for r in ranks)}]
    for rank, r in enumerate(views):
        sampled, shipped = Counter(r["sampler"]), Counter(emitted(r))
        assert not shipped - sampled, f"rank {rank}: emitted an index more often than sampled"
        assert not shipped & Counter(r["not_emitted"]), f"rank {rank}: an index is both emitted and not_emitted"
        if case.accumulation_steps == 1:
            assert not any(s["is_idle"] for s in r["steps"]), f"rank {rank}: non-join ran an IDLE step"
    if case.sampler == "odb":
        everything = [i for r in ranks for i in emitted(r)]
        assert len(everything) == len(set(everything)), "an index was emitted on two ranks"
    for rank, r in enumerate(views):
        missing = Counter(r["sampler"]) - Counter(emitted(r)) - Counter(r["not_emitted"])
        n_missing = missing.total()
        suffix = r["sampler"][len(r["sampler"]) - n_missing :] if n_missing else []
        assert Counter(suffix) == missing, f"rank {rank}: unreported indices {sorted(missing)} are not a suffix"
        assert r["unread_chunks_remaining"] or not n_missing, f"rank {rank}: indices missing, nothing unread"
    for rank, r in enumerate(views):
        missing = Counter(r["sampler"]) - Counter(emitted(r)) - Counter(r["not_emitted"])
        if missing:
            raise UnreportedIndices(f"rank {rank}: {missing.total()} never-read sampler indices (e.g. "
                                    f"{sorted(missing)[:5]}) are neither emitted nor in last_report.not_emitted")


def _check_epochs(case: Case, records: list[dict[str, Any]]) -> None:
    """Every guarantee of the case's mode, epoch by epoch; `UnreportedIndices` only after all other checks."""
    gaps = []
    for epoch in range(case.epochs):
        ranks = _epoch(records, epoch)
        assert_aligned(case, ranks)
        try:
            (assert_join_coverage if case.join else assert_quota_closure)(case, ranks)
        except UnreportedIndices as gap:
            gaps.append(gap)
    if gaps:
        raise gaps[0]


def _idle_steps(ranks: list[dict[str, Any]]) -> int:
    return sum(s["is_idle"] for r in ranks for s in r["steps"])


# --- G2 + G3 under uneven data --------------------------------------------------------------------------------
UNEVEN_JOIN = {
    "env-w2-short-vs-long-rank": ("env", Case(world_size=2, lengths=rank_skewed_lengths(240, 2))),
    "spawn-w4-skewed-ranks": ("spawn", Case(world_size=4, lengths=rank_skewed_lengths(240, 4))),
    "env-w2-short-vs-long-rank-local": ("env", Case(world_size=2, lengths=rank_skewed_lengths(240, 2),
                                                    planning="local")),
}


@pytest.mark.parametrize("name", list(UNEVEN_JOIN))
def test_join_aligns_steps_and_covers_every_index_once_with_uneven_ranks(tmp_path, name):
    launcher, case = UNEVEN_JOIN[name]
    records = _run(case, launcher, tmp_path)
    _check_epochs(case, records)
    ranks = _epoch(records, 0)
    if case.planning == "local":
        assert _idle_steps(ranks) > 0, "the short rank should have run out and gone IDLE"
    else:  # the long ranks' samples move to the short ones; only the epoch's last step can hold IDLE slots
        assert _idle_steps(ranks) <= case.world_size - 1
        assert all(s["is_idle"] is False for r in ranks for s in r["steps"][:-1])
        assert sum(r["moved_samples"] for r in ranks) > 0, "global planning moved no sample between ranks"
    for rank, r in enumerate(ranks):
        assert any(s["global_samples"] > s["local_samples"] for s in r["steps"]), (
            f"rank {rank}: no step counted another rank's samples; were the ranks synced at all?")


def test_join_covers_a_dataset_size_not_divisible_by_world_size_under_torchrun(tmp_path):
    case = Case(world_size=2, lengths=mixed_lengths(301), num_workers=2, context="fork", shuffle=True)
    records = _run(case, "torchrun", tmp_path)
    _check_epochs(case, records)
    assert [len(r["sampler"]) for r in _epoch(records, 0)] == [151, 150]


@pytest.mark.parametrize("join", [True, False], ids=["join", "non-join"])
def test_global_batches_do_not_depend_on_workers_per_rank_or_how_samples_move(tmp_path, join):
    """G7 under global planning: 3 skewed ranks, each with its own num_workers, moving samples by `send` in one
    run and by `fetch` in the other, yield the same batches on every rank."""
    first = Case(world_size=3, lengths=rank_skewed_lengths(300, 3), join=join, shuffle=True,
                 workers_by_rank=[0, 2, 1], context="fork", move="send")
    second = dataclasses.replace(first, workers_by_rank=[1, 0, 0], move="fetch")
    runs = [_run(case, "env", tmp_path / name) for case, name in ((first, "a"), (second, "b"))]
    for case, records in zip((first, second), runs):
        _check_epochs(case, records)
    assert [[s["indices"] for s in r["steps"]] for r in _epoch(runs[0], 0)] == \
        [[s["indices"] for s in r["steps"]] for r in _epoch(runs[1], 0)]
    assert sum(r["moved_samples"] for r in _epoch(runs[0], 0)) > 0


# --- a rank without data ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("planning", ["local", "global"])
def test_rank_without_data_steps_with_the_others_under_join(tmp_path, planning):
    """Rank-local: the empty rank runs IDLE dummies while the others drain. Global: it gets groups of the
    pooled samples (moved to it), IDLE only where fewer groups than ranks are left. Ranks 0-2 hold 20 samples
    each (their own samplers), rank 3 none."""
    samplers = {str(rank): {"sampler": list(range(rank, 60, 3)) if rank < 3 else []} for rank in range(4)}
    case = Case(world_size=4, lengths=mixed_lengths(60), planning=planning, options_by_rank=samplers)
    records = _run(case, "env", tmp_path)
    _check_epochs(case, records)
    ranks = _epoch(records, 0)
    empty = ranks[3]
    assert empty["sampler"] == [] and empty["steps"], "rank 3 has no data but must still step with the others"
    if planning == "local":
        assert all(s["is_idle"] for s in empty["steps"])
    else:
        assert emitted(empty), "global planning gave the empty rank none of the pooled samples"
        assert sum(r["moved_samples"] for r in ranks) > 0
        assert all(not s["is_idle"] for s in empty["steps"][:-1]), "the empty rank went IDLE before the last step"


def test_rank_without_data_ends_the_non_join_epoch_with_everything_reported(tmp_path):
    case = Case(world_size=2, lengths=[64], join=False)
    records = _run(case, "spawn", tmp_path)
    _check_epochs(case, records)
    ranks = _epoch(records, 0)
    assert [len(r["steps"]) for r in ranks] == [0, 0]
    assert ranks[0]["not_emitted"] == [0]


# --- G4 non-join --------------------------------------------------------------------------------------------------
def test_non_join_stops_at_the_shortest_rank_and_reports_what_it_did_not_emit(tmp_path):
    case = Case(world_size=2, lengths=rank_skewed_lengths(240, 2), join=False, planning="local")
    records = _run(case, "env", tmp_path)
    _check_epochs(case, records)
    assert any(r["not_emitted"] for r in _epoch(records, 0)), "the long rank should have samples left over"


def test_global_non_join_stops_when_the_pool_cannot_fill_a_step_and_reports_the_rest(tmp_path):
    """Global planning: non-join runs a group for every rank at every step, never IDLE; while a stream is active
    it goes on as long as the pool's ready groups hold a sample per rank (a band short of groups is completed by
    splits: NOTE [ A pool too small for a band ]), and its final round emits full bands only; what it did not emit
    is reported (closure, checked with the other guarantees in `_check_epochs`)."""
    case = Case(world_size=2, lengths=rank_skewed_lengths(240, 2), join=False)
    records = _run(case, "env", tmp_path)
    _check_epochs(case, records)
    ranks = _epoch(records, 0)
    assert not any(s["is_idle"] for r in ranks for s in r["steps"])
    reported = sum(len(r["not_emitted"]) for r in ranks)
    assert reported < 0.1 * len(case.lengths)  # before the NOTE, up to the pool's first round on (a skewed pool)


# --- DistributedSampler (pads with repeated indices when W does not divide the size) ---------------------------
SAMPLER_CASES = {
    "env-w2-join": ("env", Case(world_size=2, lengths=mixed_lengths(201), sampler="distributed")),
    "spawn-w2-non-join-accumulate-3": ("spawn", Case(world_size=2, lengths=mixed_lengths(201),
                                                     sampler="distributed", join=False, accumulation_steps=3)),
}


@pytest.mark.parametrize("name", list(SAMPLER_CASES))
def test_distributed_sampler_output_is_emitted_per_rank_as_sampled(tmp_path, name):
    launcher, case = SAMPLER_CASES[name]
    records = _run(case, launcher, tmp_path)
    _check_epochs(case, records)
    sampled = [i for r in _epoch(records, 0) for i in r["sampler"]]
    assert len(sampled) > len(set(sampled)) == len(case.lengths), "DistributedSampler should have padded"


# --- accumulation windows -----------------------------------------------------------------------------------------
def test_window_tokens_sum_global_tokens_over_each_accumulation_window(tmp_path):
    """Two epochs with persistent fork workers; windows of 3 (the non-join case is in the sampler test)."""
    case = Case(world_size=2, lengths=rank_skewed_lengths(200, 2), accumulation_steps=3, num_workers=2,
                context="fork", persistent_workers=True, shuffle=True, epochs=2)
    records = _run(case, "env", tmp_path)
    _check_epochs(case, records)  # includes assert_window_tokens: windows of 3, each epoch ends on a window
    first, second = _epoch(records, 0)[0], _epoch(records, 1)[0]
    assert len(first["steps"]) >= 6 and first["sampler"] != second["sampler"], "expected two reshuffled epochs"


# --- leaving an epoch early ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(("planning", "join"), [("global", True), ("local", True), ("global", False)])
def test_breaking_out_of_an_epoch_then_starting_the_next_stays_aligned_at_any_skew(tmp_path, planning, join):
    """Every rank breaks out of epoch 0 after 4 steps, rank 1 one second later, with the background producer on
    (prefetch 2, so both producers are ahead); the next epoch must still align and cover its data (NOTE [ Leaving
    an epoch ]): before, the stale producers' collectives paired up with the new epoch's (a DesyncError on one
    rank, a PeerError after the full timeout on the other)."""
    case = Case(world_size=2, lengths=mixed_lengths(300), window=8, prefetch_steps=2, epochs=2, break_after=4,
                break_skew_s=1.0, planning=planning, join=join, shuffle=True, sync_timeout_s=30.0)
    records = _run(case, "env", tmp_path)
    first, second = _epoch(records, 0), _epoch(records, 1)
    assert [len(r["steps"]) for r in first] == [4, 4]
    assert_aligned(case, second)
    (assert_join_coverage if join else assert_quota_closure)(case, second)


def test_a_rank_waiting_for_a_slower_peer_spends_its_wait_in_the_exchange(tmp_path):
    """NOTE [ Waiting for data ]: rank 1 trains 50 ms per step, rank 0 at once; rank 0's loader waits for rank 1 at
    every round's exchange, and `sync_seconds` (logged as `odb/data_wait_exchange_fraction`) is that wait, not
    `read_seconds`: its stream is read in-process and never waits. Its epoch's advice names the slowest rank, and
    rank 1's says nothing (NOTE [ Which lever ])."""
    case = Case(world_size=2, lengths=mixed_lengths(300), window=24, prefetch_steps=0, step_s_by_rank=[0.0, 0.05])
    records = _run(case, "env", tmp_path)
    fast, slow = (epoch["waits"] for epoch in _epoch(records, 0))
    trained_s = 0.05 * len(records[1]["epochs"][0]["steps"])
    assert fast["wait_seconds"] > 0.5 * trained_s, (fast, trained_s)
    assert 0.8 * fast["wait_seconds"] < fast["sync_seconds"] <= fast["wait_seconds"], fast
    assert fast["read_seconds"] < 0.1 * fast["wait_seconds"], fast
    assert slow["sync_seconds"] < 0.5 * fast["sync_seconds"], (slow, fast)  # its collectives' own cost
    fast_advice, slow_advice = (epoch["advice"] for epoch in _epoch(records, 0))  # NOTE [ Which lever ]
    assert list(fast_advice) == ["ranks"] and "slowest rank" in fast_advice["ranks"], fast_advice
    assert slow_advice == {}, slow_advice  # it never waited: it is the slow one


# --- cross-rank sync under every worker start method ------------------------------------------------------------
@pytest.mark.parametrize(("context", "num_workers"), [("fork", 2), ("forkserver", 2), ("spawn", 1)])
def test_global_counts_equal_rank_sums_under_every_worker_start_method(tmp_path, context, num_workers):
    """The reference release silently stopped syncing ranks when workers used spawn; here every context syncs.
    (spawn runs one worker per rank: each spawned worker re-imports torch, the slowest part of this file.)"""
    case = Case(world_size=2, lengths=rank_skewed_lengths(160, 2), num_workers=num_workers, context=context)
    records = _run(case, "env", tmp_path)
    _check_epochs(case, records)  # global_* == sum over ranks of local_* at every step
    ranks = _epoch(records, 0)
    assert any(min(r["steps"][k]["local_samples"] for r in ranks) > 0 for k in range(len(ranks[0]["steps"]))), (
        "some step must have samples on both ranks, or the rank sums would not show that ranks talked")


# --- VLM samples ----------------------------------------------------------------------------------------------------
def test_idle_dummy_carries_an_image_and_patch_counts_sum_over_ranks(tmp_path):
    """Rank 0 gets 7 budget-filling samples, rank 1 six short ones whose first has no image: rank 1 goes IDLE, and
    its dummy is its first sample *with* an image, so a VLM's IDLE step runs the vision tower like every real step
    (NOTE [ IDLE dummy ]). `local_patches` are the batch's pixel rows; `global_patches` sum them over the ranks."""
    case = Case(world_size=2, lengths=[2000 if i % 2 == 0 else 20 for i in range(13)], first_image=3,
                planning="local")  # rank-local: the short rank runs out and IDLEs (global moves samples instead)
    records = _run(case, "env", tmp_path)
    _check_epochs(case, records)
    ranks = _epoch(records, 0)
    idle = [s for s in ranks[1]["steps"] if s["is_idle"]]
    assert idle and all(s["pixel_rows"] == 4 * 20 for s in idle), idle
    for r in ranks:
        for s in r["steps"]:
            assert s["is_idle"] or s["local_patches"] == s["pixel_rows"]
    for step0, step1 in zip(ranks[0]["steps"], ranks[1]["steps"]):
        assert step0["global_patches"] == step1["global_patches"] == step0["local_patches"] + step1["local_patches"]
