"""The rank's side of its workers' regions: each mapped once, a tensor per slot over it, spans given back.

See NOTE [ A worker's region ] in worker_region.py. A finalizer on the numpy view under each tensor gives its span
back: the rank gathers them per worker (`_Map`) and sends them on the chunks' socket once `FLUSH_AT` have gathered,
and to every worker after each chunk it reads. The rank keeps a descriptor of each region it maps, so that a moved
sample's tensor can go to a rank of the same host by a handle to the region (`region_handle`; NOTE [ Moving shared
tensors by handle ]). The receiver maps that region too (`borrowed`) and uses the span in place: the span was *lent*,
and the worker frees it once both ranks have given it back (`LENT`, NOTE [ A worker's region ]); the receiver sends
its half to the worker's own socket (`give_back_address`).
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

from odb_core.data.worker_region import DTYPES, FLUSH_AT, LENT, MAX_SPANS, RegionSlot, give_back_address, offset_of


@dataclass(eq=False)  # by identity; no slots: a weak reference to it is kept (`weakref_slot` needs 3.11)
class _Map:
    """A rank's mapping of one worker's region, and the spans it gives back, not yet sent. The lock is reentrant: a
    finalizer may run on a thread that holds it, when an allocation there starts a collection. A process forked
    from the rank (an evaluation loader's workers) inherits the map and gives nothing back. The owner's map sends on
    the chunks' socket (`end`) and knows its live spans by offset (`live`) and which it lent (`lent`); a map of a
    peer's worker's region (`borrowed`) sends to the worker's own socket (`address`), and only halves."""

    array: np.ndarray
    end: socket.socket
    address: bytes | None = None
    lock: threading.RLock = field(default_factory=threading.RLock)
    freed: list[int] = field(default_factory=list)
    live: dict[int, int] = field(default_factory=dict)
    lent: set[int] = field(default_factory=set)
    lends: bool = False  # whether the worker takes halves back on its own socket: its spans may move by handle
    pid: int = field(default_factory=os.getpid)

    def give_back(self, span: int) -> None:
        """A finalizer's: `span` is free here (on whichever thread dropped the last tensor over it)."""
        if os.getpid() != self.pid:
            return
        with self.lock:
            if self.live.get(offset_of(span)) == span:
                del self.live[offset_of(span)]
            if span in self.lent:  # a receiver holds it too: this is the owner's half
                self.lent.discard(span)
                span |= LENT
            self.freed.append(span)
            if self.address is not None:
                _DUE[id(self)] = self  # held until sent: the last view of a borrowed region may be going
            if len(self.freed) < FLUSH_AT:
                return
        self.flush()

    def lend(self, span: int) -> None:
        """`span` goes to another rank by handle, which uses it in place and gives its own half back."""
        with self.lock:
            self.lent.add(span)

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
                data = array.array("q", batch[sent:sent + MAX_SPANS]).tobytes()
                if self.address is None:
                    self.end.send(data, socket.MSG_DONTWAIT)
                else:
                    self.end.sendto(data, socket.MSG_DONTWAIT, self.address)
                sent += MAX_SPANS
        except OSError as exc:  # the pairs are closed (the worker takes its chunks torch's way), or it ended;
            if exc.errno in _GONE or (self.address is not None and exc.errno not in _LATER):  # or it never will
                sent = len(batch)
        finally:  # full for now (or interrupted): kept for the next flush
            with self.lock:
                if sent < len(batch):
                    self.freed[:0] = batch[sent:]
                if self.address is not None:  # held while any span waits (another thread may flush meanwhile)
                    if self.freed:
                        _DUE[id(self)] = self
                    else:
                        _DUE.pop(id(self), None)


_MIB = 1 << 20
_GONE = (errno.EBADF, errno.EPIPE, errno.ECONNREFUSED, errno.ENOTCONN, errno.ECONNRESET, errno.ENOENT)
_LATER = (errno.EAGAIN, errno.ENOBUFS, errno.EINTR, errno.ENOMEM)  # a half the worker's socket may take later


class RegionMaps:
    """The rank's mappings of its workers' regions (NOTE above), by worker; `ends` are the rank's sockets."""

    def __init__(self, ends: list[socket.socket]) -> None:
        self._ends = ends
        self._maps: dict[int, _Map] = {}
        self.mapped = 0  # regions mapped, tensors handed out, and spans of dropped chunks: what the tests look at
        self.tensors = 0
        self.returned = 0

    def declare(self, worker: int, fd: int, size: int, lends: bool = False) -> None:
        """Map `worker`'s region from `fd` (the caller closes `fd`; the mapping keeps its own, and the rank a copy
        of it while the mapping lives, for `region_handle`); `lends`: the worker bound its socket for halves, so
        its spans may move by handle."""
        whole = _mapped(fd, size, f"DataLoader worker {worker}'s region", "worker_regions=False")
        own = os.dup(fd)
        base = whole.__array_interface__["data"][0]
        inode = os.fstat(own).st_ino
        region = self._maps[worker] = _Map(whole, self._ends[worker], lends=lends)
        _MAPPED[base] = (size, own, inode, weakref.ref(region))
        weakref.finalize(whole, _unmapped, base, own)  # every view of a span holds `whole`
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
        with region.lock:
            region.live[offset] = slot.span
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
        flush_borrowed()


_MAPPED: dict[int, tuple[int, int, int, weakref.ref[_Map]]] = {}  # the rank's own: base -> (size, fd, inode, map)
_BORROWED: dict[tuple[int, int], weakref.ref[_Map]] = {}  # peers' workers' regions mapped here, by (device, inode)
_DUE: dict[int, _Map] = {}  # borrowed maps with spans not yet sent: held, so that none is lost with its map
_BORROWING = threading.RLock()
_SENDER: list[socket.socket] = []  # the one socket this process sends borrowed spans from, once made


def _unmapped(base: int, fd: int) -> None:
    _MAPPED.pop(base, None)
    os.close(fd)


class RegionHandle(NamedTuple):
    """Where a rank's tensor lies in a worker's region, for a move by handle (ranks/shared_handles.py)."""

    fd: int  # the rank's descriptor of the region
    inode: int
    nbytes: int  # the region's bytes up to the tensor's storage's end
    offset: int  # the tensor's offset in the region, in elements
    span: int  # the storage's span, tagged (NOTE [ A worker's region ])
    region: _Map

    def lend(self) -> None:
        """The span goes to a receiver that uses it in place: the owner gives only its half back."""
        self.region.lend(self.span)


def region_handle(tensor: torch.Tensor) -> RegionHandle | None:
    """Where `tensor` lies in a region this rank mapped (`RegionMaps`), or None (at once where it mapped none: the
    move lane asks for every tensor of a moved sample that is not a shared file)."""
    if not _MAPPED:
        return None
    storage = tensor.untyped_storage()
    address = storage.data_ptr()
    for base, (size, fd, inode, ref) in _MAPPED.copy().items():  # a finalizer may pop from it meanwhile
        if base <= address < base + size:
            start = address - base  # a span's start, a multiple of `ALIGN`, unless a storage was cut elsewhere
            region = ref()
            span = None if region is None or not region.lends else region.live.get(start)
            if start % tensor.element_size() or span is None or span in region.lent:
                return None  # a span already lent (two fields over one storage) goes in the frame
            return RegionHandle(fd, inode, start + storage.nbytes(), start // tensor.element_size()
                                + tensor.storage_offset(), span, region)
    return None


def borrowed(fd: int, seen: os.stat_result, span: int, nbytes: int) -> torch.UntypedStorage:
    """On a receiver: the storage of a span a peer lent (`RegionHandle.lend`), from the worker's region open at `fd`
    (whose `fstat` the caller took: `seen`; mapped once while any span of it is in use here) to the region's byte
    `nbytes`; when the last tensor over it is gone, its half goes back to the worker's socket."""
    key = (seen.st_dev, seen.st_ino)
    with _BORROWING:
        region = (ref := _BORROWED.get(key)) and ref()
        if region is None:
            if not _SENDER:
                _SENDER.append(socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC))
            whole = _mapped(fd, seen.st_size, "a peer rank's DataLoader worker's region (a sample moved by handle)",
                            "shared_memory_moves=False")
            region = _Map(whole, _SENDER[0], give_back_address(seen.st_ino))
            _BORROWED[key] = weakref.ref(region, lambda _, key=key: _forget(key))
    view = region.array[offset_of(span):nbytes]
    weakref.finalize(view, region.give_back, span | LENT)
    return torch.from_numpy(view).untyped_storage()


def _mapped(fd: int, size: int, what: str, setting: str) -> np.ndarray:
    """The `size` bytes of the region open at `fd`, mapped in this process; where that fails, an `OSError` with
    mmap's errno that names the region, its size, the cause and what to do, instead of mmap's bare one."""
    try:
        return np.frombuffer(mmap.mmap(fd, size), dtype=np.uint8)
    except OSError as exc:
        raise OSError(exc.errno, f"{what}, {size / _MIB:.1f} MiB, could not be mapped in this rank ({exc.strerror}). "
                      f"{_MAP_ADVICE.get(exc.errno, '')}Or set {setting} (NOTE [ A worker's region ] in "
                      "odb_core/data/worker_region.py)") from exc


_MAP_ADVICE = {  # mmap's failures a rank's limits explain (it dup()s the descriptor first: EMFILE, ENFILE)
    errno.ENOMEM: "A process's mappings are bounded by the sysctl vm.max_map_count and its address space by "
                  "`ulimit -v`: raise them. ",
    errno.EMFILE: "The rank has too many files open: raise `ulimit -n`. ",
    errno.ENFILE: "The system has too many files open: raise the sysctl fs.file-max. ",
}


def _forget(key: tuple[int, int]) -> None:
    with _BORROWING:
        if (ref := _BORROWED.get(key)) is not None and ref() is None:
            del _BORROWED[key]


def flush_borrowed() -> None:
    """Send the workers of peers the halves of lent spans given back here since."""
    for region in list(_DUE.values()):
        region.flush()
