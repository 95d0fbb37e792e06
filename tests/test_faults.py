"""Failure behaviour (DESIGN.md section 6): errors instead of hangs, with the failing index, within a bound,
and no orphan processes or threads afterwards.

Dead and stalled peers run as real 2-rank Gloo jobs (`dist_cases.py`); worker failures and loader deletion run
in this process; Ctrl-C runs in a subprocess that receives a real SIGINT. Child processes are found by scanning
/proc, so psutil is not needed.
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from torch.utils.data import IterableDataset, get_worker_info

from conftest import LengthDataset
from dist_cases import (EXIT_CODE_OF_DEAD_RANK, REPO_ROOT, TESTS_DIR, Case, KillWorkerDataset, RaisingDataset,
                        child_env, child_pids, is_alive, mixed_lengths, run_job, wait_until)
from odb_core import DatasetFetchError, ODBDataLoader, PeerError, WorkerDiedError
from odb_core.epoch.pipeline import EpochRun
from odb_core.epoch import child_signal, watch
from odb_core.epoch.watch import READER_THREAD
from odb_core.resume.round_log import RoundLog

PRODUCER_THREAD = "odb-producer"
SLACK_S = 10.0  # scheduling slack on a loaded 2-core CI machine, added to every time bound


def producer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == PRODUCER_THREAD and t.is_alive()]


@dataclass(frozen=True)
class Baseline:
    """Producer threads and child processes that existed before a test built its loader."""

    threads: frozenset[threading.Thread]
    children: frozenset[int]

    @classmethod
    def now(cls) -> Baseline:
        return cls(frozenset(producer_threads()), frozenset(child_pids(os.getpid())))

    def new_threads(self) -> set[threading.Thread]:
        return set(producer_threads()) - self.threads

    def new_children(self) -> set[int]:
        return set(child_pids(os.getpid())) - self.children


def assert_no_leftovers(baseline: Baseline) -> None:
    """No new producer thread and no new worker process survives (DataLoader workers exit within ~5 s)."""
    gc.collect()
    assert wait_until(lambda: not baseline.new_threads(), timeout_s=5.0), f"live: {baseline.new_threads()}"
    assert wait_until(lambda: not baseline.new_children(), timeout_s=10.0), f"orphans: {baseline.new_children()}"


# --- a dead or stalled peer rank --------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize(("fault", "sync_timeout_s"), [("exit", 10.0), ("stall", 4.0)])
def test_dead_or_stalled_peer_raises_peer_error_within_the_sync_timeout(tmp_path, fault, sync_timeout_s):
    """Rank 1 leaves after 3 steps (os._exit, or alive but no longer iterating); rank 0 keeps iterating and must
    get a PeerError that says what happened, no later than sync_timeout_s after rank 1 left."""
    case = Case(world_size=2, lengths=mixed_lengths(400), window=8, fault=fault, fault_after=3,
                sync_timeout_s=sync_timeout_s, stall_s=60.0)
    result = run_job(case, "env", tmp_path, timeout_s=180)
    assert not result.timed_out, f"the job hung:\n{result.output[-4000:]}"
    survivor, faulty = result.records.get(0), result.records.get(1)
    assert survivor is not None and faulty is not None, result.output[-4000:]
    assert result.returncodes[0] == 0
    assert result.returncodes[1] == (EXIT_CODE_OF_DEAD_RANK if fault == "exit" else 0)
    assert survivor["error_type"] == PeerError.__name__ and survivor["is_peer_error"], survivor
    message = survivor["message"]
    # whichever of the rank's collectives meets the dead peer first: the rounds' metadata, or a move of samples
    # on the lane (NOTE [ Moves overlap training ]), which runs beside them
    assert message.startswith(("rank 0: ODB metadata", "rank 0: ODB's sample move")), message
    assert "peer rank probably died" in message, message
    assert f"timeout {sync_timeout_s:g}s" in message, message
    latency = survivor["raised_at"] - faulty["left_at"]
    assert latency <= 10.0, f"PeerError came {latency:.1f}s after rank 1 left"  # the fault model's bound
    assert survivor["blocked_s"] <= 10.0, f"next() blocked {survivor['blocked_s']:.1f}s"
    assert survivor["steps"] >= case.fault_after


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("prefetch_steps", [0, 2])
def test_a_rank_that_closes_its_loader_after_an_error_fails_its_peers_too(tmp_path, prefetch_steps):
    """NOTE [ A failed epoch is not left ]: rank 1's dataset raises mid-shard and its loop closes the loader after
    the error, then stays alive. Rank 0 must get a PeerError within seconds, not end its epoch early without one:
    before, the close left the epoch as a `break` does and rank 0's epoch just ended, half of rank 1's samples and
    all its own later ones untrained."""
    _assert_the_peer_fails(tmp_path, "error-then-close", prefetch_steps, "DatasetFetchError")


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("prefetch_steps", [0, 2])
def test_a_rank_whose_training_step_raises_and_closes_its_loader_fails_its_peers_too(tmp_path, prefetch_steps):
    """NOTE [ A failed epoch is not left ], for an error outside the loader: rank 1's own loop raises at its third
    step and closes the loader in a `finally:` the error passes through, then stays alive. Rank 0 must get a
    PeerError within seconds; before, the close left the epoch as a `break` does, and rank 0's epoch ended early
    and quietly."""
    _assert_the_peer_fails(tmp_path, "step-error-then-close", prefetch_steps, "StepFailed")


def _stops(loader: ODBDataLoader, saved: dict) -> dict:
    """Ways a consumer stops an epoch mid-way (`saved`: a state to roll back to)."""

    def raising_through_finally():
        with pytest.raises(ValueError):
            try:
                raise ValueError("the training step failed")
            finally:
                loader.close()

    def handled(error: BaseException, then):
        try:
            raise error
        except BaseException:  # noqa: BLE001 - the case under test
            then()

    def generator_closed(closes_in_finally: bool):
        def batches():
            try:
                if closes_in_finally:
                    for batch in loader:
                        yield batch
                else:
                    yield from loader  # closed with the generator: `yield from` calls close() with no argument
            finally:
                if closes_in_finally:
                    loader.close()  # while GeneratorExit passes through
        gen = batches()
        next(gen)
        gen.close()

    return {"close": loader.close, "close in a finally": raising_through_finally,
            "close in except ValueError": lambda: handled(ValueError(), loader.close),
            "close in except KeyboardInterrupt": lambda: handled(KeyboardInterrupt(), loader.close),
            "close in except StopIteration": lambda: handled(StopIteration(), loader.close),
            "iter() in except ValueError": lambda: handled(ValueError(), lambda: iter(loader)),
            "load_state_dict() in except ValueError": lambda: handled(ValueError(),
                                                                      lambda: loader.load_state_dict(saved)),
            "a generator that yields from it closed": lambda: generator_closed(False),
            "a generator that closes it in a finally closed": lambda: generator_closed(True)}


@pytest.mark.parametrize("prefetch_steps", [0, 2])
def test_only_a_close_while_an_error_propagates_stops_the_epoch_without_leaving_it(monkeypatch, prefetch_steps):
    """NOTE [ A failed epoch is not left ]: `close()` while an exception propagates (the training step's error in a
    `finally:` or an `except` block, a Ctrl-C) does not take part in the leaving exchange, so the peers get an
    error rather than a quiet end; a deliberate stop leaves it as before: a plain close, a close while a
    StopIteration is handled, `iter()` or `load_state_dict()` in an `except` block (the loop goes on: its ranks
    must stay in step), and a generator that `yield from`s the loader being closed. One process; the leaving
    exchange (`EpochRun.leave`) is recorded."""
    left: list[bool] = []
    leave = EpochRun.leave
    monkeypatch.setattr(EpochRun, "leave", lambda run: (left.append(True), leave(run))[1])
    data = LengthDataset([8 + (i * 53) % 200 for i in range(300)])
    expected = {"close": True, "close in a finally": False, "close in except ValueError": False,
                "close in except KeyboardInterrupt": False, "close in except StopIteration": True,
                "iter() in except ValueError": True, "load_state_dict() in except ValueError": True,
                "a generator that yields from it closed": True,
                "a generator that closes it in a finally closed": True}
    seen = {}
    for name in expected:
        loader = ODBDataLoader(data, token_budget=512, window=16, prefetch_steps=prefetch_steps)
        saved = loader.state_dict()
        if not name.startswith("a generator"):  # a generator starts the epoch itself
            next(iter(loader))
        left.clear()
        _stops(loader, saved)[name]()
        seen[name] = bool(left)
        loader.close()
    assert seen == expected


def _assert_the_peer_fails(tmp_path, fault: str, prefetch_steps: int, faulty_error: str) -> None:
    case = Case(world_size=2, lengths=mixed_lengths(400), window=8, fault=fault, fault_after=3,
                prefetch_steps=prefetch_steps, sync_timeout_s=300.0, stall_s=60.0)
    result = run_job(case, "env", tmp_path, timeout_s=180)
    assert not result.timed_out, f"the job hung:\n{result.output[-4000:]}"
    survivor, faulty = result.records.get(0), result.records.get(1)
    assert survivor is not None and faulty is not None, result.output[-4000:]
    assert faulty["error_type"] == faulty_error, faulty
    assert survivor["error_type"] == PeerError.__name__, survivor
    latency = survivor["raised_at"] - faulty["left_at"]
    assert latency <= 10.0, f"PeerError came {latency:.1f}s after rank 1 failed"


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("fault", ["kill-rank", "kill-worker-then-rank"])
def test_a_sigkilled_rank_is_noticed_in_seconds_whatever_its_workers(tmp_path, fault):
    """Rank 1 (two fork-started workers, which inherit its Gloo sockets) is SIGKILLed, alone or after one of its
    workers: with the default sync_timeout_s of 300 s its peer still gets a PeerError within seconds, because the
    workers die with their rank (NOTE [ Workers die with their rank ]) and so the sockets close. Before, the
    surviving worker kept them open and the peer waited the whole timeout."""
    case = Case(world_size=2, lengths=mixed_lengths(600), window=8, fault=fault, fault_after=3, num_workers=2,
                context="fork", sync_timeout_s=300.0)
    result = run_job(case, "env", tmp_path, timeout_s=180)
    assert not result.timed_out, f"the job hung:\n{result.output[-4000:]}"
    survivor, faulty = result.records.get(0), result.records.get(1)
    assert survivor is not None and faulty is not None, result.output[-4000:]
    assert survivor["error_type"] == PeerError.__name__, survivor
    latency = survivor["raised_at"] - faulty["left_at"]
    assert latency <= 10.0, f"PeerError came {latency:.1f}s after rank 1 was killed"
    assert len(faulty["workers"]) == 2
    assert wait_until(lambda: not any(is_alive(pid) for pid in faulty["workers"]), timeout_s=5.0), (
        "rank 1's workers outlived it")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_frozen_rank_is_noticed_within_the_liveness_timeout(tmp_path):
    """Rank 1 is frozen (SIGSTOP: its sockets stay open, nothing answers) while rank 0 waits for it in a
    collective; with sync_timeout_s at its default of 300 s, the heartbeat (NOTE [ Liveness ]) makes rank 0 raise
    a PeerError within liveness_timeout_s (4 s here) plus a beat."""
    case = Case(world_size=2, lengths=mixed_lengths(600), window=8, fault="freeze", fault_after=3,  # killed once
                sync_timeout_s=300.0, liveness_timeout_s=4.0, stall_s=14.0)  # rank 0 reported, or after 14 s
    result = run_job(case, "env", tmp_path, timeout_s=180)
    assert not result.timed_out, f"the job hung:\n{result.output[-4000:]}"
    survivor, faulty = result.records.get(0), result.records.get(1)
    assert survivor is not None and faulty is not None, result.output[-4000:]
    assert survivor["error_type"] == PeerError.__name__, survivor
    assert "stopped answering ODB's heartbeat" in survivor["message"], survivor["message"]
    latency = survivor["raised_at"] - faulty["left_at"]
    assert latency <= 10.0, f"PeerError came {latency:.1f}s after rank 1 froze"


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("launcher", ["env", "spawn"])
def test_a_frozen_rank_0_that_hosts_the_store_is_named_within_the_liveness_timeout(tmp_path, launcher):
    """Rank 0 of 3 hosts the job's c10d store (no torchrun agent: one process per rank with env://, or mp.spawn)
    and is frozen (SIGSTOP) in the middle of the exchange. The heartbeat's store calls then block, so the beat
    thread can report nothing; the waiting ranks watch the beat thread instead (NOTE [ A frozen store host ]) and
    raise a PeerError naming rank 0 within liveness_timeout_s plus two beats. Before, nothing raised for 150 s."""
    liveness_s = 4.0
    case = Case(world_size=3, lengths=mixed_lengths(900), window=8, fault="freeze", fault_rank=0, fault_after=3,
                sync_timeout_s=300.0, liveness_timeout_s=liveness_s, stall_s=14.0)  # killed once both reported
    result = run_job(case, launcher, tmp_path, timeout_s=180)
    assert not result.timed_out, f"the job hung:\n{result.output[-4000:]}"
    faulty = result.records.get(0)
    survivors = [result.records.get(r) for r in (1, 2)]
    assert faulty is not None and all(survivors), result.output[-4000:]
    bound = liveness_s + 2 * (liveness_s / 4) + 2.0  # + 2 s of scheduling slack on a loaded 2-core machine
    for survivor in survivors:
        assert survivor["error_type"] == PeerError.__name__, survivor
        assert "c10d store" in survivor["message"] and "rank 0, which hosts it" in survivor["message"], survivor
        latency = survivor["raised_at"] - faulty["left_at"]
        assert latency <= bound, f"rank {survivor['rank']}: PeerError came {latency:.1f}s after rank 0 froze"


# --- worker failures ----------------------------------------------------------------------------------------------
@pytest.mark.timeout(60)
@pytest.mark.parametrize(("prefetch_steps", "reader_thread"), [(0, True), (0, False), (2, True)])
def test_killed_worker_raises_instead_of_hanging(prefetch_steps, reader_thread):
    """A worker kills itself while the rank's main thread iterates: the error is ODB's `WorkerDiedError`, read
    directly, through the reader thread or through a producer thread. Before, torch's SIGCHLD handler raised its
    own error wherever the main thread ran, in this loop's own code about 1 run in 20, where ODB could not name it
    (NOTE [ A dead worker's signal ] in child_signal.py)."""
    baseline = Baseline.now()
    loader = ODBDataLoader(KillWorkerDataset(mixed_lengths(300), kill_index=37), token_budget=1024,
                           num_workers=2, window=16, prefetch_steps=prefetch_steps, multiprocessing_context="fork",
                           reader_thread=reader_thread)
    start = time.monotonic()
    with pytest.raises(WorkerDiedError) as caught:
        for _ in loader:
            pass
    elapsed = time.monotonic() - start
    message = str(caught.value)
    del caught  # its traceback holds the epoch's frames, and through them the workers
    assert "DataLoader worker" in message and ("killed by signal" in message or "exited unexpectedly" in message)
    assert elapsed <= 10.0 + SLACK_S, f"the dead worker was reported after {elapsed:.1f}s"
    loader.close()
    del loader
    assert_no_leftovers(baseline)


class PidsDataset(LengthDataset):
    """Every fetch leaves the fetching process's pid as a file name in `folder`."""

    def __init__(self, lengths: list[int], folder: Path) -> None:
        super().__init__(lengths)
        self.folder = folder

    def __getitem__(self, index: int) -> dict:
        (self.folder / str(os.getpid())).touch()
        return super().__getitem__(index)


@pytest.mark.timeout(60)
def test_without_odbs_handler_a_worker_death_met_in_the_loaders_bookkeeping_is_a_worker_died_error(tmp_path,
                                                                                                  monkeypatch):
    """Where ODB's SIGCHLD handler is not installed (workers started off the main thread, torch's handler installed
    by another DataLoader: NOTE [ A dead worker's signal ] in child_signal.py), torch's handler raises its error at
    the entry of whatever Python call the main thread makes next, so it can meet the loader in the bookkeeping
    after a step came (the round log, the wait advice) rather than in a read: there too the caller gets a
    `WorkerDiedError` naming the worker. Here the round log, at the first step taken, kills a worker and waits:
    torch's handler raises in that wait, and its error is the one named (a stand-in raised after the wait would
    fail the test)."""
    monkeypatch.setattr(watch, "install", lambda: None)
    current = signal.getsignal(signal.SIGCHLD)
    swapped = current is child_signal._on_child_signal  # installed by an earlier test: torch's alone, for this test
    if swapped:
        signal.signal(signal.SIGCHLD, child_signal._previous)
    baseline = Baseline.now()
    consume, killed = RoundLog.consume, []

    def kill_then_consume(log: RoundLog, info) -> None:
        if not killed:
            pid = next(int(path.name) for path in tmp_path.iterdir() if int(path.name) != os.getpid())  # a worker
            killed.append(pid)  # first: the handler may raise as soon as the kill returns
            os.kill(pid, signal.SIGKILL)
            wait_until(lambda: not is_alive(pid), timeout_s=10.0)
            time.sleep(0.5)  # the handler runs here, at the latest when the sleep is interrupted
            raise AssertionError("torch's handler did not raise while the worker's death was waited for")
        consume(log, info)

    monkeypatch.setattr(RoundLog, "consume", kill_then_consume)
    loader = ODBDataLoader(PidsDataset(mixed_lengths(120), tmp_path), token_budget=1024, num_workers=2, window=16,
                           multiprocessing_context="fork", reader_thread=False)
    try:
        with pytest.raises(WorkerDiedError) as caught:
            for _ in loader:
                pass
        assert f"(pid {killed[0]})" in str(caught.value), caught.value
        assert "is killed by signal" in str(caught.value.__cause__), caught.value.__cause__  # torch's, converted
        del caught  # its traceback holds the epoch's frames, and through them the workers
    finally:
        loader.close()
        if swapped:
            signal.signal(signal.SIGCHLD, current)
    del loader
    assert_no_leftovers(baseline)


class HalfSentDataset(LengthDataset):
    """Sample `big_index` also carries `PAYLOAD_BYTES` of bytes, so that its worker's write of the chunk outlasts
    the pipe (64 KiB) and blocks until the rank reads. That worker returns it only once the file `go` exists in
    `folder` and then writes its pid to `sending`; every worker leaves its pid in `folder/pids`."""

    PAYLOAD_BYTES = 8 << 20

    def __init__(self, lengths: list[int], big_index: int, folder: Path) -> None:
        super().__init__(lengths)
        self.big_index, self.folder = big_index, folder

    def __getitem__(self, index: int) -> dict:
        (self.folder / "pids" / str(os.getpid())).touch()
        sample = super().__getitem__(index)
        if index == self.big_index and get_worker_info() is not None:
            wait_until((self.folder / "go").exists, timeout_s=60.0)
            written = self.folder / f"sending.{os.getpid()}"  # renamed once whole: the test never reads it empty
            written.write_text(str(os.getpid()))
            written.replace(self.folder / "sending")
            sample["blob"] = bytes(self.PAYLOAD_BYTES)
        return sample


def blocked_in_a_pipe_write(pid: int) -> bool | None:
    """Whether a thread of `pid` sleeps in a pipe write (its kernel wait channel); None where /proc does not say."""
    channels = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            channels.append((task / "wchan").read_text())
        except OSError:
            pass
    if not channels or all(channel in ("", "0") for channel in channels):
        return None
    return any("pipe_write" in channel for channel in channels)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("context", "reader_thread"), [("forkserver", True), ("fork", True), ("fork", False),
                                                        ("spawn", True), ("spawn", False)])
def test_a_worker_killed_mid_message_raises_worker_died_error_within_seconds(tmp_path, context, reader_thread):
    """Issue 28, case 7: a worker SIGKILLed while it writes a multi-MiB chunk leaves half a message in the
    DataLoader's pipe. Before, the rank blocked on the rest of it for ever: at once under forkserver (its workers
    are not the rank's children, so no SIGCHLD comes), and under fork and spawn at the first read after torch's
    SIGCHLD handler had raised elsewhere in the main thread. Now the next read raises a WorkerDiedError naming the
    pid and the signal within seconds (NOTE [ A rank watches its workers ]), and no worker survives: read by the
    reader thread (the default, NOTE [ A thread reads the workers ]) or, with `reader_thread=False`, directly.
    The kill does not interrupt the test's own code, where torch's handler raised its error before
    (NOTE [ A dead worker's signal ] in child_signal.py)."""
    (tmp_path / "pids").mkdir()
    readers_before = {t for t in threading.enumerate() if t.name == READER_THREAD}
    # 4-sample chunks: round 1 reads chunks 0-3 (the window), while the workers (4 chunks ahead each) run on;
    # chunk 9 holds the big sample, past what a reader thread reads ahead
    dataset = HalfSentDataset([8] * 96, big_index=36, folder=tmp_path)
    loader = ODBDataLoader(dataset, token_budget=32, window=16, fetch_chunk=4, num_workers=2, prefetch_factor=4,
                           multiprocessing_context=context, reader_thread=reader_thread)
    it = iter(loader)
    next(it)  # round 1 is read; the rank reads nothing more until the next step is taken (NOTE [ Reading ahead ])
    time.sleep(0.5)  # let a reader thread park, its queue full, before chunk 9 is written
    (tmp_path / "go").touch()
    assert wait_until((tmp_path / "sending").exists, timeout_s=30.0), "the big sample was never fetched"
    pid = int((tmp_path / "sending").read_text())
    blocked = wait_until(lambda: blocked_in_a_pipe_write(pid) is not False, timeout_s=10.0)
    assert blocked, f"worker {pid} is not blocked writing the big chunk"
    time.sleep(0.3)  # where /proc has no wait channel: the 8 MiB write has long filled the pipe
    killed = time.monotonic()
    os.kill(pid, signal.SIGKILL)  # before, under fork and spawn, torch's SIGCHLD handler raised in this code
    assert wait_until(lambda: not is_alive(pid), timeout_s=10.0)
    time.sleep(0.2)
    with pytest.raises(WorkerDiedError) as caught:
        for _ in it:
            pass
    elapsed = time.monotonic() - killed
    message = str(caught.value)
    del caught  # its traceback holds the epoch's frames
    assert f"(pid {pid})" in message and "killed by signal 9 (SIGKILL)" in message, message
    assert "out-of-memory" in message and "resume from the last checkpoint" in message, message
    assert elapsed <= 5.0, f"the dead worker was reported {elapsed:.1f}s after the kill"
    loader.close()
    del loader, it
    gc.collect()
    workers = [int(path.name) for path in (tmp_path / "pids").iterdir()]
    assert len(workers) == 2, workers
    assert wait_until(lambda: not any(is_alive(p) for p in workers), timeout_s=10.0), (
        f"workers still alive: {[p for p in workers if is_alive(p)]}")
    # a reader thread stays blocked on the half message (a daemon; no public API can release it); a direct read
    # (fork or spawn without the reader thread) leaves none
    readers = [t for t in threading.enumerate() if t.name == READER_THREAD and t not in readers_before]
    direct = context != "forkserver" and not reader_thread
    assert all(t.daemon for t in readers) and (not readers if direct else len(readers) <= 1), readers


@pytest.mark.timeout(60)
def test_a_worker_known_by_its_pid_alone_is_still_watched(monkeypatch):
    """Where the rank cannot find the multiprocessing Process of a reported pid (it would if torch stopped
    starting its workers as multiprocessing children), it watches the pid itself, from a reader thread."""
    monkeypatch.setattr(watch.multiprocessing, "active_children", list)  # finds no Process
    loader = ODBDataLoader(KillWorkerDataset(mixed_lengths(300), kill_index=37), token_budget=1024, window=16,
                           num_workers=2, multiprocessing_context="forkserver")
    with pytest.raises(WorkerDiedError) as caught:
        for _ in loader:
            pass
    message = str(caught.value)
    del caught
    assert "DataLoader worker" in message and "died while the rank was reading" in message, message
    assert "its exit status is unknown" in message, message
    loader.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("num_workers", "prefetch_steps"), [(0, 2), (2, 0), (2, 2)])
def test_dataset_exception_in_a_worker_names_the_index(num_workers, prefetch_steps):
    baseline = Baseline.now()
    loader = ODBDataLoader(RaisingDataset(mixed_lengths(300), bad_index=37), token_budget=1024, window=16,
                           num_workers=num_workers, prefetch_steps=prefetch_steps)
    with pytest.raises(DatasetFetchError) as caught:
        for _ in loader:
            pass
    message = str(caught.value)
    del caught
    assert "dataset[37] raised ValueError: corrupt record 37" in message, message
    if num_workers:
        assert "DataLoader worker process" in message, "the worker's traceback should be kept"
    loader.close()
    # Only the thread is checked here: after a worker raised, torch's own worker shutdown takes ~2 x 5 s (its
    # join timeout), with or without ODB; worker cleanup is covered by the killed-worker and Ctrl-C tests.
    assert wait_until(lambda: not baseline.new_threads(), timeout_s=5.0), f"live: {baseline.new_threads()}"


# --- Ctrl-C ---------------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize("target", ["process", "process-group"])
def test_ctrl_c_exits_promptly_and_leaves_no_worker_processes(target):
    """SIGINT to the trainer alone, or to its whole process group as a terminal's Ctrl-C does, while the main
    thread waits on the background producer and 2 workers fetch: KeyboardInterrupt, a prompt exit, no orphans."""
    proc = subprocess.Popen([sys.executable, str(TESTS_DIR / "dist_cases.py"), "interrupt"], env=child_env(),
                            cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        line = proc.stdout.readline()  # printed after the first batch
        assert line.startswith("WORKERS"), f"{line!r}\n{proc.stderr.read() if proc.poll() is not None else ''}"
        workers = [int(pid) for pid in line.split()[1:]]
        assert len(workers) == 2 and all(is_alive(pid) for pid in workers), line
        time.sleep(0.5)  # mid-epoch: the producer and the workers are busy
        sent = time.monotonic()
        if target == "process":
            os.kill(proc.pid, signal.SIGINT)
        else:
            os.killpg(proc.pid, signal.SIGINT)
        _, stderr = proc.communicate(timeout=30)
        exit_s = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert "KeyboardInterrupt" in stderr, stderr[-3000:]
    assert proc.returncode != 0
    assert exit_s <= SLACK_S, f"the process took {exit_s:.1f}s to exit after SIGINT"
    assert wait_until(lambda: not any(is_alive(pid) for pid in workers), timeout_s=10.0), (
        f"orphan workers still alive: {[pid for pid in workers if is_alive(pid)]}")


# --- deleting a loader mid-epoch ----------------------------------------------------------------------------------
@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_deleting_a_loader_mid_epoch_stops_its_producer_thread_and_workers(num_workers):
    baseline = Baseline.now()
    loader = ODBDataLoader(LengthDataset(mixed_lengths(400)), token_budget=1024, window=16,
                           num_workers=num_workers, prefetch_steps=2)
    it = iter(loader)
    next(it)
    next(it)
    assert producer_threads(), "the epoch should be running in a producer thread"
    del it, loader
    assert_no_leftovers(baseline)


def _drop_loaders_on_a_gloo_rank(rank: int, port: int, out) -> None:
    """Build, run and drop three loaders without close(), on one of two Gloo ranks; report the threads and open
    descriptors after each (NOTE [ A dropped loader ends its threads ] in odb_core/ranks/sync.py)."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}")
    baseline = len(os.listdir("/proc/self/fd"))
    seen = []
    for _ in range(3):  # global planning on one node: a world transport and a move lane, each with a courier
        loader = ODBDataLoader(LengthDataset(mixed_lengths(200)), token_budget=1024, window=32)
        assert sum(1 for _ in loader) > 0
        del loader
        gc.collect()
        threads = sorted(t.name for t in threading.enumerate() if t.name.startswith("odb-"))
        seen.append((threads, len(os.listdir("/proc/self/fd")) - baseline))
    for _ in range(2):  # refused after its transport was built: move='fetch' cannot re-read a stream
        try:
            ODBDataLoader(Stream(), token_budget=1024, move="fetch")
            refused = "not refused"  # the premise failed: the parent's check shows it
        except ValueError as error:
            refused = "" if "move='fetch'" in str(error) else str(error)
        gc.collect()
        threads = sorted(t.name for t in threading.enumerate() if t.name.startswith("odb-"))
        seen.append(([refused] if refused else threads, len(os.listdir("/proc/self/fd")) - baseline))
    out.put((rank, seen))
    dist.destroy_process_group()


class Stream(IterableDataset):
    def __iter__(self):
        return iter([{"input_ids": [1, 2, 3]}] * 4)


def test_a_loader_dropped_without_close_ends_its_threads_and_groups():
    import multiprocessing

    from dist_cases import free_port

    context = multiprocessing.get_context("spawn")
    out, port = context.Queue(), free_port()
    ranks = [context.Process(target=_drop_loaders_on_a_gloo_rank, args=(r, port, out)) for r in range(2)]
    for process in ranks:
        process.start()
    reports = dict(out.get(timeout=120) for _ in ranks)
    for process in ranks:
        process.join(30)
    for rank, seen in reports.items():
        # before: 3 more threads (two couriers and a heartbeat) and ~11 more descriptors for each dropped loader,
        # and a courier thread and its group for each refused one
        assert [threads for threads, _ in seen] == [[]] * 5, (rank, seen)
        assert max(fds for _, fds in seen) <= 3, (rank, seen)  # a descriptor or two come and go (the store's)


CLOSED_BY_A_HANDLER = textwrap.dedent("""
    import os, signal, sys, time
    import torch.distributed as dist
    from conftest import LengthDataset, lognormal_lengths
    from odb_core import ODBDataLoader

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    loader = ODBDataLoader(LengthDataset(lognormal_lengths(200, 1.0, 96, seed=3, hi=700)), token_budget=700,
                           window=16, seed=1, sync_timeout_s=30.0)

    def handler(signum, frame):  # a preemption handler: close the loader, then end
        started = time.monotonic()
        loader.close()
        print(f"rank {rank}: close() returned after {time.monotonic() - started:.1f}s", flush=True)
        sys.exit(3)

    signal.signal(signal.SIGALRM, handler)
    for epoch in range(2):
        if epoch == 1 and rank == 0:
            signal.setitimer(signal.ITIMER_REAL, 1.0)  # rank 0 then waits in epoch 1's first round for rank 1
        if epoch == 1 and rank == 1:
            time.sleep(4)
        try:
            steps = sum(1 for _ in loader)
        except Exception as error:
            print(f"rank {rank}: {type(error).__name__}: {error}", flush=True)
            sys.exit(1)
""")


@pytest.mark.timeout(120)
def test_a_close_from_a_signal_handler_inside_the_rounds_own_exchange_ends_both_ranks_promptly(tmp_path):
    """NOTE [ A failed epoch is not left ]: rank 0's handler closes the loader while its main thread waits in the
    first round's exchange of epoch 1 (its default plan_ahead runs an epoch's first round inline). Leaving there
    queued the leaving exchange behind the one in flight, which then paired with rank 1's next exchange: Gloo
    aborted rank 0 ("op.preamble.length <= op.nbytes", SIGABRT) in a review's runs, or both ranks waited out
    sync_timeout_s. Now the epoch is not left there: rank 0's handler finishes, rank 1 gets a PeerError."""
    from dist_cases import free_port

    script = tmp_path / "closed_by_a_handler.py"
    script.write_text(CLOSED_BY_A_HANDLER)
    port = free_port()
    ranks = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), str(TESTS_DIR), os.environ.get("PYTHONPATH", "")])}
        ranks.append(subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    started = time.monotonic()
    outputs = [process.communicate(timeout=90)[0] for process in ranks]
    elapsed = time.monotonic() - started
    assert [process.returncode for process in ranks] == [3, 1], outputs  # not SIGABRT (-6), not a hang
    assert "rank 0: close() returned" in outputs[0], outputs[0][-3000:]
    assert "rank 1: PeerError" in outputs[1], outputs[1][-3000:]
    assert elapsed < 25, f"{elapsed:.1f}s: the ranks waited for the 30 s sync timeout"


def test_a_persistent_worker_that_died_between_epochs_is_replaced_with_a_warning(odb_log):
    """No sample was in flight, so nothing is lost: the next epoch starts new workers and runs whole, with a
    warning naming the worker and how it ended. Before, every later `iter()` failed with torch's bare "DataLoader
    worker (pid ...) exited unexpectedly" after 5 s, a retry too (a review's run)."""
    import multiprocessing

    before = set(multiprocessing.active_children())
    loader = ODBDataLoader(LengthDataset(mixed_lengths(120)), token_budget=700, window=16, num_workers=2,
                           persistent_workers=True)
    try:
        first = [batch.info.indices for batch in loader]
        workers = set(multiprocessing.active_children()) - before
        assert len(workers) == 2  # the premise: persistent workers alive between epochs
        victim = workers.pop()
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(5)
        second = [i for batch in loader for i in batch.info.indices]
    finally:
        loader.close()
    assert sorted(second) == sorted(i for indices in first for i in indices) == list(range(120))
    warned = [r.getMessage() for r in odb_log.caplog.records if "died between epochs" in r.getMessage()]
    assert len(warned) == 1 and f"pid {victim.pid}" in warned[0] and "SIGKILL" in warned[0], warned


def test_a_signal_handler_reading_the_position_inside_consume_does_not_deadlock():
    """`state_dict()` from a signal handler that interrupts `RoundLog.consume` on the same thread takes the
    log's lock again (a review's trace-driven run hung there for good): the lock is re-entrant."""
    log = RoundLog(None)
    done = threading.Event()

    def handler_inside_consume() -> None:
        with log._lock:  # where the interrupted consume() stands
            assert log.position is None  # the handler's state_dict()
        done.set()

    thread = threading.Thread(target=handler_inside_consume, daemon=True)
    thread.start()
    thread.join(5)
    assert done.is_set(), "the position deadlocked on the log's own lock"


def test_closing_a_producer_without_leaving_waits_seconds_not_the_sync_timeout():
    """An error's close (or a finalizer's) leaves no epoch, so it awaits no peer: the producer stuck in a collective
    gets `EXIT_TIMEOUT_S`, not `sync_timeout_s + 5` (a review's Ctrl-C with prefetch_steps=1: 37.7 s, 10 s
    without a producer); with leave it still waits as asked."""
    from odb_core.epoch.prefetch import EXIT_TIMEOUT_S, BackgroundIterator

    released = threading.Event()

    def stuck():  # a round's exchange whose peer never comes (until the test ends)
        released.wait(60)
        yield 1

    producer = BackgroundIterator(stuck(), depth=1)
    started = time.monotonic()
    producer.close(leave=False, timeout_s=35.0)
    waited = time.monotonic() - started
    released.set()
    assert EXIT_TIMEOUT_S - 0.5 <= waited <= EXIT_TIMEOUT_S + 2.0, waited
