"""A worker's shared-memory files reach its rank as descriptors, one message per chunk (NOTE [ A worker's files
travel as descriptors ] in odb_core/data/worker_files.py; issue 27, item 9's first part).

Through a real loader and its worker processes (fork, spawn, forkserver; persistent workers read over two epochs
with an early break): every sample's tensors come out with the dataset's values, dtype, shape and strides, and
the rank opened each top-level file from a message. On the sockets themselves, in one process: tensors of one
storage share a slot and come back as one storage, a dropped chunk's message is skipped and its files closed,
a message that cannot be sent leaves the chunk to torch's own way, a chunk holds at most `MAX_FILES` slots, and a
missing message is an error naming the worker, not a wait.
"""

from __future__ import annotations

import os
import resource
import socket
from collections import UserDict

import pytest
import torch
from torch.utils.data import Dataset, IterableDataset

from odb_core import ODBDataLoader
from odb_core.data import worker_files
from odb_core.data.worker_files import MAX_FILES, FileInbox, FileSlot, attach, send_files

# a socket call that blocks is a failure of its own here: a minute, not the suite's ten
pytestmark = [pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="no /proc here"), pytest.mark.timeout(60),
              pytest.mark.filterwarnings("ignore:Sparse invariant checks")]  # torch rebuilding the sparse tensor

PIXELS = 300_000  # float32: 1.2 MB, over the pipe's limit


class Images(Dataset):
    """Samples with three tensors over the pipe's limit (a transposed image, a bfloat16 map, an int64 mask), one in
    a list, a Parameter, a sparse tensor, and small ids."""

    def __len__(self) -> int:
        return 48

    def __getitem__(self, index: int) -> dict:
        n = 3 + index % 5
        return {"input_ids": torch.arange(n) + index, "labels": torch.arange(n),
                "pixel_values": image(index).t(), "depth": torch.full((300_000,), index, dtype=torch.bfloat16),
                "mask": torch.arange(80_000) * index, "frames": [image(index + 1)],
                "weight": torch.nn.Parameter(torch.ones(200_000) * index), "sparse": torch.eye(3).to_sparse() * index}


def image(index: int) -> torch.Tensor:
    return (torch.arange(PIXELS, dtype=torch.float32) + index).view(600, 500)


class KeepSamples:
    """A collator that hands the samples on as they are, beside the ids the loader's step needs."""

    def __call__(self, samples: list[dict]) -> dict:
        return {"input_ids": torch.zeros(len(samples), 1, dtype=torch.long), "samples": samples}


def check(sample: dict) -> int:
    index = int(sample["input_ids"][0])  # the ids start at the index
    assert torch.equal(sample["pixel_values"], image(index).t())
    assert sample["pixel_values"].stride() == (1, 500)  # the transposed layout kept
    assert sample["depth"].dtype == torch.bfloat16 and torch.equal(sample["depth"], torch.full((300_000,), index,
                                                                                               dtype=torch.bfloat16))
    assert torch.equal(sample["mask"], torch.arange(80_000) * index)
    assert torch.equal(sample["frames"][0], image(index + 1))
    assert type(sample["weight"]) is torch.nn.Parameter and torch.equal(sample["weight"].detach(),
                                                                         torch.ones(200_000) * index)
    assert torch.equal(sample["sparse"].to_dense(), torch.eye(3) * index)
    return index


class FeatureImages(Images):
    """`Images` as an HF processor returns them, a `UserDict` (`BatchFeature`): nothing is packed for the pipe, so
    the small ids are shared files too."""

    def __getitem__(self, index: int) -> UserDict:
        return UserDict(super().__getitem__(index))


class StreamedImages(IterableDataset):
    """`Images` as a stream: each worker reads all of it and keeps its own chunks."""

    def __iter__(self):
        return (Images()[index] for index in range(48))


@pytest.mark.parametrize(("context", "options", "dataset"), [
    ("fork", {}, Images), ("spawn", {}, Images), ("forkserver", {}, Images),
    ("fork", {"reader_thread": False}, Images),  # read on the main thread
    ("fork", {}, StreamedImages), ("fork", {}, FeatureImages)])
def test_a_workers_tensors_reach_the_rank_from_descriptors_with_their_values_and_layout(context, options, dataset):
    loader = ODBDataLoader(dataset(), token_budget=24, num_workers=2, multiprocessing_context=context,
                           collate_fn=KeepSamples(), idle_sample=Images()[0], worker_regions=False,
                           **options)  # files, the way a tensor takes without a region (or where it fits none)
    samples = [sample for batch in loader for sample in batch["samples"]]
    assert sorted(check(sample) for sample in samples) == list(range(48))
    assert all(type(sample) is (UserDict if dataset is FeatureImages else dict) for sample in samples)
    # pixel_values, depth and mask of every sample (and a UserDict's ids and labels, shared too): the list's image,
    # the Parameter and the sparse tensor go torch's way
    assert loader._stream._watch.inbox.files == (5 if dataset is FeatureImages else 3) * 48
    loader.close()
    assert loader._stream._watch.inbox is None  # the socket pairs are closed with the loader


def test_persistent_workers_left_early_still_hand_over_every_sample_right():
    loader = ODBDataLoader(Images(), token_budget=24, num_workers=2, persistent_workers=True, prefetch_factor=4,
                           fetch_chunk=2, window=8, collate_fn=KeepSamples(), worker_regions=False)
    for batch in loader:  # leaves with chunks read ahead and dropped by the DataLoader
        check(batch["samples"][0])
        break
    seen = [check(sample) for batch in loader for sample in batch["samples"]]
    assert sorted(seen) == list(range(48))
    assert loader._stream._watch.inbox.skipped > 0  # the dropped chunks' messages were met, and skipped
    loader.close()


@pytest.fixture
def inbox(monkeypatch):
    """A worker's sender and the rank's inbox in this one process: the sockets are real, only the two ends live
    in the same process."""
    box = FileInbox(1)
    monkeypatch.setattr(worker_files, "_SENDER", None)
    attach(box.ends[0], 0)
    yield box
    box.close()


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_tensors_of_one_storage_share_a_slot_and_come_back_as_one_storage(inbox):
    base = torch.arange(100, dtype=torch.float64).share_memory_()
    chunk = [(7, {"a": base[:50], "b": base[50:].view(5, 10), "c": torch.ones(3).share_memory_(), "n": 3}),
             (8, "not a mapping")]
    sent = send_files(chunk)
    assert chunk[0][1]["a"] is not None and type(chunk[0][1]["a"]) is torch.Tensor  # the worker's own is kept
    slots = sent[0][1]
    assert slots["a"].slot == slots["b"].slot == 0 and slots["c"].slot == 1 and slots["n"] == 3
    assert sent[1] == (8, "not a mapping")
    got = dict(inbox.opened(sent))
    assert torch.equal(got[7]["a"], base[:50]) and torch.equal(got[7]["b"], base[50:].view(5, 10))
    assert got[7]["a"].untyped_storage().data_ptr() == got[7]["b"].untyped_storage().data_ptr()
    assert inbox.files == 2


def test_a_dropped_chunks_message_is_skipped_and_its_files_closed(inbox):
    before = open_fds()
    dropped = send_files([(0, {"x": torch.ones(10).share_memory_()})])
    kept = send_files([(1, {"x": torch.full((10,), 2.0).share_memory_()})])
    assert dropped[0][1]["x"].message == 0 and kept[0][1]["x"].message == 1
    got = inbox.opened(kept)
    assert torch.equal(got[0][1]["x"], torch.full((10,), 2.0))
    del got
    assert open_fds() == before  # the dropped message's descriptor and the kept one's were closed


def test_a_closed_inbox_leaves_later_chunks_to_torch_though_a_forked_worker_holds_its_end(inbox):
    own_end = socket.socket(fileno=os.dup(inbox.ends[0].fileno()))  # the worker's own copy of its end
    copy_of_rank_end = os.dup(inbox._mine[0].fileno())  # what a worker forked from the rank also holds
    attach(own_end, 0)
    try:
        send_files([(0, {"x": torch.ones(10).share_memory_()})])  # queued: the close lets its file go
        inbox.close()  # the send fails at once, it does not wait
        with socket.socket(fileno=os.dup(copy_of_rank_end)) as probe, pytest.raises(BlockingIOError):
            probe.recvmsg(8, 64, socket.MSG_DONTWAIT)  # the queued message was drained
        chunk = [(0, {"x": torch.ones(10).share_memory_()})]
        assert send_files(chunk) is chunk
        assert worker_files._SENDER.number == 1  # no message was sent, so the next one keeps its number
    finally:
        own_end.close()
        os.close(copy_of_rank_end)


def test_a_rank_out_of_open_files_gets_an_error_naming_the_limit(inbox):
    send_files([(0, {f"x{k}": torch.ones(4).share_memory_() for k in range(6)})])
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    taken = {int(f) for f in os.listdir("/proc/self/fd")}
    free = [fd for fd in range(len(taken) + 3) if fd not in taken]
    resource.setrlimit(resource.RLIMIT_NOFILE, (free[1] + 1, hard))  # room for 3 of the 6 (listdir's was freed)
    try:
        with pytest.raises(OSError, match="too many files open. Raise `ulimit -n`"):
            inbox._receive(0, 0, [])
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_chunk_carries_at_most_max_files_slots(inbox):
    chunk = [(k, {"x": torch.full((4,), float(k)).share_memory_()}) for k in range(MAX_FILES + 5)]
    sent = send_files(chunk)
    assert all(type(s["x"]) is FileSlot for _, s in sent[:MAX_FILES])
    assert all(s["x"] is chunk[k][1]["x"] for k, (_, s) in enumerate(sent) if k >= MAX_FILES)
    got = inbox.opened(sent)
    assert all(torch.equal(s["x"], torch.full((4,), float(k))) for k, s in got)


def test_a_reader_left_behind_never_takes_a_message_the_current_reader_needs(inbox):
    """A reader thread left at an epoch's end may ask for a message the next epoch's reader already passed: it
    must fail alone, leaving the newer message queued."""
    old = send_files([(0, {"x": torch.ones(10).share_memory_()})])
    current = send_files([(1, {"x": torch.full((10,), 2.0).share_memory_()})])
    newer = send_files([(2, {"x": torch.full((10,), 3.0).share_memory_()})])
    assert torch.equal(inbox.opened(current)[0][1]["x"], torch.full((10,), 2.0))  # message 0 skipped on the way
    with pytest.raises(RuntimeError, match="sent shared-memory files in message 2 where the rank expected message 0"):
        inbox.opened(old)  # the reader left behind
    assert torch.equal(inbox.opened(newer)[0][1]["x"], torch.full((10,), 3.0))


def test_a_missing_message_is_an_error_naming_the_worker_not_a_wait(inbox):
    slot = FileSlot(3, 0, 0, 40, "torch.float32", (10,), (1,), 0)
    with pytest.raises(RuntimeError, match="worker 0's chunk names its shared-memory files' message 3"):
        inbox.opened([(0, {"x": slot})])
    first = send_files([(0, {"x": torch.ones(10).share_memory_()})])
    send_files([(1, {"x": torch.ones(10).share_memory_()})])
    inbox.opened(first)  # message 0
    with pytest.raises(RuntimeError, match="sent shared-memory files in message 1 where the rank expected message 0"):
        inbox.opened(first)  # message 0 again: the socket holds message 1


def test_a_full_send_buffer_leaves_the_chunk_to_torch_instead_of_waiting(inbox):
    """The rank reads a worker's messages only as it reads its chunks: a worker whose messages pile up (chunks the
    DataLoader dropped) must go on, not block in the send."""
    chunks = ([(0, {"x": torch.ones(2).share_memory_()})] for _ in range(100_000))
    fallback = next((chunk for chunk in chunks if send_files(chunk) is chunk), None)
    assert fallback is not None and type(fallback[0][1]["x"]) is torch.Tensor
    sent = worker_files._SENDER.number
    assert 0 < sent < 100_000
    fds: list[int] = []
    inbox._receive(0, sent - 1, fds)  # the last message sent is read: nothing was half sent
    assert len(fds) == 1 and inbox.skipped == sent - 1
    os.close(fds[0])


@pytest.mark.parametrize("way", ["torch", "descriptors", "region"])
def test_the_benchmark_times_both_ways_with_every_tensor_arriving_right(way):
    """`python -m benchmarks.worker_files` compares the three ways: each must deliver every tensor with its values
    (the run asserts it) and report positive per-tensor figures."""
    from benchmarks.worker_files import run

    figures = run(way, tensors=40, numel=1 << 16, per_chunk=8, hold=2)
    assert set(figures) == {"rank_cpu_ms", "worker_cpu_ms", "wall_ms"}
    assert all(value > 0 for value in figures.values())


def test_a_worker_warns_once_when_its_files_go_the_slower_way_and_not_when_its_rank_left(inbox, odb_log):
    slower = "sends a chunk's shared-memory files the slower way"
    while send_files(chunk := [(0, {"x": torch.ones(2).share_memory_()})]) is not chunk:
        pass  # until the send buffer is full
    for _ in range(3):
        send_files([(0, {"x": torch.ones(2).share_memory_()})])
    assert [r.getMessage() for r in odb_log.caplog.records if slower in r.getMessage()] == [
        f"ODB: DataLoader worker 0 {slower}, one connection per file ([Errno 11] Resource temporarily unavailable); "
        "later chunks may too (NOTE [ A worker's files travel as descriptors ] in odb_core/data/worker_files.py)"]
    odb_log.caplog.clear()
    with socket.socket(fileno=os.dup(inbox.ends[0].fileno())) as own_end:  # the worker's own copy of its end
        attach(own_end, 0)
        inbox.close()  # the rank left: its end is gone
        for _ in range(2):  # refused, then not connected
            chunk = [(0, {"x": torch.ones(2).share_memory_()})]
            assert send_files(chunk) is chunk
    assert not [r for r in odb_log.caplog.records if slower in r.getMessage()]
