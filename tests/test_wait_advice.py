"""NOTE [ Which lever ]: an epoch's waits for data and the advice they give: a gentler ramp where the workers read
faster than the device trains and it still waited for reading, more workers where they read slower, the slowest
rank where the waits were in the exchanges. The rules on made-up figures, then real loaders with real workers."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from odb_core import ODBDataLoader
from odb_core.epoch import wait_advice
from odb_core.epoch.reader import Pull, SampleReader
from odb_core.epoch.wait_advice import Advisor, EpochWaits, Levers, ReadClock, advise, rounds_config
from odb_core.planning.nodes import NodeLayout
from odb_core.settings.config import ODBConfig
from odb_core.steps.metrics import LoaderMetrics

pytestmark = pytest.mark.timeout(120)


def test_the_rounds_run_with_a_pooled_plans_window_and_a_rank_local_plan_with_its_own():
    config = ODBConfig(token_budget=16384)
    pooled = rounds_config(config, NodeLayout(world=8, per_node=8))  # 8 pooled ranks: window 1024 from 64
    assert (pooled.window, pooled.min_window) == (1024, 64)
    assert rounds_config(config, NodeLayout(world=16, per_node=8)).window == 1024  # node-aware: a node's 8 pool
    assert rounds_config(config, NodeLayout(world=2, per_node=2)) is config  # 2 x 4096 within pool_window
    local = ODBConfig(token_budget=16384, planning="local")
    assert rounds_config(local, NodeLayout(world=8, per_node=8)) is local


def test_a_read_clock_times_the_stream_from_its_first_chunk_to_its_last_or_to_the_first_hold(monkeypatch):
    clock = iter([10.0, 10.5, 11.0, 12.0, 13.0])
    monkeypatch.setattr(wait_advice, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    reads = ReadClock()
    assert reads.rate() is None
    reads.took(8)  # its samples were read before the clock started: they do not count
    reads.took(32)
    assert reads.rate() is None  # 32 samples: under MIN_SAMPLES
    reads.took(40)
    reads.pulled(looks_ahead=True, ahead=False)
    assert reads.rate() == 72 / 1.0 and reads.samples == 80
    reads.pulled(looks_ahead=True, ahead=True)  # the read-ahead stopped at its cap: the consumer paces it now
    reads.took(100)
    assert reads.rate() == 72 / 1.0 and reads.samples == 80
    reads.pulled(looks_ahead=False, ahead=False)  # no reader thread ahead: the consumer pulled only what it needed
    assert reads.rate() is None


def _waits(wall: float, wait: float, samples: int, read_rate: float, *, reading: float,
           exchange: float = 0.0) -> EpochWaits:
    """An epoch's account (`wall`, `wait` seconds after the first step, `samples` trained) whose stream read
    `read_rate` samples/s and whose loader spent `reading` and `exchange` seconds since the first step."""
    metrics = LoaderMetrics(token_budget=16384, world_size=2)
    metrics.read_seconds, metrics.sync_seconds = 1.0 + reading, 2.0 + exchange
    reads = ReadClock(first_s=0.0, last_s=10.0, first_samples=0, samples=int(read_rate * 10))
    return EpochWaits(reads, metrics, read_s=1.0, sync_s=2.0, read_end_s=1.0 + reading, sync_end_s=2.0 + exchange,
                      wall_s=wall, wait_s=wait, samples=samples, started=True)


def test_each_step_counts_its_interval_wait_and_samples_and_the_parts_from_the_first_step_on():
    metrics = LoaderMetrics(token_budget=16384, world_size=1)
    waits = EpochWaits(ReadClock(), metrics, last_s=0.0)
    metrics.read_seconds = 4.0  # the first round's fill and the workers' start: left out with the first step
    for samples, asked, now in [(4, 0.0, 5.0), (6, 5.5, 6.0), (8, 7.0, 7.5)]:
        waits.took(samples, asked, now)
    metrics.read_seconds += 1.0
    waits.took(0, 8.0, 8.25)  # an IDLE step: its 0.5 s outside next() trained no sample
    metrics.read_seconds += 3.0  # the StopIteration next(): after the last step handed over, not in the waits
    assert (waits.wall_s, waits.wait_s, waits.samples) == (3.25, 1.25, 14)  # not the first step's 5 s and 4
    assert waits.share() == pytest.approx(1.25 / 3.25) and waits.device_rate() == pytest.approx(14 / 1.5)
    assert waits.parts() == (1.0, 0.0)
    waits.read_end_s, waits.sync_end_s = 4.0 + 2.0, 0.5  # 2.5 s of parts against a wait of 1.25 s
    assert waits.parts() == pytest.approx((1.0, 0.25))  # a producer thread's: scaled down to the wait
    assert EpochWaits(ReadClock(), metrics).device_rate() is None


LEVERS = Levers(ODBConfig(token_budget=16384), window=4096)


def test_workers_faster_than_the_device_but_slower_than_the_ramp_point_to_the_gentler_ramp():
    waits = _waits(wall=10.0, wait=3.0, samples=700, read_rate=150.0, reading=2.8)  # device 100/s, workers 150
    advice = advise(waits, LEVERS, 3)
    assert list(advice) == ["ramp"]
    assert "epoch 3" in advice["ramp"] and "30%" in advice["ramp"] and "round_growth=1.25" in advice["ramp"]
    assert "read 150 samples/s, it trained 100" in advice["ramp"] and "round_growth=2 times" in advice["ramp"]
    for flat in (ODBConfig(token_budget=16384, round_growth=1.25), ODBConfig(token_budget=16384, min_window=None),
                 ODBConfig(token_budget=16384, window=256)):  # already gentle, or no ramp: nothing to say
        assert advise(waits, Levers(flat, window=flat.window), 3) == {}
    fast = _waits(wall=10.0, wait=3.0, samples=700, read_rate=210.0, reading=2.8)  # over 2x: not the ramp's
    assert advise(fast, LEVERS, 3) == {}


def test_workers_slower_than_the_device_are_named_with_the_window_lever():
    advice = advise(_waits(wall=10.0, wait=2.5, samples=750, read_rate=80.0, reading=2.5), LEVERS, 3)
    assert list(advice) == ["workers"]
    assert "25%" in advice["workers"] and "read 80 samples/s, it trained 100" in advice["workers"]
    assert "num_workers" in advice["workers"] and "window (now 4096)" in advice["workers"]
    assert "or round_growth=1.25 makes the rounds at the epoch's start and end smaller" in advice["workers"]  # 0.8
    at_the_edge = advise(_waits(10.0, 2.5, 750, read_rate=65.0, reading=2.5), LEVERS, 3)["workers"]  # 0.65 of 100/s
    assert "round_growth=1.25" in at_the_edge
    slower = advise(_waits(10.0, 2.5, 750, read_rate=64.0, reading=2.5), LEVERS, 3)["workers"]  # under GENTLE_FROM
    assert "round_growth" not in slower and "window (now 4096)" in slower
    for flat in (ODBConfig(token_budget=16384, round_growth=1.25), ODBConfig(token_budget=16384, min_window=None)):
        text = advise(_waits(10.0, 2.5, 750, read_rate=80.0, reading=2.5), Levers(flat, window=4096), 3)["workers"]
        assert "round_growth" not in text and "num_workers" in text  # already gentle, or no ramp
    pooled = Levers(rounds_config(ODBConfig(token_budget=16384), NodeLayout(world=8, per_node=8)), window=4096)
    text = advise(_waits(wall=10.0, wait=2.5, samples=750, read_rate=80.0, reading=2.5), pooled, 3)["workers"]
    assert "pool_window (now 8192: a rank's rounds of at most 1024)" in text
    in_process = Levers(ODBConfig(token_budget=16384), window=4096, in_process=True)
    inline = advise(_waits(wall=10.0, wait=2.5, samples=750, read_rate=0.0, reading=2.5), in_process, 3)
    assert list(inline) == ["workers"] and "num_workers=0" in inline["workers"]


def test_workers_about_as_fast_as_the_device_get_every_lever_that_shrinks_the_largest_round():
    waits = _waits(wall=10.0, wait=3.0, samples=700, read_rate=105.0, reading=3.0)  # within 10 % of 100
    advice = advise(waits, LEVERS, 3)
    assert list(advice) == ["even"] and "about as fast" in advice["even"]
    assert all(lever in advice["even"] for lever in ("round_growth=1.25", "num_workers", "window (now 4096)"))
    gentle = advise(waits, Levers(ODBConfig(token_budget=16384, round_growth=1.25), window=4096), 3)
    assert list(gentle) == ["even"] and "round_growth" not in gentle["even"] and "num_workers" in gentle["even"]
    assert list(advise(_waits(10.0, 3.0, 700, 91.0, reading=3.0), LEVERS, 3)) == ["even"]  # 9 % slower
    assert list(advise(_waits(10.0, 3.0, 700, 111.0, reading=3.0), LEVERS, 3)) == ["ramp"]


def test_waits_mostly_in_the_exchanges_point_to_the_slowest_rank_not_to_this_ranks_workers():
    advice = advise(_waits(10.0, 3.0, 700, 80.0, reading=0.2, exchange=2.6), LEVERS, 3)
    assert list(advice) == ["ranks"] and "2.6 s of it" in advice["ranks"] and "slowest rank" in advice["ranks"]
    assert list(advise(_waits(10.0, 3.0, 700, 80.0, reading=2.6, exchange=0.2), LEVERS, 3)) == ["workers"]
    small = _waits(10.0, 3.0, 700, 80.0, reading=0.02, exchange=0.05)  # the wait is the loader's own work
    assert advise(small, LEVERS, 3) == {}


def test_an_epoch_that_waited_little_or_on_the_loaders_own_work_or_unmeasured_gets_no_advice():
    assert advise(_waits(10.0, 0.9, 900, 80.0, reading=0.9), LEVERS, 3) == {}
    assert advise(_waits(10.0, 3.0, 700, 80.0, reading=1.2, exchange=0.5), LEVERS, 3) == {}
    paced = _waits(10.0, 3.0, 700, 80.0, reading=3.0)
    paced.reads.paced = True  # no reader thread: no rate
    assert advise(paced, LEVERS, 3) == {}


def test_an_advisor_logs_each_case_once_reports_it_every_epoch_and_says_nothing_of_a_left_epoch(odb_log):
    advisor = Advisor(LEVERS)
    metrics = LoaderMetrics(token_budget=16384, world_size=1)
    given = []
    for epoch in range(3):
        waits = advisor.epoch_waits(metrics, ReadClock(first_s=0.0, last_s=10.0, samples=800))
        waits.took(10, 0.0, 0.0)  # the first step
        metrics.read_seconds += 5.0
        waits.took(1500, 0.0, 0.0)  # the last step handed over: the parts end here
        waits.wall_s, waits.wait_s, waits.samples = 20.0, 5.0, 1500
        given.append(advisor.advise(waits, epoch, abandoned=epoch == 1))
    assert [list(g) for g in given] == [["workers"], [], ["workers"]] and "epoch 2" in given[2]["workers"]
    logged = [r.getMessage() for r in odb_log.caplog.records if "num_workers" in r.getMessage()]
    assert len(logged) == 1 and "epoch 0" in logged[0]


class Held:
    """Chunks of 4 samples; `ready()` (a reader thread's) hands over `held` of them without waiting, when given."""

    def __init__(self, chunks: int, held: int, with_ready: bool = True) -> None:
        self.chunks = [[(c * 4 + i, {"input_ids": torch.arange(8)}) for i in range(4)] for c in range(chunks)]
        self.held = held
        self.looks_ahead = with_ready  # a reader thread holds chunks (WatchedChunks.looks_ahead)
        self.ready = self._ready

    def __iter__(self):
        return self

    def __next__(self):
        if not self.chunks:
            raise StopIteration
        return self.chunks.pop(0)

    def _ready(self):
        if self.held == 0:
            return None
        self.held -= 1
        return self.chunks.pop(0)


def _reader(source: Held) -> SampleReader:
    return SampleReader(source, None, lambda: {"input_ids": torch.arange(1)}, packed=False, stream_length=None)


def test_the_read_clock_stops_where_held_chunks_take_the_read_ahead_to_its_cap_in_samples_or_in_bytes():
    free = _reader(Held(chunks=10, held=2))
    free.read_ahead(Pull(samples=8, bytes=None, cap=100, cap_bytes=None))  # under the cap: still free
    assert free.reads.samples == 16 and not free.reads.held
    waited = _reader(Held(chunks=10, held=0))
    waited.read_ahead(Pull(samples=12, bytes=None, cap=10, cap_bytes=None))  # the share waited for passes the cap
    assert not waited.reads.held  # the consumer waited for those: the workers were not ahead
    capped = _reader(Held(chunks=10, held=10))
    capped.read_ahead(Pull(samples=0, bytes=None, cap=10, cap_bytes=None))
    assert capped.reads.held and capped.reads.samples == 12  # the chunk that reached the cap is the last counted
    capped.read_ahead(Pull(samples=20, bytes=None, cap=0, cap_bytes=None))
    assert capped.reads.samples == 12  # what the consumer pulls from here is its own pace
    in_bytes = _reader(Held(chunks=10, held=10))
    in_bytes.read_ahead(Pull(samples=0, bytes=None, cap=100, cap_bytes=3 * 4 * 64))
    assert in_bytes.reads.held
    no_room = _reader(Held(chunks=10, held=10))
    no_room.read_ahead(Pull(samples=0, bytes=None, cap=100, cap_bytes=0))  # the buffer's bytes leave no room
    assert no_room.reads.held and no_room.reads.samples == 0
    ended = _reader(Held(chunks=10, held=0))
    ended.read_ahead(Pull(samples=4, bytes=None, cap=0, cap_bytes=0))  # the epoch's last round: no cap to reach
    assert not ended.reads.held


def test_without_a_reader_thread_reading_ahead_the_read_clock_reads_no_rate():
    paced = _reader(Held(chunks=30, held=0, with_ready=False))  # `ready` there, but nothing ever held
    paced.read_ahead(Pull(samples=100, bytes=None, cap=200, cap_bytes=None))
    assert paced.reads.paced and paced.reads.samples == 100 and paced.reads.rate() is None


class Timed(torch.utils.data.Dataset):
    """Samples of 20-219 tokens, each taking `ms` milliseconds of a GIL-free wait (image decoding's profile)."""

    def __init__(self, n: int, ms: float) -> None:
        self.n, self.ms = n, ms

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        time.sleep(self.ms / 1000)
        ids = torch.ones(20 + (index * 37) % 200, dtype=torch.long)
        return {"input_ids": ids, "labels": ids.clone()}


def _train(dataset: Timed, step_ms_per_sample: float, window: int = 256, **options) -> ODBDataLoader:
    """One epoch through a real loader, each step a GIL-free wait per sample (a device step's profile)."""
    loader = ODBDataLoader(dataset, token_budget=2048, window=window, min_window=16, **options)
    try:
        for batch in loader:
            time.sleep(batch.info.local_samples * step_ms_per_sample / 1000)
    finally:
        loader.close()
    return loader


def test_a_worker_slower_than_the_steps_is_named_and_so_is_reading_in_the_training_process(odb_log):
    slow = _train(Timed(150, ms=10.0), step_ms_per_sample=0.0, num_workers=1)  # the steps take no time
    assert list(slow.last_report.advice) == ["workers"] and "num_workers" in slow.last_report.advice["workers"]
    assert [r.getMessage() for r in odb_log.caplog.records if "num_workers" in r.getMessage()] == [
        slow.last_report.advice["workers"]]
    inline = _train(Timed(100, ms=5.0), step_ms_per_sample=0.0)  # num_workers=0: read between the steps
    assert list(inline.last_report.advice) == ["workers"] and "num_workers=0" in inline.last_report.advice["workers"]


def test_workers_faster_than_the_steps_but_slower_than_the_ramp_are_told_the_gentler_ramp(monkeypatch):
    """One worker at 4 ms a sample against steps of 6 ms a sample (the worker 1.5 times as fast), rounds doubling
    from 16 samples to 512: each doubling round waits for what the worker had not read while the round before
    trained. At round_growth=1.25 it is fed, and a worker 6 times as fast feeds it at 2 as well."""
    shares = []
    measured = wait_advice.advise
    monkeypatch.setattr(wait_advice, "advise", lambda waits, *args: shares.append(waits.share()) or measured(
        waits, *args))
    steep = _train(Timed(600, ms=4.0), step_ms_per_sample=6.0, window=512, num_workers=1)
    assert list(steep.last_report.advice) == ["ramp"] and "round_growth=1.25" in steep.last_report.advice["ramp"]
    gentle = _train(Timed(600, ms=4.0), step_ms_per_sample=6.0, window=512, num_workers=1, round_growth=1.25)
    assert gentle.last_report.advice == {}
    fast = _train(Timed(600, ms=1.0), step_ms_per_sample=6.0, window=512, num_workers=1)
    assert fast.last_report.advice == {}  # the first step's wait (the worker's start, the first round) left out
    assert shares[0] > 2 * shares[1] and shares[1] < 0.1 and shares[2] < 0.1, shares  # fed: it waited less
