"""Who reports a dead DataLoader worker of the rank: ODB's watch, at one of the rank's next reads, not a signal
handler at whatever line the main thread happens to run.

NOTE [ A dead worker's signal ]
torch keeps a registry of every DataLoader iterator's worker pids and, at the first `iter()` on the main thread,
installs a SIGCHLD handler that raises its RuntimeError when a registered worker died. A Python signal handler runs
on the main thread at the next point where the interpreter looks for pending signals (a call's entry or return, a
loop's back edge), so that error lands in whatever the main thread runs then: seen in a worker-death test's own
loop, and, with a handler of ODB's that raised the same way (tried and not kept), in `threading.Thread.start` (whose
cleanup then failed with a KeyError), in a new thread and in a collator (wrapped in a `CollateError`); in a
trainer it would be its step or a checkpoint being written. A raise just after a Python `__enter__` took a lock
leaves the lock held (a `threading.Condition`'s, as `multiprocessing.Queue.put` takes it: a later `put` on that
queue, such as torch's shutdown of the iterator, then blocks for good). ODB's watch names a death within seconds
without any handler (NOTE [ A rank watches its workers ] in watch.py), so the signal is narrowed to the one place
that needs it:

- `track` keeps the pids of the workers of ODB's current `iter()`s. torch's handler stays registered for them
  (ODB uses no private part of torch to change that), but ODB's handler calls it and drops its error where a
  worker of ODB's ended with an error and is not reaped yet (torch looks at unreaped children only, so the error
  may be about that worker); any other error of torch's, about another DataLoader's worker, goes on as before;
- `install` puts ODB's handler around torch's, once per process, on the main thread. It finds a worker of the
  direct read under way (`reading`, `reader_thread=False`) that ended with an error, calls torch's handler, wakes
  the kicker, a daemon thread (`odb-sigchld`, started by the process's first direct read, a forked child's own
  included) that sends SIGCHLD to the main thread again every `KICK_S` for as long as that read goes on, and
  raises `WorkerExited` only if the main thread waits in a pipe read (`Connection._recv`) or a selector's
  `select`. The read waits in those for the rest of a message (the half message a worker killed mid-write leaves
  ends only when a handler raises) or for the start of one; neither frame holds a lock that a raise would leave
  held (`multiprocessing.Queue.get` releases its own in a `finally`). Met anywhere else in the read (unpickling,
  torch's bookkeeping, sending indices), the death is left for a later signal: once the read waits, the next kick
  breaks it, and the raise lands in torch's iterator, which the epoch abandons; a read that ends first is followed
  by the next one's own look at the workers, which raises in ODB's code. A raise that lands in a finalizer's wait
  run inside the read (an abandoned iterator's shutdown) is dropped by the interpreter: the kicks go on. A worker
  torch terminates when it is slow to stop at the epoch's end is no death: torch's workers exit with code 0 on
  their parent's SIGTERM. The handler's record of a read and the kicker hold a token of the read, never torch's
  iterator, whose release stops the surviving workers;
- anything outside a direct read waits for the watch: a direct read polls the workers' sentinels before it reads,
  and a reader thread's consumer looks at the workers whenever it waits for a chunk, naming a death after 1 s of
  silence. A worker that dies while the trainer steps is the error of a later `next()`: the next one that reads.

`reading` sets the flag, then looks at the workers once more before the read blocks: a death whose signal was
handled between the sentinel poll and the flag would otherwise go unseen. That look (`waitid` with `WNOWAIT`, ~1 µs
per worker on this project's machine) neither reaps a worker nor reads the report pipe, so the handler may make it
whatever of the watch's code it interrupted; it is made before torch's handler runs, in case a handler before
torch's reaps children.

What is lost, and what else may see it: where no `iter()` of ODB's ran on the main thread (`prefetch_steps > 0`) ODB's
handler is not installed, and torch's, installed by another DataLoader, raises for ODB's workers as before;
`SampleStream.named_failure` then still names the worker where the loader's `next()` meets the error. A thread that
reaps an ODB worker between torch's look and ODB's (the watch of a `prefetch_steps` producer) lets torch's error
through. Where both an ODB worker and another DataLoader's died, torch's error for the other is dropped too (that
DataLoader's own 5 s poll still finds it), and a handler installed before torch's misses that signal. torch's handler
also broke a wait in its own shutdown of an iterator (`Event.set()` on a lock a worker was killed holding, when the kill
came during the wait); for ODB's workers nothing breaks it now (a worker killed holding that lock before the shutdown
began was never covered). Handlers installed before torch's get the kicker's extra SIGCHLDs, with no child to wait for.
The kernel may deliver the worker's SIGCHLD to another thread of the rank (Linux does so only where the main thread has
a signal pending already): the main thread's read is then not interrupted, no handler runs until it is, and nothing
kicks, as with torch's own handler.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import selectors
import signal
import threading
import time
from collections.abc import Iterator, Mapping
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from types import FrameType
from typing import Any

from torch.utils.data import DataLoader

__all__ = ["CHILD_START_METHODS", "KICK_S", "WorkerExited", "direct_reads_rescued", "install", "reading", "track"]

CHILD_START_METHODS = frozenset({"fork", "spawn"})  # start methods whose workers are the rank's own children
KICK_S = 0.05  # how often the kicker signals the main thread while a read whose worker died goes on
KICKER_THREAD = "odb-sigchld"
# where the main thread waits inside a read's pipe: the only frames a raise may interrupt (NOTE above)
_WAITS = frozenset(method.__code__ for method in (Connection._recv, selectors.PollSelector.select,
                                                   selectors.SelectSelector.select))


class WorkerExited(Exception):
    """ODB's handler found a worker ended with an error while the main thread read directly; the read turns it into
    a `WorkerDiedError` naming the worker."""

    def __init__(self, pid: int, process: BaseProcess) -> None:
        super().__init__(f"DataLoader worker (pid {pid}) ended while the rank read from it")
        self.pid, self.process = pid, process


Workers = Mapping[int, BaseProcess]  # the processes an `iter()` started, by pid

_previous: Any = None  # the handler ODB's wraps (torch's), called after ODB's look
_installed = False
_reading: tuple[Workers, Iterator[Any], object] | None = None  # the direct read under way: workers, iterator, token
_declined: object | None = None  # the token of the read the handler last found a death in (never the iterator)
_kick_in, _kick_out = -1, -1  # the kicker's pipe: the handler writes a byte to wake it
_tracked: dict[int, BaseProcess] = {}  # the workers of ODB's current `iter()`s, of every stream, by pid


def track(gone: Workers, started: Workers) -> None:
    """The workers an `iter()` of ODB's started replace those of the one before (`gone`): torch's errors about a dead
    one of them are ODB's to report (NOTE [ A dead worker's signal ])."""
    for pid in gone:
        _tracked.pop(pid, None)
    _tracked.update(started)


def install() -> None:
    """Put ODB's SIGCHLD handler around the current one: once per process, from the main thread only."""
    global _previous, _installed
    if _installed or threading.current_thread() is not threading.main_thread() or not hasattr(os, "waitid"):
        return
    current = signal.getsignal(signal.SIGCHLD)
    _previous = current if callable(current) else None
    signal.signal(signal.SIGCHLD, _on_child_signal)
    _installed = True


def direct_reads_rescued(loader: DataLoader) -> bool:
    """Whether a direct read of `loader`'s workers on the main thread is broken by ODB's handler when one dies: its
    workers are the rank's children (fork, spawn) and ODB's handler is the one installed (someone who replaced it
    sends the reads through the reader thread). Called after `iter(loader)`, when the start method is settled."""
    context = loader.multiprocessing_context
    method = context.get_start_method() if context is not None else multiprocessing.get_start_method(allow_none=True)
    return method in CHILD_START_METHODS and signal.getsignal(signal.SIGCHLD) is _on_child_signal


def reading(workers: Workers, chunks: Iterator[Any]) -> Any:
    """`next(chunks)` on the main thread, during which ODB's handler raises `WorkerExited` for a dead worker of
    `workers` (NOTE [ A dead worker's signal ])."""
    global _reading, _declined, _kick_in, _kick_out
    if _kick_out < 0:  # the first direct read of the process starts the kicker
        kick_in, kick_out = os.pipe()
        os.set_blocking(kick_out, False)
        try:
            threading.Thread(target=_kick, args=(threading.get_ident(), kick_in), name=KICKER_THREAD,
                             daemon=True).start()
        except BaseException:
            os.close(kick_in)
            os.close(kick_out)
            raise
        _kick_in, _kick_out = kick_in, kick_out
    outer, mine = _reading, (workers, chunks, object())
    _reading = mine
    try:
        dead = _exited(workers)  # a death whose signal was handled before the flag
        if dead is not None:
            raise WorkerExited(*dead)
        return next(chunks)
    finally:
        _reading = outer
        if _declined is mine[2]:
            _declined = None


def _exited(workers: Workers) -> tuple[int, BaseProcess] | None:
    """A worker that ended with an error, found without reaping it or reading anything: safe in a signal handler,
    whatever of the watch's code it interrupted."""
    for pid, process in tuple(workers.items()):
        try:
            code = _exit_code(os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT))
        except ChildProcessError:  # reaped already: its Process kept how it ended
            try:
                code = process.exitcode
            except ValueError:  # its owner closed it
                code = None
        if code:
            return pid, process
    return None


def _unreaped_death() -> bool:
    """Whether a worker of ODB's ended with an error and is not reaped yet: what torch's handler looks for (it waits
    with `WNOWAIT` too), so its error may be about that worker."""
    for pid in tuple(_tracked):
        try:
            if _exit_code(os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)):
                return True
        except ChildProcessError:
            pass
    return False


def _exit_code(info: Any) -> int | None:
    """A `waitid` result as an exit code (negative: the signal that ended the child); None while it runs."""
    return None if info is None else info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


def _on_child_signal(signum: int, frame: FrameType | None) -> None:
    global _declined
    current, dead = _reading, None
    if current is not None:
        dead = _exited(current[0])
    if dead is not None:  # kicked until the read ends: also where torch's raise below, or ours, is dropped
        _declined = current[2]
        try:
            os.write(_kick_out, b"k")
        except BlockingIOError:  # the kicker has bytes to read already
            pass
    try:
        if _previous is not None:
            _previous(signum, frame)  # torch's, which raises for any DataLoader's dead worker
    except RuntimeError:
        if not _unreaped_death():  # another DataLoader's worker: torch's error is the caller's
            raise
    if dead is not None and frame is not None and frame.f_code in _WAITS:
        raise WorkerExited(*dead)


def _kick(main: int, wake: int) -> None:
    """The kicker (NOTE [ A dead worker's signal ]): SIGCHLD to the main thread every `KICK_S` while the read the
    handler left be goes on. It holds that read's token, never its iterator."""
    while True:
        try:
            os.read(wake, 64)
        except OSError:
            return
        declined = _declined
        try:
            while declined is not None and _reads(declined):
                time.sleep(KICK_S)
                if _reads(declined):
                    signal.pthread_kill(main, signal.SIGCHLD)
        except Exception:  # noqa: BLE001 - the main thread is gone (the process ends): wait for the next read's kick
            pass


def _reads(token: object) -> bool:
    """Whether the direct read with `token` still goes on."""
    current = _reading
    return current is not None and current[2] is token


def _forget_in_child() -> None:
    """A forked child has no kicker: its first direct read starts its own (and the parent's pipe is not its)."""
    global _kick_in, _kick_out, _reading, _declined
    inherited = (_kick_in, _kick_out)
    _kick_in, _kick_out, _reading, _declined = -1, -1, None, None
    for fd in inherited:
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)
