"""A worker's shared-memory files reach its rank as descriptors in one message per chunk.

NOTE [ A worker's files travel as descriptors ]
A sample's tensors over the pipe's limit leave a DataLoader worker in shared-memory files of their own (NOTE [ The
pipe or shared memory ] in sendable.py). Under torch's default sharing strategy (`file_descriptor`) the queue's
feeder registers each file's descriptor with the worker's `resource_sharer`, and the rank, unpickling the chunk,
fetches each one over a connection of its own: a socket connected, both sides authenticated (an HMAC challenge
each way), one descriptor passed, the connection closed. A plain DataLoader pays that once per batch, ODB once per
sample, and on a host whose cores the workers share, it comes out of their reading (docs/design.md, issue 27,
item 9). `python -m benchmarks.worker_files` (2 MiB tensors): the rank's CPU per tensor 0.59-0.71 ms -> 0.40-0.49
ms with what follows, the worker's 2.17-2.64 -> 2.00-2.23 ms. A file per tensor, and its mapping and page freeing
on the rank, remain, unless `worker_regions` is on (NOTE [ A worker's region ] in worker_region.py).

So each worker of an `iter()` gets one end of a Unix datagram socket pair (`FileInbox`, made by the rank's
`WorkerWatch.start` and handed over by `Lifeline`), and the workers' collate function (`keep_chunk`) sends the
descriptors of the chunk's top-level shared tensors in one message (`send_files`: `SCM_RIGHTS`, at most
`MAX_FILES`), numbered per worker; each tensor in the chunk becomes a `FileSlot` (message, worker, place in the
message, and how the tensor lies in its file), and two tensors of one storage share a slot, as torch's cache of
received storages makes them share one storage. The message is in the rank's socket before the chunk is even put
on the worker's queue, so the rank, reading the chunk (`read_chunk`, in the reader thread), finds it there without
waiting (`FileInbox.opened`): it maps each file (the storage keeps a descriptor of its own) and closes the message's
descriptors. A message older than the one asked for belongs to a chunk the DataLoader dropped (persistent workers
reset at an epoch's early end): its descriptors are closed. One missing, or newer than asked for, cannot happen
while the worker sends before it puts; it is an error naming the worker, not a wait. A reader thread left behind at
an epoch's end may still read beside the next epoch's: one at a time (a lock), and a reader that meets a message
newer than its own leaves it queued (it looks first, `MSG_PEEK`), so the one left behind fails alone. A rank out of
open files gets its descriptors cut short: an error naming `ulimit -n`.
What still goes torch's way: tensors not at the top level of a `dict` or `UserDict` sample (HF's `BatchFeature`),
tensor subclasses (a `Parameter`), tensors that require grad, lazily negated or conjugated views, tensors of a dtype
outside `DTYPES`, storages shared by name (`file_system`), the files of a chunk beyond `MAX_FILES`, and a chunk
whose message cannot be sent at once (never a wait: its tensors just stay in the chunk): the rank's end was shut
(its iterator was left: `FileInbox.close` shuts it for reading, since forked workers hold copies of it), the
worker's send buffer is full (a few hundred messages of dropped chunks unread: then until the pairs are closed,
since the rank reads a worker's socket only for chunks that name a message), or the kernel's limit on descriptors in
flight (per user, the sender's `ulimit -n`, over every rank of the host) is reached; the worker then logs a warning
once (once per worker process: with workers that are not persistent, once per epoch). The batches are the same: the
rank's tensor is the worker's file, with its dtype, shape, strides and offset (tests/test_worker_files.py). Cost:
two descriptors per worker on the rank (and up to two per worker in each forked worker) for the socket pairs; the
files of chunks the DataLoader dropped stay open in the rank's socket until that worker's next chunk with files is
read or the pairs are closed (a new `iter()` of non-persistent workers, or the loader's `close()`); a storage that
several chunks share is mapped once per chunk (torch's cache of received storages mapped it once).
With `worker_regions` (NOTE [ A worker's region ] in worker_region.py) a chunk's message also lists its samples'
region spans, and the first one that names the worker's region carries its descriptor (its place in the message is
in the message's head, `_HEAD`); a chunk with spans sends a message even without files, so the spans of a dropped
chunk come back when the rank skips its message. Where such a message cannot be sent, the chunk's region tensors
are copied out of the region and go torch's way.
"""

from __future__ import annotations

import array
import copy
import errno
import os
import socket
import struct
import threading
from collections import UserDict
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from odb_core.data.region_maps import RegionMaps
from odb_core.data.worker_region import (DTYPES, MAX_SPANS, RegionSlot, attach_region, copied_out, detach_region,
                                         plain_bytes, worker_region)
from odb_core.settings.console import LOGGER

MAX_FILES = 250  # descriptors in one message: the kernel passes at most 253 (SCM_MAX_FD)
_LEFT = (errno.EPIPE, errno.ECONNREFUSED, errno.ENOTCONN, errno.ECONNRESET)  # the rank's end shut or closed
_NUMBER = struct.Struct("<q")
_HEAD = struct.Struct("<qqqq")  # a chunk message's number, where the region's descriptor is in it (-1: not), its
# size, and whether the worker takes halves of lent spans back on a socket of its own (NOTE [ A worker's region ])



def shared_fd(tensor: torch.Tensor) -> int | None:
    """The descriptor of the shared-memory file under `tensor`'s storage, or None (not a shared file, shared by
    name, empty, or a tensor whose bits another process would read differently: a lazily negated or conjugated
    view). `_get_shared_fd` only reads: unlike `_share_fd_cpu_`, it never moves a storage."""
    if tensor.layout is not torch.strided or tensor.is_nested:
        return None  # sparse and nested tensors have no storage of their own
    storage = tensor.untyped_storage()
    if not storage.is_shared() or not storage.nbytes() or not plain_bytes(tensor):
        return None  # `is_shared` first, and before `_get_shared_fd`, which costs 8 µs to refuse a text tensor
    try:
        fd = storage._get_shared_fd()
    except RuntimeError:
        return None
    return fd if fd >= 0 else None


def tensor_in(storage: torch.UntypedStorage, dtype: str, offset: int, shape: tuple[int, ...],
              stride: tuple[int, ...]) -> torch.Tensor:
    """A tensor of `dtype` laid over `storage` as the sender's was."""
    return torch.empty(0, dtype=DTYPES[dtype]).set_(storage, offset, shape, stride)


class FileSlot(NamedTuple):
    """A worker's tensor left in its shared-memory file, whose descriptor travels in the worker's message
    `message`, at `slot`."""

    message: int
    worker: int
    slot: int
    nbytes: int  # the storage's
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


@dataclass(slots=True)
class _Sender:
    end: socket.socket
    worker: int
    number: int = 0  # the next message's
    warned: bool = False


_SENDER: _Sender | None = None  # this worker process's, once `attach`ed


def attach(end: socket.socket, worker: int, region_bytes: int = 0) -> None:
    """In a worker process (`Lifeline`): send this worker's chunks' files on `end`, and with `region_bytes` place
    their large tensors in a region of that size (NOTE [ A worker's region ] in worker_region.py)."""
    global _SENDER
    _SENDER = _Sender(end, worker)
    attach_region(end, worker, region_bytes)


def send_files(pairs: list[tuple[int, Any]]) -> list[tuple[int, Any]]:
    """In a worker: the tagged samples of a chunk with each top-level shared tensor a `FileSlot`, once their
    descriptors are sent; `pairs` itself where there is nothing to send, or the message could not be sent."""
    sender = _SENDER
    if sender is None:
        return pairs
    fds: list[int] = []
    slots: dict[int, int] = {}  # a storage's address: its slot
    spans: list[int] = []  # the chunk's region spans (NOTE [ A worker's region ] in worker_region.py)
    over: list[int] = []  # spans past `MAX_SPANS`, copied out: given back once the chunk is sent
    out: list[tuple[int, Any]] = []
    for index, sample in pairs:
        if isinstance(sample, dict | UserDict):  # HF's `BatchFeature` is a `UserDict`
            sample = _slotted(sample, sender, fds, slots, (spans, over))
        out.append((index, sample))
    if not fds and not spans:
        return pairs
    region = worker_region() if spans else None
    declare = region is not None and not region.declared
    if declare:
        fds.append(region.fd)
    head = _HEAD.pack(sender.number, len(fds) - 1 if declare else -1, region.size if declare else 0,
                      int(declare and region.takes_halves))
    try:
        sender.end.sendmsg([head + array.array("q", spans).tobytes()], [_rights(fds)] if fds else [],
                           socket.MSG_DONTWAIT)
    except OSError as exc:  # torch's way for this chunk: the files go with its pickle
        if exc.errno in _LEFT and region is not None:
            detach_region()  # the rank has left: no later tensor goes through the region
        if exc.errno not in _LEFT and not sender.warned:
            sender.warned = True
            LOGGER.warning("ODB: DataLoader worker %d sends a chunk's shared-memory files the slower way, one "
                           "connection per file (%s); later chunks may too (NOTE [ A worker's files travel as "
                           "descriptors ] in odb_core/data/worker_files.py)", sender.worker, exc)
        return pairs if region is None else [(index, copied_out(sample, region)) for index, sample in pairs]
    if declare:
        region.declared = True
    if over:
        region.release(over)  # type: ignore[union-attr]
    sender.number += 1
    return out


def _slotted(sample: dict | UserDict, sender: _Sender, fds: list[int], slots: dict[int, int],
             spans: tuple[list[int], list[int]]) -> dict | UserDict:
    """`sample` (a copy, if any tensor is replaced) with its top-level shared tensors as `FileSlot`s, and its
    `RegionSlot`s naming the message (their spans added to `spans[0]`; past `MAX_SPANS`, copied out: `spans[1]`)."""
    out = None
    for key, value in sample.items():
        if type(value) is RegionSlot:
            if out is None:
                out = dict(sample) if type(sample) is dict else copy.copy(sample)
            listed, over = spans
            if len(listed) == MAX_SPANS:  # torch's way; the region is there, as `placed` made it
                out[key] = worker_region().read(value)  # type: ignore[union-attr]
                over.append(value.span)
                continue
            listed.append(value.span)
            out[key] = value._replace(message=sender.number)
            continue
        if type(value) is not torch.Tensor or (fd := shared_fd(value)) is None:
            continue
        storage = value.untyped_storage()
        slot = slots.get(storage.data_ptr())
        if slot is None:
            if len(fds) == MAX_FILES:
                continue
            slot = slots[storage.data_ptr()] = len(fds)
            fds.append(fd)
        if out is None:
            out = dict(sample) if type(sample) is dict else copy.copy(sample)
        out[key] = FileSlot(sender.number, sender.worker, slot, storage.nbytes(), str(value.dtype),
                            tuple(value.shape), tuple(value.stride()), value.storage_offset())
    return sample if out is None else out


def _rights(fds: list[int]) -> tuple[int, int, array.array]:
    """The ancillary data that passes `fds` (`socket.send_fds`, which Python 3.11 gives no flags, would block)."""
    return socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds)


def _received(ancillary: list[tuple[int, int, bytes]]) -> list[int]:
    """The descriptors a `recvmsg` received (`socket.recv_fds`, which Python 3.11 gives no flags, would block)."""
    fds = array.array("i")
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    return list(fds)


@dataclass(slots=True)
class _Opening:
    """What `FileInbox.opened` has received for one chunk (a chunk comes from one worker)."""

    storages: dict[tuple[int, int], torch.UntypedStorage] = field(default_factory=dict)
    fds: list[int] = field(default_factory=list)
    worker: int = -1  # the chunk's worker, once its message is received


class FileInbox:
    """The rank's ends of one `iter()`'s worker socket pairs (NOTE above); `ends` are the workers'."""

    def __init__(self, workers: int) -> None:
        pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM) for _ in range(workers)]
        self._mine = [mine for mine, _ in pairs]
        self.ends = tuple(theirs for _, theirs in pairs)
        self._lock = threading.Lock()  # a reader thread left behind may still read beside the next epoch's
        self.files = 0  # files opened, and messages of dropped chunks skipped: what the tests look at
        self.skipped = 0
        self.regions = RegionMaps(self._mine)  # NOTE [ A worker's region ] in worker_region.py

    def opened(self, chunk: list[tuple[int, Any]]) -> list[tuple[int, Any]]:
        """`chunk`'s samples with every `FileSlot` the tensor it stands for, mapped from its file, and every
        `RegionSlot` a tensor over its worker's region (NOTE [ A worker's region ] in worker_region.py)."""
        opening = _Opening()
        try:
            out = [(index, self._open_sample(sample, opening)) for index, sample in chunk]
        finally:
            for fd in opening.fds:
                os.close(fd)
        self.regions.flush()  # the spans given back since: the workers reuse them
        return out

    def _open_sample(self, sample: Any, opening: _Opening) -> Any:
        if not isinstance(sample, dict | UserDict):
            return sample
        out = None
        for key, value in sample.items():
            kind = type(value)
            if kind is not FileSlot and kind is not RegionSlot:
                continue
            if out is None:
                out = dict(sample) if type(sample) is dict else copy.copy(sample)
            if opening.worker < 0:
                self._receive(value.worker, value.message, opening.fds)
                opening.worker = value.worker
            if kind is RegionSlot:
                out[key] = self.regions.tensor(value)
                continue
            storage = opening.storages.get((value.worker, value.slot))
            if storage is None:
                storage = opening.storages[(value.worker, value.slot)] = torch.UntypedStorage._new_shared_fd_cpu(
                    opening.fds[value.slot], value.nbytes)
                self.files += 1
            out[key] = tensor_in(storage, value.dtype, value.offset, value.shape, value.stride)
        return sample if out is None else out

    def _receive(self, worker: int, message: int, fds: list[int]) -> None:
        """The descriptors of `worker`'s message `message` into `fds` (the caller closes them), its region mapped
        if it declares one; the descriptors of older ones (dropped chunks) closed and their spans given back."""
        with self._lock:
            while True:
                number, truncated, spans = self._next_message(worker, message, fds)
                if number == message and not truncated:
                    return
                for fd in fds:
                    os.close(fd)
                fds.clear()
                if truncated:
                    raise OSError(errno.EMFILE, f"the rank could not take the descriptors of DataLoader worker "
                                  f"{worker}'s shared-memory files (message {number}): it has too many files open. "
                                  "Raise `ulimit -n`, or lower max_buffer_bytes or window")
                if number > message or number < 0:
                    raise RuntimeError(f"DataLoader worker {worker} sent shared-memory files in message {number} "
                                       f"where the rank expected message {message} (NOTE [ A worker's files "
                                       "travel as descriptors ] in odb_core/data/worker_files.py); please report it")
                self.regions.give_back(worker, spans)
                self.skipped += 1

    def _next_message(self, worker: int, message: int, fds: list[int]) -> tuple[int, bool, list[int]]:
        """(number, cut short, spans) of the next message in `worker`'s socket, its descriptors added to `fds` and
        the region it declares mapped; a message newer than `message` is only looked at, and left for the reader
        that asks for it."""
        end = self._mine[worker]
        try:
            data = end.recv(_NUMBER.size, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            number = _NUMBER.unpack(data)[0] if len(data) == _NUMBER.size else -1
            if number > message:
                return number, False, []
            data, ancillary, flags, _ = end.recvmsg(_HEAD.size + 8 * MAX_SPANS, socket.CMSG_LEN(4 * (MAX_FILES + 3)),
                                                    socket.MSG_DONTWAIT)
        except BlockingIOError:
            raise RuntimeError(f"DataLoader worker {worker}'s chunk names its shared-memory files' message {message}, "
                               "which is not in the rank's socket (NOTE [ A worker's files travel as descriptors ] "
                               "in odb_core/data/worker_files.py); please report it") from None
        received = _received(ancillary)
        fds.extend(received)
        if len(data) < _HEAD.size or flags & socket.MSG_CTRUNC:
            return number, bool(flags & socket.MSG_CTRUNC), []
        _, declared, size, lends = _HEAD.unpack_from(data)
        if declared >= len(received) or flags & socket.MSG_TRUNC:
            raise RuntimeError(f"DataLoader worker {worker}'s message {number} names a region descriptor it does not "
                               "carry, or was cut short (NOTE [ A worker's region ] in odb_core/data/worker_region.py);"
                               " please report it")
        if declared >= 0:
            self.regions.declare(worker, received[declared], size, bool(lends))
        spans = array.array("q", data[_HEAD.size: len(data) - (len(data) - _HEAD.size) % 8])
        return number, False, list(spans)

    def close(self) -> None:
        """Close every pair. A worker forked from this rank holds copies of the rank's ends, so each is shut for
        reading first (a worker's later send then fails, and its chunk goes torch's way) and drained (the files of
        messages still queued are let go now, not when every such worker has exited)."""
        with self._lock:  # not beside a reader's `recvmsg`, whose socket's number a new pair may take
            for end in self._mine:
                try:
                    end.shutdown(socket.SHUT_RD)
                    while True:
                        data, ancillary, _, _ = end.recvmsg(1, socket.CMSG_LEN(4 * (MAX_FILES + 3)),
                                                            socket.MSG_DONTWAIT)
                        for fd in _received(ancillary):
                            os.close(fd)
                        if not data and not ancillary:  # a shut socket that reads as ended (not Linux)
                            break
                except OSError:  # drained (BlockingIOError), or already closed
                    pass
            for end in (*self._mine, *self.ends):
                end.close()
