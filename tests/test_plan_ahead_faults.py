"""Plan-ahead cases the mutation audit of its first mends found untested (NOTE [ Planning the next round ahead ]):
when a job starts, leave and close waiting for it, the loader's own exchanges, wait parts, a closed collate thread."""
from __future__ import annotations

import logging
import threading
import time

import pytest

from conftest import LengthDataset, lognormal_lengths
from odb_core import ODBDataLoader, run_virtual_ranks
from odb_core.epoch.collate_ahead import CollateAhead
from odb_core.epoch.collation import Collation
from odb_core.epoch.plan_ahead import PLAN_THREAD, PlanAhead, RoundAheadError
from odb_core import PadCollator

LENGTHS = lognormal_lengths(400, 1.0, 128, seed=5, hi=1024)


def _make(dataset, **kw):
    return ODBDataLoader(dataset, token_budget=1024, shuffle=True, window=64, **kw)


def _boundaries(**kw):
    rounds = [b.info.round for b in _make(LengthDataset(LENGTHS), plan_ahead=False, **kw)]
    return [k for k in range(len(rounds) - 1) if rounds[k] != rounds[k + 1]]


def _plan_threads_alive():
    return [t for t in threading.enumerate() if t.name.startswith(PLAN_THREAD) and t.is_alive()]


def test_a_job_starts_only_once_a_rounds_last_step_is_taken(monkeypatch):
    """kills: a job after every step; a job after the epoch's last step."""
    boundaries = _boundaries()
    starts: list[int] = []
    start = PlanAhead.start
    loader = _make(LengthDataset(LENGTHS))
    taken = [0]
    monkeypatch.setattr(PlanAhead, "start", lambda self, produce: (starts.append(taken[0]), start(self, produce))[1])
    for k, _ in enumerate(loader):
        taken[0] = k + 1
    assert starts == boundaries


def test_leave_does_not_leave_while_the_round_run_ahead_still_runs(caplog):
    """kills: leave() that leaves although the job has not ended."""
    release, armed = threading.Event(), threading.Event()

    def blocking(sample):
        if armed.is_set() and threading.current_thread().name.startswith(PLAN_THREAD):
            release.wait(30)
        return len(sample["input_ids"])

    stop = _boundaries()[1]
    loader = _make(LengthDataset(LENGTHS), length_fn=blocking, sync_timeout_s=0.5)
    for k, _ in enumerate(loader):
        if k == stop - 1:
            armed.set()
        if k == stop:
            break
    run = loader._current.run
    try:
        with caplog.at_level(logging.WARNING):
            loader.leave_epoch()
    finally:
        release.set()
    assert run.report is None
    assert any("did not end" in r.message for r in caplog.records)


def test_a_close_while_an_error_propagates_waits_for_the_round_run_ahead():
    """kills: EpochRun.close() that does not wait for the job (its reader closed under it)."""
    def slow_in_the_job(sample):
        if threading.current_thread().name.startswith(PLAN_THREAD):
            time.sleep(0.005)
        return len(sample["input_ids"])

    stop = _boundaries()[1]
    loader = _make(LengthDataset(LENGTHS), length_fn=slow_in_the_job)
    for k, _ in enumerate(loader):
        if k == stop:
            break
    run = loader._current.run
    assert run.round_ahead.pending
    try:
        raise ValueError("the training step failed")
    except ValueError:
        loader.close()
    assert not run.round_ahead.pending  # settled (waited for, at most CLOSE_WAIT_S)


def test_plan_epochs_exactly_waits_for_a_round_run_ahead():
    """kills: plan_epochs_exactly without _quiet_epoch."""
    stop = _boundaries()[1]

    def slow_in_the_job(sample):
        if threading.current_thread().name.startswith(PLAN_THREAD):
            time.sleep(0.005)
        return len(sample["input_ids"])

    loader = _make(LengthDataset(LENGTHS), length_fn=slow_in_the_job)
    for k, batch in enumerate(loader):
        if k == stop:
            round_ = batch.info.round
            break
    assert loader.metrics.rounds == round_ + 1
    loader.plan_epochs_exactly([1])
    assert loader.metrics.rounds == round_ + 2


def test_collate_ahead_starts_nothing_after_close():
    """kills: CollateAhead.close() that leaves it enabled."""
    loader = _make(LengthDataset(LENGTHS))
    it = iter(loader)
    next(it)
    run = loader._current.run
    step = run.ready[0][0]
    run.collating.close()
    run.collating.start(step)
    assert run.collating._pool is None
    loader.close()


class Slow(LengthDataset):
    def __getitem__(self, index):
        time.sleep(0.002)
        return super().__getitem__(index)


@pytest.mark.parametrize("plan_ahead", [False, True])
def test_reading_is_counted_as_part_of_the_wait(plan_ahead):
    """kills: the reader not counting, inline next() not adding its parts."""
    loader = _make(Slow(LENGTHS[:200]), plan_ahead=plan_ahead)
    for _ in loader:
        pass
    m = loader.metrics
    assert 0.5 * m.wait_seconds < m.read_seconds <= m.wait_seconds, (m.read_seconds, m.wait_seconds)


def test_the_exchange_part_never_exceeds_the_wait_when_the_job_waits_for_a_peer_while_the_step_trains():
    """kills: the job's sync seconds straight to the metrics. Rank 1 trains 0.3 s on the step before each round's
    last, so it takes that last step (and starts its job) late: rank 0's job waits ~0.3 s in the exchange while
    rank 0 trains its last step 0.5 s, and rank 0 waited for none of it."""
    def make(transport, plan_ahead):
        return ODBDataLoader(LengthDataset(LENGTHS), token_budget=1024, window=64, transport=transport,
                             plan_ahead=plan_ahead)

    def reference(rank, transport):
        return [b.info.round for b in make(transport, False)]
    rounds = run_virtual_ranks(reference, 2, timeout_s=60)[0]
    bounds = {k for k in range(len(rounds) - 1) if rounds[k] != rounds[k + 1]}

    def rank_main(rank, transport):
        loader = make(transport, True)
        for k, _ in enumerate(loader):
            if rank == 0 and k in bounds:
                time.sleep(0.5)
            if rank == 1 and k + 1 in bounds:
                time.sleep(0.3)
        m = loader.metrics
        return m.sync_seconds, m.wait_seconds
    (sync0, wait0), _ = run_virtual_ranks(rank_main, 2, timeout_s=60)
    assert len(bounds) >= 3 and sync0 <= wait0, (sync0, wait0)


def test_a_round_run_ahead_never_waited_for_adds_nothing_to_the_waits_parts():
    """kills: settle() adding an untaken job's parts in full."""
    from odb_core.epoch.plan_ahead import WaitParts
    from odb_core.steps.metrics import LoaderMetrics
    metrics, parts = LoaderMetrics(token_budget=100, world_size=1), WaitParts()
    ahead = PlanAhead(parts, metrics)
    ahead.start(lambda: setattr(parts, "read_seconds", 0.2) or "step")
    assert ahead.settle(5.0) == (True, None)
    assert metrics.read_seconds == 0.0 and parts.read_seconds == 0.0


def test_settle_does_not_report_the_end_of_the_epoch_as_an_error():
    """kills: settle() returning StopIteration as the job's error (leave() would log a failure)."""
    from odb_core.epoch.plan_ahead import WaitParts
    from odb_core.steps.metrics import LoaderMetrics

    def ended():
        raise StopIteration
    ahead = PlanAhead(WaitParts(), LoaderMetrics(token_budget=100, world_size=1))
    ahead.start(ended)
    assert ahead.settle(5.0) == (True, None)


def test_settle_on_the_jobs_own_thread_does_not_wait_for_itself():
    """kills: settle() that waits on its own thread (a finalizer run there)."""
    from odb_core.epoch.plan_ahead import WaitParts
    from odb_core.steps.metrics import LoaderMetrics
    ahead = PlanAhead(WaitParts(), LoaderMetrics(token_budget=100, world_size=1))
    ahead.start(lambda: (time.perf_counter(), ahead.settle(3.0), time.perf_counter()))
    started, settled, ended = ahead.take()
    assert settled == (True, None) and ended - started < 1.0


def test_a_round_run_ahead_that_failed_inside_its_plan_is_not_left():
    """kills: `exchanging` set only once plan() returned (a failure inside the round's plan collectives)."""
    stop = _boundaries()[1]
    loader = _make(LengthDataset(LENGTHS))
    for k, _ in enumerate(loader):
        if k == stop - 1:
            run = loader._current.run
            plan = run.rounds.plan

            def failing(active, take_own):
                plan_ = plan(active, take_own)  # the round's collectives ran; fail as a move would
                raise RuntimeError("a move failed")
            run.rounds.plan = failing
        if k == stop:
            break
    with pytest.raises(RoundAheadError, match="a move failed"):
        loader.leave_epoch()
    assert run.report is None  # not left: the peers would be inside the round



def test_a_loader_finalized_inside_its_collating_pools_submit_on_an_odb_thread_does_not_hang():
    """A garbage collection inside `ThreadPoolExecutor.submit` on the thread that runs the next round ahead
    finalized the loader, whose `CollateAhead.close` then waited for the lock that `submit` held: that thread hung,
    holding the executors' global lock, and so did every later `submit` of the process (seen once in the suite).
    Forced here: a collection at every allocation, whose callback closes the `CollateAhead` from inside `submit`."""
    import gc
    import sys
    from concurrent.futures import ThreadPoolExecutor

    loader = _make(LengthDataset(LENGTHS))
    it = iter(loader)
    next(it)
    run = loader._current.run
    collating = CollateAhead(run.collation, True)
    closed = []

    def close_inside_submit(phase, info):
        frame, names = sys._getframe(), set()
        while frame is not None:
            names.add(frame.f_code.co_name)
            frame = frame.f_back
        pool = collating._pool
        if (phase == "start" and not closed and threading.current_thread().name == PLAN_THREAD and "submit" in names
                and pool is not None and pool._shutdown_lock.locked()):  # inside `submit`, which holds its lock
            closed.append(True)
            collating.close()

    raised = []

    def start() -> None:
        try:
            collating.start(run.ready[0][0])
        except BaseException as exc:  # noqa: BLE001 - the test asserts there is none
            raised.append(exc)

    thresholds = gc.get_threshold()
    gc.callbacks.append(close_inside_submit)
    gc.set_threshold(1)
    try:
        worker = threading.Thread(target=start, name=PLAN_THREAD, daemon=True)
        worker.start()
        worker.join(10)
    finally:
        gc.set_threshold(*thresholds)
        gc.callbacks.remove(close_inside_submit)
    assert closed and not worker.is_alive() and not raised
    with ThreadPoolExecutor(1) as pool:  # the executors' global lock is free
        assert pool.submit(int, "7").result(timeout=10) == 7
    loader.close()
