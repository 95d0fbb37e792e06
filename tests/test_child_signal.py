"""A dead DataLoader worker of the rank is reported by ODB's watch at one of the rank's next reads, never by a
signal handler raising at whatever line the main thread runs; only a direct read waiting in its pipe is broken by
ODB's SIGCHLD handler, and torch's still raises for the workers of other DataLoaders
(NOTE [ A dead worker's signal ] in odb_core/epoch/child_signal.py). Real forked and spawned workers, real signals."""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import struct
import threading
import time
import weakref
from pathlib import Path

import pytest
from torch.utils.data import DataLoader, Dataset, get_worker_info

from conftest import LengthDataset
from dist_cases import is_alive, mixed_lengths, wait_until
from odb_core import ODBDataLoader, WorkerDiedError
from odb_core.epoch.child_signal import KICK_S, WorkerExited, direct_reads_rescued, reading
from odb_core.resume.round_log import RoundLog
from test_faults import SLACK_S, Baseline, HalfSentDataset, PidsDataset, assert_no_leftovers, blocked_in_a_pipe_write


def a_worker(folder: Path) -> int:
    """The pid of a worker that fetched a sample (`PidsDataset` leaves each fetching process's pid in `folder`)."""
    return next(int(path.name) for path in folder.iterdir() if int(path.name) != os.getpid())


def kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    assert wait_until(lambda: not is_alive(pid), timeout_s=10.0), f"worker {pid} outlived its SIGKILL"


def causes(error: BaseException) -> list[BaseException]:
    chain, seen = [], set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        chain.append(current)
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return chain


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("prefetch_steps", "reader_thread"), [(0, True), (0, False), (2, True)])
def test_a_worker_killed_while_the_caller_runs_its_own_code_is_an_error_at_a_later_next(tmp_path, prefetch_steps,
                                                                                           reader_thread):
    """The kill lands while the main thread runs the caller's code (here a sleep, in a trainer a step or a
    checkpoint write): that code runs on untouched, where torch's SIGCHLD handler raised its RuntimeError before,
    and a later `next()` raises the `WorkerDiedError` naming the worker."""
    baseline = Baseline.now()
    loader = ODBDataLoader(PidsDataset(mixed_lengths(600), tmp_path), token_budget=1024, num_workers=2, window=16,
                           prefetch_steps=prefetch_steps, multiprocessing_context="fork", reader_thread=reader_thread,
                           plan_ahead=reader_thread)  # reader_thread=False: every read on the main thread
    it = iter(loader)
    next(it)
    pid = a_worker(tmp_path)
    kill(pid)
    time.sleep(0.5)  # the caller's own code: the signal has long been handled
    killed = time.monotonic()
    with pytest.raises(WorkerDiedError) as caught:
        for _ in it:
            pass
    elapsed = time.monotonic() - killed
    message = str(caught.value)
    del caught  # its traceback holds the epoch's frames, and through them the workers
    assert f"(pid {pid})" in message and "killed by signal 9 (SIGKILL)" in message, message
    assert elapsed <= 5.0 + SLACK_S, f"the dead worker was reported {elapsed:.1f}s after the caller's code"
    loader.close()
    del loader, it
    assert_no_leftovers(baseline)


@pytest.mark.timeout(60)
def test_a_worker_killed_while_the_loader_logs_a_step_lets_that_step_through(tmp_path, monkeypatch):
    """The kill lands in the loader's own bookkeeping after a step came (the round log): that step reaches the
    caller whole (before, torch's error was raised inside the log and the step was lost), and a later `next()`
    raises the `WorkerDiedError`. (Where ODB's handler is not installed, the conversion of torch's error there is
    `test_faults.py::test_without_odbs_handler_a_worker_death_met_in_the_loaders_...`.)"""
    baseline = Baseline.now()
    consume, killed = RoundLog.consume, []

    def kill_then_consume(log: RoundLog, info) -> None:
        if not killed:
            killed.append(a_worker(tmp_path))
            kill(killed[0])
            time.sleep(0.5)  # a handler that raises does it here, at the latest when the sleep is interrupted
        consume(log, info)

    monkeypatch.setattr(RoundLog, "consume", kill_then_consume)
    loader = ODBDataLoader(PidsDataset(mixed_lengths(600), tmp_path), token_budget=1024, num_workers=2, window=16,
                           multiprocessing_context="fork", reader_thread=False, plan_ahead=False)
    it = iter(loader)
    first = next(it)
    assert killed and first.info is not None and first.info.local_samples > 0
    with pytest.raises(WorkerDiedError) as caught:
        for _ in it:
            pass
    message = str(caught.value)
    del caught
    assert f"(pid {killed[0]})" in message, message
    loader.close()
    del loader, it
    assert_no_leftovers(baseline)


def wait_channels_shown() -> bool:
    """Whether /proc names the kernel function a sleeping thread waits in."""
    stop = threading.Event()
    sleeper = threading.Thread(target=stop.wait)
    sleeper.start()
    try:
        time.sleep(0.1)
        channel = Path(f"/proc/self/task/{sleeper.native_id}/wchan").read_text()
    except OSError:
        channel = ""
    finally:
        stop.set()
        sleeper.join()
    return channel not in ("", "0")


def main_thread_reads_a_pipe(tid: int) -> bool:
    try:
        return "pipe_read" in Path(f"/proc/self/task/{tid}/wchan").read_text()
    except OSError:
        return False


@pytest.mark.timeout(90)
@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_a_direct_read_blocked_on_a_half_message_is_broken_by_odbs_handler(tmp_path, context):
    """With `reader_thread=False` the main thread reads its workers' pipe itself. A worker stopped halfway through
    writing a chunk larger than the pipe leaves the read blocked on the rest; SIGKILLed then, only a signal handler
    that raises can end that read: ODB's, which drops torch's error about its workers. The error is the
    `WorkerDiedError` within seconds, with ODB's `WorkerExited` among its causes, and no worker is left."""
    if not wait_channels_shown():
        pytest.skip("/proc does not show wait channels here")
    (tmp_path / "pids").mkdir()
    dataset = HalfSentDataset([8] * 96, big_index=36, folder=tmp_path)
    loader = ODBDataLoader(dataset, token_budget=32, window=16, fetch_chunk=4, num_workers=2, prefetch_factor=4,
                           multiprocessing_context=context, reader_thread=False,
                           plan_ahead=False)  # the planning thread's reads would go through a reader thread
    it = iter(loader)
    next(it)  # round 1 is read; the rank reads nothing more until the next step is taken
    (tmp_path / "go").touch()
    assert wait_until((tmp_path / "sending").exists, timeout_s=30.0), "the big sample was never fetched"
    pid = int((tmp_path / "sending").read_text())
    assert wait_until(lambda: blocked_in_a_pipe_write(pid) is True, timeout_s=10.0), f"{pid} is not writing"
    os.kill(pid, signal.SIGSTOP)  # frozen mid-write: the rank will read what the pipe holds and wait for the rest
    main, killed = threading.get_native_id(), []

    def kill_once_the_read_blocks() -> None:
        if wait_until(lambda: main_thread_reads_a_pipe(main), timeout_s=30.0):
            time.sleep(0.2)
            killed.append(time.monotonic())
        os.kill(pid, signal.SIGKILL)  # in any case: the test must not hang on a frozen worker

    killer = threading.Thread(target=kill_once_the_read_blocks, daemon=True)
    killer.start()
    with pytest.raises(WorkerDiedError) as caught:
        for _ in it:
            pass
    ended = time.monotonic()
    killer.join(timeout=30.0)
    chain = causes(caught.value)
    message = str(caught.value)
    del caught  # its traceback holds the epoch's frames
    assert killed, "the main thread never blocked in a pipe read"
    assert f"(pid {pid})" in message and "killed by signal 9 (SIGKILL)" in message, message
    assert any(isinstance(error, WorkerExited) for error in chain), [type(error).__name__ for error in chain]
    assert ended - killed[0] <= 5.0, f"the dead worker was reported {ended - killed[0]:.1f}s after the kill"
    loader.close()
    del loader, it
    gc.collect()  # the failed epoch's frames: garbage left for a later fork would be collected in its children
    workers = [int(path.name) for path in (tmp_path / "pids").iterdir()]
    assert wait_until(lambda: not any(is_alive(p) for p in workers), timeout_s=10.0 + SLACK_S), (
        f"workers still alive: {[p for p in workers if is_alive(p)]}")


class KillAt(Dataset):
    """Plain integers (no tensor, whose storage a reader would fetch from the dead worker's fd sharer); the worker
    that fetches `index` SIGKILLs itself, 0.2 s after the fetch began (the reader waits in its queue by then)."""

    def __init__(self, index: int) -> None:
        self.index = index

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> int:
        if index == self.index and get_worker_info() is not None:
            time.sleep(0.2)
            os.kill(os.getpid(), signal.SIGKILL)
        return index


@pytest.mark.timeout(60)
def test_torchs_handler_still_raises_for_a_plain_dataloaders_dead_worker():
    """ODB's handler wraps torch's and calls it: when a plain DataLoader's worker dies, torch's handler still raises
    its error ("killed by signal"), maybe wrapped in the "exited unexpectedly" of the read it broke; torch's own look
    after its 5 s poll would say only the latter."""
    for _ in ODBDataLoader(LengthDataset(mixed_lengths(64)), token_budget=1024, num_workers=2, window=16,
                           multiprocessing_context="fork"):
        pass
    plain = DataLoader(KillAt(5), batch_size=None, num_workers=1, multiprocessing_context="fork")
    assert direct_reads_rescued(plain), "ODB's SIGCHLD handler is not the one installed"
    with pytest.raises(RuntimeError) as caught:
        for _ in plain:
            pass
    messages = [str(error) for error in causes(caught.value)]
    assert not isinstance(caught.value, WorkerDiedError), caught.value
    del caught  # its traceback holds the plain iterator, whose dead worker torch's handler would name again
    gc.collect()
    assert any("killed by signal" in message for message in messages), messages  # torch's poll says otherwise


class BusyThenWaiting:
    """A stand-in for torch's iterator in one direct read, around a real child process: `next()` SIGKILLs the
    child, runs Python code that takes and releases a `threading.Condition` for `busy_s` (as `multiprocessing.Queue`
    does; a raise just after its `__enter__` took the lock would leave it held), then waits in a real pipe for the
    rest of a message whose header and first bytes alone were written, as a read does after a worker died
    mid-write."""

    def __init__(self, child: multiprocessing.process.BaseProcess, busy_s: float) -> None:
        self.child, self.busy_s = child, busy_s
        self.condition = threading.Condition()
        self.inbox, self.outbox = multiprocessing.Pipe(duplex=False)
        self.busy_done = False
        self.waiting_since: float | None = None

    def __next__(self) -> bytes:
        os.kill(self.child.pid, signal.SIGKILL)
        deadline = time.monotonic() + self.busy_s
        while time.monotonic() < deadline:
            with self.condition:
                pass
        self.busy_done = True
        os.write(self.outbox.fileno(), struct.pack("!i", 1 << 20) + bytes(16))  # 16 bytes of a 1 MiB message
        self.waiting_since = time.monotonic()
        return self.inbox.recv_bytes()


@pytest.mark.timeout(60)
def test_a_death_met_outside_the_reads_wait_is_raised_once_the_read_waits_in_its_pipe():
    """ODB's handler raises only where the main thread waits in the read's pipe: a death whose signal comes while
    the read runs other code (here 0.5 s of taking and releasing a lock) leaves that code alone, and the kicker's
    SIGCHLD every `KICK_S` breaks the read once it waits for the rest of a message. The lock is free after, and
    nothing of ODB's holds the iterator any more (freed, torch's stops its surviving workers)."""
    for _ in ODBDataLoader(LengthDataset(mixed_lengths(32)), token_budget=1024, num_workers=1, window=16,
                           multiprocessing_context="fork"):
        pass  # workers started on the main thread: torch's handler, and ODB's around it (done by earlier tests too)
    assert direct_reads_rescued(DataLoader([0], num_workers=1, multiprocessing_context="fork")), \
        "ODB's SIGCHLD handler is not the one installed"
    child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,))
    child.start()
    chunks = BusyThenWaiting(child, busy_s=0.5)
    with pytest.raises(WorkerExited) as caught:
        reading({child.pid: child}, chunks)
    ended = time.monotonic()
    assert caught.value.pid == child.pid
    assert chunks.busy_done, "the handler raised in the read's other code"
    assert chunks.waiting_since is not None and ended - chunks.waiting_since <= 20 * KICK_S + SLACK_S
    assert chunks.condition.acquire(blocking=False), "the condition's lock was left held"
    chunks.condition.release()
    del caught  # its traceback holds the read's frames
    gone = weakref.ref(chunks)
    del chunks
    assert wait_until(lambda: gc.collect() >= 0 and gone() is None, timeout_s=10 * KICK_S + SLACK_S), \
        "the iterator of a read that ended is still held"
    child.join(timeout=10.0)
    assert child.exitcode == -signal.SIGKILL
