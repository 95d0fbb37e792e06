"""A state taken at an epoch's last step, where the epoch ends in a round that plans no step (NOTE [ Which last
step is complete ] in odb_core/resume/round_log.py): every rank saves the same position, whatever its threads'
timing, and a resume from it goes on with the next epoch's batches.

Virtual ranks (`run_virtual_ranks`: real loaders on threads, their collectives over an in-process `VirtualHub`,
not Gloo; the threads' timing is what varies), pooled quota rounds (`join=False`, global planning) whose last
round cannot fill a band of W groups, so the epoch's end comes after its last step."""

from __future__ import annotations

import json
import time

import pytest

from conftest import LengthDataset, lognormal_lengths
from odb_core import ODBDataLoader, run_virtual_ranks
from odb_core.resume.resume import merge_states

WORLD = 3
DATASET = LengthDataset(lognormal_lengths(80, 1.0, 64, seed=62, hi=250))
OPTIONS = dict(token_budget=256, window=4, min_window=None, join=False, planning="global", shuffle=True)


def epochs(rank, transport, extra, state=None, slow_rank=None, n=2):
    """The indices of each step of `n` epochs on this rank, and its state after each step of the first."""
    loader = ODBDataLoader(DATASET, transport=transport, **OPTIONS, **extra)
    if state is not None:
        loader.load_state_dict(state)
    runs, states = [], []
    try:
        for _ in range(n):
            steps = []
            for batch in loader:
                steps.append(batch.info.indices)
                if rank == slow_rank and len(steps) >= 7:
                    time.sleep(0.3)  # the other ranks' threads run the empty last round meanwhile
                if len(runs) == 0:
                    states.append(json.loads(json.dumps(loader.state_dict())))
            runs.append(steps)
    finally:
        loader.close()
    return runs, states


@pytest.mark.parametrize("extra", [dict(plan_ahead=False, prefetch_steps=2), dict(plan_ahead=True),
                                   dict(plan_ahead=False)], ids=["prefetch", "plan_ahead", "inline"])
def test_a_state_at_the_last_step_is_the_same_on_every_rank_and_resumes_into_the_next_epoch(extra):
    ranks = run_virtual_ranks(lambda rank, t: epochs(rank, t, extra, slow_rank=0), WORLD, timeout_s=120)
    last = [states[-1] for _, states in ranks]
    steps = {len(runs[0]) for runs, _ in ranks}
    assert len(steps) == 1 and steps.pop() > 0
    # before, whether a rank's `epoch_complete` was set depended on whether its thread had run the empty round
    # by then (rank 0, slow, had it; the others not): the resume refused the states as saved after different steps
    assert [s["position"]["epoch_complete"] for s in last] == [False] * WORLD
    merge_states(last)  # refuses states saved after different steps
    resumed = run_virtual_ranks(lambda rank, t: epochs(rank, t, extra, state=last[rank], n=2), WORLD, timeout_s=120)
    for (full, _), (again, _) in zip(ranks, resumed):
        assert again == [[], full[1]]  # the rest of epoch 0 (nothing), then epoch 1 as the uninterrupted run


def test_the_trainer_s_view_of_a_resumed_epoch_that_had_ended_goes_on_into_the_next_epoch():
    """The HF adapter's `EpochView`: before, the first Trainer epoch of the resumed run got epoch 0's nothing, and
    the Trainer stops training at an epoch without a batch (a resumed run that ended early, with a warning only)."""
    from odb_core.epoch.epoch_length import EpochLength, EpochView

    ranks = run_virtual_ranks(lambda rank, t: epochs(rank, t, dict(plan_ahead=False), n=3), WORLD, timeout_s=120)

    def resumed(rank, transport):
        loader = ODBDataLoader(DATASET, transport=transport, **OPTIONS, plan_ahead=False)
        loader.load_state_dict(ranks[rank][1][-1])
        view = EpochView(loader, EpochLength(length=40, estimate=40, planned_steps=None, stop_epoch=3),
                         resumed=True)
        try:
            trainer_epochs = []
            for trainer_epoch in (1, 2):  # the Trainer's count after its saved global_step: one epoch done
                view.set_epoch(trainer_epoch)
                trainer_epochs.append([batch.info.indices for batch in view])
            return trainer_epochs, view.done()
        finally:
            loader.close()

    for (full, _), (again, done) in zip(ranks, run_virtual_ranks(resumed, WORLD, timeout_s=120)):
        assert again == [full[1], full[2]] and done

