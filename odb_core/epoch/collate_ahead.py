"""The next step collated in a thread while the consumer trains on the current one.

NOTE [ Collating the next step ahead ]
A step is collated when it is taken (NOTE [ A step is collated when it is taken ] in collation.py), by the thread
that runs the epoch, between the consumer's steps: the device waits for it. For text that is ~0.1-0.5 ms per step;
for a VLM step it is the concatenation of every sample's `pixel_values`, ~125 ms for a step of 67 images of 2 MB
on this project's 2-core machine. So when the consumer takes step k, the next step already released is handed to
a thread (`odb-collate`) that collates it while step k trains; the consumer's next `next()` takes that
batch (waiting for it if it is not done) or collates inline a step that was not handed over (the first step of a
round is released only after the round's plan). The copies that make up most of a collation (`torch.cat`, numpy's
row copies) release the GIL; its Python part is a few tens of µs per step.
  * Same batches: a collation is a pure function of the step's samples, whichever thread runs it.
  * Memory: at most one collated batch ahead of the consumer's.
  * Errors: a collation that fails in the thread is raised by the `next()` of its step, which then releases the
    worker iterator (the thread never touches the reader, so the consumer's reads between them are unaffected).
  * Only steps collated when taken (a label-preserving collator); a step with a plan-time batch needs nothing.
    Off with `collate_ahead=False`, and with `prefetch_steps > 0`, whose producer thread already collates ahead.
  * The thread ends with its epoch (its end, `close()`, leaving it), and at interpreter exit after the collation
    it may be running (a daemon thread stopped inside a torch operator would abort the process).
  * The step just taken goes to the thread with the next one, which drops it there: freeing a torch tensor
    releases the GIL, so the consumer that freed a step's samples (two tensors each, ~34 for a text step) handed
    the GIL to the reader thread at each one and waited to get it back, ~0.56 ms per step of ~24 ms on one rank
    at 2 ms per sample (0.40 s of a 17.6 s epoch: docs/benchmarks.md, "The data wait's parts").
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from odb_core.epoch.collation import Collation, PlannedStep

COLLATE_THREAD = "odb-collate"
ODB_THREADS = "odb-"  # the names of the threads ODB starts begin so


class CollateAhead:
    """One epoch's collation of its steps, the next one ahead in a thread when `enabled`.

    The thread is a `ThreadPoolExecutor`'s: at interpreter exit the executor lets a collation in progress finish
    and the thread end before the interpreter goes down (a daemon thread stopped inside a torch operator aborts the
    process: "terminate called without an active exception")."""

    def __init__(self, collation: Collation, enabled: bool) -> None:
        self.collation = collation
        self.enabled = enabled and collation.from_samples
        self._pool: ThreadPoolExecutor | None = None
        self._step: PlannedStep | None = None  # the step handed to the thread, until it is taken
        self._future: Future[Mapping[str, Any]] | None = None

    def take(self, step: PlannedStep) -> Mapping[str, Any]:
        """`step`'s collated batch: the thread's, if it was handed over, else collated here."""
        if step is not self._step or self._future is None:
            return self.collation.take(step)
        future, self._step, self._future = self._future, None, None
        try:
            return future.result()
        except BaseException:
            self.collation.release()
            raise

    def start(self, step: PlannedStep, taken: PlannedStep | None = None) -> None:
        """Collate `step` in the thread, unless a step is already handed over or it needs no collation; the
        thread also drops `taken`, the step the consumer just took, whose samples are then freed there (the last
        reference, once the consumer's `next()` returned)."""
        if not self.enabled or self._future is not None or step.batch is not None:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=COLLATE_THREAD)
        self._step, self._future = step, self._pool.submit(_collate_dropping, self.collation, step, [taken])

    def close(self) -> None:
        """End the thread, after the collation it may be running; a batch collated ahead is dropped, and the
        collator's reusable memory that no batch uses is given back (`PadCollator.release_memory`). Called on one
        of ODB's own threads, it is a garbage collection there that finalized the loader, maybe inside this pool's
        `submit` (the thread that runs the next round ahead), which holds the lock `shutdown` takes: the pool is
        only let go then, and its thread ends once the pool is collected, after the collation it may be running
        (`shutdown` there hung that thread, and every later `submit` of the process with it: seen once in the
        suite). No step is collated ahead after it (a round run ahead that outlived a close)."""
        self._step, self._future, self.enabled = None, None, False
        pool, self._pool = self._pool, None
        if pool is not None and not threading.current_thread().name.startswith(ODB_THREADS):
            pool.shutdown(wait=True, cancel_futures=True)
        release = getattr(self.collation.collate_fn, "release_memory", None)  # NOTE [ Reused collation memory ]
        if callable(release):
            release()


def _collate_dropping(collation: Collation, step: PlannedStep, taken: list[PlannedStep | None]) -> Mapping[str, Any]:
    """`step`'s batch, collated in the thread, after dropping the step just taken (see the NOTE): it comes in a
    list that the job empties first, so that its samples go before the collation, not with the job's arguments
    after it (one more step's samples alive: +40-60 MiB over 1 MiB samples in `benchmarks.buffer_memory`)."""
    taken.clear()
    return collation.take(step, False)
