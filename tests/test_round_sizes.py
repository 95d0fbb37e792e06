"""Rounds that start small and end small, and a buffer bounded in bytes (NOTE [ Round sizes ] in
odb_core/planning/round_sizes.py).

With `num_workers=0` the DataLoader reads a sample when it is pulled, so `CountingDataset.reads` at the first batch
is what the first step waited for. Before `min_window`, the first step came after one whole window of samples.
"""

from __future__ import annotations

import collections
import json
import math
import tracemalloc

import numpy as np
import torch
import pytest
from hypothesis import given
from hypothesis import strategies as st

from batch_record import LengthStream
from conftest import CountingDataset, LengthDataset, saved_midway
from odb_core import Item, ODBConfig, ODBDataLoader, run_virtual_ranks, simulate_epoch
from odb_core.data.sample import compact_ids
from odb_core.data.payload import payload_bytes
from odb_core.data.sendable import pack_sample
from odb_core.planning.round_sizes import round_target
from odb_core.resume.fields import digest_of
from odb_core.settings.config import fingerprint


GROWTHS = st.one_of(st.just(2.0), st.just(2), st.sampled_from([1.25, 1.5, 3.0]), st.floats(1.01, 8.0))


@given(window=st.integers(1, 5000), smallest=st.integers(1, 600), round_index=st.integers(0, 80),
       buffered=st.integers(0, 5000), left=st.one_of(st.none(), st.integers(0, 20000)), growth=GROWTHS)
def test_a_round_target_grows_from_min_window_to_window_and_halves_toward_a_known_end(
        window, smallest, round_index, buffered, left, growth):
    config = ODBConfig(token_budget=64, window=window, min_window=smallest, round_growth=growth)
    target = round_target(config, round_index, buffered, left)
    assert 1 <= target <= window
    if smallest >= window:
        assert target == window
        return
    exact = smallest * 2 ** round_index if growth == 2 else math.floor(smallest * growth ** min(round_index, 1000))
    grown = min(window, exact)
    if left is None:
        assert target == grown
    elif grown < window and buffered + left <= (2 * grown if growth == 2 else min(2 * (growth - 1), growth) * grown):
        # growing, and the rest is at most twice what the next round adds and at most the next round (at growth 2:
        # the rest fits this round and the next)
        assert target == min(window, buffered + left + 1)  # one more than is left: the fill finds the end
    else:
        assert target == min(grown, max(smallest, math.ceil((buffered + left) / 2)))  # at most half the rest
        assert target >= min(grown, smallest)  # never below the first round's size


def test_round_growth_sets_the_ramp_and_its_default_doubles():
    """`round_growth` is the factor between growing rounds: 2 (the default) gives the doubling rounds every recorded
    plan has; 1.25 reaches the window in more, smaller rounds; a round index far past the window costs nothing."""
    doubling = ODBConfig(token_budget=64)
    assert doubling.round_growth == 2
    assert [round_target(doubling, k, 0, None) for k in range(6)] == [256, 512, 1024, 2048, 4096, 4096]
    gentle = ODBConfig(token_budget=64, round_growth=1.25)
    ramp = [round_target(gentle, k, 0, None) for k in range(15)]
    assert ramp[:5] == [256, 320, 400, 500, 625] and ramp[12:] == [3725, 4096, 4096]
    assert round_target(gentle, 10**9, 0, None) == 4096  # no float overflow
    assert round_target(ODBConfig(token_budget=64, round_growth=1.01), 10**9, 0, None) == 4096
    # round 2 grows to 400 (1,024 doubling): a rest of up to twice what the next round adds (2 x 100; 2 x 1,024) is
    # planned whole, and the fill asks for one more sample to find the end
    assert round_target(gentle, 2, 0, 200) == 201 and round_target(doubling, 2, 0, 2048) == 2049
    assert round_target(gentle, 2, 0, 201) == 256 and round_target(gentle, 2, 0, 700) == 350  # else half the rest,
    # at least min_window
    # a fast ramp plans whole at most what its next round would take: the first step still comes after min_window
    assert round_target(ODBConfig(token_budget=64, round_growth=4), 0, 0, 1500) == 256
    assert round_target(ODBConfig(token_budget=64, round_growth=4), 0, 0, 1024) == 1025
    # growth 2 is exact integer doubling, past where a float product or a logarithm would round
    assert round_target(ODBConfig(token_budget=64, window=2**49 + 1, min_window=1), 49, 0, None) == 2**49
    assert round_target(ODBConfig(token_budget=64, window=2**60, min_window=2**53 + 1), 0, 0, 2**54 + 2) == 2**54 + 3


@pytest.mark.parametrize("growth", [1.25, 1.6])
def test_a_gentler_ramp_is_planned_alike_by_the_loader_and_the_simulator_and_resumes_exactly(growth):
    """With `round_growth` below 2 the loader's rounds are still the simulator's (G7: a function of the config and
    the stream), every sample is trained once, and a state saved at any step resumes to the same batches (G8)."""
    lengths = [8 + (i * 53) % 200 for i in range(500)]
    data = [{"input_ids": np.arange(n)} for n in lengths]
    options = dict(token_budget=512, window=128, min_window=8, round_growth=growth, shuffle=True, seed=5)
    loader = ODBDataLoader(data, **options)
    order = [int(i) for i in loader.sampler]
    full = [b.info for b in loader]
    loader.close()
    assert sorted(i for info in full for i in info.indices) == list(range(len(lengths)))
    plan = simulate_epoch([[Item(index=i, length=lengths[i]) for i in order]],
                          ODBConfig(**{k: v for k, v in options.items() if k != "shuffle"}))
    assert [tuple(sorted(info.indices)) for info in full] == _steps(plan.steps[0])
    doubling = simulate_epoch([[Item(index=i, length=lengths[i]) for i in order]],
                              ODBConfig(token_budget=512, window=128, min_window=8, seed=5))
    assert _steps(plan.steps[0]) != _steps(doubling.steps[0])  # the factor acts here, so the checks can fail
    _assert_every_resume_yields_the_rest(data, options, full, every=4)


def test_a_state_saved_with_another_round_growth_is_refused_naming_it_and_one_saved_before_the_field_resumes():
    """`round_growth` decides the rounds, so it is in the fingerprint: a state saved at 1.25 is refused by a
    doubling loader, naming the value to build it with; a state saved before the field (its rounds doubled)
    resumes on a default loader; with `min_window=None` no round grows and the field does not act."""
    lengths = [8 + (i * 53) % 200 for i in range(400)]
    data = [{"input_ids": np.arange(n)} for n in lengths]
    options = dict(token_budget=512, window=128, min_window=4, seed=5)
    state, _ = saved_midway(ODBDataLoader(data, round_growth=1.25, **options), 5, None)
    with pytest.raises(ValueError, match=r"round_growth=1\.25 \(this loader: 2\.0\).*build the loader with "
                                         r"round_growth=1\.25"):
        ODBDataLoader(data, **options).load_state_dict(state)
    state, rest = saved_midway(ODBDataLoader(data, **options), 5, "round_growth")
    again = ODBDataLoader(data, **options)
    again.load_state_dict(state)
    assert [b.info for b in again] == rest
    with pytest.raises(ValueError, match="round_growth"):  # the same state loaded again: the first load left it
        ODBDataLoader(data, round_growth=1.5, **options).load_state_dict(state)  # as it was (no digest error)
    for flat in (dict(options, min_window=None), dict(options, window=64, min_window=64)):  # no round grows
        state, rest = saved_midway(ODBDataLoader(data, round_growth=1.25, **flat), 5, None)
        again = ODBDataLoader(data, **flat)
        again.load_state_dict(state)
        assert [b.info for b in again] == rest
    # an int factor is the same setting as its float: ranks and states agree on 2 and 2.0
    assert fingerprint(ODBConfig(token_budget=64, round_growth=2)) == fingerprint(ODBConfig(token_budget=64))
    assert digest_of(fingerprint(ODBConfig(token_budget=64, round_growth=2))) == digest_of(
        fingerprint(ODBConfig(token_budget=64, round_growth=2.0)))


def test_without_min_window_every_round_fills_the_window():
    config = ODBConfig(token_budget=64, window=300, min_window=None)
    assert {round_target(config, k, 5, left) for k in range(6) for left in (None, 0, 10, 10**6)} == {300}


def test_the_first_step_comes_after_min_window_samples_not_a_whole_window():
    lengths = [16 + (i * 37) % 240 for i in range(3000)]
    reads = {}
    for smallest in (None, 64):
        dataset = CountingDataset(lengths)
        loader = ODBDataLoader(dataset, token_budget=1024, window=2048, min_window=smallest, fetch_chunk=8)
        it = iter(loader)
        next(it)
        reads[smallest] = dataset.reads
        seen = [i for batch in it for i in batch.info.indices]
        assert len(seen) + len(loader.last_report.not_emitted) <= len(lengths)
    assert reads[None] == 2048  # before: a whole window
    assert reads[64] == 64


def _steps(groups) -> list[tuple[int, ...]]:
    """Each step's indices, sorted: a loader's `StepInfo.indices`, or a simulated `Group` (None: IDLE)."""
    return [tuple(sorted(getattr(g, "indices", g) or ())) for g in groups]


@pytest.mark.parametrize("planning", ["global", "local"])
@pytest.mark.parametrize("iterable", [False, True])
def test_the_loader_plans_the_rounds_the_simulator_plans(planning, iterable):
    """The loader and `simulate_epoch` run the same engines: with the rounds of NOTE [ Round sizes ] too, both for
    map-style data (the rounds shrink toward the known end) and for a stream (they do not)."""
    lengths = [8 + (i * 53) % 200 for i in range(700)]
    options = dict(token_budget=512, window=256, min_window=8, planning=planning, shuffle_steps=False)

    def rank_main(rank, transport):
        data = LengthStream(LengthDataset(lengths)) if iterable else LengthDataset(lengths)
        loader = ODBDataLoader(data, transport=transport, **options)
        order = None if iterable else [int(i) for i in loader.sampler]
        steps = [batch.info.indices for batch in loader]
        rounds = loader.last_report.rounds
        loader.close()
        return steps, rounds, order

    ranks = run_virtual_ranks(rank_main, 2, timeout_s=120)
    orders = [order if order is not None else list(range(rank, len(lengths), 2))
              for rank, (_, _, order) in enumerate(ranks)]
    streams = [[Item(index=i, length=lengths[i]) for i in order] for order in orders]
    plan = simulate_epoch(streams, ODBConfig(**options), lengths_known=not iterable)
    for rank, (steps, rounds, _) in enumerate(ranks):
        assert _steps(steps) == _steps(plan.steps[rank])
        assert rounds == plan.rounds
    assert plan.rounds >= 5  # 8, 16, 32, ... : the ramp ran


def test_a_resume_at_any_step_of_small_and_growing_rounds_yields_the_uninterrupted_batches():
    lengths = [8 + (i * 53) % 200 for i in range(400)]
    data = [{"input_ids": np.arange(n)} for n in lengths]
    options = dict(token_budget=512, window=128, min_window=4, shuffle=True, seed=5)
    full = [b.info for b in ODBDataLoader(data, **options)]
    assert len({info.round for info in full}) >= 6
    _assert_every_resume_yields_the_rest(data, options, full, every=3)


def _assert_every_resume_yields_the_rest(data, options: dict, full: list, every: int) -> None:
    """A state saved after every `every`-th step of the epoch whose `StepInfo`s are `full` (through JSON, as a
    checkpoint holds it) resumes in a fresh loader to exactly the rest of `full`."""
    for stop in range(0, len(full), every):
        loader = ODBDataLoader(data, **options)
        it = iter(loader)
        for _ in range(stop):
            next(it)
        state = json.loads(json.dumps(loader.state_dict()))
        loader.close()
        again = ODBDataLoader(data, **options)
        again.load_state_dict(state)
        assert [b.info for b in again] == full[stop:], stop


def test_the_epoch_costs_few_more_steps_with_small_first_and_last_rounds():
    """The cost of NOTE [ Round sizes ]: smaller pools in the first rounds and the last ones. Measured on 20,000
    lognormal lengths (mean 900, CV 1) on one rank, budget 16,384 (docs/design.md): +1.0 % with the default
    (1,187 steps against 1,175; +0.5 % when the last round only left `min_window` samples, before the rounds
    halved toward the end)."""
    rng = np.random.default_rng(0)
    sigma2 = math.log(2)
    lengths = np.clip(rng.lognormal(math.log(900) - sigma2 / 2, math.sqrt(sigma2), 20000).round(), 8, 16384)
    stream = [Item(index=i, length=int(n)) for i, n in enumerate(lengths)]
    full_windows = simulate_epoch([stream], ODBConfig(token_budget=16384, min_window=None)).n_steps
    default = simulate_epoch([stream], ODBConfig(token_budget=16384)).n_steps
    assert full_windows < default <= full_windows * 1.011


class PixelSamples:
    """Map-style samples that each carry `nbytes` of numpy pixel rows (tracked by tracemalloc, unlike torch's)."""

    def __init__(self, n: int, nbytes: int) -> None:
        self.n, self.rows = n, nbytes // (64 * 4)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": np.arange(8 + index % 40), "pixel_values": np.ones((self.rows, 64), dtype=np.float32)}


def _peak_traced_bytes(loader: ODBDataLoader) -> tuple[int, list[int]]:
    tracemalloc.start()
    try:
        seen = [i for batch in loader for i in batch.info.indices]
        return tracemalloc.get_traced_memory()[1], seen
    finally:
        tracemalloc.stop()


def test_buffered_sample_payloads_stay_within_max_buffer_bytes():
    """600 samples of 100 kB (60 MB): with a 2 MB bound the process holds a bounded number of them at any time
    (the bound, the read-ahead's share, one in-process read of 64 samples, a step); without it the window holds
    all 600. Every sample is still yielded exactly once."""
    n, bound = 600, 2 * 1024 * 1024
    dataset = PixelSamples(n, 100 * 1024)
    peaks = {}
    for limit in (bound, None):
        loader = ODBDataLoader(dataset, token_budget=512, max_buffer_bytes=limit, min_window=None)
        peaks[limit], seen = _peak_traced_bytes(loader)
        loader.close()
        assert sorted(seen) == list(range(n))
    assert peaks[None] > 55 * 1024 * 1024  # the whole epoch in one window
    assert peaks[bound] < 14 * 1024 * 1024


@pytest.mark.parametrize("planning", ["local", "global"])
def test_a_byte_bound_makes_rounds_smaller_and_keeps_every_sample_once_on_every_rank(planning):
    n, per_sample = 300, 64 * 1024
    dataset = PixelSamples(n, per_sample)

    def rank_main(rank, transport):
        loader = ODBDataLoader(dataset, transport=transport, token_budget=512, max_buffer_bytes=10 * per_sample,
                               planning=planning)
        infos = [batch.info for batch in loader]
        loader.close()
        return infos

    ranks = run_virtual_ranks(rank_main, 2, timeout_s=120)
    seen = [i for infos in ranks for info in infos for i in info.indices]
    assert sorted(seen) == list(range(n))
    assert len(ranks[0]) == len(ranks[1])
    per_round: dict[int, int] = {}
    for info in ranks[0]:
        per_round[info.round] = per_round.get(info.round, 0) + info.global_samples
    assert max(per_round.values()) <= 2 * 11  # both ranks' buffers: 10 samples' bytes, and the one reaching it
    assert len(per_round) >= n // 22


class NestedPixelSamples(PixelSamples):
    """`PixelSamples` with the pixels one level down, as a processor's `BatchFeature` under a key, beside a list of
    per-image tensors."""

    def __getitem__(self, index: int) -> dict:
        sample = super().__getitem__(index)
        pixels = sample.pop("pixel_values")
        return {**sample, "images": collections.UserDict({"pixel_values": pixels[: self.rows // 2]}),
                "crops": [torch.from_numpy(pixels[self.rows // 2:])]}


def test_tensors_in_nested_mappings_and_lists_count_against_max_buffer_bytes():
    """Before, `payload_bytes` looked only at a sample's top-level values: a tensor under a nested mapping or in a
    list of tensors weighed nothing, and a byte bound of 10 samples admitted the whole window of 300."""
    top, nested = PixelSamples(300, 64 * 1024), NestedPixelSamples(300, 64 * 1024)
    assert payload_bytes(nested[3]) == payload_bytes(top[3]) > 64 * 1024
    assert payload_bytes({"a": {"b": {"c": [torch.zeros(4)]}}}) == 16  # three levels down
    # numbers weigh 8 bytes at the top level and in a top-level list only, as before (a saved fill replays as it was)
    assert payload_bytes({"ids": [1, 2.5, True], "names": ["x", None], "rows": [[1, 2], [3]], "meta": {"n": 1}}) == 24
    # numpy scalars and 0-d arrays in a top-level list weigh as before: 8 bytes a number, an array its own bytes
    assert payload_bytes({"ids": [1, np.array(5, dtype=np.int8), np.int32(2)]}) == 8 + 1 + 8
    rounds = {}
    for name, dataset in (("top", top), ("nested", nested)):
        loader = ODBDataLoader(dataset, token_budget=512, max_buffer_bytes=10 * 64 * 1024, min_window=None,
                               prefetch_steps=0)
        infos = [batch.info for batch in loader]
        loader.close()
        assert sorted(i for info in infos for i in info.indices) == list(range(300))
        rounds[name] = len({info.round for info in infos})
    assert rounds["nested"] == rounds["top"] >= 300 // 11


def test_a_sample_weighs_the_same_read_through_the_workers_or_re_read_by_index():
    """A list of ids weighs what the int64 array `compact_ids` (or the Arrow view) makes of it, so that a resume,
    which re-reads buffered samples by index as the dataset returns them, fills its round as the saved run did."""
    raw = {"input_ids": list(range(2000)), "labels": [-100] * 5 + list(range(1995)), "text": "a cat",
           "pixel_values": torch.zeros(300, 1176)}
    compacted = compact_ids(raw)
    assert isinstance(compacted["input_ids"], np.ndarray)
    assert payload_bytes(raw) == payload_bytes(compacted) == payload_bytes(pack_sample(compacted))
    assert payload_bytes(raw) == 2 * 2000 * 8 + 300 * 1176 * 4
    for ids in (list(np.arange(50)), list(np.arange(50, dtype=np.int32)), [True, False] * 25,
                [np.bool_(True)] * 50, [np.float32(0.5)] * 50):  # numpy numbers and bools: 0 bytes each before
        sample = {"input_ids": list(range(50)), "attention_mask": ids}
        for mark in (False, True):  # ODB's PadCollator takes arrays; any other collator gets lists back
            assert payload_bytes(sample) == payload_bytes(compact_ids(sample, mark=mark)) == 2 * 50 * 8, (ids, mark)


class ListIdsWithPixels(torch.utils.data.Dataset):
    """Ids as Python lists (the loader compacts them into arrays as it reads) beside 1-4 kB of pixel rows: the ids
    are most of a sample's bytes."""

    def __len__(self) -> int:
        return 300

    def __getitem__(self, index: int) -> dict:
        n = 100 + (index * 37) % 400
        return {"input_ids": list(range(n)), "pixel_values": np.ones((1 + index % 4, 256), dtype=np.float32)}


class NumpyIdsWithPixels(ListIdsWithPixels):
    """The same samples with their ids a list of numpy integers (`list(array)`), which the loader compacts as it
    reads; a resume re-reads the list, which `payload_bytes` must weigh as the array (before, 0 bytes a token)."""

    def __getitem__(self, index: int) -> dict:
        sample = super().__getitem__(index)
        return {**sample, "input_ids": list(np.asarray(sample["input_ids"], dtype=np.int64))}


@pytest.mark.parametrize("dataset", [ListIdsWithPixels, NumpyIdsWithPixels])
@pytest.mark.parametrize("planning", ["local", "global"])
def test_a_resume_under_a_binding_byte_bound_yields_the_uninterrupted_batches(planning, dataset):
    """The byte bound stops fills (rounds of ~20 samples where `window` allows 256); a resume re-reads the buffered
    samples by index, as lists, and must stop its replayed fill where the saved run's stopped."""
    options = dict(token_budget=2048, window=256, min_window=None, max_buffer_bytes=20 * 5000,
                   shuffle=True, seed=3, planning=planning)

    def rank_main(rank, transport):
        full = [b.info for b in ODBDataLoader(dataset(), transport=transport, **options)]
        rounds = len({info.round for info in full})
        for stop in (3, len(full) // 2, len(full) - 2):
            loader = ODBDataLoader(dataset(), transport=transport, **options)
            it = iter(loader)
            for _ in range(stop):
                next(it)
            state = json.loads(json.dumps(loader.state_dict()))
            loader.close()
            again = ODBDataLoader(dataset(), transport=transport, **options)
            again.load_state_dict(state)
            assert [b.info for b in again] == full[stop:], (rank, stop)
        return rounds

    assert min(run_virtual_ranks(rank_main, 2, timeout_s=300)) >= 6


@pytest.mark.parametrize("planning", ["local", "global"])
def test_the_exact_schedule_counts_the_steps_of_rounds_cut_by_the_byte_bound(planning):
    """`plan_epochs_exactly` simulates the loader's rounds, the fills the byte bound stops included (before, it
    planned full windows and promised a step count the run did not take)."""
    options = dict(token_budget=2048, window=256, max_buffer_bytes=20 * 5000, shuffle=True, seed=3,
                   planning=planning)

    def rank_main(rank, transport):
        loader = ODBDataLoader(ListIdsWithPixels(), transport=transport, **options)
        planned = loader.plan_epochs_exactly([0]).micro_batches[0]
        taken = sum(1 for _ in loader)
        unbounded = ODBDataLoader(ListIdsWithPixels(), transport=transport, **{**options, "max_buffer_bytes": None})
        without_bound = unbounded.plan_epochs_exactly([0]).micro_batches[0]
        loader.close()
        unbounded.close()
        return planned, taken, without_bound

    for planned, taken, unbounded in run_virtual_ranks(rank_main, 2, timeout_s=300):
        assert planned == taken
        assert unbounded != taken  # the bound changes the plan here: the check can fail


def test_a_state_saved_when_the_last_round_left_min_window_is_refused_not_replayed_differently():
    """Halving the last rounds changed which rounds a map-style epoch plans at its end; a state saved by the odb
    before it (its config has no `round_ends`) cannot be replayed to the same batches, so it is refused, naming why
    and what to do. With `min_window=None` the rounds did not change, and such a state resumes."""
    lengths = [8 + (i * 53) % 200 for i in range(400)]
    data = [{"input_ids": np.arange(n)} for n in lengths]
    for smallest, refused in ((4, True), (None, False)):
        options = dict(token_budget=512, window=128, min_window=smallest, seed=5)
        state, rest = saved_midway(ODBDataLoader(data, **options), 5, "round_ends")
        again = ODBDataLoader(data, **options)
        if refused:
            with pytest.raises(ValueError, match="earlier odb, whose last round of an epoch left `min_window`"):
                again.load_state_dict(state)
        else:
            again.load_state_dict(state)
            assert [b.info for b in again] == rest
