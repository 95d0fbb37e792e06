"""A bounded background producer: runs an iterator in one thread and hands items over a queue of depth D.

Messages on the queue are typed (`Produced`, `Failed`, `Exhausted`). An exception in the producer is re-raised
in the consumer's `next()` with its original traceback attached. `close()` (also called on garbage collection
and on Ctrl-C in the consumer) stops the thread; the thread is a daemon, so a producer stuck in a collective
cannot keep the process alive. `close(leave=True)` lets the producer finish what it is in and then call the
source's `leave()` on its own thread (NOTE [ Leaving an epoch ] in pipeline.py), and waits for that. A producer
still running at interpreter exit is stopped by an atexit hook first: inside a torch call when the interpreter
finalizes, it would abort the process (NOTE [ Threads at interpreter exit ] in odb_core/ranks/sync.py).
"""

from __future__ import annotations

import atexit
import logging
import queue
import sys
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

T = TypeVar("T")
POLL_S = 0.1
EXIT_TIMEOUT_S = 5.0  # at exit, how long to wait for a producer to finish the item it is producing
logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Produced(Generic[T]):
    item: T


@dataclass(frozen=True, slots=True)
class Failed:
    error: BaseException


@dataclass(frozen=True, slots=True)
class Exhausted:
    pass


class BackgroundIterator(Iterator[T]):
    """Iterate `source` in a daemon thread, at most `depth` items ahead of the consumer."""

    def __init__(self, source: Iterator[T], depth: int, name: str = "odb-producer") -> None:
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max(depth, 1))
        self._stop = threading.Event()
        self._leave = threading.Event()
        self._done = False
        self._thread = threading.Thread(target=self._run, args=(source,), name=name, daemon=True)
        self._thread.start()
        _RUNNING.add(self)

    def _put(self, message: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(message, timeout=POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def _run(self, source: Iterator[T]) -> None:
        try:
            for item in source:
                if not self._put(Produced(item)):
                    self._leave_if_asked(source)
                    return
            self._put(Exhausted())
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, not swallowed
            self._put(Failed(exc))
        finally:
            close = getattr(source, "close", None)
            if close is not None:
                close()

    def _leave_if_asked(self, source: Iterator[T]) -> None:
        leave = getattr(source, "leave", None)
        if not self._leave.is_set() or leave is None:
            return
        try:
            leave()
        except Exception as exc:  # noqa: BLE001 - nobody consumes any more; say it instead
            logger.warning("ODB: leaving the epoch early failed (%s: %s); the next epoch's first exchange will "
                           "report the same peer problem", type(exc).__name__, exc)

    def __next__(self) -> T:
        if self._done:
            raise StopIteration
        while True:
            try:
                message = self._queue.get(timeout=POLL_S)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    self._done = True
                    raise RuntimeError("ODB producer thread ended without a result") from None
        match message:
            case Produced(item=item):
                return item
            case Exhausted():
                self._done = True
                raise StopIteration
            case Failed(error=error):
                self._done = True
                raise error
        raise AssertionError(f"unexpected message {message!r}")

    def close(self, leave: bool = False, timeout_s: float = 5.0) -> None:
        """Stop the producer and wait up to `timeout_s` for it, and without `leave` at most `EXIT_TIMEOUT_S` (no peer
        is awaited then: an error's close, a finalizer's); safe to call more than once. With `leave`, the producer
        first finishes its current work and calls the source's `leave()` (NOTE [ Leaving an epoch ])."""
        if leave:
            self._leave.set()
        self._done = True
        self._stop.set()
        _RUNNING.discard(self)
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=timeout_s if leave else min(timeout_s, EXIT_TIMEOUT_S))
            if self._thread.is_alive() and leave:
                logger.warning("ODB: the producer did not leave the epoch within %.0fs (a peer rank neither "
                               "continued nor left it)", timeout_s)

    def __del__(self) -> None:
        if not sys.is_finalizing():  # at interpreter exit the queue module may already be torn down
            self.close()


_RUNNING: weakref.WeakSet[BackgroundIterator] = weakref.WeakSet()  # producers not closed yet


def unwinding() -> bool:
    """Whether the caller runs while an exception is handled, or passes through a `finally:` (NOTE [ A failed
    epoch is not left ] in pipeline.py): a loader closed then did not stop on purpose. The end of an iteration
    (StopIteration) and a generator's close (GeneratorExit) are ways to stop on purpose, not errors."""
    exc = sys.exc_info()[1]
    return exc is not None and not isinstance(exc, StopIteration | StopAsyncIteration | GeneratorExit)


@atexit.register
def _stop_at_exit() -> None:
    """Stop the producers still running while the interpreter is whole; none leaves its epoch (no collective)."""
    for producer in list(_RUNNING):
        producer.close(timeout_s=EXIT_TIMEOUT_S)
