"""NOTE [ A chunk the feeder cannot send ] (odb_core/data/feeder.py): a result that a DataLoader worker's queue
feeder fails to pickle is sent again with the failing sample named, or as an error, instead of being dropped while
the rank waits for it forever.

Real loaders with forked workers (and, for the hook alone, a real queue in this process); the failure is a field
that pickles in the worker's main thread (so the probe of NOTE [ Samples that cannot travel ] passes it) and fails
in the feeder thread on the attempts each case picks. The loaders get `worker_timeout_s=30`, so that a result lost
again fails a test in 30 s, not at pytest's timeout. The cases where /dev/shm runs out in the feeder (a sparse
tensor, one 5 levels down) are in tests/test_shared_memory.py."""

from __future__ import annotations

import multiprocessing
import multiprocessing.queues
import sys
import threading
import time

import pytest
import torch

from odb_core import ODBDataLoader
from odb_core.data.feeder import WorkerChunk, guard_feeder
from odb_core.data.sendable import Unsendable
from odb_core.planning.budget import SampleError

N_SAMPLES = 32
PICKY = 5  # the sample that carries the field


def _zero() -> int:
    return 0


class FeederOnly:
    """Pickles on the worker's main thread; in any other thread (the queue's feeder) its attempts are counted and
    those `fails` picks raise, once the worker has put its next result (or after 5 s)."""

    def __init__(self, fails: str) -> None:
        self.fails, self.attempts = fails, 0

    def __reduce__(self):
        if threading.current_thread() is not threading.main_thread():
            self.attempts += 1
            if {"always": True, "first": self.attempts == 1, "odd": self.attempts % 2 == 1}[self.fails]:
                _until_more_is_put()
                raise RuntimeError(f"refused on attempt {self.attempts}")
        return _zero, ()


def _until_more_is_put(most_s: float = 5.0) -> None:
    """In the queue's feeder thread, while it pickles a result: wait until the worker's main thread has put the
    next one (an iterable dataset's worker, its end marker), found in the feeder's own frame (`_feed`'s `buffer`),
    for at most `most_s` (a worker with nothing more to put)."""
    frame = sys._getframe()
    while frame is not None and frame.f_code.co_name != "_feed":
        frame = frame.f_back
    deadline = time.monotonic() + most_s
    while frame is not None and not frame.f_locals["buffer"] and time.monotonic() < deadline:
        time.sleep(0.01)


def _sample(i: int, fails: str, picky: int = PICKY) -> dict:
    sample = {"input_ids": torch.arange(4 + i % 5) + 3}
    if i == picky:
        sample["extra"] = FeederOnly(fails.split(",")[0])
    if fails == "odd, beside" and i == PICKY - 1:  # the worker's own probe names it (a lambda cannot be pickled)
        sample["extra"] = lambda: None
    return sample


class Samples(torch.utils.data.Dataset):
    def __init__(self, fails: str) -> None:
        self.fails = fails

    def __len__(self) -> int:
        return N_SAMPLES

    def __getitem__(self, i: int) -> dict:
        return _sample(i, self.fails)


class Stream(torch.utils.data.IterableDataset):
    """Its last sample carries the field: a worker puts its end marker right after that chunk."""

    def __init__(self, fails: str) -> None:
        self.fails = fails

    def __iter__(self):
        return (_sample(i, self.fails, picky=N_SAMPLES - 1) for i in range(N_SAMPLES))


def _ids_only(samples: list[dict]) -> dict:
    return {"input_ids": torch.nn.utils.rnn.pad_sequence([s["input_ids"] for s in samples], batch_first=True)}


def _read(fails: str, dataset: type = Samples, context: str = "fork") -> list[int]:
    loader = ODBDataLoader(dataset(fails), token_budget=64, window=N_SAMPLES, num_workers=2, max_batch_size=8,
                           collate_fn=_ids_only, worker_timeout_s=30, multiprocessing_context=context)
    return sorted(i for batch in loader for i in batch.info.indices)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("context", ["fork", "spawn", "forkserver"])
def test_a_field_the_feeder_cannot_pickle_is_an_error_naming_the_sample_and_field(context):
    """Under every start method the hook is in place before the worker's first result (a spawned worker's queue
    starts its feeder thread at its first `put`, after `Lifeline`)."""
    with pytest.raises(SampleError) as caught:
        _read("always", context=context)
    error = str(caught.value)
    assert caught.value.index == PICKY, error
    assert error.startswith(f"sample {PICKY}: field 'extra' could not be pickled to leave its DataLoader worker "
                            "(RuntimeError: refused on attempt "), error
    assert "/dev/shm" not in error, error  # it did not run out of shared memory


@pytest.mark.timeout(120)
def test_a_chunk_that_fails_once_is_sent_again_and_every_sample_arrives_once():
    assert _read("first") == list(range(N_SAMPLES))


@pytest.mark.timeout(120)
def test_a_chunk_that_fails_again_although_each_sample_pickles_alone_is_an_error_naming_its_samples():
    with pytest.raises(SampleError) as caught:
        _read("odd")
    error = str(caught.value)
    assert "could not be sent to the rank twice (RuntimeError: refused on attempt 3), although each sample pickles " \
           "alone" in error, error
    listed = error.split("the chunk of samples ")[1].split("]")[0] + "]"
    assert PICKY in eval(listed) and caught.value.index in eval(listed), error  # noqa: S307 - a list of ints


@pytest.mark.timeout(120)
def test_a_chunk_the_workers_probe_named_a_sample_of_is_not_sent_again_for_ever():
    """The chunk holds an `Unsendable` from the start; a rule that counted only chunks without one resent it, and
    failed, at every other attempt for ever."""
    with pytest.raises(SampleError) as caught:
        _read("odd, beside")
    assert "could not be sent to the rank twice (RuntimeError: refused on attempt 3)" in str(caught.value)


@pytest.mark.timeout(120)
def test_an_iterable_datasets_last_chunk_sent_again_arrives_before_its_workers_end():
    """Sent again at the back of the queue, the chunk came after the worker's end marker, and the DataLoader had
    forgotten its task: its 8 samples were lost, with no error."""
    assert _read("first", Stream) == list(range(N_SAMPLES))


def test_the_hook_rewrites_only_odbs_chunks_and_puts_them_back_in_their_place():
    """The hook alone, on a real queue in this process (its feeder is not the main thread): a chunk is put back
    ahead of what followed it, with its failing sample named; a result that is not ODB's chunk (a queue of the
    user's) is dropped with the standard hook's traceback, as before, and what follows it still arrives."""
    hook = multiprocessing.queues.Queue.__dict__["_on_queue_feeder_error"]  # the staticmethod itself, to restore
    guard_feeder()
    try:
        queue = multiprocessing.get_context("fork").Queue()
        queue.put((0, WorkerChunk([(7, {"extra": FeederOnly("always")}), (8, {"x": 1})])))
        queue.put((1, WorkerChunk([(9, {"x": 2})])))
        queue.put((2, [(10, {"extra": FeederOnly("always")})]))  # not a WorkerChunk
        queue.put("after")
        got = [queue.get(timeout=30) for _ in range(3)]
        queue.close()
        queue.join_thread()
    finally:
        multiprocessing.queues.Queue._on_queue_feeder_error = hook
    (task, chunk), second, last = got
    assert task == 0 and [index for index, _ in chunk] == [7, 8] and chunk[1][1] == {"x": 1}
    assert type(chunk[0][1]) is Unsendable and type(chunk) is list
    # attempts: 1 the chunk, 2 the sample alone, 3 its field
    assert chunk[0][1].cause.startswith("field 'extra' could not be pickled to leave its DataLoader worker "
                                        "(RuntimeError: refused on attempt 3)")
    assert second == (1, [(9, {"x": 2})]) and last == "after"
