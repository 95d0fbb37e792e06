"""A resume reads what the save read (NOTE [ A resume reads what the save read ] in odb_core/resume/replay.py).

An exact resume replays the saved round and drops the steps already trained. Before these checks, a user sampler
drawn otherwise, an unseeded `RandomSampler`, or a dataset whose lengths changed between the runs (re-tokenized, a
lower cutoff) resumed without an error into an epoch that repeated some samples and never trained others. Each is
now refused with a `StateError` that says what changed; resuming on the same data is exact as before, including
with a sampler that holds a seeded generator, which the load no longer draws from.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from torch.utils.data import IterableDataset, RandomSampler

from conftest import LengthDataset, lognormal_lengths
from odb_core import ODBDataLoader
from odb_core.resume.fields import StateError, digest_of

N = 240
LENGTHS = lognormal_lengths(N, 1.0, 96, seed=11, hi=900)
SAVED_AFTER = 2  # inside the epoch's first round, which began with nothing buffered (the buffer check is blind)


def seeded(seed: int | None) -> RandomSampler:
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    return RandomSampler(range(N), generator=generator)


def make(dataset=None, sampler=None, **kw) -> ODBDataLoader:
    return ODBDataLoader(dataset if dataset is not None else LengthDataset(LENGTHS), sampler=sampler,
                         **{**dict(token_budget=1024, window=48, seed=3, prefetch_steps=0), **kw})


def indices(steps) -> list[list[int]]:
    return [list(batch.info.indices) for batch in steps]


def epoch(loader: ODBDataLoader) -> list[list[int]]:
    """The indices of one epoch's steps, the loader closed after it (persistent workers outlive an epoch, and
    a collected loader's wait for them costs seconds per worker)."""
    try:
        return indices(loader)
    finally:
        loader.close()


def save_after(loader: ODBDataLoader, steps: int) -> tuple[list[list[int]], dict]:
    it = iter(loader)
    before = indices(next(it) for _ in range(steps))
    state = json.loads(json.dumps(loader.state_dict()))
    loader.close()  # its workers stop now (a collected one's wait for them: seconds per worker)
    assert state["position"]["start"]["buffer"] == [] and state["position"]["start"]["consumed"] == 0
    return before, state


def test_a_user_sampler_drawn_with_another_seed_is_refused_and_the_same_seed_resumes_exactly():
    whole = epoch(make(sampler=seeded(1)))
    before, state = save_after(make(sampler=seeded(1)), SAVED_AFTER)
    assert before == whole[:SAVED_AFTER]

    other = make(sampler=seeded(2))
    other.load_state_dict(state)  # the order is drawn at iter(), not at the load
    with pytest.raises(StateError, match=r"drew another order of indices for epoch 0 .*order_digest"):
        iter(other)

    same = make(sampler=seeded(1))
    same.load_state_dict(state)
    assert before + epoch(same) == whole


def test_an_unseeded_random_sampler_is_refused():
    _, state = save_after(make(sampler=seeded(None)), SAVED_AFTER)
    resumed = make(sampler=seeded(None))
    resumed.load_state_dict(state)
    with pytest.raises(StateError, match="unseeded RandomSampler"):
        iter(resumed)


WORKERS = {"in_process": {}, "workers": dict(num_workers=2), "persistent": dict(num_workers=2, persistent_workers=True)}


@pytest.mark.parametrize("workers", sorted(WORKERS))
def test_a_sampler_holding_a_seeded_generator_resumes_exactly_and_reads_the_same_with_workers(workers):
    """The generator is seeded once, where the sampler is built, as a script does: each draw takes its next
    order. The load used to draw the saved epoch's order to check the position against it, so the resumed
    `iter()` drew the following one and replayed the round on other samples, with no error. And torch iterates
    a batch sampler twice when it starts worker processes: the workers read a second draw, so the batches
    depended on `num_workers` and the order checked was not the one read (a review's runs: refused every time
    with 2 workers). ODB draws each epoch's order once (`ChunkSampler.draw`)."""
    options = WORKERS[workers]
    whole = epoch(make(sampler=seeded(7)))
    assert epoch(make(sampler=seeded(7), **options)) == whole  # the same order whatever the workers
    before, state = save_after(make(sampler=seeded(7), **options), SAVED_AFTER)
    resumed = make(sampler=seeded(7), **options)
    resumed.load_state_dict(state)
    after = epoch(resumed)
    assert before + after == whole
    assert Counter(i for step in before + after for i in step) == Counter(range(N))  # each sample once


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_dataset_whose_lengths_changed_is_refused_naming_the_round(num_workers):
    _, state = save_after(make(shuffle=True, num_workers=num_workers), SAVED_AFTER)
    cut = LengthDataset([min(n, 120) for n in LENGTHS])  # re-tokenized with a lower cutoff between the runs
    resumed = make(cut, shuffle=True, num_workers=num_workers)
    resumed.load_state_dict(state)
    round_ = state["position"]["start"]["round"]
    with pytest.raises(StateError, match=rf"round {round_} of epoch 0, which the resume replays.*lengths_digest"):
        next(iter(resumed))
    resumed.close()
    unchanged = make(shuffle=True, num_workers=num_workers)
    unchanged.load_state_dict(state)
    assert len(epoch(unchanged)) > 0


class Stream(IterableDataset):
    def __init__(self, lengths: list[int]) -> None:
        self.data = LengthDataset(lengths)

    def __iter__(self):
        return (self.data[i] for i in range(len(self.data)))


def test_a_stream_whose_lengths_changed_is_refused():
    _, state = save_after(make(Stream(LENGTHS)), SAVED_AFTER)
    assert "order_digest" not in state["position"]["start"]  # a stream's order is not drawn ahead
    resumed = make(Stream([n + 1 for n in LENGTHS]))
    resumed.load_state_dict(state)
    with pytest.raises(StateError, match="lengths or indices changed"):
        next(iter(resumed))


def test_a_state_saved_before_the_digests_resumes_unchecked_as_before():
    """States written by an odb without the digests carry none: resumed as they were (the same data: exact)."""
    whole = epoch(make(shuffle=True))
    before, state = save_after(make(shuffle=True), SAVED_AFTER)
    start = state["position"]["start"]
    del start["order_digest"], start["lengths_digest"], state["digest"]
    old = {**state, "digest": digest_of(state)}
    resumed = make(shuffle=True)
    resumed.load_state_dict(old)
    assert before + epoch(resumed) == whole
