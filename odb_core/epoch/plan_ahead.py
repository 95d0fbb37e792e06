"""The next round run in a thread while the consumer trains on the round's last step.

NOTE [ Planning the next round ahead ]
Within a round the device never waits for the loader: the round's steps are released at once, the next step is
collated ahead (NOTE [ Collating the next step ahead ]) and the next fill's samples are read while the steps train
(NOTE [ Reading ahead ]). Between rounds it did: the `next()` after a round's last step pulled the rest of the next
fill, admitted it, ran the round's exchanges and its plan, counted, all_reduced and collated the new round's first
step, all on the consumer's thread, while the device idled (at two Gloo ranks fed faster than they train, ~0.4 s
of a ~10 s epoch, `benchmarks.overlap`). So once the consumer takes the last released step and the epoch is not
over, that next `next()` runs at once in a thread of its own (`odb-plan`), while the step trains, and the
consumer's `next()` takes its step (waiting for what is left of it).
  * Same batches, same collectives in the same order: the job is exactly the `next()` it replaces, and the
    consumer touches the epoch again only once the job has ended; the loader's own collectives outside an epoch
    (`estimate_steps`, `plan_epochs_exactly`) wait for it first, and every rank must set the same `plan_ahead`
    (checked when the loaders are built). Nothing depends on the thread's timing (G7).
  * Resume: the job records its round's start in the `RoundLog` as a round run inline would; the saved position
    stays at the step the consumer took last (NOTE [ Exact resume ]), as with `prefetch_steps`.
  * Errors: what the job raises (a bad sample, a dead worker or peer) is raised by the consumer's next `next()`.
  * Leaving (NOTE [ Leaving an epoch ]) waits for the job, so the leaving exchange comes after the job's round,
    as on the peers. The job ran a round the consumer never asked for: if it failed before the round's plan or
    after its all_reduce (a bad sample in the fill, the first step's collation), the rank still leaves, at the
    position inline leaving would have taken or the one after the completed round, and the error is logged; a
    failure between them (a collator counted at plan time, a move made in line, a peer's failure) may leave the
    peers inside the round, so the epoch is not left (they get `PeerError`) and the leave raises
    `RoundAheadError` with the job's error (the rank cannot go on in step with its peers).
  * With workers, the job's reads go through a reader thread even with `reader_thread=False` (a read from a
    second thread moves every later one there: NOTE [ A rank watches its workers ] in watch.py).
  * Closing while an error propagates (NOTE [ A failed epoch is not left ]) waits at most `CLOSE_WAIT_S` for the
    job: its peers may be stuck in the failed step's own collectives and never come to the job's exchange.
  * The GIL: the job's Python work (planning, counting) runs beside one step per round. A training loop that
    launches kernels then gets the GIL back later, but at most by the job's own CPU time, which inline the device
    waited for in full. Off with `plan_ahead=False`, and with `prefetch_steps > 0`, whose producer thread already
    runs ahead. The loader's `observer` is called on the thread that runs the round.
  * `odb/data_wait_*` (NOTE [ Waiting for data ]): the job counts its reading and exchange seconds apart
    (`WaitParts`); the consumer's `next()` adds them to `LoaderMetrics` in the share of the job it waited for
    (which part it waited for is not known), so the parts never exceed the wait they split.
  * A daemon thread, as the `prefetch_steps` producer: a job stuck in an exchange with a peer that will not come
    must not hold the process's exit (its peers would wait for a live rank); an `atexit` hook first gives a
    running job `CLOSE_WAIT_S` to end (stopped inside a torch call while the interpreter finalizes, a thread
    aborts the process: NOTE [ Threads at interpreter exit ] in odb_core/ranks/sync.py).
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Generic, TypeVar

from odb_core.steps.metrics import LoaderMetrics

T = TypeVar("T")
PLAN_THREAD = "odb-plan"
CLOSE_WAIT_S = 5.0  # how long closing an epoch without leaving it (an error, exit) waits for a running job
logger = logging.getLogger(__name__)


@dataclass(slots=True)
class WaitParts:
    """The seconds an epoch's `next()` spent reading and in exchanges, until added to the loader's metrics."""

    read_seconds: float = 0.0
    sync_seconds: float = 0.0

    def add_to(self, metrics: LoaderMetrics, share: float = 1.0) -> None:
        metrics.read_seconds += self.read_seconds * share
        metrics.sync_seconds += self.sync_seconds * share
        self.read_seconds = self.sync_seconds = 0.0


class RoundAheadError(RuntimeError):
    """A round run ahead failed inside its collectives, so the epoch could not be left in step with the peers."""


class PlanAhead(Generic[T]):
    """One epoch's job that runs the next `next()` ahead, at most one at a time (see the NOTE)."""

    def __init__(self, parts: WaitParts, metrics: LoaderMetrics) -> None:
        self.parts, self.metrics = parts, metrics
        self._future: Future[T] | None = None
        self._thread: threading.Thread | None = None
        self._seconds = 0.0  # the last job's wall seconds

    @property
    def pending(self) -> bool:
        return self._future is not None

    def start(self, produce: Callable[[], T]) -> None:
        """Run `produce` on a thread of its own; where no thread can start (a process at its thread limit), no job
        is pending and the next `next()` runs in line (before, the job stayed pending unrun: that `next()` raised
        and the one after waited for good)."""
        future: Future[T] = Future()
        thread = threading.Thread(target=self._run, args=(produce, future), name=PLAN_THREAD, daemon=True)
        _RUNNING.add(thread)
        try:
            thread.start()
        except RuntimeError as exc:
            _RUNNING.discard(thread)
            logger.warning("ODB: the thread that plans the next round ahead could not start (%s); the round runs "
                           "in the next next() instead", exc)
            return
        self._future, self._thread = future, thread

    def _run(self, produce: Callable[[], T], future: Future[T]) -> None:
        started = time.perf_counter()
        try:
            result = produce()
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, not swallowed
            self._seconds = time.perf_counter() - started
            future.set_exception(exc)
        else:
            self._seconds = time.perf_counter() - started
            future.set_result(result)
        finally:
            _RUNNING.discard(threading.current_thread())

    def take(self) -> T:
        """The job's step (or its error, or StopIteration). The job's reading and exchange seconds go to the metrics
        in the share of it the consumer waited for. An interrupted wait (Ctrl-C) leaves the job pending."""
        future = self._future
        assert future is not None, "take() without a job"
        asked = time.perf_counter()
        try:
            result = future.result()
        except BaseException as exc:
            if not future.done() or future.exception() is not exc:  # the wait was interrupted, not the job
                raise
            self._took(asked)
            raise
        self._took(asked)
        return result

    def _took(self, asked: float) -> None:
        self._future = None
        waited = time.perf_counter() - asked
        self.parts.add_to(self.metrics, min(1.0, waited / self._seconds) if self._seconds > 0 else 1.0)

    def wait(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for the job to end, leaving its result to `take()`/`settle()`; whether it ended."""
        future = self._future
        if future is None or self.on_own_thread():
            return True
        try:
            future.exception(timeout=timeout_s)
        except FutureTimeout:
            return False
        return True

    def settle(self, timeout_s: float) -> tuple[bool, BaseException | None]:
        """Wait up to `timeout_s` for the job, dropping its step: (whether it ended, what it raised, StopIteration
        aside). From the job's own thread (a finalizer that ran there) it does not wait: a thread cannot wait for
        itself."""
        if self.on_own_thread():
            return True, None
        if not self.wait(timeout_s):
            return False, None
        future, self._future = self._future, None
        if future is None:
            return True, None
        self.parts.add_to(self.metrics, 0.0)  # a job nobody waited for: no part of any wait
        error = future.exception()
        return True, None if isinstance(error, StopIteration) else error

    def on_own_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def close(self, timeout_s: float = CLOSE_WAIT_S) -> None:
        """Settle the job without leaving anything (its error is the closed epoch's: logged); a job still running
        after `timeout_s` is left to end on its own (a daemon thread)."""
        ended, error = self.settle(timeout_s)
        if not ended:
            logger.warning("ODB: the round run ahead did not end within %.0fs (its reads or exchanges are still "
                           "waiting); it is left to end on its own", timeout_s)
        elif error is not None:
            logger.debug("ODB: the round run ahead of a closed epoch failed: %s: %s", type(error).__name__, error)


_RUNNING: weakref.WeakSet[threading.Thread] = weakref.WeakSet()  # job threads that may still run


@atexit.register
def _wait_at_exit() -> None:
    """Give running jobs `CLOSE_WAIT_S` to end while the interpreter is whole (see the NOTE)."""
    for thread in list(_RUNNING):
        thread.join(CLOSE_WAIT_S)
