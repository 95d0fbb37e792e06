"""The rank's side of its workers' regions: each mapped once, a tensor per slot over it, spans given back.

See NOTE [ A worker's region ] in worker_region.py. A finalizer on the numpy view under each tensor gives its span
back: the rank gathers them per worker (`_Map`) and sends them on the chunks' socket once `FLUSH_AT` have gathered,
and to every worker after each chunk it reads. The rank keeps a descriptor of each region it maps, so that a moved
sample's tensor can go to a rank of the same host by a handle to the region (`region_handle`; NOTE [ Moving shared
tensors by handle ]).
"""

from __future__ import annotations

import array
import errno
import mmap
import os
import socket
import threading
import weakref
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from odb_core.data.worker_region import DTYPES, FLUSH_AT, MAX_SPANS, RegionSlot, offset_of


@dataclass(slots=True)
class _Map:
    """The rank's mapping of one worker's region, and the spans it gives back, not yet sent. The lock is
    reentrant: a finalizer may run on a thread that holds it, when an allocation there starts a collection. A
    process forked from the rank (an evaluation loader's workers) inherits the map and gives nothing back."""

    array: np.ndarray
    end: socket.socket
    lock: threading.RLock = field(default_factory=threading.RLock)
    freed: list[int] = field(default_factory=list)
    pid: int = field(default_factory=os.getpid)

    def give_back(self, span: int) -> None:
        """A finalizer's: `span` is free (on whichever thread dropped the last tensor over it)."""
        if os.getpid() != self.pid:
            return
        with self.lock:
            self.freed.append(span)
            if len(self.freed) < FLUSH_AT:
                return
        self.flush()

    def flush(self) -> None:
        """Send the spans given back to the worker; those the socket refuses for now wait for the next flush."""
        if os.getpid() != self.pid:
            return
        fresh: list[int] = []  # made before the swap: an allocation inside it could run a finalizer here
        with self.lock:
            batch, self.freed = self.freed, fresh
        sent = 0
        try:
            while sent < len(batch):
                self.end.send(array.array("q", batch[sent:sent + MAX_SPANS]).tobytes(), socket.MSG_DONTWAIT)
                sent += MAX_SPANS
        except OSError as exc:
            if exc.errno in _GONE:  # the pairs are closed: the worker takes its chunks torch's way now
                sent = len(batch)
        finally:  # full for now (or interrupted): kept for the next flush
            if sent < len(batch):
                with self.lock:
                    self.freed[:0] = batch[sent:]


_GONE = (errno.EBADF, errno.EPIPE, errno.ECONNREFUSED, errno.ENOTCONN, errno.ECONNRESET)


class RegionMaps:
    """The rank's mappings of its workers' regions (NOTE above), by worker; `ends` are the rank's sockets."""

    def __init__(self, ends: list[socket.socket]) -> None:
        self._ends = ends
        self._maps: dict[int, _Map] = {}
        self.mapped = 0  # regions mapped, tensors handed out, and spans of dropped chunks: what the tests look at
        self.tensors = 0
        self.returned = 0

    def declare(self, worker: int, fd: int, size: int) -> None:
        """Map `worker`'s region from `fd` (the caller closes `fd`; the mapping keeps its own, and the rank a copy
        of it while the mapping lives, for `region_handle`)."""
        whole = np.frombuffer(mmap.mmap(fd, size), dtype=np.uint8)
        own = os.dup(fd)
        base = whole.__array_interface__["data"][0]
        _MAPPED[base] = (size, own, os.fstat(own).st_ino)
        weakref.finalize(whole, _unmapped, base, own)  # every view of a span holds `whole`
        self._maps[worker] = _Map(whole, self._ends[worker])
        self.mapped += 1

    def tensor(self, slot: RegionSlot) -> torch.Tensor:
        """The tensor a `RegionSlot` stands for, over the rank's mapping; its span is given back once the last
        tensor or storage over it is gone."""
        region = self._maps.get(slot.worker)
        if region is None:
            raise RuntimeError(f"DataLoader worker {slot.worker}'s sample names a region the rank never received "
                               "(NOTE [ A worker's region ] in odb_core/data/worker_region.py); please report it")
        offset = offset_of(slot.span)
        view = region.array[offset:offset + slot.nbytes]
        weakref.finalize(view, region.give_back, slot.span)
        self.tensors += 1
        return torch.from_numpy(view).view(DTYPES[slot.dtype]).view(slot.shape)

    def give_back(self, worker: int, spans: list[int]) -> None:
        """Spans of a chunk the rank will never read (the DataLoader dropped it)."""
        region = self._maps.get(worker)
        if region is not None:
            for span in spans:
                region.give_back(span)
            self.returned += len(spans)

    def flush(self) -> None:
        """Send every worker the spans given back since: a worker whose chunks name no slot any more (its region
        full, its tensors in files it shares by name) still gets them."""
        for region in list(self._maps.values()):
            if region.freed:
                region.flush()


_MAPPED: dict[int, tuple[int, int, int]] = {}  # this rank's mapped regions: base address -> (size, fd, inode)


def _unmapped(base: int, fd: int) -> None:
    _MAPPED.pop(base, None)
    os.close(fd)


class RegionHandle(NamedTuple):
    """Where a rank's tensor lies in a worker's region, for a move by handle (ranks/shared_handles.py)."""

    fd: int  # the rank's descriptor of the region
    inode: int
    nbytes: int  # the region's bytes up to the tensor's storage's end
    offset: int  # the tensor's offset in the region, in elements


def region_handle(tensor: torch.Tensor) -> RegionHandle | None:
    """Where `tensor` lies in a region this rank mapped (`RegionMaps`), or None (at once where it mapped none: the
    move lane asks for every tensor of a moved sample that is not a shared file)."""
    if not _MAPPED:
        return None
    storage = tensor.untyped_storage()
    address = storage.data_ptr()
    for base, (size, fd, inode) in _MAPPED.copy().items():  # a finalizer may pop from it meanwhile
        if base <= address < base + size:
            start = address - base  # a span's start, a multiple of `ALIGN`, unless a storage was cut elsewhere
            if start % tensor.element_size():
                return None
            return RegionHandle(fd, inode, start + storage.nbytes(), start // tensor.element_size()
                                + tensor.storage_offset())
    return None
