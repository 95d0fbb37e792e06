"""A chunk a DataLoader worker's queue cannot send goes again, its failing samples named, instead of being lost.

NOTE [ A chunk the feeder cannot send ]
A DataLoader worker puts each result, `(task index, chunk)`, on a `multiprocessing` queue, whose feeder thread
pickles it; torch's reducer moves every tensor not yet in shared memory into a shared-memory file there. If that
pickling raises, the standard library's hook for it (`Queue._on_queue_feeder_error`) prints the traceback and the
result is lost: no worker died, so nothing else reports it, and the rank waits for it forever. `sendable`'s probe
and `share_large` (NOTE [ Samples that cannot travel ], NOTE [ Shared memory runs out ] in sendable.py) catch what
they can foresee in the worker, before the chunk is put; what is left reaches the feeder: a full /dev/shm met by a
sparse or nested tensor or by one deeper than `share_large` looks, and any object whose pickling fails only there.
So every ODB worker replaces that hook (`guard_feeder`, called by `Lifeline` before the worker's first result), and
when the result is one of ODB's chunks (`WorkerChunk`, what the workers' collate function returns):

  * each sample is pickled alone, in the feeder thread, as the feeder would have (what succeeds is now in shared
    memory; the probe unpickles it again, which closes the descriptors the pickling registered); one that fails is
    replaced by an `Unsendable` naming the field that failed (looked for 8 levels down) and the error, with
    /dev/shm's size and the fixes when it ran out of space: the rank raises a `SampleError` naming the sample;
  * where no sample fails alone, the chunk goes again as it was, once (the failure may have been transient); if it
    fails again with no sample failing alone, each of its samples goes as an `Unsendable` saying so, as it does if
    naming the failing field itself raises;
  * the new chunk is put back at the head of the queue's buffer, where the lost one stood: a worker's results must
    reach the rank in the order it put them (an iterable dataset's worker puts its end marker right after its last
    chunk, and the DataLoader forgets a worker's pending task once it sees that marker).

Each pass turns at least one more sample into an `Unsendable`, or is the first or second pass with none failing
alone, so a chunk is sent at most its length + 2 times (a chunk of `Unsendable`s, ints and strings, pickles).
Anything else keeps the standard hook's printed traceback: a result that is not ODB's (a queue of the user's in the
worker), a failure to write a message already pickled, a queue closed while the worker stops or already
collected, a full bounded queue, and an error inside the hook itself (which must not end the feeder thread).
Tests: tests/test_feeder.py (a field that pickles everywhere but in the feeder: always, once, every other time,
beside a sample the worker's own probe named, and from an iterable dataset's last chunk; under fork, spawn and
forkserver), tests/test_shared_memory.py (a sparse, a nested and a 5-level-deep image under a 16 MiB /dev/shm).
A pickling that failed leaves the descriptors it had registered with the worker's `resource_sharer` until the
worker exits (with persistent workers, their files' pages too): only on this path.
"""

from __future__ import annotations

import multiprocessing.queues
import traceback
import weakref
from collections.abc import Iterable, Mapping
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch

from odb_core.data.sendable import SHARED_FILES, Unsendable, shm_advice

_DEPTH = 8  # levels `_failing_field` looks down for the field that fails


class WorkerChunk(list):
    """A worker's result: its tagged samples, `(index, sample)` pairs. It pickles as a plain list; in the worker,
    the type tells the feeder's hook which results are ODB's, and `resent` whether this one was sent again."""

    __slots__ = ("resent",)

    def __init__(self, pairs: Iterable[tuple[int, Any]] = (), resent: bool = False) -> None:
        super().__init__(pairs)
        self.resent = resent

    def __reduce__(self) -> tuple[type, tuple[list]]:
        return list, (list(self),)


class _Hook:
    """`Queue._on_queue_feeder_error` in an ODB worker: looked up on the queue when its feeder thread starts (at
    the first `put`), it binds to the queue through a weak reference, so a queue the worker drops is still
    collected (the feeder thread keeps its hook)."""

    def __get__(self, queue: Any, owner: type | None = None) -> Any:
        if queue is None:
            return self
        ref = weakref.ref(queue)
        return lambda error, result: resend_named(ref(), error, result)

    def __call__(self, error: Exception, result: Any) -> None:  # called on the class: the standard hook's print
        traceback.print_exception(error)


def guard_feeder() -> None:
    """In a worker process, before its first result: its queues' feeder errors go to `resend_named`."""
    multiprocessing.queues.Queue._on_queue_feeder_error = _Hook()


def resend_named(queue: multiprocessing.queues.Queue | None, error: Exception, result: Any) -> None:
    """The feeder thread's hook (NOTE above): `result` put back with its failing samples named, or the standard
    hook's printed traceback."""
    try:
        message = _named_again(error, result) if queue is not None else None
        if message is not None and _put_back(queue, message):
            return
    except Exception:  # noqa: BLE001 - the feeder thread must go on sending the worker's later results
        traceback.print_exc()
    traceback.print_exception(error)  # what the standard hook prints


def _named_again(error: Exception, result: Any) -> tuple[int, WorkerChunk] | None:
    """What to send in place of `result`, or None if it is not one of ODB's chunks."""
    if not (isinstance(result, tuple) and len(result) == 2 and type(result[1]) is WorkerChunk):
        return None
    task, chunk = result
    try:
        named = [(index, _sent_or_why(sample)) for index, sample in chunk]
    except Exception as failure:  # noqa: BLE001 - naming failed: the samples still go, named by the error alone
        return task, _every_sample(chunk, f"could not be sent to the rank ({type(error).__name__}: {error}); naming "
                                          f"the field that failed raised {type(failure).__name__}: {failure}", error)
    unchanged = all(new is old for (_, new), (_, old) in zip(named, chunk, strict=True))
    if unchanged and chunk.resent:
        return task, _every_sample(chunk, f"could not be sent to the rank twice ({type(error).__name__}: {error}), "
                                          "although each sample pickles alone", error)
    return task, WorkerChunk(named, resent=chunk.resent or unchanged)


def _every_sample(chunk: WorkerChunk, what: str, error: Exception) -> WorkerChunk:
    """`chunk` with each sample an `Unsendable` saying that the chunk `what`."""
    cause = f"the chunk of samples {[index for index, _ in chunk]} {what}{shm_advice(error)}"
    return WorkerChunk(((index, Unsendable(cause)) for index, _ in chunk), resent=True)


def _put_back(queue: multiprocessing.queues.Queue, message: Any) -> bool:
    """Put `message` at the head of `queue`'s buffer, which the feeder sends next; False if the queue is closed or
    full (the feeder released the lost result's slot before the hook, but a bounded queue's `put` may have taken
    it since)."""
    with queue._notempty:
        if queue._closed or not queue._sem.acquire(False):
            return False
        queue._buffer.appendleft(message)
        queue._notempty.notify()
    return True


def _sent_or_why(sample: Any) -> Any:
    """`sample` if it pickles as the feeder pickles it, else an `Unsendable` naming the field and the error."""
    failure = _failing_field(sample, "", _DEPTH)
    if failure is None:
        return sample
    path, value, error = failure
    where, how = f"field {path!r}" if path else "the sample", ""
    if isinstance(value, torch.Tensor):  # a nested tensor has no `shape` to show (torch refuses it)
        kind = (f"nested {value.dtype} tensor of {value.size(0)} parts" if value.is_nested
                else f"{value.layout} {value.dtype} tensor of shape {tuple(value.shape)}")
        where, how = f"{where} (a {kind})", SHARED_FILES
    return Unsendable(f"{where} could not be pickled to leave its DataLoader worker ({type(error).__name__}: "
                      f"{error}){how}{shm_advice(error)}")


def _failing_field(value: Any, path: str, depth: int) -> tuple[str, Any, Exception] | None:
    """(path, value, error) of the deepest part of `value` that fails to pickle, within `depth` levels; None if
    `value` pickles."""
    error = _pickling_error(value)
    if error is None:
        return None
    if depth > 0 and not isinstance(value, torch.Tensor):
        if isinstance(value, Mapping):
            parts: Iterable[tuple[str, Any]] = ((f"{path}.{key}" if path else str(key), inner)
                                                for key, inner in value.items())
        elif isinstance(value, list | tuple):
            parts = ((f"{path}[{k}]", inner) for k, inner in enumerate(value))
        else:
            parts = ()
        for inner_path, inner in parts:
            deeper = _failing_field(inner, inner_path, depth - 1)
            if deeper is not None:
                return deeper
    return path, value, error


def _pickling_error(value: Any) -> Exception | None:
    """What pickling `value` as the feeder does raises, or None. A pickling that succeeds registered a duplicate of
    each shared file's descriptor with this worker's `resource_sharer`, for a receiver to fetch; unpickling it here
    fetches and closes them."""
    try:
        pickled = ForkingPickler.dumps(value)
    except Exception as error:  # noqa: BLE001 - any pickling error is the answer
        return error
    try:
        ForkingPickler.loads(pickled)
    except Exception:  # noqa: BLE001 - what it only costs is descriptors left open until the worker exits
        pass
    return None
