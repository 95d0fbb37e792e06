"""Loader state semantics in one process: epochs across resumes, set_epoch, end-of-epoch states, metrics, old
states, and iterable streams with persistent workers."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import LengthDataset, lognormal_lengths
from odb_core import ODBDataLoader

N = 240
DATASET = LengthDataset(lognormal_lengths(N, 1.0, 96, seed=7, hi=900))
COUNTERS = ("steps", "idle_steps", "local_samples", "global_samples", "local_input_tokens", "global_input_tokens",
            "global_supervised_tokens", "padded_tokens", "splits", "pushed_back_groups", "rounds", "sync_bytes")


def make(dataset=DATASET, **kw) -> ODBDataLoader:
    return ODBDataLoader(dataset, **{**dict(token_budget=1024, window=32, shuffle=True, seed=5), **kw})


def take(loader: ODBDataLoader, n: int):
    it = iter(loader)
    return it, [next(it) for _ in range(n)]


def roundtrip(state: dict) -> dict:
    return json.loads(json.dumps(state))


def test_a_fresh_loader_continues_the_saved_epoch_instead_of_replaying_epoch_0():
    loader = make()
    epoch0 = [b.info.indices for b in loader]
    state = roundtrip(loader.state_dict())
    assert state["epoch"] == 1 and state["position"] is None
    resumed = make()
    resumed.load_state_dict(state)
    assert resumed.epoch == 1
    epoch1 = [b.info.indices for b in resumed]
    assert epoch1 != epoch0 and sorted(i for s in epoch1 for i in s) == list(range(N))
    reference = make()
    reference.set_epoch(1)
    assert epoch1 == [b.info.indices for b in reference]
    assert resumed.epoch == 2


def test_set_epoch_refuses_to_drop_a_loaded_mid_epoch_position():
    loader = make()
    it, _ = take(loader, 3)
    state = roundtrip(loader.state_dict())
    rest = [b.info.indices for b in it]
    resumed = make()
    resumed.load_state_dict(state)
    with pytest.raises(ValueError, match="continues epoch 0"):
        resumed.set_epoch(1)
    resumed.set_epoch(0)  # the restored epoch itself is fine
    assert [b.info.indices for b in resumed] == rest


def test_a_state_saved_after_the_last_step_of_an_epoch_moves_on_to_the_next():
    n = sum(1 for _ in make())
    loader = make()
    take(loader, n)
    state = roundtrip(loader.state_dict())
    assert state["epoch"] == 0 and state["position"]["epoch_complete"]
    reference = make()
    reference.set_epoch(1)
    epoch1 = [b.info.indices for b in reference]
    for choose in ("iterate", "set_epoch"):
        resumed = make()
        resumed.load_state_dict(state)
        if choose == "iterate":
            assert list(resumed) == [] and resumed.epoch == 1  # replays nothing, runs no collective
        else:
            resumed.set_epoch(1)  # allowed: nothing of epoch 0 is left
        assert [b.info.indices for b in resumed] == epoch1


@pytest.mark.parametrize("stop", [1, 9, 20])
def test_resumed_metrics_equal_the_uninterrupted_metrics(stop):
    reference = make(accumulation_steps=2)
    list(reference)
    loader = make(accumulation_steps=2)
    take(loader, stop)  # the producer thread runs ahead: its counters must not leak into the state
    state = roundtrip(loader.state_dict())
    loader.close()
    resumed = make(accumulation_steps=2)
    resumed.load_state_dict(state)
    list(resumed)
    got, want = resumed.metrics.snapshot(), reference.metrics.snapshot()
    assert {k: got[k] for k in COUNTERS} == {k: want[k] for k in COUNTERS}


def test_states_of_the_previous_version_still_resume_exactly():
    reference = [b.info for b in make()]
    loader = make()
    _, head = take(loader, 6)
    state = roundtrip(loader.state_dict())
    state.update(version=1)
    del state["sampler"], state["plan"], state["position"]["round_emitted"], state["position"]["epoch_complete"]
    del state["digest"]  # version 1 had none
    resumed = make()
    resumed.load_state_dict(state)
    assert [b.info for b in head] + [b.info for b in resumed] == reference


def test_load_state_dict_refuses_a_different_dataset_size_or_shuffle():
    state = make().state_dict()
    with pytest.raises(ValueError, match="sampler"):
        make(dataset=LengthDataset([10] * (N + 1))).load_state_dict(state)
    with pytest.raises(ValueError, match="sampler"):
        make(shuffle=False).load_state_dict(state)


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return (DATASET[i] for i in range(N))


def test_an_iterable_with_persistent_workers_resumes_and_runs_the_next_epoch_whole():
    options = dict(num_workers=1, persistent_workers=True, fetch_chunk=4)
    reference = ODBDataLoader(Stream(), token_budget=1024, window=32, **options)
    expected = [[b.info.indices for b in reference] for _ in range(2)]
    loader = ODBDataLoader(Stream(), token_budget=1024, window=32, **options)
    _, head = take(loader, 7)
    state = roundtrip(loader.state_dict())
    loader.close()
    resumed = ODBDataLoader(Stream(), token_budget=1024, window=32, **options)
    resumed.load_state_dict(state)
    got = [[b.info.indices for b in head] + [b.info.indices for b in resumed], [b.info.indices for b in resumed]]
    assert got == expected
