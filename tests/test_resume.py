"""G8 exact resume: a state taken after any step, loaded into a fresh loader, yields the remaining batches."""

from __future__ import annotations

import json
import time

import pytest

from conftest import CountingDataset, LengthDataset, lognormal_lengths
from odb_core import ODBDataLoader
from odb_core.data.sources import DatasetFetchError
from odb_core.resume.fields import digest_of


def _make(dataset, **kw):
    return ODBDataLoader(dataset, token_budget=1024, shuffle=True, window=64, **kw)


def _record(batch):
    i = batch.info
    return (i.epoch, i.step, i.indices, i.is_idle, i.window_tokens, i.global_tokens, tuple(batch["input_ids"].shape))


def _take(loader, it, n, out):
    while len(out) < n:
        try:
            out.append(_record(next(it)))
        except StopIteration:
            it = iter(loader)
    return it


@pytest.mark.parametrize("accumulation_steps,prefetch_steps", [(1, 0), (3, 2)])
def test_resumed_loader_yields_exactly_the_uninterrupted_batches(accumulation_steps, prefetch_steps):
    dataset = LengthDataset(lognormal_lengths(300, 1.0, 128, seed=3, hi=1024))
    options = dict(accumulation_steps=accumulation_steps, prefetch_steps=prefetch_steps)
    reference_loader = _make(dataset, **options)
    reference = [_record(b) for _ in range(2) for b in reference_loader]
    for stop in [0, 1, 7, len(reference) // 2 + 1, len(reference) - 1]:
        loader = _make(dataset, **options)
        got: list = []
        _take(loader, iter(loader), stop, got)
        state = json.loads(json.dumps(loader.state_dict()))  # plain, JSON-serialisable data
        loader.close()
        resumed = _make(dataset, **options)
        resumed.load_state_dict(state)
        _take(resumed, iter(resumed), len(reference), got)
        assert got == reference, f"resume after {stop} steps diverged"


def test_a_state_saved_while_the_background_producer_is_rounds_ahead_resumes_exactly():
    """The producer thread plans and collates up to `prefetch_steps` batches (here several rounds) ahead; the state
    must describe what the trainer consumed, not what the producer read."""
    options = dict(prefetch_steps=24)
    reference_loader = _make(LengthDataset(lognormal_lengths(300, 1.0, 128, seed=4, hi=1024)), **options)
    reference = [_record(b) for b in reference_loader]
    dataset = CountingDataset(lognormal_lengths(300, 1.0, 128, seed=4, hi=1024))
    loader = _make(dataset, **options)
    got: list = []
    running = _take(loader, iter(loader), 3, got)  # held: dropping the iterator would stop its producer
    window = loader.config.window
    consumed = sum(len(r[2]) for r in got)
    deadline = time.monotonic() + 30
    while dataset.reads < consumed + 2 * window and time.monotonic() < deadline:
        time.sleep(0.01)
    assert dataset.reads >= consumed + 2 * window, "the producer never got two windows ahead"
    state = json.loads(json.dumps(loader.state_dict()))
    loader.close()
    del running
    resumed = _make(LengthDataset(dataset.lengths), **options)
    resumed.load_state_dict(state)
    got += [_record(b) for b in resumed]
    assert got == reference


def test_load_state_dict_refuses_a_different_budget():
    dataset = LengthDataset([10] * 20)
    state = _make(dataset).state_dict()
    other = ODBDataLoader(dataset, token_budget=2048)
    with pytest.raises(ValueError, match="token_budget"):
        other.load_state_dict(state)


def test_load_state_dict_rejects_unknown_keys():
    dataset = LengthDataset([10] * 20)
    state = {**_make(dataset).state_dict(), "surprise": 1}
    with pytest.raises(ValueError, match="digest does not match"):  # an edit after the save
        _make(dataset).load_state_dict(state)
    state["digest"] = digest_of(state)  # a writer that signs what it adds still gets the key named
    with pytest.raises(ValueError, match="surprise"):
        _make(dataset).load_state_dict(state)


def test_estimate_steps_is_exact_when_the_sample_covers_the_epoch():
    dataset = LengthDataset(lognormal_lengths(500, 1.0, 128, seed=5, hi=1024))
    loader = _make(dataset, accumulation_steps=2)
    estimate = loader.estimate_steps(sample_size=10_000)
    assert len(loader) == estimate == sum(1 for _ in loader)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_reading_another_epoch_s_order_between_iter_and_the_first_step_leaves_the_open_epoch_s_order(num_workers):
    """`estimate_steps` (and `plan_epochs_exactly`, a state's shard check) sets the sampler's epoch to read that
    epoch's order; the open epoch's order was drawn at its first chunk, so an estimate between `iter()` and the
    first step gave epoch 0 epoch 1's order under epoch 0's labels (G7)."""
    dataset = LengthDataset(lognormal_lengths(60, 1.0, 64, seed=1, hi=250))

    def epoch_steps(estimate_between: bool, epoch: int = 0) -> list[tuple[int, ...]]:
        loader = ODBDataLoader(dataset, token_budget=512, window=16, shuffle=True, num_workers=num_workers)
        loader.set_epoch(epoch)
        try:
            running = iter(loader)
            if estimate_between:
                loader.estimate_steps(sample_size=16)  # the next epoch's: 1
            return [tuple(batch.info.indices) for batch in running]
        finally:
            loader.close()

    plain = epoch_steps(False)
    assert epoch_steps(True) == plain != epoch_steps(False, epoch=1)


def test_an_estimate_for_the_trainer_is_the_same_after_a_resume_in_a_later_epoch():
    """The HF adapter's estimated schedule (`exact_schedule=False`) came from the resumed epoch's sample, so a
    resumed run planned another total and bound than the run it continued: the LR jumped at the resume."""
    from odb_core.epoch.epoch_length import plan_epoch_length

    dataset = LengthDataset(lognormal_lengths(300, 1.0, 64, seed=3, hi=250))
    options = dict(token_budget=256, window=32, shuffle=True)
    plan = dict(max_steps=0, num_train_epochs=3, slack=0.25, sample_size=64, exact=False)
    fresh = ODBDataLoader(dataset, **options)
    first = plan_epoch_length(fresh, **plan)
    fresh.set_epoch(1)
    running = iter(fresh)
    for _ in range(5):
        next(running)
    state = json.loads(json.dumps(fresh.state_dict()))
    fresh.close()
    resumed = ODBDataLoader(dataset, **options)
    resumed.load_state_dict(state)
    assert resumed.epoch == 1 and plan_epoch_length(resumed, **plan) == first
    resumed.close()


@pytest.mark.parametrize("num_workers,prefetch_steps,taken", [(0, 0, 5), (2, 0, 5), (0, 2, 5), (0, 2, 0)])
def test_a_loader_closed_inside_an_epoch_keeps_where_its_consumer_stood(num_workers, prefetch_steps, taken):
    """`close()` before an epoch's end (a preemption handler, a `finally:`), then `state_dict()`: the state is the
    one before the close, where the consumer stood (a producer thread's rounds ahead, its metrics included, are
    not in it), and resumes the rest of that epoch. Before, it pointed at the next epoch, whose steps the resumed
    run took instead, and the closed epoch's rest was never trained. Moving the loader on forgets it."""
    dataset = LengthDataset(lognormal_lengths(300, 1.0, 128, seed=3, hi=1024))
    reference = [_record(b) for b in _make(dataset)]
    loader = _make(dataset, num_workers=num_workers, prefetch_steps=prefetch_steps)
    it = iter(loader)
    got = [_record(next(it)) for _ in range(taken)]
    saved = json.loads(json.dumps(loader.state_dict()))
    if prefetch_steps:
        time.sleep(0.3)  # the producer runs ahead of the consumer
    loader.close()
    assert json.loads(json.dumps(loader.state_dict())) == saved
    resumed = _make(dataset)
    resumed.load_state_dict(saved)
    assert got + [_record(b) for b in resumed] == reference
    loader.set_epoch(3)
    assert (loader.state_dict()["epoch"], loader.state_dict()["position"]) == (3, None)


def test_a_closed_loaders_state_survives_an_iter_that_fails_and_a_set_epoch_that_moves_nothing(monkeypatch):
    dataset = LengthDataset(lognormal_lengths(300, 1.0, 128, seed=3, hi=1024))
    loader = _make(dataset)
    it = iter(loader)
    for _ in range(4):
        next(it)
    saved = json.loads(json.dumps(loader.state_dict()))
    loader.close()
    loader.set_epoch(loader.epoch)  # the top of a loop that selects its epoch: nothing moves
    assert json.loads(json.dumps(loader.state_dict())) == saved

    def broken(*args, **kwargs):
        raise OSError("the dataset's storage is gone")

    monkeypatch.setattr(loader._stream, "open", broken)
    with pytest.raises(OSError, match="storage is gone"):
        iter(loader)
    assert json.loads(json.dumps(loader.state_dict())) == saved


def test_a_loader_closed_while_an_error_propagates_keeps_its_position_too():
    dataset = LengthDataset(lognormal_lengths(300, 1.0, 128, seed=3, hi=1024))
    reference = [_record(b) for b in _make(dataset)]
    loader = _make(dataset)
    it = iter(loader)
    got = [_record(next(it)) for _ in range(3)]
    with pytest.raises(ZeroDivisionError):
        try:
            1 / 0  # the training step fails
        finally:
            loader.close()
    resumed = _make(dataset)
    resumed.load_state_dict(json.loads(json.dumps(loader.state_dict())))
    assert got + [_record(b) for b in resumed] == reference


class _FailsOnce(LengthDataset):
    """`dataset[index]` raises once for `failing` (a transient read error), then reads as before."""

    failing: int | None = None

    def __getitem__(self, index):
        if index == self.failing:
            self.failing = None
            raise OSError(f"transient read error on record {index}")
        return super().__getitem__(index)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_resume_whose_re_read_fails_names_the_sample_and_keeps_the_position(num_workers):
    """`iter()` on a loaded state re-reads the saved round's samples by index; a read that fails (a transient I/O
    error) is a `DatasetFetchError` naming the sample, and the loaded position stays the one to run: before, the
    dataset's bare error came out and the cursor had moved on, so a retry or a save skipped the rest of the epoch."""
    dataset = _FailsOnce(lognormal_lengths(300, 1.0, 128, seed=3, hi=1024))
    reference = [_record(b) for b in _make(dataset)]
    loader = _make(dataset)
    it = iter(loader)
    got = [_record(next(it))]
    while not loader.state_dict()["position"]["start"]["buffer"]:  # a round that carries samples into the next
        got.append(_record(next(it)))
    state = json.loads(json.dumps(loader.state_dict()))
    loader.close()
    resumed = _make(dataset, num_workers=num_workers)
    resumed.load_state_dict(state)
    dataset.failing = bad = state["position"]["start"]["buffer"][0]
    with pytest.raises(DatasetFetchError, match=f"sample {bad}: re-read by index to resume its round, .*OSError"):
        iter(resumed)
    assert json.loads(json.dumps(resumed.state_dict())) == state  # the loaded position is still the one to run
    assert got + [_record(b) for b in resumed] == reference  # the retry resumes it exactly


def test_a_cut_state_file_is_a_state_error_naming_it_and_a_saved_one_loads(tmp_path):
    """`save_loader_state` syncs the file before its rename (and the folder after); a file cut anyway (an empty one
    after a crash, a partial copy) was a bare JSONDecodeError naming neither the file nor what to do."""
    from odb_core.resume.checkpoints import load_loader_state, loader_state_path, save_loader_state
    from odb_core.resume.fields import StateError

    dataset = LengthDataset([16] * 40)
    loader = ODBDataLoader(dataset, token_budget=64)
    running = iter(loader)
    next(running)
    path = save_loader_state(loader, tmp_path, rank=0)
    expected = [batch.info.indices for batch in running]
    loader.close()
    again = ODBDataLoader(dataset, token_budget=64)
    load_loader_state(again, tmp_path, 0, missing="-")
    assert [batch.info.indices for batch in again] == expected
    again.close()
    whole = open(path).read()
    for cut in ("", whole[: len(whole) // 2]):
        with open(loader_state_path(tmp_path, 0), "w") as handle:
            handle.write(cut)
        with pytest.raises(StateError, match=rf"{path} is not a whole loader state .*resume from an earlier"):
            load_loader_state(ODBDataLoader(dataset, token_budget=64), tmp_path, 0, missing="-")
