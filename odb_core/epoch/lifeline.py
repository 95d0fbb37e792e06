"""DataLoader workers die with their rank, tell their rank who they are, and leave its heap to it.

NOTE [ Workers die with their rank ]
A worker started by `fork` inherits every open socket of its rank, the Gloo group's included. If the rank dies
(SIGKILL, a crash) while a worker lives on, the peers' connections to the dead rank stay open and they wait for
the whole `sync_timeout_s` instead of failing at once; torch's own worker watchdog only looks every few seconds
and not while the worker is busy. So every ODB worker, whatever the start method, runs `Lifeline` first: on Linux
the kernel kills it when its parent dies (`PR_SET_PDEATHSIG`, for fork and spawn, whose parent is the rank), and
a daemon thread checks every `POLL_S` that the rank process itself is still running (forkserver workers are
children of the fork server, not of the rank) and exits the worker otherwise. The user's own `worker_init_fn`
runs after it. The opposite direction, a rank noticing that a worker died, is NOTE [ A rank watches its
workers ] in watch.py: `Lifeline` first sends the rank a `WorkerStarted` with the worker's pid. It also has a
chunk the worker's queue cannot send put back with its failing samples named, instead of lost (NOTE [ A chunk the
feeder cannot send ] in data/feeder.py).

NOTE [ A worker leaves its rank's objects to the rank ]
A forked worker starts with its rank's whole heap: the model's, the tokenizer's, torch's own objects (~360,000 on the
VLM benchmark). Python's cyclic collector visits every tracked object at each full collection, and a visit writes
the object's header, so in a forked worker each full collection costs time in proportion to the rank's heap and
copies every page it touches (copy-on-write). A worker's own garbage is what it made itself. So `Lifeline` first
moves every object the worker holds at its start into the collector's permanent generation (`gc.freeze()`: the
child's side of what Python's documentation advises before a `fork()`), where no collection of the worker visits it
again; the worker's own objects are collected as before, and reference counting frees inherited objects as before. A
cycle of inherited objects that becomes garbage in the worker is freed only when the worker ends. Measured on the VLM
rows (docs/benchmarks.md, "The rank's heap in its workers").
"""

from __future__ import annotations

import ctypes
import gc
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection

from odb_core.data.feeder import guard_feeder
from odb_core.data.worker_files import attach

POLL_S = 0.5
PR_SET_PDEATHSIG = 1


def rank_alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, dead but not yet reaped, counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def _watch(rank_pid: int) -> None:
    while rank_alive(rank_pid):
        time.sleep(POLL_S)
    os._exit(0)


@dataclass(frozen=True, slots=True)
class WorkerStarted:
    """A worker's report to its rank (one small pickle: a single atomic pipe write, no lock to die holding)."""

    generation: int  # which `iter()` of the DataLoader started the worker (`WorkerWatch.start`)
    worker_id: int
    pid: int


@dataclass(frozen=True, slots=True)
class Lifeline:
    """The `worker_init_fn` of ODB's workers (picklable for spawn/forkserver); see NOTE [ Workers die with their
    rank ] and NOTE [ A worker leaves its rank's objects to the rank ]. `user_init` is the user's own
    `worker_init_fn`, called afterwards; `reports`, the write end of the rank's `WorkerWatch` pipe, receives a
    `WorkerStarted` tagged `generation`; `files[worker_id]` is the worker's end of the socket its chunks' shared
    files go by (NOTE [ A worker's files travel as descriptors ])."""

    rank_pid: int
    user_init: Callable[[int], None] | None = None
    reports: Connection | None = None
    generation: int = 0
    files: tuple[socket.socket, ...] = ()  # the workers' ends of the rank's `FileInbox`, by worker id
    region_bytes: int = 0  # each worker's region (NOTE [ A worker's region ] in data/worker_region.py); 0: none

    def __call__(self, worker_id: int) -> None:
        gc.freeze()  # NOTE [ A worker leaves its rank's objects to the rank ]
        guard_feeder()  # NOTE [ A chunk the feeder cannot send ] in data/feeder.py
        if sys.platform.startswith("linux"):
            try:
                ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
            except (OSError, AttributeError):
                pass  # the watchdog below still applies
        if not rank_alive(self.rank_pid):
            os._exit(0)
        threading.Thread(target=_watch, args=(self.rank_pid,), name="odb-lifeline", daemon=True).start()
        if self.reports is not None:  # before any result: the rank knows a worker before it can read from it
            try:
                self.reports.send(WorkerStarted(self.generation, worker_id, os.getpid()))
                self.reports.close()  # this process's copy only
            except OSError:
                pass  # the rank closed its stream: nobody will read this worker's results either
        if self.files:  # NOTE [ A worker's files travel as descriptors ] in data/worker_files.py
            attach(self.files[worker_id], worker_id, self.region_bytes)
        if self.user_init is not None:
            self.user_init(worker_id)
