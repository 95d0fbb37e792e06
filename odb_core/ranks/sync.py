"""Transports: with liveness.py, the only modules that touch `torch.distributed` (an import-linter contract).

A `Transport` moves small int64 vectors between ranks with two collectives, always called in the same order on
every rank (see NOTE [ Rounds and termination ]):
  * `all_gather(values)` once per round: each rank's `RankState` (`STATE_FIELDS`, 10 ints), O(W) ints per rank;
  * `all_reduce_sum(values)` once per round: 6 ints per step of the round (`STEP_SUM_FIELDS`), O(T) ints;
  * under global planning, a second `all_gather` of every buffered item (3 ints each, padded to the longest
    buffer) and `all_to_all_bytes` of the samples that move to another rank (NOTE [ Moving samples ]), or, with a
    move lane, of their facts (3 ints each; the samples travel on the lane's own group: NOTE [ Moves overlap
    training ]).
Three implementations: `LocalTransport` (one process), `GlooTransport` (a dedicated Gloo group, created
collectively on the main thread with a timeout, isolated from the model's process group) and `VirtualTransport`
(W ranks as threads of one process, for tests and simulation of the full loader).

NOTE [ Threads at interpreter exit ]
Issue 31: two-rank runs, plain Trainer runs too, aborted after training had succeeded ("terminate called without
an active exception", SIGABRT, torchrun rc 1). The abort is torch's (pytorch/pytorch#190489), on a Gloo work thread
(`ProcessGroupGloo::runLoop`, caught with a std::terminate handler): it releases a finished collective's Work whose
tensors the Python caller already dropped, which needs the GIL; once the interpreter is finalizing, CPython ends
such a thread with `pthread_exit`, whose forced unwind through the C++ frame calls std::terminate. Under the HF
Trainer the last collective (`store_flos`' all_gather) comes about 5 ms before a script ends. Any thread that
returns into Python from a C++ call made without the GIL dies the same way: ODB's heartbeat (a store call every
`liveness_timeout_s / 4`) and its courier (a collective). So ODB ends its own before the interpreter does:
`GlooTransport.close()` stops and joins the heartbeat and the courier, then destroys ODB's group and drops it,
which joins the group's work threads (their last Work released with the interpreter alive). It runs no collective:
every rank calls it after its last ODB collective, which the others have finished too (the collectives are
lockstep), and destroying a Gloo group is local. `ODBDataLoader.close()` calls it, odb_hf at `on_train_end`; an
`atexit` hook (`_close_at_exit`) closes any transport still open. The model's own group is the user's to destroy
(docs/guides/hf-trainer.md, "Ending a run"; measured in docs/benchmarks.md, "Clean exits").
"""

from __future__ import annotations

import atexit
import logging
import queue
import secrets
import threading
import time
import weakref
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from odb_core.ranks import agreement
from odb_core.ranks.liveness import Liveness

INT64_BYTES = 8
JOIN_TIMEOUT_S = 5.0  # how long close() waits for a helper thread to end (one store call or collective in flight)
logger = logging.getLogger(__name__)


class PeerError(RuntimeError):
    """A metadata collective failed or timed out: a peer rank died, hung, or left the epoch early."""


@dataclass(slots=True)
class TransportStats:
    """Cumulative traffic and latency of the collectives: bytes this rank sent and received, wall seconds."""

    calls: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0


class Transport(ABC):
    """Small int64 collectives among `world_size` ranks. Every rank must call them in the same order."""

    rank: int
    world_size: int
    _agreement: Mapping[str, object] | None = None  # settings to check before the next collective

    def __init__(self) -> None:
        self.stats = TransportStats()
        self._agreement: Mapping[str, object] | None = None

    def require_agreement(self, settings: Mapping[str, object]) -> None:
        """Settings every rank must share, checked before this transport's next collective (NOTE [ Ranks agree on
        their settings ] in agreement.py); raises `DesyncError` there, on every rank, naming the difference."""
        self._agreement = dict(settings)

    def _check_agreement(self) -> None:
        settings, self._agreement = self._agreement, None
        if settings is None or self.world_size == 1:
            return
        names = agreement.differing(settings, self.all_gather(agreement.digests(settings)))
        if names:
            sent = agreement.payload(settings, names)
            raise agreement.mismatch_error(names, self.all_to_all_bytes([sent] * self.world_size))

    def all_gather(self, values: list[int]) -> list[list[int]]:
        """Every rank's `values` (same length on every rank), in rank order."""
        if self._agreement is not None:
            self._check_agreement()
        start = time.perf_counter()
        gathered = self._all_gather(values)
        self._account(len(values), len(values) * self.world_size, start)
        return gathered

    def all_reduce_sum(self, values: list[int]) -> list[int]:
        """Element-wise sum of `values` over ranks (same length on every rank)."""
        if self._agreement is not None:
            self._check_agreement()
        start = time.perf_counter()
        reduced = self._all_reduce_sum(values) if values else []
        self._account(len(values), len(values), start)
        return reduced

    def all_to_all_bytes(self, chunks: list[bytes]) -> list[bytes]:
        """`chunks[r]` goes to rank r; returns the chunk every rank sent to this one, in rank order."""
        if len(chunks) != self.world_size:
            raise ValueError(f"all_to_all_bytes needs one chunk per rank ({self.world_size}), got {len(chunks)}")
        if self._agreement is not None:
            self._check_agreement()
        start = time.perf_counter()
        received = self._all_to_all_bytes(chunks)
        self.stats.calls += 1
        self.stats.bytes_sent += sum(len(c) for r, c in enumerate(chunks) if r != self.rank)
        self.stats.bytes_received += sum(len(c) for r, c in enumerate(received) if r != self.rank)
        self.stats.seconds += time.perf_counter() - start
        return received

    def _account(self, n_sent: int, n_received: int, start: float) -> None:
        self.stats.calls += 1
        self.stats.bytes_sent += n_sent * INT64_BYTES
        self.stats.bytes_received += n_received * INT64_BYTES
        self.stats.seconds += time.perf_counter() - start

    @abstractmethod
    def _all_gather(self, values: list[int]) -> list[list[int]]: ...

    @abstractmethod
    def _all_reduce_sum(self, values: list[int]) -> list[int]: ...

    @abstractmethod
    def _all_to_all_bytes(self, chunks: list[bytes]) -> list[bytes]: ...

    def close(self) -> None:
        """Release resources; the transport must not be used afterwards."""


class LocalTransport(Transport):
    """A single rank: collectives are identities."""

    def __init__(self) -> None:
        super().__init__()
        self.rank, self.world_size = 0, 1

    def _all_gather(self, values: list[int]) -> list[list[int]]:
        return [list(values)]

    def _all_reduce_sum(self, values: list[int]) -> list[int]:
        return list(values)

    def _all_to_all_bytes(self, chunks: list[bytes]) -> list[bytes]:
        return list(chunks)


@dataclass(frozen=True, slots=True)
class _Stop:
    """The courier's last message: end the thread (`_Courier.stop`)."""


class _Courier:
    """Runs blocking collectives on a daemon thread so that the caller can stop waiting when the heartbeat finds a
    peer silent (NOTE [ Liveness ]); the abandoned call stays on that thread until Gloo's own timeout.

    NOTE [ A dropped loader ends its threads ]
    A loader dropped without `close()` (one built per epoch, a notebook cell run again) kept its Gloo groups, their
    sockets and three threads (two couriers and the heartbeat) until the process ended: the courier's frame held its
    last call, whose closure holds the transport. Now the courier drops each call once done, and a collected
    `ODBDataLoader` stops its epoch without leaving it (no collective from a finalizer) and closes what it built,
    as `close()` does (`tests/test_faults.py::test_a_loader_dropped_without_close_ends_its_threads_and_groups`),
    as far as its `__init__` got: a loader refused there (its settings, a stream split for another rank) closes
    the transport it built. The collector may run the finalizer on any thread, the loader's own too (a loader and
    its epoch iterator hold each other, so only the cyclic collector frees them): the courier and the move lane do
    not wait for themselves there.
    """

    def __init__(self) -> None:
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._work, name="odb-collective", daemon=True)
        self._thread.start()

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if isinstance(job, _Stop):
                return
            call, box, done = job
            try:
                box.append((True, call()))
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
                box.append((False, exc))
            done.set()
            del job, call, box, done  # NOTE [ A dropped loader ends its threads ]: a call's closure holds a transport

    def run(self, call, failure) -> object:
        box: list = []
        done = threading.Event()
        self._jobs.put((call, box, done))
        while not done.wait(0.1):
            if failure() is not None:
                raise failure()
        ok, value = box[0]
        if not ok:
            raise value
        return value

    def stop(self, timeout_s: float) -> bool:
        """End the thread after the call in flight, if any; False if that call did not return within `timeout_s`
        (an abandoned collective, which ends at Gloo's own timeout)."""
        self._jobs.put(_Stop())
        if self._thread is threading.current_thread():  # closed from a finalizer the collector ran on this thread
            return True  # (NOTE [ A dropped loader ends its threads ]): it ends after the call it is in
        self._thread.join(timeout_s)
        return not self._thread.is_alive()


class GlooTransport(Transport):
    """A dedicated Gloo group over the initialized default group; every op is bounded by `timeout_s`, and by the
    heartbeat's `liveness_timeout_s` when a peer goes silent (NOTE [ Liveness ]).

    Construction is a collective (`dist.new_group`, then a broadcast of the heartbeat's token): every rank must
    build its loader in the same order, on the main thread. A dead peer makes the next collective raise `PeerError`
    at once (its sockets close), a frozen one within `liveness_timeout_s`, one that is alive but never takes part
    within `timeout_s`.
    """

    def __init__(self, timeout_s: float, liveness_timeout_s: float = 30.0) -> None:
        super().__init__()
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("GlooTransport needs torch.distributed to be initialized (init_process_group)")
        self.timeout_s = timeout_s
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        token = torch.tensor([secrets.randbits(62) if self.rank == 0 else 0], dtype=torch.int64)
        try:
            dist.broadcast(token, src=0, group=self.group)  # this run's heartbeat keys: the same on every rank
        except Exception as exc:  # a peer that died or left after the group was made: ours is destroyed, not leaked
            group, self.group = self.group, None
            dist.destroy_process_group(group)
            raise self._fail("token broadcast", exc) from exc
        self.liveness = Liveness(self.rank, self.world_size, liveness_timeout_s, attempt=f"{int(token):x}")
        self._courier = _Courier()
        _OPEN.add(self)

    def _silent_peer(self) -> PeerError | None:
        failure = self.liveness.failure
        return None if failure is None else PeerError(f"rank {self.rank}: ODB metadata exchange abandoned: {failure}")

    def _collective(self, what: str, call) -> None:
        if self.group is None:
            raise RuntimeError(f"rank {self.rank}: ODB's transport is closed (ODBDataLoader.close()); build a new "
                               "loader to run another epoch")
        try:
            self._courier.run(call, self._silent_peer)
        except PeerError:
            raise
        except Exception as exc:  # gloo raises RuntimeError subclasses with transport-specific types
            raise self._fail(what, exc) from exc

    def _fail(self, what: str, exc: Exception) -> PeerError:
        return PeerError(f"rank {self.rank}: ODB metadata {what} failed (timeout {self.timeout_s:g}s): a peer rank "
                         f"probably died, hung, or stopped iterating early ({type(exc).__name__}: {exc})")

    def _all_gather(self, values: list[int]) -> list[list[int]]:
        local = torch.tensor(values, dtype=torch.int64)
        out = [torch.empty_like(local) for _ in range(self.world_size)]
        self._collective("all_gather", lambda: dist.all_gather(out, local, group=self.group))
        return [t.tolist() for t in out]

    def _all_reduce_sum(self, values: list[int]) -> list[int]:
        tensor = torch.tensor(values, dtype=torch.int64)
        self._collective("all_reduce", lambda: dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group))
        return tensor.tolist()

    def _all_to_all_bytes(self, chunks: list[bytes]) -> list[bytes]:
        sizes = [len(c) for c in chunks]
        incoming = torch.empty(self.world_size, dtype=torch.int64)
        self._collective("all_to_all", lambda: dist.all_to_all_single(incoming, torch.tensor(sizes), group=self.group))
        received = [bytearray(chunks[r]) if r == self.rank else bytearray(n) for r, n in enumerate(incoming.tolist())]
        self._collective("all_to_all", lambda: self._send_and_receive(chunks, received))
        return received  # type: ignore[return-value] # bytearrays: no copy (NOTE [ Sending samples without copies ])

    def _send_and_receive(self, chunks: list[bytes], received: list[bytearray]) -> None:
        """Each non-empty chunk to its rank (a bytearray or numpy uint8 array, from its own memory) and each into
        its own bytearray; `r` is a rank of the group (a node's sub-group numbers its ranks from 0), sent to as its
        world rank."""
        peer = lambda r: dist.get_global_rank(self.group, r)
        works = [dist.irecv(_as_tensor(b), peer(r), self.group) for r, b in enumerate(received)
                 if r != self.rank and len(b)]
        works += [dist.isend(_as_tensor(c), peer(r), self.group) for r, c in enumerate(chunks)
                  if r != self.rank and len(c)]
        for work in works:
            work.wait()

    def close(self) -> None:
        """End ODB's threads and Gloo group (NOTE [ Threads at interpreter exit ]); idempotent. Call it on every
        rank after the last collective; it runs none itself. Cost: up to `JOIN_TIMEOUT_S` per thread still in a
        call (a store call, or a collective abandoned after a peer failed), else a few milliseconds."""
        if self.group is None:
            return
        _OPEN.discard(self)
        stopped = self.liveness.stop(JOIN_TIMEOUT_S) & self._courier.stop(JOIN_TIMEOUT_S)
        group, self.group = self.group, None
        if not stopped:  # a call still in flight holds the group: leave it to that call's timeout
            logger.warning("ODB: a helper thread is still in a store call or collective; ODB's Gloo group is left "
                           "to the process's exit")
            return
        if dist.is_initialized():  # after destroy_process_group() of the default group, ours is gone already
            try:
                dist.destroy_process_group(group)
            except ValueError:  # destroyed by the user already
                pass
        del group  # the last reference: its work threads are joined here


def _as_tensor(chunk: bytes | bytearray | memoryview | np.ndarray) -> torch.Tensor:
    """A chunk's bytes as a uint8 tensor: its own memory for a bytearray or a numpy array, a copy otherwise."""
    if isinstance(chunk, np.ndarray):
        return torch.from_numpy(chunk.reshape(-1).view(np.uint8))
    return torch.frombuffer(chunk if isinstance(chunk, bytearray) else bytearray(chunk), dtype=torch.uint8)


_OPEN: weakref.WeakSet[GlooTransport] = weakref.WeakSet()  # transports not closed yet, for `_close_at_exit`


@atexit.register
def _close_at_exit() -> None:
    """Close the transports still open while the interpreter is whole (NOTE [ Threads at interpreter exit ])."""
    for transport in list(_OPEN):
        transport.close()


def default_transport(timeout_s: float, liveness_timeout_s: float = 30.0) -> Transport:
    """Gloo when torch.distributed is initialized with more than one rank, else a local transport."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return GlooTransport(timeout_s, liveness_timeout_s)
    return LocalTransport()
