"""G8 exact resume and elastic resume under a real SIGKILL (ranks are separate processes, gloo at W=2).

A training loop (tests/resume_worker.py) logs every step and saves its loader state atomically after each step.
Rank 0 SIGKILLs itself at a seeded random step (before or after that step's save), the test SIGKILLs the other
ranks, and a new launch restarts from the newest step every rank saved. The killed log up to that step plus the
resumed log must equal an uninterrupted run's log (exact, same W), or, at another W, cover each epoch's indices
exactly once (elastic).
"""

from __future__ import annotations

import json
import random
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest

import resume_worker
from odb_core import run_virtual_ranks
from resume_launch import free_port, run_and_kill, run_to_end
from resume_worker import N_SAMPLES, Job


def _jobs(base: Job, world_size: int, **kw) -> list[tuple[Job]]:
    port = free_port()
    return [(replace(base, rank=r, world_size=world_size, port=port, **kw),) for r in range(world_size)]


def read_log(out: Path, run: str, rank: int, upto: int | None = None) -> list[dict]:
    rows = []
    for line in (out / f"log.{run}.r{rank}.jsonl").read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a line cut by the kill
            continue
        if upto is None or row["g"] <= upto:
            rows.append(row)
    return rows


def stop_points(total: int, seed: int, n: int = 2) -> list[int]:
    """n seeded random global steps, spread over the run (one per slice), never the very last one."""
    rng = random.Random(seed)
    edges = [1 + k * (total - 1) // n for k in range(n + 1)]
    return [rng.randrange(edges[k], max(edges[k + 1], edges[k] + 1)) for k in range(n)]


def kill_and_resume(tmp: Path, base: Job, world_size: int, die_at: int, before_save: bool,
                    new_world_size: int | None = None) -> tuple[Path, int]:
    out = tmp / f"kill{die_at}"
    out.mkdir()
    base = replace(base, out=str(out))
    run_and_kill(resume_worker.main, _jobs(base, world_size, run="killed", die_at=die_at,
                                           die_before_save=before_save))
    resume = "exact" if new_world_size is None else "merged"
    run_to_end(resume_worker.main, _jobs(base, new_world_size or world_size, run="resumed", resume=resume,
                                         old_world_size=world_size))
    resumed_from = json.loads((out / "resumed.resumed.json").read_text())["g"]
    slack = 1 if new_world_size is None else base.accumulation_steps  # elastic: the last saved GA boundary
    assert die_at - slack <= resumed_from <= die_at
    return out, resumed_from


EXACT_CASES = [  # (world size, join, accumulation steps, data, seed and number of the stop points)
    pytest.param(1, True, 2, "map", 11, 2, id="W1-join-ga2"),
    pytest.param(2, True, 1, "map", 12, 2, id="W2-join"),
    pytest.param(2, False, 2, "map", 13, 2, id="W2-nonjoin-ga2"),
    pytest.param(2, True, 1, "hf", 14, 1, id="W2-hf-stream-join"),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size,join,accumulation_steps,data,seed,points", EXACT_CASES)
def test_killed_and_restarted_run_yields_exactly_the_uninterrupted_batches(tmp_path, world_size, join,
                                                                             accumulation_steps, data, seed, points):
    base = Job(out=str(tmp_path), rank=0, world_size=world_size, port=0, data=data, join=join,
               accumulation_steps=accumulation_steps)
    run_to_end(resume_worker.main, _jobs(base, world_size, run="reference"))
    reference = [read_log(tmp_path, "reference", r) for r in range(world_size)]
    total = len(reference[0])
    assert all(len(ref) == total for ref in reference)  # G2 over the whole run
    for k, die_at in enumerate(stop_points(total, seed, points)):
        out, resumed_from = kill_and_resume(tmp_path, base, world_size, die_at, before_save=k % 2 == 0)
        for r in range(world_size):
            got = read_log(out, "killed", r, upto=resumed_from) + read_log(out, "resumed", r)
            assert got == reference[r], f"rank {r}: killed at step {die_at}, resumed from {resumed_from}"


def steps_per_epoch(job: Job, world_size: int) -> int:
    """Epoch 0's step count at `world_size`, from the same loaders on an in-process virtual cluster."""
    def count(rank: int, transport) -> int:
        return sum(1 for _ in resume_worker.build_loader(replace(job, rank=rank, world_size=world_size), transport))

    counts = run_virtual_ranks(count, world_size)
    assert len(set(counts)) == 1 and counts[0] > 8
    return counts[0]


def _epoch_indices(rows: list[dict], epoch: int) -> list[int]:
    return [i for row in rows if row["epoch"] == epoch for i in row["indices"]]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("old_world,new_world,seed", [pytest.param(2, 1, 21, id="2to1"),
                                                      pytest.param(1, 2, 22, id="1to2")])
def test_elastic_resume_after_a_kill_emits_every_index_once_per_epoch(tmp_path, old_world, new_world, seed):
    base = Job(out=str(tmp_path), rank=0, world_size=old_world, port=0, accumulation_steps=2)
    epoch_steps = steps_per_epoch(base, old_world)
    die_at = 2 * random.Random(seed).randrange(epoch_steps // 8, 3 * epoch_steps // 8)  # mid-epoch 0, a GA boundary
    out, resumed_from = kill_and_resume(tmp_path, base, old_world, die_at, before_save=False,
                                        new_world_size=new_world)
    old = [read_log(out, "killed", r, upto=resumed_from) for r in range(old_world)]
    new = [read_log(out, "resumed", r) for r in range(new_world)]
    for epoch in (0, 1):
        seen = [i for rows in old + new for i in _epoch_indices(rows, epoch)]
        assert Counter(seen) == Counter(range(N_SAMPLES)), f"epoch {epoch}: lost or repeated indices"
    new_steps = [[(row["epoch"], row["step"]) for row in rows] for rows in new]
    assert all(steps == new_steps[0] for steps in new_steps)  # G2 at the new world size
    last_old = max((row["epoch"], row["step"]) for row in old[0])
    assert new_steps[0][0] == (last_old[0], last_old[1] + 1)  # step numbers continue
    if new_world == 1:  # the next epoch is a normal epoch at the new world size
        fresh = resume_worker.build_loader(replace(base, world_size=1, accumulation_steps=2))
        fresh.set_epoch(1)
        assert [b.info.indices for b in fresh] == [tuple(r["indices"]) for r in new[0] if r["epoch"] == 1]
