"""The next round's samples are read while the current round's steps are taken (NOTE [ Reading ahead ] in
odb_core/epoch/reader.py), without changing any batch.

With `num_workers=0` the DataLoader reads a sample when it is pulled, so the count of `__getitem__` calls seen at
each step shows when the reader pulled. Before, a round read nothing while its steps were taken: every step of the
first round was yielded with exactly one buffer of samples read.
"""

from __future__ import annotations

import time

import pytest
import torch

from batch_record import LengthStream
from conftest import CountingDataset, LengthDataset
from odb_core import DatasetFetchError, ODBConfig, ODBDataLoader
from odb_core.epoch.reader import Pull, ReadAhead, SampleReader
from odb_core.planning.planner import BufferEngine

WINDOW = 64


def test_the_next_round_is_read_while_the_current_rounds_steps_are_taken():
    dataset = CountingDataset([16 + (i * 37) % 240 for i in range(600)])
    loader = ODBDataLoader(dataset, token_budget=1024, window=WINDOW, fetch_chunk=4)
    reads_at = [(batch.info.round, dataset.reads) for batch in loader]
    first_round = [reads for round_, reads in reads_at if round_ == 0]
    assert len(first_round) > 2
    assert first_round[0] == WINDOW  # the first fill reads one buffer, and the first step is yielded then
    assert first_round[-1] > WINDOW  # by the round's last step the next round's samples are being read
    # (in process a chunk is 64 samples, one window, so the share per step is checked on `ReadAhead` itself:
    # test_each_step_waits_for_its_share_of_the_next_fill_and_takes_held_chunks_up_to_the_window)
    assert dataset.reads == len(dataset)  # each sample read once


def test_reading_ahead_reads_no_more_than_the_next_fill_admits():
    dataset = CountingDataset([16 + (i * 37) % 240 for i in range(600)])
    loader = ODBDataLoader(dataset, token_budget=1024, window=WINDOW, fetch_chunk=1)
    it = iter(loader)
    rounds: dict[int, int] = {}
    for batch in it:
        rounds[batch.info.round] = dataset.reads
        if batch.info.round == 3:
            break
    # at most one buffer plus the next fill's samples have been read by a round's end (in process, chunks of 64)
    for round_, reads in rounds.items():
        assert reads <= WINDOW * (round_ + 2), (round_, reads)


class TimedStream:
    """A chunk source with a reader thread's `ready()`: `ready_chunks` chunks are held at once, the rest come
    only from a blocking `next()`; every pull is logged (`pulls`: ("next" | "ready", chunk number))."""

    def __init__(self, chunks: int, size: int, ready_chunks: int) -> None:
        self.chunks = [[(c * size + i, {"input_ids": torch.arange(8)}) for i in range(size)] for c in range(chunks)]
        self.held, self.pulls = ready_chunks, []

    def __iter__(self):
        return self

    def __next__(self):
        if not self.chunks:
            raise StopIteration
        self.pulls.append(("next", len(self.pulls)))
        return self.chunks.pop(0)

    def ready(self):
        if self.held == 0:
            return None
        if not self.chunks:
            raise StopIteration
        self.held -= 1
        self.pulls.append(("ready", len(self.pulls)))
        return self.chunks.pop(0)


def _reader(source: TimedStream) -> SampleReader:
    return SampleReader(source, None, lambda: {"input_ids": torch.arange(1)}, packed=False, stream_length=None)


def test_reading_ahead_waits_for_the_next_fills_share_then_takes_only_what_the_reader_thread_holds():
    source = TimedStream(chunks=10, size=4, ready_chunks=3)
    reader = _reader(source)
    reader.read_ahead(Pull(samples=8, bytes=None, cap=100, cap_bytes=None))
    # two chunks waited for (the share), then the three held ones taken without waiting; the rest are left
    assert [kind for kind, _ in source.pulls] == ["next", "next", "ready", "ready", "ready"]
    assert len(reader.pending) == 20 and reader.pending_bytes == 20 * 8 * 8
    assert [index for index, _ in reader.pending] == list(range(20))  # stream order kept


def test_taking_held_chunks_stops_at_the_cap_in_samples_and_in_bytes():
    source = TimedStream(chunks=10, size=4, ready_chunks=10)
    reader = _reader(source)
    reader.read_ahead(Pull(samples=0, bytes=None, cap=10, cap_bytes=None))
    assert len(reader.pending) == 12  # the chunk that reaches the cap is the last one taken
    source = TimedStream(chunks=10, size=4, ready_chunks=10)
    reader = _reader(source)
    reader.read_ahead(Pull(samples=0, bytes=None, cap=100, cap_bytes=3 * 4 * 64))
    assert len(reader.pending) == 12 and reader.pending_bytes == 3 * 4 * 64
    source = TimedStream(chunks=2, size=4, ready_chunks=5)
    reader = _reader(source)
    reader.read_ahead(Pull(samples=0, bytes=None, cap=100, cap_bytes=None))
    assert len(reader.pending) == 8 and reader.stream_ended  # the end, seen through ready(), ends the stream


@pytest.mark.timeout(120)
@pytest.mark.parametrize("iterable", [False, True])
def test_the_reader_thread_and_taking_what_it_holds_change_no_batch(iterable):
    """Reading in a thread and taking held chunks past the next fill (NOTE [ Reading ahead ]) and collating the
    next step ahead (NOTE [ Collating the next step ahead ]) depend on thread timing; the batches must not. Rounds
    that grow from 8 and halve toward the end (map-style), with workers read by a thread and directly, against
    reading in the trainer process and collating each step when it is taken."""
    lengths = [8 + (i * 53) % 200 for i in range(900)]
    dataset = LengthStream(LengthDataset(lengths)) if iterable else LengthDataset(lengths)
    options = dict(token_budget=512, window=128, min_window=8, fetch_chunk=2, shuffle=not iterable, seed=3)
    runs = {}
    for name, extra in {"in process": dict(num_workers=0, collate_ahead=False),
                        "thread": dict(num_workers=2, reader_thread=True),
                        "direct": dict(num_workers=2, reader_thread=False)}.items():
        loader = ODBDataLoader(dataset, **options, **extra)
        runs[name] = [(b.info, b["input_ids"].tolist(), b["labels"].tolist()) for b in loader]
        rounds = loader.last_report.rounds
        loader.close()
    assert runs["thread"] == runs["in process"] == runs["direct"]
    assert rounds >= 6
    assert sorted(i for info, _, _ in runs["thread"] for i in info.indices) == list(range(len(lengths)))


def _late_run(dataset, options: dict, step_s: float, save_at: int | None = None, state: dict | None = None):
    """The steps of one epoch (StepInfo and ids), each followed by `step_s` of "training"; with `save_at`, also
    the state saved after that many steps; with `state`, the steps of a fresh loader resumed from it."""
    loader = ODBDataLoader(dataset, **options)
    if state is not None:
        loader.load_state_dict(state)
    steps, saved = [], None
    for batch in loader:
        steps.append((batch.info, batch["input_ids"].tolist()))
        time.sleep(step_s)
        if len(steps) == save_at:
            saved = loader.state_dict()
    loader.close()
    return steps, saved


@pytest.mark.timeout(120)
@pytest.mark.parametrize("iterable", [False, True])
def test_the_end_of_the_stream_is_planned_alike_whenever_its_end_was_read(iterable):
    """NOTE [ Whether a rank's stream has ended ]: a consumer slow enough for the reader thread to hold the
    stream's end when the last rounds read ahead, a fast one, and a run resumed after a step of the last rounds
    (whose replayed round reads nothing ahead) plan the same rounds and batches. Before, the slow run's last fill
    saw the end and the replayed one did not: the resumed run planned an extra round."""
    lengths = [8 + (i * 53) % 200 for i in range(260)]  # a last fill that admits exactly the last samples
    dataset = LengthStream(LengthDataset(lengths)) if iterable else LengthDataset(lengths)
    options = dict(token_budget=512, window=64, min_window=16, fetch_chunk=2, num_workers=1, seed=3,
                   shuffle=not iterable)
    slow, _ = _late_run(dataset, options, step_s=0.01)
    save_at = len(slow) - 3
    fast, state = _late_run(dataset, options, step_s=0.0, save_at=save_at)
    resumed, _ = _late_run(dataset, options, step_s=0.0, state=state)
    assert fast == slow
    assert resumed == slow[save_at:]
    assert sorted(i for info, _ in slow for i in info.indices) == list(range(len(lengths)))


def test_each_step_waits_for_its_share_of_the_next_fill_and_takes_held_chunks_up_to_the_window():
    """NOTE [ Reading ahead ]: a round of 8 steps before a fill of 64 samples and 8,000 bytes waits, at step k, for
    k/8 of each (not all at the first step), and takes held chunks up to the cap and the fill's bytes."""
    ahead = ReadAhead()
    ahead.plan(64, 8000, 8, 256)
    pulls = [ahead.take_step() for _ in range(8)]
    assert [p.samples for p in pulls] == [8 * k for k in range(1, 9)]
    assert [p.bytes for p in pulls] == [1000 * k for k in range(1, 9)]
    assert {(p.cap, p.cap_bytes) for p in pulls} == {(256, 8000)} and not ahead.due


def test_the_next_fill_may_add_the_byte_bound_less_the_bytes_buffered():
    reader = _reader(TimedStream(chunks=1, size=1, ready_chunks=0))
    reader.payloads.put(0, {}, 3000)
    engine = BufferEngine(ODBConfig(token_budget=64, max_buffer_bytes=10_000), epoch=0)
    assert reader.byte_space(engine) == 7000
    assert reader.byte_space(BufferEngine(ODBConfig(token_budget=64, max_buffer_bytes=None), epoch=0)) is None


@pytest.mark.timeout(120)
def test_held_chunks_read_ahead_to_the_streams_end_stay_within_the_window_and_are_all_trained():
    """A consumer slow enough for the reader thread to hold every chunk, the stream's end included: the held
    chunks are taken up to `window` pending samples (not all at once), and a stream whose end was seen while more
    samples wait than the next fill admits stays active until they are all trained (each index once)."""
    lengths = [8 + (i * 53) % 200 for i in range(203)]
    loader = ODBDataLoader(LengthStream(LengthDataset(lengths)), token_budget=512, window=32, min_window=None,
                           fetch_chunk=2, num_workers=2)
    it = iter(loader)
    seen, most = [], 0
    for batch in it:
        seen.extend(batch.info.indices)
        most = max(most, len(it.run.reader.pending))
        time.sleep(0.004)
    loader.close()
    assert sorted(seen) == list(range(len(lengths)))
    assert 16 < most <= 32 + 2, most  # the window, plus the last chunk taken


class _RaisesAt(LengthDataset):
    def __getitem__(self, index: int) -> dict:
        if index == 300:
            raise ValueError("corrupt record 300")
        return super().__getitem__(index)


@pytest.mark.timeout(120)
def test_an_error_in_a_chunk_the_reader_thread_held_is_raised_not_taken_for_the_streams_end():
    loader = ODBDataLoader(_RaisesAt([8 + (i * 53) % 200 for i in range(400)]), token_budget=512, window=64,
                           fetch_chunk=4, num_workers=1)
    with pytest.raises(DatasetFetchError, match="300"):
        for _ in loader:
            time.sleep(0.02)
    loader.close()
