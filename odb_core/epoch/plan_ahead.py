"""The next round run in a thread while the consumer trains on the round's last step.

NOTE [ Planning the next round ahead ]
Within a round the device never waits for the loader: the round's steps are released at once, the next step is
collated ahead (NOTE [ Collating the next step ahead ]) and the next fill's samples are read while the steps train
(NOTE [ Reading ahead ]). Between rounds it did: the `next()` after a round's last step pulled the rest of the next
fill, admitted it, ran the round's exchanges and its plan, counted, all_reduced and collated the new round's first
step, all on the consumer's thread, while the device idled (at two Gloo ranks fed faster than they train, ~0.4 s
of a ~10 s epoch, `benchmarks.overlap`). So once the consumer takes the last released step and the epoch is not
over, that next `next()` runs at once on a one-thread executor (`odb-plan`), while the step trains, and the
consumer's `next()` takes its step (waiting for what is left of it).
  * Same batches, same collectives in the same order: the job is exactly the `next()` it replaces, and the
    consumer touches the epoch again only once the job has ended. Nothing depends on the thread's timing (G7).
  * Resume: the job records its round's start in the `RoundLog` as a round run inline would; the saved position
    stays at the step the consumer took last (NOTE [ Exact resume ]), as with `prefetch_steps`.
  * Errors: what the job raises (a bad sample, a dead worker or peer) is raised by the consumer's next `next()`.
  * Leaving an epoch (NOTE [ Leaving an epoch ]) and closing it first wait for the job (a round every rank runs
    alike, or a step that the consumer will not take), so the leaving exchange comes after the job's round.
  * The GIL: the job's Python work (planning, counting) runs beside one step per round. A training loop that
    launches kernels then gets the GIL back later, but at most by the job's own CPU time, which inline the device
    waited for in full. Off with `plan_ahead=False`, and with `prefetch_steps > 0`, whose producer thread already
    runs ahead.
  * `odb/data_wait_*` (NOTE [ Waiting for data ]): the consumer's wait is the part of the job it waited for; the
    job's seconds of reading and exchanges count towards their parts of the wait in that proportion.
  * An executor, not a daemon thread: at interpreter exit a thread stopped inside a torch call (a collator, a
    collective's work) aborts the process; the executor lets the job end first.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Generic, TypeVar

from odb_core.steps.metrics import LoaderMetrics

T = TypeVar("T")
PLAN_THREAD = "odb-plan"
logger = logging.getLogger(__name__)


class PlanAhead(Generic[T]):
    """One epoch's job that runs the next `next()` ahead, at most one at a time (see the NOTE)."""

    def __init__(self, metrics: LoaderMetrics) -> None:
        self.metrics = metrics
        self._pool: ThreadPoolExecutor | None = None
        self._future: Future[T] | None = None
        self._parts = (0.0, 0.0, 0.0)  # the job's read seconds, sync seconds and wall seconds

    @property
    def pending(self) -> bool:
        return self._future is not None

    def start(self, produce: Callable[[], T]) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=PLAN_THREAD)
        self._future = self._pool.submit(self._timed, produce)

    def _timed(self, produce: Callable[[], T]) -> T:
        metrics, started = self.metrics, time.perf_counter()
        read, sync = metrics.read_seconds, metrics.sync_seconds
        try:
            return produce()
        finally:
            self._parts = (metrics.read_seconds - read, metrics.sync_seconds - sync, time.perf_counter() - started)

    def take(self) -> T:
        """The job's step (or its error, or StopIteration); the job's reading and exchange seconds count as parts
        of the consumer's wait in the share of the job it waited for."""
        future, self._future = self._future, None
        assert future is not None, "take() without a job"
        asked = time.perf_counter()
        try:
            return future.result()
        finally:
            read, sync, seconds = self._parts
            overlapped = 1.0 - min(1.0, (time.perf_counter() - asked) / seconds) if seconds > 0 else 0.0
            self.metrics.read_seconds -= read * overlapped
            self.metrics.sync_seconds -= sync * overlapped

    def settle(self, timeout_s: float) -> BaseException | None:
        """Wait up to `timeout_s` for the job, dropping its step; what it raised (StopIteration aside), else None.
        A job still running after that is left to end on its own (logged). From the job's own thread (a finalizer
        that ran there) it does not wait: a thread cannot wait for itself."""
        if threading.current_thread().name.startswith(PLAN_THREAD):
            return None
        future, self._future = self._future, None
        if future is None:
            return None
        try:
            future.result(timeout=timeout_s)
        except FutureTimeout:
            logger.warning("ODB: the round planned ahead did not end within %.0fs (its reads or exchanges are still "
                           "waiting); it is left to end on its own", timeout_s)
        except StopIteration:
            pass
        except BaseException as exc:  # noqa: BLE001 - returned to the caller, which decides
            return exc
        return None

    def close(self, timeout_s: float) -> None:
        """Settle the job (its error is the epoch's, which is being closed: logged) and end the thread."""
        error = self.settle(timeout_s)
        if error is not None:
            logger.debug("ODB: the round planned ahead of a closed epoch failed: %s: %s", type(error).__name__, error)
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
