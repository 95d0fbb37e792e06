"""A heartbeat beside the Gloo metadata group: a frozen or unreachable peer is noticed in seconds, not minutes.

NOTE [ Liveness ]
A peer that dies closes its sockets (its workers die with it: NOTE [ Workers die with their rank ]), and Gloo fails
at once. A peer whose process is frozen (SIGSTOP, a hung node, a network partition) keeps them open, and a
collective would wait the whole `sync_timeout_s`, which must stay long because a healthy peer may legitimately
not take part for minutes (a checkpoint save on rank 0, an evaluation). So liveness is told apart from
progress: every rank runs a daemon thread that bumps a counter in the job's c10d store (the TCPStore of
`init_process_group`, reached as a client at MASTER_ADDR:MASTER_PORT) every `liveness_timeout_s / 4`, and
watches the counter of the next rank in a ring. If that counter does not move for `liveness_timeout_s`, the
watcher records a `PeerError` and publishes it under one shared key that every rank checks on each beat, so all
ranks learn it within one beat. A collective that is waiting on the metadata group then raises that error
(`Liveness.failure`) instead of waiting on; a rank that is not waiting is not disturbed. A peer that is alive but
not iterating (paused, or stuck in the user's code) still beats: its peers wait up to `sync_timeout_s`.
Cost per rank and beat: two small store writes and two existence checks, O(1) whatever the world size.
Without MASTER_ADDR/MASTER_PORT (an init_method that names its own store) there is no heartbeat, and the
collectives are bounded by `sync_timeout_s` alone.

NOTE [ A frozen store host ]
The store lives in one process: torchrun's agent, or rank 0 itself when the ranks were started without the agent
(`env://` from a launcher of one's own, `mp.spawn`). When that process is frozen the heartbeat's own store calls
block (`check` ignores the client's timeout), so the beat thread can neither notice nor publish anything. The
waiting side therefore also watches the beat thread: `failure` reports a silent store once no beat completed for
`liveness_timeout_s` plus two beat intervals, naming the process that hosts it (rank 0 without torchrun's agent).
Every waiting rank sees this by itself, so nothing has to be published through the frozen store.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
import weakref
from datetime import timedelta

import torch.distributed as dist

logger = logging.getLogger(__name__)
_SERIAL = itertools.count()  # the n-th transport of this process: the same n on every rank (collective order)


class Liveness:
    """The heartbeat of one rank for one transport; `failure` is set once a peer is found silent."""

    def __init__(self, rank: int, world_size: int, timeout_s: float, attempt: str = "-") -> None:
        """`attempt`: a token every rank of this transport shares and no earlier run on the same store had (rank 0
        draws it, `GlooTransport` broadcasts it). Under torchrun's restarts the agent's store outlives an attempt,
        so keys of a failed attempt (`failed`, a rank's beat count) must not be read by the next: before, attempt
        1's first beat found attempt 0's `failed` key and raised `PeerError` on healthy ranks. (The restart count
        in the environment is not that token: each node's agent counts its own restarts.)"""
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self._failure: Exception | None = None
        self.prefix = f"odb/liveness/{attempt}/{next(_SERIAL)}"
        self._store = self._connect()
        self._stop = threading.Event()
        self.last_beat = time.monotonic()  # when the beat thread last completed a beat (NOTE [ A frozen store host ])
        self._watched = self._store is not None and world_size > 1
        self._thread: threading.Thread | None = None
        if self._watched:
            self._thread = threading.Thread(target=_beat, args=(weakref.ref(self), self._stop), name="odb-liveness",
                                            daemon=True)
            self._thread.start()

    @property
    def failure(self) -> Exception | None:
        """The first silence found: a peer's (by the beat thread) or the store's (by whoever asks)."""
        if self._failure is None and self._watched and not self._stop.is_set():
            stalled = time.monotonic() - self.last_beat
            if stalled > self.timeout_s + 2 * self.interval_s:
                self._failure = PeerSilent(f"the job's c10d store has not answered ODB's heartbeat for "
                                           f"{stalled:.0f}s: {_store_host()} is frozen, hung or unreachable")
        return self._failure

    @failure.setter
    def failure(self, value: Exception) -> None:
        self._failure = value

    def _connect(self) -> dist.TCPStore | None:
        host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if not host or not port:
            return None
        try:
            return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=self.timeout_s),
                                 wait_for_workers=False)
        except Exception as exc:  # noqa: BLE001 - liveness is an extra; the collectives still time out
            logger.info("ODB liveness: no store at %s:%s (%s); dead peers are bounded by sync_timeout_s", host,
                        port, exc)
            return None

    @property
    def interval_s(self) -> float:
        return max(self.timeout_s / 4, 0.05)

    def stop(self, timeout_s: float) -> bool:
        """Stop the heartbeat and wait, at most `timeout_s`, until its thread ended (NOTE [ Threads at interpreter
        exit ] in sync.py): it wakes at once, or after its store call in flight. False if it is still running (a
        store call that hangs on a frozen store host)."""
        self._stop.set()
        thread = self._thread
        if thread is None or thread is threading.current_thread():
            return True
        thread.join(timeout_s)
        return not thread.is_alive()

    def beat_once(self, count: int, watched: dict[str, float]) -> None:
        """One beat: publish, check the shared failure key, watch the next rank's counter."""
        store = self._store
        store.set(f"{self.prefix}/beat/{self.rank}", str(count))
        if store.check([f"{self.prefix}/failed"]):
            self.failure = self.failure or PeerSilent(store.get(f"{self.prefix}/failed").decode())
            return
        peer = (self.rank + 1) % self.world_size
        key = f"{self.prefix}/beat/{peer}"
        seen = store.get(key).decode() if store.check([key]) else None
        now = time.monotonic()
        if seen != watched.get("value") or "since" not in watched:
            watched.update(value=seen, since=now)
        elif now - watched["since"] > self.timeout_s:
            message = (f"rank {peer} stopped answering ODB's heartbeat for {now - watched['since']:.0f}s (its process "
                       "is frozen, hung or unreachable)")
            store.set(f"{self.prefix}/failed", message)
            self.failure = PeerSilent(message)


class PeerSilent(RuntimeError):
    """A peer's heartbeat stopped (see NOTE [ Liveness ])."""


def _store_host() -> str:
    """Who runs the job's c10d store: torchrun's agent (it sets TORCHELASTIC_RUN_ID), else rank 0's own process."""
    where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        return f"the torchrun agent that hosts it ({where})"
    return f"rank 0, which hosts it ({where}, a launch without torchrun's agent),"


def _beat(ref: weakref.ref[Liveness], stop: threading.Event) -> None:
    watched: dict[str, float] = {}
    for count in itertools.count():
        liveness = ref()
        if liveness is None or stop.is_set() or liveness.failure is not None:
            return
        try:
            liveness.beat_once(count, watched)
            liveness.last_beat = time.monotonic()
        except Exception as exc:  # noqa: BLE001 - the store's host (rank 0 or the launcher) is gone or frozen
            liveness.failure = PeerSilent(f"the job's c10d store stopped answering ({type(exc).__name__}: {exc}): "
                                          f"{_store_host()} died or is frozen")
            return
        interval = liveness.interval_s
        del liveness
        stop.wait(interval)  # `stop()` wakes it at once
