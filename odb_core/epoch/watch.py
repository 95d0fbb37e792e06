"""A rank watches its DataLoader workers: a worker that dies mid-epoch is an error within seconds, never a hang.

NOTE [ A rank watches its workers ]
torch's DataLoader reads its workers' results from one multiprocessing queue, a pipe. A worker writes a result as
a length header and then the payload, and a payload larger than the pipe (64 KiB) takes several writes: a worker
killed in between (the out-of-memory killer's SIGKILL) leaves the reader blocked on the rest of the message for
ever, since the rank itself holds the pipe's write end and no end-of-file comes. `worker_timeout_s` (the
DataLoader's `timeout`) bounds the wait for a message to start, not this. fork and spawn workers are the rank's
children: a SIGCHLD handler that raises breaks a read blocked on the main thread, and nowhere else (a read in
another thread stays blocked; a read started after the signal blocks too); ODB's raises only inside such a read
(NOTE [ A dead worker's signal ] in child_signal.py). forkserver workers are children of the fork server: no
signal comes at all. So:

- every worker reports its pid when it starts (`Lifeline` sends a `WorkerStarted`, tagged with the `iter()` that
  started it, over a pipe of the stream's `WorkerWatch`), and the rank watches the multiprocessing `Process` torch
  started with that pid (`sentinel`, `exitcode`): a worker ended by anything but torch's own stop (exit code 0)
  has died;
- by default every read runs in a daemon reader thread that hands chunks over a queue of `HOP_DEPTH` (NOTE [ A
  thread reads the workers ] in reader_thread.py); the consumer waits in `POLL_S` slices and looks at the workers
  between them. A worker that died while nothing arrived for `GRACE_S` is an error (the grace is for the end of
  an epoch, where torch stops, and at worst terminates, the workers inside the last fetch);
- with `reader_thread=False`, a read that the SIGCHLD rescue covers (fork or spawn workers, ODB's SIGCHLD
  handler installed, the read on the main thread) stays in the reading thread, after one `poll(0)` of the report
  pipe and the workers' sentinels (~2 µs per chunk, ~1 µs more per worker for the look in `reading`, nothing per
  sample): a worker that died while the rank was busy elsewhere is reported before the rank reads its half message
  (within ~0.05 s against ~1.1 s through the thread); any other read (forkserver workers, a read on another
  thread: `prefetch_steps > 0`) goes through the reader thread all the same.

`WorkerDiedError` names the worker, its pid and how it ended. A reader thread blocked on a half message cannot
be released through any public API and is left behind (a daemon, blocked until the process exits, holding the
dead DataLoader iterator); the surviving workers of that iterator, which nothing can stop any more, are killed.
A stream whose worker died builds a new DataLoader for its next epoch: persistent workers would resume the broken
iterator.
"""

from __future__ import annotations

import multiprocessing
import queue
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from typing import Any, NoReturn

from torch.utils.data import DataLoader

from odb_core.data.worker_files import FileInbox
from odb_core.epoch.child_signal import WorkerExited, install, reading, track
from odb_core.epoch.lifeline import Lifeline, WorkerStarted, rank_alive
from odb_core.epoch.prefetch import Exhausted, Failed, Produced
from odb_core.epoch.reader_thread import POLL_S, READER_THREAD, ReaderThread

__all__ = ["READER_THREAD", "WatchedChunks", "WorkerDiedError", "WorkerWatch"]

GRACE_S = 1.0  # a dead worker and a silent reader for this long: an error


class WorkerDiedError(RuntimeError):
    """A DataLoader worker of this rank died mid-epoch (NOTE [ A rank watches its workers ] in watch.py)."""


@dataclass(slots=True)
class _Worker:
    worker_id: int | None  # None: a worker that died before its report came
    pid: int
    process: BaseProcess | None  # the Process torch started with this pid; None: not found (then pid checks)
    sentinel: int | None  # its `Process.sentinel`, registered with the watch's poller

    def exit_code(self) -> int | None:
        """Its exit code (negative: the signal that ended it); None while it runs, or where unknown."""
        try:
            return self.process.exitcode if self.process is not None else None
        except ValueError:  # its owner closed the Process object
            return None

    def died(self) -> bool:
        """Ended by anything but torch's own stop, which exits with code 0."""
        if self.process is None:
            return not rank_alive(self.pid)
        code = self.exit_code()
        return code is not None and code != 0

    def how(self) -> str:
        code = self.exit_code()
        if code is None:
            return "its exit status is unknown"
        if code >= 0:
            return f"exited with code {code}"
        try:
            return f"killed by signal {-code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"killed by signal {-code}"


class WorkerWatch:
    """The workers of one `SampleStream`'s current `iter()`, learnt from their `WorkerStarted` reports.

    Owned and called by one thread at a time (the stream's reader); a report is drained on every look."""

    def __init__(self, *, rank: int, rank_pid: int, user_init: Any, region_bytes: int = 0) -> None:
        self.rank, self._rank_pid, self._user_init, self._region_bytes = rank, rank_pid, user_init, region_bytes
        self._inbox, self._outbox = multiprocessing.Pipe(duplex=False)
        self._generation = 0
        self._started: DataLoader | None = None  # the loader whose persistent workers run
        self.candidates: dict[int, BaseProcess] = {}  # processes the last `iter()` started, by pid
        self._workers: list[_Worker] = []
        self._poller = select.poll() if hasattr(select, "poll") else None
        self._watch_fd(self._inbox.fileno())
        self.cheap = self._poller is not None  # `quick_dead` sees every known worker (each has a sentinel)
        self.failed = False  # a worker died, or a reader thread outlived its epoch: the stream needs a new DataLoader
        self.inbox: FileInbox | None = None  # the current `iter()`'s workers' files (data/worker_files.py)

    def start(self, loader: DataLoader) -> Iterator[Any]:
        """`iter(loader)`, with the workers it starts watched (the running ones, for persistent workers)."""
        if loader.persistent_workers and self._started is loader:
            return iter(loader)
        self._drain()
        for worker in self._workers:
            if worker.sentinel is not None:
                self._unwatch_fd(worker.sentinel)
        self._workers, self._generation = [], self._generation + 1
        self.cheap = self._poller is not None
        self.close_files()  # the last `iter()`'s workers go: what they still send goes torch's way
        if hasattr(socket, "AF_UNIX"):  # NOTE [ A worker's files travel as descriptors ]
            self.inbox = FileInbox(loader.num_workers)
        loader.worker_init_fn = Lifeline(self._rank_pid, self._user_init, self._outbox, self._generation,
                                         self.inbox.ends if self.inbox is not None else (), self._region_bytes)
        before = {p.pid for p in multiprocessing.active_children()}
        chunks = iter(loader)
        started = {p.pid: p for p in multiprocessing.active_children() if p.pid not in before}
        track(self.candidates, started)  # NOTE [ A dead worker's signal ] in child_signal.py
        install()
        self.candidates = started
        self._started = loader
        return chunks

    def close_files(self) -> None:
        """Close the current workers' socket pairs (data/worker_files.py), if any."""
        if self.inbox is not None:
            self.inbox.close()
            self.inbox = None

    def quick_dead(self) -> _Worker | None:
        """`dead()`, looked at only when one `poll(0)` of the report pipe and the sentinels shows a change."""
        if self._poller is not None and not self._poller.poll(0):
            return None
        return self.dead()

    def dead(self) -> _Worker | None:
        """The first worker of the current `iter()` that died, after reading the reports that arrived."""
        self._drain()
        return next((worker for worker in self._workers if worker.died()), None)

    def error(self, worker: _Worker) -> WorkerDiedError:
        self.failed = True
        number = "" if worker.worker_id is None else f" {worker.worker_id}"
        return WorkerDiedError(
            f"DataLoader worker{number} (pid {worker.pid}) of rank {self.rank} died while the rank was "
            f"reading its samples: {worker.how()}. The epoch cannot go on: a worker killed while it sends a "
            "sample leaves half a message in the DataLoader's pipe (NOTE [ A rank watches its workers ] in "
            "odb_core/epoch/watch.py). A SIGKILL usually comes from the kernel's out-of-memory killer (see "
            "`dmesg`): lower num_workers, prefetch_factor or fetch_chunk, or the memory a worker holds per "
            "sample, then resume from the last checkpoint")

    def kill_survivors(self) -> None:
        """Kill the current `iter()`'s workers that still run (their DataLoader iterator can no longer stop them)."""
        for worker in self._workers:
            if worker.process is not None and worker.exit_code() is None:
                worker.process.kill()

    def _drain(self) -> None:
        try:
            while self._inbox.poll():
                report = self._inbox.recv()
                if isinstance(report, WorkerStarted) and report.generation == self._generation:
                    self._add(report)
        except (OSError, EOFError):  # the pipe is gone (the stream is being collected): nothing left to watch
            pass

    def _add(self, report: WorkerStarted) -> None:
        process = self.candidates.get(report.pid)
        sentinel = process.sentinel if process is not None else None
        self._workers.append(_Worker(report.worker_id, report.pid, process, sentinel))
        if sentinel is not None:
            self._watch_fd(sentinel)
        else:
            self.cheap = False

    def _watch_fd(self, fd: int) -> None:
        if self._poller is not None:
            self._poller.register(fd, select.POLLIN)

    def _unwatch_fd(self, fd: int) -> None:
        if self._poller is not None:
            try:
                self._poller.unregister(fd)
            except KeyError:
                pass


class WatchedChunks(Iterator[Any]):
    """A worker DataLoader's iterator whose `next()` raises `WorkerDiedError` within seconds instead of blocking
    on a dead worker (NOTE [ A rank watches its workers ]). With `direct`, reads on the main thread stay there;
    the first read anywhere else moves every later one to a reader thread."""

    def __init__(self, chunks: Iterator[Any], watch: WorkerWatch, *, direct: bool,
                 prepare: Callable[[Any], Any] | None = None) -> None:
        self._chunks: Iterator[Any] | None = chunks
        self._prepare = prepare  # applied to each chunk, in the reader thread when there is one
        self._watch = watch
        self._direct_thread = threading.main_thread().ident if direct else None
        self._hop: ReaderThread | None = None
        self._ended = False
        self._error: WorkerDiedError | None = None
        self._dead_since: float | None = None

    def __next__(self) -> Any:
        if self._error is not None:
            raise self._error
        if self._ended:
            raise StopIteration
        if self._hop is None and threading.get_ident() == self._direct_thread and self._watch.cheap:
            return self._next_direct()
        return self._next_hopped()

    def _next_direct(self) -> Any:
        try:
            dead = self._watch.quick_dead()
            if dead is None:
                chunk = reading(self._watch.candidates, self._chunks)  # type: ignore[arg-type]
                return chunk if self._prepare is None else self._prepare(chunk)
        except StopIteration:
            self._ended = True
            raise
        except Exception as exc:
            self._raise_named(exc)
        raise self._died(dead)

    def _raise_named(self, exc: Exception) -> NoReturn:
        """Raise torch's "worker exited unexpectedly", or ODB's `WorkerExited` (a direct read broken by its SIGCHLD
        handler, maybe wrapped in torch's error), as a `WorkerDiedError` naming the dead worker; any other error as
        it is."""
        dead = self._watch.dead()
        if dead is None:
            cause = next((e for e in (exc, exc.__cause__, exc.__context__) if isinstance(e, WorkerExited)), None)
            if cause is None:
                raise exc
            dead = _Worker(None, cause.pid, cause.process, None)  # it died before its report came
        raise self._died(dead) from exc

    @property
    def looks_ahead(self) -> bool:
        """Whether a reader thread reads ahead of the consumer (NOTE [ Which lever ] in wait_advice.py)."""
        return self._hop is not None

    def ready(self) -> Any | None:
        """The next chunk if the reader thread already holds it, else None, without waiting (None too for a
        direct read, which cannot look without blocking); raises StopIteration at the end, as `next()` would."""
        if self._hop is None or self._error is not None or self._ended:
            return None
        try:
            message = self._hop.queue.get_nowait()
        except queue.Empty:
            return None
        except Exception as exc:
            self._raise_named(exc)
        return self._unwrap(message)

    def _next_hopped(self) -> Any:
        if self._hop is None:
            self._hop, self._chunks = ReaderThread(self._chunks, self._prepare), None  # type: ignore[arg-type]
        while True:
            try:
                message = self._hop.queue.get(timeout=POLL_S)
            except queue.Empty:
                self._look_while_waiting()
                continue
            except Exception as exc:
                self._raise_named(exc)
            return self._unwrap(message)

    def _unwrap(self, message: Any) -> Any:
        self._dead_since = None
        match message:
            case Produced(item=item):
                return item
            case Exhausted():
                self._ended = True
                raise StopIteration
            case Failed(error=error):
                self._ended = True
                dead = self._watch.dead()
                if dead is None:
                    raise error
                raise self._died(dead) from error
        raise AssertionError(f"unexpected message {message!r}")

    def _look_while_waiting(self) -> None:
        assert self._hop is not None
        dead = self._watch.dead()
        if dead is None:
            self._dead_since = None
        elif self._dead_since is None:
            self._dead_since = time.monotonic()
        elif time.monotonic() - self._dead_since >= GRACE_S:
            raise self._died(dead)
        if not self._hop.thread.is_alive() and self._hop.queue.empty():
            self._ended = True
            raise RuntimeError("ODB's worker reader thread ended without a result")

    def _died(self, worker: _Worker) -> WorkerDiedError:
        self._error = self._watch.error(worker)
        self._chunks = None  # direct: torch's iterator stops its workers when the error's frames are cleared
        if self._hop is not None:
            self._hop.abandon()
            self._watch.kill_survivors()
        return self._error

    def close(self, wait: bool = True) -> None:
        """Stop reading: end the reader thread, if any, and release the DataLoader iterator. With `wait` the thread
        is waited for (up to `GRACE_S`, while it finishes a fetch): persistent workers keep their DataLoader
        iterator for the next epoch, whose `iter()` must not reset it while this thread still reads from it; a
        thread still reading after that makes the next epoch start a new DataLoader (`failed`)."""
        self._ended = True
        self._chunks = None
        if self._hop is not None:
            self._hop.abandon()
            if wait and self._hop.thread is not threading.current_thread():
                self._hop.thread.join(timeout=GRACE_S)
                if self._hop.thread.is_alive():  # still in a fetch (a loaded machine): no reset under it
                    self._watch.failed = True  # the next epoch gets a new DataLoader

    def __del__(self) -> None:
        if not sys.is_finalizing():
            self.close(wait=False)  # collected: nothing reuses its iterator, and a collection must not block
