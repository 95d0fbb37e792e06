"""A bounded background producer: runs an iterator in one thread and hands items over a queue of depth D.

Messages on the queue are typed (`Produced`, `Failed`, `Exhausted`). An exception in the producer is re-raised
in the consumer's `next()` with its original traceback attached. `close()` (also called on garbage collection
and on Ctrl-C in the consumer) stops the thread; the thread is a daemon, so a producer stuck in a collective
cannot keep the process alive.
"""

from __future__ import annotations

import queue
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

T = TypeVar("T")
POLL_S = 0.1


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
        self._done = False
        self._thread = threading.Thread(target=self._run, args=(source,), name=name, daemon=True)
        self._thread.start()

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
                    return
            self._put(Exhausted())
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, not swallowed
            self._put(Failed(exc))
        finally:
            close = getattr(source, "close", None)
            if close is not None:
                close()

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

    def close(self) -> None:
        """Stop the producer and wait briefly for it; safe to call more than once."""
        self._done = True
        self._stop.set()
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5.0)

    def __del__(self) -> None:
        if not sys.is_finalizing():  # at interpreter exit the queue module may already be torn down
            self.close()
